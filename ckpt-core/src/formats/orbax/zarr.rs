//! zarr array metadata as tensorstore writes it for orbax: v2 `.zarray` and v3
//! `zarr.json` (docs/orbax.md, "Zarr v2 arrays" and "Zarr v3 arrays"; tensorstore
//! 0.1.86's zarr drivers, zarr v3 spec with its `sharding_indexed` codec). Parsed into
//! one description, [`ArrayMeta`]: shape, dtype and byte order, the chunk grid, the
//! fill value, how the chunks are keyed and how a chunk's bytes are encoded.
//!
//! Restricted: C order only, no filters, compressors and codecs from an allow-list
//! (zstd, CRC-32C, `bytes`, `sharding_indexed` with one level of sharding); anything
//! else is a problem naming what it is.

use crate::layout::Dtype;
use serde_json::{Map, Value};

/// Largest zarr metadata document read (tensorstore's are a few hundred bytes).
pub(crate) const MAX_ZARR_METADATA_BYTES: u64 = 1 << 20;

/// zarr v2's metadata key, under the array's prefix.
pub(crate) const ZARRAY: &str = ".zarray";
/// zarr v3's metadata key, under the array's prefix.
pub(crate) const ZARR_JSON: &str = "zarr.json";

/// Largest rank read (tensorstore's own limit is 32).
const MAX_RANK: usize = 32;

/// One zarr array, as its metadata describes it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ArrayMeta {
    /// zarr version (2 or 3).
    pub(crate) zarr: u8,
    /// The array's shape.
    pub(crate) shape: Vec<u64>,
    /// Element type (the bytes given to the copy are little-endian).
    pub(crate) dtype: Dtype,
    /// Shape of a stored chunk (zarr v3: of a shard, the chunk grid's unit).
    pub(crate) chunk: Vec<u64>,
    /// One element of the fill value, little-endian; `None` where it cannot be
    /// represented in `dtype` (a missing chunk is then refused).
    pub(crate) fill: Option<Vec<u8>>,
    /// The fill value as written, for messages.
    pub(crate) fill_text: String,
    /// How chunk keys are spelt.
    pub(crate) keys: KeyEncoding,
    /// How a stored chunk's bytes are encoded.
    pub(crate) codec: Codec,
}

/// How a chunk's grid index becomes its key under the array's prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyEncoding {
    /// zarr v3's `default` encoding (`c/1/2`, `c` for a 0-d array); else v2's (`1.2`,
    /// `0` for a 0-d array).
    pub(crate) default: bool,
    /// The separator between indices.
    pub(crate) separator: char,
}

impl KeyEncoding {
    /// The key of chunk `idx`, under the array's prefix.
    pub(crate) fn key(self, idx: &[u64]) -> String {
        let sep = self.separator.to_string();
        let parts: Vec<String> = idx.iter().map(u64::to_string).collect();
        if self.default {
            let mut k = String::from("c");
            for p in parts {
                k.push(self.separator);
                k.push_str(&p);
            }
            k
        } else if parts.is_empty() {
            "0".into()
        } else {
            parts.join(&sep)
        }
    }
}

/// How a stored chunk's bytes are encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Codec {
    /// The chunk is the array's elements in C order through `chain`.
    Plain(Chain),
    /// The chunk is a zarr v3 shard: inner chunks of shape `inner` each through
    /// `chain`, and an index of `(offset, nbytes)` per inner chunk.
    Sharded {
        /// Inner chunk shape (divides the shard shape).
        inner: Vec<u64>,
        /// The inner chunks' encoding.
        chain: Chain,
        /// Whether the index ends in its CRC-32C.
        index_crc: bool,
        /// Whether the index is at the end of the shard (else at its start).
        index_at_end: bool,
    },
}

/// The encoding of a chunk's elements: C-order bytes (byte-swapped where stored
/// big-endian), then zstd, then a CRC-32C of what precedes it, each optional.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chain {
    /// Elements stored big-endian (swapped on read).
    pub(crate) big_endian: bool,
    /// A zstd frame.
    pub(crate) zstd: bool,
    /// Four bytes of CRC-32C (little-endian) after the encoded bytes.
    pub(crate) crc32c: bool,
}

/// The marker of a missing inner chunk in a shard index.
pub(crate) const MISSING: u64 = u64::MAX;

