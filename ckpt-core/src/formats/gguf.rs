//! GGUF, llama.cpp's model file (version 3, little-endian; gguf-py's `GGUFWriter`,
//! ggml's `gguf.cpp`): the header (`GGUF`, version, tensor and key counts), the
//! key-value pairs in order, the tensor infos (name, dims innermost first, ggml type,
//! data offset), zeros to the alignment (32), then every tensor's bytes, each padded
//! to the alignment. The writer lays the header out from the [`TensorSpec`]s and the
//! file's metadata, then takes the tensors' bytes at their precomputed places from any
//! thread, as the other codecs do.
//!
//! Two metadata entries carry what a `TensorSpec` cannot say (both made by
//! [`encode_metadata`]): [`KV_KEY`], the key-value pairs, and [`TYPES_KEY`], the ggml
//! type of each tensor whose bytes are blocks (Q8_0) rather than elements of its dtype.
//! A quantized tensor's spec is `U8` with its rows' bytes as the last dimension
//! (`[rows, cols / 32 * 34]` for Q8_0).
//!
//! A GGUF file is also read ([`read`]): its tensors of the types above as entries of the
//! same shapes (a Q8_0 tensor as its `U8` rows of blocks), its key-value pairs and the
//! Q8_0 tensors' types in the same two metadata entries, so that what is read is what
//! the writer writes back, and `--dtype` dequantizes the Q8_0 tensors
//! (`checkpoint/computed.rs`).

use super::output::StagedFile;
use super::writer::{TensorSpec, TensorWriter, WritePart};
use super::{FileFormat, Mapped, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::layout::compute::{Q8_0_BLOCK, Q8_0_BYTES};
use crate::layout::strategy::dtype_name;
use crate::layout::Dtype;
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// `GGUF`, little-endian.
pub(crate) const MAGIC: u32 = 0x4655_4747;
/// The version written (and the only one llama.cpp writes today).
pub(crate) const VERSION: u32 = 3;
/// `general.alignment`'s default: tensor data starts and is padded at multiples of it.
pub(crate) const ALIGNMENT: u64 = 32;
/// The metadata entry holding the key-value pairs.
pub(crate) const KV_KEY: &str = "gguf.kv";
/// The metadata entry holding the ggml types of block-quantized tensors.
pub(crate) const TYPES_KEY: &str = "gguf.types";

/// The ggml tensor types ckpt writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32 values along a row: an f16 scale and 32 `i8`.
    Q8_0,
}

impl GgmlType {
    /// Every type by the name `--dtype` takes (llama.cpp's converter's `--outtype`).
    pub const NAMES: [(&'static str, GgmlType); 4] = [
        ("f32", GgmlType::F32),
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::BF16),
        ("q8_0", GgmlType::Q8_0),
    ];

    /// The type named `name` (case-insensitive).
    #[must_use]
    pub fn from_name(name: &str) -> Option<GgmlType> {
        let n = name.to_ascii_lowercase();
        Self::NAMES.iter().find(|(k, _)| *k == n).map(|&(_, t)| t)
    }

    /// Its name.
    #[must_use]
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, t)| *t == self)
            .map_or("?", |(n, _)| n)
    }

    /// ggml's `enum ggml_type` value.
    #[must_use]
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::BF16 => 30,
        }
    }

    /// llama.cpp's `general.file_type` (`enum llama_ftype`) of a file mostly of it.
    #[must_use]
    pub fn file_type(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 7,
            GgmlType::BF16 => 32,
        }
    }

    /// `(values per block, bytes per block)`.
    #[must_use]
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q8_0 => (Q8_0_BLOCK, Q8_0_BYTES),
        }
    }

    /// The dtype its elements are written in (`U8`: blocks).
    #[must_use]
    pub fn dtype(self) -> Dtype {
        match self {
            GgmlType::F32 => Dtype::F32,
            GgmlType::F16 => Dtype::F16,
            GgmlType::BF16 => Dtype::BF16,
            GgmlType::Q8_0 => Dtype::U8,
        }
    }

    /// The type of elements of `dtype` written as they are.
    fn of_dtype(dtype: Dtype) -> Option<GgmlType> {
        match dtype {
            Dtype::F32 => Some(GgmlType::F32),
            Dtype::F16 => Some(GgmlType::F16),
            Dtype::BF16 => Some(GgmlType::BF16),
            _ => None,
        }
    }
}

