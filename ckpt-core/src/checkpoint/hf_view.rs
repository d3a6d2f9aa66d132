//! A Megatron GPT checkpoint seen as a Hugging Face model ([`Checkpoint::hf_view`]):
//! its tensors renamed and cut by the family's table ([`crate::hf`]), each a view of the
//! stored pieces. The family and sizes come from the source's own record (Megatron's
//! args, in each legacy rank file or in a dist_ckpt's `common.pt`), from a Hugging Face
//! `config.json` the user names (which must agree with the args), or from `--hf-arch`;
//! where none settles it, the view is refused with the option that would.

use super::Checkpoint;
use super::OPTIMIZER_PREFIX;
use crate::error::{Error, Result};
use crate::formats::megatron::{self, Args};
use crate::hf::{self, Cut, Family, Shape};
use crate::layout::source::{Block, SourceTensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What the user said of the Hugging Face model to write.
#[derive(Clone, Debug, Default)]
pub struct HfTarget {
    /// A Hugging Face `config.json` to follow (`--hf-config`): it names the family,
    /// fills in what the source does not record, and is written as the output's config.
    pub config: Option<PathBuf>,
    /// A family by name (`--hf-arch`): `llama`, `mistral`, `qwen2`, `qwen3`,
    /// `gpt_bigcode`, or an architecture class name.
    pub arch: Option<String>,
}

/// The Hugging Face model a checkpoint was viewed as.
#[derive(Clone, Debug)]
pub struct HfModel {
    /// Its family.
    pub family: Family,
    /// Its sizes and features.
    pub shape: Shape,
    /// The user's config file, written as it is (`--hf-config`); `None` when ckpt
    /// writes one from `shape`.
    pub user_config: Option<PathBuf>,
}

impl HfModel {
    /// The `config.json` to write for tensors of `dtype` (torch's name): the user's
    /// file as it is, or one made from the model's shape.
    ///
    /// # Errors
    /// The user's file unreadable.
    pub fn config_json(&self, dtype: &str) -> Result<String> {
        match &self.user_config {
            Some(p) => std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.clone(),
                source,
            }),
            None => Ok(hf::config_json(self.family, &self.shape, dtype)),
        }
    }
}

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

fn invalid(tensor: &str, problem: String) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem,
    }
}

/// A row's name for layer `l`.
fn fill(pattern: &str, l: Option<u64>) -> String {
    match l {
        Some(l) => pattern.replace("{l}", &l.to_string()),
        None => pattern.to_string(),
    }
}

/// The shape Megatron's args give a model, and which of its features the args did not
/// record (then Megatron-LM's defaults are taken, and said).
fn shape_of_args(a: &Args, notes: &mut Vec<String>) -> Result<Shape> {
    let need = |v: Option<u64>, field: &str| {
        v.ok_or_else(|| {
            unsupported(format!(
                "the checkpoint's args lack {field}: give the model's Hugging Face config with --hf-config"
            ))
        })
    };
    let hidden = need(a.hidden, "hidden_size")?;
    let heads = need(a.heads, "num_attention_heads")?;
    let m = &a.model;
    let mut defaulted = vec![];
    let mut dflt = |field: &'static str, absent: bool| {
        if absent {
            defaulted.push(field);
        }
    };
    dflt("normalization", m.normalization.is_none());
    dflt("position_embedding_type", m.position_embedding.is_none());
    dflt("add_bias_linear", m.bias_linear.is_none());
    dflt("untie_embeddings_and_output_weights", m.untied.is_none());
    let bias = m.bias_linear.unwrap_or(true);
    let shape = Shape {
        layers: need(a.num_layers, "num_layers")?,
        hidden,
        heads,
        groups: a.query_groups.unwrap_or(heads),
        head_dim: a.kv().unwrap_or(0),
        ffn: a.ffn_hidden.unwrap_or(4 * hidden),
        vocab: a.vocab.or(a.padded_vocab).unwrap_or(0),
        max_positions: a.max_positions.unwrap_or(0),
        eps: m.norm_epsilon.unwrap_or(1e-5),
        rope_theta: m.rotary_base.unwrap_or(10000.0),
        swiglu: a.swiglu,
        layer_norm: m.normalization.as_deref().unwrap_or("LayerNorm") != "RMSNorm",
        learned_positions: m
            .position_embedding
            .as_deref()
            .unwrap_or("learned_absolute")
            == "learned_absolute",
        bias,
        qkv_bias: m.qkv_bias.unwrap_or(false) || bias,
        qk_norm: m.qk_layernorm.unwrap_or(false),
        tied: !m.untied.unwrap_or(false),
    };
    if !defaulted.is_empty() {
        notes.push(format!(
            "the args do not record {}: Megatron-LM's defaults taken",
            defaulted.join(", ")
        ));
    }
    if m.rotary_percent.is_some_and(|p| p != 1.0) {
        return Err(unsupported(format!(
            "args.rotary_percent is {:?}: the Hugging Face families ckpt writes rotate every channel (1.0)",
            m.rotary_percent
        )));
    }
    Ok(shape)
}

