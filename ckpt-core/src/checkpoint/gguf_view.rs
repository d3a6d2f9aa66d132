//! A GGUF seen as the Hugging Face model it was converted from (`merge model.gguf
//! --format hf`): llama.cpp's names and interleaved query/key rows turned back by
//! [`hf::LLAMA_CPP`] (the table the GGUF writer reads forwards), the Q8_0 blocks
//! dequantized by the engine, and the model's config read from the file's keys as
//! transformers' own GGUF loader reads them (`integrations/ggml.py`,
//! `GGUF_CONFIG_MAPPING["llama"]`; transformers 5.25).
//!
//! A Mixtral (`llama` with `expert_count`: llama.cpp's converter writes
//! `MixtralForCausalLM` as its `LlamaModel`) is read back as `MixtralForCausalLM`: each
//! layer's stacked `ffn_{gate,down,up}_exps.weight` `[experts, rows, cols]` becomes the
//! per-expert `block_sparse_moe.experts.E.{w1,w2,w3}.weight` that `save_pretrained`
//! writes, each a view of expert E's run of the stacked tensor (the stored bytes, no
//! copy), and `ffn_gate_inp.weight` the router `block_sparse_moe.gate.weight`.
//!
//! Where the keys do not say what the model is, the view is refused with what would
//! settle it: a rope scaling (llama.cpp keeps Llama 3's as a `rope_freqs.weight`
//! tensor of frequencies, not the config's factors) needs `--hf-config`.

use super::{Checkpoint, HfModel, HfTarget};
use crate::error::{Error, Result};
use crate::formats::gguf::{decode_metadata, GgmlType, Value};
use crate::formats::{FileFormat, TensorFile};
use crate::hf::{self, Family, Shape, LLAMA_CPP, LLAMA_CPP_MIXTRAL, LLAMA_CPP_MIXTRAL_EXPERTS};
use crate::layout::source::SourceTensor;
use crate::layout::Dtype;
use serde_json::{json, Map, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// The tensor llama.cpp's converter adds for Llama 3's rope scaling (gguf-py's
/// `MODEL_TENSOR.ROPE_FREQS`): frequencies the Hugging Face config computes from its
/// `rope_parameters`.
const ROPE_FREQS: &str = "rope_freqs.weight";

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

fn invalid(tensor: &str, problem: String) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem,
    }
}

/// A GGUF's key-value pairs by key.
struct Keys<'a> {
    path: &'a Path,
    arch: String,
    kv: BTreeMap<String, Value>,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.kv.get(&format!("{}.{key}", self.arch))
    }

    fn count(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    unsupported(format!(
                        "{}: key `{}.{key}` is not a count ({v:?})",
                        self.path.display(),
                        self.arch
                    ))
                })
            })
            .transpose()
    }

    fn need(&self, key: &str) -> Result<u64> {
        self.count(key)?.ok_or_else(|| {
            unsupported(format!(
                "{}: no `{}.{key}`: the model's config cannot be read from the file (give it with --hf-config)",
                self.path.display(),
                self.arch
            ))
        })
    }

    fn float(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }
}

impl Checkpoint {
    /// The GGUF among the source's files, if any.
    fn gguf_file(&self) -> Option<&TensorFile> {
        self.files.iter().find(|f| f.format() == FileFormat::Gguf)
    }

