//! A Hugging Face model that `from_pretrained` loads (`merge --format hf`): the source
//! seen as the model ([`Checkpoint::hf_view`]: renamed and cut by the family's table),
//! written as `save_pretrained` writes it (`model.safetensors`, or shards of at most
//! 50 GB with the index), with `config.json` (the user's or the trainer's, else one
//! made from the model's shape), the `generation_config.json` beside the user's config,
//! and the tokenizer files (`--tokenizer`, else those a trainer kept).

use super::safetensors::Integrated;
use super::Writer;
use crate::checkpoint::{Checkpoint, HfModel};
use crate::error::{Error, Result};
use crate::formats::distcp::torch_dtype_name;
use crate::formats::output::write_file_atomic;
use crate::formats::read_small;
use crate::hf::TOKENIZER_FILES;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::Dtype;
use std::path::{Path, PathBuf};

/// transformers' `save_pretrained` default `max_shard_size` ("50GB", 10^9 bytes a GB;
/// transformers 5.24 `modeling_utils.py`).
pub const HF_MAX_SHARD_SIZE: u64 = 50_000_000_000;

/// `merge --format hf`, for a source already seen as the model.
#[derive(Clone, Debug)]
pub struct HfExport {
    /// The model (family, sizes, the config to write).
    pub model: HfModel,
    /// A directory whose tokenizer files are copied beside the model (`--tokenizer`).
    pub tokenizer: Option<PathBuf>,
    /// Shards of at most this many bytes ([`HF_MAX_SHARD_SIZE`] when `None`).
    pub max_shard_size: Option<u64>,
}

impl HfExport {
    fn files(&self) -> Integrated {
        Integrated {
            max_shard_size: Some(self.max_shard_size.unwrap_or(HF_MAX_SHARD_SIZE)),
            one_file: false,
            compression: None,
        }
    }
}

impl Writer for HfExport {
    fn name(&self) -> &'static str {
        "hf"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        self.files().plan(source, selection)
    }

    fn finish(
        &self,
        source: &Checkpoint,
        _: &Selection,
        plan: &CopyPlan,
        dir: &Path,
    ) -> Result<()> {
        self.files().write_index(plan, dir)?;
        // The config's `torch_dtype`: the first floating-point dtype written.
        let dtype = plan
            .files
            .iter()
            .flat_map(|f| &f.tensors)
            .map(|t| t.target.dtype)
            .find(|d| matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64))
            .unwrap_or(Dtype::F32);
        write_file_atomic(
            &dir.join("config.json"),
            self.model
                .config_json(torch_dtype_name(dtype).unwrap_or("float32"))?
                .as_bytes(),
        )?;
        let mut copies: Vec<PathBuf> = vec![];
        if let Some(gen) = self
            .model
            .user_config
            .as_deref()
            .and_then(Path::parent)
            .map(|d| d.join("generation_config.json"))
            .filter(|p| p.is_file())
        {
            copies.push(gen);
        }
        match &self.tokenizer {
            // Without --tokenizer: the tokenizer a trainer kept beside its weights.
            None => copies.extend(
                TOKENIZER_FILES
                    .iter()
                    .filter_map(|name| source.carried.get(*name))
                    .cloned(),
            ),
            Some(tok) => {
                let found: Vec<PathBuf> = TOKENIZER_FILES
                    .iter()
                    .map(|f| tok.join(f))
                    .filter(|p| p.is_file())
                    .collect();
                if found.is_empty() {
                    return Err(Error::UnknownInput {
                        problem: format!(
                            "--tokenizer {}: holds none of the tokenizer files ({})",
                            tok.display(),
                            TOKENIZER_FILES.join(", ")
                        ),
                    });
                }
                copies.extend(found);
            }
        }
        for from in copies {
            // Through the storage layer: beside a bucket's checkpoint, the file may
            // stand for an object not yet fetched.
            let bytes = read_small(&from)?;
            if let Some(name) = from.file_name() {
                write_file_atomic(&dir.join(name), &bytes)?;
            }
        }
        Ok(())
    }
}
