//! Strict, zero-copy safetensors reading (memory-mapped) and streaming, atomic writing.
//!
//! The reader validates the whole header before trusting any of it, in the order of
//! the reference implementation, but every error names the tensor at fault.

use super::{byte_len, FileFormat, Mapped, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::formats::checksum::{
    checksums_enabled, encode_checksums, recorded_checksums, Checksum, Recorded, CHECKSUMS_KEY,
    CHUNK,
};
use crate::formats::output::StagedFile;
use crate::json::{Members, Object};
use crate::layout::plan::DCP_SHARDING_INFO;
use crate::layout::strategy::{dtype_name, parse_dtype};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Largest header accepted (the reference implementation's limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

fn bad(problem: impl Into<String>) -> Error {
    Error::InvalidHeader {
        problem: problem.into(),
    }
}

fn bad_tensor(tensor: &str, problem: impl Into<String>) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem: problem.into(),
    }
}

/// Whether the first bytes look like safetensors: an 8-byte length, then a JSON object.
pub(crate) fn looks_like(head: &[u8]) -> bool {
    head.len() > 8 && head[8] == b'{'
}

/// Reads a mapped safetensors file: its header, and for PyTorch DCP's sharded
/// safetensors the offset of each box in the global tensor (`DCP_SHARDING_INFO`).
pub(crate) fn read(path: &Path, map: Option<Mapped>) -> Result<TensorFile> {
    let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
    let (data_start, mut tensors, metadata) = parse_header(bytes).map_err(|e| e.with_path(path))?;
    for t in &mut tensors {
        // Cannot wrap: the header check keeps both inside the file.
        t.start += data_start;
        t.end += data_start;
    }
    apply_dcp_offsets(&mut tensors, &metadata).map_err(|e| e.with_path(path))?;
    let sums = match metadata.get(CHECKSUMS_KEY) {
        Some(text) => recorded_checksums(text, tensors.iter().map(|t| &*t.name))
            .map_err(|e| e.with_path(path))?,
        None => Recorded::ByName(BTreeMap::new()),
    };
    let mut file = TensorFile::from_parts(path, map, FileFormat::Safetensors, tensors, metadata)?;
    file.set_recorded(sums).map_err(|e| e.with_path(path))?;
    Ok(file)
}

/// Parses and validates a header: length, UTF-8, JSON, every entry's dtype, shape and
/// offsets, no overlap, no gap, and the file length exact.
/// Returns the data area's start, the tensors sorted by offset, and `__metadata__`.
///
/// # Errors
/// The first problem found, naming the tensor where there is one.
#[allow(clippy::type_complexity)]
pub fn parse_header(bytes: &[u8]) -> Result<(u64, Vec<TensorEntry>, BTreeMap<String, String>)> {
    let len = bytes.len() as u64;
    if len < 8 {
        return Err(bad(format!(
            "file of {len} bytes is too short for the 8-byte header length"
        )));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().map_err(|_| bad("short"))?);
    if n > MAX_HEADER_LEN {
        return Err(Error::HeaderTooLarge {
            len: n,
            max: MAX_HEADER_LEN,
        });
    }
    let data_start = n.checked_add(8).ok_or_else(|| overflow("header length"))?;
    if data_start > len {
        return Err(bad(format!(
            "header of {n} bytes runs past the end of the file ({len} bytes): truncated?"
        )));
    }
    let header = &bytes[8..data_start as usize];
    let data_len = len - data_start;
    let (mut tensors, metadata) = match well_formed_header(header, data_len) {
        Some(parsed) => parsed,
        None => {
            let (obj, metadata) = split_header(header, bad)?;
            let mut tensors = Vec::with_capacity(obj.len());
            for (name, v) in &obj {
                tensors.push(parse_entry(name, v, data_len)?);
            }
            (tensors, metadata)
        }
    };
    tensors.sort_by_key(|a| (a.start, a.end));
    let mut pos = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if t.start < pos {
            return Err(bad_tensor(
                &t.name,
                format!(
                    "data_offsets [{}, {}) overlap tensor `{}`",
                    t.start,
                    t.end,
                    tensors[i - 1].name
                ),
            ));
        }
        if t.start > pos {
            return Err(bad_tensor(
                &t.name,
                format!(
                    "data_offsets start at {} leaving a gap after byte {pos}",
                    t.start
                ),
            ));
        }
        pos = t.end;
    }
    if pos != data_len {
        return Err(bad(format!(
            "tensors end at byte {pos} of a data area of {data_len} bytes (trailing bytes)"
        )));
    }
    Ok((data_start, tensors, metadata))
}