/// Parses a `.zarray` document.
pub(crate) fn parse_v2(bytes: &[u8]) -> Result<ArrayMeta, String> {
    let doc = object(bytes, ZARRAY)?;
    match doc.get("zarr_format") {
        Some(Value::Number(n)) if n.as_u64() == Some(2) => {}
        other => return Err(format!("zarr_format is {}, not 2", shown(other))),
    }
    let shape = dims(&doc, "shape")?;
    let chunk = dims(&doc, "chunks")?;
    check_grid(&shape, &chunk, "chunks")?;
    let Some(Value::String(dt)) = doc.get("dtype") else {
        return Err(format!(
            "dtype {} is not one ckpt reads (a numpy type string)",
            shown(doc.get("dtype"))
        ));
    };
    let (dtype, big_endian) = v2_dtype(dt)?;
    match doc.get("order") {
        None => {}
        Some(Value::String(o)) if o == "C" => {}
        Some(o) => return Err(format!("order {o}: only C order is read")),
    }
    match doc.get("filters") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(f) => return Err(format!("filters {f}: zarr filters are not read")),
    }
    let zstd = match doc.get("compressor") {
        None | Some(Value::Null) => false,
        Some(Value::Object(c)) => match c.get("id") {
            Some(Value::String(id)) if id == "zstd" => true,
            other => {
                return Err(format!(
                    "compressor {}: only zstd (orbax's) or none is read",
                    shown(other)
                ))
            }
        },
        Some(c) => return Err(format!("compressor {c} is not an object")),
    };
    let separator = match doc.get("dimension_separator") {
        None => '.',
        Some(Value::String(s)) if s == "." => '.',
        Some(Value::String(s)) if s == "/" => '/',
        Some(s) => return Err(format!("dimension_separator {s} is not `.` or `/`")),
    };
    let fill_value = doc.get("fill_value").unwrap_or(&Value::Null);
    Ok(ArrayMeta {
        zarr: 2,
        fill: fill_bytes(dtype, fill_value)?,
        fill_text: fill_value.to_string(),
        shape,
        dtype,
        chunk,
        keys: KeyEncoding {
            default: false,
            separator,
        },
        codec: Codec::Plain(Chain {
            big_endian,
            zstd,
            crc32c: false,
        }),
    })
}

/// Parses a `zarr.json` document.
pub(crate) fn parse_v3(bytes: &[u8]) -> Result<ArrayMeta, String> {
    let doc = object(bytes, ZARR_JSON)?;
    match doc.get("zarr_format") {
        Some(Value::Number(n)) if n.as_u64() == Some(3) => {}
        other => return Err(format!("zarr_format is {}, not 3", shown(other))),
    }
    match doc.get("node_type") {
        Some(Value::String(t)) if t == "array" => {}
        other => return Err(format!("node_type is {}, not \"array\"", shown(other))),
    }
    match doc.get("storage_transformers") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(t) => return Err(format!("storage_transformers {t} are not read")),
    }
    let shape = dims(&doc, "shape")?;
    let Some(Value::String(dt)) = doc.get("data_type") else {
        return Err(format!(
            "data_type {} is not one ckpt reads",
            shown(doc.get("data_type"))
        ));
    };
    let dtype = v3_dtype(dt)?;
    let grid = match doc.get("chunk_grid") {
        Some(Value::Object(g)) => g,
        other => return Err(format!("chunk_grid {} is not an object", shown(other))),
    };
    match grid.get("name") {
        Some(Value::String(n)) if n == "regular" => {}
        other => {
            return Err(format!(
                "chunk grid {}: only the regular grid is read",
                shown(other)
            ))
        }
    }
    let chunk = match grid.get("configuration") {
        Some(Value::Object(c)) => dims(c, "chunk_shape")?,
        other => {
            return Err(format!(
                "chunk grid configuration {} is not an object",
                shown(other)
            ))
        }
    };
    check_grid(&shape, &chunk, "chunk_shape")?;
    let keys = match doc.get("chunk_key_encoding") {
        None => KeyEncoding {
            default: true,
            separator: '/',
        },
        Some(Value::Object(e)) => {
            let default = match e.get("name") {
                Some(Value::String(n)) if n == "default" => true,
                Some(Value::String(n)) if n == "v2" => false,
                other => return Err(format!("chunk_key_encoding {} is not read", shown(other))),
            };
            let sep = e
                .get("configuration")
                .and_then(|c| c.get("separator"))
                .cloned();
            let separator = match sep {
                None => {
                    if default {
                        '/'
                    } else {
                        '.'
                    }
                }
                Some(Value::String(s)) if s == "/" => '/',
                Some(Value::String(s)) if s == "." => '.',
                Some(s) => return Err(format!("chunk key separator {s} is not `/` or `.`")),
            };
            KeyEncoding { default, separator }
        }
        Some(e) => return Err(format!("chunk_key_encoding {e} is not an object")),
    };
    let codecs = match doc.get("codecs") {
        Some(Value::Array(c)) => c,
        other => return Err(format!("codecs {} is not a list", shown(other))),
    };
    let codec = match chain_of(codecs, dtype, true)? {
        Chained::Plain(chain) => Codec::Plain(chain),
        Chained::Sharded(config) => sharded(config, &chunk, dtype)?,
    };
    let fill_value = doc.get("fill_value").unwrap_or(&Value::Null);
    Ok(ArrayMeta {
        zarr: 3,
        fill: fill_bytes(dtype, fill_value)?,
        fill_text: fill_value.to_string(),
        shape,
        dtype,
        chunk,
        keys,
        codec,
    })
}