/// A GGUF metadata value (the types llama.cpp's converter writes for the models ckpt
/// exports).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    /// `UINT32` (4).
    U32(u32),
    /// `INT32` (5).
    I32(i32),
    /// `FLOAT32` (6).
    F32(f32),
    /// `BOOL` (7).
    Bool(bool),
    /// `STRING` (8).
    Str(String),
    /// `ARRAY` (9) of `STRING`.
    Strings(Vec<String>),
    /// `ARRAY` of `FLOAT32`.
    F32s(Vec<f32>),
    /// `ARRAY` of `INT32`.
    I32s(Vec<i32>),
    /// Any other type (another integer or float width, arrays of them or of arrays),
    /// read from a file and kept as its bytes after the type: `(type, bytes)`.
    Other(u32, Vec<u8>),
}

const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Value {
    fn encode(&self, out: &mut Vec<u8>) {
        let array = |out: &mut Vec<u8>, t: u32, n: usize| {
            out.extend_from_slice(&T_ARRAY.to_le_bytes());
            out.extend_from_slice(&t.to_le_bytes());
            out.extend_from_slice(&(n as u64).to_le_bytes());
        };
        match self {
            Value::U32(v) => {
                out.extend_from_slice(&T_U32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Value::I32(v) => {
                out.extend_from_slice(&T_I32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Value::F32(v) => {
                out.extend_from_slice(&T_F32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Value::Bool(v) => {
                out.extend_from_slice(&T_BOOL.to_le_bytes());
                out.push(u8::from(*v));
            }
            Value::Str(s) => {
                out.extend_from_slice(&T_STRING.to_le_bytes());
                put_str(out, s);
            }
            Value::Strings(v) => {
                array(out, T_STRING, v.len());
                for s in v {
                    put_str(out, s);
                }
            }
            Value::F32s(v) => {
                array(out, T_F32, v.len());
                for x in v {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            Value::I32s(v) => {
                array(out, T_I32, v.len());
                for x in v {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            Value::Other(t, bytes) => {
                out.extend_from_slice(&t.to_le_bytes());
                out.extend_from_slice(bytes);
            }
        }
    }

    /// A scalar integer of any width as `u64` (`None` for negatives and other types):
    /// writers give a count as `UINT32` or `UINT64` as they please.
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U32(v) => Some(u64::from(*v)),
            Value::I32(v) => u64::try_from(*v).ok(),
            Value::Other(t, b) => {
                let le = |n: usize| -> Option<u64> {
                    let mut x = [0u8; 8];
                    x[..n].copy_from_slice(b.get(..n)?);
                    Some(u64::from_le_bytes(x))
                };
                let signed = |n: usize| -> Option<u64> {
                    let v = le(n)?;
                    (v >> (8 * n - 1) & 1 == 0).then_some(v)
                };
                match *t {
                    0 => le(1),
                    1 => signed(1),
                    2 => le(2),
                    3 => signed(2),
                    10 => le(8),
                    11 => signed(8),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// A scalar float (`FLOAT32`, or `FLOAT64`) as `f64`, the `f32` by its shortest
    /// decimal (`1e-5`, not `9.99999974e-6`: the number the writer was given).
    pub(crate) fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F32(v) => v.to_string().parse().ok(),
            Value::Other(12, b) => Some(f64::from_le_bytes(b.get(..8)?.try_into().ok()?)),
            _ => None,
        }
    }

    /// A string.
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as JSON for the metadata channel (floats by their bits, so they come
    /// back exactly).
    fn to_json(&self) -> Json {
        match self {
            Value::U32(v) => json!(["u32", v]),
            Value::I32(v) => json!(["i32", v]),
            Value::F32(v) => json!(["f32", v.to_bits()]),
            Value::Bool(v) => json!(["bool", v]),
            Value::Str(v) => json!(["str", v]),
            Value::Strings(v) => json!(["strs", v]),
            Value::F32s(v) => json!(["f32s", v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()]),
            Value::I32s(v) => json!(["i32s", v]),
            Value::Other(t, bytes) => json!(["other", t, bytes]),
        }
    }

    fn from_json(j: &Json) -> Option<Value> {
        let (t, v) = match j.as_array()?.as_slice() {
            [t, v] | [t, v, _] => (t, v),
            _ => return None,
        };
        let u32_of = |v: &Json| v.as_u64().and_then(|x| u32::try_from(x).ok());
        let i32_of = |v: &Json| v.as_i64().and_then(|x| i32::try_from(x).ok());
        Some(match t.as_str()? {
            "u32" => Value::U32(u32_of(v)?),
            "i32" => Value::I32(i32_of(v)?),
            "f32" => Value::F32(f32::from_bits(u32_of(v)?)),
            "bool" => Value::Bool(v.as_bool()?),
            "str" => Value::Str(v.as_str()?.to_string()),
            "strs" => Value::Strings(
                v.as_array()?
                    .iter()
                    .map(|s| s.as_str().map(str::to_string))
                    .collect::<Option<_>>()?,
            ),
            "f32s" => Value::F32s(
                v.as_array()?
                    .iter()
                    .map(|x| u32_of(x).map(f32::from_bits))
                    .collect::<Option<_>>()?,
            ),
            "i32s" => Value::I32s(v.as_array()?.iter().map(i32_of).collect::<Option<_>>()?),
            "other" => {
                let [t, bytes] = j.as_array()?.get(1..)? else {
                    return None;
                };
                Value::Other(
                    u32_of(t)?,
                    bytes
                        .as_array()?
                        .iter()
                        .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                        .collect::<Option<_>>()?,
                )
            }
            _ => return None,
        })
    }
}

/// The file metadata that makes [`GgufWriter`] write `kv` and the block-quantized
/// tensors' types (`types`: tensor name to type, for those that are not their dtype's).
#[must_use]
pub(crate) fn encode_metadata(
    kv: &[(String, Value)],
    types: &BTreeMap<String, GgmlType>,
) -> BTreeMap<String, String> {
    let kv: Vec<Json> = kv.iter().map(|(k, v)| json!([k, v.to_json()])).collect();
    let types: serde_json::Map<String, Json> = types
        .iter()
        .map(|(n, t)| (n.clone(), Json::String(t.name().into())))
        .collect();
    [
        (KV_KEY.to_string(), Json::Array(kv).to_string()),
        (TYPES_KEY.to_string(), Json::Object(types).to_string()),
    ]
    .into()
}

fn bad(problem: impl Into<String>) -> Error {
    Error::Unsupported {
        problem: format!("GGUF: {}", problem.into()),
    }
}

/// Key-value pairs in the file's order.
pub(crate) type KeyValues = Vec<(String, Value)>;

/// The key-value pairs and types [`encode_metadata`] wrote.
pub(crate) fn decode_metadata(
    metadata: &BTreeMap<String, String>,
) -> Result<(KeyValues, BTreeMap<String, GgmlType>)> {
    let parse = |key: &str| -> Result<Json> {
        metadata
            .get(key)
            .map_or(Ok(Json::Null), |s| serde_json::from_str(s))
            .map_err(|e| bad(format!("metadata `{key}`: {e}")))
    };
    let mut kv = Vec::new();
    if let Json::Array(items) = parse(KV_KEY)? {
        for item in &items {
            let pair = item.as_array().filter(|p| p.len() == 2);
            let Some((k, v)) = pair.and_then(|p| Some((p[0].as_str()?, Value::from_json(&p[1])?)))
            else {
                return Err(bad(format!("metadata `{KV_KEY}`: entry {item} unreadable")));
            };
            kv.push((k.to_string(), v));
        }
    }
    let mut types = BTreeMap::new();
    if let Json::Object(m) = parse(TYPES_KEY)? {
        for (name, t) in m {
            let ty = t
                .as_str()
                .and_then(GgmlType::from_name)
                .ok_or_else(|| bad(format!("tensor `{name}`: ggml type {t} unknown")))?;
            types.insert(name, ty);
        }
    }
    Ok((kv, types))
}

/// A tensor's ggml type and dims (innermost first, as GGUF stores them) from its spec.
fn tensor_info(spec: &TensorSpec, ty: Option<GgmlType>) -> Result<(GgmlType, Vec<u64>)> {
    let ty = match ty {
        Some(t) => t,
        None => GgmlType::of_dtype(spec.dtype).ok_or_else(|| {
            bad(format!(
                "tensor `{}`: {} has no ggml type ckpt writes (F32, F16, BF16, Q8_0)",
                spec.name,
                dtype_name(spec.dtype)
            ))
        })?,
    };
    let mut ne: Vec<u64> = spec.shape.iter().rev().copied().collect();
    let (per, bytes) = ty.block();
    if per > 1 {
        if spec.dtype != Dtype::U8 || ne.first().is_none_or(|b| b % bytes != 0) {
            return Err(bad(format!(
                "tensor `{}`: {} blocks must be U8 rows of whole {bytes}-byte blocks, not {} {:?}",
                spec.name,
                ty.name(),
                dtype_name(spec.dtype),
                spec.shape
            )));
        }
        ne[0] = ne[0] / bytes * per;
    }
    Ok((ty, ne))
}

/// The header (through the padding before the data) for `tensors` and the key-value
/// pairs, and each tensor's data offset (relative to the data) with the data's length
/// (padded) last.
///
/// # Errors
/// A tensor GGUF cannot hold as ckpt writes it; sizes that overflow.
pub(crate) fn encode_header(
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<u64>)> {
    let (kv, types) = decode_metadata(metadata)?;
    let alignment = alignment_of(&kv)?;
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in &kv {
        put_str(&mut out, k);
        v.encode(&mut out);
    }
    let mut offsets = Vec::with_capacity(tensors.len() + 1);
    let mut pos = 0u64;
    for t in tensors {
        let (ty, ne) = tensor_info(t, types.get(&t.name).copied())?;
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in &ne {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.id().to_le_bytes());
        out.extend_from_slice(&pos.to_le_bytes());
        offsets.push(pos);
        let n = super::byte_len(t.dtype, &t.shape)
            .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)))?;
        pos = pos
            .checked_add(n)
            .map(|p| p.next_multiple_of(alignment))
            .ok_or_else(|| overflow("file size"))?;
    }
    offsets.push(pos);
    out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
    Ok((out, offsets))
}

/// The alignment `general.alignment` sets (a `UINT32`, a power of two), else 32.
fn alignment_of(kv: &[(String, Value)]) -> Result<u64> {
    match kv.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(ALIGNMENT),
        Some((_, Value::U32(a))) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some((_, v)) => Err(bad(format!(
            "general.alignment is {v:?}: not a UINT32 power of two"
        ))),
    }
}

/// Whether a file starting with `head` is GGUF (its magic; the version is checked when
/// read).
pub(crate) fn looks_like(head: &[u8]) -> bool {
    head.starts_with(b"GGUF")
}

/// Reads a GGUF file's header: its tensors as entries (dims outermost first; a Q8_0
/// tensor as `U8` rows of blocks), its key-value pairs and block types as the
/// metadata entries [`encode_metadata`] makes.
///
/// # Errors
/// Every problem of the header, naming the file and, where one is at fault, the
/// tensor: not version 2 or 3, truncated, a ggml type ckpt does not read, a tensor's
/// data misaligned or outside the file.
pub(crate) fn read(path: &Path, map: Option<Mapped>) -> Result<TensorFile> {
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let (tensors, metadata) = parse(all).map_err(|e| e.with_path(path))?;
    TensorFile::from_parts(path, map, FileFormat::Gguf, tensors, metadata)
}

/// Reads the header's fields in order, each bound-checked against the file.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.at.checked_add(n))
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                bad(format!(
                    "truncated: {what} needs {n} bytes at byte {}, the file has {}",
                    self.at,
                    self.bytes.len()
                ))
            })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad(format!("{what} is not UTF-8")))
    }

    /// A count of items of at least `min` bytes each, checked against the bytes left
    /// (so that no count allocates more than the file could hold).
    fn count(&mut self, what: &str, min: u64) -> Result<usize> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min) > left {
            return Err(bad(format!(
                "{what} is {n}, more than the {left} bytes left could hold"
            )));
        }
        usize::try_from(n).map_err(|_| overflow(what.to_string()))
    }
}

