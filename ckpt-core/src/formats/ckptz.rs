//! ckpt's compressed checkpoint files (`.ckptz`): safetensors' description of every
//! tensor, plus tables of independently compressed chunks, so that any byte range can
//! be read by decompressing only the chunks that cover it.
//!
//! ckpt writes version 2 ([`v2`]: tensors of one dtype packed into shared chunks, each
//! chunk split into byte planes with the exponent alone in one, each plane zstd or
//! stored) and reads versions 1 and 2; a later version is [`Error::CkptzVersion`].
//! This file reads both (their chunks are described by one type, [`Body`]) and holds
//! version 1's layout:
//!
//! ```text
//! [8 bytes]  magic "CKPTZ\0\x01\0" (format version 1)
//! [8 bytes]  N: header length, u64 little-endian
//! [N bytes]  header: UTF-8 JSON object, padded with spaces
//! [rest]     data area: zstd frames, one per chunk, back to back in any order
//! ```
//!
//! Each header entry is a safetensors entry (`dtype`, `shape`, `data_offsets` into the
//! *uncompressed* data area, so decompressing gives back the safetensors file) plus
//! `codec` (`"zstd"`), `group` (1, or the element size in bytes: the chunk's bytes are
//! byte-grouped before compression), `chunk_size` (raw bytes per chunk, the last one
//! shorter) and `chunks` (`[start, end)` of each frame in the data area, in chunk
//! order). `docs/formats.md` specifies it for other programs.
//!
//! Byte grouping is what makes floats compressible: the high byte of a BF16 (sign and
//! exponent) varies little between neighbours, the low byte (mantissa) is noise; zstd
//! finds the redundancy of the first stream only once they are apart.

pub(crate) mod chunks;
mod entropy;
mod pack;
mod planes;
pub(crate) mod v2;

pub use v2::{CkptzWriter, CodedChunk, MAGIC_V2 as MAGIC};

use chunks::{bad, unit_bytes, Body, ChunkLoc, MAX_CHUNK_BYTES, MAX_HEADER_LEN};
#[cfg(test)]
use chunks::{chunk_size_for, PartialChunks};
pub use chunks::{Compression, DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL};
use pack::Streams;
use planes::PlaneSplit;

#[cfg(test)]
use super::byte_len;
use super::safetensors::{entry_fields, parse_description, split_header};
#[cfg(test)]
use super::safetensors::{with_checksums, TensorSpec};
use super::{bad_tensor, Decoder, FileFormat, Mapped, TensorEntry, TensorFile};
use crate::error::{overflow, Error, IoContext, Result};
#[cfg(test)]
use crate::formats::checksum::checksums_enabled;
use crate::formats::checksum::{decode_checksums, Checksum, CHECKSUMS_KEY};
#[cfg(test)]
use crate::formats::output::StagedFile;
use crate::layout::strategy::dtype_name;
use crate::layout::Dtype;
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
use std::sync::Mutex;

/// The first 8 bytes of a version 1 `.ckptz` file: `CKPTZ`, NUL, the format version
/// (1), NUL. Read as a safetensors header length it is about 2.8e14, far over every
/// safetensors reader's limit, so no safetensors reader mistakes a `.ckptz` file for
/// its own. Version 2's ([`MAGIC`]) differs in the version byte only.
pub const MAGIC_V1: [u8; 8] = *b"CKPTZ\0\x01\0";

/// The versions this build reads.
pub(crate) const READ_VERSIONS: [u8; 2] = [1, 2];

/// The file extension of compressed files.
pub const EXTENSION: &str = "ckptz";

/// Whether the first bytes are a `.ckptz` file's.
pub(crate) fn looks_like(head: &[u8]) -> bool {
    // Any version: a later one is then a named error, not "unknown format".
    head.starts_with(b"CKPTZ\0")
}

/// The byte streams a dtype is split into: the element size for the floating-point
/// types wider than a byte (their bytes differ in kind: sign and exponent against
/// mantissa), 1 (no grouping) for integers, bools and 8-bit or sub-byte floats.
#[must_use]
pub fn group_of(dtype: Dtype) -> usize {
    match dtype {
        Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 => dtype.bitsize() / 8,
        _ => 1,
    }
}

/// Splits `src` (elements of `k` bytes) into `k` streams: all byte 0s, then all byte 1s...
pub fn group_bytes(src: &[u8], k: usize, dst: &mut [u8]) {
    match k {
        2 => group_2(src, dst),
        4 => group_4(src, dst),
        8 => group_k::<8>(src, dst),
        _ => dst.copy_from_slice(src),
    }
}

/// The inverse of [`group_bytes`].
pub fn ungroup_bytes(src: &[u8], k: usize, dst: &mut [u8]) {
    match k {
        2 => ungroup_2(src, dst),
        4 => ungroup_4(src, dst),
        8 => ungroup_k::<8>(src, dst),
        _ => dst.copy_from_slice(src),
    }
}

// The 2- and 4-byte cases (BF16, F16, F32: nearly every tensor) walk all streams in one
// pass of zipped iterators, which the compiler turns into byte shuffles: 3 to 10 times
// the speed of one pass per stream, so grouping costs little beside zstd.

fn group_2(src: &[u8], dst: &mut [u8]) {
    let (a, b) = dst.split_at_mut(src.len() / 2);
    for ((e, a), b) in src.as_chunks::<2>().0.iter().zip(a).zip(b) {
        let v = u16::from_le_bytes(*e);
        (*a, *b) = (v as u8, (v >> 8) as u8);
    }
}

fn ungroup_2(src: &[u8], dst: &mut [u8]) {
    let (a, b) = src.split_at(src.len() / 2);
    for ((e, a), b) in dst.as_chunks_mut::<2>().0.iter_mut().zip(a).zip(b) {
        *e = [*a, *b];
    }
}

fn group_4(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 4;
    let (a, rest) = dst.split_at_mut(n);
    let (b, rest) = rest.split_at_mut(n);
    let (c, d) = rest.split_at_mut(n);
    for ((((e, a), b), c), d) in src.as_chunks::<4>().0.iter().zip(a).zip(b).zip(c).zip(d) {
        let v = u32::from_le_bytes(*e);
        (*a, *b, *c, *d) = (v as u8, (v >> 8) as u8, (v >> 16) as u8, (v >> 24) as u8);
    }
}