/// The bytes as one JSON object.
fn object(bytes: &[u8], what: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(format!("{what} is not a JSON object")),
        Err(e) => Err(format!("{what} is not JSON: {e}")),
    }
}

fn shown(v: Option<&Value>) -> String {
    v.map_or_else(|| "missing".to_string(), Value::to_string)
}

/// A list of dimensions (`shape`, `chunks`).
fn dims(doc: &Map<String, Value>, key: &str) -> Result<Vec<u64>, String> {
    let Some(Value::Array(a)) = doc.get(key) else {
        return Err(format!("{key} {} is not a list", shown(doc.get(key))));
    };
    if a.len() > MAX_RANK {
        return Err(format!(
            "{key} has {} dimensions, more than {MAX_RANK}",
            a.len()
        ));
    }
    a.iter()
        .map(|d| {
            d.as_u64()
                .ok_or_else(|| format!("{key} {} holds {d}, not a size", Value::Array(a.clone())))
        })
        .collect()
}

/// A chunk shape of the array's rank, no extent 0, and an element count that fits.
fn check_grid(shape: &[u64], chunk: &[u64], key: &str) -> Result<(), String> {
    if chunk.len() != shape.len() {
        return Err(format!(
            "{key} {chunk:?} has {} dimensions, the shape {shape:?} {}",
            chunk.len(),
            shape.len()
        ));
    }
    if chunk.contains(&0) {
        return Err(format!("{key} {chunk:?} has an extent 0"));
    }
    for (what, dims) in [("shape", shape), (key, chunk)] {
        if dims
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .is_none()
        {
            return Err(format!("{what} {dims:?}: the element count overflows"));
        }
    }
    Ok(())
}

/// The chunks along each dimension of a grid of `chunk`s over `shape`.
pub(crate) fn grid_counts(shape: &[u64], chunk: &[u64]) -> Vec<u64> {
    shape
        .iter()
        .zip(chunk)
        .map(|(&s, &c)| s.div_ceil(c))
        .collect()
}

/// zarr v2's numpy type strings (and tensorstore's names of the types numpy lacks):
/// the dtype and whether it is stored big-endian.
fn v2_dtype(s: &str) -> Result<(Dtype, bool), String> {
    if let Some(d) = named_dtype(s) {
        return Ok((d, false));
    }
    let refuse = || {
        format!(
            "dtype \"{s}\" is not one ckpt reads (bool, integers, float16/32/64, bfloat16, \
             complex64, float8 types)"
        )
    };
    let mut chars = s.chars();
    let order = chars.next().ok_or_else(refuse)?;
    let d = match chars.as_str() {
        "b1" => Dtype::BOOL,
        "i1" => Dtype::I8,
        "u1" => Dtype::U8,
        "i2" => Dtype::I16,
        "u2" => Dtype::U16,
        "i4" => Dtype::I32,
        "u4" => Dtype::U32,
        "i8" => Dtype::I64,
        "u8" => Dtype::U64,
        "f2" => Dtype::F16,
        "f4" => Dtype::F32,
        "f8" => Dtype::F64,
        "c8" => Dtype::C64,
        _ => return Err(refuse()),
    };
    let one_byte = d.bitsize() == 8;
    match order {
        '<' => Ok((d, false)),
        '>' => Ok((d, !one_byte)),
        '|' if one_byte => Ok((d, false)),
        _ => Err(refuse()),
    }
}

/// zarr v3's data type names.
fn v3_dtype(s: &str) -> Result<Dtype, String> {
    named_dtype(s)
        .or(match s {
            "bool" => Some(Dtype::BOOL),
            "int8" => Some(Dtype::I8),
            "uint8" => Some(Dtype::U8),
            "int16" => Some(Dtype::I16),
            "uint16" => Some(Dtype::U16),
            "int32" => Some(Dtype::I32),
            "uint32" => Some(Dtype::U32),
            "int64" => Some(Dtype::I64),
            "uint64" => Some(Dtype::U64),
            "float16" => Some(Dtype::F16),
            "float32" => Some(Dtype::F32),
            "float64" => Some(Dtype::F64),
            "complex64" => Some(Dtype::C64),
            _ => None,
        })
        .ok_or_else(|| {
            format!(
                "data_type \"{s}\" is not one ckpt reads (bool, integers, float16/32/64, \
                 bfloat16, complex64, float8 types)"
            )
        })
}