impl Checkpoint {
    /// Megatron's args of a Megatron checkpoint: a legacy rank file's, or a
    /// dist_ckpt's `common.pt`'s; `None` for other checkpoints.
    pub(crate) fn megatron_args(&self) -> Result<Option<Args>> {
        if let Some(f) = self
            .files
            .iter()
            .find(|f| f.metadata().get("format").map(String::as_str) == Some("megatron"))
        {
            return Ok(Some(megatron::source_state(f.path())?.args));
        }
        let dirs: BTreeSet<&Path> = self
            .files
            .iter()
            .filter_map(|f| f.path().parent())
            .collect();
        for dir in dirs {
            if let Some(args) = megatron::dist_ckpt_args(dir)? {
                return Ok(Some(args));
            }
        }
        Ok(None)
    }

    /// Replaces the tensors by those of the Hugging Face model the checkpoint is, named
    /// and cut by the family's table; the optimizer state is left out. Notes say what
    /// was decided.
    ///
    /// # Errors
    /// No family can be settled (the message names the option that settles it); the
    /// args and `--hf-config` disagree; a tensor the family needs is missing, has
    /// another shape than the sizes give it, or a tensor has no row in the table.
    pub fn hf_view(&mut self, target: &HfTarget) -> Result<HfModel> {
        let mut notes = vec![];
        let args = self.megatron_args()?;
        let from_args = args
            .as_ref()
            .map(|a| shape_of_args(a, &mut notes))
            .transpose()?;
        // The user's config, or a Hugging Face config.json found beside the source (ckpt's
        // own config.json has another schema: not taken).
        let mut user_config = target.config.clone();
        let from_config = match &target.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| Error::Io {
                    path: p.clone(),
                    source,
                })?;
                Some(hf::read_config(&text, &p.display().to_string())?)
            }
            None => self.carried.get("config.json").and_then(|p| {
                let text = std::fs::read_to_string(p).ok()?;
                let c = hf::read_config(&text, &p.display().to_string()).ok()?;
                notes.push(format!("Hugging Face config: {}", p.display()));
                user_config = Some(p.clone());
                Some(c)
            }),
        };
        let named = match &target.arch {
            Some(a) => Some(Family::from_name(a).ok_or_else(|| {
                unsupported(format!(
                    "--hf-arch {a}: not a family ckpt knows ({})",
                    Family::known()
                ))
            })?),
            None => None,
        };
        let (family, shape) = match (&from_args, &from_config) {
            (Some(s), Some((cf, cs))) => {
                let off = hf::disagreements(s, cs);
                if !off.is_empty() {
                    return Err(unsupported(format!(
                        "the checkpoint's args and {} disagree: {} (args vs config)",
                        user_config.as_deref().unwrap_or(Path::new("")).display(),
                        off.join(", ")
                    )));
                }
                cf.check(s)?;
                (named.unwrap_or(*cf), cs.clone())
            }
            (None, Some((cf, cs))) => (named.unwrap_or(*cf), cs.clone()),
            (Some(s), None) => {
                let f = match named {
                    Some(f) => {
                        f.check(s)?;
                        f
                    }
                    None => hf::family_of(s).ok_or_else(|| {
                        unsupported(format!(
                            "the checkpoint's args (swiglu {}, normalization {}, {} positions, linear bias {}, qkv bias {}, qk layernorm {}, {} heads in {} query groups) match no Hugging Face family ckpt knows ({}): name one with --hf-arch, or give the model's config with --hf-config",
                            s.swiglu,
                            if s.layer_norm { "LayerNorm" } else { "RMSNorm" },
                            if s.learned_positions { "learned" } else { "rotary" },
                            s.bias,
                            s.qkv_bias,
                            s.qk_norm,
                            s.heads,
                            s.groups,
                            Family::known()
                        ))
                    })?,
                };
                (f, s.clone())
            }
            (None, None) => {
                return Err(unsupported(
                    "the source records no model config (it is not a Megatron checkpoint with args): give the model's Hugging Face config with --hf-config".into(),
                ))
            }
        };
        if args.is_none() {
            return self.hf_names_as_they_are(family, shape, user_config, notes);
        }
        let rows = (shape.heads + 2 * shape.groups) * shape.head_dim;
        if shape.groups == 0 || shape.heads % shape.groups != 0 {
            return Err(unsupported(format!(
                "{} attention heads in {} query groups do not divide",
                shape.heads, shape.groups
            )));
        }
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        let mut used = BTreeSet::new();
        for row in family.rows() {
            if !family.applies(row, &shape) {
                continue;
            }
            let per_layer = row.megatron[0].contains("{l}");
            let layers: Vec<Option<u64>> = if per_layer {
                (0..shape.layers).map(Some).collect()
            } else {
                vec![None]
            };
            for l in layers {
                let names: Vec<String> = row.megatron.iter().map(|m| fill(m, l)).collect();
                let found: Vec<&String> = names
                    .iter()
                    .filter(|n| self.tensors.contains_key(*n))
                    .collect();
                let name = match found[..] {
                    [one] => one.clone(),
                    [] => {
                        return Err(invalid(
                            &names[0],
                            format!(
                                "missing: a {} of {} layers has it ({})",
                                family.architecture(),
                                shape.layers,
                                fill(row.hf[0], l)
                            ),
                        ))
                    }
                    _ => {
                        return Err(invalid(
                            &names[0],
                            format!("stored twice, also as {}", found[1]),
                        ))
                    }
                };
                let t = &self.tensors[&name];
                let first = t.shape.first().copied().unwrap_or(0);
                let parts: Vec<(Vec<Block>, u64)> = match row.cut {
                    Cut::Whole => vec![(
                        vec![Block {
                            from: 0,
                            len: first,
                            to: 0,
                        }],
                        first,
                    )],
                    Cut::Qkv => {
                        if first != rows {
                            return Err(invalid(&name, format!(
                                "has {first} rows, but {} heads in {} groups of {} channels make {rows}",
                                shape.heads, shape.groups, shape.head_dim
                            )));
                        }
                        hf::qkv_blocks(shape.groups, shape.heads / shape.groups, shape.head_dim)
                            .to_vec()
                    }
                    Cut::GateUp => {
                        if first != 2 * shape.ffn {
                            return Err(invalid(&name, format!(
                                "has {first} rows, but SwiGLU's gate and up of an MLP of {} make {}",
                                shape.ffn,
                                2 * shape.ffn
                            )));
                        }
                        hf::gate_up_blocks(shape.ffn).to_vec()
                    }
                    Cut::Vocab => {
                        if first < shape.vocab {
                            return Err(invalid(
                                &name,
                                format!(
                                    "has {first} rows, fewer than the vocabulary of {}",
                                    shape.vocab
                                ),
                            ));
                        }
                        if first > shape.vocab {
                            notes.push(format!(
                                "{name}: {} padding rows dropped ({first} rows, vocabulary {})",
                                first - shape.vocab,
                                shape.vocab
                            ));
                        }
                        vec![(
                            vec![Block {
                                from: 0,
                                len: shape.vocab,
                                to: 0,
                            }],
                            shape.vocab,
                        )]
                    }
                };
                for (hf_name, (blocks, n)) in row.hf.iter().zip(parts) {
                    let view = if row.cut == Cut::Whole {
                        t.clone()
                    } else {
                        t.regather(0, &blocks, n)
                    };
                    out.insert(fill(hf_name, l), view);
                }
                used.insert(name);
            }
        }
        let mut left = vec![];
        for name in self.tensors.keys() {
            if used.contains(name) || name.starts_with(OPTIMIZER_PREFIX) {
                continue;
            }
            if shape.tied && name == "output_layer.weight" {
                notes.push(
                    "output_layer.weight (the last stage's copy of the tied word embedding) left out: tie_word_embeddings".into(),
                );
                continue;
            }
            left.push(name.clone());
        }
        if let Some(first) = left.first() {
            return Err(invalid(
                first,
                format!(
                    "has no row in the {} table{}: nothing written (a layer beyond args.num_layers {}, or a feature the family lacks)",
                    family.model_type(),
                    if left.len() > 1 { format!(" (nor {} other tensors)", left.len() - 1) } else { String::new() },
                    shape.layers
                ),
            ));
        }
        notes.push(format!(
            "exported as {} ({} layers, hidden {}, {} heads in {} groups of {}, MLP {}, vocabulary {})",
            family.architecture(),
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.groups,
            shape.head_dim,
            shape.ffn,
            shape.vocab
        ));
        self.tensors = out;
        self.strategy = None;
        self.notes.extend(notes);
        Ok(HfModel {
            family,
            shape,
            user_config,
        })
    }

    /// A source already in Hugging Face's names (a DeepSpeed or DCP save of a
    /// transformers model, `module.` stripped): its tensors must be the family's.
    fn hf_names_as_they_are(
        &mut self,
        family: Family,
        shape: Shape,
        user_config: Option<PathBuf>,
        mut notes: Vec<String>,
    ) -> Result<HfModel> {
        let mut want = BTreeSet::new();
        for row in family.rows().iter().filter(|r| family.applies(r, &shape)) {
            let layers: Vec<Option<u64>> = if row.hf[0].contains("{l}") {
                (0..shape.layers).map(Some).collect()
            } else {
                vec![None]
            };
            for l in layers {
                want.extend(row.hf.iter().map(|h| fill(h, l)));
            }
        }
        let have: BTreeSet<String> = self
            .tensors
            .keys()
            .filter(|n| !n.starts_with(OPTIMIZER_PREFIX))
            .cloned()
            .collect();
        if let Some(missing) = want.difference(&have).next() {
            return Err(invalid(
                missing,
                format!(
                    "missing: {} of {} layers has it (the source's names must be Hugging Face's; --strip-prefix removes a wrapper's prefix)",
                    family.architecture(),
                    shape.layers
                ),
            ));
        }
        // The vocabulary rows: the config's vocabulary must fit the embedding (the
        // first row of the table), and the export holds exactly that many rows.
        if let Some(row) = family.rows().iter().find(|r| r.cut == Cut::Vocab) {
            let name = row.hf[0];
            let first = self
                .tensors
                .get(name)
                .and_then(|t| t.shape.first().copied())
                .unwrap_or(0);
            if first < shape.vocab {
                return Err(invalid(
                    name,
                    format!(
                        "has {first} rows, fewer than the vocabulary of {}",
                        shape.vocab
                    ),
                ));
            }
        }
        if let Some(extra) = have.difference(&want).next() {
            return Err(invalid(
                extra,
                format!(
                    "is not a tensor of {}: nothing written",
                    family.architecture()
                ),
            ));
        }
        self.tensors.retain(|n, _| want.contains(n));
        self.strategy = None;
        notes.push(format!(
            "tensors already in {}'s names",
            family.architecture()
        ));
        self.notes.extend(notes);
        Ok(HfModel {
            family,
            shape,
            user_config,
        })
    }
}