    /// The checkpoint as the Hugging Face model its GGUF was converted from; `None`
    /// when no file is a GGUF.
    ///
    /// # Errors
    /// Several files, an architecture or rope scaling not mapped back, keys missing,
    /// `--hf-config` disagreeing with the keys, a tensor missing or of another shape.
    pub(super) fn gguf_as_hf(&mut self, target: &HfTarget) -> Result<Option<HfModel>> {
        let Some(file) = self.gguf_file() else {
            return Ok(None);
        };
        let path = file.path().to_path_buf();
        if self.files.len() != 1 {
            return Err(unsupported(format!(
                "{}: a GGUF is a whole model in one file; read as a Hugging Face model it cannot be merged with {} other files",
                path.display(),
                self.files.len() - 1
            )));
        }
        let (kv, types) = decode_metadata(file.metadata())?;
        let kv: BTreeMap<String, Value> = kv.into_iter().collect();
        let arch = kv
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if arch != "llama" {
            return Err(unsupported(format!(
                "{}: a GGUF of llama.cpp's `{arch}` architecture: only `llama` (Llama, Mistral, Mixtral) is mapped back to Hugging Face's names",
                path.display()
            )));
        }
        let keys = Keys {
            path: &path,
            arch,
            kv,
        };
        let mut notes = vec![format!(
            "the model's config from {}'s keys (as transformers' GGUF loader reads them)",
            path.display()
        )];
        let from_keys = self.config_of_keys(&keys)?;
        let (from_keys_family, from_keys_shape) =
            hf::read_config(&from_keys.to_string(), &path.display().to_string())?;
        let rope_scaling = keys
            .get("rope.scaling.type")
            .and_then(Value::as_str)
            .filter(|t| *t != "none")
            .map(str::to_string)
            .or_else(|| {
                self.tensors
                    .contains_key(ROPE_FREQS)
                    .then(|| "llama3".into())
            });
        let named = target.family()?;
        let (family, shape, user_config) = match &target.config {
            Some(p) => {
                let text = String::from_utf8_lossy(&crate::formats::read_small(p)?).into_owned();
                let (family, shape) = hf::read_config(&text, &p.display().to_string())?;
                let off = hf::disagreements(&from_keys_shape, &shape);
                if !off.is_empty() || from_keys_shape.tied != shape.tied {
                    let mut off = off;
                    if from_keys_shape.tied != shape.tied {
                        off.push(format!(
                            "tied embeddings {} vs {}",
                            from_keys_shape.tied, shape.tied
                        ));
                    }
                    return Err(unsupported(format!(
                        "{} and {} disagree: {} (GGUF vs config)",
                        path.display(),
                        p.display(),
                        off.join(", ")
                    )));
                }
                if rope_scaling.is_some() && self.tensors.remove(ROPE_FREQS).is_some() {
                    notes.push(format!(
                        "{ROPE_FREQS} left out: {} gives the rope scaling it was computed from",
                        p.display()
                    ));
                }
                notes[0] = format!("the model's config from {}", p.display());
                (named.unwrap_or(family), shape, Some(p.clone()))
            }
            None => {
                if let Some(kind) = rope_scaling {
                    return Err(unsupported(format!(
                        "{}: the model has a rope scaling ({kind}) that llama.cpp keeps as {} rather than the config's parameters: give the model's Hugging Face config with --hf-config",
                        path.display(),
                        if self.tensors.contains_key(ROPE_FREQS) {
                            format!("the frequencies of {ROPE_FREQS}")
                        } else {
                            "its own keys".into()
                        }
                    )));
                }
                (named.unwrap_or(from_keys_family), from_keys_shape, None)
            }
        };
        family.check(&shape)?;
        let dtype = self.gguf_dtype(&file_types(&types));
        if let Some(d) = dtype {
            notes.push(format!(
                "the model is written in {} where --dtype names no other ({})",
                crate::layout::strategy::dtype_name(d),
                if d == Dtype::F32 && types.values().any(|t| *t == GgmlType::Q8_0) {
                    "Q8_0 blocks dequantize exactly in F32"
                } else {
                    "its matrices' dtype; GGUF keeps the norms in F32"
                }
            ));
        }
        let experts = if family == Family::Mixtral {
            self.unstack_mixtral_experts(&shape, &types)?
        } else {
            Vec::new()
        };
        self.rename_interleaved(&LLAMA_CPP, family, &shape, true)?;
        if !experts.is_empty() {
            notes.push(format!(
                "the experts of {} layers stacked by llama.cpp (ffn_gate_exps, ffn_down_exps, ffn_up_exps) as Mixtral's per-expert w1, w2, w3: each expert's run of the stacked tensor",
                shape.layers
            ));
        }
        self.tensors.extend(experts);
        let mut model = self.hf_names_as_they_are(family, shape, user_config, notes, true)?;
        model.dtype = dtype;
        Ok(Some(model))
    }