/// The zarr v3 `data_type` of `dtype` and its zero as `fill_value` (what tensorstore
/// writes for orbax: `false`, `0`, `0.0`); `None` for types zarr v3 has no name for
/// (sub-byte floats, complex: not written).
pub(crate) fn v3_name(dtype: Dtype) -> Option<(&'static str, &'static str)> {
    Some(match dtype {
        Dtype::BOOL => ("bool", "false"),
        Dtype::I8 => ("int8", "0"),
        Dtype::U8 => ("uint8", "0"),
        Dtype::I16 => ("int16", "0"),
        Dtype::U16 => ("uint16", "0"),
        Dtype::I32 => ("int32", "0"),
        Dtype::U32 => ("uint32", "0"),
        Dtype::I64 => ("int64", "0"),
        Dtype::U64 => ("uint64", "0"),
        Dtype::F16 => ("float16", "0.0"),
        Dtype::BF16 => ("bfloat16", "0.0"),
        Dtype::F32 => ("float32", "0.0"),
        Dtype::F64 => ("float64", "0.0"),
        Dtype::F8_E4M3 => ("float8_e4m3fn", "0.0"),
        Dtype::F8_E5M2 => ("float8_e5m2", "0.0"),
        Dtype::F8_E4M3FNUZ => ("float8_e4m3fnuz", "0.0"),
        Dtype::F8_E5M2FNUZ => ("float8_e5m2fnuz", "0.0"),
        _ => return None,
    })
}

/// The names tensorstore gives the types numpy lacks, in both zarr versions
/// (ml_dtypes' names; the float8 spellings are read from ml_dtypes, not from a
/// fixture).
fn named_dtype(s: &str) -> Option<Dtype> {
    Some(match s {
        "bfloat16" => Dtype::BF16,
        "float8_e4m3fn" => Dtype::F8_E4M3,
        "float8_e5m2" => Dtype::F8_E5M2,
        "float8_e4m3fnuz" => Dtype::F8_E4M3FNUZ,
        "float8_e5m2fnuz" => Dtype::F8_E5M2FNUZ,
        "float8_e8m0fnu" => Dtype::F8_E8M0,
        _ => return None,
    })
}

/// Bytes of one element of `dtype`.
pub(crate) fn item_size(dtype: Dtype) -> u64 {
    (dtype.bitsize() / 8) as u64
}

/// Bytes swapped as one unit when a `dtype` stored big-endian is read (a complex
/// number's two halves each).
pub(crate) fn swap_unit(dtype: Dtype) -> usize {
    match dtype {
        Dtype::C64 => 4,
        d => d.bitsize() / 8,
    }
}

