//! PyTorch DCP's default format (`torch.distributed.checkpoint.save` with the default
//! `FileSystemWriter`; FSDP2, torchtitan, TorchTune, Megatron's `torch_dist`): a
//! directory with a pickled `.metadata` and `__<rank>_<n>.distcp` data files.
//!
//! `.metadata` is a protocol-4 pickle of a `Metadata` dataclass. Its
//! `state_dict_metadata` gives every tensor's dtype, global size and chunks (offsets and
//! sizes in the global tensor), and lists the values that are not tensors
//! (`BytesStorageMetadata`: param groups, RNG and dataloader state). Its `storage_data`
//! maps each chunk (`MetadataIndex(fqn, offset, index)`) to `_StorageInfo(relative_path,
//! offset, length)`: where in which `.distcp` file the chunk lies. Each tensor chunk is a
//! whole `torch.save` archive of the chunk, written one after the other into the file,
//! so its bytes are located by reading that archive's pickle ([`torch_save`]) at the
//! chunk's offset; nothing is copied.
//!
//! Because the metadata records global shapes and every chunk, completeness is checked
//! exactly (a missing `.distcp` file is named with the tensors it holds). Chunks stored
//! with transforms (DCP's experimental compression extensions) and the
//! `SerializationFormat.SAFETENSORS` variant are refused by name. Megatron's N-D
//! flattened tensors (megatron-core 0.8 to 0.15) are stored in a reformulated shape:
//! [`flattened`] reads them as flat ranges of the real tensor.

mod flattened;

use self::flattened::FlatPiece;
use super::pickle::{self, Emitter, Value};
use super::{map_file, torch_save, FileFormat, Mapped, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::layout::flat::{numel, FlatRange};
use crate::layout::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The metadata file's name in a DCP directory.
pub(crate) const METADATA_FILE: &str = ".metadata";

/// One tensor of the metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DcpTensor {
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
}

/// One stored chunk of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DcpChunk {
    pub(crate) fqn: String,
    pub(crate) offsets: Vec<u64>,
    pub(crate) sizes: Vec<u64>,
    /// The `.distcp` file, relative to the directory.
    pub(crate) file: String,
    /// Where the chunk's `torch.save` archive lies in that file.
    pub(crate) start: u64,
    pub(crate) len: u64,
    /// When the chunk is a part of the archive's tensor (a reader mapped a flat stored
    /// tensor to the tensors it holds): which part. `None`: the whole tensor.
    pub(crate) part: Option<ChunkPart>,
    /// For a piece of a Megatron flattened tensor (stored `[1, .., 1, len]` in the
    /// reformulated shape): where it lies in the real tensor.
    pub(crate) flat: Option<FlatPiece>,
}

/// A contiguous part of a chunk archive's tensor, taken as a chunk of another tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkPart {
    /// The shape of the tensor the archive holds.
    pub(crate) stored: Vec<u64>,
    /// The elements of it (row-major) that make this chunk, `sizes` in shape.
    pub(crate) elements: FlatRange,
}

/// Where a value that is not a tensor (`BytesStorageMetadata`) is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DcpBytes {
    /// The `.distcp` file, relative to the directory.
    pub(crate) file: String,
    /// Where its bytes lie in that file.
    pub(crate) start: u64,
    pub(crate) len: u64,
}

/// A DCP directory's `.metadata`, read.
#[derive(Clone, Debug)]
pub(crate) struct DcpMetadata {
    pub(crate) tensors: BTreeMap<String, DcpTensor>,
    /// The tensors' names in the order `state_dict_metadata` lists them (the order of
    /// the saved state dicts, rank by rank).
    pub(crate) order: Vec<String>,
    /// Values stored as bytes (`BYTE_IO`), by name.
    pub(crate) bytes: Vec<String>,
    /// Where each of them is stored.
    pub(crate) bytes_at: BTreeMap<String, DcpBytes>,
    pub(crate) chunks: Vec<DcpChunk>,
}

fn bad(problem: impl Into<String>) -> Error {
    Error::InvalidTorch {
        problem: problem.into(),
    }
}

