//! One home for the file formats ckpt reads and writes. Each format is a leaf module
//! that imports only the layout algebra, this module's types and the shared codecs
//! (pickle, checksum, the output commit); nothing above it.
//!
//! Reading: a format is a [`Reader`] (`looks_like(head)`, `read(path, map)`), one row of
//! the detection table ([`detect`]). `read` parses metadata only and returns a
//! [`TensorFile`], the same description whatever the format: the tensors (name, dtype,
//! shape as stored), where each lies in its global tensor ([`TensorFile::piece`]: a box,
//! or a flat element range), its non-tensor metadata, and how to get its bytes: a range
//! of the mapped file, or a [`Decoder`] of compressed chunks. The planner and the copy
//! engine see only `TensorFile`s.
//!
//! Writing: a format is a [`writer::TensorWriter`], chosen by
//! [`detect::create_writer`] from the output's name; every writer
//! commits through [`output::StagedFile`].

pub mod checksum;
pub mod ckptz;
pub mod deepspeed;
pub mod deepspeed_tp;
pub mod deepspeed_write;
pub mod detect;
pub mod distcp;
pub mod gguf;
pub mod megatron;
pub mod mindspore_ckpt;
pub mod mindspore_strategy;
pub mod orbax;
pub mod output;
pub mod pickle;
pub mod safetensors;
pub mod torch_save;
pub mod torch_write;
pub mod ucp;
pub mod writer;

use crate::error::{overflow, Error, IoContext, Result};
use crate::formats::checksum::Checksum;
use crate::layout::region::Region;
use crate::layout::strategy::dtype_name;
use crate::layout::Dtype;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The formats an input file can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FileFormat {
    /// safetensors (Hugging Face, ckpt's own rank files, DCP's sharded safetensors).
    Safetensors,
    /// MindSpore's protobuf `.ckpt` (`mindspore.save_checkpoint`).
    MindSporeCkpt,
    /// PyTorch's `torch.save` zip archive (`.pth`, `.pt`, `.bin`).
    TorchSave,
    /// ckpt's compressed files (`.ckptz`: safetensors' description, zstd chunks).
    Ckptz,
    /// A data file of PyTorch DCP's default format (`__<rank>_<n>.distcp`), read with
    /// its directory's `.metadata`.
    Distcp,
    /// A `torch.save` file of a DeepSpeed ZeRO checkpoint, read with its tag directory
    /// (its entries are the flat pieces of the fp32 weights and moments it holds).
    DeepSpeed,
    /// A `torch.save` file of a DeepSpeed universal checkpoint (`zero/<param>/<state>.pt`:
    /// one whole tensor), read with its tag directory.
    Ucp,
    /// An Orbax (JAX) item directory: zarr v2/v3 arrays in tensorstore's OCDBT
    /// key-value store or in one directory per array, each zarr chunk one piece whose
    /// bytes are decoded on read.
    Orbax,
    /// llama.cpp's GGUF: tensors of F32, F16, BF16 and Q8_0 (its blocks as `U8` rows).
    Gguf,
}

impl FileFormat {
    /// A short name for messages.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            FileFormat::Safetensors => "safetensors",
            FileFormat::MindSporeCkpt => "MindSpore .ckpt",
            FileFormat::TorchSave => "torch.save",
            FileFormat::Ckptz => "ckptz",
            FileFormat::Distcp => "PyTorch DCP .distcp",
            FileFormat::DeepSpeed => "DeepSpeed ZeRO .pt",
            FileFormat::Ucp => "DeepSpeed universal .pt",
            FileFormat::Orbax => "Orbax zarr",
            FileFormat::Gguf => "GGUF",
        }
    }
}

/// One tensor (or one box of a tensor) stored in a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape as stored in this file.
    pub shape: Vec<u64>,
    /// First byte of the data, counted from the start of the file.
    pub start: u64,
    /// One past the last byte, counted from the start of the file.
    pub end: u64,
    /// Where this box starts in the global tensor, when the format records it (PyTorch
    /// DCP); `None` for formats that store whole tensors or leave the layout to a
    /// strategy file.
    pub offsets: Option<Vec<u64>>,
}

/// A memory-mapped input file of any format, validated: every entry's bytes lie inside
/// the file, match its shape and dtype, and no two entries overlap.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    map: Option<Mapped>,
    format: FileFormat,
    tensors: Vec<TensorEntry>,
    metadata: BTreeMap<String, String>,
    /// The recorded checksum of each tensor, where the file has one.
    checksums: Vec<Option<Checksum>>,
    /// The decoder of a compressed file (then `map` is `None` and entries' `start`/`end`
    /// are offsets in the uncompressed data area).
    chunked: Option<Box<dyn Decoder>>,
    /// The flat element range each entry was cut from, for entries a reader reports as
    /// part of a 1-D slice of a flattened tensor ([`PieceKind::Flat`]); empty when none
    /// is.
    flat: Vec<Option<(u64, u64)>>,
    /// Entries located on first access ([`TensorFile::set_lazy`]); empty when none is.
    lazy: Vec<Option<LazyEntry>>,
    /// Unique within the process: keys the decoded chunks a [`ReadCache`] keeps.
    id: u64,
    /// Bytes read so far of each span read in strided parts, by (tensor, span start)
    /// ([`TensorFile::release_when_read`]).
    strided: std::sync::Mutex<BTreeMap<(usize, u64), u64>>,
}

/// Finds where an entry's bytes lie, given the file's bytes: `(start, end)`.
pub(crate) type Locate = Box<dyn Fn(&[u8]) -> Result<(u64, u64)> + Send + Sync>;