    /// Mixtral's tensors out of a `llama` GGUF with experts, in Hugging Face's names:
    /// each layer's three stacks (`hf::LLAMA_CPP_MIXTRAL_EXPERTS`), expert `x` of
    /// `[experts, rows, cols]` the view of rows `x * rows ..` (`SourceTensor::run_rows`),
    /// and the router (`hf::LLAMA_CPP_MIXTRAL`); taken out of `self.tensors`.
    ///
    /// # Errors
    /// A stack or router missing, of another shape than the keys give, or in Q8_0
    /// blocks (not cut per expert).
    fn unstack_mixtral_experts(
        &mut self,
        shape: &Shape,
        types: &BTreeMap<String, GgmlType>,
    ) -> Result<Vec<(String, SourceTensor)>> {
        let table = &LLAMA_CPP_MIXTRAL_EXPERTS;
        let e = shape.experts;
        let mut out = Vec::new();
        for l in 0..shape.layers {
            let at = |p: &str| p.replace("{l}", &l.to_string());
            for row in LLAMA_CPP_MIXTRAL {
                let name = at(row.other);
                let t = self.tensors.remove(&name).ok_or_else(|| {
                    invalid(
                        &name,
                        format!("missing: a Mixtral of {} layers has it", shape.layers),
                    )
                })?;
                out.push((at(row.hf), t));
            }
            for (gguf, proj) in table.stacks {
                let name = at(gguf);
                let t = self.tensors.remove(&name).ok_or_else(|| {
                    invalid(
                        &name,
                        format!(
                            "missing: a Mixtral of {} layers and {e} experts has it",
                            shape.layers
                        ),
                    )
                })?;
                if types.get(&name) == Some(&GgmlType::Q8_0) {
                    return Err(invalid(
                        &name,
                        "is in Q8_0 blocks: stacked experts are read back from F32, F16 or BF16 only".into(),
                    ));
                }
                let (h, f) = (shape.hidden, shape.moe_ffn);
                let (rows, cols) = if proj == "w2" { (h, f) } else { (f, h) };
                if t.shape != [e, rows, cols] {
                    return Err(invalid(
                        &name,
                        format!(
                            "is {:?}, but {e} experts of FFN {f} and hidden {h} make {:?} (llama.cpp's stacked {proj})",
                            t.shape,
                            [e, rows, cols]
                        ),
                    ));
                }
                let files = &self.files;
                let stored = |fi: usize, i: usize| files[fi].tensors()[i].shape.clone();
                for x in 0..e {
                    let view = t
                        .run_rows(x * rows * cols, rows, cols, stored)
                        .map_err(|p| invalid(&name, format!("expert {x}: {p}")))?;
                    out.push((
                        format!("model.layers.{l}.{}.{x}.{proj}.weight", table.module),
                        view,
                    ));
                }
            }
        }
        Ok(out)
    }