fn ungroup_4(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 4;
    let (a, rest) = src.split_at(n);
    let (b, rest) = rest.split_at(n);
    let (c, d) = rest.split_at(n);
    for ((((e, a), b), c), d) in dst
        .as_chunks_mut::<4>()
        .0
        .iter_mut()
        .zip(a)
        .zip(b)
        .zip(c)
        .zip(d)
    {
        *e = [*a, *b, *c, *d];
    }
}

fn group_k<const K: usize>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / K;
    if n == 0 {
        return;
    }
    for (j, stream) in dst.chunks_exact_mut(n).enumerate() {
        for (d, e) in stream.iter_mut().zip(src.chunks_exact(K)) {
            *d = e[j];
        }
    }
}

fn ungroup_k<const K: usize>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / K;
    if n == 0 {
        return;
    }
    for (j, stream) in src.chunks_exact(n).enumerate() {
        for (e, s) in dst.chunks_exact_mut(K).zip(stream) {
            e[j] = *s;
        }
    }
}

/// Where the chunks of one tensor are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkTable {
    /// Byte streams per element (1: none).
    group: usize,
    /// Raw bytes per chunk (the last one may be shorter).
    chunk_size: u64,
    /// Raw bytes of the tensor.
    raw_len: u64,
    /// `[start, end)` of each compressed chunk, relative to the data area.
    chunks: Vec<[u64; 2]>,
}

/// The compressed side of a `.ckptz` file opened for reading: the file (read with
/// positional reads, not mapped, so resident memory does not grow with the file) and
/// its chunk tables.
#[derive(Debug)]
pub(crate) struct Chunked {
    file: File,
    data_start: u64,
    body: Body,
    /// Per tensor, per part (the tensor's bytes in one chunk): the CRC-32C of the part
    /// once decompressed (`1 << 32 | crc`; 0 before), so that a copy that reads a
    /// tensor whole has its recorded checksum checked without decompressing it again.
    crcs: Vec<Vec<AtomicU64>>,
    /// The header of the safetensors file this one was compressed from (version 2).
    source_header: Option<String>,
}

thread_local! {
    /// Per thread: a zstd decompression context and a buffer for grouped bytes, reused
    /// from chunk to chunk.
    static DECODER: RefCell<Option<(zstd::bulk::Decompressor<'static>, Vec<u8>)>> =
        const { RefCell::new(None) };
    /// Per thread: the buffer compressed chunks are read into.
    static COMPRESSED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Decompresses one chunk (a zstd frame) of `raw_len` bytes into `out`, ungrouping its
/// bytes when `group > 1`.
///
/// # Errors
/// zstd's errors (damaged frame, checksum mismatch), or a frame that does not hold
/// exactly `raw_len` bytes.
pub fn decompress_chunk(
    frame: &[u8],
    group: usize,
    raw_len: usize,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    DECODER.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            *cell = Some((zstd::bulk::Decompressor::new()?, Vec::new()));
        }
        let Some((dctx, grouped)) = cell.as_mut() else {
            return Ok(());
        };
        // Every byte is overwritten below: resizing a reused buffer zeroes only what
        // it grows by.
        out.resize(raw_len, 0);
        let target: &mut [u8] = if group > 1 {
            grouped.resize(raw_len, 0);
            grouped
        } else {
            out
        };
        let n = dctx
            .decompress_to_buffer(frame, target)
            .map_err(|e| std::io::Error::other(format!("zstd: {e}")))?;
        if n != raw_len {
            return Err(std::io::Error::other(format!(
                "decompresses to {n} bytes, {raw_len} expected"
            )));
        }
        if group > 1 {
            ungroup_bytes(grouped, group, out);
        }
        Ok(())
    })
}

impl Chunked {
    /// The stream and stream offset of tensor `t`.
    fn place(&self, t: usize) -> (usize, u64) {
        self.body.streams.place[t]
    }

    /// Number of chunks of stream `s`.
    #[cfg(test)]
    pub(crate) fn chunk_count(&self, s: usize) -> usize {
        self.body.chunks[s].len()
    }

    /// Compressed bytes of tensor `t`: its chunks' stored bytes, a chunk it shares with
    /// other tensors counted in proportion to the raw bytes it holds there.
    pub(crate) fn stored_len(&self, t: usize) -> u64 {
        let (s, _) = self.place(t);
        let st = &self.body.streams.streams[s];
        self.body
            .streams
            .parts(t)
            .map(|p| {
                let c = st.chunk_range(p.chunk);
                let stored = self.body.chunks[s][p.chunk].stored();
                let share = u128::from(stored.end - stored.start)
                    * u128::from(p.in_chunk.end - p.in_chunk.start)
                    / u128::from(c.end - c.start);
                share as u64
            })
            .sum()
    }

    /// Decompresses chunk `k` of stream `s` into `out` (resized to its raw length),
    /// recording the checksums of the tensors' parts in it. Damage is detected even
    /// when only part of a tensor is read: version 1 by zstd's frame checksum, version
    /// 2 by the chunk's CRC-32C. `name` is the tensor being read, for errors.
    pub(crate) fn decode(
        &self,
        path: &Path,
        name: &str,
        s: usize,
        k: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let loc = &self.body.chunks[s][k];
        let stored = loc.stored();
        let raw = self.body.streams.streams[s].chunk_range(k);
        let raw_len = (raw.end - raw.start) as usize;
        let damaged = |problem: String| Error::CorruptChunk {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            chunk: k as u64,
            problem,
        };
        let comp = COMPRESSED.with(|c| -> Result<Vec<u8>> {
            let mut buf = std::mem::take(&mut *c.borrow_mut());
            // In range: the header check keeps every chunk inside the file.
            buf.resize((stored.end - stored.start) as usize, 0);
            self.file
                .read_exact_at(&mut buf, self.data_start + stored.start)
                .map_err(|e| match e.kind() {
                    // The header was checked against the file's length when it was
                    // opened: only another program can have cut it since.
                    std::io::ErrorKind::UnexpectedEof => {
                        std::io::Error::new(e.kind(), "the file shrank while it was being read")
                    }
                    _ => e,
                })
                .at(path)?;
            Ok(buf)
        })?;
        let r = match loc {
            ChunkLoc::V1 { group, .. } => decompress_chunk(&comp, *group, raw_len, out),
            ChunkLoc::V2 { planes, crc, .. } => {
                let split = PlaneSplit::of(self.body.streams.streams[s].dtype);
                v2::decode_chunk(&comp, planes, split, raw_len, *crc, out)
            }
        }
        .map_err(|e| damaged(e.to_string()));
        COMPRESSED.with(|c| *c.borrow_mut() = comp);
        r?;
        // A version 2 chunk's CRC was just checked: a part that is the whole chunk (a
        // large tensor's) has it, with no second pass over the bytes.
        let whole = match loc {
            ChunkLoc::V2 { crc, .. } => Some(*crc),
            ChunkLoc::V1 { .. } => None,
        };
        for (t, j, r) in self.body.streams.in_chunk(s, k) {
            let sum = match whole {
                Some(c) if r.start == 0 && r.end == raw_len as u64 => c,
                _ => crc32c::crc32c(&out[r.start as usize..r.end as usize]),
            };
            self.crcs[t][j].store(1 << 32 | u64::from(sum), Ordering::Relaxed);
        }
        Ok(())
    }

