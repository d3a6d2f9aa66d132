//! The file codecs of a DeepSpeed ZeRO-1/2/3 checkpoint written for another
//! data-parallel size (ZeRO-1/2 in [`zero12`], ZeRO-3 in [`zero3`], both reached through
//! the checkpoint writer `write::deepspeed::write_deepspeed_dp`)
//! (`ckpt reshard ckpt/ --to N --format deepspeed`): what `engine.load_checkpoint`
//! of DeepSpeed on N ranks loads, weights and optimizer state included, without the
//! universal-checkpoint path (layout in docs/formats.md, "DeepSpeed: writing for
//! another data-parallel size").
//!
//! Read from deepspeed/runtime/zero/stage_1_and_2.py and runtime/engine.py (0.19.8):
//! - each parameter group is one flat buffer: the parameters in order, each followed by
//!   its `param_alignment_paddings` entry, padded at the end to a multiple of
//!   `nccl_start_alignment_factor * dp` (= `2 * dp`) and cut into `dp` equal
//!   partitions (`get_data_parallel_partitions`); rank r's
//!   `single_partition_of_fp32_groups[g]` is its partition without the group's end
//!   padding, which `group_paddings[g]` counts. The ranks' stored partitions laid end
//!   to end are therefore the group's buffer without its end padding, whatever the dp
//!   size: re-cutting that stream for another dp is a pure copy of flat ranges
//!   ([`FlatLayout::aligned`](crate::layout::flat::FlatLayout::aligned)), no parameter needs to be understood;
//! - `base_optimizer_state` (a rigid checkpoint: the torch optimizer's `state_dict()`)
//!   holds per group tensors of the padded partition's length (Adam's `exp_avg`,
//!   `exp_avg_sq`), cut the same way, and others (`step`) the same on every rank;
//! - `_load_legacy_checkpoint` (default `load_from_fp32_weights`, non-elastic) loads
//!   rank r's file alone: the partition padded with zeros to its length, and the torch
//!   optimizer state as it is; `param_alignment_paddings` must equal the loading run's;
//! - `engine._load_zero_checkpoint` refuses a checkpoint whose model states say another
//!   `dp_world_size`: the model-states file is copied with that one integer changed.
//!
//! bf16 runs name the same files `bf16_zero_pp_rank_*` (engine `_get_zero_ckpt_prefix`);
//! the prefix is kept. Refused by name, nothing written: DeepSpeed's BF16_Optimizer
//! files (no `zero_stage`: ZeRO-1 with fp32 gradient accumulation; the reader refuses
//! them), elastic checkpoints, round-robin gradient ordering, and whatever the reader
//! refuses (tensor parallelism). A ZeRO-1/2 mixture of experts is written for another
//! world and expert-parallel size ([`experts`]: docs/moe.md).

mod experts;
mod group_plan;
mod zero12;
mod zero3;

pub use zero12::DeepSpeedWriteStats;
pub(crate) use zero12::{optim_files, tag_dir, unsupported, write_zero12, NewSizes};
pub(crate) use zero3::write_zero3;
