//! PyTorch's `torch.save` files (`.pth`, `.pt`, `.bin`): a zip archive (stored, not
//! compressed) holding `<dir>/data.pkl`, a pickle of the saved object, and one entry
//! `<dir>/data/<key>` per storage with its raw little-endian bytes.
//!
//! The pickle is data, not a program: ckpt's pickle machine turns it into a tree of
//! objects without importing or calling anything. Other globals than torch's tensor
//! rebuild functions and storage classes are inert records (`torch.Size((8, 6))`,
//! DeepSpeed's `LossScaler` and `ZeroStageEnum`, `argparse.Namespace`: class name and
//! arguments or state, nothing made), except those whose load would run code that
//! matters (`os.system`, `builtins.eval`, `subprocess.*`, ...): a file naming one is
//! refused by name, as `torch.load(weights_only=True)` would refuse it. Tensors are
//! found anywhere in the saved object and named by their path (`state.0.exp_avg` in an
//! optimizer's state dict); values that are not tensors are listed in the metadata
//! (`torch.non_tensor`), never silently dropped. A tensor is a view of a storage: a
//! storage offset is fine, a non-contiguous stride is refused by name.
//!
//! A DTensor (FSDP1's `SHARDED_STATE_DICT`, verl's per-rank files) is read as its local
//! tensor placed at the box its device mesh and placements give ([`dtensor`]): the entry
//! carries the box's offsets, and the file's metadata the DTensor's global shape
//! (`torch.dtensor.shapes`, JSON) and the rank and world size the mesh records.

mod dtensor;

