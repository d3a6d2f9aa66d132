//! Whole-checkpoint conversion between safetensors and compressed `.ckptz` files
//! (`ckpt compress`, `ckpt decompress`): every tensor file is rewritten with the same
//! tensors in the same order and the same metadata, every other file (strategy,
//! config, `latest`) is copied byte for byte, and an index's file names follow.
//!
//! Decompressing what was compressed gives back a file ckpt wrote byte for byte: the
//! header is laid out by the same code from the same tensor order and metadata.

use crate::checkpoint::{COMPRESSED_INDEX_FILE, INDEX_FILE};
use crate::error::{Error, IoContext, Result};
use crate::formats::checksum::CHECKSUMS_KEY;
// The conversion to and from `.ckptz` itself: the one engine module that names a
// format (docs/architecture.md).
use crate::formats::ckptz::{CkptzWriter, Compression, EXTENSION};
use crate::formats::output::{check_output_outside_inputs, write_file_atomic, StagedDir};
use crate::formats::{
    create_writer, FileFormat, ReadCache, TensorFile, TensorSpec, TensorWriter, SLAB_BYTES,
};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// Which way to convert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    /// safetensors to `.ckptz`.
    Compress(Compression),
    /// `.ckptz` to safetensors.
    Decompress,
}

impl Conversion {
    /// The format converted from, and the extensions of the files read and written.
    fn from(self) -> (FileFormat, &'static str, &'static str) {
        match self {
            Conversion::Compress(_) => (FileFormat::Safetensors, "safetensors", EXTENSION),
            Conversion::Decompress => (FileFormat::Ckptz, EXTENSION, "safetensors"),
        }
    }
}

/// What a conversion did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConvertStats {
    /// Tensor files converted.
    pub files: u64,
    /// Other files copied.
    pub copied: u64,
    /// Uncompressed tensor bytes.
    pub raw_bytes: u64,
    /// Size of the tensor files read.
    pub bytes_in: u64,
    /// Size of the tensor files written.
    pub bytes_out: u64,
}

/// Converts `src` (one file, or a checkpoint directory and everything under it) into
/// `out`, which appears complete or not at all.
///
/// # Errors
/// A file of the wrong format, a directory with nothing to convert, an existing output
/// without `force`, a damaged input (checksums are checked), I/O errors.
pub fn convert(src: &Path, out: &Path, how: Conversion, force: bool) -> Result<ConvertStats> {
    check_output_outside_inputs(out, &[src.to_path_buf()])?;
    let mut stats = ConvertStats::default();
    if src.is_file() {
        if out.exists() && !force {
            return Err(Error::OutputExists {
                path: out.to_path_buf(),
            });
        }
        convert_file(src, out, how, &mut stats)?;
        return Ok(stats);
    }
    if !src.is_dir() {
        return Err(Error::UnknownInput {
            problem: format!("{}: no such file or directory", src.display()),
        });
    }
    let staged = StagedDir::new(out, force)?;
    convert_dir(src, staged.path(), how, &mut stats)?;
    if stats.files == 0 {
        let (format, ext, _) = how.from();
        return Err(Error::UnknownInput {
            problem: format!(
                "{}: no {} files (*.{ext}) to convert",
                src.display(),
                format.name()
            ),
        });
    }
    staged.commit()?;
    Ok(stats)
}

fn convert_dir(src: &Path, out: &Path, how: Conversion, stats: &mut ConvertStats) -> Result<()> {
    let (_, from_ext, to_ext) = how.from();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(src)
        .at(src)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        let Some(name) = p.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
            continue;
        };
        // Leftovers of killed runs are not part of the checkpoint.
        if name.starts_with('.') && (name.contains(".tmp-") || name.contains(".old-")) {
            continue;
        }
        if p.is_dir() {
            let d = out.join(&name);
            std::fs::create_dir_all(&d).at(&d)?;
            convert_dir(&p, &d, how, stats)?;
        } else if p.extension().is_some_and(|e| e == from_ext) {
            convert_file(&p, &out.join(&name).with_extension(to_ext), how, stats)?;
        } else if let Some(index) = index_name(&name, how) {
            let text = String::from_utf8_lossy(&crate::formats::read_small(&p)?).into_owned();
            write_file_atomic(&out.join(index), renamed_index(&text, &p, how)?.as_bytes())?;
            stats.copied += 1;
        } else {
            let bytes = crate::formats::read_small(&p)?;
            write_file_atomic(&out.join(&name), &bytes)?;
            stats.copied += 1;
        }
    }
    Ok(())
}

/// The name of the converted index, when `name` is the index of the side read.
fn index_name(name: &str, how: Conversion) -> Option<&'static str> {
    match how {
        Conversion::Compress(_) if name == INDEX_FILE => Some(COMPRESSED_INDEX_FILE),
        Conversion::Decompress if name == COMPRESSED_INDEX_FILE => Some(INDEX_FILE),
        _ => None,
    }
}

