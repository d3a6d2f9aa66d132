//! Saving and loading from a training program's memory: one rank's file, a whole
//! integrated checkpoint, and one rank's tensors loaded from any checkpoint.

use crate::checkpoint::{Checkpoint, COMPRESSED_MODEL_FILE, MODEL_FILE, STRATEGY_FILE};
use crate::engine::copy::assemble;
use crate::error::{Error, IoContext, Result};
use crate::formats::output::write_file_atomic;
use crate::formats::{byte_len, create_writer, Compression, TensorSpec};
use crate::layout::plan::{rank_metadata, rank_tensors, CopyPlan, TargetFile};
use crate::layout::strategy::Strategy;
use crate::layout::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor held in memory: dtype, shape and little-endian bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Row-major little-endian bytes.
    pub data: Vec<u8>,
}

/// Writes rank `rank`'s file of a sliced checkpoint: `dir/ckpt_<rank>/model.safetensors`
/// and `strategy.json`, each atomically. `tensors` are the rank's local tensors; those the
/// rank does not own (replicated data held by a lower rank) are left out unless
/// `keep_all`.
///
/// # Errors
/// A tensor not in the strategy or of the wrong size; I/O errors.
pub fn write_rank(
    dir: &Path,
    strategy: &Strategy,
    rank: u64,
    tensors: &[(&str, &[u8])],
    keep_all: bool,
) -> Result<PathBuf> {
    write_rank_with(dir, strategy, rank, tensors, keep_all, None)
}

/// [`write_rank`], compressed (`ckpt_<rank>/model.ckptz`) when `compression` is given.
///
/// # Errors
/// A tensor not in the strategy or of the wrong size; I/O errors.
pub fn write_rank_with(
    dir: &Path,
    strategy: &Strategy,
    rank: u64,
    tensors: &[(&str, &[u8])],
    keep_all: bool,
    compression: Option<Compression>,
) -> Result<PathBuf> {
    let rank_dir = dir.join(format!("ckpt_{rank}"));
    std::fs::create_dir_all(&rank_dir).at(&rank_dir)?;
    let given: BTreeMap<&str, &[u8]> = tensors.iter().copied().collect();
    for name in given.keys() {
        if !strategy.tensors.contains_key(*name) {
            return Err(Error::InvalidTensor {
                tensor: (*name).into(),
                problem: "is not in the strategy".into(),
            });
        }
    }
    let targets = rank_tensors(strategy, rank, keep_all, &|n, l| {
        given.contains_key(n).then_some(l.dtype)
    });
    let specs: Vec<TensorSpec> = targets
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let path = rank_dir.join(model_name(compression));
    let meta = rank_metadata(strategy, &strategy.hash(), rank, &targets);
    let w = create_writer(&path, &specs, &meta, compression)?;
    for (i, t) in targets.iter().enumerate() {
        let data = given[t.name.as_str()];
        if Some(data.len() as u64) != byte_len(t.dtype, &t.shape) {
            return Err(Error::InvalidTensor {
                tensor: t.name.clone(),
                problem: format!(
                    "rank {rank} gave {} bytes for local shape {:?} ({} bytes)",
                    data.len(),
                    t.shape,
                    byte_len(t.dtype, &t.shape).unwrap_or(0)
                ),
            });
        }
        w.write_at(i, 0, data)?;
    }
    w.finish()?;
    write_file_atomic(&rank_dir.join(STRATEGY_FILE), strategy.to_json().as_bytes())?;
    Ok(rank_dir)
}

/// Writes `dir/model.safetensors` holding whole tensors `(name, dtype, shape, bytes)`.
///
/// # Errors
/// Sizes that disagree with shapes; I/O errors.
pub fn write_integrated(dir: &Path, tensors: &[(&str, Dtype, &[u64], &[u8])]) -> Result<PathBuf> {
    write_integrated_with(dir, tensors, None)
}

/// The model file's name: compressed or not.
fn model_name(compression: Option<Compression>) -> &'static str {
    if compression.is_some() {
        COMPRESSED_MODEL_FILE
    } else {
        MODEL_FILE
    }
}

/// [`write_integrated`], compressed (`dir/model.ckptz`) when `compression` is given.
///
/// # Errors
/// Sizes that disagree with shapes; I/O errors.
pub fn write_integrated_with(
    dir: &Path,
    tensors: &[(&str, Dtype, &[u64], &[u8])],
    compression: Option<Compression>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).at(dir)?;
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, s, _)| TensorSpec {
            name: (*n).into(),
            dtype: *d,
            shape: s.to_vec(),
        })
        .collect();
    let path = dir.join(model_name(compression));
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let w = create_writer(&path, &specs, &meta, compression)?;
    for (i, (n, d, s, data)) in tensors.iter().enumerate() {
        if Some(data.len() as u64) != byte_len(*d, s) {
            return Err(Error::InvalidTensor {
                tensor: (*n).into(),
                problem: format!(
                    "{} bytes given for shape {s:?} ({} bytes)",
                    data.len(),
                    byte_len(*d, s).unwrap_or(0)
                ),
            });
        }
        w.write_at(i, 0, data)?;
    }
    w.finish()?;
    Ok(path)
}

/// Loads the tensors rank `rank` holds under `target` from any checkpoint (integrated,
/// sliced with any world size, or DCP), reading only the bytes that rank needs.
///
/// # Errors
/// Unreadable or inconsistent sources, tensors missing or of another global shape.
pub fn load_rank(
    src: &Path,
    target: &Strategy,
    rank: u64,
) -> Result<BTreeMap<String, LocalTensor>> {
    let source = Checkpoint::open(&[src.to_path_buf()])?;
    for (name, l) in &target.tensors {
        match source.tensors.get(name) {
            None => {
                return Err(Error::InvalidTensor {
                    tensor: name.clone(),
                    problem: format!("is missing from {}", src.display()),
                })
            }
            Some(s) if s.shape != l.shape => {
                return Err(Error::InvalidTensor {
                    tensor: name.clone(),
                    problem: format!(
                        "has shape {:?} in {} but {:?} is expected",
                        s.shape,
                        src.display(),
                        l.shape
                    ),
                })
            }
            Some(_) => {}
        }
    }
    let tensors = rank_tensors(target, rank, true, &|_, l| Some(l.dtype));
    let plan = CopyPlan::build(
        &source,
        vec![TargetFile {
            path: PathBuf::new(),
            tensors,
            metadata: BTreeMap::new(),
        }],
    )?;
    let mut out = BTreeMap::new();
    for f in &plan.files {
        for t in &f.tensors {
            let data = assemble(t, &source)?;
            out.insert(
                t.target.name.clone(),
                LocalTensor {
                    dtype: t.target.dtype,
                    shape: t.target.shape.clone(),
                    data,
                },
            );
        }
    }
    Ok(out)
}
