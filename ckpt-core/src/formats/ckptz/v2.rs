//! `.ckptz` version 2: the header and the chunks of packed streams of byte planes.
//!
//! ```text
//! [8 bytes]  magic "CKPTZ\0\x02\0"
//! [8 bytes]  N: header length, u64 little-endian
//! [N bytes]  header: UTF-8 JSON object, padded with spaces
//! [rest]     data area: chunks, each its planes back to back
//! ```
//!
//! The header is a safetensors header (entries `dtype`, `shape`, `data_offsets` into the
//! uncompressed data area, nothing else) plus the key `__ckptz__`: the streams (one per
//! dtype, see [`super::pack`]) with each chunk's place, raw CRC-32C and planes (see
//! [`super::planes`], [`super::entropy`]), and, for a file `ckpt compress` made from a
//! safetensors file, that file's header text as it was (`source_header`), so that
//! decompressing gives back the original byte for byte. `docs/formats.md` specifies it.
//!
//! Written deterministically: chunks are placed in the data area in a fixed order
//! (by the position of their last raw byte in the uncompressed file, which is about the
//! order in which a copy completes them), whatever thread finishes first; a chunk
//! completed ahead of its turn waits in memory, or past [`HOLD_BYTES`] in a spool file.

use super::entropy::{decode_plane, encode_plane, PlaneCodec};
use super::pack::Streams;
use super::planes::PlaneSplit;
use super::{bad, chunk_size_for, Body, ChunkLoc, Compression, MAX_CHUNK_BYTES};
use crate::checksum::{checksums_enabled, Checksum};
use crate::error::{overflow, Error, IoContext, Result};
use crate::formats::safetensors::{
    entry_fields, parse_description, split_header, with_checksums, TensorSpec,
};
use crate::formats::{bad_tensor, byte_len, TensorEntry, TensorFile};
use crate::output::{temp_name, StagedFile};
use crate::strategy::dtype_name;
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

/// The first 8 bytes of a version 2 file.
pub const MAGIC_V2: [u8; 8] = *b"CKPTZ\0\x02\0";

/// The header key of version 2's own description.
pub(crate) const KEY: &str = "__ckptz__";

/// Compressed chunks a writer keeps in memory while they wait for their turn; past
/// this they wait in a spool file beside the output.
pub(crate) const HOLD_BYTES: u64 = 256 << 20;

