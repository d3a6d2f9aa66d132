//! PyTorch's `torch.save` files (`.pth`, `.pt`, `.bin`): a zip archive (stored, not
//! compressed) holding `<dir>/data.pkl`, a pickle of the saved object, and one entry
//! `<dir>/data/<key>` per storage with its raw little-endian bytes.
//!
//! The pickle is data, not a program: candle's pickle parser turns it into a tree of
//! objects without importing or calling anything, and ckpt then accepts only the
//! globals these files use (torch's tensor rebuild functions and storage classes,
//! `collections.OrderedDict`); any other global is an error that names it. Tensors are
//! found anywhere in the saved object and named by their path (`state.0.exp_avg` in an
//! optimizer's state dict); values that are not tensors are listed in the metadata
//! (`torch.non_tensor`), never silently dropped. A tensor is a view of a storage: a
//! storage offset is fine, a non-contiguous stride is refused by name.

use super::pickle::{self, Value};
use super::{byte_len, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::formats::FileFormat;
use crate::Dtype;
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::io::Cursor;
use std::path::Path;

/// The globals a `torch.save` pickle may name; anything else is refused.
const ALLOWED: &[(&str, &str)] = &[
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("collections", "OrderedDict"),
];

/// The start of the legacy (pre-1.6) format: a pickled magic number.
const LEGACY_MAGIC: &[u8] = &[0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20];

/// A zip archive's local file header.
pub(crate) fn looks_like(head: &[u8]) -> bool {
    head.starts_with(b"PK\x03\x04")
}

/// The legacy `torch.save` format, which ckpt refuses by name.
pub(crate) fn looks_like_legacy(head: &[u8]) -> bool {
    head.starts_with(LEGACY_MAGIC)
}

fn bad(problem: impl Into<String>) -> Error {
    Error::InvalidTorch {
        problem: problem.into(),
    }
}

/// Reads a mapped `torch.save` archive.
pub(crate) fn read(path: &Path, map: Option<Mmap>) -> Result<TensorFile> {
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let (tensors, metadata) = parse(all).map_err(|e| e.with_path(path))?;
    TensorFile::from_parts(path, map, FileFormat::TorchSave, tensors, metadata)
}

/// One stored zip entry: where its bytes start in the file and how many there are.
struct Stored {
    start: u64,
    len: u64,
    compressed: bool,
}

pub(crate) fn parse(all: &[u8]) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    let archive = Archive::open(all)?;
    let obj = archive.object()?;
    check_globals(&obj)?;
    let (tensors, non_tensor) = archive.tensors(obj, String::new())?;
    let mut metadata = BTreeMap::from([("format".to_string(), "torch.save".to_string())]);
    if !non_tensor.is_empty() {
        metadata.insert("torch.non_tensor".into(), non_tensor.join(","));
    }
    Ok((tensors, metadata))
}

/// A `torch.save` archive's index: its pickle and where each storage lies. Readers of
/// formats built on torch.save (Megatron's `model_optim_rng.pt`) take the object tree
/// from here, check the globals they accept themselves, and locate the tensors of the
/// parts they read.
pub(crate) struct Archive<'a> {
    all: &'a [u8],
    /// The archive's folder (`archive/`), before `data.pkl` and `data/<key>`.
    dir: String,
    pkl_name: String,
    entries: HashMap<String, Stored>,
}