/// An entry whose bytes are located when first read: its reader knows the span of the
/// file that holds them and how to find them there, but finding them means reading
/// bytes that, in an object of a store, the copy reaches only later (a DCP chunk's
/// `torch.save` header lies just before its data). Its [`TensorEntry`]'s `start`/`end`
/// meanwhile are the span's start and the data's length: right for sizes and for
/// ordering reads by position, never for reading.
struct LazyEntry {
    /// The bytes of the file that hold the entry (its header and its data).
    span: (u64, u64),
    locate: Locate,
    /// `(start, end)`, or the problem, once located.
    at: std::sync::OnceLock<std::result::Result<(u64, u64), String>>,
}

impl std::fmt::Debug for LazyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LazyEntry({:?}, {:?})", self.span, self.at.get())
    }
}

pub(crate) use ckptz::Compression;
pub(crate) use detect::{create_writer, sniff};
pub(crate) use writer::{TensorSpec, TensorWriter, WritePart};

/// A format ckpt reads: one row of the detection table ([`detect`]).
pub(crate) trait Reader: Sync {
    /// The format this reader reads.
    fn format(&self) -> FileFormat;
    /// Whether a file whose first bytes (up to 64) are `head` is of this format.
    fn looks_like(&self, head: &[u8]) -> bool;
    /// Parses the file's metadata (never its tensor data) into a [`TensorFile`] that
    /// records where each tensor's bytes are.
    ///
    /// # Errors
    /// Every problem of the file's metadata, naming the file and the tensor.
    fn read(&self, path: &Path, map: Option<Mapped>) -> Result<TensorFile>;
}

/// Where a stored piece lies in its global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PieceKind {
    /// A box of the tensor (whole tensors are the box at the origin).
    Box(Region),
    /// Elements `[start, start + len)` of the tensor flattened in row-major order, as
    /// ZeRO, FSDP1 and Megatron's distributed optimizer store them. Such a range is
    /// stored as several entries, the boxes [`crate::layout::flat`] cuts it into (each
    /// at its `offsets`: what planning reads); every one of them reports the whole
    /// range, the piece's identity in pictures, JSON and coverage messages.
    Flat {
        /// First element, in the flattened tensor.
        start: u64,
        /// Number of elements.
        len: u64,
    },
}

/// How a reader gets the bytes of tensors it stores compressed: chunks of a fixed raw
/// size, each decoded on its own, so that a read decodes only the chunks it covers.
/// Compression is a property of the format's reader: the copy engine reads through
/// [`TensorFile::read`] and [`ReadCache`] and never learns that a file is compressed
/// beyond [`TensorFile::is_compressed`].
pub trait Decoder: Send + Sync + std::fmt::Debug + std::any::Any {
    /// Where bytes `range` of tensor `t` lie: the stream of chunks that holds them and
    /// the range within that stream (a stream may hold several tensors, or one).
    fn locate(&self, t: usize, range: std::ops::Range<u64>) -> (usize, std::ops::Range<u64>);
    /// Raw (decoded) bytes per chunk of stream `s`; the last chunk may be shorter.
    fn chunk_size(&self, s: usize) -> u64;
    /// Decodes chunk `k` of stream `s` into `out` (resized to its raw length); `name`
    /// is the tensor being read, for errors.
    ///
    /// # Errors
    /// A damaged chunk ([`Error::CorruptChunk`] naming `path` and `name`); I/O errors.
    fn decode(&self, path: &Path, name: &str, s: usize, k: usize, out: &mut Vec<u8>) -> Result<()>;
    /// The checksum of tensor `t`'s raw bytes, decoding all of it.
    ///
    /// # Errors
    /// As [`Decoder::decode`].
    fn checksum(&self, path: &Path, name: &str, t: usize) -> Result<Checksum>;
    /// The checksum of tensor `t`'s raw bytes from the chunks decoded so far, when
    /// every one of them has been.
    fn decoded_checksum(&self, t: usize) -> Option<Checksum>;
    /// Bytes of tensor `t` as stored (compressed).
    fn stored_len(&self, t: usize) -> u64;
    /// Whether stream `s`'s raw bytes are read by position ([`Decoder::read_at`])
    /// rather than chunk by chunk: a decoder that keeps a stream decoded whole (an
    /// Orbax chunk read out of order) says so, and reads then take only the bytes they
    /// ask for instead of a whole chunk each.
    fn reads_at(&self, _s: usize) -> bool {
        false
    }
    /// Raw bytes `range` of stream `s` into `out` (its length), where
    /// [`Decoder::reads_at`]; `name` is the tensor being read, for errors.
    ///
    /// # Errors
    /// As [`Decoder::decode`]; a stream not read by position.
    fn read_at(
        &self,
        _name: &str,
        s: usize,
        _range: std::ops::Range<u64>,
        _out: &mut [u8],
    ) -> Result<()> {
        Err(Error::Unsupported {
            problem: format!("stream {s} of this file is read by chunk, not by position"),
        })
    }
    /// The decoder as [`std::any::Any`], for its own format's tests.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Largest slab assembled in memory at once: the copy engine's unit, and the window
/// readers and converters stream in.
pub const SLAB_BYTES: u64 = 4 << 20;

/// The old name of [`ReadCache`].
pub type ChunkCache = ReadCache;

/// Decoded chunks kept for reuse across reads (one per thread): a copy reads the same source chunk
/// for several output slabs (a column-sharded source feeds every row slab of the
/// output), so each thread keeps its last few chunks rather than decompress again.
/// Also holds the buffer a read spanning several chunks is assembled in.
///
/// A cache dropped hands its chunks and buffers to the next one made on the same thread
/// ([`ReadCache::new`]): rayon makes a fresh per-job state each time it splits work, and
/// a cache that started empty each time decoded again chunks its thread had just decoded
/// (about a quarter of them in a 2-thread merge) and allocated and freed 4 MiB buffers
/// over and over, whose unmapping interrupts the other threads to flush their TLBs (in a
/// virtual machine this doubled the kernel time of a merge from `.ckptz`).
#[derive(Debug)]
pub struct ReadCache {
    /// `(file id, stream, chunk, bytes)`, most recently used last.
    entries: Vec<(u64, usize, usize, Vec<u8>)>,
    span: Vec<u8>,
    /// The copy engine's slab buffer, kept here so that it too outlives rayon's
    /// per-job state.
    pub(crate) slab: Vec<u8>,
    /// How many decoded chunks to keep ([`ReadCache::keep`]).
    capacity: usize,
}

thread_local! {
    /// The state of the last [`ReadCache`] dropped on this thread.
    static KEPT: std::cell::RefCell<Option<ReadCache>> = const { std::cell::RefCell::new(None) };
}

impl Default for ReadCache {
    fn default() -> ReadCache {
        ReadCache::new()
    }
}

impl Drop for ReadCache {
    fn drop(&mut self) {
        if self.entries.is_empty() && self.span.capacity() == 0 && self.slab.capacity() == 0 {
            return;
        }
        // The thread's last cache wins. The one it replaces is dropped while the slot is
        // borrowed, so its own drop frees its buffers instead of storing them; during
        // thread teardown the slot is gone and this cache's buffers are simply freed.
        let _ = KEPT.try_with(|k| {
            if let Ok(mut k) = k.try_borrow_mut() {
                let state = ReadCache {
                    entries: std::mem::take(&mut self.entries),
                    span: std::mem::take(&mut self.span),
                    slab: std::mem::take(&mut self.slab),
                    capacity: self.capacity,
                };
                let old = k.replace(state);
                drop(old);
            }
        });
    }
}

/// Chunks a [`ReadCache`] keeps unless told fewer ([`ReadCache::keep`]): 8 covers
/// merging an 8-way sharded tensor slab by slab with each source's chunk still cached
/// (32 MiB per thread at 4 MiB chunks).
pub(crate) const CACHED_CHUNKS: usize = 8;

impl ReadCache {
    /// A cache holding what the last one dropped on this thread held (chunks are keyed by
    /// a file id no other file ever gets, so a stale chunk is never mistaken for
    /// another's), or an empty one.
    #[must_use]
    pub fn new() -> ReadCache {
        KEPT.try_with(|k| k.try_borrow_mut().ok().and_then(|mut k| k.take()))
            .ok()
            .flatten()
            .map(|mut kept| {
                kept.capacity = CACHED_CHUNKS;
                kept
            })
            .unwrap_or(ReadCache {
                entries: Vec::new(),
                span: Vec::new(),
                slab: Vec::new(),
                capacity: CACHED_CHUNKS,
            })
    }