/// Parses the entries and `__ckptz__` of a version 2 header (`obj` without
/// `__metadata__`): the tensors sorted by uncompressed offset, the chunks, and the
/// source header. The caller checks that the tensors tile the uncompressed area and
/// the chunks the data area.
pub(crate) fn parse(
    mut obj: Map<String, Value>,
    data_len: u64,
) -> Result<(Vec<TensorEntry>, Body, Option<String>)> {
    let own = obj
        .remove(KEY)
        .ok_or_else(|| bad(format!("version 2 header without `{KEY}`")))?;
    let own = own
        .as_object()
        .ok_or_else(|| bad(format!("`{KEY}` must be an object")))?;
    if let Some(k) = own
        .keys()
        .find(|k| !["streams", "source_header"].contains(&k.as_str()))
    {
        return Err(bad(format!("`{KEY}`: unknown field `{k}`")));
    }
    let mut tensors = Vec::with_capacity(obj.len());
    for (name, v) in &obj {
        let fields = entry_fields(name, v, &["dtype", "shape", "data_offsets"])?;
        tensors.push(parse_description(name, fields, u64::MAX)?);
    }
    tensors.sort_by_key(|t| (t.start, t.end));
    let source = match own.get("source_header") {
        None => None,
        Some(Value::String(s)) => {
            check_source(s, &tensors)?;
            Some(s.clone())
        }
        Some(_) => return Err(bad(format!("`{KEY}.source_header` must be a string"))),
    };
    let list = own
        .get("streams")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(format!("`{KEY}.streams` must be an array")))?;
    let described: Vec<(crate::Dtype, u64)> =
        tensors.iter().map(|t| (t.dtype, t.end - t.start)).collect();
    // The chunk sizes come from the header: take them in stream order once the streams
    // are known to be the ones the tensors make.
    let mut streams = Streams::packed(&described, |_| 1)?;
    if list.len() != streams.streams.len() {
        return Err(bad(format!(
            "`{KEY}.streams` lists {} stream(s), the tensors' dtypes make {}",
            list.len(),
            streams.streams.len()
        )));
    }
    let mut chunks = Vec::with_capacity(list.len());
    for (s, v) in list.iter().enumerate() {
        let st = &mut streams.streams[s];
        let name = dtype_name(st.dtype);
        let who = |problem: String| bad(format!("stream {s} ({name}): {problem}"));
        let obj = v
            .as_object()
            .ok_or_else(|| who("must be an object".into()))?;
        if let Some(k) = obj
            .keys()
            .find(|k| !["dtype", "chunk_size", "chunks"].contains(&k.as_str()))
        {
            return Err(who(format!("unknown field `{k}`")));
        }
        if obj.get("dtype").and_then(Value::as_str) != Some(name.as_str()) {
            return Err(who(format!(
                "`dtype` {} is not the dtype of the stream's tensors (streams follow each dtype's first tensor in file order)",
                obj.get("dtype").unwrap_or(&Value::Null)
            )));
        }
        let split = PlaneSplit::of(st.dtype);
        let unit = super::unit_bytes(st.dtype).max(split.width as u64);
        let cs = obj
            .get("chunk_size")
            .and_then(Value::as_u64)
            .filter(|&c| c > 0 && c <= MAX_CHUNK_BYTES && c % unit == 0)
            .ok_or_else(|| {
                who(format!(
                    "`chunk_size` must be a multiple of {unit} byte(s) (whole elements) from 1 to {MAX_CHUNK_BYTES}"
                ))
            })?;
        st.chunk_size = cs;
        let list = obj
            .get("chunks")
            .and_then(Value::as_array)
            .ok_or_else(|| who("`chunks` must be an array".into()))?;
        if list.len() != st.chunk_count() {
            return Err(who(format!(
                "{} bytes in chunks of {cs} make {} chunk(s) but `chunks` lists {}",
                st.len,
                st.chunk_count(),
                list.len()
            )));
        }
        let mut locs = Vec::with_capacity(list.len());
        for (k, c) in list.iter().enumerate() {
            let r = st.chunk_range(k);
            let loc = parse_chunk(c, split, r.end - r.start, data_len)
                .map_err(|p| who(format!("chunk {k}: {p}")))?;
            locs.push(loc);
        }
        chunks.push(locs);
    }
    Ok((tensors, Body { streams, chunks }, source))
}

/// One chunk: `{"at": start, "crc32c": crc, "planes": [[codec, length], ...]}`, one
/// plane per byte of the element (one for dtypes not split), inside the data area.
fn parse_chunk(
    v: &Value,
    split: PlaneSplit,
    raw_len: u64,
    data_len: u64,
) -> std::result::Result<ChunkLoc, String> {
    let obj = v.as_object().ok_or("must be an object")?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["at", "crc32c", "planes"].contains(&k.as_str()))
    {
        return Err(format!("unknown field `{k}`"));
    }
    let at = obj
        .get("at")
        .and_then(Value::as_u64)
        .ok_or("`at` must be a non-negative integer")?;
    let crc = obj
        .get("crc32c")
        .and_then(Value::as_u64)
        .and_then(|c| u32::try_from(c).ok())
        .ok_or("`crc32c` must be an integer below 2^32")?;
    let list = obj
        .get("planes")
        .and_then(Value::as_array)
        .ok_or("`planes` must be an array")?;
    if list.len() != split.width {
        return Err(format!(
            "{} plane(s) listed, the dtype has {}",
            list.len(),
            split.width
        ));
    }
    let plane_len = raw_len / split.width as u64;
    let mut planes = Vec::with_capacity(list.len());
    let mut end = at;
    for (j, p) in list.iter().enumerate() {
        let (codec, len) = p
            .as_array()
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_str()?, a[1].as_u64()?)))
            .ok_or_else(|| format!("plane {j} must be [codec, length]"))?;
        let codec = PlaneCodec::parse(codec)
            .ok_or_else(|| format!("plane {j}: unknown codec `{codec}` (raw or zstd)"))?;
        // A raw plane is the plane; a zstd frame is never empty.
        if (codec == PlaneCodec::Raw && len != plane_len) || (codec == PlaneCodec::Zstd && len == 0)
        {
            return Err(format!(
                "plane {j}: {} of {len} bytes for a plane of {plane_len}",
                codec.name()
            ));
        }
        planes.push((codec, len));
        end = end
            .checked_add(len)
            .ok_or_else(|| "plane lengths overflow".to_string())?;
    }
    if end > data_len || end == at {
        return Err(format!(
            "bytes [{at}, {end}) are empty or run past the end of the data area ({data_len} bytes): truncated file?"
        ));
    }
    Ok(ChunkLoc::V2 { at, planes, crc })
}