    /// The CRC-32C of tensor `t`'s raw bytes from the chunks decompressed so far, when
    /// every one of them has been.
    pub(crate) fn decoded_checksum(&self, t: usize) -> Option<Checksum> {
        let mut parts = Vec::with_capacity(self.crcs[t].len());
        for (p, c) in self.body.streams.parts(t).zip(&self.crcs[t]) {
            let v = c.load(Ordering::Relaxed);
            if v == 0 {
                return None;
            }
            parts.push((Checksum(v as u32), p.in_tensor.end - p.in_tensor.start));
        }
        Some(Checksum::combine(parts))
    }

    /// The CRC-32C of tensor `t`'s uncompressed bytes, chunks decompressed in parallel.
    pub(crate) fn checksum(&self, path: &Path, name: &str, t: usize) -> Result<Checksum> {
        use rayon::prelude::*;
        let (s, _) = self.place(t);
        let parts: Vec<pack::Part> = self.body.streams.parts(t).collect();
        let sums = parts
            .into_par_iter()
            .map_init(Vec::new, |buf, p| {
                self.decode(path, name, s, p.chunk, buf)?;
                let r = p.in_chunk.start as usize..p.in_chunk.end as usize;
                Ok((Checksum(crc32c::crc32c(&buf[r.clone()])), r.len() as u64))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Checksum::combine(sums))
    }
}

/// Reads a `.ckptz` file: parses and checks its header from the mapping, then keeps the
/// file for positional reads and drops the mapping.
pub(crate) fn read(path: &Path, file: File, map: Option<Mapped>) -> Result<TensorFile> {
    let len = map.as_ref().map_or(0, |m| m.len() as u64);
    // The header only: the data area is never read through the mapping.
    let parsed = parse_header(map.as_deref().unwrap_or(&[]), len);
    if let Some(m) = &map {
        crate::fault::unregister_map(m.as_ptr() as usize);
    }
    drop(map);
    let Header {
        data_start,
        mut tensors,
        body,
        metadata,
        source_header,
    } = parsed.map_err(|e| e.with_path(path))?;
    let sums = match metadata.get(CHECKSUMS_KEY) {
        Some(text) => decode_checksums(text).map_err(|e| e.with_path(path))?,
        None => BTreeMap::new(),
    };
    // What the safetensors reader takes from `__metadata__` (PyTorch DCP's offsets of
    // each box), taken here too: a compressed file describes the same tensors.
    super::safetensors::apply_dcp_offsets(&mut tensors, &metadata)
        .map_err(|e| e.with_path(path))?;
    let crcs = (0..tensors.len())
        .map(|t| body.streams.parts(t).map(|_| AtomicU64::new(0)).collect())
        .collect();
    let chunked = Chunked {
        file,
        data_start,
        body,
        crcs,
        source_header,
    };
    let mut file = TensorFile::from_decoder(
        path,
        FileFormat::Ckptz,
        Box::new(chunked),
        tensors,
        metadata,
    );
    file.set_checksums(&sums).map_err(|e| e.with_path(path))?;
    Ok(file)
}

/// A parsed, checked `.ckptz` header.
#[derive(Debug)]
pub struct Header {
    /// Where the data area starts in the file.
    pub data_start: u64,
    /// The tensors, by uncompressed offset (`start`/`end` are `data_offsets`).
    pub tensors: Vec<TensorEntry>,
    body: Body,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// Version 2: the header of the safetensors file compressed, as it was.
    source_header: Option<String>,
}

/// Parses and validates a `.ckptz` header from the file's first bytes (at least the
/// header; more is ignored) and the file's length: magic, length, UTF-8, JSON, every
/// entry's dtype, shape, uncompressed offsets (contiguous from 0, as safetensors),
/// codec, grouping, chunk size and chunk table (one chunk per `chunk_size` raw bytes),
/// and the chunks of all tensors tiling the data area exactly.
///
/// # Errors
/// The first problem found, naming the tensor where there is one.
pub fn parse_header(bytes: &[u8], file_len: u64) -> Result<Header> {
    if file_len < 16 || bytes.len() < 16 {
        return Err(bad(format!(
            "file of {file_len} bytes is too short for the 16-byte preamble: truncated?"
        )));
    }
    if !looks_like(bytes) || bytes[7] != 0 {
        return Err(bad("the file does not start with the .ckptz magic"));
    }
    let version = bytes[6];
    if !READ_VERSIONS.contains(&version) {
        return Err(Error::CkptzVersion {
            version,
            supported: READ_VERSIONS.to_vec(),
        });
    }
    let n = u64::from_le_bytes(bytes[8..16].try_into().map_err(|_| bad("short"))?);
    if n > MAX_HEADER_LEN {
        return Err(Error::HeaderTooLarge {
            len: n,
            max: MAX_HEADER_LEN,
        });
    }
    // Version 1: the header follows the preamble, the data area follows it. Version 2:
    // the data area follows the preamble, the header (one zstd frame) ends the file.
    let (text, data_start, data_len) = if version == 1 {
        let data_start = n.checked_add(16).ok_or_else(|| overflow("header length"))?;
        if data_start > file_len || data_start > bytes.len() as u64 {
            return Err(bad(format!(
                "header of {n} bytes runs past the end of the file ({file_len} bytes): truncated?"
            )));
        }
        let text = std::borrow::Cow::Borrowed(&bytes[16..data_start as usize]);
        (text, data_start, file_len - data_start)
    } else {
        if n > file_len - 16 || bytes.len() as u64 != file_len {
            return Err(bad(format!(
                "header of {n} bytes does not fit in the file ({file_len} bytes after the 16-byte preamble): truncated?"
            )));
        }
        let at = (file_len - n) as usize;
        let text = v2::decompress_header(&bytes[at..])?;
        (std::borrow::Cow::Owned(text), 16, file_len - n - 16)
    };
    let (obj, metadata) = split_header(&text, bad)?;
    let (tensors, body, source_header) = if version == 1 {
        parse_v1(&obj, data_len)?
    } else {
        v2::parse(obj, data_len)?
    };
    // The uncompressed layout: contiguous from 0, as in a safetensors file.
    let mut pos = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if t.start != pos {
            let why = if t.start < pos {
                format!("overlap tensor `{}`", tensors[i - 1].name)
            } else {
                format!("leave a gap after byte {pos}")
            };
            return Err(bad_tensor(
                &t.name,
                format!("data_offsets [{}, {}) {why}", t.start, t.end),
            ));
        }
        pos = t.end;
    }
    // The compressed chunks: every byte of the data area in exactly one chunk.
    let mut all: Vec<(u64, u64, usize, usize)> = Vec::new();
    for (s, list) in body.chunks.iter().enumerate() {
        all.extend(list.iter().enumerate().map(|(k, c)| {
            let r = c.stored();
            (r.start, r.end, s, k)
        }));
    }
    all.sort_unstable();
    let mut pos = 0u64;
    for &(start, end, s, k) in &all {
        if start != pos {
            let why = if start < pos {
                "overlaps another chunk"
            } else {
                "leaves a gap before it"
            };
            let problem =
                format!("compressed chunk [{start}, {end}) {why} (expected it to start at {pos})");
            return Err(if version == 1 {
                bad_tensor(&tensors[s].name, problem)
            } else {
                let st = &body.streams.streams[s];
                bad(format!(
                    "stream {s} ({}): chunk {k}: {problem}",
                    dtype_name(st.dtype)
                ))
            });
        }
        pos = end;
    }
    if pos != data_len {
        return Err(bad(format!(
            "chunks end at byte {pos} of a data area of {data_len} bytes (trailing bytes)"
        )));
    }
    Ok(Header {
        data_start,
        tensors,
        body,
        metadata,
        source_header,
    })
}

