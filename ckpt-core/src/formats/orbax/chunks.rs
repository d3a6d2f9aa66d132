//! The pieces of an Orbax item and how their bytes are decoded on read: each zarr
//! chunk (each inner chunk of a zarr v3 shard) is one piece, a box of its array,
//! decoded through the copy engine's [`Decoder`] interface in parts of [`PART_BYTES`],
//! so that memory stays bounded whatever the chunk's size (orbax writes chunks of up
//! to 2 GiB).
//!
//! A zstd frame cannot be entered in the middle, so a part is decoded by a stream of
//! the chunk's frame kept from the previous part ([`Decoding`]): the copy reads a
//! chunk's parts in order (it sorts its slabs by where their source bytes are), and a
//! part asked out of order restarts the frame and skips ahead. A chunk whose frame
//! must be started a second time is read in another order than its bytes' — MaxText's
//! scanned kernels (`[embed, layers, mlp]`) give each layer's Hugging Face tensor,
//! transposed, from bytes spread over the whole chunk, so every slab of the output
//! would decode the whole chunk again — and is decoded once, in full, into an unnamed
//! temporary file ([`Spilled`], in `TMPDIR`), which serves its reads from then on, each
//! by position and of the bytes asked only ([`Decoder::reads_at`]): one more decode and
//! a write to the page cache instead of one decode per slab, in the memory of a part. Chunks at the array's
//! edge (zarr pads them to the full chunk shape) are cut to the array as they are read;
//! a missing chunk is its fill value; stored big-endian elements are swapped.

use super::store::Loc;
use super::zarr::{item_size, swap_unit, Chain};
use crate::error::{Error, Result};
use crate::formats::checksum::Checksum;
use crate::formats::Decoder;
use crate::layout::Dtype;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Raw bytes decoded per part (the unit the read cache keeps; a multiple of every
/// element size).
pub(crate) const PART_BYTES: u64 = 4 << 20;

/// Streams of frames kept between parts, all pieces together (each holds zstd's
/// window, up to a few MiB).
const KEPT_STREAMS: usize = 32;

/// One array of the item.
#[derive(Debug)]
pub(crate) struct Array {
    /// Its parameter name.
    pub(crate) name: String,
    /// Element type.
    pub(crate) dtype: Dtype,
}

/// Where a piece's bytes come from.
#[derive(Debug)]
pub(crate) enum Source {
    /// A missing chunk: every element is this fill value (one element's bytes).
    Fill(Vec<u8>),
    /// A stored chunk, encoded by `chain`.
    Stored {
        /// Where its encoded bytes are (the CRC-32C included where the chain has one).
        loc: Loc,
        /// Its encoding.
        chain: Chain,
    },
}

/// One piece: a zarr chunk (or inner chunk) cut to its array.
#[derive(Debug)]
pub(crate) struct Piece {
    /// Index of its array.
    pub(crate) array: usize,
    /// Its zarr key, for messages.
    pub(crate) key: String,
    /// Its number in the array's chunk grid (C order), for messages.
    pub(crate) number: u64,
    /// Where its first element sits in the array.
    pub(crate) start: Vec<u64>,
    /// Its shape: the chunk's, cut to the array.
    pub(crate) shape: Vec<u64>,
    /// The shape of the chunk as stored (the full chunk shape).
    pub(crate) stored: Vec<u64>,
    /// Its bytes.
    pub(crate) source: Source,
    /// Raw bytes of the piece (its shape x the element size).
    pub(crate) len: u64,
    /// Raw bytes of the stored chunk (its stored shape x the element size).
    pub(crate) stored_len: u64,
    /// The CRC-32C check of its stored bytes, once made.
    pub(crate) crc: OnceLock<std::result::Result<(), String>>,
}

/// A chunk decoded in full into an unnamed temporary file, read by position.
#[derive(Debug)]
struct Spilled {
    file: std::fs::File,
}

/// What is known of how a chunk's frame has been read.
#[derive(Debug, Default)]
struct Starts {
    /// Frames started per piece (a second start spills it).
    count: std::collections::HashMap<usize, u32>,
    /// Pieces spilled, by number.
    spilled: std::collections::HashMap<usize, std::sync::Arc<Spilled>>,
}

/// A chunk's frame being decoded front to back, between two parts.
struct Decoding {
    piece: usize,
    /// Raw bytes of the stored chunk decoded so far.
    pos: u64,
    reader: Box<dyn Read + Send>,
}

/// The decoder of an Orbax item's pieces: piece `t` is stream `t`.
pub(crate) struct Chunks {
    /// The item directory (messages about inline values name it).
    pub(crate) dir: PathBuf,
    pub(crate) arrays: Vec<Array>,
    pub(crate) pieces: Vec<Piece>,
    /// Frames left part-way, most recently used last.
    kept: Mutex<Vec<Decoding>>,
    /// Frames started, and the chunks decoded into temporary files.
    starts: Mutex<Starts>,
}

impl std::fmt::Debug for Chunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Chunks({} arrays, {} pieces)",
            self.arrays.len(),
            self.pieces.len()
        )
    }
}

