//! torchtitan's Llama seen in Hugging Face's names, and back ([`crate::hf`]'s
//! `TORCHTITAN_LLAMA` table): each tensor renamed, the query and key projections'
//! rows permuted from torchtitan's interleaved rotary layout to Hugging Face's halves
//! (or back) as a view of the stored pieces, one row a block, so the copy engine
//! streams them as any other.

use super::Checkpoint;
use crate::error::{Error, Result};
use crate::hf::{self, Family, RopeRows, Shape, TORCHTITAN_LLAMA, TORCHTITAN_TRAINING_STATE};
use crate::layout::source::SourceTensor;
use std::collections::BTreeMap;

/// The tensor a torchtitan checkpoint always has, by which it is told apart.
const TITAN_EMBEDDING: &str = "tok_embeddings.weight";
/// The Hugging Face tensor torchtitan has under its own name when the model is tied.
const LM_HEAD: &str = "lm_head.weight";

fn invalid(tensor: &str, problem: String) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem,
    }
}

/// A `{l}` pattern filled for layer `l`.
fn at(pattern: &str, l: Option<u64>) -> String {
    match l {
        Some(l) => pattern.replace("{l}", &l.to_string()),
        None => pattern.to_string(),
    }
}

/// The rows of one projection turned from one rotary layout into the other.
fn rope_view(
    t: &SourceTensor,
    rope: RopeRows,
    shape: &Shape,
    to_hf: bool,
    name: &str,
) -> Result<SourceTensor> {
    let heads = match rope {
        RopeRows::AsTheyAre => return Ok(t.clone()),
        RopeRows::Query => shape.heads,
        RopeRows::Key => shape.groups,
    };
    let rows = heads.checked_mul(shape.head_dim);
    if !shape.head_dim.is_multiple_of(2) || t.shape.first().copied() != rows || t.shape.len() != 2 {
        return Err(invalid(
            name,
            format!(
                "has shape {:?}; the config gives {heads} heads of {} rows (an even head_dim) by the hidden size",
                t.shape, shape.head_dim
            ),
        ));
    }
    let blocks = hf::rope_blocks(heads, shape.head_dim, to_hf);
    Ok(t.regather(0, &blocks, heads * shape.head_dim))
}

impl Checkpoint {
    /// Whether the tensors are in torchtitan's names.
    pub(crate) fn is_torchtitan(&self) -> bool {
        self.tensors.contains_key(TITAN_EMBEDDING)
    }

    /// Renames a torchtitan Llama's tensors to Hugging Face's (`to_hf`) or back, by
    /// the table; a tied model has no `lm_head.weight` in Hugging Face's names
    /// (torchtitan's adapter drops it too). torchtitan's training state
    /// (`optimizer.*`, `lr_scheduler.*`, ...) is left out, said in a note.
    ///
    /// # Errors
    /// A family torchtitan's names are not known for; a tensor of the table missing, or
    /// not the table's; a projection of another shape than the config gives.
    pub(crate) fn rename_torchtitan(
        &mut self,
        family: Family,
        shape: &Shape,
        to_hf: bool,
    ) -> Result<()> {
        if !matches!(family, Family::Llama | Family::Mistral) || shape.experts > 0 {
            return Err(Error::Unsupported {
                problem: format!(
                    "torchtitan's names are known for its Llama (LlamaForCausalLM, MistralForCausalLM), not {}",
                    family.architecture()
                ),
            });
        }
        let (from_dir, to_dir) = if to_hf {
            ("torchtitan", "Hugging Face")
        } else {
            ("Hugging Face", "torchtitan")
        };
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        for row in &TORCHTITAN_LLAMA {
            let (from, to) = if to_hf {
                (row.titan, row.hf)
            } else {
                (row.hf, row.titan)
            };
            let layers: Vec<Option<u64>> = if from.contains("{l}") {
                (0..shape.layers).map(Some).collect()
            } else {
                vec![None]
            };
            for l in layers {
                let (src, dst) = (at(from, l), at(to, l));
                let Some(t) = self.tensors.remove(&src) else {
                    if row.hf == LM_HEAD && shape.tied {
                        continue;
                    }
                    return Err(invalid(
                        &src,
                        format!(
                            "missing: {from_dir}'s Llama of {} layers has it",
                            shape.layers
                        ),
                    ));
                };
                // Tied: one embedding in Hugging Face's names; torchtitan keeps the
                // head as its own parameter, the embedding's copy.
                if row.hf == LM_HEAD && shape.tied && to_hf {
                    continue;
                }
                out.insert(dst, rope_view(&t, row.rope, shape, to_hf, &src)?);
            }
        }
        if !to_hf && shape.tied {
            if let Some(e) = out.get(TORCHTITAN_LLAMA[0].titan).cloned() {
                out.insert(LM_HEAD.into(), e);
            }
        }
        let training: Vec<String> = self
            .tensors
            .keys()
            .filter(|n| TORCHTITAN_TRAINING_STATE.iter().any(|p| n.starts_with(p)))
            .cloned()
            .collect();
        if let Some(extra) = self.tensors.keys().find(|n| !training.contains(n)) {
            return Err(invalid(
                extra,
                format!("is not a tensor of {from_dir}'s Llama (nothing written)"),
            ));
        }
        if !training.is_empty() {
            self.notes.push(format!(
                "{} tensors of torchtitan's training state (optimizer, lr_scheduler, ...) are not carried",
                training.len()
            ));
        }
        self.tensors = out;
        self.strategy = None;
        self.notes.push(format!(
            "{from_dir}'s Llama names as {to_dir}'s; the query and key rows permuted between torchtitan's interleaved rotary pairs and Hugging Face's halves"
        ));
        Ok(())
    }
}

impl Checkpoint {
    /// Replaces a Hugging Face Llama's tensors by torchtitan's (the inverse of the
    /// export's renaming: the same table), for a DCP save torchtitan's
    /// `CheckpointManager` loads. The config is `target.config`, or the `config.json`
    /// beside the model.
    ///
    /// # Errors
    /// No Hugging Face config; a family other than Llama's; a tensor missing or not the
    /// family's.
    pub fn torchtitan_import(&mut self, target: &super::HfTarget) -> Result<()> {
        let path = target
            .config
            .clone()
            .or_else(|| self.carried.get("config.json").cloned())
            .ok_or_else(|| Error::Unsupported {
                problem: "--format torchtitan needs the model's Hugging Face config.json (beside the safetensors files, or --hf-config)".into(),
            })?;
        let text = String::from_utf8_lossy(&crate::formats::read_small(&path)?).into_owned();
        let (family, shape) = hf::read_config(&text, &path.display().to_string())?;
        family.check(&shape)?;
        self.rename_torchtitan(family, &shape, false)
    }
}
