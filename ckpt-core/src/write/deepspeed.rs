//! DeepSpeed ZeRO-1/2/3 for another data-parallel size (`reshard --format deepspeed`):
//! the checkpoint writer, its typed options the new data-parallel and expert-parallel
//! sizes. Not a [`super::Writer`]: a ZeRO partition is a range of a parameter group's
//! padded flat buffer, several tensors and padding end to end, which a copy plan (each
//! target tensor filled from one source tensor by boxes) does not express, and its
//! files are DeepSpeed's pickles re-emitted around the new partitions
//! (docs/architecture.md, "The write side"). The codecs are the format's
//! (`formats/deepspeed_write/`).

use crate::error::Result;
use crate::formats::deepspeed;
use crate::formats::deepspeed_write::{
    optim_files, tag_dir, unsupported, write_zero12, write_zero3, DeepSpeedWriteStats, NewSizes,
};
use std::path::Path;

/// Writes the ZeRO-1/2/3 checkpoint at `source` (a directory with `latest`, or a tag
/// directory) as a checkpoint for `dp` data-parallel ranks at `output`
/// (`output/latest`, `output/<tag>/`), all of it or nothing. A ZeRO-1/2 mixture of
/// experts (`deepspeed.moe`) is written for expert-parallel size `ep` (the source's
/// when `None`): its expert group regrouped by expert, the expert files copied.
///
/// # Errors
/// [`Unsupported`](crate::error::Error::Unsupported) for what is not written (ZeRO-3
/// sub-groups split otherwise on `dp` ranks, elastic checkpoints, round-robin
/// gradients, a dp size the ZeRO-1/2 model states cannot record in place, `ep` without
/// experts, experts without ZeRO); [`InvalidDeepSpeed`](crate::error::Error::InvalidDeepSpeed)
/// naming file and tensor for a damaged source; an existing output without `force`; I/O
/// errors.
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
        write_zero12(
            &dir,
            &tag,
            output,
            NewSizes { dp, ep },
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
        write_zero3(&dir, &tag, output, dp, force, &prefix, &optim)
    }
}
