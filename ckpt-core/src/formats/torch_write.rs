//! Writing `torch.save` archives that `torch.load(weights_only=True)` reads: one archive
//! of many tensors (`model.pth`), or, for DCP's `.distcp` files, one archive per tensor
//! chunk, one after the other.
//!
//! An archive is a zip file of stored (uncompressed) entries: `archive/data.pkl` (a
//! protocol-2 pickle of a dict of name to `torch._utils._rebuild_tensor_v2(storage, 0,
//! size, stride, False, OrderedDict())`, each storage a persistent id `("storage",
//! torch.<T>Storage, key, "cpu", numel)`), `archive/byteorder` (`little`), one
//! `archive/data/<key>` per tensor with its raw bytes, aligned to 64 bytes as torch
//! aligns them (padding in an extra field), and `archive/version`. Every byte except the
//! tensors' data and their CRC-32s is known from names, dtypes and shapes alone, so the
//! layout (and each archive's length, which DCP's metadata records) is computed before
//! any data is copied; the copy engine then writes data at its offsets in parallel, and
//! `finish` combines the CRC-32 of each write, patches the local headers and writes the
//! central directory. Zip64 records are used where a size or offset needs them.

use super::byte_len;
use super::pickle::Emitter;
use crate::error::{overflow, Error, Result};
use crate::formats::output::StagedFile;
use crate::formats::writer::{TensorSpec, WritePart};
use crate::layout::Dtype;
use std::path::Path;
use std::sync::Mutex;

/// torch aligns storage data to this many bytes (so `torch.load(mmap=True)` can map it).
const ALIGN: u64 = 64;
const U32_MAX: u64 = 0xFFFF_FFFF;

/// torch's storage class for a dtype.
pub(crate) fn storage_class(dtype: Dtype) -> Option<&'static str> {
    Some(match dtype {
        Dtype::F32 => "FloatStorage",
        Dtype::F64 => "DoubleStorage",
        Dtype::F16 => "HalfStorage",
        Dtype::BF16 => "BFloat16Storage",
        Dtype::I64 => "LongStorage",
        Dtype::I32 => "IntStorage",
        Dtype::I16 => "ShortStorage",
        Dtype::I8 => "CharStorage",
        Dtype::U8 => "ByteStorage",
        Dtype::BOOL => "BoolStorage",
        Dtype::F8_E4M3 => "Float8_e4m3fnStorage",
        Dtype::F8_E5M2 => "Float8_e5m2Storage",
        _ => return None,
    })
}

/// `data.pkl` for tensors stored under keys `0`, `1`, ...: a plain dict (what
/// `torch.save(dict)` writes) or, for a DCP chunk, the bare tensor.
fn data_pkl(tensors: &[TensorSpec], bare: bool, wrap: Option<&Wrap>) -> Result<Vec<u8>> {
    let mut e = Emitter::new();
    if !bare {
        e.empty_dict().mark();
        if let Some(w) = wrap {
            e.raw(&w.prefix);
        }
    }
    let nested = wrap.filter(|_| !bare).and_then(|w| w.key.as_ref());
    if let Some(key) = nested {
        e.str(key).empty_dict().mark();
    }
    let flat = wrap.is_some_and(|w| w.flat);
    for (key, t) in tensors.iter().enumerate() {
        let class = storage_class(t.dtype).ok_or_else(|| Error::Unsupported {
            problem: format!(
                "tensor `{}`: torch has no storage type for {}",
                t.name,
                crate::layout::strategy::dtype_name(t.dtype)
            ),
        })?;
        let numel = t
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| overflow(format!("tensor `{}` element count", t.name)))?;
        if !bare {
            e.str(&t.name);
        }
        let shape = if flat { &[numel][..] } else { &t.shape[..] };
        emit_rebuild(&mut e, key, class, numel, shape, false);
    }
    if let (Some(w), Some(_)) = (wrap, nested) {
        e.set_items().raw(&w.extra);
    }
    if !bare {
        e.set_items();
    }
    Ok(e.finish())
}

