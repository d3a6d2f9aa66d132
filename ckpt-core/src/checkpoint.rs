//! `Checkpoint`: a set of safetensors files read as pieces of global tensors.
//!
//! Three kinds are understood: ckpt's sliced rank directories (`ckpt_<r>/` with
//! `model.safetensors` and `strategy.json`), Hugging Face integrated checkpoints
//! (`model.safetensors` or shards with `model.safetensors.index.json`), and PyTorch
//! DCP sharded safetensors (`DCP_SHARDING_INFO` offsets, layout inferred).
//!
//! The work is split by what it does: `open` (the paths' files, found by the formats'
//! directory discovery, read and checked), `sliced` (pieces placed by a strategy: ckpt's
//! rank directories, Megatron), `mindspore` (by a MindSpore strategy), `boxes` (files
//! that say where their pieces sit, or hold tensors whole: Hugging Face, DCP, DeepSpeed)
//! and `coverage` (every element held exactly once; `flat_names` names ZeRO-style flat
//! pieces in its messages).

mod boxes;
mod computed;
mod coverage;
mod flat_names;
mod gguf_view;
mod hf_view;
mod interleaved_view;
mod maxtext_view;
mod megatron_views;
mod mindspore;
mod open;
mod peft_wrapped;
mod sliced;

pub use maxtext_view::MAXTEXT_ITEM;

use crate::error::Error;
use crate::formats::TensorFile;
use crate::layout::source::{PieceSource, SourceTensor};
use crate::layout::strategy::Strategy;
use crate::layout::Dtype;
use std::collections::BTreeMap;
use std::path::PathBuf;

pub use crate::formats::detect::discover::{
    CARRIED_FILES, COMPRESSED_INDEX_FILE, COMPRESSED_MODEL_FILE, INDEX_FILE, MODEL_FILE,
    OPTIMIZER_FILE, STRATEGY_FILE,
};
pub use crate::layout::plan::DCP_SHARDING_INFO;
pub use computed::{Computations, SCALE_INV_SUFFIX};
pub use hf_view::{HfModel, HfTarget};
/// The names of optimizer state, in ckpt's training checkpoints (`optim.<param>.<state>`)
/// and torch's (`optim.state.<i>.<state>`).
pub const OPTIMIZER_PREFIX: &str = "optim.";

/// How the note on a prefix every name shares begins.
const SHARED_PREFIX_NOTE: &str = "every tensor name starts with";

/// Most problems of one kind listed one by one; the rest are counted.
pub(crate) const MAX_LISTED: usize = 20;

/// What kind of checkpoint a set of inputs is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// ckpt rank directories with a strategy.
    Sliced,
    /// Whole tensors (Hugging Face layout).
    Integrated,
    /// PyTorch DCP sharded safetensors.
    Dcp,
}

/// An opened, checked checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    /// The kind of the inputs.
    pub kind: Kind,
    /// The mapped files.
    pub files: Vec<TensorFile>,
    /// Rank of each file (sliced checkpoints).
    pub ranks: Vec<Option<u64>>,
    /// The strategy (sliced checkpoints).
    pub strategy: Option<Strategy>,
    /// The tensors by name.
    pub tensors: BTreeMap<String, SourceTensor>,
    /// Carried files found beside the inputs (`config.json`, ...), by name.
    pub carried: BTreeMap<String, PathBuf>,
    /// What could not be checked from these inputs (not problems; said by inspect
    /// and verify so that an ok is not read as more than it is).
    pub notes: Vec<String>,
    /// A model imported from Hugging Face as Megatron's tensors
    /// ([`Checkpoint::megatron_import`]): the args its legacy output carries.
    pub(crate) imported: Option<crate::formats::megatron::SourceState>,
    /// The model's sizes a trainer recorded beside its weights in Megatron's terms
    /// (Megatron-Bridge's `run_config.yaml`, NeMo's `context/model.yaml`), as
    /// Megatron-LM's args, and the file: used where the files hold no args.
    pub(crate) recorded_args: Option<(crate::formats::megatron::Args, std::path::PathBuf)>,
    /// Where a trainer records the LoRA rank and alpha of a PEFT-wrapped model's
    /// shards (verl's `lora_train_meta.json`; the file may be missing).
    pub(crate) lora_meta: Option<std::path::PathBuf>,
    /// Scratch directories holding carried files rewritten for the output (a config
    /// without its `quantization_config`), removed when the checkpoint is dropped.
    pub(crate) scratch: Vec<tempfile::TempDir>,
    /// The local trees standing for URL inputs (last: dropped after the files that
    /// map their objects).
    pub(crate) mirrors: Vec<std::sync::Arc<ckpt_storage::Mirror>>,
}

