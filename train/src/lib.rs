//! ckpt-train: a distributed trainer on candle that writes integrated or sliced
//! checkpoints with their strategy.
//!
//! Ranks are threads of one process ([`run_threads`]) that talk only through [`Comm`]
//! collectives; the mesh has a `dp` axis (data parallel) and a `tp` axis (Megatron
//! tensor parallel).
//!
//! - [`train`] runs a [`TrainConfig`] (clap arguments of `ckpt train`; `Default` is the
//!   embedded run: the mlp on the shipped digits, 4 ranks on `dp=2,tp=2`).
//! - [`load_model`] builds one rank's slice of a trained model from any checkpoint, for
//!   inference on any mesh.
//! - The models ([`models`]) take a [`ShardedVarBuilder`]: tensors are asked for by
//!   global shape and `tp` placement ([`ParamHint`]), and the rank gets its piece.
//!
//! ```
//! use ckpt_train::{train, TrainConfig};
//! let cfg = TrainConfig::try_parse_from(["train", "--mesh", "tp=2", "--max-steps", "3", "--no-eval"]).unwrap();
//! let report = train(&cfg, false).unwrap();
//! assert_eq!(report.steps, 3);
//! assert!(report.losses[2] < report.losses[0]);
//! ```

// cudarc compiles one CUDA version's bindings: `cuda` picks 12.8's, `cuda-candle` 13.0's.
#[cfg(all(feature = "cuda", feature = "cuda-candle"))]
compile_error!("features `cuda` and `cuda-candle` exclude each other: `cuda-candle` includes the NCCL backend (build with one of them)");

mod activation;
mod batch_norm;
mod checkpoint;
mod comm;
mod config;
mod conv;
mod cpu_data;
mod cuda;
mod data;
mod device;
mod error;
mod events;
mod inference;
mod kernels;
mod launch;
mod layers;
pub mod models;
mod optim;
mod parallel;
mod params;
mod present;
mod trainer;

pub use crate::checkpoint::{
    checkpoint_tensor_names, f32_bytes, f32_from_bytes, find_meta_file, gather_full,
    read_trainer_state, resolve_checkpoint, FullTensor, RngState, SaveMode, ScheduleState,
    TrainerState, CONFIG_FILE, LATEST_FILE, TRAINER_STATE_FILE, TRAINER_STATE_FORMAT,
};
pub use crate::comm::{
    all_gather_tensor, all_reduce_tensor, check_mesh, run_threads, tensor_to_vec, Comm, Dist,
    ReduceOp, MESH_AXES,
};
#[cfg(feature = "mpi")]
pub use crate::comm::{finalize_mpi, mpi_world, run_mpi, MpiWorld};
#[cfg(feature = "cuda-driver")]
pub use crate::comm::{run_nccl, JOB_ID_VAR, RENDEZVOUS_DIR_VAR};
#[cfg(any(feature = "mpi", feature = "cuda-driver"))]
pub use crate::comm::{DEFAULT_TIMEOUT as COMM_DEFAULT_TIMEOUT, TIMEOUT_VAR as COMM_TIMEOUT_VAR};
pub use crate::config::TrainConfig;
pub use crate::cuda::{cuda_available, NCCL_CANDIDATES, NCCL_LIB_VAR};
pub use crate::data::{
    digits, parse_digits_csv, read_cifar10, read_fashion_mnist, read_idx, DataSource, Dataset,
    DistributedSampler, Idx, Split, CIFAR_RECORD, DIGITS_CSV_GZ, DIGITS_SPLIT_SEED, DIGITS_TEST,
    FASHION_MNIST_DIR,
};
pub use crate::device::DeviceKind;
pub use crate::error::{Error, Result};
pub use crate::events::EventWriter;
pub use crate::inference::{load_model, model_strategy, read_model_config};
pub use crate::kernels::Kernels;
pub use crate::launch::{configure_cpu_threads, ranks_in_process, Backend, LaunchEnv, Launcher};
pub use crate::layers::{
    linear, BatchNorm2d, ColumnLinear, Conv2d, LayerNorm, Linear, ModelCtx, RowLinear,
};
pub use crate::models::{build_model, Model, ModelConfig, ModelKind};
pub use crate::optim::{
    lr_at, state_layout, state_tensor_name, OptimConfig, Optimizer, OptimizerKind, Schedule,
};
pub use crate::parallel::{
    all_reduce_sum_both, chunk, copy_to_group, gather_from_group, reduce_from_group,
};
pub use crate::params::{
    init_global, local_positions, place_local, slice_local, Init, ParamHint, ParamSpec,
    ShardedVarBuilder, ShardedVars,
};
pub use crate::trainer::{train, TrainReport};