/// `torch._utils._rebuild_tensor_v2` of storage `key` (`numel` elements of the torch
/// storage type `class`) viewed as a contiguous tensor of `shape`: what torch.save
/// pickles for a tensor. Shared by every writer of torch.save archives.
pub(crate) fn emit_rebuild(
    e: &mut Emitter,
    key: usize,
    class: &str,
    numel: u64,
    shape: &[u64],
    requires_grad: bool,
) {
    // C-order strides.
    let mut stride = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        stride[d] = stride[d + 1].saturating_mul(shape[d + 1].max(1));
    }
    e.global("torch._utils", "_rebuild_tensor_v2");
    e.mark();
    e.mark()
        .str("storage")
        .global("torch", class)
        .str(&key.to_string())
        .str("cpu")
        .int(numel)
        .tuple()
        .persistent_id();
    e.int(0).ints(shape).ints(&stride).bool(requires_grad);
    e.global("collections", "OrderedDict")
        .empty_tuple()
        .reduce();
    e.tuple().reduce();
}

/// Metadata key (of a target file) asking the torch writer to put the tensors under
/// one key of the saved dict: Megatron's `{'model': {...}, 'args': ...}`.
pub(crate) const WRAP_KEY: &str = "torch.wrap.key";
/// Metadata key of the other entries of that dict: a pickle fragment (hex) that pushes
/// key/value pairs ([`Emitter::fragment`]).
pub(crate) const WRAP_EXTRA: &str = "torch.wrap.extra";

/// Metadata key of storages the [`WRAP_EXTRA`] fragment refers to (comma-separated
/// hex), stored after the tensors' as `data/<n>`, `data/<n+1>`, ... for `n` tensors:
/// Megatron's carried RNG state holds torch byte tensors.
pub(crate) const WRAP_STORAGES: &str = "torch.wrap.storages";

/// Metadata key of entries put in the saved dict before the tensors: a pickle fragment
/// (hex), as [`WRAP_EXTRA`]. DeepSpeed's universal checkpoint: `{'cat_dim': 0, 'param': t}`.
pub(crate) const PREFIX: &str = "torch.prefix";
/// Metadata key asking for each tensor pickled alone (one archive per tensor, as DCP's)
/// and flattened to one dimension (same bytes): DeepSpeed's ZeRO-3 universal files.
pub(crate) const BARE_FLAT: &str = "torch.bare_flat";

/// Metadata key giving some tensors another shape of the same elements to be pickled
/// with (a JSON object, name: shape): a chunk of a stacked tensor, `[1, rows, cols]` of
/// a Megatron dist_ckpt's `decoder.layers.<param>`, holds the bytes of the one layer's
/// `[rows, cols]` the plan assembles.
pub(crate) const STORED_SHAPES: &str = "torch.stored_shapes";

/// `tensors` with the shapes [`STORED_SHAPES`] gives them, each checked to hold as many
/// elements as the tensor.
///
/// # Errors
/// A value that is not such an object; a shape of another element count.
pub(crate) fn with_stored_shapes(
    tensors: &[TensorSpec],
    m: &std::collections::BTreeMap<String, String>,
) -> Result<Vec<TensorSpec>> {
    let mut out = tensors.to_vec();
    let Some(text) = m.get(STORED_SHAPES) else {
        return Ok(out);
    };
    let bad = |problem: String| Error::Unsupported {
        problem: format!("{STORED_SHAPES}: {problem}"),
    };
    let shapes: std::collections::BTreeMap<String, Vec<u64>> =
        serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let numel = |s: &[u64]| s.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    for t in &mut out {
        if let Some(shape) = shapes.get(&t.name) {
            if numel(shape).is_none() || numel(shape) != numel(&t.shape) {
                return Err(bad(format!(
                    "tensor `{}` of shape {:?} cannot be stored as {shape:?}",
                    t.name, t.shape
                )));
            }
            t.shape.clone_from(shape);
        }
    }
    Ok(out)
}

