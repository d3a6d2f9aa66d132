//! A Megatron GPT checkpoint seen as a Hugging Face model ([`Checkpoint::hf_view`]):
//! its tensors renamed and cut by the family's table ([`crate::hf`]), each a view of the
//! stored pieces. The family and sizes come from the source's own record (Megatron's
//! args, in each legacy rank file or in a dist_ckpt's `common.pt`), from a Hugging Face
//! `config.json` the user names (which must agree with the args), or from `--hf-arch`;
//! where none settles it, the view is refused with the option that would.

use super::{Checkpoint, OPTIMIZER_PREFIX};
use crate::error::{Error, Result};
use crate::formats::detect::trainers::RECORD_NOT_READ;
use crate::formats::distcp::torch_dtype_name;
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
    /// The dtype the output takes when `--dtype` names none, where the source's own
    /// dtypes would not make a model (a GGUF's Q8_0 blocks, its F32 norms beside F16
    /// matrices).
    pub dtype: Option<crate::layout::Dtype>,
}

impl HfTarget {
    /// The family `--hf-arch` names, if it names one.
    ///
    /// # Errors
    /// A name that is no family ckpt knows.
    pub(crate) fn family(&self) -> Result<Option<Family>> {
        self.arch
            .as_deref()
            .map(|a| {
                Family::from_name(a).ok_or_else(|| {
                    unsupported(format!(
                        "--hf-arch {a}: not a family ckpt knows ({})",
                        Family::known()
                    ))
                })
            })
            .transpose()
    }
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

/// Whether `name` holds one of `want`'s names inside it, with more before or after
/// (`optimizer.state.model.norm.weight.exp_avg` of `model.norm.weight`): a parameter's
/// training state, not a tensor of the model.
fn names_a_tensor_inside(name: &str, want: &BTreeSet<String>) -> bool {
    let dots: Vec<usize> = std::iter::once(0)
        .chain(name.match_indices('.').map(|(i, _)| i + 1))
        .collect();
    let ends: Vec<usize> = name
        .match_indices('.')
        .map(|(i, _)| i)
        .chain(std::iter::once(name.len()))
        .collect();
    dots.iter().any(|&a| {
        ends.iter()
            .filter(|&&b| b > a && (a > 0 || b < name.len()))
            .any(|&b| want.contains(&name[a..b]))
    })
}

/// The word embedding's name in Megatron's models: a checkpoint holding it (under a
/// wrapper's prefix or not) has Megatron's names.
const MEGATRON_EMBEDDING: &str = "embedding.word_embeddings.weight";

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

fn invalid(tensor: &str, problem: String) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem,
    }
}

/// Where a row is filled: a layer (`{l}`) and an expert (`{e}`), where it names them.
#[derive(Clone, Copy, Debug)]
struct At {
    layer: Option<u64>,
    expert: Option<u64>,
}

/// A row's name at `at`.
fn fill(pattern: &str, at: At) -> String {
    let mut n = pattern.to_string();
    if let Some(l) = at.layer {
        n = n.replace("{l}", &l.to_string());
    }
    if let Some(e) = at.expert {
        n = n.replace("{e}", &e.to_string());
    }
    n
}

/// Where a row's `pattern` is filled: every layer of the model where it names one
/// (`{l}`), and every expert where it names one (`{e}`); else once.
fn layers(pattern: &str, shape: &Shape) -> Vec<At> {
    let ls: Vec<Option<u64>> = if pattern.contains("{l}") {
        (0..shape.layers).map(Some).collect()
    } else {
        vec![None]
    };
    let es: Vec<Option<u64>> = if pattern.contains("{e}") {
        (0..shape.experts).map(Some).collect()
    } else {
        vec![None]
    };
    ls.iter()
        .flat_map(|&layer| es.iter().map(move |&expert| At { layer, expert }))
        .collect()
}

/// The FFN size a gate/up cut splits at: the dense MLP's, an expert's or the shared
/// expert's.
fn gate_up_ffn(cut: Cut, shape: &Shape) -> u64 {
    match cut {
        Cut::ExpertGateUp => shape.moe_ffn,
        Cut::SharedGateUp => shape.shared_ffn,
        _ => shape.ffn,
    }
}

