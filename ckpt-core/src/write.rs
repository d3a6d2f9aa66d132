//! Checkpoint writers: what `--format NAME` writes. Each is a [`Writer`]: from the
//! source checkpoint and the selection it builds the copy plan (the output's files, the
//! names and cuts of its tensors, views of the same bytes), and once the engine has
//! copied, it writes the files beside the engine's (index, config, trackers, args,
//! metadata its framework's loader reads) into the same staged directory. Each writer
//! is configured by its own typed options (its constructor's arguments), never by
//! strings in the plan.
//!
//! The top floor of ckpt-core: a writer may use the checkpoint, the engine, the formats'
//! file codecs and the algebra; nothing below imports a writer (docs/architecture.md,
//! "The write side"). The byte encoders themselves are the formats' (`formats/<name>.rs`,
//! behind [`TensorWriter`](crate::formats::writer::TensorWriter)).

pub(crate) mod hf;
pub(crate) mod megatron;
pub(crate) mod megatron_dist;
pub(crate) mod one_file;
pub(crate) mod safetensors;
pub(crate) mod ucp;

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::formats::ckptz::Compression;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
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

    /// Writes the files beside the engine's into `dir` (the staged output, or the
    /// output directory for the process writing share 0): `plan` is the whole output's.
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
}
