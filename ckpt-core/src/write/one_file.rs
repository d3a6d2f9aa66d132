//! One file of every tensor, as a framework loads it: `model.pth` for
//! `torch.load(weights_only=True)`, `model.ckpt` for `mindspore.load_checkpoint`. The
//! file's codec is the format's (chosen by the file's name); the carried files are
//! copied beside it.

use super::safetensors::whole_tensors;
use super::Writer;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::output::copy_carried;
use crate::layout::plan::{CopyPlan, TargetFile};
use crate::layout::select::Selection;
use std::collections::BTreeMap;
use std::path::Path;

/// `merge --format torch` and `--format mindspore`.
#[derive(Clone, Copy, Debug)]
pub struct OneFile {
    /// The format's name (`--format`).
    name: &'static str,
    /// The file written.
    file: &'static str,
}

impl OneFile {
    /// One `model.pth` (a dict of tensors).
    pub const TORCH: OneFile = OneFile {
        name: "torch",
        file: "model.pth",
    };
    /// One `model.ckpt` (MindSpore's protobuf checkpoint).
    pub const MINDSPORE: OneFile = OneFile {
        name: "mindspore",
        file: "model.ckpt",
    };

    /// The writer, refusing what does not apply to one file its framework reads.
    ///
    /// # Errors
    /// A compression or a shard size asked for.
    pub fn checked(self, compressed: bool, max_shard_size: Option<u64>) -> Result<OneFile> {
        let (name, file) = (self.name, self.file);
        if compressed {
            return Err(Error::Unsupported {
                problem: format!(
                    "--format {name} writes {file}, which {name} reads: --compress does not apply"
                ),
            });
        }
        if max_shard_size.is_some() {
            return Err(Error::Unsupported {
                problem: format!(
                    "--format {name} writes one {file}: --max-shard-size does not apply"
                ),
            });
        }
        Ok(self)
    }
}

impl Writer for OneFile {
    fn name(&self) -> &'static str {
        self.name
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        let file = TargetFile {
            path: self.file.into(),
            tensors: whole_tensors(source, selection)?,
            metadata: BTreeMap::new(),
        };
        CopyPlan::build(source, vec![file])
    }

    fn finish(&self, source: &Checkpoint, _: &Selection, _: &CopyPlan, dir: &Path) -> Result<()> {
        copy_carried(&source.carried, dir)
    }
}