/// One element of the fill value, little-endian: `Ok(None)` for a value the dtype
/// cannot hold (or one ckpt does not convert), an error for one that is no fill value.
fn fill_bytes(dtype: Dtype, v: &Value) -> Result<Option<Vec<u8>>, String> {
    let size = item_size(dtype) as usize;
    // tensorstore: `null` is zero bytes.
    if v.is_null() {
        return Ok(Some(vec![0; size]));
    }
    if let Value::String(s) = v {
        if let Some(hex) = s.strip_prefix("0x") {
            // zarr v3: the element's bits, as a hexadecimal number.
            let bits = u64::from_str_radix(hex, 16)
                .map_err(|_| format!("fill_value \"{s}\" is not hexadecimal"))?;
            if size < 8 && bits >> (8 * size) != 0 || dtype == Dtype::C64 {
                return Ok(None);
            }
            return Ok(Some(bits.to_le_bytes()[..size].to_vec()));
        }
    }
    let float = |v: &Value| -> Result<Option<f64>, String> {
        Ok(match v {
            Value::Number(n) => n.as_f64(),
            Value::String(s) if s == "NaN" => Some(f64::NAN),
            Value::String(s) if s == "Infinity" => Some(f64::INFINITY),
            Value::String(s) if s == "-Infinity" => Some(f64::NEG_INFINITY),
            Value::String(_) => None,
            Value::Bool(b) => Some(f64::from(u8::from(*b))),
            other => return Err(format!("fill_value {other} is not a number")),
        })
    };
    // A finite value the type cannot hold (it would round to infinity) is no fill.
    let fits = |x: f64, y: f64| !x.is_finite() || y.is_finite();
    let out = match dtype {
        Dtype::F16 => float(v)?
            .map(|x| (x, half::f16::from_f64(x)))
            .filter(|(x, y)| fits(*x, y.to_f64()))
            .map(|(_, y)| y.to_le_bytes().to_vec()),
        Dtype::BF16 => float(v)?
            .map(|x| (x, half::bf16::from_f64(x)))
            .filter(|(x, y)| fits(*x, y.to_f64()))
            .map(|(_, y)| y.to_le_bytes().to_vec()),
        Dtype::F32 => float(v)?
            .filter(|&x| fits(x, f64::from(x as f32)))
            .map(|x| (x as f32).to_le_bytes().to_vec()),
        Dtype::F64 => float(v)?.map(|x| x.to_le_bytes().to_vec()),
        Dtype::C64 => match v {
            Value::Array(pair) if pair.len() == 2 => match (float(&pair[0])?, float(&pair[1])?) {
                (Some(re), Some(im)) => {
                    let mut b = (re as f32).to_le_bytes().to_vec();
                    b.extend((im as f32).to_le_bytes());
                    Some(b)
                }
                _ => None,
            },
            other => float(other)?.map(|re| {
                let mut b = (re as f32).to_le_bytes().to_vec();
                b.extend(0f32.to_le_bytes());
                b
            }),
        },
        // Zero is 0x00 in every 8-bit float but e8m0 (which has no zero); other values
        // are not converted here.
        Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::F8_E4M3FNUZ | Dtype::F8_E5M2FNUZ => {
            (float(v)? == Some(0.0)).then(|| vec![0])
        }
        Dtype::BOOL => match v {
            Value::Bool(b) => Some(vec![u8::from(*b)]),
            other => match float(other)? {
                Some(x) if x == 0.0 || x == 1.0 => Some(vec![x as u8]),
                _ => None,
            },
        },
        Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64 => integer(v)?.and_then(|x| {
            let bits = (size * 8) as u32;
            let lo = -(1i128 << (bits - 1));
            let hi = (1i128 << (bits - 1)) - 1;
            (lo..=hi)
                .contains(&x)
                .then(|| (x as i64).to_le_bytes()[..size].to_vec())
        }),
        Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => integer(v)?.and_then(|x| {
            let bits = (size * 8) as u32;
            let hi = if bits == 64 {
                i128::from(u64::MAX)
            } else {
                (1i128 << bits) - 1
            };
            (0..=hi)
                .contains(&x)
                .then(|| (x as u64).to_le_bytes()[..size].to_vec())
        }),
        _ => None,
    };
    Ok(out)
}

/// An integer fill value (a float with no fraction counts).
fn integer(v: &Value) -> Result<Option<i128>, String> {
    Ok(match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Some(i128::from(u))
            } else if let Some(i) = n.as_i64() {
                Some(i128::from(i))
            } else {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 1e38)
                    .map(|f| f as i128)
            }
        }
        Value::Bool(b) => Some(i128::from(*b)),
        Value::String(_) => None,
        other => return Err(format!("fill_value {other} is not a number")),
    })
}

/// A codec list read: the chain of a plain array, or the configuration of its
/// sharding codec.
enum Chained<'a> {
    Plain(Chain),
    Sharded(&'a Map<String, Value>),
}

/// Reads a zarr v3 codec list: no array-to-array codec, one array-to-bytes codec
/// (`bytes`, or `sharding_indexed` where `shard` allows it, then nothing after it),
/// then `zstd` and/or `crc32c` in that order.
fn chain_of<'a>(codecs: &'a [Value], dtype: Dtype, shard: bool) -> Result<Chained<'a>, String> {
    let name = |c: &Value| c.get("name").and_then(Value::as_str).map(str::to_string);
    let config = |c: &'a Value| c.get("configuration").and_then(Value::as_object);
    let Some((first, rest)) = codecs.split_first() else {
        return Err("the codec list is empty".into());
    };
    let mut chain = Chain {
        big_endian: false,
        zstd: false,
        crc32c: false,
    };
    match name(first).as_deref() {
        Some("bytes") => {
            let endian = config(first).and_then(|c| c.get("endian"));
            chain.big_endian = match endian.and_then(Value::as_str) {
                Some("little") => false,
                Some("big") => item_size(dtype) > 1,
                None if item_size(dtype) == 1 => false,
                _ => {
                    return Err(format!(
                        "codec bytes: endian {} is not \"little\" or \"big\"",
                        shown(endian)
                    ))
                }
            };
        }
        Some("sharding_indexed") if shard => {
            if let Some(extra) = rest.first() {
                return Err(format!(
                    "codec {} after sharding_indexed: a shard compressed whole is not read \
                     (its inner chunks could not be found without decoding all of it)",
                    shown(extra.get("name"))
                ));
            }
            let c = config(first).ok_or("codec sharding_indexed has no configuration")?;
            return Ok(Chained::Sharded(c));
        }
        Some("sharding_indexed") => {
            return Err("sharding_indexed inside a shard (nested sharding) is not read".into())
        }
        Some(other) => {
            return Err(format!(
                "codec {other}: only bytes or sharding_indexed may come first (array-to-array \
                 codecs such as transpose are not read)"
            ))
        }
        None => return Err(format!("codec {first} has no name")),
    }
    for c in rest {
        match name(c).as_deref() {
            Some("zstd") if !chain.zstd && !chain.crc32c => chain.zstd = true,
            Some("crc32c") if !chain.crc32c => chain.crc32c = true,
            Some(n @ ("zstd" | "crc32c")) => {
                return Err(format!(
                    "codec {n} here: only bytes, then zstd, then crc32c are read"
                ))
            }
            Some(other) => {
                return Err(format!(
                    "codec {other} is not read (only bytes, zstd, crc32c, sharding_indexed)"
                ))
            }
            None => return Err(format!("codec {c} has no name")),
        }
    }
    Ok(Chained::Plain(chain))
}