impl<'a> Archive<'a> {
    /// Reads the zip directory of a mapped file.
    pub(crate) fn open(all: &'a [u8]) -> Result<Archive<'a>> {
        let mut zip = zip::ZipArchive::new(Cursor::new(all))
            .map_err(|e| bad(format!("not a readable zip archive: {e}")))?;
        let mut entries: HashMap<String, Stored> = HashMap::new();
        for i in 0..zip.len() {
            let f = zip
                .by_index_raw(i)
                .map_err(|e| bad(format!("zip entry {i}: {e}")))?;
            let name = f
                .name()
                .map_err(|e| bad(format!("zip entry {i}: {e}")))?
                .to_string();
            let start = f
                .data_start()
                .ok_or_else(|| bad(format!("zip entry `{name}`: no data offset")))?;
            let compressed = f.compression() != zip::CompressionMethod::Stored;
            let len = f.compressed_size();
            entries.insert(
                name,
                Stored {
                    start,
                    len,
                    compressed,
                },
            );
        }
        let mut pickles: Vec<&String> = entries
            .keys()
            .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
            .collect();
        pickles.sort();
        let pkl_name = match pickles.as_slice() {
            [one] => (*one).clone(),
            [] => {
                return Err(bad(
                    "a zip archive without `<name>/data.pkl`: not a torch.save file",
                ))
            }
            many => return Err(bad(format!("several pickles in one archive: {many:?}"))),
        };
        let dir = pkl_name.trim_end_matches("data.pkl").to_string();
        Ok(Archive {
            all,
            dir,
            pkl_name,
            entries,
        })
    }

    /// The saved object, parsed (never run); its globals are the caller's to check.
    pub(crate) fn object(&self) -> Result<Value> {
        let pkl = &self.entries[&self.pkl_name];
        if pkl.compressed {
            return Err(bad(format!(
                "`{}` is compressed: torch.save stores it",
                self.pkl_name
            )));
        }
        unpickle(slice(self.all, pkl.start, pkl.len, &self.pkl_name)?)
    }

    /// The tensors anywhere in `obj` (a part of [`Archive::object`]), named by their
    /// path under `path`, located in the file; and the paths of the plain values
    /// (numbers, strings, `None`) met on the way.
    pub(crate) fn tensors(
        &self,
        obj: Value,
        path: String,
    ) -> Result<(Vec<TensorEntry>, Vec<String>)> {
        let mut found = Vec::new();
        let mut non_tensor = Vec::new();
        walk(obj, path, &mut found, &mut non_tensor)?;
        let mut tensors = Vec::with_capacity(found.len());
        for t in found {
            tensors.push(locate(&t, &self.dir, &self.entries)?);
        }
        Ok((tensors, non_tensor))
    }
}

fn slice<'a>(all: &'a [u8], start: u64, len: u64, what: &str) -> Result<&'a [u8]> {
    let end = start.checked_add(len).ok_or_else(|| overflow(what))?;
    let (s, e) = (usize::try_from(start), usize::try_from(end));
    match (s, e) {
        (Ok(s), Ok(e)) if e <= all.len() => Ok(&all[s..e]),
        _ => Err(bad(format!(
            "`{what}` lies at bytes {start}..{end}, past the end of the file ({} bytes)",
            all.len()
        ))),
    }
}

/// Parses `data.pkl`; never imports or calls anything.
pub(crate) fn unpickle(bytes: &[u8]) -> Result<Value> {
    pickle::parse(bytes).map_err(|e| bad(format!("data.pkl: {e}")))
}

pub(crate) fn allowed(module: &str, class: &str) -> bool {
    ALLOWED.contains(&(module, class))
        || (module == "torch" && class.ends_with("Storage") && storage_dtype(class).is_some())
}

/// Refuses any global outside the allow-list, by name.
fn check_globals(obj: &Value) -> Result<()> {
    let mut names = Vec::new();
    obj.globals(&mut names);
    match names.into_iter().find(|(m, c)| !allowed(m, c)) {
        None => Ok(()),
        Some((module, class)) => Err(bad(format!(
            "data.pkl names the global `{module}.{class}`, which is not allowed in a checkpoint (ckpt accepts only torch's tensor rebuild functions, storage classes and OrderedDict)"
        ))),
    }
}

fn storage_dtype(class: &str) -> Option<Dtype> {
    Some(match class {
        "FloatStorage" => Dtype::F32,
        "DoubleStorage" => Dtype::F64,
        "HalfStorage" => Dtype::F16,
        "BFloat16Storage" => Dtype::BF16,
        "LongStorage" => Dtype::I64,
        "IntStorage" => Dtype::I32,
        "ShortStorage" => Dtype::I16,
        "CharStorage" => Dtype::I8,
        "ByteStorage" => Dtype::U8,
        "BoolStorage" => Dtype::BOOL,
        "Float8_e4m3fnStorage" => Dtype::F8_E4M3,
        "Float8_e5m2Storage" => Dtype::F8_E5M2,
        _ => return None,
    })
}