impl Chunks {
    pub(crate) fn new(dir: PathBuf, arrays: Vec<Array>, pieces: Vec<Piece>) -> Chunks {
        Chunks {
            dir,
            arrays,
            pieces,
            kept: Mutex::new(Vec::new()),
            starts: Mutex::new(Starts::default()),
        }
    }

    /// The error naming piece `t`'s chunk and file.
    fn damaged(&self, t: usize, problem: impl std::fmt::Display) -> Error {
        let p = &self.pieces[t];
        let (path, at) = match &p.source {
            Source::Stored { loc, .. } => (
                loc.file()
                    .map_or_else(|| self.dir.join("manifest.ocdbt"), Path::to_path_buf),
                loc.shown(),
            ),
            Source::Fill(_) => (self.dir.clone(), "not stored".into()),
        };
        Error::CorruptChunk {
            path,
            tensor: self.arrays[p.array].name.clone(),
            chunk: p.number,
            problem: format!("zarr key `{}` ({at}): {problem}", p.key),
        }
    }

    /// Checks the CRC-32C the chain ends in, once per piece, reading the stored bytes
    /// as a stream.
    fn check_crc(&self, t: usize, loc: &Loc) -> Result<()> {
        let p = &self.pieces[t];
        let r = p.crc.get_or_init(|| {
            let body = loc.len() - 4;
            let mut reader = loc.reader().map_err(|e| e.to_string())?;
            let mut crc = 0u32;
            let mut left = body;
            let mut buf = vec![0u8; 1 << 16];
            while left > 0 {
                let n = (left as usize).min(buf.len());
                reader
                    .read_exact(&mut buf[..n])
                    .map_err(|e| format!("reading it: {e}"))?;
                crc = crc32c::crc32c_append(crc, &buf[..n]);
                left -= n as u64;
            }
            let mut want = [0u8; 4];
            reader
                .read_exact(&mut want)
                .map_err(|e| format!("reading its CRC-32C: {e}"))?;
            let want = u32::from_le_bytes(want);
            if crc != want {
                return Err(format!(
                    "its CRC-32C is {want:08x}, its bytes give {crc:08x}"
                ));
            }
            Ok(())
        });
        r.clone().map_err(|problem| self.damaged(t, problem))
    }

    /// Decodes raw bytes `range` of piece `t` into `out` (its length).
    fn decode_range(&self, t: usize, range: std::ops::Range<u64>, out: &mut [u8]) -> Result<()> {
        let p = &self.pieces[t];
        let dtype = self.arrays[p.array].dtype;
        let size = item_size(dtype);
        let (loc, chain) = match &p.source {
            Source::Fill(one) => {
                for (i, b) in out.iter_mut().enumerate() {
                    *b = one[((range.start + i as u64) % size) as usize];
                }
                return Ok(());
            }
            Source::Stored { loc, chain } => (loc, *chain),
        };
        if chain.crc32c {
            self.check_crc(t, loc)?;
        }
        let runs = runs(&p.shape, &p.stored, size, range.clone());
        if let Some(spilled) = self.spilled(t) {
            self.read_spilled(t, &spilled, &runs, out)?;
        } else if chain.zstd {
            self.decode_frame(t, loc, &runs, out)?;
        } else {
            for &(at, dst, n) in &runs {
                loc.read_at(at, &mut out[dst as usize..(dst + n) as usize])?;
            }
        }
        if chain.big_endian {
            let unit = swap_unit(dtype);
            for e in out.chunks_exact_mut(unit) {
                e.reverse();
            }
        }
        Ok(())
    }

