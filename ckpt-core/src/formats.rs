//! One home for the file formats ckpt reads: each turns a file into a [`TensorFile`],
//! the same description whatever the format (tensors, dtypes, shapes as stored, where
//! their bytes lie in the file, and where each box lies in the global tensor when the
//! format records it). The planner and the copy engine see only `TensorFile`s.
//!
//! A format is a module with a `read(path, map)` that parses metadata only and records
//! byte ranges (never copies tensor data), a [`FileFormat`] variant, and a branch in
//! [`sniff`], which decides by content, not by the file's name.

pub(crate) mod checksum;
pub(crate) mod ckptz;
pub(crate) mod distcp;
pub(crate) mod mindspore_ckpt;
pub(crate) mod mindspore_strategy;
pub(crate) mod output;
pub(crate) mod pickle;
pub(crate) mod safetensors;
pub(crate) mod torch_save;
pub(crate) mod torch_write;

use crate::checksum::Checksum;
use crate::error::{overflow, Error, IoContext, Result};
use crate::strategy::dtype_name;
use crate::Dtype;
pub use ckptz::ChunkCache;
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
    map: Option<Mmap>,
    format: FileFormat,
    tensors: Vec<TensorEntry>,
    metadata: BTreeMap<String, String>,
    /// The recorded checksum of each tensor, where the file has one.
    checksums: Vec<Option<Checksum>>,
    /// The chunk tables of a compressed file (then `map` is `None` and entries'
    /// `start`/`end` are offsets in the uncompressed data area).
    chunked: Option<ckptz::Chunked>,
    /// Unique within the process: keys the decompressed chunks a [`ChunkCache`] keeps.
    id: u64,
}