/// The shape Megatron's args give a model, and which of its features the args did not
/// record (then Megatron-LM's defaults are taken, and said).
fn shape_of_args(a: &Args, grouped_held: bool, notes: &mut Vec<String>) -> Result<Shape> {
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
        ffn: a.ffn_hidden.unwrap_or(hidden.saturating_mul(4)),
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
        ..Shape::default()
    };
    let mut shape = shape;
    let moe = &a.moe;
    if let Some(experts) = moe.experts {
        shape.experts = experts;
        shape.topk = need(moe.topk, "moe_router_topk")?;
        shape.moe_ffn = moe.ffn.unwrap_or(shape.ffn);
        shape.shared_ffn = moe.shared_ffn.unwrap_or(0);
        shape.shared_gate = moe.shared_gate;
        // Megatron's softmax over the top-k logits is a renormalised top-k.
        shape.norm_topk = !moe.pre_softmax;
        let score = moe.score_function.as_deref().unwrap_or("softmax");
        shape.moe_unsupported = if moe.grouped_gemm && grouped_held {
            // (Read with --per-layer, as `--format hf` reads, they are given per expert.)
            Some("the grouped expert layer (args.moe_grouped_gemm) read as its grouped weights (mlp.experts.weight1/weight2) rather than per expert".into())
        } else if score != "softmax" {
            Some(format!(
                "router scores by {score} (args.moe_router_score_function)"
            ))
        } else if moe.expert_bias {
            Some("a router expert bias (args.moe_router_enable_expert_bias)".into())
        } else {
            moe.dense_layers
                .as_ref()
                .map(|f| format!("layers without experts (args.moe_layer_freq {f})"))
        };
    }
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

/// The rows of the fused QKV projection: `(heads + 2 * groups) * head_dim`.
fn qkv_rows(shape: &Shape) -> Result<u64> {
    shape
        .groups
        .checked_mul(2)
        .and_then(|g| g.checked_add(shape.heads))
        .and_then(|n| n.checked_mul(shape.head_dim))
        .ok_or_else(|| crate::error::overflow("the QKV projection's rows"))
}

/// One tensor made of `parts` placed by `blocks` (each part's blocks map rows of the
/// whole to rows of the part, as the family's cuts give them): the inverse of the cut,
/// the stored pieces moved, nothing copied.
fn fused(
    parts: &[&SourceTensor],
    blocks: &[(Vec<Block>, u64)],
    rows: u64,
    name: &str,
) -> Result<SourceTensor> {
    let mut whole: Option<SourceTensor> = None;
    for (part, (bs, n)) in parts.iter().zip(blocks) {
        if part.shape.first() != Some(n) {
            return Err(invalid(
                name,
                format!(
                    "a part of it has shape {:?}, the model's sizes give it {n} rows",
                    part.shape
                ),
            ));
        }
        let back: Vec<Block> = bs
            .iter()
            .map(|b| Block {
                from: b.to,
                len: b.len,
                to: b.from,
            })
            .collect();
        let placed = part.regather(0, &back, rows);
        match &mut whole {
            None => whole = Some(placed),
            Some(w) => {
                if w.dtype != placed.dtype || w.shape != placed.shape {
                    return Err(invalid(name, "its parts differ in dtype or shape".into()));
                }
                w.pieces.extend(placed.pieces);
                w.copies.extend(placed.copies);
            }
        }
    }
    whole.ok_or_else(|| invalid(name, "no parts".into()))
}

impl Checkpoint {
    /// The args a Megatron legacy output of this checkpoint carries: those of the
    /// model imported from Hugging Face, or the source's own (its first rank file's).
    ///
    /// # Errors
    /// Neither (the source is not Megatron's and was not imported).
    pub(crate) fn megatron_state(&self) -> Result<megatron::SourceState> {
        if let Some(s) = &self.imported {
            return Ok(s.clone());
        }
        let first = self
            .files
            .iter()
            .find(|f| f.metadata().get("format").map(String::as_str) == Some("megatron"))
            .ok_or_else(|| {
                unsupported(
                    "--format megatron and megatron-dist write Megatron checkpoints from a Megatron legacy source (its args are carried) or from a Hugging Face model (its config.json beside it): this source is neither (a dist_ckpt source: export it with `ckpt merge SRC --format hf` and import that)".into(),
                )
            })?;
        megatron::source_state(first.path())
    }

    /// Whether the checkpoint is Megatron's (legacy rank files, or a dist_ckpt with
    /// Megatron-LM's args in its common.pt): its tensors have Megatron's names already.
    #[must_use]
    pub fn is_megatron(&self) -> bool {
        self.files
            .iter()
            .any(|f| f.metadata().get("format").map(String::as_str) == Some("megatron"))
            || self.megatron_args().ok().flatten().is_some()
    }