    /// Decodes `runs` of piece `t`'s zstd frame (stored at `loc`) into `out`,
    /// continuing a stream kept from an earlier part where one is at or before them.
    fn decode_frame(
        &self,
        t: usize,
        loc: &Loc,
        runs: &[(u64, u64, u64)],
        out: &mut [u8],
    ) -> Result<()> {
        let p = &self.pieces[t];
        let Some(&(first, _, _)) = runs.first() else {
            return Ok(());
        };
        let taken = {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            let best = kept
                .iter()
                .enumerate()
                .filter(|(_, d)| d.piece == t && d.pos <= first)
                .max_by_key(|(_, d)| d.pos)
                .map(|(i, _)| i);
            best.map(|i| kept.remove(i))
        };
        let mut d = match taken {
            Some(d) => d,
            None if self.second_start(t) => {
                let spilled = self.spill(t, loc)?;
                return self.read_spilled(t, &spilled, runs, out);
            }
            None => {
                let frame = Loc::sub(loc, 0, loc.len() - if self.crc_of(t) { 4 } else { 0 });
                let reader = frame.reader()?;
                let dec = zstd::stream::read::Decoder::new(reader)
                    .map_err(|e| self.damaged(t, format!("zstd: {e}")))?;
                Decoding {
                    piece: t,
                    pos: 0,
                    reader: Box::new(dec),
                }
            }
        };
        let stored_len = p.stored_len;
        for &(at, dst, n) in runs {
            skip(&mut d.reader, at - d.pos).map_err(|e| self.short(t, e, stored_len))?;
            d.reader
                .read_exact(&mut out[dst as usize..(dst + n) as usize])
                .map_err(|e| self.short(t, e, stored_len))?;
            d.pos = at + n;
        }
        if d.pos == stored_len {
            // The end: the frame must end here too.
            let mut one = [0u8; 1];
            match d.reader.read(&mut one) {
                Ok(0) => {}
                Ok(_) => {
                    return Err(self.damaged(
                        t,
                        format!("decodes to more than the chunk's {stored_len} bytes"),
                    ))
                }
                Err(e) => return Err(self.damaged(t, format!("zstd: {e}"))),
            }
        } else {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            if kept.len() >= KEPT_STREAMS {
                kept.remove(0);
            }
            kept.push(d);
        }
        Ok(())
    }

    /// Whether piece `t`'s frame has been started before (and counts this start).
    fn second_start(&self, t: usize) -> bool {
        let mut starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        let n = starts.count.entry(t).or_insert(0);
        *n += 1;
        *n > 1
    }

    /// Piece `t`'s chunk in its temporary file, if it was spilled.
    fn spilled(&self, t: usize) -> Option<std::sync::Arc<Spilled>> {
        let starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        starts.spilled.get(&t).cloned()
    }

    /// Decodes piece `t`'s whole frame into an unnamed temporary file (once: a thread
    /// that asks meanwhile waits for it).
    fn spill(&self, t: usize, loc: &Loc) -> Result<std::sync::Arc<Spilled>> {
        let mut starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = starts.spilled.get(&t) {
            return Ok(s.clone());
        }
        let p = &self.pieces[t];
        let frame = Loc::sub(loc, 0, loc.len() - if self.crc_of(t) { 4 } else { 0 });
        let mut dec = zstd::stream::read::Decoder::new(frame.reader()?)
            .map_err(|e| self.damaged(t, format!("zstd: {e}")))?;
        let scratch = std::env::temp_dir();
        let io = |e: std::io::Error| Error::Io {
            path: scratch.clone(),
            source: e,
        };
        let file = tempfile::tempfile().map_err(io)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
        // The frame decodes to exactly the chunk's bytes: fewer or more is damage.
        let n = std::io::copy(&mut (&mut dec).take(p.stored_len), &mut w)
            .map_err(|e| self.short(t, e, p.stored_len))?;
        if n < p.stored_len {
            return Err(self.damaged(
                t,
                format!("decodes to fewer bytes than the chunk's {}", p.stored_len),
            ));
        }
        let mut one = [0u8; 1];
        match dec.read(&mut one) {
            Ok(0) => {}
            Ok(_) => {
                return Err(self.damaged(
                    t,
                    format!("decodes to more than the chunk's {} bytes", p.stored_len),
                ))
            }
            Err(e) => return Err(self.damaged(t, format!("zstd: {e}"))),
        }
        std::io::Write::flush(&mut w).map_err(io)?;
        drop(w);
        let spilled = std::sync::Arc::new(Spilled { file });
        starts.spilled.insert(t, spilled.clone());
        Ok(spilled)
    }