/// One entry of a well-formed header, as the JSON says it: exactly these three fields,
/// each once (read through [`Object`], which refuses the array form a derived parser
/// would also take). The dtype is a name, checked by [`checked_entry`]'s caller (a
/// derived `Dtype` would also take the object form `{"F32": null}`).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WellFormedEntry<'a> {
    #[serde(borrow)]
    dtype: std::borrow::Cow<'a, str>,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// The entries (in name order, as the checked parse gives them) and `__metadata__` of
/// a header that is well formed, parsed straight into their types: no JSON tree, whose
/// building and freeing cost more than the rest of opening a file of many small
/// tensors. `None` on anything else (bad JSON, a wrong type, an unknown field, a name
/// twice, an entry that fails its checks): the checked parse then finds the problem
/// and names it, so both paths accept the same headers with the same result.
fn well_formed_header(
    header: &[u8],
    data_len: u64,
) -> Option<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    struct Visit;
    type Parsed<'de> = (
        Vec<(String, WellFormedEntry<'de>)>,
        Option<BTreeMap<String, String>>,
    );
    impl<'de> serde::de::Visitor<'de> for Visit {
        type Value = Parsed<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a safetensors header")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Parsed<'de>, A::Error> {
            let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0));
            let mut metadata = None;
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == "__metadata__" {
                    if metadata.is_some() {
                        return Err(serde::de::Error::custom("`__metadata__` twice"));
                    }
                    metadata = Some(map.next_value()?);
                } else {
                    let Object(entry) = map.next_value()?;
                    entries.push((key.into_owned(), entry));
                }
            }
            Ok((entries, metadata))
        }
    }
    let text = std::str::from_utf8(header).ok()?;
    let mut de = serde_json::Deserializer::from_str(text);
    let (mut entries, metadata) = serde::Deserializer::deserialize_map(&mut de, Visit).ok()?;
    de.end().ok()?;
    entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    if entries.windows(2).any(|w| w[0].0 == w[1].0) {
        return None;
    }
    let tensors = entries
        .into_iter()
        .map(|(name, e)| {
            let [start, end] = e.data_offsets;
            let dtype = parse_dtype(&e.dtype).ok()?;
            checked_entry(name, dtype, e.shape, start, end, data_len).ok()
        })
        .collect::<Option<Vec<_>>>()?;
    Some((tensors, metadata.unwrap_or_default()))
}

/// A JSON header as its tensor entries and its `__metadata__` (strings only), each
/// problem made an error by `bad` (every format names its own header).
pub(crate) fn split_header(
    bytes: &[u8],
    bad: fn(String) -> Error,
) -> Result<(Map<String, Value>, BTreeMap<String, String>)> {
    let text = std::str::from_utf8(bytes).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
    let Value::Object(mut obj) =
        serde_json::from_str(text).map_err(|e| bad(format!("header is not JSON: {e}")))?
    else {
        return Err(bad("header must be a JSON object".into()));
    };
    let mut metadata = BTreeMap::new();
    if let Some(v) = obj.remove("__metadata__") {
        let m = v
            .as_object()
            .ok_or_else(|| bad("`__metadata__` must be an object of strings".into()))?;
        for (k, v) in m {
            let s = v
                .as_str()
                .ok_or_else(|| bad(format!("`__metadata__.{k}` must be a string")))?;
            metadata.insert(k.clone(), s.to_string());
        }
    }
    Ok((obj, metadata))
}

fn parse_entry(name: &str, v: &Value, data_len: u64) -> Result<TensorEntry> {
    let obj = entry_fields(name, v, &["dtype", "shape", "data_offsets"])?;
    parse_description(name, obj, data_len)
}