/// The `sharding_indexed` codec of shards of shape `shard`.
fn sharded(c: &Map<String, Value>, shard: &[u64], dtype: Dtype) -> Result<Codec, String> {
    let inner = dims(c, "chunk_shape").map_err(|e| format!("codec sharding_indexed: {e}"))?;
    if inner.len() != shard.len() || inner.iter().zip(shard).any(|(&i, &s)| i == 0 || s % i != 0) {
        return Err(format!(
            "codec sharding_indexed: inner chunk shape {inner:?} does not divide the shard \
             shape {shard:?}"
        ));
    }
    let Some(Value::Array(codecs)) = c.get("codecs") else {
        return Err("codec sharding_indexed: codecs is not a list".into());
    };
    let Chained::Plain(chain) = chain_of(codecs, dtype, false)? else {
        return Err("sharding_indexed inside a shard (nested sharding) is not read".into());
    };
    let index_crc = match c.get("index_codecs") {
        None => true,
        Some(Value::Array(ic)) => match chain_of(ic, Dtype::U64, false) {
            Ok(Chained::Plain(Chain {
                big_endian: false,
                zstd: false,
                crc32c,
            })) => crc32c,
            _ => {
                return Err(format!(
                    "codec sharding_indexed: index codecs {}: only bytes (little-endian) \
                         and crc32c are read",
                    Value::Array(ic.clone())
                ))
            }
        },
        Some(ic) => return Err(format!("codec sharding_indexed: index_codecs {ic}")),
    };
    let index_at_end = match c.get("index_location") {
        None => true,
        Some(Value::String(s)) if s == "end" => true,
        Some(Value::String(s)) if s == "start" => false,
        Some(l) => return Err(format!("codec sharding_indexed: index_location {l}")),
    };
    Ok(Codec::Sharded {
        inner,
        chain,
        index_crc,
        index_at_end,
    })
}

/// Bytes of a shard index of `n` inner chunks.
pub(crate) fn index_len(n: u64, crc: bool) -> Option<u64> {
    n.checked_mul(16)?.checked_add(if crc { 4 } else { 0 })
}