/// Every global a DCP metadata pickle may name: DCP's dataclasses, torch's dtypes and
/// `Size`, the layout and memory-format helpers, and the path class of `checkpoint_id`.
fn allowed(module: &str, name: &str) -> bool {
    match module {
        "torch.distributed.checkpoint.metadata" => matches!(
            name,
            "Metadata"
                | "TensorStorageMetadata"
                | "BytesStorageMetadata"
                | "TensorProperties"
                | "ChunkStorageMetadata"
                | "MetadataIndex"
                | "StorageMeta"
                | "_MEM_FORMAT_ENCODING"
        ),
        "torch.distributed.checkpoint.filesystem" => name == "_StorageInfo",
        // megatron-core 0.15's Metadata and SavePlan with its `mcore_data` (the original
        // shapes of flattened tensors).
        "megatron.core.dist_checkpointing.strategies.torch" => {
            matches!(name, "MCoreMetadata" | "MCoreSavePlan")
        }
        // `Metadata.all_local_plans` (torch 2.15 as Megatron's torch_dist saves it): the
        // ranks' save plans, plain dataclasses and an enum; not read.
        "torch.distributed.checkpoint.planner" => matches!(
            name,
            "SavePlan" | "WriteItem" | "TensorWriteData" | "WriteItemType"
        ),
        "torch" => name == "Size" || torch_dtype(name).is_some(),
        "torch.serialization" => name == "_get_layout",
        "pathlib" => matches!(
            name,
            "PosixPath" | "PurePosixPath" | "WindowsPath" | "PureWindowsPath"
        ),
        "collections" => name == "OrderedDict",
        _ => false,
    }
}

/// torch's dtype attribute names (`torch.bfloat16`).
fn torch_dtype(name: &str) -> Option<Dtype> {
    Some(match name {
        "float32" => Dtype::F32,
        "float64" => Dtype::F64,
        "float16" => Dtype::F16,
        "bfloat16" => Dtype::BF16,
        "int64" => Dtype::I64,
        "int32" => Dtype::I32,
        "int16" => Dtype::I16,
        "int8" => Dtype::I8,
        "uint8" => Dtype::U8,
        "bool" => Dtype::BOOL,
        "float8_e4m3fn" => Dtype::F8_E4M3,
        "float8_e5m2" => Dtype::F8_E5M2,
        _ => return None,
    })
}

/// The class an object was made from (`NEWOBJ` then `BUILD`), and its state.
fn object(v: &Value) -> Option<(&str, Option<&Value>)> {
    match v {
        Value::Build { object, state } => Some((object.call_of()?.0 .1, Some(state))),
        Value::Call { .. } => Some((v.call_of()?.0 .1, None)),
        _ => None,
    }
}

fn uint(v: &Value, what: &str) -> Result<u64> {
    match v {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        _ => Err(bad(format!("{what} is not a non-negative integer"))),
    }
}

/// `torch.Size((8, 6))`, or a plain tuple.
fn size(v: &Value, what: &str) -> Result<Vec<u64>> {
    let tuple = match v.call_of() {
        Some((("torch", "Size"), args)) => args.items().and_then(|a| a.first()),
        _ => Some(v),
    };
    tuple
        .and_then(Value::items)
        .ok_or_else(|| bad(format!("{what} is not a torch.Size")))?
        .iter()
        .map(|x| uint(x, what))
        .collect()
}

/// The original shapes of Megatron's flattened tensors, by name, from the metadata's
/// `mcore_data` (megatron-core 0.8 to 0.15: `{key: {'nd_reformulated_orig_global_shape':
/// (..)}}`, `{}` for the tensors that are not flattened); `None` without one.
fn mcore_shapes(mcore_data: Option<&Value>) -> Result<Option<BTreeMap<String, Vec<u64>>>> {
    let kv = match mcore_data {
        None | Some(Value::None) => return Ok(None),
        Some(Value::Dict(kv)) => kv,
        Some(_) => return Err(bad(".metadata: `mcore_data` is not a dict")),
    };
    let mut out = BTreeMap::new();
    for (k, v) in kv {
        let Value::Str(key) = k else {
            return Err(bad(".metadata: an `mcore_data` key that is not a string"));
        };
        if let Some(shape) = v.get("nd_reformulated_orig_global_shape") {
            let what = format!("tensor `{key}`: mcore_data's original shape");
            out.insert(key.clone(), size(shape, &what)?);
        }
    }
    Ok(Some(out))
}

