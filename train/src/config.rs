//! `TrainConfig`: every option of a training run, as clap arguments (flattened into
//! `ckpt train`) with the embedded default run as their defaults.

use crate::checkpoint::SaveMode;
use crate::device::DeviceKind;
use crate::launch::Backend;
use crate::models::ModelKind;
use crate::optim::{OptimizerKind, Schedule};
use clap::Parser;
use std::path::PathBuf;

/// Options of a training run. `TrainConfig::default()` is the embedded default run: the
/// `mlp` on the shipped digits, 4 thread ranks on the mesh `dp=2,tp=2`, 10 epochs of
/// global batch 64 with AdamW.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct TrainConfig {
    /// Model family (ignored when resuming: the checkpoint's config.json is used).
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    pub model: ModelKind,
    /// ResNet depth: 8, 20, 32, 56 (CIFAR 6n+2) or 50 (bottleneck).
    #[arg(long)]
    pub depth: Option<usize>,
    /// Full model configuration as JSON (the `config` object of config.json),
    /// overriding the defaults of --model.
    #[arg(long, value_name = "JSON")]
    pub model_config: Option<String>,
    /// Data set: `digits` (shipped), `digits:FILE.csv[.gz]`, `fashion-mnist[:DIR]`,
    /// `cifar10:DIR` (cifar-10-batches-bin).
    #[arg(long, default_value = "digits", value_parser = parse_data)]
    pub data: String,
    /// Use only the first N training images.
    #[arg(long, value_name = "N")]
    pub train_limit: Option<usize>,
    /// Use only the first N test images.
    #[arg(long, value_name = "N")]
    pub test_limit: Option<usize>,
    /// Pure data parallel over N thread ranks (mesh `dp=N`).
    #[arg(long, value_name = "N", conflicts_with = "mesh", value_parser = clap::value_parser!(u64).range(1..))]
    pub ranks: Option<u64>,
    /// Device mesh, e.g. `dp=2,tp=2` [default: dp=2,tp=2; dp=4 for resnet].
    #[arg(long)]
    pub mesh: Option<String>,
    /// Epochs to train (in total, counting those before a resume).
    #[arg(long, default_value_t = 10)]
    pub epochs: u64,
    /// Stop after this many updates in total (the schedule still spans --epochs).
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,
    /// Global batch size (split evenly over dp).
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// Peak learning rate [default: 0.005 for adamw, 0.1 for sgd].
    #[arg(long)]
    pub lr: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay [default: 0.01 for adamw, 5e-4 for sgd].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Learning-rate schedule.
    #[arg(long, value_enum, default_value_t = Schedule::Cosine)]
    pub schedule: Schedule,
    /// Linear warmup updates.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Seed of initialisation, shuffles and augmentation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Synchronize BatchNorm statistics over dp.
    #[arg(long)]
    pub sync_bn: bool,
    /// Split optimizer state over dp (ZeRO-1).
    #[arg(long)]
    pub shard_optimizer: bool,
    /// Checkpoint format.
    #[arg(long, value_enum, default_value_t = SaveMode::Sliced)]
    pub save: SaveMode,
    /// Save compressed .ckptz files (byte-grouped zstd; zstd or zstd:LEVEL), which
    /// --resume and every ckpt command read.
    #[arg(long, value_name = "zstd[:LEVEL]", value_parser = ckpt_core::formats::ckptz::Compression::parse)]
    pub compress: Option<ckpt_core::formats::ckptz::Compression>,
    /// Save every N updates (0: only at the end). Needs --out.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub save_every: u64,
    /// Keep only the newest N checkpoints (0: all).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub keep: usize,
    /// Write each checkpoint before training goes on. By default a save stops training
    /// only to copy the rank's tensors into memory and is written by a background
    /// thread (at most one in flight; `latest` names a step once every rank's part is
    /// written; the run ends when the last one is complete).
    #[arg(long)]
    pub sync_save: bool,
    /// Save in the background: the default, accepted so that it can be said.
    #[arg(long, conflicts_with = "sync_save")]
    pub async_save: bool,
    /// Output directory for checkpoints (none written without it).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Resume from a checkpoint (integrated or sliced, any mesh; an --out directory
    /// resumes from its `latest`).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Skip the per-epoch test accuracy.
    #[arg(long)]
    pub no_eval: bool,
    /// How ranks talk: threads of this process, or one process per rank started by
    /// mpirun (`mpi`) or by mpirun/torchrun/srun on GPUs (`nccl`); see docs/distributed.md.
    #[arg(long, value_enum, default_value_t = Backend::Threads)]
    pub backend: Backend,
    /// Where the model maths runs: the CPU, or CUDA GPUs (rank `local_rank % GPUs`;
    /// needs a build with `--features cuda-candle`).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Gather the final full weights into the report (for checks).
    #[arg(long, hide = true)]
    pub gather_weights: bool,
    /// Use the portable kernels (what a GPU runs) on the CPU too, to check their maths.
    #[arg(long, hide = true)]
    pub portable_kernels: bool,
}

#[derive(Parser)]
struct Standalone {
    #[command(flatten)]
    cfg: TrainConfig,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        Standalone::parse_from(["train"]).cfg
    }
}

impl TrainConfig {
    /// Parses options as on the command line (`args[0]` is the program name).
    ///
    /// # Errors
    /// Unknown or malformed options, with clap's message.
    pub fn try_parse_from<I, T>(args: I) -> Result<TrainConfig, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Standalone::try_parse_from(args).map(|s| s.cfg)
    }
}

/// Checks `--data` at parse time (an unknown data set is a usage error), keeping the text.
pub(crate) fn parse_data(s: &str) -> std::result::Result<String, String> {
    crate::data::DataSource::parse(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--async-save` is the default said aloud; with `--sync-save` it is a usage error.
    #[test]
    fn async_save_is_the_default_and_conflicts_with_sync_save() {
        let c = TrainConfig::try_parse_from(["t", "--async-save"]).unwrap();
        assert!(c.async_save && !c.sync_save);
        assert!(!TrainConfig::default().sync_save);
        let e = TrainConfig::try_parse_from(["t", "--async-save", "--sync-save"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn default_is_the_embedded_run() {
        let c = TrainConfig::default();
        assert_eq!(
            (c.model, c.data.as_str(), c.epochs, c.batch_size),
            (ModelKind::Mlp, "digits", 10, 64)
        );
        assert_eq!(c.mesh, None);
    }

    #[test]
    fn test_flags() {
        let c = TrainConfig::try_parse_from([
            "t",
            "--ranks",
            "4",
            "--save",
            "integrated",
            "--sync-bn",
            "--model",
            "resnet",
            "--depth",
            "8",
        ])
        .unwrap();
        assert_eq!(
            (c.ranks, c.save, c.sync_bn, c.depth),
            (Some(4), SaveMode::Integrated, true, Some(8))
        );
        assert!(TrainConfig::try_parse_from(["t", "--ranks", "4", "--mesh", "dp=2"]).is_err());
        assert!(TrainConfig::try_parse_from(["t", "--optimizer", "lion"]).is_err());
        let c = TrainConfig::try_parse_from([
            "t",
            "--shard-optimizer",
            "--optimizer",
            "sgd",
            "--keep",
            "2",
            "--save-every",
            "5",
        ])
        .unwrap();
        assert_eq!(
            (c.shard_optimizer, c.optimizer, c.keep, c.save_every),
            (true, OptimizerKind::Sgd, 2, 5)
        );
    }
}
