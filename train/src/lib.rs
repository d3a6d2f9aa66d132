//! ckpt-train: a distributed trainer on candle that writes integrated or sliced
//! checkpoints with their strategy.
//!
//! Ranks are threads of one process ([`run_threads`]) that talk only through [`Comm`]
//! collectives; the mesh has a `dp` axis (data parallel) and a `tp` axis (Megatron
//! tensor parallel).

mod comm;
mod data;
mod error;
mod parallel;
mod params;

pub use crate::comm::{all_gather_tensor, all_reduce_tensor, check_mesh, run_threads, tensor_to_vec, Comm, Dist, ReduceOp, MESH_AXES};
pub use crate::error::{Error, Result};
pub use crate::data::{
    digits, parse_digits_csv, read_cifar10, read_fashion_mnist, read_idx, DataSource, Dataset, DistributedSampler, Idx, Split,
    DIGITS_CSV_GZ, FASHION_MNIST_DIR,
};
pub use crate::parallel::{all_reduce_sum_both, chunk, copy_to_group, gather_from_group, reduce_from_group};
pub use crate::params::{init_global, local_positions, place_local, slice_local, Init, ParamHint, ParamSpec, ShardedVarBuilder, ShardedVars};