    /// Keeps at most `chunks` decoded chunks (at least one), the least recently used
    /// dropped first: the copy engine sizes the cache by how many chunks its slabs read
    /// at once, since a cache larger than that only holds memory (two threads keeping
    /// eight 4 MiB zarr chunks each were 64 of the 93 MiB a merge of an Orbax save
    /// held, where each slab read two).
    pub fn keep(&mut self, chunks: usize) {
        self.capacity = chunks.max(1);
        let excess = self.entries.len().saturating_sub(self.capacity);
        self.entries.drain(..excess);
    }

    /// The index of chunk `k` of stream `s` of `file` in `entries`, decompressed now if
    /// it was not there (`t`: the tensor being read, for errors).
    fn get(
        &mut self,
        file: &TensorFile,
        chunked: &dyn Decoder,
        t: usize,
        s: usize,
        k: usize,
    ) -> Result<usize> {
        let id = file.id();
        if let Some(i) = self
            .entries
            .iter()
            .position(|e| e.0 == id && e.1 == s && e.2 == k)
        {
            let e = self.entries.remove(i);
            self.entries.push(e);
            return Ok(self.entries.len() - 1);
        }
        let mut buf = if self.entries.len() >= self.capacity {
            self.entries.remove(0).3
        } else {
            Vec::new()
        };
        let name = &file.tensors()[t].name;
        chunked.decode(file.path(), name, s, k, &mut buf)?;
        self.entries.push((id, s, k, buf));
        Ok(self.entries.len() - 1)
    }

    /// Bytes `range` (relative to the tensor, inside it) of tensor `t` of a compressed
    /// file, decompressing only the chunks that cover it.
    pub(crate) fn read<'a>(
        &'a mut self,
        file: &TensorFile,
        chunked: &dyn Decoder,
        t: usize,
        range: std::ops::Range<u64>,
    ) -> Result<&'a [u8]> {
        if range.is_empty() {
            return Ok(&[]);
        }
        let (s, r) = chunked.locate(t, range.clone());
        if chunked.reads_at(s) {
            let mut span = std::mem::take(&mut self.span);
            span.resize((range.end - range.start) as usize, 0);
            let got = chunked.read_at(&file.tensors()[t].name, s, r, &mut span);
            self.span = span;
            got?;
            return Ok(&self.span);
        }
        let cs = chunked.chunk_size(s);
        let (k0, k1) = ((r.start / cs) as usize, ((r.end - 1) / cs) as usize);
        if k0 == k1 {
            let i = self.get(file, chunked, t, s, k0)?;
            let lo = (r.start - k0 as u64 * cs) as usize;
            let hi = (r.end - k0 as u64 * cs) as usize;
            return Ok(&self.entries[i].3[lo..hi]);
        }
        let mut span = std::mem::take(&mut self.span);
        span.resize((range.end - range.start) as usize, 0);
        let r = self.copy_into(file, chunked, t, range, &mut span);
        self.span = span;
        r?;
        Ok(&self.span)
    }

    /// Copies bytes `range` of tensor `t` of a compressed file into `dst` (of the
    /// range's length), chunk by chunk, with no intermediate buffer.
    pub(crate) fn copy_into(
        &mut self,
        file: &TensorFile,
        chunked: &dyn Decoder,
        t: usize,
        range: std::ops::Range<u64>,
        dst: &mut [u8],
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        let (s, range) = chunked.locate(t, range);
        if chunked.reads_at(s) {
            return chunked.read_at(&file.tensors()[t].name, s, range, dst);
        }
        let cs = chunked.chunk_size(s);
        let mut at = 0;
        for k in (range.start / cs) as usize..=((range.end - 1) / cs) as usize {
            let i = self.get(file, chunked, t, s, k)?;
            let base = k as u64 * cs;
            let lo = (range.start.max(base) - base) as usize;
            let hi = (range.end.min(base + cs) - base) as usize;
            dst[at..at + hi - lo].copy_from_slice(&self.entries[i].3[lo..hi]);
            at += hi - lo;
        }
        Ok(())
    }
}