/// How the tensors sit in the saved object: under one key of the saved dict beside
/// other entries, after some entries, or alone and flattened.
#[derive(Clone, Debug, Default)]
pub(crate) struct Wrap {
    key: Option<String>,
    extra: Vec<u8>,
    prefix: Vec<u8>,
    /// Raw storages after the tensors' ([`WRAP_STORAGES`]).
    storages: Vec<Vec<u8>>,
    /// One bare tensor per archive, pickled with shape `[numel]`.
    pub(crate) flat: bool,
}

fn unhex(m: &std::collections::BTreeMap<String, String>, key: &str) -> Result<Vec<u8>> {
    unhex_str(m.get(key).map_or("", String::as_str), key)
}

fn unhex_str(hex: &str, key: &str) -> Result<Vec<u8>> {
    let bad = || Error::Unsupported {
        problem: format!("{key} is not hex"),
    };
    if !hex.len().is_multiple_of(2) {
        return Err(bad());
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2).ok_or_else(bad)?, 16).map_err(|_| bad()))
        .collect()
}

impl Wrap {
    /// From a target file's metadata, when it asks for one.
    pub(crate) fn from_metadata(
        m: &std::collections::BTreeMap<String, String>,
    ) -> Result<Option<Wrap>> {
        let flat = m.get(BARE_FLAT).is_some_and(|v| v == "1");
        if !m.contains_key(WRAP_KEY) && !m.contains_key(PREFIX) && !flat {
            return Ok(None);
        }
        Ok(Some(Wrap {
            key: m.get(WRAP_KEY).cloned(),
            extra: unhex(m, WRAP_EXTRA)?,
            prefix: unhex(m, PREFIX)?,
            storages: match m.get(WRAP_STORAGES) {
                Some(list) => list
                    .split(',')
                    .map(|h| unhex_str(h, WRAP_STORAGES))
                    .collect::<Result<_>>()?,
                None => Vec::new(),
            },
            flat,
        }))
    }
}

/// Hex of a pickle fragment, for [`WRAP_EXTRA`].
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One entry of an archive.
#[derive(Debug)]
struct Entry {
    name: String,
    /// Where its local header starts, from the start of the archive.
    header_at: u64,
    /// Where its data starts.
    data_at: u64,
    len: u64,
    /// The data's CRC-32, for entries whose content is known up front.
    crc: Option<u32>,
    zip64: bool,
}

/// The layout of one archive: every byte but the tensors' data and CRCs.
#[derive(Debug)]
pub(crate) struct Archive {
    entries: Vec<Entry>,
    /// Content of the small entries, by entry index.
    small: Vec<(usize, Vec<u8>)>,
    /// Entry index of each tensor's data.
    tensor_entry: Vec<usize>,
    /// Where the central directory starts.
    cd_at: u64,
    /// The whole archive's length.
    pub(crate) len: u64,
}

fn local_header_len(name: &str, zip64: bool) -> u64 {
    30 + name.len() as u64 + if zip64 { 20 } else { 0 }
}

impl Archive {
    /// Lays out an archive of `tensors` (`bare`: one tensor, pickled alone, as DCP
    /// stores each chunk).
    pub(crate) fn new(tensors: &[TensorSpec], bare: bool) -> Result<Archive> {
        Archive::wrapped(tensors, bare, None)
    }

    /// [`Archive::new`], the tensors under `wrap`'s key beside its entries.
    pub(crate) fn wrapped(
        tensors: &[TensorSpec],
        bare: bool,
        wrap: Option<&Wrap>,
    ) -> Result<Archive> {
        let storages = wrap.filter(|_| !bare).map_or(&[][..], |w| &w.storages[..]);
        Archive::with_storages(data_pkl(tensors, bare, wrap)?, tensors, storages)
    }