/// Version 1's entries: the tensors by uncompressed offset, one stream each.
fn parse_v1(
    obj: &Map<String, Value>,
    data_len: u64,
) -> Result<(Vec<TensorEntry>, Body, Option<String>)> {
    let mut entries = Vec::with_capacity(obj.len());
    for (name, v) in obj {
        entries.push(parse_entry(name, v, data_len)?);
    }
    entries.sort_by_key(|(t, _)| (t.start, t.end));
    let streams = Streams::one_per_tensor(
        &entries
            .iter()
            .map(|(t, c)| (t.dtype, c.raw_len, c.chunk_size))
            .collect::<Vec<_>>(),
    );
    let chunks = entries
        .iter()
        .map(|(_, c)| {
            c.chunks
                .iter()
                .map(|&frame| ChunkLoc::V1 {
                    frame,
                    group: c.group,
                })
                .collect()
        })
        .collect();
    let tensors = entries.into_iter().map(|(t, _)| t).collect();
    Ok((tensors, Body { streams, chunks }, None))
}

fn u64_array(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_array()?.iter().map(Value::as_u64).collect()
}

fn parse_entry(name: &str, v: &Value, data_len: u64) -> Result<(TensorEntry, ChunkTable)> {
    const FIELDS: [&str; 7] = [
        "dtype",
        "shape",
        "data_offsets",
        "codec",
        "group",
        "chunk_size",
        "chunks",
    ];
    let obj = entry_fields(name, v, &FIELDS)?;
    // `data_offsets` place the tensor in the uncompressed data area, which the file
    // does not hold: their only bound is that they tile it (checked by the caller).
    let entry = parse_description(name, obj, u64::MAX)?;
    let (dtype, raw_len) = (entry.dtype, entry.end - entry.start);
    match obj.get("codec").and_then(Value::as_str) {
        Some("zstd") => {}
        Some(c) => return Err(bad_tensor(name, format!("unknown codec `{c}` (only zstd)"))),
        None => return Err(bad_tensor(name, "missing `codec`")),
    }
    let group = obj
        .get("group")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad_tensor(name, "`group` must be a non-negative integer"))?;
    let bits = dtype.bitsize() as u64;
    if group != 1 && !(bits.is_multiple_of(8) && group == bits / 8) {
        return Err(bad_tensor(
            name,
            format!(
                "`group` {group} is neither 1 nor the {} element size in bytes",
                dtype_name(dtype)
            ),
        ));
    }
    let chunk_size = obj
        .get("chunk_size")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad_tensor(name, "`chunk_size` must be a non-negative integer"))?;
    let unit = unit_bytes(dtype);
    if chunk_size == 0 || chunk_size > MAX_CHUNK_BYTES || chunk_size % unit != 0 {
        return Err(bad_tensor(
            name,
            format!(
                "`chunk_size` {chunk_size} must be a multiple of {unit} byte(s) (whole {} elements) from 1 to {MAX_CHUNK_BYTES}",
                dtype_name(dtype)
            ),
        ));
    }
    let list = obj
        .get("chunks")
        .and_then(Value::as_array)
        .ok_or_else(|| bad_tensor(name, "`chunks` must be an array of [start, end]"))?;
    let count = raw_len.div_ceil(chunk_size);
    if list.len() as u64 != count {
        return Err(bad_tensor(
            name,
            format!(
                "{raw_len} bytes in chunks of {chunk_size} make {count} chunk(s) but `chunks` lists {}",
                list.len()
            ),
        ));
    }
    let mut chunks = Vec::with_capacity(list.len());
    for (k, c) in list.iter().enumerate() {
        let c = u64_array(Some(c))
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad_tensor(name, format!("chunk {k} must be [start, end]")))?;
        // A zstd frame is never empty, so an empty range is damage, not a chunk.
        if c[0] >= c[1] || c[1] > data_len {
            return Err(bad_tensor(
                name,
                format!(
                    "compressed chunk {k} [{}, {}) is empty, reversed or past the end of the data area ({data_len} bytes): truncated file?",
                    c[0], c[1]
                ),
            ));
        }
        chunks.push([c[0], c[1]]);
    }
    Ok((
        entry,
        ChunkTable {
            group: group as usize,
            chunk_size,
            raw_len,
            chunks,
        },
    ))
}