/// A number no other file opened by this process has.
fn next_file_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Number of bytes of a tensor of `dtype` and `shape`, when whole and representable.
pub(crate) fn byte_len(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    let numel = shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b))?;
    let bits = numel.checked_mul(dtype.bitsize() as u64)?;
    (bits % 8 == 0).then_some(bits / 8)
}

fn bad_tensor(tensor: &str, problem: impl Into<String>) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem: problem.into(),
    }
}

/// The entries of a directory, sorted (so discovery is the same on every file system).
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .at(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    v.sort();
    Ok(v)
}

/// A whole input file mapped read-only, with its open handle: readers and the copy
/// engine read the bytes through the mapping, and writers may have the kernel copy long
/// runs of them file to file through the handle (`copy_file_range`), which the mapping
/// alone cannot name. An object of a bucket is mapped the same way, its pages fetched
/// on first touch ([`ckpt_storage::Paged`]), with no handle.
#[derive(Debug)]
pub(crate) struct Mapped {
    map: Backing,
    file: Option<File>,
}

#[derive(Debug)]
enum Backing {
    File(Mmap),
    Remote(ckpt_storage::Paged),
}

impl std::ops::Deref for Mapped {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.map {
            Backing::File(m) => m,
            Backing::Remote(p) => p.bytes(),
        }
    }
}

impl Mapped {
    /// Whether the bytes are an object of a store, paged on demand.
    pub(crate) fn is_remote(&self) -> bool {
        matches!(self.map, Backing::Remote(_))
    }

    /// Drops a local file's pages from the resident set after its header was parsed:
    /// a read of a few bytes maps a whole large folio of the page cache (2 MiB where
    /// the kernel made them, as after `cat` read the file), and a reader's scattered
    /// reads (every zip entry's header) left a third of a 1 GB checkpoint in the RSS
    /// of a process that had copied nothing yet. The pages stay in the page cache; a
    /// later read faults them back. (A remote object's pages are accounted by what the
    /// copy consumes: not touched here.)
    fn forget_pages(&self) {
        if let Backing::File(m) = &self.map {
            crate::fault::forget_mapped(m.as_ptr() as usize, m.len());
        }
    }

    /// Drops bytes `start..end`, consumed, from the resident set: a file's whole pages
    /// inside the range (they come back from the page cache); a remote object's pages
    /// the range touches, its blocks dropped once every page of them has been released
    /// (a neighbour still to be read is fetched again if need be).
    fn release(&self, start: u64, end: u64) {
        match &self.map {
            Backing::File(m) => {
                let page = 4096u64;
                let lo = start.div_ceil(page) * page;
                let hi = (end / page) * page;
                if hi > lo {
                    // SAFETY: the mapping is read-only and file-backed, so dropping its
                    // pages loses nothing: a later access faults them back in from the
                    // page cache. Advice only; failure costs nothing but memory.
                    let _ = unsafe {
                        m.unchecked_advise_range(
                            memmap2::UncheckedAdvice::DontNeed,
                            lo as usize,
                            (hi - lo) as usize,
                        )
                    };
                }
            }
            Backing::Remote(p) => p.release(start..end),
        }
    }
}

/// Maps a whole file read-only (`None` when it is empty) and registers the mapping for
/// the SIGBUS handler. A placeholder of a remote object is demand-paged where the
/// system allows it, else downloaded into place first.
pub(crate) fn map_file(path: &Path) -> Result<Option<Mapped>> {
    if let Some(object) = ckpt_storage::placeholder(path) {
        ckpt_storage::set_fatal_hook(crate::fault::remove_registered_temporaries);
        if let Some(p) = ckpt_storage::Paged::map(&object) {
            return Ok(Some(Mapped {
                map: Backing::Remote(p),
                file: None,
            }));
        }
        ckpt_storage::materialize(path)?;
    }
    let file = File::open(path).at(path)?;
    let len = file.metadata().at(path)?.len();
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: the mapping is read-only; ckpt never writes to its inputs, and a file
    // changed underneath by another program is outside what any reader can defend.
    let map = unsafe { Mmap::map(&file) }.at(path)?;
    crate::fault::register_map(map.as_ptr() as usize, map.len(), path);
    Ok(Some(Mapped {
        map: Backing::File(map),
        file: Some(file),
    }))
}

/// The first `n` bytes of a file (fewer if it is shorter): of a placeholder, one ranged
/// request, not the object.
pub(crate) fn read_head(path: &Path, n: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    if let Some(o) = ckpt_storage::placeholder(path) {
        return Ok(o.get_range(0..n.min(o.size))?.to_vec());
    }
    let mut head = Vec::new();
    File::open(path)
        .at(path)?
        .take(n)
        .read_to_end(&mut head)
        .at(path)?;
    Ok(head)
}

/// A whole small file (a tracker, an index, `.metadata`), downloaded first where it is
/// a placeholder of a larger remote object.
///
/// # Errors
/// The download; the read, as [`Error::Io`] with the path.
pub fn read_small(path: &Path) -> Result<Vec<u8>> {
    ckpt_storage::materialize(path)?;
    std::fs::read(path).at(path)
}