/// The bytes one value of `GGUF` type `t` takes at a fixed size, `None` for strings
/// and arrays.
fn fixed_size(t: u32) -> Option<u64> {
    match t {
        0 | 1 | T_BOOL => Some(1),
        2 | 3 => Some(2),
        T_U32 | T_I32 | T_F32 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// A value of type `t` (its type already read).
fn read_value(c: &mut Cursor<'_>, t: u32, key: &str) -> Result<Value> {
    let what = format!("the value of `{key}`");
    let start = c.at;
    Ok(match t {
        T_U32 => Value::U32(c.u32(&what)?),
        T_I32 => Value::I32(c.u32(&what)? as i32),
        T_F32 => Value::F32(f32::from_bits(c.u32(&what)?)),
        T_BOOL => match c.take(1, &what)?[0] {
            b @ (0 | 1) => Value::Bool(b == 1),
            b => return Err(bad(format!("`{key}`: BOOL byte {b}"))),
        },
        T_STRING => Value::Str(c.string(&what)?),
        T_ARRAY => {
            let e = c.u32(&what)?;
            let n = c.count(&what, fixed_size(e).unwrap_or(8))?;
            match e {
                T_STRING => Value::Strings((0..n).map(|_| c.string(&what)).collect::<Result<_>>()?),
                T_F32 => Value::F32s(
                    (0..n)
                        .map(|_| c.u32(&what).map(f32::from_bits))
                        .collect::<Result<_>>()?,
                ),
                T_I32 => Value::I32s(
                    (0..n)
                        .map(|_| c.u32(&what).map(|v| v as i32))
                        .collect::<Result<_>>()?,
                ),
                _ => {
                    for _ in 0..n {
                        skip_value(c, e, key, 1)?;
                    }
                    Value::Other(t, c.bytes[start..c.at].to_vec())
                }
            }
        }
        _ => {
            skip_value(c, t, key, 0)?;
            Value::Other(t, c.bytes[start..c.at].to_vec())
        }
    })
}

/// Steps over a value of type `t` (arrays of arrays at most a few deep).
fn skip_value(c: &mut Cursor<'_>, t: u32, key: &str, depth: u32) -> Result<()> {
    let what = format!("the value of `{key}`");
    match (t, fixed_size(t)) {
        (_, Some(n)) => {
            c.take(n, &what)?;
        }
        (T_STRING, None) => {
            let n = c.u64(&what)?;
            c.take(n, &what)?;
        }
        (T_ARRAY, None) if depth < 4 => {
            let e = c.u32(&what)?;
            let n = c.count(&what, fixed_size(e).unwrap_or(8))?;
            match fixed_size(e) {
                Some(size) => {
                    c.take(size * n as u64, &what)?;
                }
                None => {
                    for _ in 0..n {
                        skip_value(c, e, key, depth + 1)?;
                    }
                }
            }
        }
        _ => return Err(bad(format!("`{key}`: value type {t} unknown"))),
    }
    Ok(())
}

/// The type ggml's `enum ggml_type` value `id` is, if ckpt reads it.
fn ggml_type(id: u32) -> Option<GgmlType> {
    GgmlType::NAMES
        .iter()
        .map(|&(_, t)| t)
        .find(|t| t.id() == id)
}

/// The tensor entries and metadata of a GGUF file's bytes (for the fuzz target: every
/// parser has one).
///
/// # Errors
/// What [`read`] refuses of a header.
pub fn parse_gguf(all: &[u8]) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    parse(all)
}

/// The tensor entries and metadata of a GGUF file's bytes.
fn parse(all: &[u8]) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    let mut c = Cursor { bytes: all, at: 0 };
    if c.take(4, "the magic")? != b"GGUF" {
        return Err(bad("no GGUF magic"));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!(
            "version {version}: ckpt reads versions 2 and 3 (version 1's counts are 32-bit)"
        )));
    }
    // A tensor info takes at least 8 + 4 + 4 + 8 bytes; a key-value pair 8 + 4 + 1.
    let n_tensors = c.count("the tensor count", 24)?;
    let n_kv = c.count("the key-value count", 13)?;
    let mut kv: Vec<(String, Value)> = Vec::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("a key")?;
        if kv.iter().any(|(k, _)| *k == key) {
            return Err(bad(format!("key `{key}` appears twice")));
        }
        let t = c.u32(&format!("the type of `{key}`"))?;
        let v = read_value(&mut c, t, &key)?;
        kv.push((key, v));
    }
    let alignment = alignment_of(&kv)?;
    let mut infos = Vec::with_capacity(n_tensors);
    let mut types = BTreeMap::new();
    for _ in 0..n_tensors {
        let name = c.string("a tensor name")?;
        let n_dims = c.u32(&format!("the dims of `{name}`"))?;
        if n_dims > 8 {
            return Err(bad(format!(
                "tensor `{name}`: {n_dims} dims (GGML has at most 4)"
            )));
        }
        let ne = (0..n_dims)
            .map(|_| c.u64(&format!("the dims of `{name}`")))
            .collect::<Result<Vec<u64>>>()?;
        let id = c.u32(&format!("the type of `{name}`"))?;
        let offset = c.u64(&format!("the offset of `{name}`"))?;
        let ty = ggml_type(id).ok_or_else(|| {
            bad(format!(
                "tensor `{name}`: ggml type {id} is not read (ckpt reads F32, F16, BF16 and Q8_0; dequantize other types with llama.cpp's tools first)"
            ))
        })?;
        if offset % alignment != 0 {
            return Err(bad(format!(
                "tensor `{name}`: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let (per, bytes) = ty.block();
        let mut shape: Vec<u64> = ne.iter().rev().copied().collect();
        if per > 1 {
            // Blocks run along the innermost dim: a tensor of blocks has one.
            let Some(&inner) = ne.first() else {
                return Err(bad(format!(
                    "tensor `{name}`: a {} tensor of no dims",
                    ty.name()
                )));
            };
            if inner % per != 0 {
                return Err(bad(format!(
                    "tensor `{name}`: rows of {inner} values are not whole {} blocks of {per}",
                    ty.name()
                )));
            }
            *shape.last_mut().expect("a dim") = inner / per * bytes;
            types.insert(name.clone(), ty);
        }
        if infos.iter().any(|(n, ..): &(String, _, _, _)| *n == name) {
            return Err(bad(format!("tensor `{name}` appears twice")));
        }
        infos.push((name, ty, shape, offset));
    }
    let data = (c.at as u64).next_multiple_of(alignment);
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, ty, shape, offset) in infos {
        let len = super::byte_len(ty.dtype(), &shape)
            .ok_or_else(|| overflow(format!("size of tensor `{name}`")))?;
        let start = data
            .checked_add(offset)
            .ok_or_else(|| overflow(format!("offset of tensor `{name}`")))?;
        let end = start
            .checked_add(len)
            .ok_or_else(|| overflow(format!("end of tensor `{name}`")))?;
        tensors.push(TensorEntry {
            name,
            dtype: ty.dtype(),
            shape,
            start,
            end,
            offsets: None,
        });
    }
    Ok((tensors, encode_metadata(&kv, &types)))
}

/// A GGUF file being written.
#[derive(Debug)]
pub(crate) struct GgufWriter {
    out: StagedFile,
    data_start: u64,
    /// Each tensor's data offset, and the data's padded length last.
    offsets: Vec<u64>,
}

impl GgufWriter {
    /// Creates `dest` (through a temporary file beside it): the header written, the
    /// data zeros (the padding stays so).
    ///
    /// # Errors
    /// What [`encode_header`] refuses; I/O errors, with the path.
    pub(crate) fn create(
        dest: &Path,
        tensors: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
    ) -> Result<GgufWriter> {
        let (header, offsets) = encode_header(tensors, metadata).map_err(|e| e.with_path(dest))?;
        let out = StagedFile::create(dest)?;
        let data_start = header.len() as u64;
        out.set_len(data_start + offsets.last().copied().unwrap_or(0))?;
        out.write_at(&header, 0)?;
        Ok(GgufWriter {
            out,
            data_start,
            offsets,
        })
    }
}

impl TensorWriter for GgufWriter {
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        self.out
            .write_at(bytes, self.data_start + self.offsets[index] + offset)
    }

    fn write_parts_at(&self, index: usize, offset: u64, parts: &[WritePart<'_>]) -> Result<bool> {
        self.out
            .write_parts_at(parts, self.data_start + self.offsets[index] + offset)?;
        Ok(true)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.out.commit()
    }
}

/// A SentencePiece `ModelProto`'s pieces (field 1; the trainer and normalizer specs
/// skipped): `piece` (1), `score` (2), `type` (3, default NORMAL).
#[derive(Clone, PartialEq, prost::Message)]
struct SentencePieceModel {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<SentencePiece>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SentencePiece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

/// The pieces of a SentencePiece model (`tokenizer.model`) as llama.cpp's converter
/// takes them: text (`▁` kept), score, and ggml's token type (1 normal, 2 unknown,
/// 3 control, 5 unused, 6 byte; SentencePiece's user-defined pieces are normal, as
/// `IsUnknown`/`IsControl`/`IsUnused`/`IsByte` leave them).
///
/// # Errors
/// Bytes that are not such a protobuf.
pub(crate) fn read_sentencepiece(bytes: &[u8]) -> Result<Vec<(String, f32, i32)>> {
    use prost::Message;
    let model = SentencePieceModel::decode(bytes).map_err(|e| Error::UnknownInput {
        problem: format!("not a SentencePiece model (tokenizer.model): {e}"),
    })?;
    Ok(model
        .pieces
        .into_iter()
        .map(|p| {
            let kind = match p.kind.unwrap_or(1) {
                k @ (2 | 3 | 5 | 6) => k,
                _ => 1,
            };
            (p.piece.unwrap_or_default(), p.score.unwrap_or(0.0), kind)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lays_out_keys_infos_and_aligned_offsets() {
        let kv = vec![
            (
                "general.architecture".to_string(),
                Value::Str("llama".into()),
            ),
            ("x.eps".to_string(), Value::F32(1e-5)),
            (
                "x.toks".to_string(),
                Value::Strings(vec!["a".into(), "▁b".into()]),
            ),
        ];
        let types: BTreeMap<String, GgmlType> = [("q".to_string(), GgmlType::Q8_0)].into();
        let meta = encode_metadata(&kv, &types);
        let specs = vec![
            TensorSpec {
                name: "n".into(),
                dtype: Dtype::F32,
                shape: vec![3],
            },
            TensorSpec {
                name: "q".into(),
                dtype: Dtype::U8,
                shape: vec![2, 68],
            },
        ];
        let (h, offsets) = encode_header(&specs, &meta).unwrap();
        assert_eq!(&h[..4], b"GGUF");
        assert_eq!(h.len() % 32, 0);
        // 12 bytes of F32 padded to 32; 136 bytes of Q8_0 padded to 160.
        assert_eq!(offsets, vec![0, 32, 192]);
        // q's dims: 64 values (2 blocks) a row, 2 rows; type 8.
        let q_info: Vec<u8> = [
            &1u64.to_le_bytes()[..],
            b"q",
            &2u32.to_le_bytes(),
            &64u64.to_le_bytes(),
            &2u64.to_le_bytes(),
            &8u32.to_le_bytes(),
            &32u64.to_le_bytes(),
        ]
        .concat();
        assert!(h.windows(q_info.len()).any(|w| w == q_info));
        let (back, _) = decode_metadata(&meta).unwrap();
        assert_eq!(back, kv);
    }

    /// The smallest file of one tensor info: `(name, dims, type id)`, offset 0.
    fn one_tensor_file(name: &str, ne: &[u64], ty: u32) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        put_str(&mut b, name);
        b.extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in ne {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.resize(b.len().next_multiple_of(32) + 68, 0);
        b
    }

    #[test]
    fn tensor_infos_are_read_as_row_major_shapes_and_block_rows() {
        let (t, meta) = parse(&one_tensor_file("q", &[64, 1], 8)).unwrap();
        assert_eq!((t[0].dtype, t[0].shape.clone()), (Dtype::U8, vec![1, 68]));
        assert_eq!(t[0].end - t[0].start, 68);
        assert!(meta[TYPES_KEY].contains("q8_0"), "{meta:?}");
        // A Q8_0 tensor of no dims (found by the fuzz target: it panicked), and rows
        // that are not whole blocks, are refused by name.
        for (ne, problem) in [(&[][..], "no dims"), (&[33, 1][..], "not whole")] {
            let e = parse(&one_tensor_file("q", ne, 8)).unwrap_err().to_string();
            assert!(e.contains("`q`") && e.contains(problem), "{e}");
        }
    }

    #[test]
    fn a_block_type_needs_whole_blocks() {
        let spec = TensorSpec {
            name: "q".into(),
            dtype: Dtype::U8,
            shape: vec![2, 35],
        };
        assert!(tensor_info(&spec, Some(GgmlType::Q8_0)).is_err());
        let f = TensorSpec {
            name: "i".into(),
            dtype: Dtype::I64,
            shape: vec![2],
        };
        assert!(tensor_info(&f, None).is_err());
    }
}