    /// An archive whose `data.pkl` is `pkl`, made by the caller, which stores tensor `i`
    /// of `tensors` under storage key `i` (DeepSpeed's optimizer states: a whole dict
    /// of carried values around the tensors).
    pub(crate) fn with_pickle(pkl: Vec<u8>, tensors: &[TensorSpec]) -> Result<Archive> {
        Archive::with_storages(pkl, tensors, &[])
    }

    /// [`Archive::with_pickle`] with raw `storages` after the tensors': storage key
    /// `tensors.len() + j` holds `storages[j]`.
    fn with_storages(
        pkl: Vec<u8>,
        tensors: &[TensorSpec],
        storages: &[Vec<u8>],
    ) -> Result<Archive> {
        let mut entries = Vec::new();
        let mut small = Vec::new();
        let mut tensor_entry = Vec::new();
        let mut pos = 0u64;
        // Entries in torch's order; `content` for the small ones, `None` for tensor data.
        let mut add = |name: String, len: u64, content: Option<Vec<u8>>| -> Result<usize> {
            let zip64 = len >= U32_MAX || pos >= U32_MAX;
            let header = local_header_len(&name, zip64);
            let mut data_at = pos
                .checked_add(header)
                .ok_or_else(|| overflow("archive size"))?;
            // The alignment padding is an extra field of its own (4 bytes + padding).
            let pad = (ALIGN - (data_at + 4) % ALIGN) % ALIGN;
            data_at += 4 + pad;
            let crc = content.as_deref().map(crc32fast::hash);
            entries.push(Entry {
                name,
                header_at: pos,
                data_at,
                len,
                crc,
                zip64,
            });
            if let Some(c) = content {
                small.push((entries.len() - 1, c));
            }
            pos = data_at
                .checked_add(len)
                .ok_or_else(|| overflow("archive size"))?;
            Ok(entries.len() - 1)
        };
        add("archive/data.pkl".into(), pkl.len() as u64, Some(pkl))?;
        add("archive/byteorder".into(), 6, Some(b"little".to_vec()))?;
        for (key, t) in tensors.iter().enumerate() {
            let n = byte_len(t.dtype, &t.shape)
                .ok_or_else(|| overflow(format!("size of tensor `{}`", t.name)))?;
            tensor_entry.push(add(format!("archive/data/{key}"), n, None)?);
        }
        for (j, bytes) in storages.iter().enumerate() {
            let key = tensors.len() + j;
            add(
                format!("archive/data/{key}"),
                bytes.len() as u64,
                Some(bytes.clone()),
            )?;
        }
        add("archive/version".into(), 2, Some(b"3\n".to_vec()))?;
        let cd_at = pos;
        let mut a = Archive {
            entries,
            small,
            tensor_entry,
            cd_at,
            len: 0,
        };
        let tail = a.tail(&vec![0; a.tensor_entry.len()]).len() as u64;
        a.len = cd_at
            .checked_add(tail)
            .ok_or_else(|| overflow("archive size"))?;
        Ok(a)
    }

    /// Where tensor `i`'s data starts, from the start of the archive.
    pub(crate) fn data_at(&self, i: usize) -> u64 {
        self.entries[self.tensor_entry[i]].data_at
    }

    fn crc_of(&self, entry: usize, crcs: &[u32]) -> u32 {
        match self.entries[entry].crc {
            Some(c) => c,
            None => {
                let t = self
                    .tensor_entry
                    .iter()
                    .position(|&e| e == entry)
                    .unwrap_or(0);
                crcs[t]
            }
        }
    }