/// A file's length: the object's, where the file is a placeholder of one in a bucket
/// (not yet downloaded: the local file is empty).
///
/// # Errors
/// The file's metadata cannot be read ([`Error::Io`] with the path).
pub(crate) fn file_len(path: &Path) -> Result<u64> {
    if let Some(o) = ckpt_storage::placeholder(path) {
        return Ok(o.size);
    }
    Ok(std::fs::metadata(path).at(path)?.len())
}

/// Downloads a placeholder of an object in a bucket into place (nothing to do for a
/// local file): for readers that read files by plain file reads.
///
/// # Errors
/// The download.
pub(crate) fn download(path: &Path) -> Result<()> {
    Ok(ckpt_storage::materialize(path)?)
}

/// A handle on a file to read with positional reads, downloaded first where it is a
/// placeholder (such reads cannot be paged).
pub(crate) fn open_handle(path: &Path) -> Result<File> {
    ckpt_storage::materialize(path)?;
    File::open(path).at(path)
}

impl TensorFile {
    /// Builds a file from a reader's entries, checking each against the file: bytes
    /// inside it, length equal to shape x dtype, no overlap with another entry.
    ///
    /// # Errors
    /// The first entry at fault, by name.
    pub(crate) fn from_parts(
        path: &Path,
        map: Option<Mapped>,
        format: FileFormat,
        tensors: Vec<TensorEntry>,
        metadata: BTreeMap<String, String>,
    ) -> Result<TensorFile> {
        let len = map.as_ref().map_or(0, |m| m.len() as u64);
        let check = || -> Result<()> {
            for t in &tensors {
                if t.end < t.start || t.end > len {
                    return Err(bad_tensor(
                        &t.name,
                        format!(
                            "bytes [{}, {}) lie outside the file ({len} bytes): truncated?",
                            t.start, t.end
                        ),
                    ));
                }
                let want = byte_len(t.dtype, &t.shape).ok_or_else(|| {
                    overflow(format!(
                        "tensor `{}`: {} x {:?} does not make whole bytes or overflows",
                        t.name,
                        dtype_name(t.dtype),
                        t.shape
                    ))
                })?;
                if t.end - t.start != want {
                    return Err(bad_tensor(
                        &t.name,
                        format!(
                            "{} x {:?} needs {want} bytes but {} are stored",
                            dtype_name(t.dtype),
                            t.shape,
                            t.end - t.start
                        ),
                    ));
                }
                if let Some(o) = &t.offsets {
                    if o.len() != t.shape.len() {
                        return Err(bad_tensor(
                            &t.name,
                            format!("offsets {o:?} do not match shape {:?}", t.shape),
                        ));
                    }
                    for (d, (a, b)) in o.iter().zip(&t.shape).enumerate() {
                        a.checked_add(*b).ok_or_else(|| {
                            overflow(format!(
                                "tensor `{}`: offset {a} + extent {b} of dim {d} wraps",
                                t.name
                            ))
                        })?;
                    }
                }
            }
            // A torch.save archive's tensors are views of storages: two that share one
            // (tied `lm_head.weight` and `embed.weight`, a row of a matrix) overlap by
            // design. The torch reader has checked each view to lie inside its own
            // storage's zip entry, so overlaps there are views, not damage.
            if format == FileFormat::TorchSave {
                return Ok(());
            }
            let mut order: Vec<&TensorEntry> = tensors.iter().filter(|t| t.end > t.start).collect();
            order.sort_by_key(|t| (t.start, t.end));
            for w in order.windows(2) {
                if w[1].start < w[0].end {
                    return Err(bad_tensor(
                        &w[1].name,
                        format!("its bytes overlap those of tensor `{}`", w[0].name),
                    ));
                }
            }
            Ok(())
        };
        check().map_err(|e| e.with_path(path))?;
        if let Some(m) = &map {
            m.forget_pages();
        }
        // An object of a store: the bytes that are not tensor data (headers, archive
        // records, read while parsing) count as consumed, so that a block is dropped
        // once its tensors' bytes have been copied.
        if let Some(m) = map.as_ref().filter(|m| matches!(m.map, Backing::Remote(_))) {
            let mut spans: Vec<(u64, u64)> = tensors.iter().map(|t| (t.start, t.end)).collect();
            spans.sort_unstable();
            let mut at = 0u64;
            for (start, end) in spans {
                if start > at {
                    m.release(at, start);
                }
                at = at.max(end);
            }
            if len > at {
                m.release(at, len);
            }
        }
        Ok(TensorFile {
            path: path.to_path_buf(),
            map,
            format,
            checksums: vec![None; tensors.len()],
            tensors,
            metadata,
            chunked: None,
            flat: Vec::new(),
            lazy: Vec::new(),
            id: next_file_id(),
            strided: Default::default(),
        })
    }

    /// Builds a compressed file from its checked header (the format's reader has
    /// validated every entry and chunk against the file): its bytes come from
    /// `decoder`, never from a mapping.
    pub(crate) fn from_decoder(
        path: &Path,
        format: FileFormat,
        decoder: Box<dyn Decoder>,
        tensors: Vec<TensorEntry>,
        metadata: BTreeMap<String, String>,
    ) -> TensorFile {
        TensorFile {
            path: path.to_path_buf(),
            map: None,
            format,
            checksums: vec![None; tensors.len()],
            tensors,
            metadata,
            chunked: Some(decoder),
            flat: Vec::new(),
            lazy: Vec::new(),
            id: next_file_id(),
            strided: Default::default(),
        }
    }

    /// The decoder, when the file is compressed.
    pub(crate) fn decoder(&self) -> Option<&dyn Decoder> {
        self.chunked.as_deref()
    }