/// Header entry `name` as an object holding no field but `fields`.
pub(crate) fn entry_fields<'a>(
    name: &str,
    v: &'a Value,
    fields: &[&str],
) -> Result<&'a Map<String, Value>> {
    let obj = v
        .as_object()
        .ok_or_else(|| bad_tensor(name, "entry must be an object"))?;
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(bad_tensor(name, format!("unknown field `{k}`")));
    }
    Ok(obj)
}

/// An entry's `dtype`, `shape` and `data_offsets` (inside `data_len`, spanning exactly
/// shape x dtype), as a [`TensorEntry`] with offsets relative to the data area.
pub(crate) fn parse_description(
    name: &str,
    obj: &Map<String, Value>,
    data_len: u64,
) -> Result<TensorEntry> {
    let dtype = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad_tensor(name, "missing `dtype`"))
        .and_then(|d| parse_dtype(d).map_err(|e| bad_tensor(name, e)))?;
    let shape = obj
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
        .ok_or_else(|| bad_tensor(name, "`shape` must be an array of non-negative integers"))?;
    let offs = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
        .filter(|a| a.len() == 2)
        .ok_or_else(|| bad_tensor(name, "`data_offsets` must be [start, end]"))?;
    checked_entry(name.to_string(), dtype, shape, offs[0], offs[1], data_len)
}

/// An entry's description as a [`TensorEntry`] once checked: offsets in order, inside
/// `data_len`, and spanning exactly `shape` x `dtype`.
fn checked_entry(
    name: String,
    dtype: crate::layout::Dtype,
    shape: Vec<u64>,
    start: u64,
    end: u64,
    data_len: u64,
) -> Result<TensorEntry> {
    if end < start {
        return Err(bad_tensor(
            &name,
            format!("data_offsets [{start}, {end}) end before they start"),
        ));
    }
    if end > data_len {
        return Err(bad_tensor(
            &name,
            format!("data_offsets [{start}, {end}) run past the end of the data ({data_len} bytes): truncated file?"),
        ));
    }
    let want = byte_len(dtype, &shape).ok_or_else(|| {
        bad_tensor(
            &name,
            format!(
                "shape {shape:?} of {} does not make whole bytes or overflows",
                dtype_name(dtype)
            ),
        )
    })?;
    if end - start != want {
        return Err(bad_tensor(
            &name,
            format!(
                "{} x {shape:?} needs {want} bytes but data_offsets span {}",
                dtype_name(dtype),
                end - start
            ),
        ));
    }
    Ok(TensorEntry {
        name,
        dtype,
        shape,
        start,
        end,
        offsets: None,
    })
}

/// Sets each tensor's `offsets` from PyTorch DCP's `DCP_SHARDING_INFO` metadata, when
/// there is some (also for a `.ckptz` file compressed from such a file).
pub(crate) fn apply_dcp_offsets(
    tensors: &mut [TensorEntry],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    if let Some(text) = metadata.get(DCP_SHARDING_INFO) {
        // Most files list their boxes in the order of their tensors (ckpt's leave out
        // the blocked ones, whose boxes its strategy places): then each takes
        // its own with no map of names (one copy of every name and a tree's
        // comparisons of names with long shared prefixes, for each of 50,000 tensors
        // a file). Otherwise by name, below.
        if let Ok(Members(saved)) = serde_json::from_str::<Members<Object<Saved>>>(text) {
            if let Some(saved) = Members(saved).in_order_of(tensors.iter().map(|t| &*t.name)) {
                for (t, s) in tensors.iter_mut().zip(saved) {
                    t.offsets = s.map(|Object(s)| s.saved_offsets);
                }
                return Ok(());
            }
        }
        let mut offsets = parse_dcp_offsets(text).map_err(bad)?;
        for t in tensors {
            t.offsets = offsets.remove(&t.name);
        }
    }
    Ok(())
}

/// One entry of `DCP_SHARDING_INFO` as ckpt reads it (other fields are DCP's).
#[derive(serde::Deserialize)]
struct Saved {
    saved_offsets: Vec<u64>,
}