/// Reads a shard index (`bytes`: exactly [`index_len`] of them) of a shard of
/// `shard_len` bytes: per inner chunk, `None` where missing, else its byte range in
/// the shard (checked to lie inside it).
pub(crate) fn parse_index(
    bytes: &[u8],
    n: u64,
    crc: bool,
    shard_len: u64,
) -> Result<Vec<Option<(u64, u64)>>, String> {
    if Some(bytes.len() as u64) != index_len(n, crc) {
        return Err(format!(
            "the shard index is {} bytes, not the {} of {n} inner chunks",
            bytes.len(),
            index_len(n, crc).map_or("(overflowing)".into(), |l| l.to_string())
        ));
    }
    let body = &bytes[..n as usize * 16];
    if crc {
        let want = u32::from_le_bytes([
            bytes[bytes.len() - 4],
            bytes[bytes.len() - 3],
            bytes[bytes.len() - 2],
            bytes[bytes.len() - 1],
        ]);
        let got = crc32c::crc32c(body);
        if got != want {
            return Err(format!(
                "the shard index's CRC-32C is {want:08x}, its bytes give {got:08x} (damaged)"
            ));
        }
    }
    let mut out = Vec::with_capacity(n as usize);
    for (i, e) in body.chunks_exact(16).enumerate() {
        let mut a = [0u8; 8];
        a.copy_from_slice(&e[..8]);
        let off = u64::from_le_bytes(a);
        a.copy_from_slice(&e[8..]);
        let len = u64::from_le_bytes(a);
        match (off, len) {
            (MISSING, MISSING) => out.push(None),
            (MISSING, _) | (_, MISSING) => {
                return Err(format!(
                    "shard index entry {i}: offset {off:#x}, length {len:#x}: only one of \
                     them marks a missing chunk"
                ))
            }
            _ if off.checked_add(len).is_none_or(|end| end > shard_len) => {
                return Err(format!(
                    "shard index entry {i}: bytes {off}..+{len} lie outside the shard \
                     ({shard_len} bytes)"
                ))
            }
            _ => out.push(Some((off, len))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V2: &str = r#"{"chunks":[4,8],"compressor":{"id":"zstd","level":1},"dimension_separator":".","dtype":"bfloat16","fill_value":null,"filters":null,"order":"C","shape":[8,16],"zarr_format":2}"#;
    const V3: &str = r#"{"chunk_grid":{"configuration":{"chunk_shape":[4,8]},"name":"regular"},
        "chunk_key_encoding":{"name":"default"},
        "codecs":[{"configuration":{"chunk_shape":[4,8],
            "codecs":[{"configuration":{"endian":"little"},"name":"bytes"},
                      {"configuration":{"checksum":false,"level":3},"name":"zstd"}],
            "index_codecs":[{"configuration":{"endian":"little"},"name":"bytes"},{"name":"crc32c"}]},
          "name":"sharding_indexed"}],
        "data_type":"bfloat16","fill_value":0.0,"node_type":"array","shape":[8,16],"zarr_format":3}"#;

    #[test]
    fn tensorstores_v2_metadata_is_read() {
        let m = parse_v2(V2.as_bytes()).unwrap();
        assert_eq!(
            (m.zarr, m.shape.clone(), m.chunk.clone(), m.dtype),
            (2, vec![8, 16], vec![4, 8], Dtype::BF16)
        );
        assert_eq!(m.fill, Some(vec![0, 0]));
        assert_eq!(
            m.codec,
            Codec::Plain(Chain {
                big_endian: false,
                zstd: true,
                crc32c: false
            })
        );
        assert_eq!(m.keys.key(&[3, 1]), "3.1");
        assert_eq!(m.keys.key(&[]), "0");
        assert_eq!(grid_counts(&m.shape, &m.chunk), vec![2, 2]);
    }

    #[test]
    fn tensorstores_v3_metadata_is_read() {
        let m = parse_v3(V3.as_bytes()).unwrap();
        assert_eq!((m.zarr, m.dtype), (3, Dtype::BF16));
        assert_eq!(
            m.codec,
            Codec::Sharded {
                inner: vec![4, 8],
                chain: Chain {
                    big_endian: false,
                    zstd: true,
                    crc32c: false
                },
                index_crc: true,
                index_at_end: true,
            }
        );
        assert_eq!(m.keys.key(&[1, 0]), "c/1/0");
        assert_eq!(m.keys.key(&[]), "c");
    }

    #[test]
    fn byte_orders_and_types() {
        let cases = [
            ("<f4", Dtype::F32, false),
            (">f4", Dtype::F32, true),
            ("|u1", Dtype::U8, false),
            (">i1", Dtype::I8, false),
            ("|b1", Dtype::BOOL, false),
            (">c8", Dtype::C64, true),
            ("float8_e4m3fn", Dtype::F8_E4M3, false),
        ];
        for (s, d, big) in cases {
            assert_eq!(v2_dtype(s), Ok((d, big)), "{s}");
        }
        for bad in ["<U4", "|O", "<m8", "=f4", "", "int4", "<c16"] {
            assert!(v2_dtype(bad).is_err(), "{bad}");
        }
        assert_eq!(v3_dtype("int32"), Ok(Dtype::I32));
        assert!(v3_dtype("int4").is_err());
    }

    #[test]
    fn fill_values_become_element_bytes() {
        let f = |d, v: &str| fill_bytes(d, &serde_json::from_str(v).unwrap());
        assert_eq!(
            f(Dtype::F32, "1.5"),
            Ok(Some(1.5f32.to_le_bytes().to_vec()))
        );
        assert_eq!(f(Dtype::BF16, "1.0"), Ok(Some(vec![0x80, 0x3f])));
        assert_eq!(
            f(Dtype::F32, "\"NaN\""),
            Ok(Some(f32::NAN.to_le_bytes().to_vec()))
        );
        assert_eq!(
            f(Dtype::F32, "\"0x7fc00000\""),
            Ok(Some(vec![0, 0, 0xc0, 0x7f]))
        );
        assert_eq!(f(Dtype::I16, "-2"), Ok(Some(vec![0xfe, 0xff])));
        assert_eq!(f(Dtype::U8, "256"), Ok(None));
        assert_eq!(f(Dtype::F32, "1e40"), Ok(None));
        assert_eq!(f(Dtype::BF16, "1e40"), Ok(None));
        assert_eq!(f(Dtype::F16, "70000"), Ok(None));
        assert_eq!(f(Dtype::U8, "-1"), Ok(None));
        assert_eq!(f(Dtype::I32, "0.5"), Ok(None));
        assert_eq!(f(Dtype::BOOL, "true"), Ok(Some(vec![1])));
        assert_eq!(f(Dtype::F8_E8M0, "0"), Ok(None));
        assert_eq!(f(Dtype::F8_E8M0, "null"), Ok(Some(vec![0])));
        assert!(f(Dtype::F32, "{}").is_err());
    }

    #[test]
    fn what_is_not_read_is_named() {
        let v2 = |edit: &dyn Fn(&mut Map<String, Value>)| {
            let mut m: Map<String, Value> = serde_json::from_str(V2).unwrap();
            edit(&mut m);
            parse_v2(Value::Object(m).to_string().as_bytes()).unwrap_err()
        };
        assert!(v2(&|m| {
            m.insert("order".into(), "F".into());
        })
        .contains("only C order"));
        assert!(v2(&|m| {
            m.insert("compressor".into(), serde_json::json!({"id": "blosc"}));
        })
        .contains("\"blosc\""));
        assert!(v2(&|m| {
            m.insert("filters".into(), serde_json::json!([{"id": "delta"}]));
        })
        .contains("filters"));
        assert!(v2(&|m| {
            m.insert("chunks".into(), serde_json::json!([0, 8]));
        })
        .contains("extent 0"));
        assert!(v2(&|m| {
            m.insert("chunks".into(), serde_json::json!([4]));
        })
        .contains("dimensions"));
        assert!(v2(&|m| {
            m.insert("shape".into(), serde_json::json!([u64::MAX, 3]));
        })
        .contains("overflows"));
        let v3 = |from: &str, to: &str| parse_v3(V3.replace(from, to).as_bytes()).unwrap_err();
        assert!(v3("\"zstd\"", "\"gzip\"").contains("gzip"));
        assert!(v3(
            "\"chunk_shape\":[4,8]},\"name\":\"regular\"",
            "\"chunk_shape\":[4,8]},\"name\":\"rectilinear\""
        )
        .contains("regular"));
        assert!(v3(
            "\"codecs\":[{\"configuration\":{\"chunk_shape\":[4,8]",
            "\"codecs\":[{\"configuration\":{\"chunk_shape\":[3,8]"
        )
        .contains("does not divide"));
    }

    #[test]
    fn shard_indices_are_checked() {
        let mut idx = Vec::new();
        for (o, l) in [(0u64, 10u64), (MISSING, MISSING)] {
            idx.extend(o.to_le_bytes());
            idx.extend(l.to_le_bytes());
        }
        let crc = crc32c::crc32c(&idx);
        let mut with_crc = idx.clone();
        with_crc.extend(crc.to_le_bytes());
        assert_eq!(
            parse_index(&with_crc, 2, true, 46),
            Ok(vec![Some((0, 10)), None])
        );
        assert_eq!(
            parse_index(&idx, 2, false, 46),
            Ok(vec![Some((0, 10)), None])
        );
        with_crc[3] ^= 1;
        assert!(parse_index(&with_crc, 2, true, 46)
            .unwrap_err()
            .contains("CRC-32C"));
        assert!(parse_index(&idx, 2, false, 5)
            .unwrap_err()
            .contains("outside the shard"));
        assert!(parse_index(&idx, 3, false, 46)
            .unwrap_err()
            .contains("not the"));
    }
    #[test]
    fn v3_names_written_read_back() {
        for d in [
            Dtype::BOOL,
            Dtype::I8,
            Dtype::U8,
            Dtype::I16,
            Dtype::U16,
            Dtype::I32,
            Dtype::U32,
            Dtype::I64,
            Dtype::U64,
            Dtype::F16,
            Dtype::BF16,
            Dtype::F32,
            Dtype::F64,
            Dtype::F8_E4M3,
            Dtype::F8_E5M2,
            Dtype::F8_E4M3FNUZ,
            Dtype::F8_E5M2FNUZ,
        ] {
            let (name, fill) = v3_name(d).unwrap();
            assert_eq!(v3_dtype(name), Ok(d));
            let fill: Value = serde_json::from_str(fill).unwrap();
            assert_eq!(
                fill_bytes(d, &fill),
                Ok(Some(vec![0; item_size(d) as usize]))
            );
        }
        assert_eq!(v3_name(Dtype::F4), None);
    }
}