/// Checks that a source header describes exactly the tensors of the file (names,
/// dtypes, shapes, offsets): decompressing writes it in front of the data area.
fn check_source(text: &str, tensors: &[TensorEntry]) -> Result<()> {
    let why = |p: String| bad(format!("`{KEY}.source_header`: {p}"));
    let (obj, _) = split_header(text.as_bytes(), bad).map_err(|e| why(e.to_string()))?;
    let mut theirs = Vec::with_capacity(obj.len());
    for (name, v) in &obj {
        let f = entry_fields(name, v, &["dtype", "shape", "data_offsets"])
            .map_err(|e| why(e.to_string()))?;
        theirs.push(parse_description(name, f, u64::MAX).map_err(|e| why(e.to_string()))?);
    }
    theirs.sort_by_key(|t| (t.start, t.end));
    if theirs != tensors {
        return Err(why(
            "does not describe the file's tensors (names, dtypes, shapes, offsets)".into(),
        ));
    }
    Ok(())
}

thread_local! {
    /// Per thread: the planes of the chunk being decoded or encoded.
    static PLANES: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Decodes one chunk (its planes back to back in `comp`) of `raw_len` bytes into `out`
/// and checks its CRC-32C.
///
/// # Errors
/// A plane that does not decode to its length, or a CRC mismatch.
pub(crate) fn decode_chunk(
    comp: &[u8],
    planes: &[(PlaneCodec, u64)],
    split: PlaneSplit,
    raw_len: usize,
    crc: u32,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    // Every byte is overwritten: resizing a reused buffer zeroes only what it grows by.
    out.resize(raw_len, 0);
    let n = raw_len / split.width;
    let decode_all = |dst: &mut [u8]| -> std::io::Result<()> {
        let mut at = 0usize;
        for (j, &(codec, len)) in planes.iter().enumerate() {
            // In range: the header check keeps the planes inside the chunk read.
            let src = &comp[at..at + len as usize];
            decode_plane(codec, src, &mut dst[j * n..(j + 1) * n])
                .map_err(|e| std::io::Error::other(format!("plane {j}: {e}")))?;
            at += len as usize;
        }
        Ok(())
    };
    if split.width == 1 {
        decode_all(out)?;
    } else {
        PLANES.with(|p| -> std::io::Result<()> {
            let mut p = p.borrow_mut();
            p.resize(raw_len, 0);
            decode_all(&mut p)?;
            split.join(&p, out);
            Ok(())
        })?;
    }
    let got = crc32c::crc32c(out);
    if got != crc {
        return Err(std::io::Error::other(format!(
            "CRC-32C of the decoded bytes is {got:08x}, the header records {crc:08x}"
        )));
    }
    Ok(())
}

/// Encodes one chunk: its planes, each zstd at `level` or raw, appended to `out`.
///
/// # Errors
/// zstd's errors.
pub(crate) fn encode_chunk(
    raw: &[u8],
    split: PlaneSplit,
    level: i32,
    out: &mut Vec<u8>,
) -> std::io::Result<Vec<(PlaneCodec, u64)>> {
    out.clear();
    let mut table = Vec::with_capacity(split.width);
    let mut code = |planes: &[u8]| -> std::io::Result<()> {
        let n = planes.len() / split.width;
        for j in 0..split.width {
            let before = out.len();
            let codec = encode_plane(&planes[j * n..(j + 1) * n], level, out)?;
            table.push((codec, (out.len() - before) as u64));
        }
        Ok(())
    };
    if split.width == 1 {
        code(raw)?;
    } else {
        PLANES.with(|p| -> std::io::Result<()> {
            let mut p = p.borrow_mut();
            p.resize(raw.len(), 0);
            split.split(raw, &mut p);
            code(&p)
        })?;
    }
    Ok(table)
}

/// A chunk written: where, its planes, the CRC-32C of its raw bytes.
#[derive(Clone, Debug)]
struct Record {
    at: u64,
    planes: Vec<(PlaneCodec, u64)>,
    crc: u32,
}

/// A chunk compressed ahead of its turn.
#[derive(Debug)]
enum Held {
    Memory(Vec<u8>, Vec<(PlaneCodec, u64)>, u32),
    Spooled(u64, u64, Vec<(PlaneCodec, u64)>, u32),
}

/// Puts chunks into the data area in their fixed order.
#[derive(Debug, Default)]
struct Sequencer {
    /// The next chunk (by order number) to write.
    next: usize,
    /// Where it goes in the data area.
    pos: u64,
    held: BTreeMap<usize, Held>,
    held_bytes: u64,
    /// The spool (created on first use, already unlinked) and its length.
    spool: Option<(File, u64)>,
    /// By order number, once written.
    records: Vec<Option<Record>>,
}

/// A `.ckptz` file (version 2) being written. Data arrives by positional writes of raw
/// bytes at any place of any tensor from any thread (as the safetensors writer's
/// does); each chunk is encoded as soon as all its raw bytes have arrived (a write
/// covering a whole chunk straight from the caller's buffer) and placed in the data
/// area in its turn. The header, sized beforehand for the largest numbers it can hold,
/// is written by [`CkptzWriter::finish`].
#[derive(Debug)]
pub struct CkptzWriter {
    out: StagedFile,
    specs: Vec<TensorSpec>,
    metadata: BTreeMap<String, String>,
    source_header: Option<String>,
    level: i32,
    streams: Streams,
    data_start: u64,
    /// Per stream, per chunk: its order number in the data area.
    order: Vec<Vec<usize>>,
    /// Partly written chunks: `(stream, chunk)` to the raw bytes and how many arrived.
    pending: Mutex<HashMap<(usize, usize), (Vec<u8>, u64)>>,
    /// Per tensor, per part: the CRC-32C of the part once its chunk is complete.
    parts: Vec<Mutex<Vec<Option<Checksum>>>>,
    seq: Mutex<Sequencer>,
}

impl CkptzWriter {
    /// Creates `dest` (through a temporary file beside it) for `tensors`, laid out in
    /// the uncompressed data area in the order given.
    ///
    /// # Errors
    /// I/O errors, with the path; sizes that overflow; a header over the limit.
    pub fn create(
        dest: &Path,
        tensors: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
        compression: Compression,
    ) -> Result<CkptzWriter> {
        CkptzWriter::create_with_source(dest, tensors, metadata, compression, None)
    }

    /// [`CkptzWriter::create`] for a file compressed from a safetensors file whose
    /// header text (after the 8-byte length, padding included) is `source_header`:
    /// it is kept so that decompressing gives the source back byte for byte. Its
    /// tensors must be `tensors` (the file's reader checks it).
    ///
    /// # Errors
    /// As [`CkptzWriter::create`].
    pub(crate) fn create_with_source(
        dest: &Path,
        tensors: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
        compression: Compression,
        source_header: Option<String>,
    ) -> Result<CkptzWriter> {
        let mut described = Vec::with_capacity(tensors.len());
        let mut file_start = Vec::with_capacity(tensors.len());
        let mut pos = 0u64;
        for t in tensors {
            let n = byte_len(t.dtype, &t.shape)
                .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)).with_path(dest))?;
            described.push((t.dtype, n));
            file_start.push(pos);
            pos = pos
                .checked_add(n)
                .ok_or_else(|| overflow("file size").with_path(dest))?;
        }
        let chunk_bytes = compression.chunk_bytes.min(MAX_CHUNK_BYTES);
        let streams = Streams::packed(&described, |d| {
            // Whole elements, and whole planes.
            let w = PlaneSplit::of(d).width as u64;
            (chunk_size_for(d, chunk_bytes) / w).max(1) * w
        })
        .map_err(|e| e.with_path(dest))?;
        // The fixed order: by the uncompressed position of each chunk's last byte.
        let mut keyed = Vec::new();
        let mut bound = 0u64;
        for (s, st) in streams.streams.iter().enumerate() {
            for k in 0..st.chunk_count() {
                let c = st.chunk_range(k);
                // The tensor holding the chunk's last byte, and that byte's place in it.
                let last = streams.in_chunk(s, k).last().map_or(0, |(t, _, _)| {
                    file_start[t] + (c.end - 1 - streams.place[t].1)
                });
                keyed.push((last, s, k));
                let w = PlaneSplit::of(st.dtype).width;
                let plane = ((c.end - c.start) / w as u64) as usize;
                bound = (zstd::zstd_safe::compress_bound(plane) as u64)
                    .checked_mul(w as u64)
                    .and_then(|b| b.checked_add(bound))
                    .ok_or_else(|| overflow("compressed size bound").with_path(dest))?;
            }
        }
        keyed.sort_unstable();
        let mut order: Vec<Vec<usize>> = streams
            .streams
            .iter()
            .map(|st| vec![0; st.chunk_count()])
            .collect();
        let by_order: Vec<(usize, usize)> = keyed.iter().map(|&(_, s, k)| (s, k)).collect();
        for (i, &(s, k)) in by_order.iter().enumerate() {
            order[s][k] = i;
        }
        // Sized with every number at its largest, so the real header (same structure,
        // smaller or equal numbers) always fits; the rest is padded with spaces.
        let widest: Vec<Vec<Record>> = streams
            .streams
            .iter()
            .map(|st| {
                let w = PlaneSplit::of(st.dtype).width;
                vec![
                    Record {
                        at: bound,
                        planes: vec![(PlaneCodec::Zstd, bound); w],
                        crc: u32::MAX,
                    };
                    st.chunk_count()
                ]
            })
            .collect();
        let header_meta = with_checksums(
            metadata,
            tensors.iter().map(|t| (t.name.clone(), Checksum(u32::MAX))),
        );
        let reserved = encode_header(
            tensors,
            &header_meta,
            &streams,
            &widest,
            source_header.as_deref(),
        )
        .map_err(|e| e.with_path(dest))?
        .len() as u64;
        let reserved = reserved.div_ceil(8) * 8;
        if reserved > super::MAX_HEADER_LEN {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: the header for {} tensors would take {reserved} bytes, over the {}-byte limit: split the output into more files (--max-shard-size)",
                    dest.display(),
                    tensors.len(),
                    super::MAX_HEADER_LEN
                ),
            });
        }
        let parts = (0..tensors.len())
            .map(|t| Mutex::new(vec![None; streams.parts(t).count()]))
            .collect();
        let out = StagedFile::create(dest)?;
        let n = by_order.len();
        Ok(CkptzWriter {
            out,
            specs: tensors.to_vec(),
            metadata: metadata.clone(),
            source_header,
            level: compression.level,
            streams,
            data_start: 16 + reserved,
            order,
            pending: Mutex::new(HashMap::new()),
            parts,
            seq: Mutex::new(Sequencer {
                records: vec![None; n],
                ..Sequencer::default()
            }),
        })
    }

    /// Writes raw `bytes` at byte `offset` of tensor `index`'s (uncompressed) data.
    /// Writes must not overlap.
    ///
    /// # Errors
    /// I/O and zstd errors, with the path; bytes past the tensor's end.
    pub fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(bytes.len() as u64)
            .filter(|&e| e <= self.streams.lens[index])
            .ok_or_else(|| {
                overflow(format!(
                    "{}: write past the end of tensor `{}`",
                    self.out.dest().display(),
                    self.specs[index].name
                ))
            })?;
        let (s, range) = self.streams.locate(index, offset..end);
        let st = &self.streams.streams[s];
        let cs = st.chunk_size;
        let mut pos = range.start;
        let mut rest = bytes;
        while pos < range.end {
            let k = (pos / cs) as usize;
            let c = st.chunk_range(k);
            let take = (c.end - pos).min(rest.len() as u64) as usize;
            let (part, tail) = rest.split_at(take);
            if pos == c.start && pos + take as u64 == c.end {
                self.emit(s, k, part)?;
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
                    self.emit(s, k, &raw)?;
                }
            }
            pos += take as u64;
            rest = tail;
        }
        Ok(())
    }

    /// Encodes chunk `k` of stream `s` and places it.
    fn emit(&self, s: usize, k: usize, raw: &[u8]) -> Result<()> {
        thread_local! {
            /// The encoded chunk, reused: a fresh 4 MiB buffer per chunk costs its page
            /// faults every time.
            static FRAME: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let mut whole = None;
        for (t, j, r) in self.streams.in_chunk(s, k) {
            let sum = Checksum(crc32c::crc32c(&raw[r.start as usize..r.end as usize]));
            if r.end - r.start == raw.len() as u64 {
                whole = Some(sum.0);
            }
            self.parts[t]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)[j] = Some(sum);
        }
        let crc = whole.unwrap_or_else(|| crc32c::crc32c(raw));
        let split = PlaneSplit::of(self.streams.streams[s].dtype);
        FRAME.with(|f| -> Result<()> {
            let mut frame = f.borrow_mut();
            let planes = encode_chunk(raw, split, self.level, &mut frame).at(self.out.dest())?;
            self.place(self.order[s][k], &frame, planes, crc)
        })
    }

    /// Writes chunk number `i` (in the fixed order) now if it is its turn, with every
    /// held chunk that follows it; otherwise holds it.
    fn place(
        &self,
        i: usize,
        frame: &[u8],
        planes: Vec<(PlaneCodec, u64)>,
        crc: u32,
    ) -> Result<()> {
        let mut q = self
            .seq
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if i != q.next {
            let len = frame.len() as u64;
            let held = if q.held_bytes + len <= HOLD_BYTES {
                q.held_bytes += len;
                Held::Memory(frame.to_vec(), planes, crc)
            } else {
                if q.spool.is_none() {
                    q.spool = Some((self.open_spool()?, 0));
                }
                let Some((spool, end)) = q.spool.as_mut() else {
                    return Ok(());
                };
                spool.write_all_at(frame, *end).at(self.out.dest())?;
                *end += len;
                Held::Spooled(*end - len, len, planes, crc)
            };
            q.held.insert(i, held);
            return Ok(());
        }
        self.write_next(&mut q, frame, planes, crc)?;
        loop {
            let next = q.next;
            let Some(h) = q.held.remove(&next) else {
                break;
            };
            match h {
                Held::Memory(bytes, planes, crc) => {
                    q.held_bytes -= bytes.len() as u64;
                    self.write_next(&mut q, &bytes, planes, crc)?;
                }
                Held::Spooled(at, len, planes, crc) => {
                    let mut bytes = vec![0; len as usize];
                    if let Some((spool, _)) = &q.spool {
                        spool.read_exact_at(&mut bytes, at).at(self.out.dest())?;
                    }
                    self.write_next(&mut q, &bytes, planes, crc)?;
                }
            }
        }
        Ok(())
    }

    fn write_next(
        &self,
        q: &mut Sequencer,
        frame: &[u8],
        planes: Vec<(PlaneCodec, u64)>,
        crc: u32,
    ) -> Result<()> {
        self.out.write_at(frame, self.data_start + q.pos)?;
        let i = q.next;
        q.records[i] = Some(Record {
            at: q.pos,
            planes,
            crc,
        });
        q.pos += frame.len() as u64;
        q.next += 1;
        Ok(())
    }

    /// A spool file beside the output, unlinked at once (it lives as long as the
    /// handle, and no crash leaves it behind).
    fn open_spool(&self) -> Result<File> {
        let p = temp_name(self.out.dest());
        let f = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&p)
            .at(&p)?;
        std::fs::remove_file(&p).at(&p)?;
        Ok(f)
    }

    /// Writes the header (streams, chunks, the checksums of the raw bytes), syncs the
    /// file and renames it to its final name.
    ///
    /// # Errors
    /// A chunk that was never (completely) written; I/O errors, with the path.
    pub fn finish(self) -> Result<()> {
        let q = self
            .seq
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut records: Vec<Vec<Record>> = Vec::with_capacity(self.streams.streams.len());
        for (s, st) in self.streams.streams.iter().enumerate() {
            let mut list = Vec::with_capacity(st.chunk_count());
            for k in 0..st.chunk_count() {
                let r = q.records[self.order[s][k]].clone().ok_or_else(|| {
                    let t = self.streams.in_chunk(s, k).next().map_or(0, |x| x.0);
                    bad_tensor(
                        &self.specs[t].name,
                        format!(
                            "chunk {k} of the {} stream of the output was never completely written",
                            dtype_name(st.dtype)
                        ),
                    )
                    .with_path(self.out.dest())
                })?;
                list.push(r);
            }
            records.push(list);
        }
        let mut sums = Vec::with_capacity(self.specs.len());
        for (t, p) in self.parts.into_iter().enumerate() {
            let p = p
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let lens = self
                .streams
                .parts(t)
                .map(|p| p.in_tensor.end - p.in_tensor.start);
            let parts: Option<Vec<(Checksum, u64)>> = p
                .into_iter()
                .zip(lens)
                .map(|(c, l)| c.map(|c| (c, l)))
                .collect();
            // Every part is written once every chunk is (checked above).
            sums.push((
                self.specs[t].name.clone(),
                Checksum::combine(parts.unwrap_or_default()),
            ));
        }
        let meta = if checksums_enabled() {
            with_checksums(&self.metadata, sums)
        } else {
            self.metadata.clone()
        };
        let mut header = encode_header(
            &self.specs,
            &meta,
            &self.streams,
            &records,
            self.source_header.as_deref(),
        )
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
        let mut preamble = MAGIC_V2.to_vec();
        preamble.extend_from_slice(&reserved.to_le_bytes());
        preamble.extend_from_slice(&header);
        self.out.write_at(&preamble, 0)?;
        self.out.set_len(self.data_start + q.pos)?;
        self.out.commit()
    }
}