/// A tensor found in the pickle, before its bytes are located.
struct Found {
    name: String,
    dtype: Dtype,
    key: String,
    storage_numel: u64,
    offset: u64,
    shape: Vec<u64>,
    stride: Vec<u64>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn key_text(k: &Value) -> Option<String> {
    match k {
        Value::Str(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn walk(obj: Value, path: String, out: &mut Vec<Found>, skipped: &mut Vec<String>) -> Result<()> {
    match obj {
        Value::Dict(kv) => {
            for (k, v) in kv {
                let key = key_text(&k).ok_or_else(|| {
                    bad(format!(
                        "`{path}`: a dict key that is not a string or integer"
                    ))
                })?;
                walk(v, join(&path, &key), out, skipped)?;
            }
            Ok(())
        }
        Value::List(v) | Value::Tuple(v) => {
            for (i, o) in v.into_iter().enumerate() {
                walk(o, join(&path, &i.to_string()), out, skipped)?;
            }
            Ok(())
        }
        Value::Call { callable, args } => match callable.global() {
            Some((_, "_rebuild_tensor_v2")) => {
                out.push(tensor(&path, *args)?);
                Ok(())
            }
            Some((_, "_rebuild_parameter")) => {
                let mut a = tuple(*args, &path)?;
                if a.is_empty() {
                    return Err(bad(format!(
                        "`{path}`: _rebuild_parameter without a tensor"
                    )));
                }
                walk(a.remove(0), path, out, skipped)
            }
            _ => Err(bad(format!("`{path}`: an object ckpt does not read"))),
        },
        Value::Build { object, .. } => walk(*object, path, out, skipped),
        Value::Int(_) | Value::Float(_) | Value::Str(_) | Value::Bool(_) | Value::None => {
            skipped.push(if path.is_empty() {
                "<root>".into()
            } else {
                path
            });
            Ok(())
        }
        _ => Err(bad(format!("`{path}`: an object ckpt does not read"))),
    }
}

fn tuple(o: Value, path: &str) -> Result<Vec<Value>> {
    match o {
        Value::Tuple(v) => Ok(v),
        _ => Err(bad(format!("`{path}`: expected a tuple"))),
    }
}

fn uint(o: &Value, path: &str, what: &str) -> Result<u64> {
    match o {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        _ => Err(bad(format!(
            "`{path}`: {what} is not a non-negative integer"
        ))),
    }
}

fn uints(o: &Value, path: &str, what: &str) -> Result<Vec<u64>> {
    match o {
        Value::Tuple(v) => v.iter().map(|x| uint(x, path, what)).collect(),
        _ => Err(bad(format!("`{path}`: {what} is not a tuple"))),
    }
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks, ...)`
/// where storage is `persistent_load(("storage", torch.XStorage, key, location, numel))`.
fn tensor(path: &str, args: Value) -> Result<Found> {
    let a = tuple(args, path)?;
    if a.len() < 4 {
        return Err(bad(format!(
            "`{path}`: _rebuild_tensor_v2 with {} arguments",
            a.len()
        )));
    }
    let storage = match &a[0] {
        Value::PersistentId(s) => match s.as_ref() {
            Value::Tuple(s) if s.len() == 5 => s,
            _ => {
                return Err(bad(format!(
                    "`{path}`: a storage reference ckpt does not read"
                )))
            }
        },
        _ => {
            return Err(bad(format!(
                "`{path}`: the tensor's storage is not a persistent id"
            )))
        }
    };
    let dtype = match &storage[1] {
        Value::Global {
            name: class_name, ..
        } => storage_dtype(class_name)
            .ok_or_else(|| bad(format!("`{path}`: storage type `{class_name}` is not read")))?,
        _ => return Err(bad(format!("`{path}`: the storage type is not a class"))),
    };
    let key = key_text(&storage[2])
        .ok_or_else(|| bad(format!("`{path}`: the storage key is not a string")))?;
    Ok(Found {
        name: path.to_string(),
        dtype,
        key,
        storage_numel: uint(&storage[4], path, "the storage size")?,
        offset: uint(&a[1], path, "the storage offset")?,
        shape: uints(&a[2], path, "the size")?,
        stride: uints(&a[3], path, "the stride")?,
    })
}

fn locate(t: &Found, dir: &str, entries: &HashMap<String, Stored>) -> Result<TensorEntry> {
    let name = &t.name;
    let err = |p: String| Error::InvalidTensor {
        tensor: name.clone(),
        problem: p,
    };
    if t.stride.len() != t.shape.len() {
        return Err(err(format!(
            "size {:?} and stride {:?} differ in rank",
            t.shape, t.stride
        )));
    }
    // Contiguous (C order) strides; dims of extent 1 may carry any stride.
    let mut expect = 1u64;
    for (d, (&n, &s)) in t.shape.iter().zip(&t.stride).enumerate().rev() {
        if n != 1 && s != expect {
            return Err(err(format!(
                "a non-contiguous view (size {:?}, stride {:?}, dim {d}): not supported; save `tensor.contiguous()`",
                t.shape, t.stride
            )));
        }
        expect = expect
            .checked_mul(n)
            .ok_or_else(|| overflow(format!("`{name}` element count")))?;
    }
    let entry_name = format!("{dir}data/{}", t.key);
    let stored = entries
        .get(&entry_name)
        .ok_or_else(|| err(format!("its storage `{entry_name}` is not in the archive")))?;
    if stored.compressed {
        return Err(err(format!("its storage `{entry_name}` is compressed")));
    }
    let elem = (t.dtype.bitsize() / 8) as u64;
    let storage_bytes = t
        .storage_numel
        .checked_mul(elem)
        .ok_or_else(|| overflow(format!("`{name}` storage size")))?;
    if storage_bytes != stored.len {
        return Err(err(format!(
            "storage `{entry_name}` holds {} bytes, the pickle says {} elements ({storage_bytes} bytes)",
            stored.len, t.storage_numel
        )));
    }
    let len = byte_len(t.dtype, &t.shape).ok_or_else(|| overflow(format!("`{name}` size")))?;
    let rel = t
        .offset
        .checked_mul(elem)
        .ok_or_else(|| overflow(format!("`{name}` offset")))?;
    let rel_end = rel
        .checked_add(len)
        .ok_or_else(|| overflow(format!("`{name}` end")))?;
    if rel_end > storage_bytes {
        return Err(err(format!(
            "bytes {rel}..{rel_end} of its view lie past the end of storage `{entry_name}` ({storage_bytes} bytes)"
        )));
    }
    let start = stored
        .start
        .checked_add(rel)
        .ok_or_else(|| overflow(format!("`{name}` start")))?;
    Ok(TensorEntry {
        name: name.clone(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        start,
        end: start + len,
        offsets: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/torch")
            .join(name);
        std::fs::read(p).unwrap()
    }

    #[test]
    fn ddp_file_names_shapes_and_views() {
        let (t, _) = parse(&fixture("ddp.pth")).unwrap();
        let by: BTreeMap<_, _> = t.iter().map(|e| (e.name.as_str(), e)).collect();
        assert_eq!(by["module.embed.weight"].shape, vec![8, 6]);
        assert_eq!(by["module.layer.q.weight"].dtype, Dtype::BF16);
        assert_eq!(by["module.scale"].shape, Vec::<u64>::new());
        // Two views of one storage: b starts 3 rows (3*6*4 bytes) after a.
        assert_eq!(by["module.split.b"].start - by["module.split.a"].start, 72);
    }

    #[test]
    fn nested_optimizer_state_is_named_by_path() {
        let (t, m) = parse(&fixture("optim.pt")).unwrap();
        let names: Vec<_> = t.iter().map(|e| e.name.as_str()).collect();
        assert!(names.contains(&"optim.state.0.exp_avg"), "{names:?}");
        assert!(names.contains(&"model.bias"), "{names:?}");
        assert!(
            m["torch.non_tensor"].contains("optim.param_groups.0.lr"),
            "{m:?}"
        );
    }

    #[test]
    fn non_contiguous_view_is_refused_by_name() {
        let e = parse(&fixture("noncontig.pth")).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("non-contiguous"), "{e}");
    }

    #[test]
    fn disallowed_global_is_named() {
        // GLOBAL 'os system', MARK, 'ls', TUPLE, REDUCE, STOP
        let p = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85R.";
        let obj = unpickle(p).unwrap();
        let e = check_globals(&obj).unwrap_err().to_string();
        assert!(e.contains("`os.system`"), "{e}");
    }

    #[test]
    fn truncated_pickle_is_an_error() {
        let e = unpickle(b"\x80\x02}q\x00(X\x05\x00\x00")
            .unwrap_err()
            .to_string();
        assert!(e.contains("data.pkl"), "{e}");
    }

    #[test]
    fn storage_offset_past_the_end_is_named() {
        let mut entries = HashMap::new();
        entries.insert(
            "x/data/0".to_string(),
            Stored {
                start: 100,
                len: 16,
                compressed: false,
            },
        );
        let f = Found {
            name: "w".into(),
            dtype: Dtype::F32,
            key: "0".into(),
            storage_numel: 4,
            offset: 2,
            shape: vec![3],
            stride: vec![1],
        };
        let e = locate(&f, "x/", &entries).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("past the end"), "{e}");
    }
}
