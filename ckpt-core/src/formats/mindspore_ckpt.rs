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

/// MindSpore's dtype names (`tensor_type`) and ours.
pub(crate) fn dtype_from_mindspore(name: &str) -> Option<Dtype> {
    Some(match name {
        "Float64" => Dtype::F64,
        "Float32" => Dtype::F32,
        "Float16" => Dtype::F16,
        "BFloat16" => Dtype::BF16,
        "Int64" => Dtype::I64,
        "Int32" => Dtype::I32,
        "Int16" => Dtype::I16,
        "Int8" => Dtype::I8,
        "UInt64" => Dtype::U64,
        "UInt32" => Dtype::U32,
        "UInt16" => Dtype::U16,
        "UInt8" => Dtype::U8,
        "Bool" => Dtype::BOOL,
        _ => return None,
    })
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
