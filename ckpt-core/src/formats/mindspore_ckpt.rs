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
//! CRC-32 of the records), kept in the metadata. Tensors over 512 MiB, which MindSpore
//! writes as several records with the same tag, and map tensors are refused by name.

use super::{FileFormat, TensorEntry, TensorFile};
use crate::error::{Error, Result};
use crate::Dtype;
use memmap2::Mmap;
use prost::bytes::Buf;
use prost::encoding::{decode_key, decode_varint, WireType};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

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
pub(crate) fn read(path: &Path, map: Option<Mmap>) -> Result<TensorFile> {
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
    let mut tensors = Vec::new();
    let mut seen = BTreeSet::new();
    let mut metadata = BTreeMap::from([("format".to_string(), "ms".to_string())]);
    while !c.rest.is_empty() {
        if c.rest.starts_with(CRC_TRAILER) && c.rest.len() == CRC_TRAILER.len() + 10 {
            let crc = c.rest[CRC_TRAILER.len()..]
                .iter()
                .fold(0u128, |a, &b| (a << 8) | u128::from(b));
            metadata.insert("crc_num".into(), crc.to_string());
            break;
        }
        let at = c.pos();
        let (field, wire) = c.key()?;
        if (field, wire) != (1, WireType::LengthDelimited) {
            return Err(unexpected("Checkpoint", field, wire, at));
        }
        let t = parse_value(c.sub()?)?;
        if !seen.insert(t.name.clone()) {
            return Err(Error::Unsupported {
                problem: format!(
                    "tensor `{}` is stored as several records (MindSpore splits tensors over 512 MiB): not supported yet",
                    t.name
                ),
            });
        }
        tensors.push(t);
    }
    Ok((tensors, metadata))
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
/// [`SafetensorsWriter`](crate::SafetensorsWriter); the file appears at its name only
/// when [`MindSporeWriter::finish`] renames it.
#[derive(Debug)]
pub struct MindSporeWriter {
    tmp: std::path::PathBuf,
    dest: std::path::PathBuf,
    file: std::fs::File,
    /// Where each tensor's content starts in the file.
    content_at: Vec<u64>,
    done: bool,
}

impl MindSporeWriter {
    /// Creates `dest` (through a temporary file beside it) for `tensors`.
    ///
    /// # Errors
    /// Dtypes MindSpore has no name for, sizes that overflow, I/O errors.
    pub fn create(dest: &Path, tensors: &[crate::TensorSpec]) -> Result<MindSporeWriter> {
        use prost::encoding::{encode_varint, encoded_len_varint};
        let mut framing: Vec<(u64, Vec<u8>)> = Vec::with_capacity(tensors.len());
        let mut content_at = Vec::with_capacity(tensors.len());
        let mut pos = 0u64;
        for t in tensors {
            let type_name = dtype_to_mindspore(t.dtype).ok_or_else(|| Error::Unsupported {
                problem: format!(
                    "tensor `{}`: {} has no MindSpore dtype",
                    t.name,
                    crate::dtype_name(t.dtype)
                ),
            })?;
            let n = super::byte_len(t.dtype, &t.shape)
                .ok_or_else(|| crate::error::overflow(format!("size of tensor `{}`", t.name)))?;
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
            content_at.push(pos + head);
            pos = pos
                .checked_add(head)
                .and_then(|p| p.checked_add(n))
                .ok_or_else(|| crate::error::overflow("file size"))?;
        }
        let (tmp, file) = crate::output::create_staged_file(dest)?;
        let w = MindSporeWriter {
            tmp,
            dest: dest.to_path_buf(),
            file,
            content_at,
            done: false,
        };
        use crate::error::IoContext;
        use std::os::unix::fs::FileExt;
        w.file.set_len(pos).at(&w.tmp)?;
        for (at, bytes) in framing {
            w.file.write_all_at(&bytes, at).at(&w.tmp)?;
        }
        Ok(w)
    }

    /// Writes `bytes` at byte `offset` of tensor `index`'s content.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        use crate::error::IoContext;
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(bytes, self.content_at[index] + offset)
            .at(&self.tmp)
    }

    /// Syncs the data and renames the file to its final name.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn finish(mut self) -> Result<()> {
        crate::output::commit_staged_file(&self.file, &self.tmp, &self.dest)?;
        self.done = true;
        Ok(())
    }
}

impl Drop for MindSporeWriter {
    fn drop(&mut self) {
        if !self.done {
            crate::output::discard_staged_file(&self.tmp);
        }
    }
}