/// Parses a `.metadata` pickle.
pub(crate) fn parse_metadata(bytes: &[u8]) -> Result<DcpMetadata> {
    let root = pickle::parse(bytes).map_err(|e| bad(format!(".metadata: {e}")))?;
    let mut names = Vec::new();
    root.globals(&mut names);
    if let Some((m, n)) = names.into_iter().find(|(m, n)| !allowed(m, n)) {
        return Err(bad(format!(
            ".metadata names the global `{m}.{n}`, which is not allowed in DCP metadata"
        )));
    }
    let state = match object(&root) {
        Some(("Metadata" | "MCoreMetadata", Some(state))) => state,
        _ => return Err(bad(".metadata does not hold a DCP Metadata object")),
    };
    let entries = match state.get("state_dict_metadata") {
        Some(Value::Dict(kv)) => kv,
        _ => return Err(bad(".metadata: no `state_dict_metadata` dict")),
    };
    let mut tensors = BTreeMap::new();
    let mut order = Vec::new();
    let mut bytes_items = Vec::new();
    let mut bytes_at = BTreeMap::new();
    let mut declared_chunks: BTreeMap<(String, Vec<u64>), Vec<u64>> = BTreeMap::new();
    for (k, v) in entries {
        let Value::Str(fqn) = k else {
            return Err(bad(
                ".metadata: a state_dict_metadata key that is not a string",
            ));
        };
        let what = |s: &str| format!("tensor `{fqn}`: {s}");
        match object(v) {
            Some(("BytesStorageMetadata", _)) => bytes_items.push(fqn.clone()),
            Some(("TensorStorageMetadata", Some(st))) => {
                let props = st
                    .get("properties")
                    .and_then(object)
                    .and_then(|(_, s)| s)
                    .ok_or_else(|| bad(what("no properties")))?;
                // TensorProperties pickles its fields as a tuple (dtype first) in
                // torch 2.x; as a dict in versions that do not define __getstate__.
                let dtype_value = match props {
                    Value::Tuple(t) => t.first(),
                    d => d.get("dtype"),
                };
                let dtype = dtype_value
                    .and_then(Value::global)
                    .and_then(|(m, n)| (m == "torch").then_some(n))
                    .ok_or_else(|| bad(what("no dtype in its properties")))?;
                let dtype = torch_dtype(dtype)
                    .ok_or_else(|| bad(what(&format!("dtype torch.{dtype} is not read"))))?;
                let shape = size(
                    st.get("size").ok_or_else(|| bad(what("no size")))?,
                    &what("size"),
                )?;
                let chunks = st
                    .get("chunks")
                    .and_then(Value::items)
                    .ok_or_else(|| bad(what("no chunk list")))?;
                for c in chunks {
                    let cs = match object(c) {
                        Some(("ChunkStorageMetadata", Some(s))) => s,
                        _ => return Err(bad(what("a chunk that is not ChunkStorageMetadata"))),
                    };
                    let offsets = size(
                        cs.get("offsets").unwrap_or(&Value::None),
                        &what("chunk offsets"),
                    )?;
                    let sizes = size(
                        cs.get("sizes").unwrap_or(&Value::None),
                        &what("chunk sizes"),
                    )?;
                    if offsets.len() != shape.len() || sizes.len() != shape.len() {
                        return Err(bad(what(&format!(
                            "a chunk at {offsets:?} of size {sizes:?} in a tensor of shape {shape:?}"
                        ))));
                    }
                    declared_chunks.insert((fqn.clone(), offsets), sizes);
                }
                tensors.insert(fqn.clone(), DcpTensor { dtype, shape });
                order.push(fqn.clone());
            }
            _ => {
                return Err(bad(what(
                    "neither TensorStorageMetadata nor BytesStorageMetadata",
                )))
            }
        }
    }
    let storage = match state.get("storage_data") {
        Some(Value::Dict(kv)) => kv,
        _ => {
            return Err(bad(
                ".metadata: no `storage_data` dict (not written by FileSystemWriter?)",
            ))
        }
    };
    let mut chunks = Vec::new();
    // Looked up once per stored entry (a list scan per entry was quadratic: a
    // megatron-core save holds an `_extra_state` bytes item per module and expert).
    let bytes_set: std::collections::HashSet<&str> =
        bytes_items.iter().map(String::as_str).collect();
    for (k, v) in storage {
        let index = match object(k) {
            Some(("MetadataIndex", Some(s))) => s,
            _ => {
                return Err(bad(
                    ".metadata: a storage_data key that is not a MetadataIndex",
                ))
            }
        };
        let Some(Value::Str(fqn)) = index.get("fqn") else {
            return Err(bad(".metadata: a MetadataIndex without its fqn"));
        };
        let info = match object(v) {
            Some(("_StorageInfo", Some(s))) => s,
            _ => {
                return Err(bad(format!(
                    ".metadata: `{fqn}`: storage that is not a _StorageInfo"
                )))
            }
        };
        if let Some(t) = info.get("transform_descriptors") {
            if t.items().is_some_and(|t| !t.is_empty()) {
                return Err(Error::Unsupported {
                    problem: format!(
                        "DCP stores `{fqn}` with transforms {t:?} (a storage extension such as compression), which ckpt does not read"
                    ),
                });
            }
        }
        let Some(Value::Str(file)) = info.get("relative_path") else {
            return Err(bad(format!(".metadata: `{fqn}`: no relative_path")));
        };
        // The path must stay inside the checkpoint directory.
        if file.is_empty() || file.contains('/') || file.contains('\\') || file == ".." {
            return Err(bad(format!(
                ".metadata: `{fqn}`: relative_path `{file}` is not a file name in the directory"
            )));
        }
        let start = uint(
            info.get("offset").unwrap_or(&Value::None),
            &format!("`{fqn}`: storage offset"),
        )?;
        let len = uint(
            info.get("length").unwrap_or(&Value::None),
            &format!("`{fqn}`: storage length"),
        )?;
        if bytes_set.contains(fqn.as_str()) {
            bytes_at.insert(
                fqn.clone(),
                DcpBytes {
                    file: file.clone(),
                    start,
                    len,
                },
            );
            continue;
        }
        let offsets = size(
            index.get("offset").unwrap_or(&Value::None),
            &format!("`{fqn}`: chunk offset"),
        )?;
        let sizes = declared_chunks
            .get(&(fqn.clone(), offsets.clone()))
            .ok_or_else(|| bad(format!(".metadata: `{fqn}`: stored chunk at {offsets:?} is not among the tensor's chunks")))?
            .clone();
        chunks.push(DcpChunk {
            fqn: fqn.clone(),
            offsets,
            sizes,
            file: file.clone(),
            start,
            len,
            part: None,
            flat: None,
        });
    }
    // Every declared chunk must be stored somewhere (looked up in a set of the stored
    // ones: a scan of them per declared chunk took minutes at 100,000 expert chunks).
    let stored_chunks: std::collections::HashSet<(&str, &[u64])> = chunks
        .iter()
        .map(|c| (c.fqn.as_str(), &c.offsets[..]))
        .collect();
    for (fqn, offsets) in declared_chunks.keys() {
        if !stored_chunks.contains(&(fqn.as_str(), &offsets[..])) {
            return Err(bad(format!(
                ".metadata: `{fqn}`: the chunk at {offsets:?} has no storage entry"
            )));
        }
    }
    let recorded = mcore_shapes(state.get("mcore_data"))?;
    let shapes = tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.shape.clone()))
        .collect();
    let stored: Vec<_> = chunks
        .iter()
        .map(|c| flattened::Stored {
            name: &c.fqn,
            offsets: &c.offsets,
            sizes: &c.sizes,
        })
        .collect();
    let resolved = flattened::resolve(recorded.as_ref(), &shapes, &stored)?;
    for (c, p) in chunks.iter_mut().zip(resolved.pieces) {
        c.flat = p;
    }
    for (name, shape) in resolved.shapes {
        if let Some(t) = tensors.get_mut(&name) {
            t.shape = shape;
        }
    }
    chunks.sort_by(|a, b| (&a.file, a.start).cmp(&(&b.file, b.start)));
    Ok(DcpMetadata {
        tensors,
        order,
        bytes_at,
        bytes: bytes_items,
        chunks,
    })
}