    /// Whether the bytes come from a decoder (compressed chunks) rather than from the
    /// mapping: reads of the same chunks are then best made close together.
    #[must_use]
    pub fn is_compressed(&self) -> bool {
        self.chunked.is_some()
    }

    /// Marks entry `index` (a box, at its offsets) as cut from elements `[start, start
    /// + len)` of its tensor flattened (ZeRO, FSDP1 and Megatron's distributed optimizer
    /// store such pieces): see [`PieceKind::Flat`].
    pub(crate) fn set_flat(&mut self, index: usize, start: u64, len: u64) {
        if self.flat.is_empty() {
            self.flat = vec![None; self.tensors.len()];
        }
        self.flat[index] = Some((start, len));
    }

    /// Makes entry `index` one located on first access: its bytes lie in `span` of the
    /// file, where `locate` finds them (given the file's bytes), and must then be as
    /// long as the entry says. Readers of objects in a store use it for what they can
    /// only find by reading ahead of the copy.
    pub(crate) fn set_lazy(&mut self, index: usize, span: (u64, u64), locate: Locate) {
        if self.lazy.is_empty() {
            self.lazy = (0..self.tensors.len()).map(|_| None).collect();
        }
        self.lazy[index] = Some(LazyEntry {
            span,
            locate,
            at: std::sync::OnceLock::new(),
        });
    }

    /// Where tensor `index`'s bytes lie in the file, located first where it is a lazy
    /// entry (the bytes of its span outside them then count as consumed).
    ///
    /// # Errors
    /// What locating the entry found wrong, naming file and tensor.
    fn bounds(&self, index: usize) -> Result<(u64, u64)> {
        let t = &self.tensors[index];
        let Some(Some(lazy)) = self.lazy.get(index) else {
            return Ok((t.start, t.end));
        };
        let at = lazy.at.get_or_init(|| {
            let all: &[u8] = self.map.as_deref().unwrap_or(&[]);
            let (s, e) = (lazy.locate)(all).map_err(|e| match e {
                Error::InvalidTensor { problem, .. } => problem,
                e => e.to_string(),
            })?;
            let (lo, hi) = lazy.span;
            if s < lo || e > hi || e.checked_sub(s) != Some(t.end - t.start) {
                return Err(format!(
                    "its bytes were found at {s}..{e}, not {} bytes within {lo}..{hi} as the metadata says",
                    t.end - t.start
                ));
            }
            if let Some(m) = &self.map {
                // The header and whatever follows the data: never read by the copy.
                m.release(lo, s);
                m.release(e, hi);
            }
            Ok((s, e))
        });
        at.clone().map_err(|problem| {
            Error::InvalidTensor {
                tensor: t.name.clone(),
                problem,
            }
            .with_path(&self.path)
        })
    }

    /// Locates every entry located on first access ([`TensorFile::set_lazy`]) now: what
    /// is wrong with any of them, each named. (`verify` reads every header.)
    #[must_use]
    pub fn locate_all(&self) -> Vec<Error> {
        self.lazy
            .iter()
            .enumerate()
            .filter(|(_, lazy)| lazy.is_some())
            .filter_map(|(i, _)| self.bounds(i).err())
            .collect()
    }

    /// The piece entry `index` belongs to, as its reader reports it: a box (at the
    /// entry's offsets, or the origin), or the flat element range the entry's box was
    /// cut from. (Planning reads the box: the entry's offsets and shape.)
    #[must_use]
    pub fn piece(&self, index: usize) -> PieceKind {
        if let Some(Some((start, len))) = self.flat.get(index) {
            return PieceKind::Flat {
                start: *start,
                len: *len,
            };
        }
        let t = &self.tensors[index];
        let start = t.offsets.clone().unwrap_or_else(|| vec![0; t.shape.len()]);
        PieceKind::Box(Region::new(start, t.shape.clone()))
    }

    /// Unique within the process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Attaches recorded checksums by tensor name.
    ///
    /// # Errors
    /// A checksum for a tensor the file does not hold.
    /// Records the checksums a reader found ([`checksum::Recorded`]).
    ///
    /// # Errors
    /// As [`TensorFile::set_checksums`].
    pub(crate) fn set_recorded(&mut self, sums: checksum::Recorded) -> Result<()> {
        match sums {
            checksum::Recorded::ByPosition(sums) => {
                debug_assert_eq!(sums.len(), self.checksums.len());
                self.checksums = sums;
                Ok(())
            }
            checksum::Recorded::ByName(sums) => self.set_checksums(&sums),
        }
    }

    pub(crate) fn set_checksums(&mut self, sums: &BTreeMap<String, Checksum>) -> Result<()> {
        // By name through a map: a file may hold a million tensors.
        let index: std::collections::HashMap<&str, usize> = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        for (name, sum) in sums {
            let i = *index
                .get(name.as_str())
                .ok_or_else(|| Error::InvalidHeader {
                    problem: format!(
                        "a checksum is recorded for tensor `{name}`, which the file does not hold"
                    ),
                })?;
            self.checksums[i] = Some(*sum);
        }
        Ok(())
    }

    /// The checksum recorded for tensor `index`, if any.
    #[must_use]
    pub fn checksum(&self, index: usize) -> Option<Checksum> {
        self.checksums[index]
    }

    /// Hashes tensor `index`'s bytes and compares them with the recorded checksum,
    /// releasing the pages as it goes. `Ok(false)` when there is nothing recorded.
    ///
    /// # Errors
    /// [`Error::ChecksumMismatch`] naming file, tensor and both values.
    pub fn check_checksum(&self, index: usize) -> Result<bool> {
        let Some(want) = self.checksums[index] else {
            return Ok(false);
        };
        let got = match (&self.chunked, self.data(index)) {
            (Some(c), _) => c.checksum(&self.path, &self.tensors[index].name, index)?,
            (None, Some(data)) => Checksum::of_chunks(data, &|r| self.release(index, r)),
            (None, None) => return Ok(false),
        };
        self.compare_checksum(index, want, got)
    }