/// Parses `{"name": {"saved_offsets": [..]}, ...}`.
fn parse_dcp_offsets(text: &str) -> std::result::Result<BTreeMap<String, Vec<u64>>, String> {
    // Straight into the types when well formed (an object per tensor holding integer
    // `saved_offsets`, other fields being DCP's and not ours); otherwise the checked
    // path below says what is wrong.
    if let Ok(saved) = serde_json::from_str::<BTreeMap<String, Object<Saved>>>(text) {
        return Ok(saved
            .into_iter()
            .map(|(name, Object(s))| (name, s.saved_offsets))
            .collect());
    }
    let doc: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{DCP_SHARDING_INFO} is not JSON: {e}"))?;
    let obj = doc
        .as_object()
        .ok_or_else(|| format!("{DCP_SHARDING_INFO} must be an object"))?;
    let mut out = BTreeMap::new();
    for (name, v) in obj {
        let offs = v
            .get("saved_offsets")
            .and_then(|o| o.as_array())
            .and_then(|a| {
                a.iter()
                    .map(serde_json::Value::as_u64)
                    .collect::<Option<Vec<u64>>>()
            })
            .ok_or_else(|| {
                format!("{DCP_SHARDING_INFO}: `{name}` has no integer `saved_offsets`")
            })?;
        out.insert(name.clone(), offs);
    }
    Ok(out)
}

pub(crate) use super::writer::TensorSpec;
use super::writer::WritePart;

/// A safetensors file being written: the header is laid out first, then data arrives
/// by positional writes (from any thread) at each tensor's place; the file is written
/// under a temporary name and renamed only by [`SafetensorsWriter::finish`].
///
/// Each write is hashed as it passes; `finish` combines the hashes into one checksum
/// per tensor and rewrites the header with them in `__metadata__` (the header was laid
/// out with placeholders of the same length, so no byte of data moves).
#[derive(Debug)]
pub struct SafetensorsWriter {
    out: StagedFile,
    data_start: u64,
    offsets: Vec<u64>,
    specs: Vec<TensorSpec>,
    metadata: BTreeMap<String, String>,
    /// Per tensor: `(offset, length, checksum)` of every write; `None` without checksums.
    written: Option<Vec<Mutex<Written>>>,
}

/// `(offset, length, checksum)` of each write to one tensor.
type Written = Vec<(u64, u64, Checksum)>;

/// Serialises a header: entries in the given order, offsets contiguous, padded with
/// spaces to a multiple of 8 bytes. Returns the bytes (with the length prefix) and each
/// tensor's data offset.
///
/// # Errors
/// Sizes that do not make whole bytes or overflow.
pub fn encode_header(
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<u64>)> {
    let mut pos = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len() + 1);
    for t in tensors {
        let n = byte_len(t.dtype, &t.shape)
            .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)))?;
        offsets.push(pos);
        pos = pos.checked_add(n).ok_or_else(|| overflow("file size"))?;
    }
    offsets.push(pos);
    // The text of a JSON object with the keys sorted (readers take the order from the
    // offsets), written straight from the specs: the same bytes as serde_json's map of
    // `Value`s, whose building and freeing took a tenth of a merge of 50,000 tensors.
    // As in a map, a later key replaces an earlier equal one: `__metadata__` is the
    // first inserted (`None`), then the tensors in order.
    let mut keys: Vec<(&str, Option<usize>)> = Vec::with_capacity(tensors.len() + 1);
    if !metadata.is_empty() {
        keys.push(("__metadata__", None));
    }
    keys.extend(
        tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), Some(i))),
    );
    // Stable: equal keys keep their order of insertion, and the last one is written.
    keys.sort_by(|a, b| a.0.cmp(b.0));
    let json = |e: serde_json::Error| bad(e.to_string());
    let mut text: Vec<u8> = Vec::with_capacity(64 * keys.len() + 64);
    text.push(b'{');
    for (k, run) in keys.chunk_by(|a, b| a.0 == b.0).enumerate() {
        let (name, what) = run[run.len() - 1];
        if k > 0 {
            text.push(b',');
        }
        serde_json::to_writer(&mut text, name).map_err(json)?;
        text.push(b':');
        match what {
            None => serde_json::to_writer(&mut text, metadata).map_err(json)?,
            Some(i) => {
                let t = &tensors[i];
                text.extend_from_slice(b"{\"data_offsets\":");
                serde_json::to_writer(&mut text, &[offsets[i], offsets[i + 1]]).map_err(json)?;
                text.extend_from_slice(b",\"dtype\":");
                serde_json::to_writer(&mut text, &dtype_name(t.dtype)).map_err(json)?;
                text.extend_from_slice(b",\"shape\":");
                serde_json::to_writer(&mut text, &t.shape).map_err(json)?;
                text.push(b'}');
            }
        }
    }
    text.push(b'}');
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    // Readers (ours and the reference) refuse larger headers: never write one.
    if text.len() as u64 > MAX_HEADER_LEN {
        return Err(Error::Unsupported {
            problem: format!(
                "the header for {} tensors would take {} bytes, over the {MAX_HEADER_LEN}-byte limit of safetensors readers: split the output into more files (--max-shard-size)",
                tensors.len(),
                text.len()
            ),
        });
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    Ok((out, offsets))
}

