//! `.ckptz` version 2: the header and the chunks of packed streams of byte planes.
//!
//! ```text
//! [8 bytes]  magic "CKPTZ\0\x02\0"
//! [8 bytes]  N: header length, u64 little-endian
//! [D bytes]  data area: chunks, each its planes back to back
//! [N bytes]  header: one zstd frame holding a UTF-8 JSON object
//! ```
//!
//! The header comes last and compressed: it is written once every chunk's place is
//! known, with no space reserved beforehand, and a model of many small tensors does not
//! pay for its tensor table raw (ResNet-20: a 30 kB table, 6 kB compressed, against
//! 1.1 MB of weights).
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

use super::chunks::{
    bad, chunk_size_for, unit_bytes, Body, ChunkLoc, Compression, PartialChunks, MAX_CHUNK_BYTES,
    MAX_HEADER_LEN,
};
use super::entropy::{decode_plane, encode_plane, PlaneCodec};
use super::pack::Streams;
use super::planes::PlaneSplit;
use crate::error::{overflow, Error, IoContext, Result};
use crate::formats::checksum::{checksums_enabled, Checksum};
use crate::formats::output::{temp_name, StagedFile};
use crate::formats::safetensors::{
    entry_fields, parse_description, split_header, with_checksums, TensorSpec,
};
use crate::formats::{bad_tensor, byte_len, TensorEntry, TensorFile};
use crate::layout::strategy::dtype_name;
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

/// The first 8 bytes of a version 2 file.
pub const MAGIC_V2: [u8; 8] = *b"CKPTZ\0\x02\0";

/// The header key of version 2's own description.
pub(crate) const KEY: &str = "__ckptz__";

/// The zstd level of the header: a small text, compressed once.
const HEADER_LEVEL: i32 = 9;

/// Compressed chunks a writer keeps in memory while they wait for their turn; past
/// this they wait in a spool file beside the output.
pub(crate) const HOLD_BYTES: u64 = 256 << 20;

/// The header text from its zstd frame (at most [`MAX_HEADER_LEN`] bytes).
///
/// # Errors
/// A frame that does not decompress, or to more than the limit.
pub(crate) fn decompress_header(frame: &[u8]) -> Result<Vec<u8>> {
    let limit = MAX_HEADER_LEN as usize;
    let declared = zstd::zstd_safe::get_frame_content_size(frame)
        .map_err(|_| bad("the header is not a zstd frame: damaged or truncated file?"))?;
    match declared {
        Some(n) if n > limit as u64 => Err(Error::HeaderTooLarge {
            len: n,
            max: MAX_HEADER_LEN,
        }),
        Some(n) => zstd::bulk::decompress(frame, n as usize)
            .map_err(|e| bad(format!("the header does not decompress: {e}"))),
        None => Err(bad("the header's zstd frame does not record its size")),
    }
}

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
    let described: Vec<(crate::layout::Dtype, u64)> =
        tensors.iter().map(|t| (t.dtype, t.end - t.start)).collect();
    // The chunk sizes come from the header: take them in stream order once the streams
    // are known to be the ones the tensors make.
    let mut streams = Streams::packed(&described, |_| 1)?;
    let listed: Vec<crate::layout::Dtype> = list
        .iter()
        .filter_map(|v| v.get("dtype").and_then(Value::as_str))
        .filter_map(|d| crate::layout::strategy::parse_dtype(d).ok())
        .collect();
    // When the listed dtypes are the tensors' own in another order, that order is the
    // writer's (see `Streams::follow`); anything else is refused per stream below.
    streams.follow(&listed);
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
        let unit = unit_bytes(st.dtype).max(split.width as u64);
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
    let plane_err = |j: usize, e: std::io::Error| std::io::Error::other(format!("plane {j}: {e}"));
    let got = if split.width == 1 {
        // In range: the header check keeps the planes inside the chunk read.
        let (codec, len) = planes[0];
        decode_plane(codec, &comp[..len as usize], out).map_err(|e| plane_err(0, e))?;
        crc32c::crc32c(out)
    } else {
        // Stored planes are joined straight from the bytes read; only the coded ones
        // (the exponent plane, mostly) are decoded into the thread's buffer first.
        PLANES.with(|p| -> std::io::Result<u32> {
            let mut p = p.borrow_mut();
            let coded = planes.iter().filter(|q| q.0 != PlaneCodec::Raw).count();
            p.resize(coded * n, 0);
            let (mut at, mut slot) = (0usize, 0usize);
            for (j, &(codec, len)) in planes.iter().enumerate() {
                let src = &comp[at..at + len as usize];
                if codec == PlaneCodec::Raw {
                    if src.len() != n {
                        return Err(plane_err(
                            j,
                            std::io::Error::other(format!(
                                "raw plane of {} bytes, {n} expected",
                                src.len()
                            )),
                        ));
                    }
                } else {
                    decode_plane(codec, src, &mut p[slot * n..(slot + 1) * n])
                        .map_err(|e| plane_err(j, e))?;
                    slot += 1;
                }
                at += len as usize;
            }
            let (mut at, mut slot) = (0usize, 0usize);
            let mut parts: Vec<&[u8]> = Vec::with_capacity(planes.len());
            for &(codec, len) in planes {
                if codec == PlaneCodec::Raw {
                    parts.push(&comp[at..at + n]);
                } else {
                    parts.push(&p[slot * n..(slot + 1) * n]);
                    slot += 1;
                }
                at += len as usize;
            }
            Ok(split.join_crc(&parts, out))
        })?
    };
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