    /// Decodes tensor `index` whole where it is stored encoded (a compressed or chunked
    /// format's [`Decoder`]), dropping the bytes: the decoder checks whatever the
    /// encoding itself records (a zarr `crc32c` codec, a zstd frame's checksum, that
    /// the frame decodes to the tensor's length), so that `verify` reads every stored
    /// chunk of a format that keeps no checksum of its own for ckpt to compare.
    /// `Ok(false)` when the tensor is stored raw (nothing to decode).
    ///
    /// # Errors
    /// The decoder's, naming the file, the tensor and the chunk.
    pub fn check_decodes(&self, index: usize) -> Result<bool> {
        match &self.chunked {
            Some(c) => c
                .checksum(&self.path, &self.tensors[index].name, index)
                .map(|_| true),
            None => Ok(false),
        }
    }

    /// Checks tensor `index`'s recorded checksum against `got`, the checksum of its
    /// bytes as the copy read them; `Ok(false)` when none is recorded.
    ///
    /// # Errors
    /// [`Error::ChecksumMismatch`] naming file, tensor and both values.
    pub(crate) fn check_read_checksum(&self, index: usize, got: Checksum) -> Result<bool> {
        match self.checksums[index] {
            Some(want) => self.compare_checksum(index, want, got),
            None => Ok(false),
        }
    }

    /// `Ok(true)` when `got` is `want`, else the mismatch naming file and tensor.
    fn compare_checksum(&self, index: usize, want: Checksum, got: Checksum) -> Result<bool> {
        if got != want {
            return Err(Error::ChecksumMismatch {
                path: self.path.clone(),
                tensor: self.tensors[index].name.clone(),
                recorded: want.to_string(),
                actual: got.to_string(),
            });
        }
        Ok(true)
    }

    /// [`TensorFile::check_checksum`] after tensor `index` has been read whole: for a
    /// compressed file, from the checksums of its chunks taken as they were
    /// decompressed (no second decompression), when every chunk has been.
    ///
    /// # Errors
    /// [`Error::ChecksumMismatch`] naming file, tensor and both values.
    pub(crate) fn check_checksum_after_read(&self, index: usize) -> Result<bool> {
        let (Some(want), Some(got)) = (
            self.checksums[index],
            self.chunked
                .as_ref()
                .and_then(|c| c.decoded_checksum(index)),
        ) else {
            return self.check_checksum(index);
        };
        self.compare_checksum(index, want, got)
    }

    /// Checks a checksum the format records for the whole file: MindSpore's `crc_num`
    /// (`save_checkpoint(crc_check=True)`: a zlib CRC-32 of every byte before it).
    /// `Ok(false)` when the file records none.
    ///
    /// # Errors
    /// [`Error::Mismatch`] naming the file and both values.
    pub fn check_file_checksum(&self) -> Result<bool> {
        let (Some(want), Some(len)) = (
            self.metadata
                .get("crc_num")
                .and_then(|c| c.parse::<u128>().ok()),
            self.metadata
                .get("crc_bytes")
                .and_then(|c| c.parse::<usize>().ok()),
        ) else {
            return Ok(false);
        };
        let all: &[u8] = self.map.as_deref().unwrap_or(&[]);
        let got = crc32fast::hash(&all[..len.min(all.len())]);
        if u128::from(got) != want {
            return Err(Error::Mismatch {
                what: format!(
                    "{}: checksum mismatch: MindSpore's crc_num records {want}, the bytes give {got} (the file is damaged)",
                    self.path.display()
                ),
            });
        }
        Ok(true)
    }

    /// The path this file was opened from.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's format.
    #[must_use]
    pub fn format(&self) -> FileFormat {
        self.format
    }

