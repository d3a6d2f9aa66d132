//! The coding of each plane (`.ckptz` version 2): the smallest of zstd at the chosen
//! level, zstd tuned to code literals, and the bytes stored as they are.
//!
//! A mantissa plane is noise: zstd cannot shrink it and would only add its block
//! headers and cost the reader a pass, so it is stored. The exponent plane of a trained
//! layer holds a few distinct values in no repeating order: its redundancy is the
//! skew of its byte distribution, which an order-0 entropy coder (Huffman, FSE) takes.
//! zstd's default match finder spends bits on short matches there: on ResNet-20's F32
//! exponent plane (273,754 bytes, order-0 entropy 90,617 bytes) zstd level 1 gives
//! 99,632 bytes, a static Huffman code of the whole plane 92,062. zstd with matches of
//! 7 bytes or more only and a 64-entry hash table codes nearly everything as Huffman
//! literals and still takes the long runs: 91,671 bytes, 1.2% over the entropy (ViT
//! BF16: 22,262 against 21,268; MLP F32: 55,548 against 54,239;
//! `scripts/compress_baseline.py --entropy`). That is the "entropy coder" offered per
//! plane: zstd's own Huffman literal coding, in a standard zstd frame, so readers need
//! nothing but zstd.

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
    /// Per thread: a zstd context tuned to code literals (see the module comment).
    static LITERALS: RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { RefCell::new(None) };
    /// Per thread: where a plane is compressed before it is known to be the smaller.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// zstd level 1 with matches of 7 bytes or more (the longest minimum zstd allows) found
/// through a 64-entry hash table: few matches, every other byte a Huffman literal.
fn literal_compressor() -> std::io::Result<zstd::bulk::Compressor<'static>> {
    use zstd::zstd_safe::CParameter;
    let mut c = zstd::bulk::Compressor::new(1)?;
    c.set_parameter(CParameter::MinMatch(7))?;
    c.set_parameter(CParameter::HashLog(6))?;
    Ok(c)
}

/// Appends `plane`, coded, to `out`: the smaller of zstd at `level` and zstd tuned to
/// code literals when one is smaller than the plane, else the plane as it is (a plane
/// zstd at `level` cannot shrink is noise: the literal coding is not tried).
/// Deterministic: the same bytes and level give the same output on every thread (one
/// single-threaded zstd context per call, each with fixed parameters).
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
    let coded = SCRATCH.with(|s| -> std::io::Result<bool> {
        let mut s = s.borrow_mut();
        let bound = zstd::zstd_safe::compress_bound(plane.len());
        s.clear();
        s.reserve(bound);
        let n = CCTX.with(|cell| -> std::io::Result<usize> {
            let mut cell = cell.borrow_mut();
            if cell.as_ref().is_none_or(|c| c.0 != level) {
                // No frame checksum: the chunk's CRC-32C covers the raw bytes of every
                // plane, whichever codec holds it.
                *cell = Some((level, zstd::bulk::Compressor::new(level)?));
            }
            match cell.as_mut() {
                Some((_, cctx)) => cctx.compress_to_buffer(plane, &mut *s),
                None => Ok(usize::MAX),
            }
        })?;
        if n >= plane.len() {
            return Ok(false);
        }
        let at = out.len();
        out.extend_from_slice(&s);
        s.clear();
        let m = LITERALS.with(|cell| -> std::io::Result<usize> {
            let mut cell = cell.borrow_mut();
            if cell.is_none() {
                *cell = Some(literal_compressor()?);
            }
            match cell.as_mut() {
                Some(cctx) => cctx.compress_to_buffer(plane, &mut *s),
                None => Ok(usize::MAX),
            }
        })?;
        if m < n {
            out.truncate(at);
            out.extend_from_slice(&s);
        }
        Ok(true)
    })?;
    Ok(if coded {
        PlaneCodec::Zstd
    } else {
        out.extend_from_slice(plane);
        PlaneCodec::Raw
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
        // The literal coding wins on a skewed plane with no long repeats.
        let mut x = 7u32;
        let skewed: Vec<u8> = (0..1 << 16)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let r = x >> 26;
                if r < 40 {
                    0x7C
                } else if r < 54 {
                    0x7B
                } else {
                    0x70 + (r % 16) as u8
                }
            })
            .collect();
        let plain = zstd::bulk::compress(&skewed, 1).unwrap().len();
        let mut out = Vec::new();
        assert_eq!(
            encode_plane(&skewed, 1, &mut out).unwrap(),
            PlaneCodec::Zstd
        );
        assert!(out.len() < plain, "{} against {plain}", out.len());
        let mut back = vec![0; skewed.len()];
        decode_plane(PlaneCodec::Zstd, &out, &mut back).unwrap();
        assert_eq!(back, skewed);
        let mut short = vec![0; 3];
        assert!(decode_plane(PlaneCodec::Raw, &[1, 2], &mut short).is_err());
        let e = decode_plane(PlaneCodec::Zstd, &[1, 2, 3], &mut short).unwrap_err();
        assert!(e.to_string().starts_with("zstd:"), "{e}");
        assert_eq!(PlaneCodec::parse("raw"), Some(PlaneCodec::Raw));
        assert_eq!(PlaneCodec::parse("huff"), None);
    }
}
