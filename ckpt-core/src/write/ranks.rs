//! What the writers of one file per target rank share (`reshard`'s outputs: ckpt's and
//! MindSpore's rank directories, PyTorch DCP's two layouts, Megatron's grids): which
//! ranks a process writes, the options they all take, each rank's tensors under the
//! target strategy, and the `strategy.json` and carried files written beside them.

use crate::checkpoint::{Checkpoint, STRATEGY_FILE};
use crate::error::{Error, Result};
use crate::formats::ckptz::Compression;
use crate::formats::output::{copy_carried, write_file_atomic};
use crate::layout::plan::{rank_metadata, rank_tensors, CopyPlan, TargetFile, TargetTensor};
use crate::layout::strategy::Strategy;
use std::path::{Path, PathBuf};

/// The largest target world size (one file per rank is written).
pub const MAX_TARGET_RANKS: u64 = 1 << 20;

/// Which target ranks to build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ranks {
    /// All of them, appearing together.
    #[default]
    All,
    /// Only this one (partitioned work across machines).
    One(u64),
    /// Share `index` of `count`: target ranks `r` with `r % count == index` (one process
    /// of a job started by mpirun, srun or torchrun).
    Share {
        /// This process's share.
        index: u64,
        /// Number of shares.
        count: u64,
    },
}

impl Ranks {
    /// The target ranks of a world of `world` ranks this selects.
    ///
    /// # Errors
    /// A rank past the target's world size.
    pub fn list(self, world: u64) -> Result<Vec<u64>> {
        match self {
            Ranks::All => Ok((0..world).collect()),
            Ranks::One(r) if r < world => Ok(vec![r]),
            Ranks::One(r) => Err(Error::Unsupported {
                problem: format!("--rank {r} but the target has {world} ranks"),
            }),
            Ranks::Share { index, count } => {
                Ok((index..world).step_by(count.max(1) as usize).collect())
            }
        }
    }
}

/// The typed options every writer of one file per target rank takes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RankOptions {
    /// Which target ranks to write.
    pub ranks: Ranks,
    /// Replicated tensors on every rank that holds them, not only their owner.
    pub keep_all: bool,
    /// `.ckptz` rank files (ckpt's own layout only).
    pub compression: Option<Compression>,
}

impl RankOptions {
    /// Refuses a compression: the layout is read by another program.
    pub(crate) fn uncompressed(&self) -> Result<()> {
        if self.compression.is_some() {
            return Err(Error::Unsupported {
                problem: "--compress writes ckpt's own layout (ckpt_<r>/model.ckptz): PyTorch and MindSpore do not read .ckptz files, so it does not combine with --format dcp-safetensors, distcp, mindspore or megatron".into(),
            });
        }
        Ok(())
    }
}

/// How a format lays out its rank files.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RankFiles {
    /// The file of target rank `r`, relative to the output.
    pub(crate) path: fn(u64) -> PathBuf,
    /// PyTorch DCP: one box per tensor on a rank.
    pub(crate) one_box: bool,
    /// PyTorch DCP's default format: each chunk stored once, by its owner (its metadata
    /// maps a chunk to one file), and no empty chunks (a rank's empty slice needs no
    /// archive).
    pub(crate) once: bool,
}

/// What target rank `r` stores.
pub(crate) fn target_tensors(
    strategy: &Strategy,
    r: u64,
    keep_all: bool,
    files: RankFiles,
) -> Vec<TargetTensor> {
    let mut tensors = rank_tensors(strategy, r, keep_all && !files.once, &|_, l| Some(l.dtype));
    if files.once {
        tensors.retain(|t| t.shape.iter().all(|&d| d > 0));
    }
    tensors
}

/// The plan of `ranks` of `strategy`, one file per rank.
///
/// # Errors
/// A target mesh of more than [`MAX_TARGET_RANKS`] ranks; a rank past it; a tensor in
/// several boxes on a rank of a DCP layout; see [`CopyPlan::build`].
pub(crate) fn rank_plan(
    source: &Checkpoint,
    strategy: &Strategy,
    ranks: Ranks,
    keep_all: bool,
    files: RankFiles,
) -> Result<CopyPlan> {
    let world = strategy.mesh.world_size();
    // One file per target rank is written: a mesh that claims more ranks than any
    // machine room holds is a mistake, refused before anything is allocated for it.
    if world > MAX_TARGET_RANKS {
        return Err(Error::Unsupported {
            problem: format!(
                "the target mesh {} has {world} ranks, more than the {MAX_TARGET_RANKS} ckpt writes files for",
                strategy.mesh
            ),
        });
    }
    let list = ranks.list(world)?;
    let hash = strategy.hash();
    let targets = list
        .into_iter()
        .map(|r| {
            let tensors = target_tensors(strategy, r, keep_all, files);
            if files.one_box {
                if let Some(t) = tensors.iter().find(|t| t.pieces.len() > 1) {
                    return Err(Error::Unsupported {
                        problem: format!(
                            "tensor `{}`: rank {r} holds it as {} boxes (a blocked shard) and PyTorch DCP stores one box per tensor: use blocks=1 in the target strategy or --exclude it",
                            t.name,
                            t.pieces.len()
                        ),
                    });
                }
            }
            Ok(TargetFile {
                path: (files.path)(r),
                metadata: rank_metadata(strategy, &hash, r, &tensors),
                tensors,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    CopyPlan::build(source, targets)
}

/// Writes a directory's `strategy.json` (`json`) and carried files.
pub(crate) fn finish_dir(dir: &Path, json: &str, source: &Checkpoint) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    write_file_atomic(&dir.join(STRATEGY_FILE), json.as_bytes())?;
    copy_carried(&source.carried, dir)
}