/// One chunk coded as version 2 writes it, held in memory: for benchmarks and other
/// programs that time the chunk codec apart from the file around it.
#[derive(Clone, Debug)]
pub struct CodedChunk {
    /// The planes back to back, as stored in the data area.
    pub bytes: Vec<u8>,
    planes: Vec<(PlaneCodec, u64)>,
    split: PlaneSplit,
    raw_len: usize,
    crc: u32,
}

impl CodedChunk {
    /// Codes `raw` (whole elements of `dtype`) at zstd `level`, as the writer does.
    ///
    /// # Errors
    /// zstd's errors.
    pub fn encode(
        raw: &[u8],
        dtype: crate::layout::Dtype,
        level: i32,
    ) -> std::io::Result<CodedChunk> {
        let split = PlaneSplit::of(dtype);
        let mut bytes = Vec::new();
        let planes = encode_chunk(raw, split, level, &mut bytes)?;
        Ok(CodedChunk {
            bytes,
            planes,
            split,
            raw_len: raw.len(),
            crc: crc32c::crc32c(raw),
        })
    }

    /// Decodes into `out` (resized to the raw length), checking the CRC, as the reader
    /// does.
    ///
    /// # Errors
    /// A CRC mismatch; zstd's errors.
    pub fn decode(&self, out: &mut Vec<u8>) -> std::io::Result<()> {
        decode_chunk(
            &self.bytes,
            &self.planes,
            self.split,
            self.raw_len,
            self.crc,
            out,
        )
    }
}

/// The planes of an encoded chunk: codec and stored length of each.
type Planes = Vec<(PlaneCodec, u64)>;

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
    /// The encoded bytes, the planes, the CRC.
    Memory(Vec<u8>, Planes, u32),
    /// Where in the spool and how long, the planes, the CRC.
    Spooled(u64, u64, Planes, u32),
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
    pending: PartialChunks,
    /// Per tensor, per part: the CRC-32C of the part once its chunk is complete.
    parts: Vec<Mutex<Vec<Option<Checksum>>>>,
    seq: Mutex<Sequencer>,
    /// Held bytes kept in memory ([`HOLD_BYTES`]; the tests lower it to use the spool).
    hold: u64,
    /// Whether checksums are recorded: the setting when the writer was created (it
    /// may be finished on a pool thread, which does not see the caller's setting).
    sums: bool,
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
        // The largest the data area can get (zstd's bound on every plane), checked once
        // here so that the positions added up as chunks are placed cannot wrap.
        let mut bound = 16u64;
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
            data_start: 16,
            order,
            pending: PartialChunks::default(),
            parts,
            seq: Mutex::new(Sequencer {
                records: vec![None; n],
                ..Sequencer::default()
            }),
            hold: HOLD_BYTES,
            sums: checksums_enabled(),
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
        self.pending.write(
            s,
            range.start,
            bytes,
            st.chunk_size,
            |k| st.chunk_range(k),
            |k, raw| self.emit(s, k, raw),
        )
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
            let held = if q.held_bytes + len <= self.hold {
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
        let meta = if self.sums {
            with_checksums(&self.metadata, sums)
        } else {
            self.metadata.clone()
        };
        let header = encode_header(
            &self.specs,
            &meta,
            &self.streams,
            &records,
            self.source_header.as_deref(),
        )
        .map_err(|e| e.with_path(self.out.dest()))?;
        if header.len() as u64 > MAX_HEADER_LEN {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: the header for {} tensors would take {} bytes, over the {}-byte limit: split the output into more files (--max-shard-size)",
                    self.out.dest().display(),
                    self.specs.len(),
                    header.len(),
                    MAX_HEADER_LEN
                ),
            });
        }
        // With zstd's checksum: a damaged header is named as such, not misparsed.
        let frame = zstd::bulk::Compressor::new(HEADER_LEVEL)
            .and_then(|mut c| {
                c.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true))?;
                c.compress(&header)
            })
            .at(self.out.dest())?;
        let mut preamble = MAGIC_V2.to_vec();
        preamble.extend_from_slice(&(frame.len() as u64).to_le_bytes());
        self.out.write_at(&frame, self.data_start + q.pos)?;
        self.out.write_at(&preamble, 0)?;
        self.out
            .set_len(self.data_start + q.pos + frame.len() as u64)?;
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
            let end = (pos + crate::formats::SLAB_BYTES).min(t.end - t.start);
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
        .try_for_each_init(crate::formats::ReadCache::new, |cache, (i, range)| {
            let start = f.tensors()[*i].start;
            let bytes = f.read(*i, range.clone(), cache)?;
            out.write_at(bytes, data_start + start + range.start)
        })?;
    out.commit()
}

