//! Writing a DeepSpeed ZeRO-1/2/3 checkpoint for another data-parallel size (ZeRO-1/2 in
//! [`zero12`], ZeRO-3 in [`zero3`], both reached through [`write_deepspeed_dp`])
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
//!   ([`FlatLayout::aligned`]), no parameter needs to be understood;
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

use super::deepspeed;
use crate::error::Result;
use std::path::Path;
use zero12::{optim_files, tag_dir, unsupported};

pub use zero12::DeepSpeedWriteStats;

/// Writes the ZeRO-1/2/3 checkpoint at `source` (a directory with `latest`, or a tag
/// directory) as a checkpoint for `dp` data-parallel ranks at `output`
/// (`output/latest`, `output/<tag>/`), all of it or nothing. A ZeRO-1/2 mixture of
/// experts (`deepspeed.moe`) is written for expert-parallel size `ep` (the source's
/// when `None`): its expert group regrouped by expert, the expert files copied.
///
/// # Errors
/// [`crate::Error::Unsupported`] for what is not written (ZeRO-3 sub-groups split otherwise on
/// `dp` ranks, elastic checkpoints, round-robin gradients, a dp size the ZeRO-1/2 model
/// states cannot record in place, `ep` without experts, experts without ZeRO);
/// [`crate::Error::InvalidDeepSpeed`] naming file and tensor for a damaged
/// source; an existing output without `force`; I/O errors.
pub fn write_deepspeed_dp(
    source: &Path,
    output: &Path,
    dp: u64,
    ep: Option<u64>,
    force: bool,
) -> Result<DeepSpeedWriteStats> {
    if dp == 0 {
        return Err(unsupported("a data-parallel size of 0"));
    }
    let (dir, tag) = tag_dir(source)?;
    // The reader's checks first: missing ranks or expert files, partitions that do
    // not add up, padding out of place, tensor parallelism are refused there.
    let read = deepspeed::read(&dir)?;
    drop(read);
    let (prefix, optim, rank_models) = optim_files(&dir)?;
    if optim.is_empty() {
        return Err(unsupported(format!(
            "{}: no ZeRO optimizer-states files (zero_pp_rank_*): a checkpoint without ZeRO is not re-cut; `ckpt merge` reads its weights",
            dir.display()
        )));
    }
    // Per-rank model states: ZeRO-3 (the reader checked the stage), which DeepSpeed
    // refuses with experts.
    if rank_models.is_empty() {
        zero12::write_zero12(
            &dir,
            &tag,
            output,
            zero12::NewSizes { dp, ep },
            force,
            &prefix,
            &optim,
        )
    } else if ep.is_some() {
        Err(unsupported(format!(
            "{}: an EP size was given for a ZeRO-3 checkpoint, which has no expert groups (DeepSpeed refuses ZeRO-3 with its MoE layers)",
            dir.display()
        )))
    } else {
        zero3::write_zero3(&dir, &tag, output, dp, force, &prefix, &optim)
    }
}