/// Reads a DCP directory's `.metadata`.
pub(crate) fn read_metadata(dir: &Path) -> Result<DcpMetadata> {
    let path = dir.join(METADATA_FILE);
    let bytes = super::read_small(&path)?;
    parse_metadata(&bytes).map_err(|e| e.with_path(&path))
}

impl DcpMetadata {
    /// The `.distcp` files the chunks lie in, in the directory.
    pub(crate) fn files(&self, dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = self.chunks.iter().map(|c| dir.join(&c.file)).collect();
        v.dedup();
        v
    }

    /// Opens one `.distcp` file: each chunk the metadata places in it becomes an entry
    /// (named by the tensor, with the chunk's global offsets) whose bytes are the data
    /// of the chunk's `torch.save` archive.
    pub(crate) fn open(&self, path: &Path) -> Result<TensorFile> {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let map = map_file(path)?;
        let all: &[u8] = map.as_deref().unwrap_or(&[]);
        // An object of a store: each chunk's archive header lies just before its data,
        // a few MiB from the next; reading them all now would stream the whole object
        // once before the copy streams it again. They are read when the copy reaches
        // them (docs/storage.md).
        let remote = map.as_ref().is_some_and(Mapped::is_remote);
        let mut entries = Vec::new();
        let mut lazy = Vec::new();
        // The flat range of the tensor each entry was cut from, where it is one.
        let mut flat = Vec::new();
        for c in self.chunks.iter().filter(|c| c.file == name) {
            let t = &self.tensors[&c.fqn];
            if remote && c.flat.is_none() {
                if let Some(e) = lazy_entry(all, c, t).map_err(|e| e.with_path(path))? {
                    lazy.push((entries.len(), c.clone(), t.clone()));
                    entries.push(e);
                    flat.push(None);
                    continue;
                }
            }
            let e = self.chunk_entry(all, c, t).map_err(|e| e.with_path(path))?;
            match &c.flat {
                None => {
                    entries.push(e);
                    flat.push(None);
                }
                Some(p) => {
                    for (e, f) in p.entries(e, &t.shape).map_err(|e| e.with_path(path))? {
                        entries.push(e);
                        flat.push(f);
                    }
                }
            }
        }
        let rank = name
            .strip_prefix("__")
            .and_then(|r| r.split('_').next())
            .filter(|r| r.parse::<u64>().is_ok());
        let mut metadata = BTreeMap::from([("format".to_string(), "distcp".to_string())]);
        if let Some(r) = rank {
            metadata.insert("rank".into(), r.to_string());
        }
        let mut f = TensorFile::from_parts(path, map, FileFormat::Distcp, entries, metadata)?;
        for (i, r) in flat.into_iter().enumerate() {
            if let Some(r) = r {
                f.set_flat(i, r.start, r.len);
            }
        }
        for (i, c, t) in lazy {
            let span = (c.start, c.start + c.len);
            f.set_lazy(
                i,
                span,
                Box::new(move |all: &[u8]| {
                    let bytes = chunk_bytes(all, &c)?;
                    let entry = torch_save::parse_single_forward(bytes).map_err(|err| {
                        chunk_problem(&c, format!("the chunk at {:?}: {err}", c.offsets))
                    })?;
                    let e = finish_entry(entry, &c, &t)?;
                    Ok((e.start, e.end))
                }),
            );
        }
        Ok(f)
    }