use super::pickle::{self, Value};
use super::{byte_len, Mapped, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::formats::FileFormat;
use crate::layout::Dtype;
use std::collections::{BTreeMap, HashMap};
use std::io::Cursor;
use std::path::Path;

/// The modules whose globals a checkpoint never names: loading such a pickle with
/// Python's unpickler would run a command, evaluate code, import or open something.
/// (ckpt runs nothing; it refuses such a file because it is a trap, not a checkpoint.)
const REFUSED_MODULES: &[&str] = &[
    "os",
    "posix",
    "nt",
    "subprocess",
    "sys",
    "shutil",
    "socket",
    "importlib",
    "runpy",
    "pickle",
    "_pickle",
    "marshal",
    "code",
    "codeop",
    "pty",
    "ctypes",
    "webbrowser",
    "multiprocessing",
    "signal",
    "types",
    "functools",
    "operator",
    "io",
    "_io",
    "pathlib",
    "tempfile",
    "threading",
    "asyncio",
    "inspect",
    "pdb",
    "timeit",
    "commands",
    "popen2",
    "platform",
    "torch.hub",
    "torch.jit",
    "torch.serialization",
    "torch.utils.cpp_extension",
];

/// The builtins that are inert values (constructors of plain data); every other
/// builtin (`eval`, `exec`, `getattr`, `open`, `__import__`, ...) is refused.
const INERT_BUILTINS: &[&str] = &[
    "set",
    "frozenset",
    "slice",
    "complex",
    "bytearray",
    "range",
    "dict",
    "list",
    "tuple",
    "int",
    "float",
    "bool",
    "str",
    "bytes",
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

/// Reads a mapped `torch.save` archive; from a store, its storages are located when
/// first read ([`Deferred`]).
pub(crate) fn read(path: &Path, map: Option<Mapped>) -> Result<TensorFile> {
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let at = |e: Error| e.with_path(path);
    let archive = Archive::open_for(all, map.as_ref()).map_err(at)?;
    let obj = archive.object().map_err(at)?;
    check_globals(&obj).map_err(at)?;
    let (found, non_tensor) = archive.found(obj, String::new()).map_err(at)?;
    let mut metadata = BTreeMap::from([("format".to_string(), "torch.save".to_string())]);
    if !non_tensor.is_empty() {
        metadata.insert("torch.non_tensor".into(), non_tensor.join(","));
    }
    dtensor_metadata(&found, &mut metadata).map_err(at)?;
    let (tensors, deferred): (Vec<_>, Vec<_>) = found
        .iter()
        .map(|t| locate_deferred(t, &archive.dir, &archive.entries))
        .collect::<Result<Vec<_>>>()
        .map_err(at)?
        .into_iter()
        .unzip();
    let mut f = TensorFile::from_parts(path, map, FileFormat::TorchSave, tensors, metadata)?;
    Deferred::attach_all(&mut f, deferred);
    Ok(f)
}

/// One stored zip entry: where its bytes start in the file and how many there are.
struct Stored {
    /// Where its data starts: `None` until its local header is read.
    start: Option<u64>,
    /// Where its local header starts (the central directory says).
    header: u64,
    /// Where the next record (or the central directory) starts: the entry's local
    /// header, data and data descriptor lie before it.
    span_end: u64,
    len: u64,
    compressed: bool,
}

impl Stored {
    /// An entry whose data start is known (read forward, record by record).
    fn at(start: u64, len: u64, compressed: bool) -> Stored {
        Stored {
            start: Some(start),
            header: start,
            span_end: start.saturating_add(len),
            len,
            compressed,
        }
    }
}

/// Where the data of the entry `name` whose local header starts at `header` begins:
/// past the header's 30 bytes, the name and the extra field, which the local header
/// alone gives (its extra field may differ from the central directory's: torch pads
/// there to align the data to 64 bytes). The data must end by `span_end`.
fn local_data_start(all: &[u8], name: &str, header: u64, span_end: u64, len: u64) -> Result<u64> {
    let at = usize::try_from(header).map_err(|_| overflow(name))?;
    let head = all
        .get(at..)
        .and_then(|h| h.get(..30))
        .filter(|h| looks_like(h))
        .ok_or_else(|| {
            bad(format!(
                "zip entry `{name}`: no local header at byte {header}, where the central directory puts it"
            ))
        })?;
    let u16_at = |i: usize| u64::from(u16::from_le_bytes([head[i], head[i + 1]]));
    let start = header + 30 + u16_at(26) + u16_at(28);
    let end = start.checked_add(len).ok_or_else(|| overflow(name))?;
    if end > span_end.min(all.len() as u64) {
        return Err(bad(format!(
            "zip entry `{name}`: its {len} bytes from byte {start} run past byte {}, where the next record or the end of the file is",
            span_end.min(all.len() as u64)
        )));
    }
    Ok(start)
}

/// A tensor's entry, and how to locate it when first read where its storage's local
/// header is not read yet.
pub(crate) type Located = (TensorEntry, Option<Deferred>);

/// A tensor whose storage's local header is read when the tensor is first read
/// ([`TensorFile::set_lazy`]), not at open: the headers lie before each storage, all
/// through the file, and reading them at open would have a reader streaming the file
/// from a store fetch the whole object twice (once for the headers, once for the
/// copy), as every block it held for the headers was dropped again before the copy.
pub(crate) struct Deferred {
    entry: String,
    header: u64,
    span_end: u64,
    storage_len: u64,
    /// The view's bytes within its storage.
    rel: u64,
    len: u64,
}

impl Deferred {
    /// Makes entry `index` of `f` located on first read.
    pub(crate) fn attach(self, f: &mut TensorFile, index: usize) {
        let span = (self.header, self.span_end);
        f.set_lazy(
            index,
            span,
            Box::new(move |all: &[u8]| {
                let s = local_data_start(
                    all,
                    &self.entry,
                    self.header,
                    self.span_end,
                    self.storage_len,
                )? + self.rel;
                Ok((s, s + self.len))
            }),
        );
    }

    /// [`Deferred::attach`] for each entry that has one, in entry order.
    pub(crate) fn attach_all(f: &mut TensorFile, deferred: Vec<Option<Deferred>>) {
        for (i, d) in deferred.into_iter().enumerate() {
            if let Some(d) = d {
                d.attach(f, i);
            }
        }
    }
}

/// Where a `torch.save` archive's storages lie (owned: a reader keeps it beside the
/// mapping it was read from), for [`locate_value`].
pub(crate) struct ArchiveIndex {
    dir: String,
    entries: HashMap<String, Stored>,
}

impl ArchiveIndex {
    /// The tensors anywhere in `obj` (a part of [`Archive::object`]), named by their
    /// path under `path`, located in the file (or, where the storage's local header is
    /// not read yet, to be located when read: [`Deferred`]); and the paths of the plain values
    /// (numbers, strings, `None`) met on the way.
    pub(crate) fn tensors(&self, obj: Value, path: String) -> Result<(Vec<Located>, Vec<String>)> {
        let mut found = Vec::new();
        let mut non_tensor = Vec::new();
        walk(obj, path, &mut found, &mut non_tensor)?;
        let mut tensors = Vec::with_capacity(found.len());
        for t in found {
            tensors.push(locate_deferred(&t, &self.dir, &self.entries)?);
        }
        Ok((tensors, non_tensor))
    }

    /// The byte range `(start, len)` of storage `key` (`data/<key>`) in the archive,
    /// when it is there and stored uncompressed.
    pub(crate) fn storage(&self, key: &str) -> Option<(u64, u64)> {
        let s = self.entries.get(&format!("{}data/{key}", self.dir))?;
        s.start
            .filter(|_| !s.compressed)
            .map(|start| (start, s.len))
    }
}

/// Reads the zip directory and the pickle of a `torch.save` file, checking its globals;
/// tensors are not located yet ([`locate_value`] does, for the values a caller wants).
pub(crate) fn open_archive(all: &[u8]) -> Result<(ArchiveIndex, Value)> {
    let archive = Archive::open(all)?;
    let obj = archive.object()?;
    check_globals(&obj)?;
    Ok((archive.into_index(), obj))
}

/// Where the bytes of the tensor `v` lie in the archive, as an entry named `name`.
///
/// # Errors
/// `v` is not a tensor (the message says what it is), or its storage is not in the
/// archive or too short.
pub(crate) fn locate_value(archive: &ArchiveIndex, name: &str, v: &Value) -> Result<TensorEntry> {
    match v.call_of() {
        Some(((_, "_rebuild_tensor_v2"), args)) => {
            let t = tensor(name, args.clone())?;
            locate(&t, &archive.dir, &archive.entries)
        }
        Some(((_, "_rebuild_from_type_v2"), args)) => match from_type_inner(args) {
            Some(inner) => locate_value(archive, name, &inner),
            None => Err(bad(format!(
                "`{name}`: _rebuild_from_type_v2 without a tensor"
            ))),
        },
        Some(((_, "_rebuild_parameter"), args)) => match args.items().and_then(|a| a.first()) {
            Some(inner) => locate_value(archive, name, inner),
            None => Err(bad(format!(
                "`{name}`: _rebuild_parameter without a tensor"
            ))),
        },
        _ => match v {
            Value::Build { object, .. } if is_tensor(object) => locate_value(archive, name, object),
            _ => Err(Error::InvalidTensor {
                tensor: name.to_string(),
                problem: format!("expected a tensor, found {}", describe(v)),
            }),
        },
    }
}

/// The metadata key under which a file of DTensors declares their global shapes: a
/// JSON object of name and shape.
pub(crate) const DTENSOR_SHAPES: &str = "torch.dtensor.shapes";

pub(crate) fn parse(all: &[u8]) -> Result<(Vec<TensorEntry>, BTreeMap<String, String>)> {
    let archive = Archive::open(all)?;
    let obj = archive.object()?;
    check_globals(&obj)?;
    let (found, non_tensor) = archive.found(obj, String::new())?;
    let mut metadata = BTreeMap::from([("format".to_string(), "torch.save".to_string())]);
    if !non_tensor.is_empty() {
        metadata.insert("torch.non_tensor".into(), non_tensor.join(","));
    }
    dtensor_metadata(&found, &mut metadata)?;
    let tensors = found
        .iter()
        .map(|t| locate(t, &archive.dir, &archive.entries))
        .collect::<Result<Vec<_>>>()?;
    Ok((tensors, metadata))
}

/// The one tensor of a `torch.save` archive of a single tensor (a DCP chunk), found by
/// reading forward from the archive's start: its zip records' local headers one after
/// the other up to the tensor's storage, never the central directory at the end. A
/// reader streaming the archive from a store thus reads only bytes just before the
/// data it reads next.
///
/// torch writes each record's sizes after its data (a data descriptor, flag bit 3:
/// `PK\x07\x08`, CRC-32, then the sizes, 4 or 8 bytes each), so a record's length is
/// where the descriptor that names that very length starts; the storage's own length
/// is the pickle's (the descriptor after it is not read).
///
/// # Errors
/// Not a walkable zip, no pickle before the storage, not exactly one tensor, as
/// [`parse`] would say.
pub(crate) fn parse_single_forward(all: &[u8]) -> Result<TensorEntry> {
    const LOCAL: &[u8] = b"PK\x03\x04";
    let mut entries: HashMap<String, Stored> = HashMap::new();
    let mut at = 0usize;
    let mut pickle: Option<(String, Found)> = None;
    loop {
        let head = all
            .get(at..at + 30)
            .filter(|h| h.starts_with(LOCAL))
            .ok_or_else(|| {
                bad(format!(
                    "no zip record at byte {at} before the tensor's storage"
                ))
            })?;
        let u16_at = |i: usize| u16::from_le_bytes([head[i], head[i + 1]]) as usize;
        let descriptor = u16_at(6) & 0x8 != 0;
        let compressed = u16_at(8) != 0;
        let (name_len, extra_len) = (u16_at(26), u16_at(28));
        let name_at = at + 30;
        let name = all
            .get(name_at..name_at + name_len)
            .and_then(|n| std::str::from_utf8(n).ok())
            .ok_or_else(|| {
                bad(format!(
                    "the zip record at byte {at}: its name is not readable"
                ))
            })?
            .to_string();
        let extra = all
            .get(name_at + name_len..name_at + name_len + extra_len)
            .ok_or_else(|| bad(format!("zip record `{name}`: truncated")))?;
        let start = name_at + name_len + extra_len;
        if let Some((dir, t)) = &pickle {
            if name == format!("{dir}data/{}", t.key) {
                // The storage: as long as the pickle says (checked against the
                // chunk's length by the caller), located.
                let len = t
                    .storage_numel
                    .checked_mul((t.dtype.bitsize() / 8) as u64)
                    .ok_or_else(|| overflow(&name))?;
                entries.insert(name, Stored::at(start as u64, len, compressed));
                let entry = locate(t, dir, &entries)?;
                if entry.end > all.len() as u64 {
                    return Err(bad(format!(
                        "`{}` ends at byte {}, past the archive's {} bytes",
                        t.name,
                        entry.end,
                        all.len()
                    )));
                }
                return Ok(entry);
            }
        }
        let len = if descriptor {
            descriptor_length(all, start).ok_or_else(|| {
                bad(format!(
                    "zip record `{name}`: no data descriptor names its length"
                ))
            })?
        } else {
            local_length(head, extra).ok_or_else(|| {
                bad(format!(
                    "zip record `{name}`: a zip64 size without its extra field"
                ))
            })?
        };
        let data = slice(all, start as u64, len, &name)?;
        if pickle.is_none() {
            if let Some(dir) = name
                .strip_suffix("data.pkl")
                .filter(|d| d.ends_with('/') && d.matches('/').count() == 1)
            {
                if compressed {
                    return Err(bad(format!("`{name}` is compressed: torch.save stores it")));
                }
                let obj = unpickle(data)?;
                check_globals(&obj)?;
                let mut found = Vec::new();
                walk(obj, String::new(), &mut found, &mut Vec::new())?;
                let [t] = &found[..] else {
                    return Err(bad(format!(
                        "{} tensors in the archive, not one",
                        found.len()
                    )));
                };
                pickle = Some((dir.to_string(), t.clone()));
            }
        }
        // Past the data and its descriptor (signature, CRC-32, two sizes of 4 or 8).
        let mut next = start + len as usize;
        if descriptor {
            let small = 16;
            next += if all.get(next + 8..next + 12).map(u32_le) == Some(len) {
                small
            } else {
                24
            };
        }
        at = next;
    }
}

fn u32_le(b: &[u8]) -> u64 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64
}

/// The length of a record whose data starts at `start` and is followed by a data
/// descriptor: the first descriptor signature after `start` whose compressed size (4
/// or 8 bytes) is its own distance from `start`.
fn descriptor_length(all: &[u8], start: usize) -> Option<u64> {
    const DESCRIPTOR: &[u8] = b"PK\x07\x08";
    let rest = all.get(start..)?;
    let mut from = 0;
    while let Some(i) = rest.get(from..)?.windows(4).position(|w| w == DESCRIPTOR) {
        let pos = from + i;
        let d = rest.get(pos + 8..)?;
        let short = d.get(..4).map(u32_le);
        let long = d
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        if short == Some(pos as u64) || long == Some(pos as u64) {
            return Some(pos as u64);
        }
        from = pos + 1;
    }
    None
}

/// A record's compressed size from its local header (`head`, 30 bytes) and extra
/// field: zip64's (extra field 0x0001: uncompressed, then compressed) where the header
/// says 0xFFFFFFFF.
fn local_length(head: &[u8], extra: &[u8]) -> Option<u64> {
    let len = u32_le(&head[18..22]);
    if len != 0xFFFF_FFFF {
        return Some(len);
    }
    let mut e = extra;
    while e.len() >= 4 {
        let (id, n) = (
            u16::from_le_bytes([e[0], e[1]]),
            u16::from_le_bytes([e[2], e[3]]) as usize,
        );
        let body = e.get(4..4 + n)?;
        if id == 1 && body.len() >= 16 {
            return Some(u64::from_le_bytes(body[8..16].try_into().expect("8 bytes")));
        }
        e = e.get(4 + n..)?;
    }
    None
}

/// The global shapes of the file's DTensors, and the rank and world size their meshes
/// record (which must agree: one file is one process's save).
fn dtensor_metadata(found: &[Found], metadata: &mut BTreeMap<String, String>) -> Result<()> {
    let mut shapes = serde_json::Map::new();
    let (mut rank, mut world) = (None, None);
    for t in found {
        let Some(p) = &t.placed else { continue };
        shapes.insert(t.name.clone(), serde_json::json!(p.global));
        for (seen, now, what) in [
            (&mut rank, p.rank, "rank"),
            (&mut world, p.world, "world size"),
        ] {
            match (&*seen, now) {
                (Some((a, first)), Some(b)) if *a != b => {
                    return Err(bad(format!(
                        "DTensors of different meshes: `{first}` records {what} {a}, `{}` {b}",
                        t.name
                    )))
                }
                (None, Some(b)) => *seen = Some((b, t.name.clone())),
                _ => {}
            }
        }
    }
    if shapes.is_empty() {
        return Ok(());
    }
    metadata.insert(
        DTENSOR_SHAPES.into(),
        serde_json::Value::Object(shapes).to_string(),
    );
    if let (Some((r, _)), Some((w, _))) = (rank, world) {
        if r >= w {
            return Err(bad(format!("a DTensor's mesh records rank {r} of {w}")));
        }
        metadata.insert("rank".into(), r.to_string());
        metadata.insert("world_size".into(), w.to_string());
    }
    Ok(())
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
    /// Reads the zip directory of a mapped file and every entry's local header.
    pub(crate) fn open(all: &'a [u8]) -> Result<Archive<'a>> {
        let mut archive = Archive::open_deferred(all)?;
        // In the file's order, so that the first damaged header named is the same
        // on every run.
        let mut entries: Vec<(&String, &mut Stored)> = archive.entries.iter_mut().collect();
        entries.sort_by_key(|(_, s)| s.header);
        for (name, s) in entries {
            if s.start.is_none() {
                let start = local_data_start(all, name, s.header, s.span_end, s.len)?;
                s.start = Some(start);
                // Reading the local header mapped its pages (in a file mapping, maybe
                // a whole 2 MiB folio): dropped again, so that opening an archive of
                // many entries does not hold them all.
                let at = usize::try_from(s.header).unwrap_or(usize::MAX);
                if let Some(len) = usize::try_from(start - s.header)
                    .ok()
                    .filter(|_| at < all.len())
                {
                    crate::fault::forget_mapped(
                        all.as_ptr() as usize + at,
                        len.min(all.len() - at),
                    );
                }
            }
        }
        Ok(archive)
    }

    /// [`Archive::open_deferred`] for an object of a store, whose local headers the copy
    /// reaches with its data; [`Archive::open`] for a local file (every header checked
    /// at open, as `inspect` shows it).
    pub(crate) fn open_for(all: &'a [u8], map: Option<&Mapped>) -> Result<Archive<'a>> {
        if map.is_some_and(Mapped::is_remote) {
            Archive::open_deferred(all)
        } else {
            Archive::open(all)
        }
    }

    /// Reads the zip directory of a mapped file (at its end) and the pickle's local
    /// header; the storages' local headers are read when their tensors are
    /// ([`locate_deferred`]).
    pub(crate) fn open_deferred(all: &'a [u8]) -> Result<Archive<'a>> {
        let zip = zip::ZipArchive::new(Cursor::new(all))
            .map_err(|e| bad(format!("not a readable zip archive: {e}")))?;
        let mut records = Vec::with_capacity(zip.len());
        for i in 0..zip.len() {
            let f = zip
                .by_index_data(i)
                .map_err(|e| bad(format!("zip entry {i}: {e}")))?;
            let name = f
                .name()
                .map_err(|e| bad(format!("zip entry {i}: {e}")))?
                .to_string();
            let compressed = f.compression() != zip::CompressionMethod::Stored;
            records.push((f.header_start(), name, f.compressed_size(), compressed));
        }
        // Each record ends where the next begins (the last where the directory does).
        records.sort_by_key(|r| r.0);
        let directory = zip.central_directory_start();
        let mut entries: HashMap<String, Stored> = HashMap::with_capacity(records.len());
        for (i, (header, name, len, compressed)) in records.iter().enumerate() {
            let span_end = records.get(i + 1).map_or(directory, |r| r.0).max(*header);
            entries.insert(
                name.clone(),
                Stored {
                    start: None,
                    header: *header,
                    span_end,
                    len: *len,
                    compressed: *compressed,
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
        let pkl = entries.get_mut(&pkl_name).expect("found above");
        pkl.start = Some(local_data_start(
            all,
            &pkl_name,
            pkl.header,
            pkl.span_end,
            pkl.len,
        )?);
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
        let start = self.data_start(&self.pkl_name, pkl)?;
        unpickle(slice(self.all, start, pkl.len, &self.pkl_name)?)
    }

    /// The index of storages, owned (kept beside the mapping it was read from).
    pub(crate) fn into_index(self) -> ArchiveIndex {
        ArchiveIndex {
            dir: self.dir,
            entries: self.entries,
        }
    }

    /// Where entry `name`'s data starts: known, or read from its local header now.
    fn data_start(&self, name: &str, s: &Stored) -> Result<u64> {
        match s.start {
            Some(start) => Ok(start),
            None => local_data_start(self.all, name, s.header, s.span_end, s.len),
        }
    }

    /// The stored bytes of storage `key` (`data/<key>`).
    ///
    /// # Errors
    /// No such storage, a compressed one, or one past the end of the file.
    pub(crate) fn storage_bytes(&self, key: &str) -> Result<&'a [u8]> {
        let name = format!("{}data/{key}", self.dir);
        match self.entries.get(&name) {
            Some(s) if !s.compressed => slice(self.all, self.data_start(&name, s)?, s.len, &name),
            Some(_) => Err(bad(format!("`{name}` is compressed: torch.save stores it"))),
            None => Err(bad(format!(
                "storage `{key}` is referred to but `{name}` is missing"
            ))),
        }
    }

    /// The tensors anywhere in `obj`, named by their path under `path`, not located
    /// yet; and the paths of the plain values met on the way.
    fn found(&self, obj: Value, path: String) -> Result<(Vec<Found>, Vec<String>)> {
        let mut found = Vec::new();
        let mut non_tensor = Vec::new();
        walk(obj, path, &mut found, &mut non_tensor)?;
        Ok((found, non_tensor))
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

/// Whether a pickle may name this global: anything but a refused module (or one
/// inside it) and the builtins that are not inert.
pub(crate) fn allowed(module: &str, name: &str) -> bool {
    // A tensor subclass's layout (`torch.strided`, in every DTensor's pickle): a name
    // looked up in torch, on torch's own `weights_only` allow-list.
    if (module, name) == ("torch.serialization", "_get_layout") {
        return true;
    }
    let root_refused = REFUSED_MODULES.iter().any(|m| {
        module == *m
            || module
                .strip_prefix(m)
                .is_some_and(|rest| rest.starts_with('.'))
    });
    if root_refused {
        return false;
    }
    if matches!(module, "builtins" | "__builtin__" | "__builtins__") {
        return INERT_BUILTINS.contains(&name);
    }
    // `eval`/`exec` reached through another module's namespace (`numpy.eval` does not
    // exist, but a crafted pickle may try `some_module.eval`).
    !matches!(
        name,
        "eval" | "exec" | "execfile" | "compile" | "__import__" | "system" | "popen"
    )
}

/// Refuses the globals whose load would run code, by name; every other global is an
/// inert record.
pub(crate) fn check_globals(obj: &Value) -> Result<()> {
    let mut names = Vec::new();
    obj.globals(&mut names);
    match names.into_iter().find(|(m, c)| !allowed(m, c)) {
        None => Ok(()),
        Some((module, class)) => Err(bad(format!(
            "data.pkl names the global `{module}.{class}`, which is not allowed in a checkpoint (loading it with Python would run code; ckpt reads other classes as inert records)"
        ))),
    }
}

/// The class or function a value records, when it is a record of one (`REDUCE`,
/// `NEWOBJ`, `BUILD` of a global that is not a tensor).
pub(crate) fn record_class(v: &Value) -> Option<String> {
    match v {
        Value::Call { callable, .. } => match callable.global() {
            Some((m, n)) => Some(format!("{m}.{n}")),
            None => record_class(callable),
        },
        Value::Build { object, .. } => record_class(object),
        Value::Global { module, name } => Some(format!("{module}.{name}")),
        _ => None,
    }
}

/// What a value is, for messages that say what was found where something else was
/// needed (`a record of `deepspeed...LossScaler``, `an integer`).
pub(crate) fn describe(v: &Value) -> String {
    if is_tensor(v) {
        return "a tensor".into();
    }
    if let Some(c) = record_class(v) {
        return format!("a `{c}` record");
    }
    match v {
        Value::None => "None",
        Value::Bool(_) => "a boolean",
        Value::Int(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Str(_) => "a string",
        Value::Bytes(_) => "bytes",
        Value::Tuple(_) => "a tuple",
        Value::List(_) => "a list",
        Value::Dict(_) => "a dict",
        _ => "a value ckpt does not read",
    }
    .into()
}

/// `_rebuild_from_type_v2(func, type, args, state)` (a tensor subclass, or a plain
/// tensor saved through `Tensor.__reduce_ex__` as ZeRO-3's flat groups are): the call
/// `func(*args)` it wraps.
fn from_type_inner(args: &Value) -> Option<Value> {
    match args.items()? {
        [func, _, inner, ..] => Some(Value::Call {
            callable: Box::new(func.clone()),
            args: Box::new(inner.clone()),
        }),
        _ => None,
    }
}

/// Whether `v` is a tensor (`_rebuild_tensor_v2(...)`, or a parameter around one).
pub(crate) fn is_tensor(v: &Value) -> bool {
    match v.call_of() {
        Some(((_, "_rebuild_tensor_v2"), _)) => true,
        Some(((_, "_rebuild_from_type_v2"), args)) => {
            from_type_inner(args).is_some_and(|i| is_tensor(&i))
        }
        Some(((_, "_rebuild_parameter"), args)) => args
            .items()
            .is_some_and(|a| a.first().is_some_and(is_tensor)),
        _ => matches!(v, Value::Build { object, .. } if is_tensor(object)),
    }
}

/// Whether a tensor lies anywhere inside `v`.
fn holds_tensor(v: &Value) -> bool {
    if is_tensor(v) {
        return true;
    }
    match v {
        Value::Tuple(x) | Value::List(x) => x.iter().any(holds_tensor),
        Value::Dict(kv) => kv.iter().any(|(k, v)| holds_tensor(k) || holds_tensor(v)),
        Value::Call { callable, args } => holds_tensor(callable) || holds_tensor(args),
        Value::Build { object, state } => holds_tensor(object) || holds_tensor(state),
        _ => false,
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
#[derive(Clone)]
struct Found {
    name: String,
    dtype: Dtype,
    key: String,
    storage_numel: u64,
    offset: u64,
    shape: Vec<u64>,
    stride: Vec<u64>,
    /// A DTensor's local tensor: where it sits in the DTensor's global tensor.
    placed: Option<dtensor::Placed>,
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
            Some((_, "_rebuild_from_type_v2")) if dtensor::is_dtensor(&args) => {
                out.push(dtensor_local(&path, &args)?);
                Ok(())
            }
            Some((_, "_rebuild_tensor_v2")) => {
                out.push(tensor(&path, *args)?);
                Ok(())
            }
            Some((_, "_rebuild_from_type_v2")) => match from_type_inner(&args) {
                Some(inner) if is_tensor(&inner) => walk(inner, path, out, skipped),
                _ => Err(bad(format!(
                    "`{path}`: _rebuild_from_type_v2 of something that is not a tensor"
                ))),
            },
            Some((_, "_rebuild_parameter")) => {
                let mut a = tuple(*args, &path)?;
                if a.is_empty() {
                    return Err(bad(format!(
                        "`{path}`: _rebuild_parameter without a tensor"
                    )));
                }
                walk(a.remove(0), path, out, skipped)
            }
            _ => record(Value::Call { callable, args }, path, out, skipped),
        },
        // A record built with a state (a `LossScaler`); a dict built with a state (a
        // module's state dict, an OrderedDict carrying `_metadata`) is the dict.
        Value::Build { object, state }
            if !is_tensor(&object) && record_class(&object).is_some() =>
        {
            record(Value::Build { object, state }, path, out, skipped)
        }
        Value::Build { object, .. } => walk(*object, path, out, skipped),
        Value::Int(_) | Value::Float(_) | Value::Str(_) | Value::Bool(_) | Value::None => {
            skipped.push(if path.is_empty() {
                "<root>".into()
            } else {
                path
            });
            Ok(())
        }
        Value::Global { .. } | Value::Bytes(_) => record(obj, path, out, skipped),
        _ => Err(bad(format!("`{path}`: an object ckpt does not read"))),
    }
}

/// A DTensor's local tensor, placed in its global tensor.
fn dtensor_local(path: &str, args: &Value) -> Result<Found> {
    let (local, placed) = dtensor::read(path, args)?;
    let mut t = match local.call_of() {
        Some(((_, "_rebuild_tensor_v2"), a)) => tensor(path, a.clone())?,
        _ => {
            return Err(Error::InvalidTensor {
                tensor: path.to_string(),
                problem: format!(
                    "a DTensor whose local tensor is {}, not a tensor ckpt reads",
                    describe(&local)
                ),
            })
        }
    };
    if t.shape != placed.shape {
        return Err(Error::InvalidTensor {
            tensor: path.to_string(),
            problem: format!(
                "a DTensor of global shape {:?} whose local tensor has shape {:?}, but its mesh \
                 coordinate and placements give a box of {:?} at {:?}",
                placed.global, t.shape, placed.shape, placed.offsets
            ),
        });
    }
    t.placed = Some(placed);
    Ok(t)
}

/// An inert record (`torch.Size(...)`, a `LossScaler`): listed with its class among the
/// values that are not tensors; tensors inside one (an object holding tensors in its
/// state) are found under its path, never dropped.
fn record(v: Value, path: String, out: &mut Vec<Found>, skipped: &mut Vec<String>) -> Result<()> {
    let class = record_class(&v).unwrap_or_else(|| describe(&v));
    if !holds_tensor(&v) {
        let at = if path.is_empty() { "<root>" } else { &path };
        skipped.push(format!("{at} ({class})"));
        return Ok(());
    }
    match v {
        Value::Call { args, .. } => walk(*args, path, out, skipped),
        Value::Build { object, state } => {
            walk(*object, path.clone(), out, skipped)?;
            walk(*state, path, out, skipped)
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
        placed: None,
    })
}

fn locate(t: &Found, dir: &str, entries: &HashMap<String, Stored>) -> Result<TensorEntry> {
    match locate_deferred(t, dir, entries)? {
        (entry, None) => Ok(entry),
        (_, Some(d)) => Err(bad(format!(
            "zip entry `{}`: its local header is not read",
            d.entry
        ))),
    }
}

/// Where tensor `t`'s bytes lie: located, where its storage's data start is known;
/// else placed at its storage's local header (for sizes and read order) with the
/// [`Deferred`] that locates it when read.
fn locate_deferred(t: &Found, dir: &str, entries: &HashMap<String, Stored>) -> Result<Located> {
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
    let deferred = stored.start.is_none().then(|| Deferred {
        entry: entry_name.clone(),
        header: stored.header,
        span_end: stored.span_end,
        storage_len: stored.len,
        rel,
        len,
    });
    let start = stored
        .start
        .unwrap_or(stored.header)
        .checked_add(rel)
        .ok_or_else(|| overflow(format!("`{name}` start")))?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| overflow(format!("`{name}` end")))?;
    let entry = TensorEntry {
        name: name.clone(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        start,
        end,
        offsets: t.placed.as_ref().map(|p| p.offsets.clone()),
    };
    Ok((entry, deferred))
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
    fn dtensors_are_their_local_tensors_at_their_boxes() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/dtensor/ws4/model_world_size_4_rank_1.pt");
        let (t, m) = parse(&std::fs::read(p).unwrap()).unwrap();
        let by: BTreeMap<_, _> = t.iter().map(|e| (e.name.as_str(), e)).collect();
        // 9x6 on a 2x2 mesh as (Shard(0), Shard(1)), coordinate (0, 1): rows 0..5,
        // columns 3..6.
        assert_eq!(by["embed.weight"].offsets, Some(vec![0, 3]));
        assert_eq!(by["embed.weight"].shape, vec![5, 3]);
        assert_eq!(by["plain.buffer"].offsets, None);
        let shapes: BTreeMap<String, Vec<u64>> = serde_json::from_str(&m[DTENSOR_SHAPES]).unwrap();
        assert_eq!(shapes["embed.weight"], vec![9, 6]);
        assert!(!shapes.contains_key("plain.buffer"));
        assert_eq!((m["rank"].as_str(), m["world_size"].as_str()), ("1", "4"));
    }

    /// Every tensor of a file torch wrote (a model with tied weights: views of one
    /// storage) is found at the same bytes whether its local header is read at open or
    /// when the tensor is read.
    #[test]
    fn deferred_tensors_are_located_where_the_local_headers_say() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/torch/ddp.pth");
        let all = std::fs::read(&p).unwrap();
        let eager = parse(&all).unwrap().0;
        let archive = Archive::open_deferred(&all).unwrap();
        let (found, _) = archive
            .found(archive.object().unwrap(), String::new())
            .unwrap();
        assert_eq!(found.len(), eager.len());
        for (t, want) in found.iter().zip(&eager) {
            let (entry, deferred) = locate_deferred(t, &archive.dir, &archive.entries).unwrap();
            let d = deferred.expect("not located at open");
            assert_eq!(entry.end - entry.start, want.end - want.start, "{}", t.name);
            assert!(
                entry.start <= want.start && want.end <= d.span_end,
                "{}",
                t.name
            );
            let s = local_data_start(&all, &d.entry, d.header, d.span_end, d.storage_len).unwrap();
            assert_eq!(
                (s + d.rel, s + d.rel + d.len),
                (want.start, want.end),
                "{}",
                t.name
            );
        }
        // A local header damaged: named when located, with the entry.
        let d = locate_deferred(&found[0], &archive.dir, &archive.entries)
            .unwrap()
            .1
            .unwrap();
        let mut bad = all.clone();
        bad[d.header as usize] = b'X';
        let e = local_data_start(&bad, &d.entry, d.header, d.span_end, d.storage_len)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&d.entry) && e.contains("no local header"), "{e}");
        // A length past the next record: named.
        let e = local_data_start(&all, &d.entry, d.header, d.span_end, d.span_end - d.header)
            .unwrap_err()
            .to_string();
        assert!(e.contains("run past byte"), "{e}");
    }

    #[test]
    fn every_byte_of_a_dtensor_pickle_changed_is_an_error_or_a_reading_never_a_panic() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/dtensor/ws4/model_world_size_4_rank_2.pt");
        let all = std::fs::read(p).unwrap();
        let archive = Archive::open(&all).unwrap();
        let pkl = &archive.entries[&archive.pkl_name];
        let (start, len) = (
            pkl.start.expect("located at open") as usize,
            pkl.len as usize,
        );
        for i in start..start + len {
            for b in [0x00, 0xff] {
                let mut bad = all.clone();
                bad[i] = b;
                let _ = parse(&bad);
            }
        }
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

    /// A pickle of `{"shape": torch.Size((11, 6)), "stage": ZeroStageEnum(2),
    /// "scaler": <LossScaler built with {"cur_scale": 16}>, "args": Namespace(),
    /// "dtype": torch.float16}`, as DeepSpeed's files hold them.
    fn deepspeed_like() -> Vec<u8> {
        let mut e = pickle::Emitter::new();
        e.empty_dict().mark();
        e.str("shape")
            .global("torch", "Size")
            .mark()
            .ints(&[11, 6])
            .tuple()
            .reduce();
        e.str("stage")
            .global("deepspeed.runtime.zero.config", "ZeroStageEnum")
            .mark()
            .int(2)
            .tuple()
            .reduce();
        e.str("scaler")
            .global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
            .empty_tuple()
            .new_obj()
            .empty_dict()
            .mark()
            .str("cur_scale")
            .int(16)
            .set_items()
            .build();
        e.str("args")
            .global("argparse", "Namespace")
            .empty_tuple()
            .reduce();
        e.str("dtype").global("torch", "float16");
        e.set_items();
        e.finish()
    }

    #[test]
    fn ordinary_globals_are_inert_records() {
        let obj = unpickle(&deepspeed_like()).unwrap();
        check_globals(&obj).unwrap();
        assert_eq!(
            describe(obj.get("scaler").unwrap()),
            "a `deepspeed.runtime.fp16.loss_scaler.LossScaler` record"
        );
        let (mut found, mut skipped) = (vec![], vec![]);
        walk(obj, String::new(), &mut found, &mut skipped).unwrap();
        assert!(found.is_empty());
        assert_eq!(
            skipped,
            vec![
                "shape (torch.Size)",
                "stage (deepspeed.runtime.zero.config.ZeroStageEnum)",
                "scaler (deepspeed.runtime.fp16.loss_scaler.LossScaler)",
                "args (argparse.Namespace)",
                "dtype (torch.float16)",
            ]
        );
    }

    #[test]
    fn globals_that_run_code_stay_refused() {
        for (m, n) in [
            ("builtins", "eval"),
            ("builtins", "exec"),
            ("__builtin__", "getattr"),
            ("subprocess", "Popen"),
            ("posix", "system"),
            ("os.path", "join"),
            ("torch.hub", "load"),
            ("some_module", "eval"),
        ] {
            let mut e = pickle::Emitter::new();
            e.global(m, n).mark().str("x").tuple().reduce();
            let obj = unpickle(&e.finish()).unwrap();
            let msg = check_globals(&obj).unwrap_err().to_string();
            assert!(msg.contains(&format!("`{m}.{n}`")), "{msg}");
        }
        // Plain-data builtins are records like any class.
        let mut e = pickle::Emitter::new();
        e.global("builtins", "set")
            .mark()
            .empty_list()
            .tuple()
            .reduce();
        check_globals(&unpickle(&e.finish()).unwrap()).unwrap();
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
        entries.insert("x/data/0".to_string(), Stored::at(100, 16, false));
        let f = Found {
            name: "w".into(),
            dtype: Dtype::F32,
            key: "0".into(),
            storage_numel: 4,
            offset: 2,
            shape: vec![3],
            stride: vec![1],
            placed: None,
        };
        let e = locate(&f, "x/", &entries).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("past the end"), "{e}");
    }
}
