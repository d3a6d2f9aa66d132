//! MindSpore `.ckpt` files (`mindspore.save_checkpoint`): a protobuf `Checkpoint`
//! (`mindspore/ccsrc/utils/checkpoint.proto`):
//!
//! ```text
//! message Checkpoint  { message Value { required string tag = 1;
//!                                        required TensorProto tensor = 2;
//!                                        MapTensorProto maptensor = 3; }
//!                       repeated Value value = 1; }
//! message TensorProto { repeated int64 dims = 1; required string tensor_type = 2;
//!                       required bytes tensor_content = 3; }
//! ```
//!
//! The wire format is walked with prost's decoding primitives and each tensor's
//! `tensor_content` is recorded as a byte range of the mapped file: nothing is copied.
//! Only the fields above are accepted; anything else is an error naming the byte.
//! `save_checkpoint(crc_check=True)` appends `crc_num` and 10 big-endian bytes (a zlib
//! CRC-32 of every byte before it), checked by `verify`. A tensor over 512 MiB, which
//! MindSpore writes as several consecutive records with the same tag (runs of its bytes,
//! each record with the whole dims), is read as the boxes those runs cover. Map tensors
//! are refused by name.

use super::{list_dir, FileFormat, Mapped, TensorEntry, TensorFile};
use crate::error::{Error, Result};
use crate::formats::output::StagedFile;
use crate::layout::Dtype;
use prost::bytes::Buf;
use prost::encoding::{decode_key, decode_varint, WireType};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The trailer `save_checkpoint(crc_check=True)` appends.
const CRC_TRAILER: &[u8] = b"crc_num";

/// Whether the first bytes look like a MindSpore checkpoint: field 1 (a `Value`),
/// length-delimited, whose first field is again field 1 (its `tag`).
pub(crate) fn looks_like(head: &[u8]) -> bool {
    let mut b = head;
    if b.first() != Some(&0x0a) {
        return false;
    }
    b.advance(1);
    decode_varint(&mut b).is_ok() && b.first() == Some(&0x0a)
}

/// MindSpore's dtype names (`tensor_type`) and ours: one table for both directions.
const DTYPES: [(&str, Dtype); 13] = [
    ("Float64", Dtype::F64),
    ("Float32", Dtype::F32),
    ("Float16", Dtype::F16),
    ("BFloat16", Dtype::BF16),
    ("Int64", Dtype::I64),
    ("Int32", Dtype::I32),
    ("Int16", Dtype::I16),
    ("Int8", Dtype::I8),
    ("UInt64", Dtype::U64),
    ("UInt32", Dtype::U32),
    ("UInt16", Dtype::U16),
    ("UInt8", Dtype::U8),
    ("Bool", Dtype::BOOL),
];

/// Our dtype for a MindSpore `tensor_type`.
pub(crate) fn dtype_from_mindspore(name: &str) -> Option<Dtype> {
    DTYPES.iter().find(|(n, _)| *n == name).map(|(_, d)| *d)
}

/// Our dtype's MindSpore name.
fn dtype_to_mindspore(dtype: Dtype) -> Option<&'static str> {
    DTYPES.iter().find(|(_, d)| *d == dtype).map(|(n, _)| *n)
}

fn bad(problem: String) -> Error {
    Error::InvalidHeader { problem }
}