    fn local_header(&self, entry: usize, crc: u32) -> Vec<u8> {
        let e = &self.entries[entry];
        let mut h = Vec::with_capacity((e.data_at - e.header_at) as usize);
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&(if e.zip64 { 45u16 } else { 20 }).to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // flags
        h.extend_from_slice(&0u16.to_le_bytes()); // stored
        h.extend_from_slice(&0u16.to_le_bytes()); // time
        h.extend_from_slice(&0x21u16.to_le_bytes()); // 1980-01-01
        h.extend_from_slice(&crc.to_le_bytes());
        let size32 = if e.zip64 {
            U32_MAX as u32
        } else {
            e.len as u32
        };
        h.extend_from_slice(&size32.to_le_bytes());
        h.extend_from_slice(&size32.to_le_bytes());
        h.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        let extra = (e.data_at - e.header_at) - 30 - e.name.len() as u64;
        h.extend_from_slice(&(extra as u16).to_le_bytes());
        h.extend_from_slice(e.name.as_bytes());
        if e.zip64 {
            h.extend_from_slice(&1u16.to_le_bytes());
            h.extend_from_slice(&16u16.to_le_bytes());
            h.extend_from_slice(&e.len.to_le_bytes());
            h.extend_from_slice(&e.len.to_le_bytes());
        }
        let pad = (e.data_at - e.header_at) as usize - h.len() - 4;
        h.extend_from_slice(b"FB");
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.extend(std::iter::repeat_n(b'Z', pad));
        h
    }

    /// The central directory and end records, given the tensors' CRCs.
    fn tail(&self, crcs: &[u32]) -> Vec<u8> {
        let mut cd = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            let big_size = e.len >= U32_MAX;
            let big_at = e.header_at >= U32_MAX;
            let mut extra = Vec::new();
            if big_size {
                extra.extend_from_slice(&e.len.to_le_bytes());
                extra.extend_from_slice(&e.len.to_le_bytes());
            }
            if big_at {
                extra.extend_from_slice(&e.header_at.to_le_bytes());
            }
            cd.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            let version: u16 = if e.zip64 || big_at { 45 } else { 20 };
            cd.extend_from_slice(&version.to_le_bytes());
            cd.extend_from_slice(&version.to_le_bytes());
            cd.extend_from_slice(&[0; 4]); // flags, method
            cd.extend_from_slice(&0u16.to_le_bytes());
            cd.extend_from_slice(&0x21u16.to_le_bytes());
            cd.extend_from_slice(&self.crc_of(i, crcs).to_le_bytes());
            let size32 = if big_size {
                U32_MAX as u32
            } else {
                e.len as u32
            };
            cd.extend_from_slice(&size32.to_le_bytes());
            cd.extend_from_slice(&size32.to_le_bytes());
            cd.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            let extra_len = if extra.is_empty() { 0 } else { 4 + extra.len() };
            cd.extend_from_slice(&(extra_len as u16).to_le_bytes());
            cd.extend_from_slice(&[0; 6]); // comment length, disk, internal attributes
            cd.extend_from_slice(&0u32.to_le_bytes()); // external attributes
            let at32 = if big_at {
                U32_MAX as u32
            } else {
                e.header_at as u32
            };
            cd.extend_from_slice(&at32.to_le_bytes());
            cd.extend_from_slice(e.name.as_bytes());
            if !extra.is_empty() {
                cd.extend_from_slice(&1u16.to_le_bytes());
                cd.extend_from_slice(&(extra.len() as u16).to_le_bytes());
                cd.extend_from_slice(&extra);
            }
        }
        let n = self.entries.len() as u64;
        let cd_len = cd.len() as u64;
        let zip64 = n >= 0xFFFF || self.cd_at >= U32_MAX || cd_len >= U32_MAX;
        let mut out = cd;
        if zip64 {
            let eocd64_at = self.cd_at + cd_len;
            out.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
            out.extend_from_slice(&44u64.to_le_bytes());
            out.extend_from_slice(&45u16.to_le_bytes());
            out.extend_from_slice(&45u16.to_le_bytes());
            out.extend_from_slice(&[0; 8]);
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&cd_len.to_le_bytes());
            out.extend_from_slice(&self.cd_at.to_le_bytes());
            out.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&eocd64_at.to_le_bytes());
            out.extend_from_slice(&1u32.to_le_bytes());
        }
        out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        let n16 = n.min(0xFFFF) as u16;
        out.extend_from_slice(&n16.to_le_bytes());
        out.extend_from_slice(&n16.to_le_bytes());
        out.extend_from_slice(&(cd_len.min(U32_MAX) as u32).to_le_bytes());
        out.extend_from_slice(&(self.cd_at.min(U32_MAX) as u32).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }
}