impl SafetensorsWriter {
    /// Creates `dest` (through a temporary file beside it) sized for `tensors`.
    ///
    /// # Errors
    /// I/O errors, with the path; a header over [`MAX_HEADER_LEN`].
    pub fn create(
        dest: &Path,
        tensors: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
    ) -> Result<SafetensorsWriter> {
        let sums = checksums_enabled();
        let header_meta = if sums {
            with_checksums(
                metadata,
                tensors.iter().map(|t| (t.name.clone(), Checksum(0))),
            )
        } else {
            metadata.clone()
        };
        let (header, offsets) =
            encode_header(tensors, &header_meta).map_err(|e| e.with_path(dest))?;
        let out = StagedFile::create(dest)?;
        let data_start = header.len() as u64;
        let total = data_start + offsets.last().copied().unwrap_or(0);
        let w = SafetensorsWriter {
            out,
            data_start,
            offsets,
            specs: tensors.to_vec(),
            metadata: metadata.clone(),
            written: sums.then(|| tensors.iter().map(|_| Mutex::new(Vec::new())).collect()),
        };
        w.out.set_len(total)?;
        w.out.write_rewritable_at(&header, 0)?;
        Ok(w)
    }

    /// Writes `bytes` at byte `offset` of tensor `index`'s data.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        self.write_parts_at(index, offset, &[bytes.into()])
    }

    /// [`SafetensorsWriter::write_at`] of the concatenation of `parts`, written
    /// straight from them (one `pwritev` per 1024 parts; long parts of input files
    /// copied file to file by the kernel) and hashed as one write, so the checksum
    /// recorded is the one `write_at` would record.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn write_parts_at(&self, index: usize, offset: u64, parts: &[WritePart<'_>]) -> Result<()> {
        let len: u64 = parts.iter().map(|p| p.bytes.len() as u64).sum();
        debug_assert!(self.offsets[index] + offset + len <= self.offsets[index + 1]);
        // Hashed before the write: the hash is what touches the mapped input pages
        // first, so a truncated input faults here, in this process (the SIGBUS
        // handler names the file), rather than failing the write with EFAULT.
        let sum = self.written.is_some().then(|| {
            Checksum(
                parts
                    .iter()
                    .fold(0, |c, p| crc32c::crc32c_append(c, p.bytes)),
            )
        });
        self.out
            .write_parts_at(parts, self.data_start + self.offsets[index] + offset)?;
        if let (Some(w), Some(sum)) = (&self.written, sum) {
            w[index]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((offset, len, sum));
        }
        Ok(())
    }

    /// Bytes of tensor `index`.
    #[must_use]
    pub fn tensor_len(&self, index: usize) -> u64 {
        self.offsets[index + 1] - self.offsets[index]
    }

    /// Size of the whole file.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.data_start + self.offsets.last().copied().unwrap_or(0)
    }

    /// The checksum of tensor `index`: its writes combined in offset order when they
    /// tile it exactly; otherwise (overlapping or missing writes) its bytes read back.
    fn checksum(&self, index: usize, writes: &mut [(u64, u64, Checksum)]) -> Result<Checksum> {
        let len = self.tensor_len(index);
        writes.sort_by_key(|w| w.0);
        let mut pos = 0;
        let tiles = writes.iter().all(|&(off, n, _)| {
            let ok = off == pos;
            pos = off + n;
            ok
        }) && pos == len;
        if tiles {
            return Ok(Checksum::combine(writes.iter().map(|&(_, n, c)| (c, n))));
        }
        let mut parts = Vec::new();
        let mut buf = vec![0u8; (len as usize).min(CHUNK)];
        let mut off = 0;
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            self.out
                .read_at(&mut buf[..n], self.data_start + self.offsets[index] + off)?;
            parts.push((Checksum(crc32c::crc32c(&buf[..n])), n as u64));
            off += n as u64;
        }
        Ok(Checksum::combine(parts))
    }

    /// Records the checksums in the header, syncs the data and renames the file to its
    /// final name.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn finish(mut self) -> Result<()> {
        if let Some(written) = self.written.take() {
            let mut sums = Vec::with_capacity(written.len());
            for (i, w) in written.into_iter().enumerate() {
                let mut w = w
                    .into_inner()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                sums.push((self.specs[i].name.clone(), self.checksum(i, &mut w)?));
            }
            let meta = with_checksums(&self.metadata, sums);
            let (header, _) =
                encode_header(&self.specs, &meta).map_err(|e| e.with_path(self.out.dest()))?;
            if header.len() as u64 != self.data_start {
                return Err(overflow(format!(
                    "{}: header with checksums changed size ({} to {} bytes)",
                    self.out.dest().display(),
                    self.data_start,
                    header.len()
                )));
            }
            self.out.write_rewritable_at(&header, 0)?;
        }
        self.out.commit()
    }
}

