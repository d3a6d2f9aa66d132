//! The coding of each plane (`.ckptz` version 2): zstd, or the bytes stored as they
//! are, whichever is smaller.
//!
//! A mantissa plane is noise: zstd cannot shrink it and would only add its block
//! headers and cost the reader a pass, so it is stored. The exponent plane of a trained
//! layer holds a few distinct values; zstd codes its literals with Huffman (and finds
//! the runs of repeated exponents that an order-0 coder cannot), so no second entropy
//! coder is offered: on the planes we measured, zstd level 1 comes within a few tenths
//! of a percent of the plane's order-0 entropy, the bound of any Huffman or FSE coding
//! of it (`scripts/compress_baseline.py --entropy`, README).

use std::cell::RefCell;

/// How one plane is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PlaneCodec {
    /// The plane's bytes as they are.
    Raw,
    /// One zstd frame (RFC 8878) holding the plane, with its content size.
    Zstd,
}

impl PlaneCodec {
    /// The name in the header.
    pub(crate) fn name(self) -> &'static str {
        match self {
            PlaneCodec::Raw => "raw",
            PlaneCodec::Zstd => "zstd",
        }
    }

    /// The codec a header names.
    pub(crate) fn parse(name: &str) -> Option<PlaneCodec> {
        match name {
            "raw" => Some(PlaneCodec::Raw),
            "zstd" => Some(PlaneCodec::Zstd),
            _ => None,
        }
    }
}

thread_local! {
    /// Per thread: a zstd compression context and its level, reused from plane to plane.
    static CCTX: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { RefCell::new(None) };
    /// Per thread: a zstd decompression context.
    static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
    /// Per thread: where a plane is compressed before it is known to be the smaller.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Appends `plane`, coded, to `out`: zstd at `level` when its frame is smaller than the
/// plane, else the plane as it is. Deterministic: the same bytes and level give the
/// same output on every thread (one single-threaded zstd context per call).
///
/// # Errors
/// zstd's errors.
pub(crate) fn encode_plane(
    plane: &[u8],
    level: i32,
    out: &mut Vec<u8>,
) -> std::io::Result<PlaneCodec> {
    if plane.is_empty() {
        return Ok(PlaneCodec::Raw);
    }
    let zstd_len = CCTX.with(|cell| -> std::io::Result<Option<usize>> {
        let mut cell = cell.borrow_mut();
        if cell.as_ref().is_none_or(|c| c.0 != level) {
            // No frame checksum: the chunk's CRC-32C covers the raw bytes of every
            // plane, whichever codec holds it.
            *cell = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        let Some((_, cctx)) = cell.as_mut() else {
            return Ok(None);
        };
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.clear();
            s.reserve(zstd::zstd_safe::compress_bound(plane.len()));
            let n = cctx.compress_to_buffer(plane, &mut *s)?;
            if n < plane.len() {
                out.extend_from_slice(&s);
                Ok(Some(n))
            } else {
                Ok(None)
            }
        })
    })?;
    Ok(match zstd_len {
        Some(_) => PlaneCodec::Zstd,
        None => {
            out.extend_from_slice(plane);
            PlaneCodec::Raw
        }
    })
}

/// Decodes one plane stored as `codec` in `src` into `dst` (the plane's raw length).
///
/// # Errors
/// A raw plane of another length; zstd's errors; a frame that does not hold exactly
/// `dst.len()` bytes.
pub(crate) fn decode_plane(codec: PlaneCodec, src: &[u8], dst: &mut [u8]) -> std::io::Result<()> {
    match codec {
        PlaneCodec::Raw => {
            if src.len() != dst.len() {
                return Err(std::io::Error::other(format!(
                    "raw plane of {} bytes, {} expected",
                    src.len(),
                    dst.len()
                )));
            }
            dst.copy_from_slice(src);
            Ok(())
        }
        PlaneCodec::Zstd => DCTX.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.is_none() {
                *cell = Some(zstd::bulk::Decompressor::new()?);
            }
            let Some(dctx) = cell.as_mut() else {
                return Ok(());
            };
            let n = dctx
                .decompress_to_buffer(src, dst)
                .map_err(|e| std::io::Error::other(format!("zstd: {e}")))?;
            if n != dst.len() {
                return Err(std::io::Error::other(format!(
                    "zstd plane decompresses to {n} bytes, {} expected",
                    dst.len()
                )));
            }
            Ok(())
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_stored_and_repetition_compressed() {
        // A linear congruential sequence: no byte-level redundancy zstd can use.
        let mut x = 12345u32;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect();
        let exps: Vec<u8> = (0..4096).map(|i| [0x7E, 0x7F, 0x7D][i % 7 % 3]).collect();
        for (plane, want) in [(&noise, PlaneCodec::Raw), (&exps, PlaneCodec::Zstd)] {
            let mut out = vec![9];
            let codec = encode_plane(plane, 1, &mut out).unwrap();
            assert_eq!(codec, want);
            assert!(out.len() <= plane.len() + 1);
            let mut back = vec![0; plane.len()];
            decode_plane(codec, &out[1..], &mut back).unwrap();
            assert_eq!(&back, plane);
        }
        let mut short = vec![0; 3];
        assert!(decode_plane(PlaneCodec::Raw, &[1, 2], &mut short).is_err());
        let e = decode_plane(PlaneCodec::Zstd, &[1, 2, 3], &mut short).unwrap_err();
        assert!(e.to_string().starts_with("zstd:"), "{e}");
        assert_eq!(PlaneCodec::parse("raw"), Some(PlaneCodec::Raw));
        assert_eq!(PlaneCodec::parse("huff"), None);
    }
}