/// A cursor over part of the mapped file that knows its absolute position.
struct Cursor<'a> {
    /// Where `field` starts in the file.
    base: usize,
    field: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn new(base: usize, field: &'a [u8]) -> Cursor<'a> {
        Cursor {
            base,
            field,
            rest: field,
        }
    }

    fn pos(&self) -> usize {
        self.base + (self.field.len() - self.rest.len())
    }

    fn key(&mut self) -> Result<(u32, WireType)> {
        let at = self.pos();
        decode_key(&mut self.rest).map_err(|e| bad(format!("byte {at}: bad field key: {e}")))
    }

    fn varint(&mut self) -> Result<u64> {
        let at = self.pos();
        decode_varint(&mut self.rest).map_err(|e| bad(format!("byte {at}: bad varint: {e}")))
    }

    /// A length-delimited field: a cursor over its bytes.
    fn sub(&mut self) -> Result<Cursor<'a>> {
        let len = self.varint()?;
        let at = self.pos();
        if len > self.rest.len() as u64 {
            return Err(bad(format!(
                "byte {at}: a field of {len} bytes runs past the end of its message ({} bytes left): truncated?",
                self.rest.len()
            )));
        }
        let (field, rest) = self.rest.split_at(len as usize);
        self.rest = rest;
        Ok(Cursor::new(at, field))
    }
}

fn unexpected(message: &str, field: u32, wire: WireType, at: usize) -> Error {
    bad(format!(
        "byte {at}: unexpected field {field} ({wire:?}) in a {message}: not a MindSpore checkpoint this reader knows"
    ))
}

/// Reads a mapped `.ckpt` file.
pub(crate) fn read(path: &Path, map: Option<Mapped>) -> Result<TensorFile> {
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let (tensors, metadata) = parse(all).map_err(|e| e.with_path(path))?;
    TensorFile::from_parts(path, map, FileFormat::MindSporeCkpt, tensors, metadata)
}

/// Parses a whole `.ckpt` image: its tensors (byte ranges absolute) and metadata.
///
/// # Errors
/// The first problem, naming the byte (and the tensor, once its tag is known).
pub fn parse_mindspore_ckpt(all: &[u8]) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    parse(all)
}

fn parse(all: &[u8]) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    let mut c = Cursor::new(0, all);
    // Records in file order; consecutive records with one tag are one split tensor.
    let mut records: Vec<TensorEntry> = Vec::new();
    let mut metadata = BTreeMap::from([("format".to_string(), "ms".to_string())]);
    while !c.rest.is_empty() {
        if c.rest.starts_with(CRC_TRAILER) && c.rest.len() == CRC_TRAILER.len() + 10 {
            let crc = c.rest[CRC_TRAILER.len()..]
                .iter()
                .fold(0u128, |a, &b| (a << 8) | u128::from(b));
            metadata.insert("crc_num".into(), crc.to_string());
            metadata.insert("crc_bytes".into(), c.pos().to_string());
            break;
        }
        let at = c.pos();
        let (field, wire) = c.key()?;
        if (field, wire) != (1, WireType::LengthDelimited) {
            return Err(unexpected("Checkpoint", field, wire, at));
        }
        records.push(parse_value(c.sub()?)?);
    }
    let mut tensors = Vec::with_capacity(records.len());
    let mut seen = BTreeSet::new();
    let mut i = 0;
    while i < records.len() {
        let n = records[i..]
            .iter()
            .take_while(|r| r.name == records[i].name)
            .count();
        if !seen.insert(records[i].name.clone()) {
            return Err(Error::InvalidTensor {
                tensor: records[i].name.clone(),
                problem: "stored twice, in records that are not consecutive".into(),
            });
        }
        if n == 1 {
            tensors.push(records[i].clone());
        } else {
            split_tensor(&records[i..i + n], &mut tensors)?;
        }
        i += n;
    }
    Ok((tensors, metadata))
}