    fn chunk_entry(&self, all: &[u8], c: &DcpChunk, t: &DcpTensor) -> Result<TensorEntry> {
        let bytes = chunk_bytes(all, c)?;
        let (mut found, _) = torch_save::parse(bytes)
            .map_err(|err| chunk_problem(c, format!("the chunk at {:?}: {err}", c.offsets)))?;
        if found.len() != 1 {
            return Err(chunk_problem(
                c,
                format!(
                    "the chunk at {:?} holds {} tensors, not one",
                    c.offsets,
                    found.len()
                ),
            ));
        }
        finish_entry(found.remove(0), c, t)
    }
}

/// Chunk `c`'s entry as the metadata gives it, to be located when first read
/// ([`TensorFile::set_lazy`]): its data's length, its span's start for the position.
/// `None` where the metadata alone cannot say the length (a sub-byte dtype), so that
/// the archive is read now; the chunk's range is checked against the file either way.
fn lazy_entry(all: &[u8], c: &DcpChunk, t: &DcpTensor) -> Result<Option<TensorEntry>> {
    let end = c
        .start
        .checked_add(c.len)
        .ok_or_else(|| overflow(format!("`{}`: chunk offset + length", c.fqn)))?;
    if end > all.len() as u64 {
        // (Said with the offsets by `chunk_bytes`.)
        chunk_bytes(all, c)?;
    }
    let bits = t.dtype.bitsize() as u64;
    let Some(len) = numel(&c.sizes)?
        .checked_mul(bits)
        .filter(|b| b % 8 == 0)
        .map(|b| b / 8)
        .filter(|&l| l <= c.len)
    else {
        return Ok(None);
    };
    Ok(Some(TensorEntry {
        name: c.fqn.clone(),
        dtype: t.dtype,
        shape: c.sizes.clone(),
        start: c.start,
        end: c.start + len,
        offsets: Some(c.offsets.clone()),
    }))
}

/// The problem `p` of chunk `c`, naming its tensor.
fn chunk_problem(c: &DcpChunk, p: String) -> Error {
    Error::InvalidTensor {
        tensor: c.fqn.clone(),
        problem: p,
    }
}

/// The bytes of chunk `c`'s archive in the file's bytes `all` (not touched: a slice),
/// which must hold them, and be a `torch.save` archive.
fn chunk_bytes<'a>(all: &'a [u8], c: &DcpChunk) -> Result<&'a [u8]> {
    let end = c
        .start
        .checked_add(c.len)
        .ok_or_else(|| overflow(format!("`{}`: chunk offset + length", c.fqn)))?;
    let (Ok(s), Ok(e)) = (usize::try_from(c.start), usize::try_from(end)) else {
        return Err(overflow(format!("`{}`: chunk range", c.fqn)));
    };
    if e > all.len() {
        return Err(chunk_problem(
            c,
            format!(
                "the chunk at {:?} lies at bytes {s}..{e}, past the end of the file ({} bytes): truncated?",
                c.offsets,
                all.len()
            ),
        ));
    }
    let bytes = &all[s..e];
    if !torch_save::looks_like(bytes) {
        return Err(chunk_problem(
            c,
            format!(
                "the chunk at {:?} (bytes {s}..{e}) is not a torch.save archive (DCP's SerializationFormat.SAFETENSORS is not read)",
                c.offsets
            ),
        ));
    }
    Ok(bytes)
}