/// An index with every file name of its `weight_map` given the converted extension
/// (the rest of the document as it was).
fn renamed_index(text: &str, path: &Path, how: Conversion) -> Result<String> {
    let (_, _, to_ext) = how.from();
    let bad = |problem: String| Error::UnknownInput {
        problem: format!("{}: {problem}", path.display()),
    };
    let mut doc: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = doc
        .get_mut("weight_map")
        .and_then(|m| m.as_object_mut())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    for v in map.values_mut() {
        if let Some(f) = v.as_str() {
            *v = Path::new(f)
                .with_extension(to_ext)
                .display()
                .to_string()
                .into();
        }
    }
    Ok(serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n")
}

/// Rewrites one tensor file: same tensors in the same stored order, same metadata
/// (checksums recomputed over the bytes written, then compared with the source's).
fn convert_file(src: &Path, dest: &Path, how: Conversion, stats: &mut ConvertStats) -> Result<()> {
    let f = TensorFile::open(src)?;
    let (format, _, _) = how.from();
    if f.format() != format {
        return Err(Error::UnknownInput {
            problem: format!(
                "{}: a {} file, not {} ({})",
                src.display(),
                f.format().name(),
                format.name(),
                match how {
                    Conversion::Compress(_) => "compress reads safetensors",
                    Conversion::Decompress => "decompress reads .ckptz",
                }
            ),
        });
    }
    // The stored order, so that the output's layout is the input's.
    let mut order: Vec<usize> = (0..f.tensors().len()).collect();
    order.sort_by_key(|&i| (f.tensors()[i].start, f.tensors()[i].end));
    let specs: Vec<TensorSpec> = order
        .iter()
        .map(|&i| {
            let t = &f.tensors()[i];
            TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            }
        })
        .collect();
    let mut metadata = f.metadata().clone();
    metadata.remove(CHECKSUMS_KEY);
    let compression = match how {
        Conversion::Compress(c) => Some(c),
        Conversion::Decompress => None,
    };
    if let (Conversion::Decompress, Some(header)) = (how, f.source_header()) {
        // The file `ckpt compress` read, byte for byte (header included).
        crate::formats::ckptz::v2::write_source(&f, header, dest)?;
        return finish_file(src, dest, &f, stats);
    }
    let writer: Box<dyn TensorWriter> = match compression {
        // Keeps the source's header text, so that decompressing gives it back; not
        // when it is the header ckpt writes for these tensors and metadata (a file
        // ckpt wrote), which decompressing writes again anyway.
        Some(c) => {
            let text = safetensors_header(src)?;
            let ours = crate::formats::safetensors::encode_header(&specs, f.metadata())
                .ok()
                .filter(|_| crate::formats::checksum::checksums_enabled());
            let same = ours.is_some_and(|(h, _)| h.get(8..) == Some(text.as_bytes()));
            Box::new(CkptzWriter::create_with_source(
                dest,
                &specs,
                &metadata,
                c,
                (!same).then_some(text),
            )?)
        }
        None => create_writer(dest, &specs, &metadata, None)?,
    };
    let mut jobs = Vec::new();
    for (j, &i) in order.iter().enumerate() {
        let t = &f.tensors()[i];
        let len = t.end - t.start;
        let mut pos = 0;
        while pos < len {
            let end = (pos + SLAB_BYTES).min(len);
            jobs.push((j, i, pos..end));
            pos = end;
        }
    }
    jobs.par_iter()
        .try_for_each_init(ReadCache::new, |cache, (j, i, range)| {
            let bytes = f.read(*i, range.clone(), cache)?;
            let r = writer.write_at(*j, range.start, bytes);
            f.release(*i, range.clone());
            r
        })?;
    writer.finish()?;
    finish_file(src, dest, &f, stats)
}

/// The header text of a safetensors file (after its 8-byte length), as it is.
fn safetensors_header(src: &Path) -> Result<String> {
    use std::io::Read;
    let mut file = crate::formats::open_handle(src)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).at(src)?;
    // The file was opened and checked as safetensors: the length is within the limit.
    let n = u64::from_le_bytes(len).min(crate::formats::safetensors::MAX_HEADER_LEN);
    let mut text = vec![0; n as usize];
    file.read_exact(&mut text).at(src)?;
    String::from_utf8(text).map_err(|e| Error::UnknownInput {
        problem: format!("{}: header is not UTF-8: {e}", src.display()),
    })
}

/// Checks a converted file's checksums against the source's and counts it.
fn finish_file(src: &Path, dest: &Path, f: &TensorFile, stats: &mut ConvertStats) -> Result<()> {
    // The output's checksums are those of the bytes read: they must be the ones the
    // source recorded, or the source was damaged (and so is the copy: remove it).
    let written = TensorFile::open(dest)?;
    for (i, t) in f.tensors().iter().enumerate() {
        let (Some(want), Some(got)) = (
            f.checksum(i),
            written.find(&t.name).and_then(|k| written.checksum(k)),
        ) else {
            continue;
        };
        if want != got {
            let _ = std::fs::remove_file(dest);
            return Err(Error::ChecksumMismatch {
                path: src.to_path_buf(),
                tensor: t.name.clone(),
                recorded: want.to_string(),
                actual: got.to_string(),
            });
        }
    }
    stats.files += 1;
    stats.raw_bytes += f.tensor_bytes();
    stats.bytes_in += std::fs::metadata(src).at(src)?.len();
    stats.bytes_out += std::fs::metadata(dest).at(dest)?.len();
    Ok(())
}