/// The header JSON (without preamble or padding) for `specs` laid out contiguously.
fn encode_header(
    specs: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
    streams: &Streams,
    records: &[Vec<Record>],
    source_header: Option<&str>,
) -> Result<Vec<u8>> {
    let mut obj = Map::new();
    if !metadata.is_empty() {
        obj.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).map_err(|e| bad(e.to_string()))?,
        );
    }
    let list: Vec<Value> = streams
        .streams
        .iter()
        .zip(records)
        .map(|(st, recs)| {
            let chunks: Vec<Value> = recs
                .iter()
                .map(|r| {
                    let planes: Vec<Value> = r
                        .planes
                        .iter()
                        .map(|&(c, l)| serde_json::json!([c.name(), l]))
                        .collect();
                    serde_json::json!({"at": r.at, "crc32c": r.crc, "planes": planes})
                })
                .collect();
            serde_json::json!({"dtype": dtype_name(st.dtype), "chunk_size": st.chunk_size, "chunks": chunks})
        })
        .collect();
    let mut own = Map::new();
    own.insert("streams".into(), Value::Array(list));
    if let Some(s) = source_header {
        own.insert("source_header".into(), Value::String(s.to_string()));
    }
    obj.insert(KEY.into(), Value::Object(own));
    let mut pos = 0u64;
    for t in specs {
        let n = byte_len(t.dtype, &t.shape)
            .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)))?;
        let end = pos.checked_add(n).ok_or_else(|| overflow("file size"))?;
        obj.insert(
            t.name.clone(),
            serde_json::json!({"dtype": dtype_name(t.dtype), "shape": t.shape, "data_offsets": [pos, end]}),
        );
        pos = end;
    }
    serde_json::to_vec(&Value::Object(obj)).map_err(|e| bad(e.to_string()))
}