/// A number no other file opened by this process has.
fn next_file_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Decides a file's format from its first bytes.
#[must_use]
pub fn sniff(head: &[u8]) -> Option<FileFormat> {
    // First: the magic's 9th byte (the low byte of the header length) may be `{`.
    if ckptz::looks_like(head) {
        return Some(FileFormat::Ckptz);
    }
    if safetensors::looks_like(head) {
        return Some(FileFormat::Safetensors);
    }
    if mindspore_ckpt::looks_like(head) {
        return Some(FileFormat::MindSporeCkpt);
    }
    if torch_save::looks_like(head) {
        return Some(FileFormat::TorchSave);
    }
    None
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

/// Maps a whole file read-only (`None` when it is empty) and registers the mapping for
/// the SIGBUS handler.
pub(crate) fn map_file(path: &Path) -> Result<Option<Mmap>> {
    let file = File::open(path).at(path)?;
    let len = file.metadata().at(path)?.len();
    // SAFETY: the mapping is read-only; ckpt never writes to its inputs, and a file
    // changed underneath by another program is outside what any reader can defend.
    let map = if len == 0 {
        None
    } else {
        Some(unsafe { Mmap::map(&file) }.at(path)?)
    };
    if let Some(m) = &map {
        crate::fault::register_map(m.as_ptr() as usize, m.len(), path);
    }
    Ok(map)
}

impl TensorFile {
    /// Opens and maps a file, finds its format from its content and reads its metadata.
    /// Errors carry the path.
    ///
    /// # Errors
    /// I/O errors, a format ckpt does not read, and every problem of the file's metadata.
    pub fn open(path: &Path) -> Result<TensorFile> {
        if path.extension().is_some_and(|e| e == "distcp") {
            // Its chunks are found through the directory's `.metadata`.
            let dir = path.parent().unwrap_or(Path::new("."));
            return distcp::read_metadata(dir)?.open(path);
        }
        let map = map_file(path)?;
        let head: &[u8] = map.as_deref().unwrap_or(&[]);
        let head = &head[..head.len().min(64)];
        // An empty protobuf is an empty MindSpore checkpoint (a rank that holds
        // nothing): only the name can tell.
        let empty_ckpt = head.is_empty() && path.extension().is_some_and(|e| e == "ckpt");
        match sniff(head).or(empty_ckpt.then_some(FileFormat::MindSporeCkpt)) {
            Some(FileFormat::Safetensors) => safetensors::read(path, map),
            Some(FileFormat::MindSporeCkpt) => mindspore_ckpt::read(path, map),
            Some(FileFormat::TorchSave) => torch_save::read(path, map),
            Some(FileFormat::Ckptz) => ckptz::read(path, File::open(path).at(path)?, map),
            Some(FileFormat::Distcp) => unreachable!("sniff never says distcp"),
            None if torch_save::looks_like_legacy(head) => Err(Error::InvalidTorch {
                problem: format!(
                    "{}: the legacy torch.save format (before torch 1.6, or _use_new_zipfile_serialization=False) is not read; save it again with a current torch",
                    path.display()
                ),
            }),
            None => Err(Error::UnknownInput {
                problem: format!(
                    "{}: not a checkpoint file ckpt reads ({}; expected safetensors, a MindSpore .ckpt or a torch.save file; encrypted MindSpore checkpoints are not supported)",
                    path.display(),
                    describe_head(head)
                ),
            }),
        }
    }

    /// Builds a file from a reader's entries, checking each against the file: bytes
    /// inside it, length equal to shape x dtype, no overlap with another entry.
    ///
    /// # Errors
    /// The first entry at fault, by name.
    pub(crate) fn from_parts(
        path: &Path,
        map: Option<Mmap>,
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
        Ok(TensorFile {
            path: path.to_path_buf(),
            map,
            format,
            checksums: vec![None; tensors.len()],
            tensors,
            metadata,
            chunked: None,
            id: next_file_id(),
        })
    }

    /// Builds a compressed file from its checked header (`ckptz::parse_header` has
    /// validated every entry and chunk against the file).
    pub(crate) fn from_chunked(
        path: &Path,
        chunked: ckptz::Chunked,
        tensors: Vec<TensorEntry>,
        metadata: BTreeMap<String, String>,
    ) -> TensorFile {
        TensorFile {
            path: path.to_path_buf(),
            map: None,
            format: FileFormat::Ckptz,
            checksums: vec![None; tensors.len()],
            tensors,
            metadata,
            chunked: Some(chunked),
            id: next_file_id(),
        }
    }

    /// The chunk tables, when the file is compressed.
    pub(crate) fn chunked(&self) -> Option<&ckptz::Chunked> {
        self.chunked.as_ref()
    }

    /// Unique within the process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Attaches recorded checksums by tensor name.
    ///
    /// # Errors
    /// A checksum for a tensor the file does not hold.
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
        let t = &self.tensors[index];
        let bytes: &[u8] = self.map.as_deref().unwrap_or(&[]);
        // In range: checked by `from_parts`.
        Some(&bytes[t.start as usize..t.end as usize])
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
        cache: &'a mut ChunkCache,
    ) -> Result<&'a [u8]> {
        self.check_range(index, &range)?;
        let t = &self.tensors[index];
        match &self.chunked {
            Some(c) => cache.read(self, c, index, range),
            None => {
                let bytes: &[u8] = self.map.as_deref().unwrap_or(&[]);
                // In range: checked above and by `from_parts`.
                Ok(&bytes[(t.start + range.start) as usize..(t.start + range.end) as usize])
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
        cache: &mut ChunkCache,
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
            Some(c) => cache.copy_into(self, c, index, range, dst),
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
        if let Some(m) = &self.map {
            let t = &self.tensors[index];
            let page = 4096u64;
            let lo = (t.start + range.start).div_ceil(page) * page;
            let hi = ((t.start + range.end) / page) * page;
            if hi > lo {
                // SAFETY: the mapping is read-only and file-backed, so dropping its pages
                // loses nothing: a later access faults them back in from the page cache.
                // Advice only; failure costs nothing but memory.
                let _ = unsafe {
                    m.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        lo as usize,
                        (hi - lo) as usize,
                    )
                };
            }
        }
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

impl Drop for TensorFile {
    fn drop(&mut self) {
        if let Some(m) = &self.map {
            crate::fault::unregister_map(m.as_ptr() as usize);
        }
    }
}

/// A file being written, in the format its name asks for: `*.ckpt` MindSpore's,
/// `*.pth`/`*.pt`/`*.bin` a torch.save archive, `*.distcp` DCP's (one torch.save archive
/// per tensor), anything else safetensors; compressed `.ckptz` when a compression is
/// given. The copy engine writes through this and knows no format.
#[derive(Debug)]
pub(crate) enum FileWriter {
    Safetensors(safetensors::SafetensorsWriter),
    MindSpore(mindspore_ckpt::MindSporeWriter),
    Compressed(ckptz::CkptzWriter),
    Torch(torch_write::TorchWriter),
}

impl FileWriter {
    pub(crate) fn create(
        dest: &Path,
        tensors: &[safetensors::TensorSpec],
        metadata: &BTreeMap<String, String>,
        compression: Option<ckptz::Compression>,
    ) -> Result<FileWriter> {
        if let Some(c) = compression {
            return Ok(FileWriter::Compressed(ckptz::CkptzWriter::create(
                dest, tensors, metadata, c,
            )?));
        }
        let ext = dest.extension().and_then(|e| e.to_str()).unwrap_or("");
        Ok(if ext == "ckpt" {
            FileWriter::MindSpore(mindspore_ckpt::MindSporeWriter::create(dest, tensors)?)
        } else if matches!(ext, "pth" | "pt" | "bin" | "distcp") {
            FileWriter::Torch(torch_write::TorchWriter::create(
                dest,
                tensors,
                ext == "distcp",
            )?)
        } else {
            FileWriter::Safetensors(safetensors::SafetensorsWriter::create(
                dest, tensors, metadata,
            )?)
        })
    }

    pub(crate) fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        match self {
            FileWriter::Safetensors(w) => w.write_at(index, offset, bytes),
            FileWriter::MindSpore(w) => w.write_at(index, offset, bytes),
            FileWriter::Compressed(w) => w.write_at(index, offset, bytes),
            FileWriter::Torch(w) => w.write_at(index, offset, bytes),
        }
    }

    pub(crate) fn finish(self) -> Result<()> {
        match self {
            FileWriter::Safetensors(w) => w.finish(),
            FileWriter::MindSpore(w) => w.finish(),
            FileWriter::Compressed(w) => w.finish(),
            FileWriter::Torch(w) => w.finish(),
        }
    }
}

/// A few words on what the first bytes of an unknown file look like.
fn describe_head(head: &[u8]) -> String {
    if head.is_empty() {
        return "the file is empty".into();
    }
    if head.starts_with(b"PK\x03\x04") {
        return "a zip archive".into();
    }
    let shown: Vec<String> = head.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("it starts with bytes {}", shown.join(" "))
}