/// The first dotted component every name shares (`module.`), when there are at least
/// two names.
fn shared_prefix<'a>(mut names: impl Iterator<Item = &'a str>) -> Option<String> {
    let first = names.next()?;
    let p = &first[..=first.find('.')?];
    let mut n = 1;
    for name in names {
        if !name.starts_with(p) || name.len() == p.len() {
            return None;
        }
        n += 1;
    }
    (n > 1).then(|| p.to_string())
}

/// A global tensor whose pieces are still to be found (the coverage check fills them).
fn unplaced(dtype: Dtype, shape: Vec<u64>) -> SourceTensor {
    SourceTensor {
        dtype,
        shape,
        pieces: vec![],
        copies: vec![],
    }
}

impl Checkpoint {
    /// Label of a file for messages: its path, and rank when known.
    #[must_use]
    pub fn label(&self, file: usize) -> String {
        match self.ranks[file] {
            Some(r) => format!("{} (rank {r})", self.files[file].path().display()),
            None => self.files[file].path().display().to_string(),
        }
    }

    /// How many stored tensors have a recorded checksum (safetensors' and .ckptz's
    /// per-tensor sums; MindSpore's whole-file `crc_num` is not one).
    #[must_use]
    pub fn recorded_checksums(&self) -> usize {
        self.files
            .iter()
            .map(|f| {
                (0..f.tensors().len())
                    .filter(|&i| f.checksum(i).is_some())
                    .count()
            })
            .sum()
    }

    /// [`Error::NoTensors`] when the checkpoint holds no tensor (a merge or reshard
    /// would write an empty output); `None` otherwise.
    #[must_use]
    pub fn no_tensors(&self) -> Option<Error> {
        if !self.tensors.is_empty() {
            return None;
        }
        let mut files: Vec<String> = self
            .files
            .iter()
            .take(4)
            .map(|f| format!("{} ({})", f.path().display(), f.format().name()))
            .collect();
        if self.files.len() > 4 {
            files.push(format!("{} more", self.files.len() - 4));
        }
        Some(Error::NoTensors {
            files: if files.is_empty() {
                "the inputs".to_string()
            } else {
                files.join(", ")
            },
        })
    }

    /// Frees every tensor's pieces and further copies, keeping its name, dtype and
    /// shape, once a plan of the copy is made: the plan's ops then say all the copy
    /// reads (a merge's ops are its pieces, each once more), and holding both at once
    /// was a third of a many-tensor merge's memory. Files, strategy, carried files and
    /// notes stay for the copy and the writer's `finish`.
    pub fn release_pieces(&mut self) {
        for t in self.tensors.values_mut() {
            t.pieces = Vec::new();
            t.copies = Vec::new();
        }
    }

    /// Drops the checkpoint in a process that is about to exit: its files' mappings,
    /// scratch directories and mirrors are released as usual, but the descriptions of
    /// its tensors and pieces (several allocations each, freed one by one: 8 % of an
    /// `inspect` of 50,000 tensors on 8 ranks) are left for the exit to take back.
    pub fn drop_at_exit(mut self) {
        std::mem::forget(std::mem::take(&mut self.tensors));
        for f in &mut self.files {
            f.forget_entries();
        }
    }

    /// Total bytes of tensor data in all input files.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|f| f.tensors().iter().map(|t| t.end - t.start).sum::<u64>())
            .sum()
    }
}

impl PieceSource for Checkpoint {
    fn source_tensors(&self) -> &BTreeMap<String, SourceTensor> {
        &self.tensors
    }

    fn stored_shape(&self, file: usize, tensor: usize) -> &[u64] {
        &self.files[file].tensors()[tensor].shape
    }
}