#[cfg(test)]
mod tests {
    use super::super::{parse_header, MAGIC};
    use super::*;
    use crate::formats::{FileFormat, ReadCache as ChunkCache};
    use crate::layout::Dtype;

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Float-like bytes: a slowly varying exponent byte, noisy low bytes.
    fn bytes(seed: usize, n: usize) -> Vec<u8> {
        let mut x = (seed as u32).wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|i| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                if i % 4 == 3 {
                    0x3C + (x >> 30) as u8
                } else {
                    (x >> 24) as u8
                }
            })
            .collect()
    }

    /// The reader's join of planes held apart (stored ones read in place, coded ones
    /// decoded aside) and its CRC in the same pass: every width, every mix of stored
    /// and coded planes, chunk lengths around the join's block size, and a damaged
    /// CRC named.
    #[test]
    fn decode_chunk_gives_the_raw_bytes_for_every_width_and_plane_mix() {
        let mut out = Vec::new();
        for dtype in [Dtype::U8, Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::F64] {
            let split = PlaneSplit::of(dtype);
            for elems in [1usize, 7, 8191, 8192, 8193, 70_001] {
                let raw = bytes(elems, elems * split.width);
                let mut comp = Vec::new();
                let planes = encode_chunk(&raw, split, 1, &mut comp).unwrap();
                let crc = crc32c::crc32c(&raw);
                decode_chunk(&comp, &planes, split, raw.len(), crc, &mut out).unwrap();
                assert!(out == raw, "{dtype:?} x {elems}: {planes:?}");
                // Every plane stored, every plane coded, and alternately (the writer's
                // choice above depends on the bytes).
                let n = elems;
                let mut planar = vec![0; raw.len()];
                split.split(&raw, &mut planar);
                let stored: Vec<(PlaneCodec, u64)> = vec![(PlaneCodec::Raw, n as u64); split.width];
                decode_chunk(&planar, &stored, split, raw.len(), crc, &mut out).unwrap();
                assert!(out == raw, "{dtype:?} x {elems}, all stored");
                let mut coded = Vec::new();
                let mut table = Vec::new();
                for j in 0..split.width {
                    let f = zstd::bulk::compress(&planar[j * n..(j + 1) * n], 1).unwrap();
                    table.push((PlaneCodec::Zstd, f.len() as u64));
                    coded.extend_from_slice(&f);
                }
                decode_chunk(&coded, &table, split, raw.len(), crc, &mut out).unwrap();
                assert!(out == raw, "{dtype:?} x {elems}, all coded");
                let (mut mixed, mut mtable) = (Vec::new(), Vec::new());
                for j in 0..split.width {
                    let plane = &planar[j * n..(j + 1) * n];
                    if j % 2 == 0 {
                        mixed.extend_from_slice(plane);
                        mtable.push((PlaneCodec::Raw, n as u64));
                    } else {
                        let f = zstd::bulk::compress(plane, 1).unwrap();
                        mtable.push((PlaneCodec::Zstd, f.len() as u64));
                        mixed.extend_from_slice(&f);
                    }
                }
                decode_chunk(&mixed, &mtable, split, raw.len(), crc, &mut out).unwrap();
                assert!(out == raw, "{dtype:?} x {elems}, mixed");
                let e = decode_chunk(&comp, &planes, split, raw.len(), crc ^ 1, &mut out)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("CRC-32C"), "{e}");
            }
        }
    }

    /// A mix: many tiny tensors of two dtypes interleaved, an empty one, a scalar, an
    /// integer vector, a large one.
    fn specs() -> Vec<TensorSpec> {
        let mut v = Vec::new();
        for i in 0..40 {
            v.push(spec(&format!("bn{i:02}.w"), Dtype::F32, &[3 + i % 5]));
            v.push(spec(&format!("bn{i:02}.h"), Dtype::BF16, &[2, 1 + i % 3]));
        }
        v.push(spec("empty", Dtype::F32, &[0, 4]));
        v.push(spec("scalar", Dtype::F64, &[]));
        v.push(spec("steps", Dtype::I64, &[3]));
        v.push(spec("big", Dtype::F32, &[50, 33]));
        v.push(spec("tail", Dtype::F16, &[7]));
        v
    }

    /// Writes `specs` in chunks of `chunk` bytes, each tensor in pieces of `piece`
    /// bytes, the pieces in the order `order` gives them, from `threads` threads.
    fn write(
        dest: &Path,
        specs: &[TensorSpec],
        chunk: u64,
        piece: usize,
        threads: usize,
        hold: u64,
        reverse: bool,
    ) -> Vec<Vec<u8>> {
        use rayon::prelude::*;
        let c = Compression {
            level: 1,
            chunk_bytes: chunk,
        };
        let mut w = CkptzWriter::create(dest, specs, &BTreeMap::new(), c).unwrap();
        w.hold = hold;
        let data: Vec<Vec<u8>> = specs
            .iter()
            .enumerate()
            .map(|(i, t)| bytes(i, byte_len(t.dtype, &t.shape).unwrap() as usize))
            .collect();
        let mut jobs: Vec<(usize, usize)> = Vec::new();
        for (i, d) in data.iter().enumerate() {
            jobs.extend((0..d.len()).step_by(piece).map(|s| (i, s)));
        }
        if reverse {
            jobs.reverse();
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            jobs.par_iter().for_each(|&(i, s)| {
                let e = (s + piece).min(data[i].len());
                w.write_at(i, s as u64, &data[i][s..e]).unwrap();
            });
        });
        w.finish().unwrap();
        data
    }

    /// Found by the fuzz target: empty tensors of several dtypes at one offset, named so
    /// that name order is not the writer's order (`t10` sorts before `t2`), left the
    /// order of the streams to the reader's tie-break, and the writer's own file was
    /// refused. The header's order decides.
    #[test]
    fn empty_tensors_first_do_not_reorder_the_streams() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.ckptz");
        // Written streams: F32, F16, BF16; by name among the empty ones at offset 20:
        // t1 (F32), t10 (BF16), t2 (F16).
        let mut specs = vec![spec("t0", Dtype::F32, &[5]), spec("t1", Dtype::F32, &[0])];
        specs.push(spec("t2", Dtype::F16, &[0]));
        specs.extend((3..10).map(|i| spec(&format!("t{i}"), Dtype::F32, &[0])));
        specs.push(spec("t10", Dtype::BF16, &[0]));
        specs.push(spec("t11", Dtype::F16, &[3]));
        specs.push(spec("t12", Dtype::BF16, &[3]));
        let data = write(&p, &specs, 8, 3, 1, HOLD_BYTES, false);
        let f = TensorFile::open(&p).unwrap();
        let mut cache = ChunkCache::new();
        for (i, t) in specs.iter().enumerate() {
            let k = f.find(&t.name).unwrap();
            let n = data[i].len() as u64;
            assert_eq!(
                f.read(k, 0..n, &mut cache).unwrap(),
                &data[i][..],
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn round_trips_every_range_and_records_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.ckptz");
        let specs = specs();
        for chunk in [8u64, 60, 1 << 20] {
            let data = write(&p, &specs, chunk, 10, 2, HOLD_BYTES, true);
            let bytes = std::fs::read(&p).unwrap();
            assert!(bytes.starts_with(&MAGIC));
            let f = TensorFile::open(&p).unwrap();
            assert_eq!(f.format(), FileFormat::Ckptz);
            let mut cache = ChunkCache::new();
            for (i, t) in specs.iter().enumerate() {
                let k = f.find(&t.name).unwrap();
                let e = &f.tensors()[k];
                assert_eq!((e.dtype, &e.shape), (t.dtype, &t.shape));
                let n = data[i].len() as u64;
                assert_eq!(f.read(k, 0..n, &mut cache).unwrap(), &data[i][..]);
                for lo in (0..n).step_by(3) {
                    for hi in (lo..n.min(lo + 70)).step_by(5) {
                        let mut dst = vec![0; (hi - lo) as usize];
                        f.read_into(k, lo..hi, &mut dst, &mut cache).unwrap();
                        assert_eq!(dst, &data[i][lo as usize..hi as usize], "{}", t.name);
                    }
                }
                assert!(
                    f.check_checksum(k).unwrap(),
                    "{}: checksum recorded",
                    t.name
                );
                assert_eq!(f.chunked().unwrap().decoded_checksum(k), f.checksum(k));
            }
        }
    }

    #[test]
    fn the_same_input_gives_the_same_bytes_whatever_the_order_and_threads() {
        let dir = tempfile::tempdir().unwrap();
        let specs = specs();
        let mut files = Vec::new();
        // Forward on one thread (chunks arrive in turn), backward on 1 and 4 threads
        // (all held), and with the spool for every chunk held.
        for (n, (threads, hold, reverse)) in [
            (1, HOLD_BYTES, false),
            (1, HOLD_BYTES, true),
            (4, HOLD_BYTES, true),
            (4, 0, true),
            (3, 100, false),
        ]
        .into_iter()
        .enumerate()
        {
            let p = dir.path().join(format!("x{n}.ckptz"));
            write(&p, &specs, 64, 7, threads, hold, reverse);
            files.push(std::fs::read(&p).unwrap());
        }
        for f in &files[1..] {
            assert!(*f == files[0]);
        }
        // Nothing left beside the outputs (the spool was unlinked at once).
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), files.len());
    }

    #[test]
    fn small_tensors_share_chunks() {
        // 2000 tensors of 16 F32 against one tensor of the same bytes: the same planes.
        let dir = tempfile::tempdir().unwrap();
        let many: Vec<TensorSpec> = (0..2000)
            .map(|i| spec(&format!("t{i:04}"), Dtype::F32, &[16]))
            .collect();
        let one = [spec("t", Dtype::F32, &[32_000])];
        let data_len = |specs: &[TensorSpec]| {
            let p = dir.path().join("x.ckptz");
            let c = Compression::default();
            let w = CkptzWriter::create(&p, specs, &BTreeMap::new(), c).unwrap();
            let all = bytes(7, 128_000);
            for (i, _) in specs.iter().enumerate() {
                let n = 128_000 / specs.len();
                w.write_at(i, 0, &all[i * n..(i + 1) * n]).unwrap();
            }
            w.finish().unwrap();
            let b = std::fs::read(&p).unwrap();
            let h = parse_header(&b, b.len() as u64).unwrap();
            assert_eq!(h.body.chunks[0].len(), 1);
            // The data area: between the preamble and the header.
            let n = u64::from_le_bytes(b[8..16].try_into().unwrap());
            b.len() as u64 - h.data_start - n
        };
        assert_eq!(data_len(&many), data_len(&one));
    }

    #[test]
    fn a_read_decodes_only_the_chunks_it_covers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.ckptz");
        let specs = [spec("a", Dtype::F32, &[10]), spec("w", Dtype::F32, &[100])];
        let data = write(&p, &specs, 40, 400, 1, HOLD_BYTES, false);
        let f = TensorFile::open(&p).unwrap();
        let c = f.chunked().unwrap();
        // One stream: a is [0, 40), w [40, 440): chunks of 40 bytes, 11 of them.
        assert_eq!(c.chunk_count(0), 11);
        let mut cache = ChunkCache::new();
        // w's bytes [85, 125) are stream bytes [125, 165): chunks 3 and 4.
        assert_eq!(f.read(1, 85..125, &mut cache).unwrap(), &data[1][85..125]);
        let decoded: Vec<usize> = (0..11)
            .filter(|&k| cache.entries.iter().any(|e| e.1 == 0 && e.2 == k))
            .collect();
        assert_eq!(decoded, [3, 4]);
        assert_eq!(c.decoded_checksum(1), None);
    }

    /// A small file, its header edited by `edit`.
    fn edited(edit: impl Fn(&mut Value)) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.ckptz");
        let specs = [spec("a", Dtype::BF16, &[8]), spec("i", Dtype::U8, &[8])];
        write(&p, &specs, 8, 16, 1, HOLD_BYTES, false);
        let bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
        let at = bytes.len() - n;
        let mut doc: Value =
            serde_json::from_slice(&decompress_header(&bytes[at..]).unwrap()).unwrap();
        edit(&mut doc);
        let frame = zstd::bulk::compress(&serde_json::to_vec(&doc).unwrap(), 1).unwrap();
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&(frame.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes[16..at]);
        out.extend_from_slice(&frame);
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
        let e = err(&edited(|d| d[KEY]["streams"][0]["dtype"] = "F32".into()));
        assert!(
            e.starts_with("invalid .ckptz header: stream 0 (BF16): `dtype` \"F32\""),
            "{e}"
        );
        let e = err(&edited(|d| {
            d[KEY]["streams"][0]["chunks"][0]["planes"]
                .as_array_mut()
                .unwrap()
                .pop();
        }));
        assert!(
            e.contains("chunk 0: 1 plane(s) listed, the dtype has 2"),
            "{e}"
        );
        let e = err(&edited(|d| {
            d[KEY]["streams"][0]["chunks"][0]["planes"][0] = serde_json::json!(["huff", 4]);
        }));
        assert!(e.contains("unknown codec `huff`"), "{e}");
        let e = err(&edited(|d| d[KEY]["streams"][1]["chunk_size"] = 0.into()));
        assert!(e.contains("stream 1 (U8): `chunk_size` must be"), "{e}");
        let e = err(&edited(|d| {
            d[KEY]["streams"].as_array_mut().unwrap().pop();
        }));
        assert!(
            e.contains("lists 1 stream(s), the tensors' dtypes make 2"),
            "{e}"
        );
        let e = err(&edited(|d| d[KEY]["source_header"] = "{}".into()));
        assert!(e.contains("does not describe the file's tensors"), "{e}");
        let e = err(&edited(|d| d[KEY]["extra"] = 1.into()));
        assert!(e.contains("unknown field `extra`"), "{e}");
        let e = err(&edited(|d| d["a"]["codec"] = "zstd".into()));
        assert_eq!(e, "tensor `a`: unknown field `codec`");
        let e = err(&edited(|d| {
            let c = d[KEY]["streams"][0]["chunks"][0].clone();
            d[KEY]["streams"][0]["chunks"][1]["at"] = c["at"].clone();
        }));
        assert!(
            e.contains("chunk 1: compressed chunk [0, 8) overlaps another chunk"),
            "{e}"
        );
        let e = err(&edited(|d| {
            d[KEY]["streams"][1]["chunks"][0]["at"] = 17.into()
        }));
        assert!(e.contains("past the end of the data area"), "{e}");
        // Truncated, damaged or oversized header frames.
        assert!(
            err(&ok[..ok.len() - 1]).contains("header"),
            "{}",
            err(&ok[..ok.len() - 1])
        );
        let mut big = ok.clone();
        big[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_header(&big, big.len() as u64),
            Err(Error::HeaderTooLarge { .. })
        ));
        let mut long = ok.clone();
        long[8..16].copy_from_slice(&(ok.len() as u64).to_le_bytes());
        assert!(
            err(&long).contains("does not fit in the file"),
            "{}",
            err(&long)
        );
        // A later version is its own error.
        let mut later = ok.clone();
        later[6] = 9;
        assert!(matches!(
            parse_header(&later, later.len() as u64),
            Err(Error::CkptzVersion { version: 9, .. })
        ));
    }

    #[test]
    fn a_damaged_plane_is_a_named_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.ckptz");
        let specs = [spec("w", Dtype::F32, &[64])];
        write(&p, &specs, 64, 256, 1, HOLD_BYTES, false);
        let mut bytes = std::fs::read(&p).unwrap();
        // The last chunk's first plane is raw noise: a flipped bit there only the CRC
        // sees.
        let n = bytes.len();
        let h = parse_header(&bytes, n as u64).unwrap();
        let ChunkLoc::V2 { at, ref planes, .. } = h.body.chunks[0][3] else {
            panic!("version 2 expected")
        };
        assert_eq!(planes[0].0, PlaneCodec::Raw);
        bytes[(h.data_start + at) as usize] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let f = TensorFile::open(&p).unwrap();
        let e = f.read(0, 200..256, &mut ChunkCache::new()).unwrap_err();
        assert!(matches!(e, Error::CorruptChunk { chunk: 3, .. }), "{e}");
        assert!(
            e.to_string().contains("CRC-32C of the decoded bytes"),
            "{e}"
        );
        assert!(f.read(0, 0..192, &mut ChunkCache::new()).is_ok());
    }
}