    /// Replaces a Hugging Face model's tensors by Megatron's, named and fused by the
    /// family's table (the inverse of [`Checkpoint::hf_view`]: the same rows), placed
    /// on one rank by megatron-core's rules, with the args a legacy output carries.
    /// The config is `target.config`, or the `config.json` beside the model.
    ///
    /// # Errors
    /// No Hugging Face config; a family the tables do not know; a tensor missing, of
    /// another shape than the config gives, or not the family's.
    pub fn megatron_import(&mut self, target: &HfTarget) -> Result<()> {
        let path = target
            .config
            .clone()
            .or_else(|| self.carried.get("config.json").cloned())
            .ok_or_else(|| {
                unsupported(
                    "--format megatron from a model that is not Megatron's needs its Hugging Face config.json (beside the safetensors files, or --hf-config)".into(),
                )
            })?;
        let text = String::from_utf8_lossy(&crate::formats::read_small(&path)?).into_owned();
        let (config_family, shape) = hf::read_config(&text, &path.display().to_string())?;
        let family = target.family()?.unwrap_or(config_family);
        family.check(&shape)?;
        if shape.groups == 0 || shape.heads % shape.groups != 0 {
            return Err(unsupported(format!(
                "{}: {} attention heads in {} key/value heads do not divide",
                path.display(),
                shape.heads,
                shape.groups
            )));
        }
        let have: BTreeSet<&String> = self.tensors.keys().collect();
        let dtype = self
            .tensors
            .values()
            .map(|t| t.dtype)
            .next()
            .unwrap_or(crate::layout::Dtype::F32);
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        let mut used: BTreeSet<String> = BTreeSet::new();
        let qkv_rows = qkv_rows(&shape)?;
        for row in &family.rows() {
            if !family.applies(row, &shape) {
                continue;
            }
            for l in layers(row.megatron[0], &shape) {
                let names: Vec<String> = row.hf.iter().map(|h| fill(h, l)).collect();
                let mut parts = Vec::with_capacity(names.len());
                for n in &names {
                    let t = self.tensors.get(n).ok_or_else(|| {
                        invalid(
                            n,
                            format!(
                                "missing: {} of {} layers has it ({})",
                                family.architecture(),
                                shape.layers,
                                path.display()
                            ),
                        )
                    })?;
                    parts.push(t);
                }
                let meg = fill(row.megatron[0], l);
                let t = match row.cut {
                    Cut::Whole => parts[0].clone(),
                    Cut::Vocab => {
                        let rows = parts[0].shape.first().copied().unwrap_or(0);
                        if rows != shape.vocab {
                            return Err(invalid(
                                &names[0],
                                format!(
                                    "has {rows} rows, the config's vocabulary is {}",
                                    shape.vocab
                                ),
                            ));
                        }
                        parts[0].clone()
                    }
                    Cut::Qkv => {
                        let b = hf::qkv_blocks(
                            shape.groups,
                            shape.heads / shape.groups,
                            shape.head_dim,
                        );
                        fused(&parts, &b, qkv_rows, &meg)?
                    }
                    Cut::GateUp | Cut::ExpertGateUp | Cut::SharedGateUp => {
                        let ffn = gate_up_ffn(row.cut, &shape);
                        fused(&parts, &hf::gate_up_blocks(ffn), 2 * ffn, &meg)?
                    }
                };
                out.insert(meg, t);
                used.extend(names);
            }
        }
        if let Some(extra) = have.iter().find(|n| !used.contains(n.as_str())) {
            return Err(invalid(
                extra,
                format!(
                    "is not a tensor of {} (nothing written)",
                    family.architecture()
                ),
            ));
        }
        // Tied embeddings: the last of several pipeline stages keeps a copy of the word
        // embedding as its output layer (dropped again where there is one stage).
        if shape.tied {
            if let Some(e) = out.get("embedding.word_embeddings.weight").cloned() {
                out.insert("output_layer.weight".into(), e);
            }
        }
        let dtype_name = torch_dtype_name(dtype).unwrap_or("float32");
        let state = megatron::imported_state(&megatron::ImportedModel {
            layers: shape.layers,
            hidden: shape.hidden,
            heads: shape.heads,
            groups: shape.groups,
            kv_channels: shape.head_dim,
            ffn: shape.ffn,
            vocab: shape.vocab,
            max_positions: shape.max_positions,
            eps: shape.eps,
            rotary_base: shape.rope_theta,
            swiglu: shape.swiglu,
            rms_norm: !shape.layer_norm,
            learned_positions: shape.learned_positions,
            bias: shape.bias,
            qkv_bias: shape.qkv_bias && !shape.bias,
            qk_layernorm: shape.qk_norm,
            tied: shape.tied,
            experts: (shape.experts > 0).then_some(megatron::ImportedExperts {
                experts: shape.experts,
                topk: shape.topk,
                ffn: shape.moe_ffn,
                shared_ffn: shape.shared_ffn,
                shared_gate: shape.shared_gate,
                norm_topk: shape.norm_topk,
            }),
            dtype: dtype_name,
        })?;
        let list: Vec<(String, crate::layout::Dtype, Vec<u64>)> = out
            .iter()
            .map(|(n, t)| (n.clone(), t.dtype, t.shape.clone()))
            .collect();
        self.strategy = Some(megatron::imported_strategy(&state.args, &list)?);
        self.tensors = out;
        self.notes.push(format!(
            "imported {} ({}) as megatron-core's GPT model: a release checkpoint, vocabulary {} unpadded (train it with --make-vocab-size-divisible-by 1)",
            family.architecture(),
            path.display(),
            shape.vocab
        ));
        self.imported = Some(state);
        Ok(())
    }