/// Chunk `c`'s entry from the tensor its archive holds (`entry`, located within the
/// archive): checked against the metadata, cut to the chunk's part where it is one,
/// named and placed in the file.
fn finish_entry(mut entry: TensorEntry, c: &DcpChunk, t: &DcpTensor) -> Result<TensorEntry> {
    let what = |p: String| chunk_problem(c, p);
    let stored = c.part.as_ref().map_or(&c.sizes, |p| &p.stored);
    if entry.dtype != t.dtype || &entry.shape != stored {
        return Err(what(format!(
            "the chunk at {:?} holds {:?} {:?}, the metadata says {:?} {:?}",
            c.offsets, entry.dtype, entry.shape, t.dtype, stored
        )));
    }
    if let Some(p) = &c.part {
        // (Whole bytes only: a part of a sub-byte dtype that starts inside a byte
        // is refused below.)
        let bits = t.dtype.bitsize() as u64;
        let bytes = |n: u64| n.checked_mul(bits).filter(|b| b % 8 == 0).map(|b| b / 8);
        let start = bytes(p.elements.start).and_then(|b| entry.start.checked_add(b));
        let end = start.and_then(|s| s.checked_add(bytes(p.elements.len)?));
        match (start, end) {
            (Some(s), Some(e)) if e <= entry.end && numel(&c.sizes)? == p.elements.len => {
                entry.start = s;
                entry.end = e;
            }
            _ => {
                return Err(what(format!(
                    "the chunk at {:?} is elements {} of a stored {stored:?}, which it does not hold as {:?}",
                    c.offsets, p.elements, c.sizes
                )))
            }
        }
        entry.shape = c.sizes.clone();
    }
    entry.name = c.fqn.clone();
    entry.start += c.start;
    entry.end += c.start;
    entry.offsets = Some(c.offsets.clone());
    Ok(entry)
}

/// torch's dtype attribute for a dtype (the inverse of `torch_dtype`).
pub fn torch_dtype_name(dtype: Dtype) -> Option<&'static str> {
    Some(match dtype {
        Dtype::F32 => "float32",
        Dtype::F64 => "float64",
        Dtype::F16 => "float16",
        Dtype::BF16 => "bfloat16",
        Dtype::I64 => "int64",
        Dtype::I32 => "int32",
        Dtype::I16 => "int16",
        Dtype::I8 => "int8",
        Dtype::U8 => "uint8",
        Dtype::BOOL => "bool",
        Dtype::F8_E4M3 => "float8_e4m3fn",
        Dtype::F8_E5M2 => "float8_e5m2",
        _ => return None,
    })
}

const DCP_METADATA: &str = "torch.distributed.checkpoint.metadata";

/// `torch.Size(v)`.
fn emit_size(e: &mut Emitter, v: &[u64]) {
    e.global("torch", "Size").mark().ints(v).tuple().reduce();
}

/// `cls.__new__(cls)` of a DCP dataclass; its state dict follows, then `build`.
fn emit_object(e: &mut Emitter, module: &str, class: &str) {
    e.global(module, class).empty_tuple().new_obj();
}

/// `_StorageInfo(relative_path, offset, length)`: where a stored value's bytes are.
fn emit_storage_info(e: &mut Emitter, file: &str, offset: u64, len: u64) {
    emit_object(e, "torch.distributed.checkpoint.filesystem", "_StorageInfo");
    e.empty_dict().mark();
    e.str("relative_path")
        .str(file)
        .str("offset")
        .int(offset)
        .str("length")
        .int(len);
    e.set_items().build();
}

/// One chunk a `.distcp` file will hold, for [`metadata_bytes`].
#[derive(Clone, Debug)]
pub struct DistcpChunk {
    /// The tensor's name.
    pub fqn: String,
    /// Where the chunk starts in the global tensor.
    pub offsets: Vec<u64>,
    /// Its shape.
    pub sizes: Vec<u64>,
}

/// A value that is not a tensor (DCP's `BytesStorageMetadata`, a `torch.save` of the
/// object) at bytes `offset..offset + len` of `file`, for [`metadata_bytes`].
#[derive(Clone, Debug)]
pub struct DistcpObject {
    /// Its key.
    pub fqn: String,
    /// The file (relative to the directory).
    pub file: String,
    /// Where its bytes start in the file.
    pub offset: u64,
    /// How many bytes.
    pub len: u64,
}