/// A file of one or more archives being written: `model.pth` (one archive of every
/// tensor) or a `.distcp` file (one archive per tensor).
#[derive(Debug)]
pub(crate) struct TorchWriter {
    out: StagedFile,
    /// Each archive and where it starts in the file.
    archives: Vec<(u64, Archive)>,
    /// For each tensor: its archive, and its index in that archive.
    place: Vec<(usize, usize)>,
    /// Each tensor's writes: (offset, length, CRC-32).
    written: Vec<Mutex<Vec<(u64, u64, u32)>>>,
}

impl TorchWriter {
    /// Lays out `dest` for `tensors`: one archive of them all, or (`per_tensor`) one
    /// archive per tensor, one after the other, as DCP writes its `.distcp` files.
    ///
    /// # Errors
    /// Dtypes torch has no storage for, sizes that overflow, I/O errors.
    #[cfg(test)]
    pub(crate) fn create(
        dest: &Path,
        tensors: &[TensorSpec],
        per_tensor: bool,
    ) -> Result<TorchWriter> {
        TorchWriter::create_wrapped(dest, tensors, per_tensor, None)
    }

    /// [`TorchWriter::create`] of one archive whose dict holds the tensors under
    /// `wrap`'s key, beside its entries.
    ///
    /// # Errors
    /// Dtypes torch has no storage for, sizes that overflow, I/O errors.
    pub(crate) fn create_wrapped(
        dest: &Path,
        tensors: &[TensorSpec],
        per_tensor: bool,
        wrap: Option<&Wrap>,
    ) -> Result<TorchWriter> {
        let mut archives = Vec::new();
        let mut place = Vec::new();
        let mut pos = 0u64;
        let mut push =
            |specs: &[TensorSpec], bare: bool, archives: &mut Vec<(u64, Archive)>| -> Result<()> {
                let a = Archive::wrapped(specs, bare, wrap).map_err(|e| e.with_path(dest))?;
                let at = pos;
                pos = pos
                    .checked_add(a.len)
                    .ok_or_else(|| overflow("file size"))?;
                archives.push((at, a));
                Ok(())
            };
        if per_tensor {
            for (i, t) in tensors.iter().enumerate() {
                push(std::slice::from_ref(t), true, &mut archives)?;
                place.push((i, 0));
            }
        } else {
            push(tensors, false, &mut archives)?;
            place.extend((0..tensors.len()).map(|i| (0, i)));
        }
        TorchWriter::start(dest, archives, place, tensors.len(), pos)
    }

    /// One archive at `dest` whose `data.pkl` is `pkl` ([`Archive::with_pickle`]).
    ///
    /// # Errors
    /// Dtypes torch has no storage for, sizes that overflow, I/O errors.
    pub(crate) fn create_with_pickle(
        dest: &Path,
        tensors: &[TensorSpec],
        pkl: Vec<u8>,
    ) -> Result<TorchWriter> {
        let a = Archive::with_pickle(pkl, tensors).map_err(|e| e.with_path(dest))?;
        let len = a.len;
        let place = (0..tensors.len()).map(|i| (0, i)).collect();
        TorchWriter::start(dest, vec![(0, a)], place, tensors.len(), len)
    }