    /// Megatron's args of a Megatron checkpoint: a legacy rank file's, or a
    /// dist_ckpt's `common.pt`'s; `None` for other checkpoints.
    pub(crate) fn megatron_args(&self) -> Result<Option<Args>> {
        Ok(self
            .stored_megatron_args()?
            .or_else(|| self.recorded_args.as_ref().map(|(a, _)| a.clone())))
    }

    /// The args the files themselves hold (a legacy rank file's, a dist_ckpt's
    /// `common.pt`'s), not a trainer's record beside them.
    fn stored_megatron_args(&self) -> Result<Option<Args>> {
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
        if let Some(model) = self.gguf_as_hf(target)? {
            return Ok(model);
        }
        let mut notes = vec![];
        // The files' own args (read once: a rank file's or common.pt's pickle), else the
        // trainer's record beside them.
        let stored = self.stored_megatron_args()?;
        let recorded = stored.is_none() && self.recorded_args.is_some();
        let args = match stored {
            Some(a) => Some(a),
            None => self.recorded_args.as_ref().map(|(a, p)| {
                notes.push(format!(
                    "the model's sizes from {} (the trainer's record, in Megatron's terms)",
                    p.display()
                ));
                a.clone()
            }),
        };
        let from_args = args
            .as_ref()
            .map(|a| {
                let grouped = self.tensors.keys().any(|n| megatron::is_grouped_weight(n));
                shape_of_args(a, grouped, &mut notes)
            })
            .transpose()?;
        // The user's config, or a Hugging Face config.json found beside the source (ckpt's
        // own config.json has another schema: not taken).
        let mut user_config = target.config.clone();
        // Why a config.json beside the source was not taken, said when nothing else
        // gives the model (a Hugging Face config ckpt refuses, not ckpt's own).
        let mut carried_refused = None;
        let from_config = match &target.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| Error::Io {
                    path: p.clone(),
                    source,
                })?;
                Some(hf::read_config(&text, &p.display().to_string())?)
            }
            None => self.carried.get("config.json").and_then(|p| {
                let text = String::from_utf8(crate::formats::read_small(p).ok()?).ok()?;
                let c = match hf::read_config(&text, &p.display().to_string()) {
                    Ok(c) => c,
                    Err(e) => {
                        // A Hugging Face config ckpt refuses (not another schema).
                        let hf_config =
                            serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|d| {
                                d.get("architectures").is_some() || d.get("model_type").is_some()
                            });
                        if hf_config {
                            carried_refused = Some(e);
                        }
                        return None;
                    }
                };
                notes.push(format!("Hugging Face config: {}", p.display()));
                user_config = Some(p.clone());
                Some(c)
            }),
        };
        let named = target.family()?;
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
                            "the checkpoint's args (swiglu {}, normalization {}, {} positions, linear bias {}, qkv bias {}, qk layernorm {}, {} heads in {} query groups{}) match no Hugging Face family ckpt knows ({}): name one with --hf-arch, or give the model's config with --hf-config",
                            s.swiglu,
                            if s.layer_norm { "LayerNorm" } else { "RMSNorm" },
                            if s.learned_positions { "learned" } else { "rotary" },
                            s.bias,
                            s.qkv_bias,
                            s.qk_norm,
                            s.heads,
                            s.groups,
                            match (&s.moe_unsupported, s.experts) {
                                (Some(why), _) => format!(", {} experts with {why}", s.experts),
                                (None, 0) => String::new(),
                                (None, e) => format!(", {e} experts"),
                            },
                            Family::known()
                        ))
                    })?,
                };
                (f, s.clone())
            }
            (None, None) => {
                if let Some(e) = carried_refused {
                    return Err(e);
                }
                // A trainer's record that could not be read says why.
                let why = self
                    .notes
                    .iter()
                    .find(|n| n.starts_with(RECORD_NOT_READ))
                    .map_or(String::new(), |n| format!(" ({n})"));
                return Err(unsupported(format!(
                    "the source records no model config (it is not a Megatron checkpoint with args){why}: give the model's Hugging Face config with --hf-config"
                )));
            }
        };
        // Megatron's names without Megatron-LM's args: a dist_ckpt megatron-core saved
        // outside Megatron-LM's training loop (Megatron-Bridge, NeMo 2, a user's own
        // `dist_checkpointing.save`), maybe under a wrapper's prefix (NeMo's
        // `module.`). The config gave the sizes; the table's cuts check the tensors
        // against them.
        let megatron_prefix = match &args {
            // A trainer's record beside a dist_ckpt under a wrapper's prefix (NeMo 2's
            // `module.`, its model.yaml the record).
            Some(_) if recorded => self
                .wrapper_prefix(&[MEGATRON_EMBEDDING])?
                .filter(|p| !p.is_empty()),
            Some(_) => None,
            None => self.wrapper_prefix(&[MEGATRON_EMBEDDING])?,
        };
        if args.is_none() && megatron_prefix.is_none() {
            let renamed = if self.is_torchtitan() {
                self.rename_interleaved(&hf::TORCHTITAN, family, &shape, true)?;
                true
            } else if self.is_maxtext() {
                let rope = match &user_config {
                    Some(p) => super::maxtext_view::interleaved_rope(p)?,
                    None => false,
                };
                self.maxtext_to_hf(family, &shape, rope)?;
                true
            } else {
                false
            };
            let model = self.hf_names_as_they_are(family, shape, user_config, notes, renamed)?;
            // (A GGUF's view holds quantized blocks, not rows: its config is its keys'.)
            self.check_rows_against_config(family, &model.shape, model.user_config.as_deref())?;
            return Ok(model);
        }
        if let Some(prefix) = megatron_prefix.as_ref().filter(|_| args.is_some()) {
            self.take_wrapped(prefix, &mut notes);
        } else if let Some(prefix) = &megatron_prefix {
            self.take_wrapped(prefix, &mut notes);
            self.check_hidden(MEGATRON_EMBEDDING, &shape, user_config.as_deref())?;
            notes.push(format!(
                "no Megatron-LM args in the checkpoint: the model's sizes from {}, its Megatron names and shapes checked against them",
                user_config.as_deref().map_or("--hf-arch".into(), |p| p.display().to_string())
            ));
        }
        // Args that do not say whether the output layer is tied, beside an output layer:
        // Megatron-LM's default (tied) would drop it, a guess that is wrong for an untied
        // model. A config settles it.
        if args.as_ref().is_some_and(|a| a.model.untied.is_none())
            && user_config.is_none()
            && self.tensors.contains_key("output_layer.weight")
        {
            return Err(unsupported(
                "the checkpoint's args do not record untie_embeddings_and_output_weights and it holds output_layer.weight: whether lm_head is tied to the embedding is not known; give the model's Hugging Face config (tie_word_embeddings) with --hf-config".into(),
            ));
        }
        let rows = qkv_rows(&shape)?;
        if shape.groups == 0 || shape.heads % shape.groups != 0 {
            return Err(unsupported(format!(
                "{} attention heads in {} query groups do not divide",
                shape.heads, shape.groups
            )));
        }
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        let mut used = BTreeSet::new();
        for row in &family.rows() {
            if !family.applies(row, &shape) {
                continue;
            }
            for l in layers(row.megatron[0], &shape) {
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
                    Cut::GateUp | Cut::ExpertGateUp | Cut::SharedGateUp => {
                        let ffn = gate_up_ffn(row.cut, &shape);
                        if Some(first) != ffn.checked_mul(2) {
                            return Err(invalid(&name, format!(
                                "has {first} rows, but SwiGLU's gate and up of an MLP of {ffn} make {}",
                                ffn.saturating_mul(2)
                            )));
                        }
                        hf::gate_up_blocks(ffn).to_vec()
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
            dtype: None,
        })
    }

    /// The prefix a trainer's wrapper put before every name of the model (accelerate's
    /// `model.`, Lightning's `model.` and the module's attribute, NeMo's `module.`):
    /// the one `P` (maybe empty) under which every name of `anchors` is a tensor.
    /// `None` where there is none.
    ///
    /// # Errors
    /// Several such prefixes: two models in one checkpoint, which one is meant is not
    /// ckpt's to guess.
    fn wrapper_prefix(&self, anchors: &[&str]) -> Result<Option<String>> {
        let Some(first) = anchors.first() else {
            return Ok(None);
        };
        let found: Vec<String> = self
            .tensors
            .keys()
            .filter_map(|n| n.strip_suffix(first))
            .filter(|p| p.is_empty() || p.ends_with('.'))
            .filter(|p| {
                anchors
                    .iter()
                    .all(|a| self.tensors.contains_key(&format!("{p}{a}")))
            })
            .map(str::to_string)
            .collect();
        match &found[..] {
            [] => Ok(None),
            [one] => Ok(Some(one.clone())),
            many => Err(Error::Ambiguous {
                tensor: (*first).to_string(),
                files: many
                    .iter()
                    .map(|p| format!("{p}{first}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                problem: "the checkpoint holds a model under each of these prefixes: pass the one meant with --include 'PREFIX*' and --strip-prefix PREFIX".into(),
            }),
        }
    }

    /// Keeps the tensors named under `prefix`, without it; the others (a trainer's
    /// optimizer state, RNG or progress saved in the same files) are left out, said.
    fn take_wrapped(&mut self, prefix: &str, notes: &mut Vec<String>) {
        if prefix.is_empty() {
            return;
        }
        let all = std::mem::take(&mut self.tensors);
        let mut left = vec![];
        for (name, t) in all {
            match name.strip_prefix(prefix) {
                Some(rest) => {
                    self.tensors.insert(rest.to_string(), t);
                }
                None => left.push(name),
            }
        }
        notes.push(format!("the model's tensors are those under `{prefix}` (a trainer's wrapper), the prefix removed"));
        if !left.is_empty() {
            notes.push(format!(
                "{} tensors outside `{prefix}` left out (not the model: {}{})",
                left.len(),
                left.iter().take(3).cloned().collect::<Vec<_>>().join(", "),
                if left.len() > 3 { ", ..." } else { "" }
            ));
        }
    }

    /// The embedding `name` must be as wide as the model's hidden size.
    fn check_hidden(&self, name: &str, shape: &Shape, config: Option<&Path>) -> Result<()> {
        let Some(t) = self.tensors.get(name) else {
            return Ok(());
        };
        match t.shape.get(1) {
            Some(&h) if h == shape.hidden => Ok(()),
            got => Err(invalid(
                name,
                format!(
                    "is {} wide, but {} says hidden_size {}",
                    got.map_or("not 2-d".into(), u64::to_string),
                    config.map_or("the config".into(), |p| p.display().to_string()),
                    shape.hidden
                ),
            )),
        }
    }

    /// A source in Hugging Face's names (a DeepSpeed or DCP save of a transformers
    /// model, `module.` stripped, or under a trainer's wrapper prefix; or `renamed` to
    /// them by a view, which said so): its tensors must be the family's.
    pub(super) fn hf_names_as_they_are(
        &mut self,
        family: Family,
        shape: Shape,
        user_config: Option<PathBuf>,
        mut notes: Vec<String>,
        renamed: bool,
    ) -> Result<HfModel> {
        let mut want = BTreeSet::new();
        for row in family.rows().iter().filter(|r| family.applies(r, &shape)) {
            for l in layers(row.hf[0], &shape) {
                want.extend(row.hf.iter().map(|h| fill(h, l)));
            }
        }
        self.unfuse_experts(family, &shape, &mut notes)?;
        // Under a trainer's wrapper (accelerate, Lightning), beside its other state.
        let anchors: Vec<&str> = want.iter().map(String::as_str).collect();
        if let Some(prefix) = self.wrapper_prefix(&anchors)? {
            self.take_wrapped(&prefix, &mut notes);
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
        // A trainer's optimizer state saved with the model (`optimizer.state.<param>.exp_avg`,
        // `state.<param>.step`): never part of the export.
        let (state, extra): (Vec<&String>, Vec<&String>) = have
            .difference(&want)
            .partition(|n| names_a_tensor_inside(n, &want));
        if !state.is_empty() {
            notes.push(format!(
                "{} tensors of a parameter's training state left out ({}{})",
                state.len(),
                state
                    .iter()
                    .take(2)
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                if state.len() > 2 { ", ..." } else { "" }
            ));
        }
        if let Some(extra) = extra.first() {
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
        if !renamed {
            notes.push(format!(
                "tensors already in {}'s names",
                family.architecture()
            ));
        }
        self.notes.extend(notes);
        Ok(HfModel {
            family,
            shape,
            user_config,
            dtype: None,
        })
    }

    /// A mixture of experts saved as transformers' module holds it (a trainer's DCP of
    /// the live state dict, under the trainer's wrapper prefix or not): each layer's
    /// fused `mlp.experts.gate_up_proj` and `down_proj` ([`hf::FUSED_EXPERTS_GATE_UP`])
    /// become the family's per-expert tensors, as `save_pretrained` writes them (each a
    /// run of the stacked tensor: the same stored bytes), and the module's names of the
    /// family's other rows (Mixtral's router, `mlp.gate.weight`) the checkpoint's. A
    /// source without fused experts is left as it is.
    ///
    /// # Errors
    /// A fused tensor of another shape than the config's experts, FFN and hidden sizes
    /// give it, its partner missing, or a piece that holds part of an expert's row.
    fn unfuse_experts(
        &mut self,
        family: Family,
        shape: &Shape,
        notes: &mut Vec<String>,
    ) -> Result<()> {
        let fused: Vec<String> = self
            .tensors
            .keys()
            .filter(|n| n.ends_with(hf::FUSED_EXPERTS_GATE_UP))
            .cloned()
            .collect();
        if fused.is_empty() || !family.is_moe() {
            return Ok(());
        }
        let rows = family.rows();
        let applies = |r: &&hf::Row| family.applies(r, shape);
        let gate_up = rows
            .iter()
            .filter(applies)
            .find(|r| r.cut == Cut::ExpertGateUp);
        let down = rows
            .iter()
            .filter(applies)
            .find(|r| r.cut == Cut::Whole && r.hf[0].contains("{e}"));
        let (Some(gate_up), Some(down)) = (gate_up, down) else {
            return Ok(());
        };
        let to_module = |name: String| {
            family
                .module_renames()
                .iter()
                .fold(name, |n, (ours, theirs)| n.replace(ours, theirs))
        };
        let (e, f, h) = (shape.experts, shape.moe_ffn, shape.hidden);
        let files = &self.files;
        let stored = |fi: usize, i: usize| files[fi].tensors()[i].shape.clone();
        let mut out: Vec<(String, SourceTensor)> = vec![];
        let mut gone = vec![];
        for name in &fused {
            // `{prefix}model.layers.{l}.mlp.experts.gate_up_proj`
            let stem = &name[..name.len() - hf::FUSED_EXPERTS_GATE_UP.len()];
            let layer = stem
                .strip_suffix('.')
                .and_then(|s| s.rsplit_once('.'))
                .and_then(|(head, l)| Some((head, l.parse::<u64>().ok()?)))
                .and_then(|(head, l)| Some((head.strip_suffix("model.layers")?, l)));
            let Some((prefix, l)) = layer else {
                return Err(invalid(
                    name,
                    "is a fused experts tensor outside `model.layers.<l>.`: not a layer of the model".into(),
                ));
            };
            let down_name = format!("{stem}{}", hf::FUSED_EXPERTS_DOWN);
            let Some(down_t) = self.tensors.get(&down_name) else {
                return Err(invalid(
                    &down_name,
                    format!("missing: {name} is there, and a layer of fused experts has both"),
                ));
            };
            let t = &self.tensors[name];
            for (n, t, want) in [(name, t, [e, 2 * f, h]), (&down_name, down_t, [e, h, f])] {
                if t.shape != want {
                    return Err(invalid(
                        n,
                        format!(
                            "is {:?}, but {e} experts of FFN {f} and hidden {h} make {want:?} (transformers' fused experts)",
                            t.shape
                        ),
                    ));
                }
            }
            let cut = |t: &SourceTensor, n: &str, start: u64, r: u64, c: u64, x: u64| {
                t.run_rows(start, r, c, stored)
                    .map_err(|p| invalid(n, format!("expert {x}: {p}")))
            };
            for x in 0..e {
                let at = At {
                    layer: Some(l),
                    expert: Some(x),
                };
                let base = x * 2 * f * h;
                out.push((
                    format!("{prefix}{}", fill(gate_up.hf[0], at)),
                    cut(t, name, base, f, h, x)?,
                ));
                out.push((
                    format!("{prefix}{}", fill(gate_up.hf[1], at)),
                    cut(t, name, base + f * h, f, h, x)?,
                ));
                out.push((
                    format!("{prefix}{}", fill(down.hf[0], at)),
                    cut(down_t, &down_name, x * h * f, h, f, x)?,
                ));
            }
            // The family's other rows of this layer under the module's names.
            for r in rows
                .iter()
                .filter(applies)
                .filter(|r| !r.hf[0].contains("{e}"))
            {
                for pattern in r.hf {
                    let ours = format!(
                        "{prefix}{}",
                        fill(
                            pattern,
                            At {
                                layer: Some(l),
                                expert: None
                            }
                        )
                    );
                    let theirs = to_module(ours.clone());
                    if theirs != ours && !self.tensors.contains_key(&ours) {
                        if let Some(t) = self.tensors.get(&theirs) {
                            out.push((ours, t.clone()));
                            gone.push(theirs);
                        }
                    }
                }
            }
            gone.push(name.clone());
            gone.push(down_name);
        }
        for n in &gone {
            self.tensors.remove(n);
        }
        self.tensors.extend(out);
        notes.push(format!(
            "the experts of {} layers as transformers' module holds them ({}, {}): each expert's tensors cut from them, as save_pretrained writes them",
            fused.len(),
            hf::FUSED_EXPERTS_GATE_UP,
            hf::FUSED_EXPERTS_DOWN
        ));
        Ok(())
    }

    /// The config's sizes against a model in Hugging Face's names, as a Megatron
    /// checkpoint's fused tensors are checked against them: the query, key and value
    /// rows (heads x head_dim, key/value heads x head_dim), the gate and up rows of
    /// every MLP (dense, expert and shared), and the embedding's width. A config that
    /// contradicts the tensors would be written beside them as a model that does not
    /// load.
    ///
    /// # Errors
    /// A tensor whose rows or width the config's sizes do not give, naming both.
    fn check_rows_against_config(
        &self,
        family: Family,
        shape: &Shape,
        config: Option<&Path>,
    ) -> Result<()> {
        let said = config.map_or("the config".into(), |p| p.display().to_string());
        for row in family.rows().iter().filter(|r| family.applies(r, shape)) {
            for l in layers(row.hf[0], shape) {
                for (i, pattern) in row.hf.iter().enumerate() {
                    let name = fill(pattern, l);
                    let Some(rows) = self
                        .tensors
                        .get(&name)
                        .and_then(|t| t.shape.first().copied())
                    else {
                        continue;
                    };
                    let (want, what) = match row.cut {
                        Cut::Qkv if i == 0 => (
                            shape.heads * shape.head_dim,
                            format!("{} heads of {}", shape.heads, shape.head_dim),
                        ),
                        Cut::Qkv => (
                            shape.groups * shape.head_dim,
                            format!("{} key/value heads of {}", shape.groups, shape.head_dim),
                        ),
                        Cut::GateUp | Cut::ExpertGateUp | Cut::SharedGateUp => {
                            (gate_up_ffn(row.cut, shape), "its MLP size".to_string())
                        }
                        Cut::Vocab | Cut::Whole => continue,
                    };
                    if rows != want {
                        return Err(invalid(
                            &name,
                            format!("has {rows} rows, but {said} gives {want} ({what})"),
                        ));
                    }
                }
            }
        }
        if let Some(row) = family.rows().iter().find(|r| r.cut == Cut::Vocab) {
            self.check_hidden(row.hf[0], shape, config)?;
        }
        Ok(())
    }
}