/// A tensor MindSpore wrote as several records (over 512 MiB: `save_checkpoint` cuts
/// its bytes into runs of `SLICE_SIZE`, each record with the whole tensor's dims): each
/// record's run of elements becomes the boxes it covers, each a contiguous part of the
/// record, with its offsets in the tensor. The runs must cover the tensor exactly, in
/// order, on element boundaries.
fn split_tensor(records: &[TensorEntry], out: &mut Vec<TensorEntry>) -> Result<()> {
    let first = &records[0];
    let bad_t = |problem: String| Error::InvalidTensor {
        tensor: first.name.clone(),
        problem,
    };
    let elem = u64::from(first.dtype.bitsize() as u32 / 8);
    let numel = first
        .shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| crate::error::overflow(format!("`{}` element count", first.name)))?;
    let mut pos = 0u64;
    for (k, r) in records.iter().enumerate() {
        if (r.dtype, &r.shape) != (first.dtype, &first.shape) {
            return Err(bad_t(format!(
                "record {k} of its {} records says {:?} {:?}, the first {:?} {:?}",
                records.len(),
                r.dtype,
                r.shape,
                first.dtype,
                first.shape
            )));
        }
        let len = r.end - r.start;
        if len % elem != 0 {
            return Err(bad_t(format!(
                "record {k} holds {len} bytes, not a whole number of {elem}-byte elements"
            )));
        }
        let end = pos + len / elem;
        if end > numel {
            return Err(bad_t(format!(
                "its {} records hold more than the {numel} elements of {:?}",
                records.len(),
                first.shape
            )));
        }
        let mut at = r.start;
        for b in crate::layout::region::Region::flat_range(&first.shape, pos, end) {
            let bytes = b.numel() * elem;
            out.push(TensorEntry {
                name: first.name.clone(),
                dtype: first.dtype,
                shape: b.shape.to_vec(),
                start: at,
                end: at + bytes,
                offsets: Some(b.start.into_vec()),
            });
            at += bytes;
        }
        pos = end;
    }
    if pos != numel {
        return Err(bad_t(format!(
            "its {} records hold {pos} of the {numel} elements of {:?}: truncated?",
            records.len(),
            first.shape
        )));
    }
    Ok(())
}

fn parse_value(mut c: Cursor<'_>) -> Result<TensorEntry> {
    let start = c.pos();
    let mut tag = None;
    let mut tensor = None;
    while !c.rest.is_empty() {
        let at = c.pos();
        let (field, wire) = c.key()?;
        match (field, wire) {
            (1, WireType::LengthDelimited) => {
                let s = c.sub()?;
                let t = std::str::from_utf8(s.field)
                    .map_err(|_| bad(format!("byte {at}: a tag that is not UTF-8")))?;
                tag = Some(t.to_string());
            }
            (2, WireType::LengthDelimited) => tensor = Some(c.sub()?),
            (3, WireType::LengthDelimited) => {
                return Err(Error::Unsupported {
                    problem: format!(
                        "byte {at}: a map tensor{}: not supported",
                        tag.as_deref()
                            .map(|t| format!(" (`{t}`)"))
                            .unwrap_or_default()
                    ),
                })
            }
            _ => return Err(unexpected("Checkpoint.Value", field, wire, at)),
        }
    }
    let name = tag.ok_or_else(|| bad(format!("byte {start}: a value without a tag")))?;
    let tensor = tensor.ok_or_else(|| Error::InvalidTensor {
        tensor: name.clone(),
        problem: "no tensor".into(),
    })?;
    parse_tensor(tensor, name)
}