    /// Creates the staged file of `len` bytes and writes every byte known up front.
    fn start(
        dest: &Path,
        archives: Vec<(u64, Archive)>,
        place: Vec<(usize, usize)>,
        tensors: usize,
        pos: u64,
    ) -> Result<TorchWriter> {
        let out = StagedFile::create(dest)?;
        let w = TorchWriter {
            out,
            archives,
            place,
            written: (0..tensors).map(|_| Mutex::new(Vec::new())).collect(),
        };
        w.out.set_len(pos)?;
        for (at, a) in &w.archives {
            for (entry, bytes) in &a.small {
                let e = &a.entries[*entry];
                w.out.write_at(bytes, at + e.data_at)?;
            }
        }
        Ok(w)
    }

    /// The lengths of the archives, in order (DCP's metadata records each chunk's).
    pub(crate) fn archive_spans(tensors: &[TensorSpec]) -> Result<Vec<(u64, u64)>> {
        let mut pos = 0u64;
        tensors
            .iter()
            .map(|t| {
                let a = Archive::new(std::slice::from_ref(t), true)?;
                let at = pos;
                pos = pos
                    .checked_add(a.len)
                    .ok_or_else(|| overflow("file size"))?;
                Ok((at, a.len))
            })
            .collect()
    }

    fn data_start(&self, index: usize) -> u64 {
        let (a, t) = self.place[index];
        let (at, archive) = &self.archives[a];
        at + archive.data_at(t)
    }

    /// Writes `bytes` at byte `offset` of tensor `index`'s data.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub(crate) fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        self.write_parts_at(index, offset, &[bytes.into()])
    }

    /// [`TorchWriter::write_at`] of the concatenation of `parts`, written straight from
    /// them (`pwritev`) and hashed as one write (the zip entry's CRC-32 comes out the
    /// same).
    pub(crate) fn write_parts_at(
        &self,
        index: usize,
        offset: u64,
        parts: &[WritePart<'_>],
    ) -> Result<()> {
        // Hashed first, so a truncated mapped input faults in this process (named by
        // the SIGBUS handler) rather than failing the write with EFAULT.
        let mut h = crc32fast::Hasher::new();
        for p in parts {
            h.update(p.bytes);
        }
        let len: u64 = parts.iter().map(|p| p.bytes.len() as u64).sum();
        self.out
            .write_parts_at(parts, self.data_start(index) + offset)?;
        self.written[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((offset, len, h.finalize()));
        Ok(())
    }

    /// The CRC-32 of tensor `index`: its writes combined when they tile it, else read
    /// back.
    fn crc(&self, index: usize, len: u64) -> Result<u32> {
        let mut w = std::mem::take(
            &mut *self.written[index]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        w.sort_by_key(|x| x.0);
        let mut pos = 0;
        let tiles = w.iter().all(|&(off, n, _)| {
            let ok = off == pos;
            pos = off + n;
            ok
        }) && pos == len;
        let mut h = crc32fast::Hasher::new();
        if tiles {
            for (_, n, c) in w {
                h.combine(&crc32fast::Hasher::new_with_initial_len(c, n));
            }
            return Ok(h.finalize());
        }
        let start = self.data_start(index);
        let mut buf = vec![0u8; (len as usize).min(1 << 22)];
        let mut off = 0;
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            self.out.read_at(&mut buf[..n], start + off)?;
            h.update(&buf[..n]);
            off += n as u64;
        }
        Ok(h.finalize())
    }

    /// Patches the CRCs into the local headers, writes the central directories, syncs
    /// and renames the file to its final name.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub(crate) fn finish(self) -> Result<()> {
        let mut crcs: Vec<Vec<u32>> = self
            .archives
            .iter()
            .map(|(_, a)| vec![0; a.tensor_entry.len()])
            .collect();
        for i in 0..self.place.len() {
            let (a, t) = self.place[i];
            let len = self.archives[a].1.entries[self.archives[a].1.tensor_entry[t]].len;
            crcs[a][t] = self.crc(i, len)?;
        }
        for ((at, a), crcs) in self.archives.iter().zip(&crcs) {
            for i in 0..a.entries.len() {
                let h = a.local_header(i, a.crc_of(i, crcs));
                self.out.write_at(&h, at + a.entries[i].header_at)?;
            }
            self.out.write_at(&a.tail(crcs), at + a.cd_at)?;
        }
        self.out.commit()
    }
}

