//! A Llama in another program's names whose query and key rows interleave the
//! rotary pairs (torchtitan's, llama.cpp's: [`crate::hf::InterleavedNames`]) seen in
//! Hugging Face's names, and back: each tensor renamed by the program's table, the
//! query and key projections' rows permuted between the interleaved layout and Hugging
//! Face's halves as a view of the stored pieces, one row a block, so the copy engine
//! streams them as any other.

use super::Checkpoint;
use crate::error::{Error, Result};
use crate::hf::{self, Family, InterleavedNames, RopeRows, Shape, TORCHTITAN};
use crate::layout::source::SourceTensor;
use std::collections::BTreeMap;

/// The Hugging Face tensor a program may keep under its own name when the model is
/// tied.
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
        self.tensors.contains_key(TORCHTITAN.rows[0].other)
    }

    /// Renames a Llama's tensors from `program`'s names to Hugging Face's (`to_hf`) or
    /// back, by its table; a tied model has no `lm_head.weight` in Hugging Face's
    /// names. The program's training state (torchtitan's `optimizer.*`,
    /// `lr_scheduler.*`, ...) is left out, said in a note.
    ///
    /// # Errors
    /// A family the program's names are not known for; a tensor of the table missing,
    /// or not the table's; a projection of another shape than the config gives.
    pub(crate) fn rename_interleaved(
        &mut self,
        program: &InterleavedNames,
        family: Family,
        shape: &Shape,
        to_hf: bool,
    ) -> Result<()> {
        let name = program.program;
        // llama.cpp's Mixtral is its Llama with experts, which the GGUF view takes out
        // first (`gguf_view`'s `unstack_mixtral_experts`): the rest is Llama's, less
        // the dense MLP.
        let mixtral = family == Family::Mixtral && name == hf::LLAMA_CPP.program;
        if !((matches!(family, Family::Llama | Family::Mistral) && shape.experts == 0) || mixtral) {
            return Err(Error::Unsupported {
                problem: format!(
                    "{name}'s names are known for its Llama (LlamaForCausalLM, MistralForCausalLM{}), not {}",
                    if name == hf::LLAMA_CPP.program { ", MixtralForCausalLM" } else { "" },
                    family.architecture()
                ),
            });
        }
        let (from_dir, to_dir) = if to_hf {
            (name, "Hugging Face")
        } else {
            ("Hugging Face", name)
        };
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        for row in program.rows {
            let (from, to) = if to_hf {
                (row.other, row.hf)
            } else {
                (row.hf, row.other)
            };
            if mixtral && row.hf.contains(".mlp.") {
                continue;
            }
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
        if !to_hf && shape.tied && program.tied_head_kept {
            if let Some(e) = out.get(program.rows[0].other).cloned() {
                out.insert(LM_HEAD.into(), e);
            }
        }
        let training: Vec<String> = self
            .tensors
            .keys()
            .filter(|n| program.state.iter().any(|p| n.starts_with(p)))
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
                "{} tensors of {name}'s training state ({}) are not carried",
                training.len(),
                program.state.join(", ")
            ));
        }
        self.tensors = out;
        self.strategy = None;
        self.notes.push(format!(
            "{from_dir}'s Llama names as {to_dir}'s; the query and key rows permuted between {name}'s interleaved rotary pairs and Hugging Face's halves"
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
        self.rename_interleaved(&TORCHTITAN, family, &shape, false)
    }
}