fn parse_tensor(mut c: Cursor<'_>, name: String) -> Result<TensorEntry> {
    let bad_t = |problem: String| Error::InvalidTensor {
        tensor: name.clone(),
        problem,
    };
    let mut dims = Vec::new();
    let mut dtype = None;
    let mut content = None;
    while !c.rest.is_empty() {
        let at = c.pos();
        let (field, wire) = c.key()?;
        match (field, wire) {
            (1, WireType::Varint) => dims.push(c.varint()? as i64),
            (1, WireType::LengthDelimited) => {
                let mut p = c.sub()?;
                while !p.rest.is_empty() {
                    dims.push(p.varint()? as i64);
                }
            }
            (2, WireType::LengthDelimited) => {
                let s = c.sub()?;
                let t = std::str::from_utf8(s.field).unwrap_or("<not UTF-8>");
                dtype = Some(dtype_from_mindspore(t).ok_or_else(|| {
                    bad_t(format!("tensor_type `{t}` is not a dtype ckpt reads"))
                })?);
            }
            (3, WireType::LengthDelimited) => {
                let s = c.sub()?;
                content = Some((s.base as u64, (s.base + s.field.len()) as u64));
            }
            _ => return Err(unexpected("TensorProto", field, wire, at)),
        }
    }
    let shape = dims
        .iter()
        .map(|&d| u64::try_from(d).map_err(|_| bad_t(format!("negative dimension {d}"))))
        .collect::<Result<Vec<u64>>>()?;
    let dtype = dtype.ok_or_else(|| bad_t("no tensor_type".into()))?;
    let (start, end) = content.unwrap_or((0, 0));
    Ok(TensorEntry {
        name,
        dtype,
        shape,
        start,
        end,
        offsets: None,
    })
}

/// A `.ckpt` file being written, as `mindspore.save_checkpoint` lays it out: one
/// `Value` record per tensor, in the given order. Every length is known from the
/// shapes, so the protobuf framing is written first and each tensor's bytes arrive by
/// positional writes at their place (any thread, any order), like
/// [`SafetensorsWriter`](crate::formats::safetensors::SafetensorsWriter); the file appears at its name only
/// when [`MindSporeWriter::finish`] renames it.
#[derive(Debug)]
pub struct MindSporeWriter {
    out: StagedFile,
    /// Where each tensor's content lies in the file: `(offset in the tensor, offset in
    /// the file)` of each of its records, in order.
    content_at: Vec<Vec<(u64, u64)>>,
    /// Each tensor's byte length.
    lens: Vec<u64>,
}

/// MindSpore writes a tensor over this many bytes as records of this many bytes
/// (`SLICE_SIZE`, 512 MiB): protobuf messages stay far below their 2 GiB limit.
const SLICE_BYTES: u64 = 512 << 20;

impl MindSporeWriter {
    /// Creates `dest` (through a temporary file beside it) for `tensors`.
    ///
    /// # Errors
    /// Dtypes MindSpore has no name for, sizes that overflow, I/O errors.
    pub fn create(
        dest: &Path,
        tensors: &[crate::formats::writer::TensorSpec],
    ) -> Result<MindSporeWriter> {
        Self::create_sliced(dest, tensors, SLICE_BYTES)
    }

    /// [`MindSporeWriter::create`] cutting tensors over `slice` bytes into records of
    /// `slice` bytes, as `save_checkpoint` does.
    fn create_sliced(
        dest: &Path,
        tensors: &[crate::formats::writer::TensorSpec],
        slice: u64,
    ) -> Result<MindSporeWriter> {
        use prost::encoding::{encode_varint, encoded_len_varint};
        let mut framing: Vec<(u64, Vec<u8>)> = Vec::with_capacity(tensors.len());
        let mut content_at = Vec::with_capacity(tensors.len());
        let mut lens = Vec::with_capacity(tensors.len());
        let mut pos = 0u64;
        for t in tensors {
            let type_name = dtype_to_mindspore(t.dtype).ok_or_else(|| Error::Unsupported {
                problem: format!(
                    "tensor `{}`: {} has no MindSpore dtype",
                    t.name,
                    crate::layout::strategy::dtype_name(t.dtype)
                ),
            })?;
            let total = super::byte_len(t.dtype, &t.shape)
                .ok_or_else(|| crate::error::overflow(format!("size of tensor `{}`", t.name)))?;
            lens.push(total);
            let mut records = Vec::new();
            let mut done = 0u64;
            // One record at least (an empty tensor has one, with empty content).
            while done < total || records.is_empty() {
                let n = if total > slice {
                    slice.min(total - done)
                } else {
                    total
                };
                let mut tp = Vec::new();
                for &d in &t.shape {
                    tp.push(0x08);
                    encode_varint(d, &mut tp);
                }
                tp.push(0x12);
                encode_varint(type_name.len() as u64, &mut tp);
                tp.extend_from_slice(type_name.as_bytes());
                tp.push(0x1a);
                encode_varint(n, &mut tp);
                let tp_len = tp.len() as u64 + n;
                let mut value = vec![0x0a];
                encode_varint(t.name.len() as u64, &mut value);
                value.extend_from_slice(t.name.as_bytes());
                value.push(0x12);
                encode_varint(tp_len, &mut value);
                value.extend_from_slice(&tp);
                let value_len = value.len() as u64 + n;
                let mut record = vec![0x0a];
                encode_varint(value_len, &mut record);
                record.extend_from_slice(&value);
                let head = record.len() as u64;
                debug_assert_eq!(
                    head + n,
                    1 + encoded_len_varint(value_len) as u64 + value_len
                );
                framing.push((pos, record));
                records.push((done, pos + head));
                pos = pos
                    .checked_add(head)
                    .and_then(|p| p.checked_add(n))
                    .ok_or_else(|| crate::error::overflow("file size"))?;
                done += n;
            }
            content_at.push(records);
        }
        let out = StagedFile::create(dest)?;
        let w = MindSporeWriter {
            out,
            content_at,
            lens,
        };
        w.out.set_len(pos)?;
        for (at, bytes) in framing {
            w.out.write_at(&bytes, at)?;
        }
        Ok(w)
    }