    /// Reads `runs` of piece `t`'s spilled chunk into `out`.
    fn read_spilled(
        &self,
        t: usize,
        spilled: &Spilled,
        runs: &[(u64, u64, u64)],
        out: &mut [u8],
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        for &(at, dst, n) in runs {
            spilled
                .file
                .read_exact_at(&mut out[dst as usize..(dst + n) as usize], at)
                .map_err(|e| self.damaged(t, format!("reading its decoded copy back: {e}")))?;
        }
        Ok(())
    }

    fn crc_of(&self, t: usize) -> bool {
        matches!(&self.pieces[t].source, Source::Stored { chain, .. } if chain.crc32c)
    }

    /// The error of a frame that ended early or failed to decode.
    fn short(&self, t: usize, e: std::io::Error, stored_len: u64) -> Error {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            self.damaged(
                t,
                format!("decodes to fewer bytes than the chunk's {stored_len}"),
            )
        } else {
            self.damaged(t, format!("zstd: {e}"))
        }
    }
}

/// Reads and drops `n` bytes.
fn skip(r: &mut dyn Read, n: u64) -> std::io::Result<()> {
    let got = std::io::copy(&mut r.take(n), &mut std::io::sink())?;
    if got < n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Where raw bytes `range` of a piece of `shape`, cut from a stored chunk of shape
/// `stored` (elements of `size` bytes, the piece at the chunk's origin), lie in the
/// chunk's raw bytes: `(offset in the chunk, offset in the range, length)`, in order,
/// each within one row of the piece. `range` starts and ends on element boundaries.
///
/// A piece of shape `[2, 3]` cut from a stored `[4, 4]` chunk of 1-byte elements:
/// bytes `1..5` are `(1, 0, 2)` (row 0, columns 1..3) and `(4, 2, 2)` (row 1, columns
/// 0..2).
pub(crate) fn runs(
    shape: &[u64],
    stored: &[u64],
    size: u64,
    range: std::ops::Range<u64>,
) -> Vec<(u64, u64, u64)> {
    if range.is_empty() {
        return vec![];
    }
    if shape == stored {
        return vec![(range.start, 0, range.end - range.start)];
    }
    // Not the whole chunk: at least one dimension.
    let last = shape.len() - 1;
    let row = shape[last];
    let mut out = Vec::new();
    let mut p = range.start;
    let mut idx = vec![0u64; last];
    while p < range.end {
        let elem = p / size;
        let (mut r, col) = (elem / row, elem % row);
        for d in (0..last).rev() {
            idx[d] = r % shape[d];
            r /= shape[d];
        }
        let srow = idx
            .iter()
            .zip(&stored[..last])
            .fold(0u64, |a, (&i, &s)| a * s + i);
        let at = (srow * stored[last] + col) * size;
        let n = (range.end - p).min((row - col) * size);
        out.push((at, p - range.start, n));
        p += n;
    }
    out
}

impl Decoder for Chunks {
    fn locate(&self, t: usize, range: std::ops::Range<u64>) -> (usize, std::ops::Range<u64>) {
        (t, range)
    }

    fn chunk_size(&self, _s: usize) -> u64 {
        PART_BYTES
    }

    fn decode(
        &self,
        _path: &Path,
        _name: &str,
        s: usize,
        k: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let len = self.pieces[s].len;
        let start = (k as u64).saturating_mul(PART_BYTES).min(len);
        let end = start.saturating_add(PART_BYTES).min(len);
        out.clear();
        out.resize((end - start) as usize, 0);
        self.decode_range(s, start..end, out)
    }

    fn checksum(&self, path: &Path, name: &str, t: usize) -> Result<Checksum> {
        let len = self.pieces[t].len;
        let mut crc = 0u32;
        let mut buf = Vec::new();
        for k in 0..len.div_ceil(PART_BYTES) {
            self.decode(path, name, t, k as usize, &mut buf)?;
            crc = crc32c::crc32c_append(crc, &buf);
        }
        Ok(Checksum(crc))
    }

    fn decoded_checksum(&self, _t: usize) -> Option<Checksum> {
        None
    }

    fn reads_at(&self, s: usize) -> bool {
        self.spilled(s).is_some()
    }

    fn read_at(
        &self,
        _name: &str,
        s: usize,
        range: std::ops::Range<u64>,
        out: &mut [u8],
    ) -> Result<()> {
        self.decode_range(s, range, out)
    }

    fn stored_len(&self, t: usize) -> u64 {
        match &self.pieces[t].source {
            Source::Fill(_) => 0,
            Source::Stored { loc, .. } => loc.len(),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_a_piece_cut_from_its_chunk() {
        // The doc's example.
        assert_eq!(runs(&[2, 3], &[4, 4], 1, 1..5), vec![(1, 0, 2), (4, 2, 2)]);
        // Whole chunk: one run.
        assert_eq!(runs(&[4, 4], &[4, 4], 2, 8..32), vec![(8, 0, 24)]);
        // 3-d, 2-byte elements: rows of 2 elements from rows of 3.
        assert_eq!(
            runs(&[2, 1, 2], &[2, 2, 3], 2, 0..8),
            vec![(0, 0, 4), (12, 4, 4)]
        );
        // 0-d.
        assert_eq!(runs(&[], &[], 4, 0..4), vec![(0, 0, 4)]);
        assert!(runs(&[2], &[4], 4, 4..4).is_empty());
    }

    fn piece(source: Source, shape: &[u64], stored: &[u64], dtype: Dtype) -> Chunks {
        let size = item_size(dtype);
        Chunks::new(
            PathBuf::from("item"),
            vec![Array {
                name: "w".into(),
                dtype,
            }],
            vec![Piece {
                array: 0,
                key: "w/0.0".into(),
                number: 0,
                start: vec![0; shape.len()],
                shape: shape.to_vec(),
                stored: stored.to_vec(),
                source,
                len: shape.iter().product::<u64>() * size,
                stored_len: stored.iter().product::<u64>() * size,
                crc: OnceLock::new(),
            }],
        )
    }

    fn inline(bytes: Vec<u8>) -> Loc {
        Loc::Inline {
            len: bytes.len() as u64,
            bytes: bytes.into(),
            start: 0,
        }
    }

    #[test]
    fn zstd_chunks_are_cut_swapped_and_checked() {
        // A [3, 4] chunk of big-endian u16 0..12, the piece its [2, 3] corner.
        let raw: Vec<u8> = (0u16..12).flat_map(u16::to_be_bytes).collect();
        let frame = zstd::encode_all(&raw[..], 1).unwrap();
        let chain = Chain {
            big_endian: true,
            zstd: true,
            crc32c: false,
        };
        let c = piece(
            Source::Stored {
                loc: inline(frame.clone()),
                chain,
            },
            &[2, 3],
            &[3, 4],
            Dtype::U16,
        );
        let mut out = Vec::new();
        c.decode(Path::new("x"), "w", 0, 0, &mut out).unwrap();
        let want: Vec<u8> = [0u16, 1, 2, 4, 5, 6]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(out, want);
        // With a CRC-32C after the frame: checked.
        let mut with_crc = frame.clone();
        with_crc.extend(crc32c::crc32c(&frame).to_le_bytes());
        let chain = Chain {
            crc32c: true,
            ..chain
        };
        let ok = piece(
            Source::Stored {
                loc: inline(with_crc.clone()),
                chain,
            },
            &[3, 4],
            &[3, 4],
            Dtype::U16,
        );
        ok.decode(Path::new("x"), "w", 0, 0, &mut out).unwrap();
        assert_eq!(out.len(), 24);
        let n = with_crc.len();
        with_crc[n - 1] ^= 1;
        let bad = piece(
            Source::Stored {
                loc: inline(with_crc),
                chain,
            },
            &[3, 4],
            &[3, 4],
            Dtype::U16,
        );
        let e = bad.decode(Path::new("x"), "w", 0, 0, &mut out).unwrap_err();
        assert!(e.to_string().contains("CRC-32C"), "{e}");
        // A frame of other bytes than the chunk holds: named.
        let short = zstd::encode_all(&raw[..20], 1).unwrap();
        let c = piece(
            Source::Stored {
                loc: inline(short),
                chain: Chain {
                    crc32c: false,
                    ..chain
                },
            },
            &[3, 4],
            &[3, 4],
            Dtype::U16,
        );
        let e = c.decode(Path::new("x"), "w", 0, 0, &mut out).unwrap_err();
        assert!(
            e.to_string().contains("fewer bytes") && e.to_string().contains("w/0.0"),
            "{e}"
        );
    }

    /// A 1-D chunk of `n` u32 elements stored as one zstd frame of `raw`.
    fn zstd_piece(raw: &[u8], n: u64, big_endian: bool) -> Chunks {
        piece(
            Source::Stored {
                loc: inline(zstd::encode_all(raw, 1).unwrap()),
                chain: Chain {
                    big_endian,
                    zstd: true,
                    crc32c: false,
                },
            },
            &[n],
            &[n],
            Dtype::U32,
        )
    }

    #[test]
    fn parts_of_a_large_chunk_continue_one_stream() {
        // 3 parts and a bit of 4-byte elements.
        let n = (3 * PART_BYTES + 4096) / 4;
        let raw: Vec<u8> = (0..n as u32).flat_map(u32::to_le_bytes).collect();
        let c = zstd_piece(&raw, n, false);
        let mut out = Vec::new();
        let part = |c: &Chunks, k: usize, out: &mut Vec<u8>| {
            c.decode(Path::new("x"), "w", 0, k, out).unwrap();
            let lo = k * PART_BYTES as usize;
            assert_eq!(
                out[..],
                raw[lo..(lo + PART_BYTES as usize).min(raw.len())],
                "part {k}"
            );
        };
        // In order: one stream, continued part after part (the last part checks the
        // end of the frame, and the stream that reached it is dropped).
        for k in 0..4 {
            part(&c, k, &mut out);
        }
        assert!(c.kept.lock().unwrap().is_empty());
        assert!(!c.reads_at(0), "read in order, nothing is spilled");
        let sum = c.checksum(Path::new("x"), "w", 0).unwrap();
        assert_eq!(sum, Checksum::of(&raw));
    }

    #[test]
    fn a_chunk_read_out_of_order_is_decoded_once_into_a_file() {
        let n = (3 * PART_BYTES + 4096) / 4;
        let raw: Vec<u8> = (0..n as u32).flat_map(u32::to_be_bytes).collect();
        let c = zstd_piece(&raw, n, true);
        let want: Vec<u8> = (0..n as u32).flat_map(u32::to_le_bytes).collect();
        let mut out = Vec::new();
        // Part 2 first (a stream skips to it), then part 0: the frame would start a
        // second time, so it is decoded whole into a file, which serves every read
        // after, by position (swapped to little-endian like the stream's).
        for k in [2usize, 0, 3, 1] {
            c.decode(Path::new("x"), "w", 0, k, &mut out).unwrap();
            let lo = k * PART_BYTES as usize;
            assert_eq!(
                out[..],
                want[lo..(lo + PART_BYTES as usize).min(want.len())],
                "part {k}"
            );
            assert_eq!(c.reads_at(0), k != 2, "spilled after part {k}");
        }
        // Any run of whole elements, by position.
        let mut some = vec![0u8; 12];
        c.read_at("w", 0, 4_000_000..4_000_012, &mut some).unwrap();
        assert_eq!(some[..], want[4_000_000..4_000_012]);
        assert_eq!(
            c.checksum(Path::new("x"), "w", 0).unwrap(),
            Checksum::of(&want)
        );
        // A frame that decodes short is named when spilled, as when streamed.
        let c = zstd_piece(&raw[..raw.len() - 4], n, false);
        c.decode(Path::new("x"), "w", 0, 1, &mut out).unwrap();
        let e = c
            .decode(Path::new("x"), "w", 0, 0, &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("decodes to fewer bytes than the chunk's"), "{e}");
    }

    #[test]
    fn missing_chunks_are_their_fill_value() {
        let c = piece(
            Source::Fill(1.5f32.to_le_bytes().to_vec()),
            &[3],
            &[4],
            Dtype::F32,
        );
        let mut out = Vec::new();
        c.decode(Path::new("x"), "w", 0, 0, &mut out).unwrap();
        assert_eq!(
            out,
            [1.5f32; 3]
                .iter()
                .flat_map(|f| f.to_le_bytes())
                .collect::<Vec<u8>>()
        );
        assert_eq!(c.stored_len(0), 0);
    }
}
