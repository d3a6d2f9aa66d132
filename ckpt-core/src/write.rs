//! Checkpoint writers: what `--format NAME` writes. Each is a [`Writer`]: from the
//! source checkpoint and the selection it builds the copy plan (the output's files, the
//! names and cuts of its tensors, views of the same bytes), and once the engine has
//! copied, it writes the files beside the engine's (index, config, trackers, args,
//! metadata its framework's loader reads) into the same staged directory. Each writer
//! is configured by its own typed options (its constructor's arguments), never by
//! strings in the plan.
//!
//! `merge`'s formats: [`safetensors`], [`hf`], [`one_file`], [`ucp`]. `reshard`'s, one
//! file per target rank, its target strategy the constructor's argument: [`sliced`]
//! (ckpt's and MindSpore's rank directories), [`dcp`] (PyTorch DCP's two layouts,
//! torchtitan's), [`megatron`], [`megatron_dist`], [`megatron_bridge`] and [`nemo2`] (Megatron-Bridge's and NeMo 2's imports, on
//! `megatron_dist`), sharing [`ranks`]; and [`deepspeed`],
//! DeepSpeed ZeRO for another data-parallel size, outside the trait (its partitions mix
//! tensors, which a copy plan does not; docs/architecture.md, "The write side").
//!
//! The top floor of ckpt-core: a writer may use the checkpoint, the engine, the formats'
//! file codecs and the algebra; nothing below imports a writer (docs/architecture.md,
//! "The write side"). The byte encoders themselves are the formats' (`formats/<name>.rs`,
//! behind [`TensorWriter`](crate::formats::writer::TensorWriter)).

pub mod dcp;
pub mod deepspeed;
pub mod gguf;
pub mod hf;
pub mod hf_import;
pub mod megatron;
pub mod megatron_bridge;
pub mod megatron_dist;
pub mod nemo2;
pub mod one_file;
pub mod orbax;
pub mod ranks;
pub mod safetensors;
pub mod sliced;
pub mod ucp;

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::formats::ckptz::Compression;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use std::path::Path;

/// A checkpoint writer (one per output format).
pub trait Writer: Send + Sync {
    /// The format's name, as `--format` takes it.
    fn name(&self) -> &'static str;

    /// The output's files and the tensors each holds, for the tensors `selection`
    /// keeps of `source`.
    ///
    /// # Errors
    /// Tensors the format cannot hold, options that do not apply to it.
    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan>;

    /// The compression the engine applies to the files it writes (`.ckptz`).
    fn compression(&self) -> Option<Compression> {
        None
    }

    /// Whether the output's files may be written by several processes, each a share
    /// of them (`merge --rank`): false for a format written as one tree.
    fn shares_files(&self) -> bool {
        true
    }

    /// The one file the output is, when it is a file rather than a directory (GGUF):
    /// the plan's only file, by this name in the staged directory, which the tool
    /// moves to the output's path.
    fn output_file(&self) -> Option<&'static str> {
        None
    }

    /// Writes the files beside the engine's into `dir` (the staged output, or the
    /// output directory for the process writing share 0): `plan` is the whole output's
    /// (for a process writing some of a reshard's ranks, the files it wrote outside the
    /// rank directories [`Writer::finish_part`] finished).
    ///
    /// # Errors
    /// I/O errors, with the path; what the format's side files need and the source
    /// does not give.
    fn finish(
        &self,
        source: &Checkpoint,
        selection: &Selection,
        plan: &CopyPlan,
        dir: &Path,
    ) -> Result<()>;

    /// The target strategy the output's ranks follow, for a writer of one file per
    /// target rank (what `reshard --plan` shows); `None` for an integrated output.
    fn strategy(&self) -> Option<&Strategy> {
        None
    }

    /// Writes the side files of one directory of the output (a rank directory,
    /// `ckpt_<r>/`) into `dir`, its staged copy: a process that writes only some of the
    /// output's files (`reshard --rank`) publishes each file's directory whole with
    /// them, then calls [`Writer::finish`] with the files it wrote outside such
    /// directories.
    ///
    /// # Errors
    /// I/O errors, with the path.
    fn finish_part(&self, source: &Checkpoint, dir: &Path) -> Result<()> {
        let _ = (source, dir);
        Ok(())
    }
}

/// The target layout a tool derives from its request (`reshard --to`, `--mesh`,
/// `--strategy`), for the writers that see the source in their framework's names or lay
/// part of the target out by its rules (Megatron's experts by megatron-core's) before
/// the strategy is derived.
pub trait TargetLayout {
    /// The target strategy for `source`: the one the request names, or `laid_out` where
    /// a writer laid it out itself; selection and casting applied either way, and every
    /// tensor of the source placed.
    ///
    /// # Errors
    /// A target that does not fit the source.
    fn strategy(&self, source: &Checkpoint, laid_out: Option<Strategy>) -> Result<Strategy>;

    /// The axis sizes the request asks by name (`--mesh tp=2,pp=2`; `--to N` as a
    /// tensor-parallel size on one stage, `tp=N,pp=1`), where it resizes a mesh.
    fn grid(&self) -> Option<Vec<(String, u64)>>;
}