    /// Writes `bytes` at byte `offset` of tensor `index`'s content (across records
    /// where the tensor is split).
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let records = &self.content_at[index];
        let end = offset + bytes.len() as u64;
        for (k, &(from, file_at)) in records.iter().enumerate() {
            let to = records.get(k + 1).map_or(self.lens[index], |r| r.0);
            let (lo, hi) = (offset.max(from), end.min(to));
            if lo >= hi {
                continue;
            }
            let part = &bytes[(lo - offset) as usize..(hi - offset) as usize];
            self.out.write_at(part, file_at + (lo - from))?;
        }
        Ok(())
    }

    /// Syncs the data and renames the file to its final name.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn finish(self) -> Result<()> {
        self.out.commit()
    }
}

impl super::writer::TensorWriter for MindSporeWriter {
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        MindSporeWriter::write_at(self, index, offset, bytes)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        MindSporeWriter::finish(*self)
    }
}

// Directory discovery (a row of formats/detect/discover.rs).

/// The checkpoint file of a MindSpore rank directory: its only `.ckpt`/`.safetensors`
/// (or `ckpt compress`ed `.ckptz`) file, or the newest `<prefix>-<epoch>_<step>` of
/// several.
///
/// # Errors
/// The directory unreadable; several files not named by epoch and step; no file, or
/// several, of the step asked for.
pub(crate) fn rank_file(
    dir: &Path,
    step: Option<u64>,
    notes: &mut Vec<String>,
) -> Result<Option<PathBuf>> {
    let files: Vec<PathBuf> = list_dir(dir)?
        .into_iter()
        .filter(|p| p.is_file())
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "ckpt" || e == "safetensors" || e == "ckptz")
        })
        .collect();
    if files.len() <= 1 && step.is_none() {
        return Ok(files.into_iter().next());
    }
    let epoch_step = |p: &Path| -> Option<(u64, u64)> {
        let stem = p.file_stem()?.to_str()?;
        let (_, tail) = stem.rsplit_once('-')?;
        let (e, s) = tail.split_once('_')?;
        Some((e.parse().ok()?, s.parse().ok()?))
    };
    let mut dated: Vec<((u64, u64), PathBuf)> = Vec::new();
    for f in &files {
        match epoch_step(f) {
            Some(k) => dated.push((k, f.clone())),
            None => {
                return Err(unknown_input(format!(
                    "{}: several checkpoint files and `{}` is not named <prefix>-<epoch>_<step>: pass the file to use",
                    dir.display(),
                    f.display()
                )))
            }
        }
    }
    dated.sort();
    if let Some(want) = step {
        let have: Vec<String> = dated.iter().map(|((_, s), _)| s.to_string()).collect();
        let mut at = dated.into_iter().filter(|((_, s), _)| *s == want);
        return match (at.next(), at.next()) {
            (Some((_, f)), None) => Ok(Some(f)),
            (Some(_), Some(_)) => Err(unknown_input(format!(
                "{}: several checkpoint files of step {want} (different epochs): pass the file to use",
                dir.display()
            ))),
            (None, _) => Err(unknown_input(format!(
                "{}: no checkpoint file of step {want} (<prefix>-<epoch>_{want}.ckpt); steps here: {}",
                dir.display(),
                if have.is_empty() { "none".to_string() } else { have.join(", ") }
            ))),
        };
    }
    let (_, newest) = dated.pop().expect("several files");
    notes.push(format!(
        "{}: {} checkpoint files, using the newest, {}",
        dir.display(),
        files.len(),
        newest.file_name().unwrap_or_default().to_string_lossy()
    ));
    Ok(Some(newest))
}