/// The header JSON (without preamble or padding) for `specs` laid out contiguously, with
/// chunk tables `tables` (one `[start, end]` list per tensor).
#[cfg(test)]
fn encode_header(
    specs: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
    sizes: &[(usize, u64)],
    tables: &[Vec<[u64; 2]>],
) -> Result<Vec<u8>> {
    let mut obj = Map::new();
    if !metadata.is_empty() {
        obj.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).map_err(|e| bad(e.to_string()))?,
        );
    }
    let mut pos = 0u64;
    for ((t, &(group, chunk_size)), chunks) in specs.iter().zip(sizes).zip(tables) {
        let n = byte_len(t.dtype, &t.shape)
            .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)))?;
        let end = pos.checked_add(n).ok_or_else(|| overflow("file size"))?;
        obj.insert(
            t.name.clone(),
            serde_json::json!({"dtype": dtype_name(t.dtype), "shape": t.shape,
                "data_offsets": [pos, end], "codec": "zstd", "group": group,
                "chunk_size": chunk_size, "chunks": chunks}),
        );
        pos = end;
    }
    serde_json::to_vec(&Value::Object(obj)).map_err(|e| bad(e.to_string()))
}

thread_local! {
    /// Per thread: a zstd compression context (with its level) and a buffer for grouped
    /// bytes, reused from chunk to chunk.
    static ENCODER: RefCell<Option<(i32, zstd::bulk::Compressor<'static>, Vec<u8>)>> =
        const { RefCell::new(None) };
}

/// Compresses one chunk (grouping its bytes first when `group > 1`) into `out`, with
/// zstd's frame checksum so that readers detect damage to any single chunk.
///
/// # Errors
/// zstd's errors.
pub fn compress_chunk(
    raw: &[u8],
    group: usize,
    level: i32,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    ENCODER.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.as_ref().is_none_or(|c| c.0 != level) {
            let mut c = zstd::bulk::Compressor::new(level)?;
            c.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true))?;
            *cell = Some((level, c, Vec::new()));
        }
        let Some((_, cctx, grouped)) = cell.as_mut() else {
            return Ok(());
        };
        let input: &[u8] = if group > 1 {
            grouped.resize(raw.len(), 0);
            group_bytes(raw, group, grouped);
            grouped
        } else {
            raw
        };
        out.clear();
        out.reserve(zstd::zstd_safe::compress_bound(input.len()));
        cctx.compress_to_buffer(input, out)?;
        Ok(())
    })
}

/// A compressed chunk in the data area: `(start, end, checksum of its raw bytes)`.
#[cfg(test)]
type Written = (u64, u64, Checksum);

/// A version 1 `.ckptz` file being written, kept for the tests that prove version 1
/// files still read (ckpt writes version 2: [`CkptzWriter`]). Data arrives as the safetensors writer's does, by
/// positional writes of raw bytes at any place of any tensor from any thread; each chunk
/// is compressed as soon as all its bytes have arrived (a write covering a whole chunk
/// is compressed straight from the caller's buffer) and appended to the data area, so
/// memory holds only the partly written chunks. The header, sized beforehand for the
/// largest offsets the data can reach, is written by [`CkptzWriter::finish`].
#[derive(Debug)]
#[cfg(test)]
pub(crate) struct V1Writer {
    out: StagedFile,
    specs: Vec<TensorSpec>,
    metadata: BTreeMap<String, String>,
    level: i32,
    /// Per tensor: `(group, chunk_size)`.
    sizes: Vec<(usize, u64)>,
    /// Per tensor: raw length.
    raw_lens: Vec<u64>,
    /// Where the data area starts (after the reserved header).
    data_start: u64,
    /// Compressed bytes written so far: the next chunk goes there.
    next: AtomicU64,
    /// Per tensor, per chunk: `(start, end, raw checksum)` once written.
    written: Vec<Mutex<Vec<Option<Written>>>>,
    /// Partly written chunks: `(tensor, chunk)` to the raw bytes and how many arrived.
    pending: PartialChunks,
}