    /// The Hugging Face `config.json` a GGUF's keys give (transformers' mapping for
    /// `llama`); the vocabulary from `llama.vocab_size`, else the tokenizer's tokens,
    /// else the embedding's rows; tied when there is no `output.weight`. With
    /// `llama.expert_count` it is a `MixtralForCausalLM` (the converter's `LlamaModel`
    /// writes Mixtral's `num_local_experts` and `num_experts_per_tok` as
    /// `expert_count` and `expert_used_count`, its experts' FFN as
    /// `feed_forward_length`, transformers' `GGUF_CONFIG_MAPPING` for `mixtral`).
    fn config_of_keys(&self, keys: &Keys<'_>) -> Result<Json> {
        let hidden = keys.need("embedding_length")?;
        let heads = keys.need("attention.head_count")?;
        let head_dim = match keys.count("attention.key_length")? {
            Some(d) => d,
            None => keys
                .count("rope.dimension_count")?
                .unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
        };
        if let Some(rot) = keys.count("rope.dimension_count")? {
            if rot != head_dim {
                return Err(unsupported(format!(
                    "{}: rotary dims {rot} of heads of {head_dim}: a partial rotary embedding is not Llama's",
                    keys.path.display()
                )));
            }
        }
        let embedding = LLAMA_CPP.rows[0].other;
        let vocab = match keys.count("vocab_size")? {
            Some(v) => v,
            None => match keys.kv.get("tokenizer.ggml.tokens") {
                Some(Value::Strings(t)) => t.len() as u64,
                _ => self
                    .tensors
                    .get(embedding)
                    .and_then(|t| t.shape.first().copied())
                    .unwrap_or(0),
            },
        };
        let experts = keys.count("expert_count")?.filter(|&e| e > 0);
        let family = if experts.is_some() {
            Family::Mixtral
        } else {
            Family::Llama
        };
        let mut c = Map::new();
        c.insert("architectures".into(), json!([family.architecture()]));
        c.insert("model_type".into(), json!(family.model_type()));
        if let Some(e) = experts {
            c.insert("num_local_experts".into(), json!(e));
            c.insert(
                "num_experts_per_tok".into(),
                json!(keys.need("expert_used_count")?),
            );
        }
        c.insert("hidden_size".into(), json!(hidden));
        c.insert("num_hidden_layers".into(), json!(keys.need("block_count")?));
        c.insert(
            "intermediate_size".into(),
            json!(keys.need("feed_forward_length")?),
        );
        c.insert("num_attention_heads".into(), json!(heads));
        c.insert(
            "num_key_value_heads".into(),
            json!(keys.count("attention.head_count_kv")?.unwrap_or(heads)),
        );
        c.insert("head_dim".into(), json!(head_dim));
        if let Some(n) = keys.count("context_length")? {
            c.insert("max_position_embeddings".into(), json!(n));
        }
        let eps = keys
            .float("attention.layer_norm_rms_epsilon")
            .ok_or_else(|| {
                unsupported(format!(
                    "{}: no `{}.attention.layer_norm_rms_epsilon` (give the model's config with --hf-config)",
                    keys.path.display(),
                    keys.arch
                ))
            })?;
        c.insert("rms_norm_eps".into(), json!(eps));
        c.insert(
            "rope_theta".into(),
            json!(keys.float("rope.freq_base").unwrap_or(10000.0)),
        );
        c.insert("vocab_size".into(), json!(vocab));
        c.insert(
            "tie_word_embeddings".into(),
            json!(!self.tensors.contains_key(LLAMA_CPP.rows[1].other)),
        );
        Ok(Json::Object(c))
    }

    /// The dtype the model takes without `--dtype`: F32 when a kept tensor is Q8_0
    /// (its values `d * q` are exact in F32 alone), else the matrices' one dtype
    /// (llama.cpp keeps norms in F32 beside F16 or BF16 matrices); `None` when the
    /// matrices differ.
    fn gguf_dtype(&self, q8_0: &[String]) -> Option<Dtype> {
        if q8_0.iter().any(|n| self.tensors.contains_key(n)) {
            return Some(Dtype::F32);
        }
        let mut matrices = self
            .tensors
            .values()
            .filter(|t| t.shape.len() == 2)
            .map(|t| t.dtype);
        let first = matrices.next();
        first.filter(|d| matrices.all(|m| m == *d))
    }
}

/// The tensors whose bytes are Q8_0 blocks.
fn file_types(types: &BTreeMap<String, GgmlType>) -> Vec<String> {
    types
        .iter()
        .filter(|(_, t)| **t == GgmlType::Q8_0)
        .map(|(n, _)| n.clone())
        .collect()
}