fn unknown_input(problem: String) -> Error {
    Error::UnknownInput { problem }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_over_the_slice_size_are_split_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("m.ckpt");
        let specs = [
            crate::formats::writer::TensorSpec {
                name: "w".into(),
                dtype: Dtype::F32,
                shape: vec![7, 9],
            },
            crate::formats::writer::TensorSpec {
                name: "b".into(),
                dtype: Dtype::F16,
                shape: vec![3],
            },
        ];
        let w: Vec<u8> = (0..252).map(|i| (i * 7 % 251) as u8).collect();
        let b = [1u8, 2, 3, 4, 5, 6];
        // Records of 100 bytes: w is cut mid-row into 100 + 100 + 52 bytes.
        let writer = MindSporeWriter::create_sliced(&dest, &specs, 100).unwrap();
        // Writes that straddle the records' boundaries.
        writer.write_at(0, 0, &w[..150]).unwrap();
        writer.write_at(0, 150, &w[150..]).unwrap();
        writer.write_at(1, 0, &b).unwrap();
        writer.finish().unwrap();
        let f = TensorFile::open(&dest).unwrap();
        let mut got = Vec::new();
        let mut covered = 0;
        for (i, e) in f
            .tensors()
            .iter()
            .enumerate()
            .filter(|(_, e)| e.name == "w")
        {
            assert!(e.offsets.is_some(), "{e:?}");
            got.extend_from_slice(f.data(i).unwrap());
            covered += e.shape.iter().product::<u64>();
        }
        assert_eq!(covered, 63);
        assert_eq!(got, w);
        assert_eq!(f.data(f.find("b").unwrap()), Some(&b[..]));
        // Elements 0..25 are rows 0-1 and part of row 2: two boxes; 25..50 three;
        // 50..63 two.
        assert_eq!(f.tensors().iter().filter(|e| e.name == "w").count(), 7);
    }

    #[test]
    fn split_records_that_do_not_add_up_are_named() {
        let rec = |start: u64, end: u64, shape: Vec<u64>| TensorEntry {
            name: "w".into(),
            dtype: Dtype::F32,
            shape,
            start,
            end,
            offsets: None,
        };
        let mut out = Vec::new();
        let e = split_tensor(&[rec(0, 10, vec![4]), rec(20, 26, vec![4])], &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`w`") && e.contains("not a whole number"), "{e}");
        let e = split_tensor(&[rec(0, 8, vec![4]), rec(20, 24, vec![4])], &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 of the 4 elements"), "{e}");
        let e = split_tensor(&[rec(0, 8, vec![4]), rec(20, 24, vec![5])], &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("record 1"), "{e}");
    }
}
