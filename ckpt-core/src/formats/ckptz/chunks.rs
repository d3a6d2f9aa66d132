//! What both versions of the format share: the compression asked for, the chunk
//! sizes, where a chunk is stored and how ([`ChunkLoc`]), and a file's chunks
//! ([`Body`]), and the writers' gathering of chunks written in parts
//! ([`PartialChunks`]). Its own module so that the version-2 codec (`v2.rs`) and the
//! reader (`ckptz.rs`) both build on it without importing each other.

use super::entropy::PlaneCodec;
use super::pack::Streams;
use crate::error::Error;
use crate::layout::Dtype;

/// Largest header accepted (as for safetensors).
pub(crate) const MAX_HEADER_LEN: u64 = crate::formats::safetensors::MAX_HEADER_LEN;

/// Largest chunk a reader accepts: a reader holds a few chunks per thread, so a header
/// must not be able to ask for gigabytes.
pub(crate) const MAX_CHUNK_BYTES: u64 = 256 << 20;

/// Default raw bytes per chunk: large enough for zstd to find the redundancy, small
/// enough that a partial read decompresses little it does not need.
pub const DEFAULT_CHUNK_BYTES: u64 = 4 << 20;

/// How to compress: the zstd level and the raw bytes per chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compression {
    /// zstd level, 1 to 22.
    pub level: i32,
    /// Raw bytes per chunk (rounded down to whole elements per tensor).
    pub chunk_bytes: u64,
}

/// The default level. On byte-grouped floats, level 3's deeper match search finds
/// almost nothing level 1's misses (AdamW moments: 0.731 against 0.730 of raw, BF16
/// weights 0.697 against 0.678, `cargo bench --bench compress`) and costs half the
/// speed: the redundancy is in the exponent bytes' statistics, which the entropy coder
/// takes at any level.
pub const DEFAULT_LEVEL: i32 = 1;

impl Default for Compression {
    fn default() -> Compression {
        Compression {
            level: DEFAULT_LEVEL,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
        }
    }
}

impl Compression {
    /// Parses `zstd` or `zstd:LEVEL` (1 to 22).
    ///
    /// # Errors
    /// Any other text, a level out of range.
    pub fn parse(text: &str) -> std::result::Result<Compression, String> {
        let (codec, level) = match text.split_once(':') {
            Some((c, l)) => (c, Some(l)),
            None => (text, None),
        };
        if codec != "zstd" {
            return Err(format!(
                "`{text}`: unknown codec `{codec}` (expected zstd or zstd:LEVEL)"
            ));
        }
        let level = match level {
            None => Compression::default().level,
            Some(l) => l
                .parse::<i32>()
                .ok()
                .filter(|l| (1..=22).contains(l))
                .ok_or_else(|| {
                    format!("`{text}`: zstd level `{l}` is not a number from 1 to 22")
                })?,
        };
        Ok(Compression {
            level,
            ..Compression::default()
        })
    }
}

pub(crate) fn bad(problem: impl Into<String>) -> Error {
    Error::InvalidCompressed {
        problem: problem.into(),
    }
}

/// The smallest number of bytes that holds whole elements of `dtype` (3 for 6-bit
/// types, 1 for 4-bit ones): chunk sizes are multiples of it, so chunk edges fall on
/// element edges.
pub(crate) fn unit_bytes(dtype: Dtype) -> u64 {
    let bits = dtype.bitsize() as u64;
    let mut unit = bits;
    while !unit.is_multiple_of(8) {
        unit += bits;
    }
    unit / 8
}

/// The chunk size used for a tensor of `dtype` when `max` bytes are asked for: whole
/// elements, at least one.
pub(crate) fn chunk_size_for(dtype: Dtype, max: u64) -> u64 {
    let unit = unit_bytes(dtype);
    (max / unit).max(1) * unit
}

/// Where one chunk is stored, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ChunkLoc {
    /// Version 1: one zstd frame `[start, end)` of the chunk's bytes grouped by `group`.
    V1 { frame: [u64; 2], group: usize },
    /// Version 2: the planes back to back from `at`, and the raw bytes' CRC-32C.
    V2 {
        at: u64,
        planes: Vec<(PlaneCodec, u64)>,
        crc: u32,
    },
}

impl ChunkLoc {
    /// The chunk's bytes in the data area.
    pub(crate) fn stored(&self) -> std::ops::Range<u64> {
        match self {
            ChunkLoc::V1 { frame, .. } => frame[0]..frame[1],
            ChunkLoc::V2 { at, planes, .. } => *at..at + planes.iter().map(|p| p.1).sum::<u64>(),
        }
    }
}

/// The chunks of a file, either version: the streams the tensors lie in (version 1:
/// one per tensor) and, per stream, per chunk, where it is stored.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Body {
    pub(crate) streams: Streams,
    pub(crate) chunks: Vec<Vec<ChunkLoc>>,
}

/// Chunks that arrive in parts: the copy writes a tensor's bytes in whatever runs its
/// sources hold, on several threads, and a chunk is compressed only once all of its
/// bytes are there. Keyed by `(stream, chunk)` (a tensor in version 1).
#[derive(Debug, Default)]
pub(crate) struct PartialChunks {
    pending: std::sync::Mutex<std::collections::HashMap<(usize, usize), Partial>>,
}

/// A chunk whose raw bytes have partly arrived: the bytes, and how many have arrived.
type Partial = (Vec<u8>, u64);

impl PartialChunks {
    /// Splits `bytes`, which go at `pos..` of stream `s` (chunks of `chunk_size` bytes,
    /// chunk `k` covering `chunk_range(k)`), at its chunks' edges, and calls
    /// `emit(k, raw)` with each chunk that is whole: at once where `bytes` covers it,
    /// else when its last part arrives. Parts must not overlap.
    ///
    /// # Errors
    /// What `emit` returns.
    pub(crate) fn write(
        &self,
        s: usize,
        mut pos: u64,
        bytes: &[u8],
        chunk_size: u64,
        chunk_range: impl Fn(usize) -> std::ops::Range<u64>,
        mut emit: impl FnMut(usize, &[u8]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let k = (pos / chunk_size) as usize;
            let c = chunk_range(k);
            let take = (c.end - pos).min(rest.len() as u64) as usize;
            let (part, tail) = rest.split_at(take);
            if pos == c.start && pos + take as u64 == c.end {
                emit(k, part)?;
            } else {
                let complete = {
                    let mut pending = self
                        .pending
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let e = pending
                        .entry((s, k))
                        .or_insert_with(|| (vec![0; (c.end - c.start) as usize], 0));
                    let lo = (pos - c.start) as usize;
                    e.0[lo..lo + take].copy_from_slice(part);
                    e.1 += take as u64;
                    if e.1 == c.end - c.start {
                        pending.remove(&(s, k)).map(|e| e.0)
                    } else {
                        None
                    }
                };
                if let Some(raw) = complete {
                    emit(k, &raw)?;
                }
            }
            pos += take as u64;
            rest = tail;
        }
        Ok(())
    }
}