    /// The tensors, in the order the format lists them.
    #[must_use]
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }

    /// Free-form metadata of the file (safetensors' `__metadata__`).
    #[must_use]
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The bytes of tensor `index` borrowed from the mapping (no copy); `None` for a
    /// compressed file, whose bytes only [`TensorFile::read`] gives.
    #[must_use]
    pub fn data(&self, index: usize) -> Option<&[u8]> {
        if self.chunked.is_some() {
            return None;
        }
        // (A lazy entry that cannot be located has no bytes: `read` names why.)
        let (start, end) = self.bounds(index).ok()?;
        let bytes: &[u8] = self.map.as_deref().unwrap_or(&[]);
        // In range: checked by `from_parts` (a lazy entry's by `bounds`).
        Some(&bytes[start as usize..end as usize])
    }

    /// Bytes `range` (relative to the tensor) of tensor `index` as a part to write:
    /// borrowed from the mapping, with where they lie in the file for a kernel copy.
    /// `None` for a compressed file or a range outside the tensor.
    pub(crate) fn mapped_part(
        &self,
        index: usize,
        range: std::ops::Range<u64>,
    ) -> Option<WritePart<'_>> {
        let m = self.map.as_ref().filter(|_| self.chunked.is_none())?;
        let (start, end) = self.bounds(index).ok()?;
        if range.start > range.end || range.end > end - start {
            return None;
        }
        // In the file: checked by `from_parts` (a lazy entry's by `bounds`).
        let at = start + range.start;
        Some(WritePart {
            bytes: &m[at as usize..(start + range.end) as usize],
            from: m.file.as_ref().map(|f| (f, at)),
        })
    }

    /// Bytes `range` (relative to the tensor) of tensor `index`, whatever the file
    /// stores: borrowed from the mapping for plain files, decompressed (only the chunks
    /// covering the range, kept in `cache` for the next reads) for compressed ones.
    ///
    /// # Errors
    /// A range outside the tensor; a damaged chunk ([`Error::CorruptChunk`]); I/O errors.
    pub fn read<'a>(
        &'a self,
        index: usize,
        range: std::ops::Range<u64>,
        cache: &'a mut ReadCache,
    ) -> Result<&'a [u8]> {
        self.check_range(index, &range)?;
        match &self.chunked {
            Some(c) => cache.read(self, c.as_ref(), index, range),
            None => {
                let (start, _) = self.bounds(index)?;
                let bytes: &[u8] = self.map.as_deref().unwrap_or(&[]);
                // In range: checked above and by `from_parts` (a lazy entry's by
                // `bounds`).
                Ok(&bytes[(start + range.start) as usize..(start + range.end) as usize])
            }
        }
    }

    /// Copies bytes `range` (relative to the tensor) of tensor `index` into `dst`:
    /// [`TensorFile::read`] without the intermediate buffer that a range over several
    /// compressed chunks needs.
    ///
    /// # Errors
    /// As [`TensorFile::read`]; a `dst` of another length than the range.
    pub fn read_into(
        &self,
        index: usize,
        range: std::ops::Range<u64>,
        dst: &mut [u8],
        cache: &mut ReadCache,
    ) -> Result<()> {
        self.check_range(index, &range)?;
        if range.end - range.start != dst.len() as u64 {
            return Err(overflow(format!(
                "{}: {} bytes of tensor `{}` read into a buffer of {}",
                self.path.display(),
                range.end - range.start,
                self.tensors[index].name,
                dst.len()
            )));
        }
        match &self.chunked {
            Some(c) => cache.copy_into(self, c.as_ref(), index, range, dst),
            None => {
                dst.copy_from_slice(self.read(index, range, cache)?);
                Ok(())
            }
        }
    }

    /// A range inside tensor `index`, or the error naming it.
    fn check_range(&self, index: usize, range: &std::ops::Range<u64>) -> Result<()> {
        let t = &self.tensors[index];
        if range.start > range.end || range.end > t.end - t.start {
            return Err(overflow(format!(
                "{}: bytes [{}, {}) of tensor `{}` asked, it has {}",
                self.path.display(),
                range.start,
                range.end,
                t.name,
                t.end - t.start
            )));
        }
        Ok(())
    }

    /// Drops the mapping's pages of tensor `index` in `range` (relative to the tensor)
    /// from this process's resident set (the page cache keeps them): keeps RSS bounded
    /// while streaming.
    pub fn release(&self, index: usize, range: std::ops::Range<u64>) {
        let Some(m) = &self.map else { return };
        let t = &self.tensors[index];
        match self.lazy.get(index) {
            Some(Some(lazy)) => match lazy.at.get() {
                Some(Ok((start, _))) => m.release(start + range.start, start + range.end),
                // Not located (or not locatable): released only as a whole, with
                // its header, when none of it is to be read.
                _ if range.start == 0 && range.end >= t.end - t.start => {
                    m.release(lazy.span.0, lazy.span.1);
                }
                _ => {}
            },
            _ => m.release(t.start + range.start, t.start + range.end),
        }
    }

    /// [`TensorFile::release`] of bytes `span` of tensor `index` once `bytes` of them
    /// have been read, counted over calls: for a span read in strided parts (a
    /// transposed view's slabs each read a column of every row of it), whose pages
    /// every part touches, so that releasing them part by part would drop the pages
    /// the next part reads (from a bucket: fetch them again).
    pub fn release_when_read(
        &self,
        index: usize,
        span: std::ops::Range<u64>,
        bytes: u64,
        read: u64,
    ) {
        let done = {
            let mut strided = self.strided.lock().unwrap_or_else(|e| e.into_inner());
            let key = (index, span.start);
            let total = strided.entry(key).or_insert(0);
            *total += read;
            let done = *total >= bytes;
            if done {
                strided.remove(&key);
            }
            done
        };
        if done {
            self.release(index, span);
        }
    }

    /// Whether the bytes come from an object of a store, paged on demand: the local
    /// file at [`TensorFile::path`] is then an empty placeholder that no other program
    /// may map or read in its place.
    #[must_use]
    pub fn is_remote(&self) -> bool {
        matches!(self.map.as_ref().map(|m| &m.map), Some(Backing::Remote(_)))
    }

    /// Index of the tensor called `name`.
    #[must_use]
    pub fn find(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    /// Total bytes of tensor data in the file.
    #[must_use]
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.end - t.start).sum()
    }
}

impl TensorFile {
    /// Leaves the entries' memory to the process's exit ([`crate::Checkpoint::drop_at_exit`]).
    pub(crate) fn forget_entries(&mut self) {
        std::mem::forget(std::mem::take(&mut self.tensors));
        std::mem::forget(std::mem::take(&mut self.metadata));
    }
}

impl Drop for TensorFile {
    fn drop(&mut self) {
        if let Some(m) = &self.map {
            crate::fault::unregister_map(m.as_ptr() as usize);
        }
    }
}

/// Files opened at most this many at a time ([`open_abreast`]).
const OPENED_ABREAST: usize = 16;

/// `open` of each item, in their order, on up to [`OPENED_ABREAST`] threads at once.
/// Opening a file reads its header; from a bucket that is a request whose answer takes
/// the server a read of the object (about 0.1 s for 55 MB against moto), and eight
/// DCP safetensors shards opened one after the other took 1.1 s before the copy began.
/// The threads mostly wait on the network (a local header is parsed in microseconds).
pub(crate) fn open_abreast<I: Sync, T: Send>(items: &[I], open: impl Fn(&I) -> T + Sync) -> Vec<T> {
    let threads = items.len().min(OPENED_ABREAST);
    if threads <= 1 {
        return items.iter().map(open).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, T)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        mine.push((i, open(item)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, t)| t).collect()
}