/// `metadata` plus [`CHECKSUMS_KEY`] recording `sums`.
pub(crate) fn with_checksums(
    metadata: &BTreeMap<String, String>,
    sums: impl IntoIterator<Item = (String, Checksum)>,
) -> BTreeMap<String, String> {
    let mut m = metadata.clone();
    m.insert(
        CHECKSUMS_KEY.into(),
        encode_checksums(&sums.into_iter().collect()),
    );
    m
}

impl super::writer::TensorWriter for SafetensorsWriter {
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        SafetensorsWriter::write_at(self, index, offset, bytes)
    }

    fn write_parts_at(&self, index: usize, offset: u64, parts: &[WritePart<'_>]) -> Result<bool> {
        SafetensorsWriter::write_parts_at(self, index, offset, parts).map(|()| true)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        SafetensorsWriter::finish(*self)
    }
}

// Directory discovery (a row of formats/detect/discover.rs).

/// The shard files a Hugging Face index (`model.safetensors.index.json`, or
/// `model.ckptz.index.json`) names in its `weight_map`, each once, in name order.
///
/// # Errors
/// The index unreadable, not JSON, or without a `weight_map` object.
pub(crate) fn index_shards(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let unknown = |problem: String| Error::UnknownInput { problem };
    let text = String::from_utf8_lossy(&super::read_small(index)?).into_owned();
    let doc: Value = serde_json::from_str(&text)
        .map_err(|e| unknown(format!("{}: not JSON: {e}", index.display())))?;
    let map = doc
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| unknown(format!("{}: no `weight_map` object", index.display())))?;
    let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Dtype;

    fn file(tensors: &[TensorSpec], data_len_delta: i64) -> Vec<u8> {
        let (mut h, offs) = encode_header(tensors, &BTreeMap::new()).unwrap();
        let n = (*offs.last().unwrap() as i64 + data_len_delta) as usize;
        h.extend(std::iter::repeat_n(7u8, n));
        h
    }

    /// The typed parse takes no header the checked parse refuses, and where it takes
    /// one it gives the same entries and metadata.
    #[test]
    fn the_typed_parse_agrees_with_the_checked_one() {
        let checked =
            |text: &str, data_len: u64| -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
                let (obj, metadata) = split_header(text.as_bytes(), bad)?;
                let entries = obj
                    .iter()
                    .map(|(name, v)| parse_entry(name, v, data_len))
                    .collect::<Result<Vec<_>>>()?;
                Ok((entries, metadata))
            };
        let headers = [
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}"#,
            r#"{"b":{"shape":[],"data_offsets":[8,12],"dtype":"I32"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            r#"{"z":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"y":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}"#,
            // Refused by the checked parse: each must fall to it.
            r#"{"a":["F32",[2],[0,8]]}"#,
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}}"#,
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":"F32","shape":[2],"dtype":"F32","data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}}"#,
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,80]}}"#,
            r#"{"__metadata__":null}"#,
            r#"{"__metadata__":{"k":1}}"#,
            r#"{"__metadata__":{},"__metadata__":{}}"#,
            r#"[]"#,
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} x"#,
        ];
        for text in headers {
            let typed = well_formed_header(text.as_bytes(), 12);
            let want = checked(text, 12);
            match (typed, want) {
                (None, _) => {}
                (Some(got), Ok(want)) => {
                    assert_eq!(format!("{got:?}"), format!("{want:?}"), "{text}");
                }
                (Some(_), Err(e)) => panic!("the typed parse took {text}, refused as {e}"),
            }
        }
        // DCP's offsets: other fields ignored as the checked parse does, arrays refused.
        let offsets = parse_dcp_offsets(r#"{"w":{"saved_offsets":[0,4],"x":1}}"#).unwrap();
        assert_eq!(offsets["w"], vec![0, 4]);
        assert!(parse_dcp_offsets(r#"{"w":[[0,4]]}"#).is_err());
        // Well-formed headers take the typed path.
        assert!(well_formed_header(headers[0].as_bytes(), 8).is_some());
        assert!(well_formed_header(headers[1].as_bytes(), 12).is_some());
    }

    /// The header as a map of `Value`s gives it (how it was written before): the text
    /// written straight from the specs must be the same bytes.
    #[test]
    fn the_header_text_is_the_map_of_values_text() {
        fn through_values(tensors: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Vec<u8> {
            let mut obj = Map::new();
            if !metadata.is_empty() {
                obj.insert(
                    "__metadata__".into(),
                    serde_json::to_value(metadata).unwrap(),
                );
            }
            let mut pos = 0u64;
            for t in tensors {
                let end = pos + byte_len(t.dtype, &t.shape).unwrap();
                obj.insert(
                    t.name.clone(),
                    serde_json::json!({"dtype": dtype_name(t.dtype), "shape": t.shape, "data_offsets": [pos, end]}),
                );
                pos = end;
            }
            let mut text = serde_json::to_string(&Value::Object(obj))
                .unwrap()
                .into_bytes();
            while !text.len().is_multiple_of(8) {
                text.push(b' ');
            }
            let mut out = (text.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&text);
            out
        }
        let meta: BTreeMap<String, String> = [
            ("format".to_string(), "pt".to_string()),
            ("q\"uote\n".to_string(), "{\"a\": [1]}\u{1}é".to_string()),
        ]
        .into();
        let cases: Vec<(Vec<TensorSpec>, BTreeMap<String, String>)> = vec![
            (vec![], BTreeMap::new()),
            (vec![], meta.clone()),
            (
                vec![
                    spec("b.weight", Dtype::BF16, &[3, 4]),
                    spec("a", Dtype::F32, &[]),
                    spec("Z\\esc\"aped\t", Dtype::F8_E4M3, &[0, 7]),
                    spec("__metadata_", Dtype::I64, &[2]),
                    spec("é", Dtype::U8, &[5]),
                ],
                meta.clone(),
            ),
            // A name given twice, and a tensor named `__metadata__`: the later wins, as
            // in a map.
            (
                vec![
                    spec("x", Dtype::F32, &[2]),
                    spec("__metadata__", Dtype::F16, &[1]),
                    spec("x", Dtype::F16, &[3]),
                ],
                meta,
            ),
        ];
        for (tensors, metadata) in cases {
            let (got, offsets) = encode_header(&tensors, &metadata).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(&through_values(&tensors, &metadata))
            );
            assert_eq!(offsets.len(), tensors.len() + 1);
        }
    }

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn header_round_trip_with_sub_byte_types() {
        let t = [
            spec("a", Dtype::F4, &[3, 2]),
            spec("b", Dtype::BF16, &[2]),
            spec("c", Dtype::F8_E5M2, &[]),
        ];
        let bytes = file(&t, 0);
        assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()) % 8, 0);
        let (_, entries, _) = parse_header(&bytes).unwrap();
        let got: Vec<(&str, u64, u64)> = entries
            .iter()
            .map(|e| (e.name.as_str(), e.start, e.end))
            .collect();
        assert_eq!(got, vec![("a", 0, 3), ("b", 3, 7), ("c", 7, 8)]);
    }

    #[test]
    fn truncated_and_trailing_files_are_named() {
        let t = [spec("w", Dtype::F32, &[4])];
        let e = parse_header(&file(&t, -1)).unwrap_err().to_string();
        assert_eq!(e, "tensor `w`: data_offsets [0, 16) run past the end of the data (15 bytes): truncated file?");
        let e = parse_header(&file(&t, 3)).unwrap_err().to_string();
        assert!(e.contains("trailing bytes"), "{e}");
        let e = parse_header(&[1, 0, 0]).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
        let mut big = vec![0u8; 16];
        big[..8].copy_from_slice(&(u64::MAX).to_le_bytes());
        assert!(matches!(
            parse_header(&big),
            Err(Error::HeaderTooLarge { .. })
        ));
    }

    #[test]
    fn wrong_size_and_overlap_are_named() {
        let h = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#;
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h);
        b.extend_from_slice(&[0; 4]);
        let e = parse_header(&b).unwrap_err().to_string();
        assert_eq!(
            e,
            "tensor `w`: F32 x [2] needs 8 bytes but data_offsets span 4"
        );
        let h = br#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h);
        b.extend_from_slice(&[0; 4]);
        let e = parse_header(&b).unwrap_err().to_string();
        assert!(e.contains("overlap tensor `a`"), "{e}");
    }

    #[test]
    fn parts_write_the_bytes_and_checksum_of_their_concatenation() {
        let dir = tempfile::tempdir().unwrap();
        // 3000 parts: more than one pwritev (1024 buffers at most), some empty.
        let parts: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| (0..i % 7).map(|k| (i * 7 + k) as u8).collect())
            .collect();
        let all: Vec<u8> = parts.concat();
        let n = all.len() as u64;
        let specs = [spec("w", Dtype::U8, &[n + 2])];
        let one = dir.path().join("one.safetensors");
        let w = SafetensorsWriter::create(&one, &specs, &BTreeMap::new()).unwrap();
        w.write_at(0, 0, &[9]).unwrap();
        w.write_at(0, 1, &all).unwrap();
        w.write_at(0, n + 1, &[8]).unwrap();
        w.finish().unwrap();
        let many = dir.path().join("many.safetensors");
        let w = SafetensorsWriter::create(&many, &specs, &BTreeMap::new()).unwrap();
        w.write_at(0, 0, &[9]).unwrap();
        let refs: Vec<WritePart<'_>> = parts.iter().map(|p| p.as_slice().into()).collect();
        w.write_parts_at(0, 1, &refs).unwrap();
        w.write_at(0, n + 1, &[8]).unwrap();
        w.finish().unwrap();
        // Same bytes, header (with the recorded checksum) included.
        assert_eq!(std::fs::read(&one).unwrap(), std::fs::read(&many).unwrap());
        let f = TensorFile::open(&many).unwrap();
        assert_eq!(&f.data(0).unwrap()[1..=all.len()], &all[..]);
        assert!(f.check_checksum(0).unwrap());
    }

    #[test]
    fn writer_is_atomic() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.safetensors");
        {
            let w =
                SafetensorsWriter::create(&dest, &[spec("w", Dtype::U8, &[3])], &BTreeMap::new())
                    .unwrap();
            w.write_at(0, 0, &[1, 2, 3]).unwrap();
            // Dropped without finish: nothing appears, no temporary is left.
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let w = SafetensorsWriter::create(&dest, &[spec("w", Dtype::U8, &[3])], &BTreeMap::new())
            .unwrap();
        w.write_at(0, 1, &[2, 3]).unwrap();
        w.write_at(0, 0, &[1]).unwrap();
        w.finish().unwrap();
        let f = TensorFile::open(&dest).unwrap();
        assert_eq!(f.data(0), Some(&[1u8, 2, 3][..]));
    }
}