/// Writes the safetensors file a `.ckptz` file was compressed from, byte for byte: its
/// recorded header text, then the uncompressed data area.
///
/// # Errors
/// A damaged chunk; I/O errors, with the path.
pub(crate) fn write_source(f: &TensorFile, header: &str, dest: &Path) -> Result<()> {
    use rayon::prelude::*;
    let out = StagedFile::create(dest)?;
    let n = header.len() as u64;
    let data_start = 8 + n;
    let mut jobs = Vec::new();
    let mut total = 0u64;
    for (i, t) in f.tensors().iter().enumerate() {
        let mut pos = 0;
        while pos < t.end - t.start {
            let end = (pos + crate::copy::SLAB_BYTES).min(t.end - t.start);
            jobs.push((i, pos..end));
            pos = end;
        }
        total = total.max(t.end);
    }
    out.set_len(data_start + total)?;
    let mut head = n.to_le_bytes().to_vec();
    head.extend_from_slice(header.as_bytes());
    out.write_at(&head, 0)?;
    jobs.par_iter()
        .try_for_each_init(super::ChunkCache::new, |cache, (i, range)| {
            let start = f.tensors()[*i].start;
            let bytes = f.read(*i, range.clone(), cache)?;
            out.write_at(bytes, data_start + start + range.start)
        })?;
    out.commit()
}