impl super::writer::TensorWriter for TorchWriter {
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        TorchWriter::write_at(self, index, offset, bytes)
    }

    fn write_parts_at(&self, index: usize, offset: u64, parts: &[WritePart<'_>]) -> Result<bool> {
        TorchWriter::write_parts_at(self, index, offset, parts).map(|()| true)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        TorchWriter::finish(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::TensorFile;

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn parts_write_the_same_archive_as_one_write() {
        let dir = tempfile::tempdir().unwrap();
        let parts: Vec<Vec<u8>> = (0..2500u32)
            .map(|i| (0..i % 5).map(|k| (i ^ k) as u8).collect())
            .collect();
        let all = parts.concat();
        let specs = [spec("w", Dtype::U8, &[all.len() as u64])];
        let (one, many) = (dir.path().join("one.pt"), dir.path().join("many.pt"));
        let w = TorchWriter::create(&one, &specs, false).unwrap();
        w.write_at(0, 0, &all).unwrap();
        w.finish().unwrap();
        let w = TorchWriter::create(&many, &specs, false).unwrap();
        let refs: Vec<WritePart<'_>> = parts.iter().map(|p| p.as_slice().into()).collect();
        w.write_parts_at(0, 0, &refs).unwrap();
        w.finish().unwrap();
        // The zip entry's CRC-32 included.
        assert_eq!(std::fs::read(&one).unwrap(), std::fs::read(&many).unwrap());
        let f = TensorFile::open(&many).unwrap();
        assert_eq!(f.data(0).unwrap(), &all[..]);
    }

    #[test]
    fn a_written_archive_reads_back_with_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("model.pth");
        let specs = [
            spec("w", Dtype::F32, &[2, 3]),
            spec("b", Dtype::BF16, &[3]),
            spec("s", Dtype::I64, &[]),
            spec("e", Dtype::F16, &[0, 4]),
        ];
        let w = TorchWriter::create(&dest, &specs, false).unwrap();
        let data: Vec<Vec<u8>> = [24usize, 6, 8, 0]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|b| (b * 7 + i) as u8).collect())
            .collect();
        // Two writes for w, in reverse order, to exercise CRC combining.
        w.write_at(0, 12, &data[0][12..]).unwrap();
        w.write_at(0, 0, &data[0][..12]).unwrap();
        for (i, d) in data.iter().enumerate().skip(1) {
            w.write_at(i, 0, d).unwrap();
        }
        w.finish().unwrap();
        let f = TensorFile::open(&dest).unwrap();
        for (i, s) in specs.iter().enumerate() {
            let k = f.find(&s.name).unwrap();
            assert_eq!(f.tensors()[k].shape, s.shape);
            assert_eq!(f.tensors()[k].dtype, s.dtype);
            assert_eq!(f.data(k), Some(&data[i][..]), "{}", s.name);
            assert_eq!(f.tensors()[k].start % ALIGN, 0);
        }
        // The zip crate checks every CRC it reads.
        let bytes = std::fs::read(&dest).unwrap();
        let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
        for i in 0..z.len() {
            let mut e = z.by_index(i).unwrap();
            std::io::copy(&mut e, &mut std::io::sink()).unwrap();
        }
    }

    #[test]
    fn dropped_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.distcp");
        let w = TorchWriter::create(&dest, &[spec("w", Dtype::U8, &[3])], true).unwrap();
        w.write_at(0, 0, &[1, 2, 3]).unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
