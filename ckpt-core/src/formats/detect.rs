//! The detection table: which format a path is, for reading (by content: magic bytes
//! and headers, the extension only where content cannot tell) and for writing (by the
//! output's name). The only place that names every format; a format unknown or
//! ambiguous to it is refused here, the same way for all.
//!
//! Adding a format is one row in [`READERS`] (and one branch in [`create_writer`] if
//! ckpt writes it; one row in [`discover`]'s directory table if it is a directory of
//! files): see docs/architecture.md.

pub(crate) mod discover;
pub(crate) mod trainers;

/// Every directory under the committed fixtures (`tests/fixtures`), for the tests that
/// offer each to the discovery tables.
#[cfg(test)]
pub(crate) fn fixture_dirs() -> Vec<std::path::PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        out.push(dir.to_path_buf());
        for p in super::list_dir(dir).unwrap() {
            if p.is_dir() {
                walk(&p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"),
        &mut out,
    );
    out
}

use super::writer::{TensorSpec, TensorWriter};
use super::{
    ckptz, distcp, gguf, map_file, mindspore_ckpt, orbax, safetensors, torch_save, torch_write,
    FileFormat, Mapped, Reader, TensorFile,
};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// A row of the table: a format and its reader's two functions.
struct Row {
    format: FileFormat,
    looks_like: fn(&[u8]) -> bool,
    read: fn(&Path, Option<Mapped>) -> Result<TensorFile>,
}

impl Reader for Row {
    fn format(&self) -> FileFormat {
        self.format
    }

    fn looks_like(&self, head: &[u8]) -> bool {
        (self.looks_like)(head)
    }

    fn read(&self, path: &Path, map: Option<Mapped>) -> Result<TensorFile> {
        (self.read)(path, map)
    }
}

/// The formats read from a file's first bytes, tried in this order.
/// (DCP's `.distcp` files are found through their directory's `.metadata`, not here.)
static READERS: [Row; 5] = [
    // First: the magic's 9th byte (the low byte of the header length) may be `{`.
    Row {
        format: FileFormat::Ckptz,
        looks_like: ckptz::looks_like,
        read: read_ckptz,
    },
    Row {
        format: FileFormat::Safetensors,
        looks_like: safetensors::looks_like,
        read: safetensors::read,
    },
    Row {
        format: FileFormat::MindSporeCkpt,
        looks_like: mindspore_ckpt::looks_like,
        read: mindspore_ckpt::read,
    },
    Row {
        format: FileFormat::TorchSave,
        looks_like: torch_save::looks_like,
        read: torch_save::read,
    },
    Row {
        format: FileFormat::Gguf,
        looks_like: gguf::looks_like,
        read: gguf::read,
    },
];

/// `.ckptz` reads its chunks with positional reads on its own handle.
fn read_ckptz(path: &Path, map: Option<Mapped>) -> Result<TensorFile> {
    ckptz::read(path, super::open_handle(path)?, map)
}

/// The reader of a file starting with `head`, if one recognises it.
fn reader_of(head: &[u8]) -> Option<&'static dyn Reader> {
    READERS
        .iter()
        .find(|r| r.looks_like(head))
        .map(|r| r as &dyn Reader)
}

/// Decides a file's format from its first bytes.
#[must_use]
pub fn sniff(head: &[u8]) -> Option<FileFormat> {
    reader_of(head).map(Reader::format)
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
        let reader = reader_of(head).or_else(|| {
            empty_ckpt
                .then(|| {
                    READERS
                        .iter()
                        .find(|r| r.format == FileFormat::MindSporeCkpt)
                })
                .flatten()
                .map(|r| r as &dyn Reader)
        });
        match reader {
            Some(r) => r.read(path, map),
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

/// The writer for an output file, in the format its name asks for: `*.gguf` GGUF,
/// `*.ckpt`
/// MindSpore's, `*.pth`/`*.pt`/`*.bin` a torch.save archive, `*.distcp` DCP's (one
/// torch.save archive per tensor), anything else safetensors; compressed `.ckptz` when
/// a compression is given (compression is a property of the writer, not a case of the
/// engine).
///
/// # Errors
/// I/O errors, with the path; tensors the format cannot hold.
pub fn create_writer(
    dest: &Path,
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
    compression: Option<ckptz::Compression>,
) -> Result<Box<dyn TensorWriter>> {
    if let Some(c) = compression {
        return Ok(Box::new(ckptz::CkptzWriter::create(
            dest, tensors, metadata, c,
        )?));
    }
    let ext = dest.extension().and_then(|e| e.to_str()).unwrap_or("");
    Ok(if ext == "ocdbt" {
        // An Orbax item's `manifest.ocdbt`: the database of zarr arrays around it.
        Box::new(orbax::encode::OrbaxArraysWriter::create(
            dest,
            tensors,
            metadata,
            orbax::encode::max_chunk_bytes(),
        )?)
    } else if ext == "gguf" {
        Box::new(gguf::GgufWriter::create(dest, tensors, metadata)?)
    } else if ext == "ckpt" {
        Box::new(mindspore_ckpt::MindSporeWriter::create(dest, tensors)?)
    } else if matches!(ext, "pth" | "pt" | "bin" | "distcp") {
        let wrap = torch_write::Wrap::from_metadata(metadata)?;
        let bare = ext == "distcp" || wrap.as_ref().is_some_and(|w| w.flat);
        let tensors =
            torch_write::with_stored_shapes(tensors, metadata).map_err(|e| e.with_path(dest))?;
        Box::new(torch_write::TorchWriter::create_wrapped(
            dest,
            &tensors,
            bare,
            wrap.as_ref(),
        )?)
    } else {
        Box::new(safetensors::SafetensorsWriter::create(
            dest, tensors, metadata,
        )?)
    })
}