/// The `.metadata` of a DCP directory whose file `files[k].0` holds the chunks
/// `files[k].1`, in order, each as one `torch.save` archive (as
/// [`TorchWriter`](super::torch_write::TorchWriter) lays them out), of the tensors
/// `tensors` (name: dtype and global shape), and the values `objects`.
/// `torch.distributed.checkpoint.load` with the default `FileSystemReader` reads it.
///
/// # Errors
/// Dtypes torch has no name for, sizes that overflow.
pub fn metadata_bytes(
    tensors: &BTreeMap<String, (Dtype, Vec<u64>)>,
    files: &[(String, Vec<DistcpChunk>)],
    objects: &[DistcpObject],
) -> Result<Vec<u8>> {
    // Where each chunk's archive lies.
    let mut storage: Vec<(&DistcpChunk, &str, u64, u64)> = Vec::new();
    for (file, chunks) in files {
        let specs = chunks
            .iter()
            .map(|c| {
                let (dtype, _) = tensors.get(&c.fqn).ok_or_else(|| Error::Unsupported {
                    problem: format!("chunk of `{}`, which is not among the tensors", c.fqn),
                })?;
                Ok(crate::formats::writer::TensorSpec {
                    name: c.fqn.clone(),
                    dtype: *dtype,
                    shape: c.sizes.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let spans = super::torch_write::TorchWriter::archive_spans(&specs)?;
        for (c, (at, len)) in chunks.iter().zip(spans) {
            storage.push((c, file, at, len));
        }
    }
    let mut e = Emitter::new();
    emit_object(&mut e, DCP_METADATA, "Metadata");
    e.empty_dict().mark();
    e.str("state_dict_metadata").empty_dict().mark();
    for (name, (dtype, shape)) in tensors {
        let t = torch_dtype_name(*dtype).ok_or_else(|| Error::Unsupported {
            problem: format!(
                "tensor `{name}`: torch has no dtype for {}",
                crate::layout::strategy::dtype_name(*dtype)
            ),
        })?;
        e.str(name);
        emit_object(&mut e, DCP_METADATA, "TensorStorageMetadata");
        e.empty_dict().mark();
        // TensorProperties' __setstate__ takes (dtype, layout, requires_grad,
        // memory-format encoding, pin_memory, strides).
        e.str("properties");
        emit_object(&mut e, DCP_METADATA, "TensorProperties");
        e.mark().global("torch", t);
        e.global("torch.serialization", "_get_layout")
            .mark()
            .str("torch.strided")
            .tuple()
            .reduce();
        e.bool(false);
        e.global(DCP_METADATA, "_MEM_FORMAT_ENCODING")
            .mark()
            .int(0)
            .tuple()
            .reduce();
        e.bool(false).none().tuple().build();
        e.str("size");
        emit_size(&mut e, shape);
        e.str("chunks").empty_list().mark();
        for (c, ..) in storage.iter().filter(|s| &s.0.fqn == name) {
            emit_object(&mut e, DCP_METADATA, "ChunkStorageMetadata");
            e.empty_dict().mark().str("offsets");
            emit_size(&mut e, &c.offsets);
            e.str("sizes");
            emit_size(&mut e, &c.sizes);
            e.set_items().build();
        }
        e.appends();
        e.set_items().build();
    }
    for o in objects {
        // A dataclass without fields: no state to build.
        e.str(&o.fqn);
        emit_object(&mut e, DCP_METADATA, "BytesStorageMetadata");
    }
    e.set_items();
    e.str("planner_data").empty_dict().mark();
    for name in tensors.keys().chain(objects.iter().map(|o| &o.fqn)) {
        e.str(name).mark().str(name).tuple();
    }
    e.set_items();
    e.str("storage_data").empty_dict().mark();
    let mut index: BTreeMap<&str, u64> = BTreeMap::new();
    for (c, file, at, len) in &storage {
        let i = index.entry(&c.fqn).or_insert(0);
        emit_object(&mut e, DCP_METADATA, "MetadataIndex");
        e.empty_dict().mark().str("fqn").str(&c.fqn).str("offset");
        emit_size(&mut e, &c.offsets);
        e.str("index").int(*i).set_items().build();
        *i += 1;
        emit_storage_info(&mut e, file, *at, *len);
    }
    for o in objects {
        emit_object(&mut e, DCP_METADATA, "MetadataIndex");
        e.empty_dict().mark().str("fqn").str(&o.fqn);
        e.str("offset")
            .none()
            .str("index")
            .none()
            .set_items()
            .build();
        emit_storage_info(&mut e, &o.file, o.offset, o.len);
    }
    e.set_items();
    e.str("storage_meta").none();
    e.str("version").str("1.0.0");
    e.set_items().build();
    Ok(e.finish())
}

// Directory discovery (a row of formats/detect/discover.rs).

impl DcpMetadata {
    /// The note on the values of `dir`'s `.metadata` that are not tensors (ckpt does not
    /// carry them), when there are any.
    pub(crate) fn non_tensor_note(&self, dir: &Path) -> Option<String> {
        if self.bytes.is_empty() {
            return None;
        }
        let shown = self
            .bytes
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        let more = if self.bytes.len() > 8 { ", ..." } else { "" };
        Some(format!(
            "{}: {} value(s) that are not tensors (BYTE_IO) are not carried: {shown}{more}",
            dir.join(METADATA_FILE).display(),
            self.bytes.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/torch/dcp")
    }

    #[test]
    fn metadata_of_torch_2_15_is_read() {
        let m = read_metadata(&fixture_dir()).unwrap();
        assert_eq!(
            m.tensors["layer.q.weight"],
            DcpTensor {
                dtype: Dtype::BF16,
                shape: vec![6, 6]
            }
        );
        assert_eq!(m.tensors["scale"].shape, Vec::<u64>::new());
        let o: Vec<_> = m
            .chunks
            .iter()
            .filter(|c| c.fqn == "layer.o.weight")
            .map(|c| (c.offsets.clone(), c.sizes.clone(), c.file.as_str()))
            .collect();
        assert_eq!(
            o,
            vec![
                (vec![0, 0], vec![6, 3], "__0_0.distcp"),
                (vec![0, 3], vec![6, 2], "__1_0.distcp")
            ]
        );
    }

    #[test]
    fn each_chunk_is_located_in_its_file() {
        let dir = fixture_dir();
        let m = read_metadata(&dir).unwrap();
        let f = m.open(&dir.join("__1_0.distcp")).unwrap();
        let e = &f.tensors()[f.find("counts").unwrap()];
        assert_eq!(e.offsets, Some(vec![5]));
        assert_eq!(e.shape, vec![5]);
        assert_eq!(e.end - e.start, 40);
    }

    /// Reading a chunk's archive forward from its start (as a chunk of an object in a
    /// store is located, when the copy reaches it) finds what reading its zip directory
    /// finds, for every chunk torch wrote (the fixture) and ckpt writes (megatron-core's
    /// dist_ckpt fixture, parts of chunks included); a damaged storage record is named.
    #[test]
    fn chunks_read_forward_are_located_as_from_their_directory() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let mut checked = 0;
        for dir in [fixture_dir(), root.join("megatron/tp2pp2/dist_ckpt")] {
            let m = read_metadata(&dir).unwrap();
            for c in &m.chunks {
                let all = std::fs::read(dir.join(&c.file)).unwrap();
                let t = &m.tensors[&c.fqn];
                let bytes = chunk_bytes(&all, c).unwrap();
                let eager = m.chunk_entry(&all, c, t).unwrap();
                let forward = torch_save::parse_single_forward(bytes)
                    .and_then(|e| finish_entry(e, c, t))
                    .unwrap();
                assert_eq!(forward, eager, "{} at {:?}", c.fqn, c.offsets);
                checked += 1;
            }
        }
        assert!(checked > 20, "{checked}");
        // The storage record renamed: the walk reaches the archive's end without it.
        let dir = fixture_dir();
        let m = read_metadata(&dir).unwrap();
        let c = m.chunks.iter().find(|c| c.file == "__1_0.distcp").unwrap();
        let mut all = std::fs::read(dir.join(&c.file)).unwrap();
        let at = c.start as usize
            + all[c.start as usize..]
                .windows(7)
                .position(|w| w == b"/data/0")
                .unwrap();
        all[at + 6] = b'9';
        let e = torch_save::parse_single_forward(chunk_bytes(&all, c).unwrap()).unwrap_err();
        assert!(e.to_string().contains("before the tensor's storage"), "{e}");
    }

    #[test]
    fn written_metadata_reads_back() {
        let tensors = BTreeMap::from([
            ("w".to_string(), (Dtype::BF16, vec![4, 6])),
            ("s".to_string(), (Dtype::F32, vec![])),
        ]);
        let files = vec![
            (
                "__0_0.distcp".to_string(),
                vec![
                    DistcpChunk {
                        fqn: "w".into(),
                        offsets: vec![0, 0],
                        sizes: vec![4, 3],
                    },
                    DistcpChunk {
                        fqn: "s".into(),
                        offsets: vec![],
                        sizes: vec![],
                    },
                ],
            ),
            (
                "__1_0.distcp".to_string(),
                vec![DistcpChunk {
                    fqn: "w".into(),
                    offsets: vec![0, 3],
                    sizes: vec![4, 3],
                }],
            ),
        ];
        let m = parse_metadata(&metadata_bytes(&tensors, &files, &[]).unwrap()).unwrap();
        assert_eq!(
            m.tensors["w"],
            DcpTensor {
                dtype: Dtype::BF16,
                shape: vec![4, 6]
            }
        );
        let got: Vec<_> = m
            .chunks
            .iter()
            .map(|c| (c.fqn.as_str(), c.offsets.clone(), c.file.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("w", vec![0, 0], "__0_0.distcp"),
                ("s", vec![], "__0_0.distcp"),
                ("w", vec![0, 3], "__1_0.distcp"),
            ]
        );
        // The second archive of file 0 starts where the first ends.
        assert_eq!(m.chunks[1].start, m.chunks[0].len);
    }

    #[test]
    fn a_global_outside_the_list_is_named() {
        // Metadata() whose state names os.system.
        let p = b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x08Metadata\x94\x93)\x81}(\x8c\x01x\x8c\x02os\x8c\x06system\x93ub.";
        let e = parse_metadata(p).unwrap_err().to_string();
        assert!(e.contains("`os.system`"), "{e}");
    }
}