#[cfg(test)]
impl V1Writer {
    /// Creates `dest` (through a temporary file beside it) for `tensors`.
    ///
    /// # Errors
    /// I/O errors, with the path; sizes that overflow; a header over [`MAX_HEADER_LEN`].
    pub(crate) fn create(
        dest: &Path,
        tensors: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
        compression: Compression,
    ) -> Result<V1Writer> {
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut raw_lens = Vec::with_capacity(tensors.len());
        let mut counts = Vec::with_capacity(tensors.len());
        // The largest the data area can get: zstd's bound on every chunk.
        let mut bound = 0u64;
        for t in tensors {
            let raw = byte_len(t.dtype, &t.shape)
                .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)).with_path(dest))?;
            let cs = chunk_size_for(t.dtype, compression.chunk_bytes.min(MAX_CHUNK_BYTES));
            let count = raw.div_ceil(cs);
            let full = zstd::zstd_safe::compress_bound(cs as usize) as u64;
            bound = count
                .checked_mul(full)
                .and_then(|b| b.checked_add(bound))
                .ok_or_else(|| overflow("compressed size bound").with_path(dest))?;
            sizes.push((group_of(t.dtype), cs));
            raw_lens.push(raw);
            counts.push(count as usize);
        }
        // Sized with every offset at the bound, so the real header (same structure,
        // smaller or equal numbers) always fits; the rest is padded with spaces.
        let widest: Vec<Vec<[u64; 2]>> = counts.iter().map(|&n| vec![[bound, bound]; n]).collect();
        let header_meta = with_checksums(
            metadata,
            tensors.iter().map(|t| (t.name.clone(), Checksum(0))),
        );
        let reserved = encode_header(tensors, &header_meta, &sizes, &widest)
            .map_err(|e| e.with_path(dest))?
            .len() as u64;
        let reserved = reserved.div_ceil(8) * 8;
        if reserved > MAX_HEADER_LEN {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: the header for {} tensors would take {reserved} bytes, over the {MAX_HEADER_LEN}-byte limit: split the output into more files (--max-shard-size)",
                    dest.display(),
                    tensors.len()
                ),
            });
        }
        let out = StagedFile::create(dest)?;
        Ok(V1Writer {
            out,
            specs: tensors.to_vec(),
            metadata: metadata.clone(),
            level: compression.level,
            sizes,
            raw_lens,
            data_start: 16 + reserved,
            next: AtomicU64::new(0),
            written: counts.iter().map(|&n| Mutex::new(vec![None; n])).collect(),
            pending: PartialChunks::default(),
        })
    }

    /// Writes raw `bytes` at byte `offset` of tensor `index`'s (uncompressed) data.
    /// Writes must not overlap.
    ///
    /// # Errors
    /// I/O and zstd errors, with the path; bytes past the tensor's end.
    pub(crate) fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let (_, cs) = self.sizes[index];
        let raw_len = self.raw_lens[index];
        offset
            .checked_add(bytes.len() as u64)
            .filter(|&e| e <= raw_len)
            .ok_or_else(|| {
                overflow(format!(
                    "{}: write past the end of tensor `{}`",
                    self.out.dest().display(),
                    self.specs[index].name
                ))
            })?;
        self.pending.write(
            index,
            offset,
            bytes,
            cs,
            |k| {
                let c0 = k as u64 * cs;
                c0..(c0 + cs).min(raw_len)
            },
            |k, raw| self.emit(index, k, raw),
        )
    }

    /// Compresses chunk `k` of tensor `index` and appends it to the data area.
    fn emit(&self, index: usize, k: usize, raw: &[u8]) -> Result<()> {
        thread_local! {
            /// The compressed chunk, reused: a fresh 4 MiB buffer per chunk costs its
            /// page faults every time.
            static FRAME: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let sum = Checksum(crc32c::crc32c(raw));
        let (start, len) = FRAME.with(|f| -> Result<(u64, u64)> {
            let mut out = f.borrow_mut();
            compress_chunk(raw, self.sizes[index].0, self.level, &mut out).at(self.out.dest())?;
            let len = out.len() as u64;
            let start = self.next.fetch_add(len, Ordering::Relaxed);
            self.out.write_at(&out, self.data_start + start)?;
            Ok((start, len))
        })?;
        let mut w = self.written[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        w[k] = Some((start, start + len, sum));
        Ok(())
    }

    /// Writes the header (chunk tables and the checksums of the raw bytes), syncs the
    /// file and renames it to its final name.
    ///
    /// # Errors
    /// A chunk that was never (completely) written; I/O errors, with the path.
    pub(crate) fn finish(mut self) -> Result<()> {
        let mut tables = Vec::with_capacity(self.specs.len());
        let mut sums = Vec::with_capacity(self.specs.len());
        for (i, w) in std::mem::take(&mut self.written).into_iter().enumerate() {
            let w = w
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut table = Vec::with_capacity(w.len());
            let mut parts = Vec::with_capacity(w.len());
            for (k, c) in w.into_iter().enumerate() {
                let (start, end, sum) = c.ok_or_else(|| {
                    bad_tensor(
                        &self.specs[i].name,
                        format!("chunk {k} of the output was never completely written"),
                    )
                    .with_path(self.out.dest())
                })?;
                let (_, cs) = self.sizes[i];
                let lo = k as u64 * cs;
                parts.push((sum, (lo + cs).min(self.raw_lens[i]) - lo));
                table.push([start, end]);
            }
            tables.push(table);
            sums.push((self.specs[i].name.clone(), Checksum::combine(parts)));
        }
        let meta = if checksums_enabled() {
            with_checksums(&self.metadata, sums)
        } else {
            self.metadata.clone()
        };
        let mut header = encode_header(&self.specs, &meta, &self.sizes, &tables)
            .map_err(|e| e.with_path(self.out.dest()))?;
        let reserved = self.data_start - 16;
        if header.len() as u64 > reserved {
            return Err(overflow(format!(
                "{}: header of {} bytes does not fit the {reserved} reserved",
                self.out.dest().display(),
                header.len()
            )));
        }
        header.resize(reserved as usize, b' ');
        let mut preamble = MAGIC_V1.to_vec();
        preamble.extend_from_slice(&reserved.to_le_bytes());
        preamble.extend_from_slice(&header);
        self.out.write_at(&preamble, 0)?;
        self.out
            .set_len(self.data_start + self.next.load(Ordering::Relaxed))?;
        self.out.commit()
    }
}

/// Compression as a property of the reader: the engine reads `.ckptz` files through
/// this, chunk by chunk, without knowing the format.
impl Decoder for Chunked {
    fn locate(&self, t: usize, range: std::ops::Range<u64>) -> (usize, std::ops::Range<u64>) {
        self.body.streams.locate(t, range)
    }

    fn chunk_size(&self, s: usize) -> u64 {
        self.body.streams.streams[s].chunk_size
    }

    fn decode(&self, path: &Path, name: &str, s: usize, k: usize, out: &mut Vec<u8>) -> Result<()> {
        Chunked::decode(self, path, name, s, k, out)
    }

    fn checksum(&self, path: &Path, name: &str, t: usize) -> Result<Checksum> {
        Chunked::checksum(self, path, name, t)
    }

    fn decoded_checksum(&self, t: usize) -> Option<Checksum> {
        Chunked::decoded_checksum(self, t)
    }

    fn stored_len(&self, t: usize) -> u64 {
        Chunked::stored_len(self, t)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl TensorFile {
    /// The chunk tables, when the file is a `.ckptz` one.
    pub(crate) fn chunked(&self) -> Option<&Chunked> {
        self.decoder()?.as_any().downcast_ref::<Chunked>()
    }

    /// Compressed bytes of tensor `index` as stored, when the file is compressed (a
    /// chunk shared with other tensors counted in proportion to its raw bytes there).
    #[must_use]
    pub fn compressed_len(&self, index: usize) -> Option<u64> {
        self.chunked().map(|c| c.stored_len(index))
    }

    /// The header of the safetensors file a compressed file was made from, as it was
    /// (version 2 files written by `ckpt compress`).
    pub(crate) fn source_header(&self) -> Option<&str> {
        self.chunked().and_then(|c| c.source_header.as_deref())
    }
}

impl super::writer::TensorWriter for CkptzWriter {
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        CkptzWriter::write_at(self, index, offset, bytes)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        CkptzWriter::finish(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{ChunkCache, FileFormat};

    const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Bytes that are neither constant nor random, so that both grouping and zstd
    /// have something to do.
    fn bytes(seed: usize, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (((i * 7 + seed * 13) % 251) ^ (i / 3)) as u8)
            .collect()
    }

    /// Writes `tensors` with chunks of at most `chunk` bytes, each tensor's bytes
    /// arriving in pieces of `piece` bytes in reverse order (so that pieces straddle
    /// chunk edges and chunks complete out of order).
    fn write(
        dir: &Path,
        tensors: &[TensorSpec],
        chunk: u64,
        piece: usize,
    ) -> (std::path::PathBuf, Vec<Vec<u8>>) {
        let dest = dir.join("x.ckptz");
        let c = Compression {
            level: 3,
            chunk_bytes: chunk,
        };
        let w = V1Writer::create(&dest, tensors, &BTreeMap::new(), c).unwrap();
        let mut all = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let data = bytes(i, byte_len(t.dtype, &t.shape).unwrap() as usize);
            let starts: Vec<usize> = (0..data.len()).step_by(piece.max(1)).collect();
            for &s in starts.iter().rev() {
                let e = (s + piece).min(data.len());
                w.write_at(i, s as u64, &data[s..e]).unwrap();
            }
            all.push(data);
        }
        w.finish().unwrap();
        (dest, all)
    }

    #[test]
    fn grouping_round_trips_and_groups() {
        let src: Vec<u8> = (0..24).collect();
        for k in [1, 2, 4, 8] {
            let mut g = vec![0; 24];
            group_bytes(&src, k, &mut g);
            let mut back = vec![0; 24];
            ungroup_bytes(&g, k, &mut back);
            assert_eq!(back, src, "k {k}");
        }
        let mut g = vec![0; 8];
        group_bytes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut g);
        assert_eq!(g, [1, 5, 2, 6, 3, 7, 4, 8]);
        group_bytes(&[1, 2, 3, 4, 5, 6, 7, 8], 2, &mut g);
        assert_eq!(g, [1, 3, 5, 7, 2, 4, 6, 8]);
        // Against the definition g[j * n + i] = e[i][j], on sizes past any vector width.
        let src: Vec<u8> = (0..8 * 1001).map(|i| (i * 37 % 253) as u8).collect();
        for k in [2, 4, 8] {
            let n = src.len() / k;
            let mut g = vec![0; src.len()];
            group_bytes(&src, k, &mut g);
            for i in 0..n {
                for j in 0..k {
                    assert_eq!(g[j * n + i], src[i * k + j], "k {k} i {i} j {j}");
                }
            }
            let mut back = vec![0; src.len()];
            ungroup_bytes(&g, k, &mut back);
            assert_eq!(back, src, "k {k}");
        }
    }

    #[test]
    fn every_dtype_round_trips_with_chunks_of_any_size() {
        let dir = tempfile::tempdir().unwrap();
        for chunk in [1u64, 5, 24, 1000] {
            let mut specs: Vec<TensorSpec> = ALL
                .iter()
                .enumerate()
                .map(|(i, &d)| spec(&format!("t{i:02}"), d, &[7, 12]))
                .collect();
            specs.push(spec("empty", Dtype::F32, &[0, 5]));
            specs.push(spec("scalar", Dtype::BF16, &[]));
            specs.push(spec("small", Dtype::F64, &[1]));
            let (path, data) = write(dir.path(), &specs, chunk, 10);
            let f = TensorFile::open(&path).unwrap();
            assert_eq!(f.format(), FileFormat::Ckptz);
            let mut cache = ChunkCache::new();
            for (i, t) in specs.iter().enumerate() {
                let k = f.find(&t.name).unwrap();
                let e = &f.tensors()[k];
                assert_eq!((e.dtype, &e.shape), (t.dtype, &t.shape));
                let n = data[i].len() as u64;
                assert_eq!(
                    f.read(k, 0..n, &mut cache).unwrap(),
                    &data[i][..],
                    "{} chunk {chunk}",
                    t.name
                );
                // Every sub-range, across chunk edges.
                for lo in 0..n.min(40) {
                    for hi in lo..n.min(40) {
                        let got = f.read(k, lo..hi, &mut cache).unwrap();
                        assert_eq!(got, &data[i][lo as usize..hi as usize]);
                    }
                }
                assert!(
                    f.check_checksum(k).unwrap(),
                    "{}: checksum recorded",
                    t.name
                );
            }
            assert!(f.read(0, 0..10_000, &mut cache).is_err());
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn a_read_decompresses_only_the_chunks_it_covers() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [spec("w", Dtype::F32, &[100])];
        let (path, data) = write(dir.path(), &specs, 40, 400);
        let f = TensorFile::open(&path).unwrap();
        let c = f.chunked().unwrap();
        let decoded = || -> Vec<usize> {
            (0..c.chunk_count(0))
                .filter(|&k| c.crcs[0][k].load(Ordering::Relaxed) != 0)
                .collect()
        };
        assert_eq!(c.chunk_count(0), 10);
        // Bytes [85, 125) lie in chunks 2 and 3 (of 40 bytes each).
        let mut cache = ChunkCache::new();
        let got = f.read(0, 85..125, &mut cache).unwrap();
        assert_eq!(got, &data[0][85..125]);
        assert_eq!(decoded(), [2, 3]);
        assert_eq!(c.decoded_checksum(0), None);
        f.read(0, 0..400, &mut ChunkCache::new()).unwrap();
        assert_eq!(decoded(), (0..10).collect::<Vec<_>>());
        assert_eq!(c.decoded_checksum(0), f.checksum(0));
    }

    #[test]
    fn chunks_are_whole_elements_and_floats_grouped() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [
            spec("b", Dtype::BF16, &[10]),
            spec("s", Dtype::F6_E2M3, &[8]),
            spec("i", Dtype::I32, &[3]),
        ];
        let (path, _) = write(dir.path(), &specs, 7, 4);
        let bytes = std::fs::read(&path).unwrap();
        let h = parse_header(&bytes, bytes.len() as u64).unwrap();
        // Version 1: one stream per tensor, in offset order.
        let by: BTreeMap<&str, (usize, u64, usize)> = h
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let ChunkLoc::V1 { group, .. } = h.body.chunks[i][0] else {
                    panic!("a version 2 chunk in a version 1 file");
                };
                let cs = h.body.streams.streams[i].chunk_size;
                (t.name.as_str(), (group, cs, h.body.chunks[i].len()))
            })
            .collect();
        assert_eq!(by["b"], (2, 6, 4));
        assert_eq!(by["s"], (1, 6, 1));
        assert_eq!(by["i"], (1, 4, 3));
        // The uncompressed layout is the safetensors one: contiguous, in spec order.
        let offs: Vec<(u64, u64)> = h.tensors.iter().map(|t| (t.start, t.end)).collect();
        assert_eq!(offs, [(0, 20), (20, 26), (26, 38)]);
    }

    /// A file with one U8 tensor of 8 bytes in chunks of 4, header edited by `edit`.
    fn edited(edit: impl Fn(&mut Value)) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write(dir.path(), &[spec("w", Dtype::U8, &[8])], 4, 8);
        let bytes = std::fs::read(&path).unwrap();
        let h = parse_header(&bytes, bytes.len() as u64).unwrap();
        let mut doc: Value = serde_json::from_slice(&bytes[16..h.data_start as usize]).unwrap();
        edit(&mut doc);
        let text = serde_json::to_vec(&doc).unwrap();
        let mut out = MAGIC_V1.to_vec();
        out.extend_from_slice(&(text.len() as u64).to_le_bytes());
        out.extend_from_slice(&text);
        out.extend_from_slice(&bytes[h.data_start as usize..]);
        out
    }

    fn err(bytes: &[u8]) -> String {
        parse_header(bytes, bytes.len() as u64)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn bad_headers_are_named() {
        let ok = edited(|_| {});
        assert!(parse_header(&ok, ok.len() as u64).is_ok());
        let e = err(&edited(|d| d["w"]["group"] = 2.into()));
        assert_eq!(
            e,
            "tensor `w`: `group` 2 is neither 1 nor the U8 element size in bytes"
        );
        let e = err(&edited(|d| d["w"]["chunk_size"] = 3.into()));
        assert_eq!(
            e,
            "tensor `w`: 8 bytes in chunks of 3 make 3 chunk(s) but `chunks` lists 2"
        );
        let e = err(&edited(|d| d["w"]["chunk_size"] = 0.into()));
        assert!(e.contains("`chunk_size` 0 must be"), "{e}");
        let e = err(&edited(|d| d["w"]["codec"] = "lz4".into()));
        assert_eq!(e, "tensor `w`: unknown codec `lz4` (only zstd)");
        let e = err(&edited(|d| d["w"]["shape"] = serde_json::json!([9])));
        assert_eq!(
            e,
            "tensor `w`: U8 x [9] needs 9 bytes but data_offsets span 8"
        );
        let e = err(&edited(|d| {
            d["w"]["chunks"][1] = d["w"]["chunks"][0].clone()
        }));
        assert!(e.contains("overlaps another chunk"), "{e}");
        let e = err(&edited(|d| d["w"]["extra"] = 1.into()));
        assert_eq!(e, "tensor `w`: unknown field `extra`");
        let e = err(&edited(|d| d["w"]["chunks"][1][1] = u64::MAX.into()));
        assert!(e.contains("past the end of the data area"), "{e}");
        // Truncated: the last chunk runs past the end.
        let e = err(&ok[..ok.len() - 1]);
        assert!(e.contains("truncated file?"), "{e}");
        // Trailing bytes.
        let mut long = ok.clone();
        long.push(0);
        assert!(err(&long).contains("trailing bytes"));
        assert!(err(&ok[..10]).contains("too short"));
        let mut big = ok.clone();
        big[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_header(&big, big.len() as u64),
            Err(Error::HeaderTooLarge { .. })
        ));
        // Not mistaken for safetensors, and safetensors' parser refuses it.
        assert_eq!(super::super::sniff(&ok), Some(FileFormat::Ckptz));
        assert!(matches!(
            super::super::safetensors::parse_header(&ok),
            Err(Error::HeaderTooLarge { .. })
        ));
    }

    #[test]
    fn damaged_chunks_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [spec("w", Dtype::F32, &[64])];
        let (path, _) = write(dir.path(), &specs, 64, 256);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 0x55;
        std::fs::write(&path, &bytes).unwrap();
        let f = TensorFile::open(&path).unwrap();
        let e = f.check_checksum(0).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}: tensor `w`: compressed chunk 3 is damaged: zstd:",
                path.display()
            )),
            "{e}"
        );
        let e = f.read(0, 250..256, &mut ChunkCache::new()).unwrap_err();
        assert!(matches!(e, Error::CorruptChunk { chunk: 3, .. }), "{e}");
        // The chunks before the damaged one still read.
        assert!(f.read(0, 0..192, &mut ChunkCache::new()).is_ok());
    }

    #[test]
    fn compression_flag_parses() {
        assert_eq!(Compression::parse("zstd"), Ok(Compression::default()));
        assert_eq!(Compression::parse("zstd:19").map(|c| c.level), Ok(19));
        assert!(Compression::parse("zstd:0").is_err());
        assert!(Compression::parse("zstd:x").is_err());
        assert!(Compression::parse("gzip").is_err());
    }
}
