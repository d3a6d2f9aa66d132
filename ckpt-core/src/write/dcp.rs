//! PyTorch Distributed Checkpoint (DCP) outputs, one file per target rank in the output
//! directory, with ckpt's `strategy.json` and the carried files beside them:
//! - DCP's default format: `__<r>_0.distcp` (one `torch.save` archive per chunk) and
//!   `.metadata`, loadable by `torch.distributed.checkpoint.load`; in torchtitan's names
//!   (from a Hugging Face Llama and its config.json), what torchtitan's
//!   `CheckpointManager` loads as a model-only checkpoint (`initial_load_path`);
//! - DCP's sharded safetensors: `shard-<r+1>-model-00001-of-00001.safetensors`, loadable
//!   by `torch.distributed.checkpoint.HuggingFaceStorageReader`.
//!
//! DCP stores each tensor of a rank as one box; its default format stores each chunk
//! once (its metadata maps a chunk to one file), by its owner.

use super::ranks::{finish_dir, rank_plan, target_tensors, RankFiles, RankOptions};
use super::{TargetLayout, Writer};
use crate::checkpoint::{Checkpoint, HfTarget};
use crate::error::Result;
use crate::formats::distcp::{metadata_bytes, DistcpChunk, METADATA_FILE};
use crate::formats::output::write_file_atomic;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use std::path::{Path, PathBuf};

/// `reshard --format distcp`, `--format torchtitan` and `--format dcp-safetensors`.
#[derive(Clone, Debug)]
pub struct Dcp {
    /// The format's name (`--format`).
    name: &'static str,
    /// Its rank files.
    files: RankFiles,
    strategy: Strategy,
    options: RankOptions,
}

/// The rank files of DCP's default format (a dist_ckpt's too, in its iteration
/// directory).
pub(crate) const DISTCP_FILES: RankFiles = RankFiles {
    path: distcp_file,
    one_box: true,
    once: true,
};

fn distcp_file(r: u64) -> PathBuf {
    PathBuf::from(format!("__{r}_0.distcp"))
}

fn safetensors_file(r: u64) -> PathBuf {
    // PyTorch numbers shards from 1.
    PathBuf::from(format!(
        "shard-{:05}-model-00001-of-00001.safetensors",
        r + 1
    ))
}

impl Dcp {
    /// DCP's default format for `strategy`.
    ///
    /// # Errors
    /// A compression asked for.
    pub fn distcp(strategy: Strategy, options: RankOptions) -> Result<Dcp> {
        options.uncompressed()?;
        Ok(Dcp {
            name: "distcp",
            files: DISTCP_FILES,
            strategy,
            options,
        })
    }

    /// DCP's default format in torchtitan's names: `source` (a Hugging Face Llama) is
    /// seen in them, then `target` derives the strategy.
    ///
    /// # Errors
    /// A compression asked for; a source torchtitan's names do not fit; what `target`
    /// refuses.
    pub fn torchtitan(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
    ) -> Result<Dcp> {
        options.uncompressed()?;
        source.torchtitan_import(&HfTarget::default())?;
        Ok(Dcp {
            name: "torchtitan",
            ..Dcp::distcp(target.strategy(source, None)?, options)?
        })
    }

    /// DCP's sharded safetensors for `strategy`.
    ///
    /// # Errors
    /// A compression asked for.
    pub fn safetensors(strategy: Strategy, options: RankOptions) -> Result<Dcp> {
        options.uncompressed()?;
        Ok(Dcp {
            name: "dcp-safetensors",
            files: RankFiles {
                path: safetensors_file,
                one_box: true,
                once: false,
            },
            strategy,
            options,
        })
    }

    /// The `.metadata` of DCP's default format: every target rank's chunks, laid out as
    /// the writer lays out its file.
    fn metadata(&self) -> Result<Vec<u8>> {
        let strategy = &self.strategy;
        let tensors = strategy
            .tensors
            .iter()
            .map(|(n, l)| (n.clone(), (l.dtype, l.shape.clone())))
            .collect();
        let files: Vec<(String, Vec<DistcpChunk>)> = (0..strategy.mesh.world_size())
            .map(|r| {
                let chunks = target_tensors(strategy, r, false, self.files)
                    .into_iter()
                    .filter_map(|t| {
                        let p = t.pieces.first()?;
                        Some(DistcpChunk {
                            fqn: t.name,
                            offsets: p.global.start.to_vec(),
                            sizes: t.shape,
                        })
                    })
                    .collect();
                ((self.files.path)(r).display().to_string(), chunks)
            })
            .collect();
        metadata_bytes(&tensors, &files, &[])
    }
}

impl Writer for Dcp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn plan(&self, source: &Checkpoint, _: &Selection) -> Result<CopyPlan> {
        let o = &self.options;
        rank_plan(source, &self.strategy, o.ranks, o.keep_all, self.files)
    }

    fn strategy(&self) -> Option<&Strategy> {
        Some(&self.strategy)
    }

    /// The top directory's `strategy.json` and carried files, and DCP's default
    /// format's `.metadata` (the same bytes from every process writing some ranks).
    fn finish(&self, source: &Checkpoint, _: &Selection, _: &CopyPlan, dir: &Path) -> Result<()> {
        finish_dir(dir, &self.strategy.to_json(), source)?;
        if self.files.once {
            write_file_atomic(&dir.join(METADATA_FILE), &self.metadata()?)?;
        }
        Ok(())
    }
}
