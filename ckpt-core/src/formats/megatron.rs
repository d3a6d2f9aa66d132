//! Megatron-LM's legacy checkpoints (`--ckpt-format torch`), read with the layer rules
//! of megatron-core's GPT model.
//!
//! The layout, from megatron/training/checkpointing.py (NVIDIA/Megatron-LM):
//!
//! ```text
//! <save>/latest_checkpointed_iteration.txt     the iteration, or `release`
//! <save>/iter_0000100/                         `iter_{:07d}` (or `release/`)
//!     mp_rank_00/model_optim_rng.pt            pipeline size 1: `mp_rank_{tp:02d}`
//!     mp_rank_00_000/model_optim_rng.pt        else `mp_rank_{tp:02d}_{pp:03d}`
//!     mp_rank_00_000/distrib_optim.pt          the distributed optimizer's state
//! ```
//!
//! Each `model_optim_rng.pt` is a `torch.save` of the dict generate_state_dict builds:
//! `args` (the run's `argparse.Namespace`), `checkpoint_version` (3.0), `iteration`,
//! `model` (the module's state dict for this TP rank and pipeline stage; `model0`,
//! `model1`, ... with virtual pipeline stages), `optimizer`, `opt_param_scheduler`,
//! `rng_state`. Which parameter is split on which dimension is not in the files: it is
//! megatron-core's, and [`rule`] is its table for the GPT layers. Layer `N` of a stage is
//! layer `offset + N` of the model, the offset as get_transformer_layer_offset computes
//! it for uniform stages. The sizes the rules check against come from `args`.
//!
//! The pickle is read as data (nothing is imported or run). Globals other than torch's
//! tensor machinery are accepted only from the modules these files name (`argparse`'s
//! Namespace, numpy's arrays of the RNG state, `_codecs.encode`, torch's dtypes,
//! megatron's own enums); anything else is refused by name.

pub(crate) mod dist_optim;
mod names;
pub(crate) use names::{is_expert_name, is_grouped_weight};
mod optim;
mod pickled;
mod rng;
pub(crate) use rng::RankRng;

use super::distcp::{ChunkPart, DcpChunk, DcpMetadata, DcpTensor};
use super::pickle::Value;
use super::torch_save::{Archive, ArchiveIndex, Deferred};
use super::{map_file, open_abreast, FileFormat, Mapped, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::layout::flat::FlatRange;
use crate::layout::mesh::Mesh;
use crate::layout::strategy::{dtype_name, Strategy};
use crate::layout::{Dtype, Placement, TensorLayout};
use pickled::{allowed, namespace_fields};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The file naming the newest iteration.
pub(crate) const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
/// A rank's file.
pub(crate) const RANK_FILE: &str = "model_optim_rng.pt";
/// Megatron-LM's `--ckpt-format` of a legacy checkpoint, and of a dist_ckpt.
pub(crate) const LEGACY_FORMAT: &str = "torch";
pub(crate) const DIST_FORMAT: &str = "torch_dist";
/// The distributed optimizer's per-rank file (read by [`optim`]).
const DISTRIB_OPTIM_FILE: &str = optim::FILE;
/// The pipeline axis of the mesh ckpt gives a legacy checkpoint.
pub(crate) const PP_AXIS: &str = "pp";
/// The tensor-parallel axis.
pub(crate) const TP_AXIS: &str = "tp";
/// The inner tensor-parallel axis, the expert-TP part, where 1 < ETP < TP (the outer
/// one is then [`TP_AXIS`], of size TP / ETP).
pub(crate) const ETP_AXIS: &str = "etp";
/// The expert-parallel axis of a legacy checkpoint without pipeline stages.
pub(crate) const EP_AXIS: &str = "ep";
/// The pipeline and expert-parallel axes of a legacy checkpoint with both, as one
/// (coordinate `pp x EP + ep`).
pub(crate) const PP_EP_AXIS: &str = "pp_ep";

/// Where a legacy rank file sits on the grid.
#[derive(Clone, Copy, Debug)]
struct RankAt {
    tp: u64,
    pp: u64,
    ep: u64,
}

/// Which `mp_rank_TT[_PPP]_EEE` directories of one pipeline stage a legacy save
/// writes, and which of them ckpt reads each part of the model from (docs/moe.md,
/// "Who writes"). A process writes when its dense or its expert data-parallel rank is 0:
/// processes `r < max(TP, ETP x EP)` of the stage, as `(r % TP, (r / ETP) % EP)`, and
/// its experts are expert-TP part `r % ETP` (= `TP rank % ETP`, ETP dividing TP). With
/// `ETP == TP` that is every `(tp, ep)` pair; with a smaller ETP fewer, so each TP rank
/// and each EP rank is in fewer directories.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RankDirs {
    pub(crate) tp: u64,
    pub(crate) ep: u64,
    /// The expert tensor-parallel size, which divides `tp`.
    pub(crate) etp: u64,
}

impl RankDirs {
    /// Whether the save wrote directory `(t, e)`: the processes of a stage enumerated
    /// (the pattern repeats every `lcm(TP, ETP x EP)` processes).
    pub(crate) fn written(self, t: u64, e: u64) -> bool {
        let RankDirs { tp, ep, etp } = self;
        let (Some(group), true) = (etp.checked_mul(ep), t < tp && e < ep) else {
            return false;
        };
        (0..tp.max(group)).any(|r| r % tp == t && (r / etp) % ep == e)
    }

    /// The EP coordinate of the directory the dense tensors of TP rank `t` are read from:
    /// the first the save wrote for `t` (the others hold data-parallel copies of them).
    fn dense_from(self, t: u64) -> u64 {
        (0..self.ep).find(|&e| self.written(t, e)).unwrap_or(0)
    }

    /// Whether the experts of EP rank `e` are read from directory `(t, e)`: the first
    /// directory of `e` that holds expert-TP part `t % ETP` (every directory when
    /// `ETP == TP`; one per EP rank when `ETP == 1`).
    fn experts_from(self, t: u64, e: u64) -> bool {
        let etp = self.etp.max(1);
        self.written(t, e) && !(0..t).any(|u| u % etp == t % etp && self.written(u, e))
    }
}

/// What ckpt reads from one legacy rank file: its dense tensors (placed as those of
/// [`Args::dense_rank`]), its experts, or both.
#[derive(Clone, Copy, Debug)]
struct Reads {
    dense: bool,
    experts: bool,
}

/// Whether `dir` is a Megatron legacy checkpoint: a save directory (with the tracker
/// file) or one iteration's directory (with `mp_rank_*` directories).
pub(crate) fn looks_like(dir: &Path) -> bool {
    dir.join(TRACKER_FILE).is_file() || !rank_dirs(dir).is_empty()
}

/// `(tp, rest, path)` of each `mp_rank_TT[_PPP][_EEE]` directory: the tensor-parallel
/// rank and the numbers after it (pipeline stage, expert-parallel rank, or both: only
/// args tell `mp_rank_TT_EEE` from `mp_rank_TT_PPP`).
fn rank_dirs(dir: &Path) -> Vec<(u64, Vec<u64>, PathBuf)> {
    let Ok(read) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut out = Vec::new();
    for e in read.flatten() {
        let p = e.path();
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(rest) = name.strip_prefix("mp_rank_") else {
            continue;
        };
        if !p.is_dir() {
            continue;
        }
        let nums: Option<Vec<u64>> = rest.split('_').map(|s| s.parse::<u64>().ok()).collect();
        if let Some(nums) = nums.filter(|n| (1..=3).contains(&n.len())) {
            out.push((nums[0], nums[1..].to_vec(), p));
        }
    }
    out.sort();
    out
}

fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

/// The run's sizes, from the pickled `args` (the fields the rules and the Hugging Face
/// export need).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Args {
    pub(crate) tp: u64,
    pub(crate) pp: u64,
    pub(crate) vp: Option<u64>,
    pub(crate) num_layers: Option<u64>,
    pub(crate) hidden: Option<u64>,
    pub(crate) ffn_hidden: Option<u64>,
    pub(crate) heads: Option<u64>,
    pub(crate) query_groups: Option<u64>,
    pub(crate) kv_channels: Option<u64>,
    pub(crate) padded_vocab: Option<u64>,
    pub(crate) vocab: Option<u64>,
    pub(crate) max_positions: Option<u64>,
    pub(crate) swiglu: bool,
    /// What the model is, for a Hugging Face export (`None` where args lack the field).
    pub(crate) model: ModelArgs,
    /// Uneven pipeline stages (`num_layers_in_first/last_pipeline_stage`,
    /// `pipeline_model_parallel_layout`): set when args use them, refused for now.
    pub(crate) uneven: Option<String>,
    /// Mixture of experts (docs/moe.md); `experts` is `None` for a dense model.
    pub(crate) moe: MoeArgs,
}

/// Megatron-LM's mixture-of-experts fields (arguments.py's names).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct MoeArgs {
    /// `num_experts`: experts of each MoE layer, over all expert-parallel ranks.
    pub(crate) experts: Option<u64>,
    /// `expert_model_parallel_size` (1 when absent).
    pub(crate) ep: u64,
    /// `expert_tensor_parallel_size` (`None`: the tensor-parallel size).
    pub(crate) etp: Option<u64>,
    /// `moe_ffn_hidden_size` (`None`: `ffn_hidden_size`).
    pub(crate) ffn: Option<u64>,
    /// `moe_shared_expert_intermediate_size`.
    pub(crate) shared_ffn: Option<u64>,
    /// `moe_grouped_gemm`: experts as one grouped layer.
    pub(crate) grouped_gemm: bool,
    /// `moe_use_legacy_grouped_gemm`: that layer is megatron-core's `GroupedMLP`
    /// (`weight1`/`weight2`), not Transformer Engine's `TEGroupedMLP`.
    pub(crate) legacy_grouped: bool,
    /// `moe_router_topk`.
    pub(crate) topk: Option<u64>,
    /// `moe_router_pre_softmax`: softmax over all experts, the top-k kept as they are
    /// (else softmax over the top-k logits: renormalised).
    pub(crate) pre_softmax: bool,
    /// `moe_router_score_function` (`softmax`, `sigmoid`).
    pub(crate) score_function: Option<String>,
    /// `moe_router_enable_expert_bias`.
    pub(crate) expert_bias: bool,
    /// `moe_shared_expert_gate`.
    pub(crate) shared_gate: bool,
    /// `moe_layer_freq` when it makes some layers dense (an int above 1, or a list
    /// with a 0), as written.
    pub(crate) dense_layers: Option<String>,
}

impl MoeArgs {
    /// Experts each expert-parallel rank holds.
    fn local_experts(&self) -> Option<u64> {
        let e = self.experts?;
        (self.ep > 0 && e % self.ep == 0).then(|| e / self.ep)
    }

    /// The FFN size of one expert.
    fn expert_ffn(&self, dense_ffn: Option<u64>) -> Option<u64> {
        self.ffn.or(dense_ffn)
    }
}

/// The fields of Megatron-LM's args that say which model family a GPT model is
/// (arguments.py's names; `None` where the args lack the field).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ModelArgs {
    /// `normalization`: `LayerNorm` or `RMSNorm`.
    pub(crate) normalization: Option<String>,
    /// `position_embedding_type`: `learned_absolute`, `rope`, ...
    pub(crate) position_embedding: Option<String>,
    /// `qk_layernorm`.
    pub(crate) qk_layernorm: Option<bool>,
    /// `add_qkv_bias`.
    pub(crate) qkv_bias: Option<bool>,
    /// `add_bias_linear`.
    pub(crate) bias_linear: Option<bool>,
    /// `untie_embeddings_and_output_weights`.
    pub(crate) untied: Option<bool>,
    /// `norm_epsilon` (Megatron-LM's name for TransformerConfig.layernorm_epsilon).
    pub(crate) norm_epsilon: Option<f64>,
    /// `rotary_base`.
    pub(crate) rotary_base: Option<f64>,
    /// `rotary_percent`.
    pub(crate) rotary_percent: Option<f64>,
    /// The args' `params_dtype` (`torch.float32`, ...) or the `bf16`/`fp16` flags.
    pub(crate) dtype: Option<String>,
}

impl Args {
    /// Reads the fields ckpt needs; absent optional ones stay `None` and are then
    /// taken from the files. `path` is for messages.
    fn from_value(v: &Value, path: &Path) -> Result<Args> {
        let fields = namespace_fields(v).ok_or_else(|| {
            unknown(format!(
                "{}: `args` is not an argparse.Namespace",
                path.display()
            ))
        })?;
        Args::from_fields(fields, path)
    }

    /// [`Args::from_value`] of the namespace's `(name, value)` pairs.
    fn from_fields(fields: &[(Value, Value)], path: &Path) -> Result<Args> {
        let get = |key: &str| {
            fields
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v)
        };
        let int = |key: &str| -> Result<Option<u64>> {
            match get(key) {
                None | Some(Value::None) => Ok(None),
                Some(Value::Int(i)) if *i > 0 => Ok(Some(*i as u64)),
                Some(other) => Err(unknown(format!(
                    "{}: args.{key} is {other:?}, not a positive integer",
                    path.display()
                ))),
            }
        };
        let flag = |key: &str| matches!(get(key), Some(Value::Bool(true)));
        let mut uneven = None;
        for key in [
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "pipeline_model_parallel_layout",
        ] {
            if !matches!(get(key), None | Some(Value::None)) {
                uneven = Some(key.to_string());
            }
        }
        let heads = int("num_attention_heads")?;
        let boolean = |key: &str| match get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        };
        let text = |key: &str| match get(key) {
            Some(Value::Str(s)) => Some(s.clone()),
            _ => None,
        };
        let float = |key: &str| match get(key) {
            Some(Value::Float(f)) => Some(*f),
            Some(Value::Int(i)) => Some(*i as f64),
            _ => None,
        };
        let dtype = if flag("bf16") {
            Some("bfloat16".to_string())
        } else if flag("fp16") {
            Some("float16".to_string())
        } else {
            match get("params_dtype") {
                Some(Value::Global { module, name }) if module == "torch" => Some(name.clone()),
                _ => None,
            }
        };
        let model = ModelArgs {
            normalization: text("normalization"),
            position_embedding: text("position_embedding_type"),
            qk_layernorm: boolean("qk_layernorm"),
            qkv_bias: boolean("add_qkv_bias"),
            bias_linear: boolean("add_bias_linear"),
            untied: boolean("untie_embeddings_and_output_weights"),
            norm_epsilon: float("norm_epsilon").or_else(|| float("layernorm_epsilon")),
            rotary_base: float("rotary_base"),
            rotary_percent: float("rotary_percent"),
            dtype,
        };
        Ok(Args {
            tp: int("tensor_model_parallel_size")?.unwrap_or(1),
            pp: int("pipeline_model_parallel_size")?.unwrap_or(1),
            vp: int("virtual_pipeline_model_parallel_size")?,
            num_layers: int("num_layers")?,
            hidden: int("hidden_size")?,
            ffn_hidden: int("ffn_hidden_size")?,
            heads,
            // Megatron sets num_query_groups = heads when GQA is off.
            query_groups: if flag("group_query_attention") {
                int("num_query_groups")?
            } else {
                heads
            },
            kv_channels: int("kv_channels")?,
            padded_vocab: int("padded_vocab_size")?,
            vocab: int("vocab_size")?,
            max_positions: int("max_position_embeddings")?,
            swiglu: flag("swiglu"),
            model,
            uneven,
            moe: MoeArgs {
                experts: int("num_experts")?,
                ep: int("expert_model_parallel_size")?.unwrap_or(1),
                etp: int("expert_tensor_parallel_size")?,
                ffn: int("moe_ffn_hidden_size")?,
                shared_ffn: int("moe_shared_expert_intermediate_size")?,
                grouped_gemm: flag("moe_grouped_gemm"),
                legacy_grouped: flag("moe_use_legacy_grouped_gemm"),
                topk: int("moe_router_topk")?,
                pre_softmax: flag("moe_router_pre_softmax"),
                score_function: text("moe_router_score_function"),
                expert_bias: flag("moe_router_enable_expert_bias"),
                shared_gate: flag("moe_shared_expert_gate"),
                dense_layers: match get("moe_layer_freq") {
                    None | Some(Value::None) | Some(Value::Int(1)) => None,
                    Some(Value::List(v)) if v.iter().all(|x| matches!(x, Value::Int(1))) => None,
                    Some(other) => Some(format!("{other:?}")),
                },
            },
        })
    }

    /// The mesh rank of a legacy checkpoint whose place a dense tensor of rank `rank`'s
    /// file takes: the rank of expert-parallel coordinate 0 with the same TP and PP
    /// coordinates. The dense tensors of an expert-parallel rank above 0 are read only
    /// where the save wrote no directory for EP rank 0 with that TP rank (expert TP 1,
    /// [`RankDirs`]).
    pub(crate) fn dense_rank(&self, rank: u64) -> u64 {
        let per_stage = self.tp * self.moe.ep;
        rank / per_stage * per_stage + rank % self.tp
    }

    /// The expert tensor-parallel size the experts were split over: args'
    /// `expert_tensor_parallel_size` in a model with experts, else (and where unset)
    /// the tensor-parallel size.
    pub(crate) fn expert_tp(&self) -> u64 {
        match (self.moe.experts, self.moe.etp) {
            (Some(_), Some(etp)) => etp,
            _ => self.tp,
        }
    }

    pub(crate) fn kv(&self) -> Option<u64> {
        self.kv_channels
            .or_else(|| Some(self.hidden? / self.heads?))
    }

    fn layers_per_chunk(&self) -> Option<u64> {
        let chunks = self.pp.checked_mul(self.vp.unwrap_or(1))?;
        let l = self.num_layers?;
        (chunks > 0 && l % chunks == 0).then(|| l / chunks)
    }

    /// The global index of layer `n` of model chunk `chunk` on stage `pp`
    /// (get_transformer_layer_offset, uniform stages).
    fn global_layer(&self, pp: u64, chunk: u64, n: u64) -> Option<u64> {
        let per = self.layers_per_chunk()?;
        let per_vp_stage = self.pp.checked_mul(per)?;
        chunk
            .checked_mul(per_vp_stage)?
            .checked_add(pp.checked_mul(per)?)?
            .checked_add(n)
    }
}

pub(crate) use crate::layout::split_rules::Split;
use crate::layout::split_rules::{SplitRules, HOW_TO_ADD};

/// Which pipeline stage a tensor must be on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    First,
    Last,
    /// A transformer layer: the stage of its file.
    Any,
}

/// megatron-core's GPT rule for a parameter (by its name with the layer prefix
/// removed for layers): how it is split and the global shape args give it (`None`
/// where args lack a size).
fn rule(name: &str, args: &Args) -> Option<(Split, Stage, Option<Vec<u64>>)> {
    let col = Split::Dim { dim: 0, blocks: 1 };
    let row = Split::Dim { dim: 1, blocks: 1 };
    let h = args.hidden;
    let kv = args.kv();
    let qkv = (|| {
        let groups = args.query_groups?;
        args.heads?
            .checked_add(groups.checked_mul(2)?)?
            .checked_mul(kv?)
    })();
    let proj_in = (|| args.heads?.checked_mul(kv?))();
    let gate = if args.swiglu { 2 } else { 1 };
    let ffn = args.ffn_hidden.or_else(|| h.and_then(|h| h.checked_mul(4)));
    let fc1 = ffn.and_then(|f| f.checked_mul(gate));
    let shape = |dims: &[Option<u64>]| dims.iter().copied().collect::<Option<Vec<u64>>>();
    if let Some(rest) = name.strip_prefix("decoder.layers.") {
        let (_, rest) = rest.split_once('.')?;
        let r = match rest {
            "input_layernorm.weight"
            | "input_layernorm.bias"
            | "pre_mlp_layernorm.weight"
            | "pre_mlp_layernorm.bias"
            | "self_attention.linear_qkv.layer_norm_weight"
            | "self_attention.linear_qkv.layer_norm_bias"
            | "mlp.linear_fc1.layer_norm_weight"
            | "mlp.linear_fc1.layer_norm_bias" => (Split::Replicated, shape(&[h])),
            "self_attention.q_layernorm.weight"
            | "self_attention.q_layernorm.bias"
            | "self_attention.k_layernorm.weight"
            | "self_attention.k_layernorm.bias" => (Split::Replicated, shape(&[kv])),
            "self_attention.linear_qkv.weight" => (col, shape(&[qkv, h])),
            "self_attention.linear_qkv.bias" => (col, shape(&[qkv])),
            "self_attention.linear_proj.weight" => (row, shape(&[h, proj_in])),
            "self_attention.linear_proj.bias" | "mlp.linear_fc2.bias" => {
                (Split::Replicated, shape(&[h]))
            }
            "mlp.linear_fc1.weight" => (
                Split::Dim {
                    dim: 0,
                    blocks: gate,
                },
                shape(&[fc1, h]),
            ),
            "mlp.linear_fc1.bias" => (
                Split::Dim {
                    dim: 0,
                    blocks: gate,
                },
                shape(&[fc1]),
            ),
            "mlp.linear_fc2.weight" => (row, shape(&[h, ffn])),
            // megatron-core's GroupedMLP: the grouped weights of all experts, whole on
            // every TP rank (expert TP 1; docs/moe.md).
            "mlp.experts.weight1" | "mlp.experts.weight2" => (
                Split::Replicated,
                grouped_split(name, args, 1, 0)
                    .ok()
                    .flatten()
                    .map(|g| g.global),
            ),
            "mlp.router.weight" => (Split::Replicated, shape(&[args.moe.experts, h])),
            "mlp.router.expert_bias" => (Split::Replicated, shape(&[args.moe.experts])),
            "mlp.shared_experts.gate_weight" => (Split::Replicated, shape(&[Some(1), h])),
            _ => {
                // An expert (`mlp.experts.local_experts.<g>.`, global id) or the shared
                // expert: an MLP of its own FFN size, split like the dense one.
                let (tail, f) = if let Some(e) = rest.strip_prefix("mlp.experts.local_experts.") {
                    (e.split_once('.')?.1, args.moe.ffn.or(ffn))
                } else if let Some(t) = rest.strip_prefix("mlp.shared_experts.") {
                    (t, args.moe.shared_ffn)
                } else {
                    return None;
                };
                let f1 = f.and_then(|f| f.checked_mul(gate));
                let fc1 = Split::Dim {
                    dim: 0,
                    blocks: gate,
                };
                match tail {
                    "linear_fc1.weight" => (fc1, shape(&[f1, h])),
                    "linear_fc1.bias" => (fc1, shape(&[f1])),
                    "linear_fc2.weight" => (row, shape(&[h, f])),
                    "linear_fc2.bias" => (Split::Replicated, shape(&[h])),
                    _ => return None,
                }
            }
        };
        return Some((r.0, Stage::Any, r.1));
    }
    let v = args.padded_vocab;
    Some(match name {
        "embedding.word_embeddings.weight" => (col, Stage::First, shape(&[v, h])),
        "embedding.position_embeddings.weight" => (
            Split::Replicated,
            Stage::First,
            shape(&[args.max_positions, h]),
        ),
        "decoder.final_layernorm.weight" | "decoder.final_layernorm.bias" => {
            (Split::Replicated, Stage::Last, shape(&[h]))
        }
        "output_layer.weight" => (col, Stage::Last, shape(&[v, h])),
        "output_layer.bias" => (col, Stage::Last, shape(&[v])),
        _ => return None,
    })
}

/// The global name of a stage-local name: `decoder.layers.N.` renumbered.
fn global_name(
    local: &str,
    args: &Args,
    pp: u64,
    chunk: u64,
) -> std::result::Result<String, String> {
    let Some(rest) = local.strip_prefix("decoder.layers.") else {
        return Ok(local.to_string());
    };
    let (n, tail) = rest
        .split_once('.')
        .ok_or_else(|| "a layer name without a parameter".to_string())?;
    let n: u64 = n
        .parse()
        .map_err(|_| format!("layer number `{n}` is not a number"))?;
    let per = args.layers_per_chunk().ok_or_else(|| {
        format!(
            "args.num_layers {:?} is not a multiple of pipeline x virtual stages ({} x {})",
            args.num_layers,
            args.pp,
            args.vp.unwrap_or(1)
        )
    })?;
    if n >= per {
        return Err(format!(
            "layer {n} on a stage of {per} layers (args.num_layers {:?}, {} stages)",
            args.num_layers, args.pp
        ));
    }
    let g = args
        .global_layer(pp, chunk, n)
        .ok_or_else(|| "layer index overflows".to_string())?;
    Ok(format!("decoder.layers.{g}.{tail}"))
}

/// The global name of an expert's tensor named with its local index
/// (`…mlp.experts.local_experts.<i>.…`): `None` for any other tensor, an error for an
/// index the args do not allow.
fn expert_name(
    name: &str,
    args: &Args,
    ep_rank: u64,
) -> Option<std::result::Result<String, String>> {
    const LOCAL: &str = ".mlp.experts.local_experts.";
    let at = name.find(LOCAL)? + LOCAL.len();
    let (i, tail) = name[at..].split_once('.')?;
    Some((|| {
        let i: u64 = i
            .parse()
            .map_err(|_| format!("expert number `{i}` is not a number"))?;
        let Some(per) = args.moe.local_experts() else {
            return Err(format!(
                "an expert, but args.num_experts {:?} is not set or not a multiple of args.expert_model_parallel_size {}",
                args.moe.experts, args.moe.ep
            ));
        };
        if i >= per {
            return Err(format!(
                "local expert {i}, but args give {per} per expert-parallel rank (num_experts {:?} / expert_model_parallel_size {})",
                args.moe.experts, args.moe.ep
            ));
        }
        let g = ep_rank * per + i;
        Ok(format!("{}{g}.{tail}", &name[..at]))
    })())
}

/// A legacy checkpoint opened: one file per (tp, pp) rank, the tensors under their
/// global names, and the layout that places them.
#[derive(Debug)]
pub(crate) struct Legacy {
    /// Mesh rank (`pp * tp_size + tp`) and file, in rank order.
    pub(crate) files: Vec<(u64, TensorFile)>,
    /// Where every tensor lies: mesh `pp=P,tp=T` (pipeline axis `pp`; `tp=T` alone when
    /// P is 1).
    pub(crate) strategy: Strategy,
    /// What was read and not carried.
    pub(crate) notes: Vec<String>,
    /// The run's sizes (for the views of its fused and padded tensors).
    pub(crate) args: Args,
}

/// The iteration directory a path means: a save directory's tracker names it, an
/// iteration directory is itself.
pub(crate) fn iteration_dir(path: &Path) -> Result<PathBuf> {
    let tracker = path.join(TRACKER_FILE);
    if !tracker.is_file() {
        return Ok(path.to_path_buf());
    }
    let text = String::from_utf8_lossy(&crate::formats::read_small(&tracker)?).into_owned();
    let text = text.trim();
    let name = if text == "release" {
        "release".to_string()
    } else {
        let it: u64 = text.parse().map_err(|_| {
            unknown(format!(
                "{}: `{text}` is neither an iteration number nor `release`",
                tracker.display()
            ))
        })?;
        format!("iter_{it:07}")
    };
    let dir = path.join(&name);
    if !dir.is_dir() {
        return Err(unknown(format!(
            "{}: names iteration `{text}`, but {} is not there",
            tracker.display(),
            dir.display()
        )));
    }
    Ok(dir)
}

/// Opens a legacy checkpoint: reads `args` from the first rank's file, checks that every
/// rank directory args call for is there (and no other), places every model tensor by
/// the rules, and checks each against args.
///
/// # Errors
/// A missing or unexpected `mp_rank` directory; a file that is not a readable
/// torch.save archive; a tensor the rules cannot place; args that contradict a file's
/// shapes; a global outside what these files name.
pub(crate) fn open(path: &Path, rules: &SplitRules) -> Result<Legacy> {
    let dir = iteration_dir(path)?;
    let found = rank_dirs(&dir);
    let Some((_, _, first)) = found.first() else {
        return Err(unknown(format!(
            "{}: no mp_rank_TT[_PPP][_EEE]/ directories",
            dir.display()
        )));
    };
    let first_file = first.join(RANK_FILE);
    // Mapped and parsed once: its args, then its tensors.
    let mut first_rank = Some(RankFile::open(&first_file)?);
    let (args, args_value) = {
        let obj = &first_rank.as_ref().expect("just opened").obj;
        let a = obj.get("args").ok_or_else(|| {
            unknown(format!(
                "{}: no `args` (not a Megatron checkpoint?)",
                first_file.display()
            ))
        })?;
        (Args::from_value(a, &first_file)?, a.clone())
    };
    if let Some(key) = &args.uneven {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: args.{key} is set: stages of uneven layer counts are not read yet",
                first_file.display()
            ),
        });
    }
    let (tp, pp, ep) = (args.tp, args.pp, args.moe.ep);
    let unsupported = |problem: String| Error::Unsupported {
        problem: format!("{}: {problem}", first_file.display()),
    };
    // docs/moe.md: what is read of expert parallelism, and what not yet.
    if ep > 1 && args.moe.local_experts().is_none() {
        return Err(unknown(format!(
            "{}: args.num_experts {:?} is not a multiple of args.expert_model_parallel_size {ep}",
            first_file.display(),
            args.moe.experts
        )));
    }
    let etp = args.expert_tp();
    if etp == 0 || tp % etp != 0 {
        return Err(unsupported(format!(
            "args.expert_tensor_parallel_size {etp} with tensor_model_parallel_size {tp}: which expert part a rank directory holds is read where the expert TP size divides the TP size, not otherwise"
        )));
    }
    if args.moe.experts.is_some() && args.moe.grouped_gemm {
        if !args.moe.legacy_grouped {
            return Err(unsupported(
                "args.moe_grouped_gemm without moe_use_legacy_grouped_gemm: Transformer Engine's grouped expert layers (TEGroupedMLP) are not read yet; megatron-core's GroupedMLP (mlp.experts.weight1/weight2) and SequentialMLP experts (local_experts.<i>) are".into(),
            ));
        }
        if etp != 1 {
            return Err(unsupported(format!(
                "args.moe_grouped_gemm with expert tensor parallel size {etp}: each rank's GroupedMLP weights are then column blocks of every expert, which are not read yet (whole experts, expert_tensor_parallel_size 1, are)"
            )));
        }
        if args.hidden.is_none_or(|h| h % ep != 0) {
            return Err(unsupported(format!(
                "args.moe_grouped_gemm: hidden_size {:?} is not a multiple of the expert-parallel size {ep}, so the ranks' GroupedMLP weight1 are not rows of the grouped weight1 of all experts (not read yet)",
                args.hidden
            )));
        }
    }
    let dirs = RankDirs { tp, ep, etp };
    let world = tp
        .checked_mul(pp)
        .and_then(|w| w.checked_mul(ep))
        .ok_or_else(|| overflow("tensor x pipeline x expert parallel size"))?;
    // Every directory the args call for, by name; and none else. Megatron-LM's
    // get_checkpoint_name: `_PPP` when pipeline-parallel, then `_EEE` when
    // expert-parallel.
    let name_of = |t: u64, p: u64, e: u64| {
        let mut n = format!("mp_rank_{t:02}");
        if pp > 1 {
            n.push_str(&format!("_{p:03}"));
        }
        if ep > 1 {
            n.push_str(&format!("_{e:03}"));
        }
        n
    };
    let parts = usize::from(pp > 1) + usize::from(ep > 1);
    let sizes = if ep > 1 {
        format!("tensor parallel {tp} x pipeline {pp} x expert parallel {ep}")
    } else {
        format!("tensor parallel {tp} x pipeline {pp}")
    };
    let mut missing = Vec::new();
    'ranks: for p in 0..pp {
        for e in 0..ep {
            for t in (0..tp).filter(|&t| dirs.written(t, e)) {
                let d = dir.join(name_of(t, p, e));
                if !d.join(RANK_FILE).is_file() {
                    missing.push(Error::Mismatch {
                        what: format!(
                            "{}: missing (args say {sizes}: rank tp={t} pp={p}{})",
                            d.join(RANK_FILE).display(),
                            if ep > 1 {
                                format!(" ep={e}")
                            } else {
                                String::new()
                            }
                        ),
                    });
                }
                if missing.len() >= 20 {
                    break 'ranks;
                }
            }
        }
    }
    for (t, rest, d) in &found {
        let expected = rest.len() == parts
            && *t < tp
            && match rest[..] {
                [] => true,
                [x] if pp > 1 => x < pp,
                [e] => dirs.written(*t, e),
                [p, e] => p < pp && dirs.written(*t, e),
                _ => false,
            };
        if !expected {
            // A name with one more part than the args explain, the args saying no
            // expert parallelism: an expert-parallel checkpoint without its args.
            let why = if rest.len() == parts + 1 && ep == 1 {
                " (named like an expert-parallel rank, mp_rank_TT[_PPP]_EEE, but args.expert_model_parallel_size is 1: the args are not this checkpoint's, or expert parallelism is not recorded)"
            } else {
                ""
            };
            missing.push(Error::Mismatch {
                what: format!(
                    "{}: not a rank of {sizes} (as {} says){why}",
                    d.display(),
                    first_file.display()
                ),
            });
        }
    }
    if !missing.is_empty() {
        return Err(Error::Many(crate::error::Problems(missing)));
    }
    // The axis whose coordinate says which files hold a tensor: the pipeline stage,
    // the expert-parallel rank, or both (`pp_ep` = pp x EP + ep). Dense tensors live on
    // expert rank 0's coordinate (the other expert ranks hold data-parallel replicas of
    // them, not read); each expert on its own rank's.
    let stage_axis = match (pp > 1, ep > 1) {
        (true, false) => Some((PP_AXIS, pp)),
        (false, true) => Some((EP_AXIS, ep)),
        (true, true) => Some((PP_EP_AXIS, pp * ep)),
        (false, false) => None,
    };
    // The TP coordinate as two axes where the experts are split over fewer ranks than
    // the dense layers (1 < ETP < TP): the dense tensors are split over both, the
    // experts over the inner one, `tp % ETP`.
    let mut axes: Vec<(String, u64)> = match etp {
        e if e > 1 && e < tp => vec![(TP_AXIS.into(), tp / e), (ETP_AXIS.into(), e)],
        _ => vec![(TP_AXIS.into(), tp)],
    };
    let mesh = match stage_axis {
        Some((name, n)) => {
            axes.insert(0, (name.into(), n));
            Mesh::new(axes)?.with_pipeline(name)?
        }
        None => Mesh::new(axes)?,
    };
    let mut strategy = Strategy::new(mesh.clone());
    let mut files = Vec::with_capacity(world as usize);
    let mut notes = Vec::new();
    let mut carried: Vec<String> = Vec::new();
    let mut optim = Vec::new();
    let written: Vec<(u64, u64, u64)> = (0..pp)
        .flat_map(|p| (0..ep).flat_map(move |e| (0..tp).map(move |t| (p, e, t))))
        .filter(|&(_, e, t)| dirs.written(t, e))
        .collect();
    // Every rank's file mapped and parsed abreast (from a bucket, each a request), the
    // first's already.
    let rank_file = |&(p, e, t): &(u64, u64, u64)| dir.join(name_of(t, p, e)).join(RANK_FILE);
    let mut opened = open_abreast(&written, |r| {
        let file = rank_file(r);
        (file != first_file).then(|| RankFile::open(&file))
    })
    .into_iter();
    for &(p, e, t) in &written {
        let rank = (p * ep + e) * tp + t;
        let reads = Reads {
            dense: dirs.dense_from(t) == e,
            experts: dirs.experts_from(t, e),
        };
        let opened = match opened.next().flatten() {
            Some(r) => r?,
            None => first_rank
                .take()
                .expect("the first rank's file, opened once"),
        };
        let f = read_rank(
            opened,
            &args,
            rules,
            RankAt {
                tp: t,
                pp: p,
                ep: e,
            },
            reads,
            &mesh,
            rank,
            &mut strategy,
            &mut carried,
        )?;
        files.push((rank, f));
        let opt = dir.join(name_of(t, p, e)).join(DISTRIB_OPTIM_FILE);
        if etp != tp && opt.is_file() {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: the distributed optimizer's state with expert tensor parallel {etp} under tensor parallel {tp} is not read yet",
                    opt.display()
                ),
            });
        }
        optim.push((rank, p, opt.is_file().then_some(opt)));
    }
    if etp != tp {
        notes.push(format!(
            "{}: expert tensor parallel {etp} under tensor parallel {tp}: each TP rank's dense tensors and each EP rank's experts (each expert-TP part) are read from the first directory that holds them",
            dir.display()
        ));
    } else if ep > 1 {
        notes.push(format!(
            "{}: the dense tensors are read from expert-parallel rank 0 (ranks 1 to {} hold data-parallel copies of them)",
            dir.display(),
            ep - 1
        ));
        // Which rank holds which experts (the same in every MoE layer): mesh axis
        // `{EP_AXIS}` or `{PP_EP_AXIS}` is the stage coordinate in pictures.
        let per = args.moe.local_experts().unwrap_or(0);
        let held: Vec<String> = (0..ep)
            .map(|e| match per {
                1 => format!("ep {e}: expert {e}"),
                _ => format!("ep {e}: experts {}-{}", e * per, e * per + per - 1),
            })
            .collect();
        notes.push(format!(
            "experts by expert-parallel rank, every MoE layer ({} experts, global ids): {}",
            args.moe.experts.unwrap_or(0),
            held.join("; ")
        ));
    }
    // The distributed optimizer's state: fp32 master weights and Adam moments.
    optim::attach(
        &mut files,
        &mut strategy,
        &optim,
        &args_value,
        &first_file,
        pp,
        args.vp,
        // megatron-core marks experts `allreduce = False` (their own optimizer) only
        // when expert-parallel (`expert_model_parallel_size > 1`).
        (args.moe.experts.is_some() && ep > 1).then_some(optim::ExpertParallel { tp, etp, ep }),
        |rank| {
            let (t, stage) = (rank % tp, rank / tp);
            dir.join(name_of(t, stage / ep, stage % ep)).join(RANK_FILE)
        },
    )?;
    carried.sort();
    carried.dedup();
    if !carried.is_empty() {
        notes.push(format!(
            "{}: read, not tensors: {} (merge carries none of them; reshard --format megatron carries args, iteration and, to the same TP x PP, rng_state)",
            dir.display(),
            carried.join(", ")
        ));
    }
    Ok(Legacy {
        files,
        strategy,
        notes,
        args,
    })
}

/// A rank's file mapped, and its pickle parsed (from a store, the storages' local
/// headers are read when their tensors are: [`Deferred`]).
struct RankFile {
    path: PathBuf,
    map: Option<Mapped>,
    /// Where its storages lie (read once, with the pickle).
    index: ArchiveIndex,
    obj: Value,
}

impl RankFile {
    fn open(path: &Path) -> Result<RankFile> {
        let map = map_file(path)?;
        let all: &[u8] = map.as_deref().unwrap_or(&[]);
        let archive = Archive::open_for(all, map.as_ref()).map_err(|e| e.with_path(path))?;
        let obj = archive.object().map_err(|e| e.with_path(path))?;
        let index = archive.into_index();
        Ok(RankFile {
            path: path.to_path_buf(),
            map,
            index,
            obj,
        })
    }
}

/// Reads one rank's file: the tensors of `model` (or `model0`, `model1`, ...) under their
/// global names, each placed into `strategy` and checked against args.
#[allow(clippy::too_many_arguments)]
fn read_rank(
    rank_file: RankFile,
    args: &Args,
    rules: &SplitRules,
    at_rank: RankAt,
    reads: Reads,
    mesh: &Mesh,
    rank: u64,
    strategy: &mut Strategy,
    carried: &mut Vec<String>,
) -> Result<TensorFile> {
    let RankAt {
        tp: tp_rank,
        pp: pp_rank,
        ep: ep_rank,
    } = at_rank;
    let ep = args.moe.ep;
    // The coordinate on the mesh's stage axis (pipeline, expert, or both).
    let stage_of = |expert: bool| pp_rank * ep + if expert { ep_rank } else { 0 };
    let has_stage_axis = args.pp > 1 || ep > 1;
    let RankFile {
        path: file,
        map,
        index: archive,
        obj,
    } = rank_file;
    let file = file.as_path();
    let at = |e: Error| e.with_path(file);
    let mut names = Vec::new();
    obj.globals(&mut names);
    if let Some((m, n)) = names.into_iter().find(|(m, n)| !allowed(m, n)) {
        return Err(at(Error::InvalidTorch {
            problem: format!(
                "data.pkl names the global `{m}.{n}`, which a Megatron checkpoint does not hold"
            ),
        }));
    }
    let Value::Dict(top) = obj else {
        return Err(at(unknown("the saved object is not a dict".into())));
    };
    // Model chunks: `model`, or `model0`.. with virtual pipeline stages.
    let mut chunks: Vec<(u64, Value)> = Vec::new();
    for (k, v) in top {
        let Value::Str(k) = k else { continue };
        if k == "model" {
            chunks.push((0, v));
        } else if let Some(i) = k.strip_prefix("model").and_then(|i| i.parse::<u64>().ok()) {
            chunks.push((i, v));
        } else {
            carried.push(k);
        }
    }
    if chunks.is_empty() {
        return Err(at(unknown(
            "no `model` state dict (saved with --no-save-weights?)".into(),
        )));
    }
    let vp = args.vp.unwrap_or(1);
    if let Some((i, _)) = chunks.iter().find(|(i, _)| *i >= vp) {
        return Err(at(unknown(format!(
            "model chunk `model{i}` but args.virtual_pipeline_model_parallel_size is {vp}"
        ))));
    }
    let mut entries: Vec<TensorEntry> = Vec::new();
    let mut deferred_entries = Vec::new();
    for (chunk, v) in chunks {
        let (tensors, plain) = archive.tensors(v, String::new()).map_err(at)?;
        // `_extra_state` of a local (non-TransformerEngine) layer is None.
        if let Some(p) = plain.iter().find(|p| !p.ends_with("._extra_state")) {
            return Err(at(Error::InvalidTensor {
                tensor: p.clone(),
                problem: "a model entry that is not a tensor".into(),
            }));
        }
        for (mut t, deferred) in tensors {
            // TransformerEngine's `_extra_state` (FP8 scaling state) as a byte tensor:
            // not a weight; said, not carried.
            if t.name.ends_with("._extra_state") {
                carried.push("TransformerEngine _extra_state".into());
                continue;
            }
            let bad = |problem: String| {
                at(Error::InvalidTensor {
                    tensor: t.name.clone(),
                    problem,
                })
            };
            let global = global_name(&t.name, args, pp_rank, chunk).map_err(&bad)?;
            // Experts are numbered locally in the file: `g = ep_rank x E/EP + i`.
            let (global, expert) = match expert_name(&global, args, ep_rank) {
                Some(r) => (r.map_err(&bad)?, true),
                None => {
                    let grouped = is_grouped_weight(&global);
                    (global, grouped)
                }
            };
            if (expert && !reads.experts) || (!expert && !reads.dense) {
                // A copy another file's tensor is read from: a data-parallel replica
                // (dense tensors on EP ranks above 0), or a whole expert that every
                // TP rank holds (expert TP 1).
                continue;
            }
            if let Some(g) = grouped_split(&global, args, args.moe.ep, ep_rank).map_err(&bad)? {
                // A piece placed by the reader: this rank's rows of the grouped weight
                // (the same bytes), whole on every TP rank (expert TP 1).
                if t.shape != g.stored {
                    return Err(bad(format!(
                        "holds {:?}, but args give each of {} expert-parallel ranks {:?}",
                        t.shape, args.moe.ep, g.stored
                    )));
                }
                let placements = vec![Placement::Replicate; usize::from(has_stage_axis) + 1];
                let mut layout = TensorLayout::new(g.global.clone(), t.dtype, placements);
                if has_stage_axis {
                    layout = layout.with_stage(stage_of(false));
                }
                insert_layout(strategy, &global, layout, pp_rank).map_err(&at)?;
                t.shape = g.rows_shape();
                t.offsets = Some(vec![g.rows.start, 0]);
                t.name = global;
                entries.push(t);
                deferred_entries.push(deferred);
                continue;
            }
            // The user's rule first; the table's shape (and stage) still checks it.
            let (split, stage, want) = match (rules.find(&global), rule(&global, args)) {
                (Some((split, _)), Some((_, stage, want))) => (split, stage, want),
                (Some((split, _)), None) => (split, Stage::Any, None),
                (None, Some(r)) => r,
                (None, None) => {
                    return Err(bad(format!(
                        "no rule places `{global}` (not a layer of megatron-core's GPT model ckpt knows, and no user rule matches): {HOW_TO_ADD}"
                    )))
                }
            };
            let by = |what: String| match rules.find(&global) {
                Some((_, pattern)) => format!("{what} (split by {})", rules.describe(pattern)),
                None => what,
            };
            let want_stage = match stage {
                Stage::First => Some(0),
                Stage::Last => Some(args.pp - 1),
                Stage::Any => None,
            };
            if let Some(s) = want_stage.filter(|&s| s != pp_rank) {
                return Err(bad(format!(
                    "held by pipeline stage {pp_rank}, but megatron-core keeps it on stage {s}"
                )));
            }
            // Experts are split over the expert TP ranks (whole in every file with
            // expert TP 1 under TP > 1), the rest over the TP ranks.
            let by_table = expert && rules.find(&global).is_none();
            let etp = args.expert_tp();
            let split = if by_table && etp == 1 {
                Split::Replicated
            } else {
                split
            };
            let parts = if by_table { etp } else { args.tp };
            let mut shape = t.shape.clone();
            let placement = match split {
                Split::Replicated => Placement::Replicate,
                Split::Dim { dim, blocks } => {
                    if dim >= shape.len() {
                        return Err(bad(by(format!(
                            "split on dim {dim} by the rules, but it has shape {:?}",
                            t.shape
                        ))));
                    }
                    shape[dim] = shape[dim]
                        .checked_mul(parts)
                        .ok_or_else(|| overflow(format!("global shape of `{}`", t.name)))?;
                    Placement::blocked(dim, blocks)
                }
            };
            if let Some(w) = want.filter(|w| *w != shape) {
                return Err(bad(by(format!(
                    "args give it the global shape {w:?}, but this file's {} {:?} on {} tensor-parallel ranks makes {shape:?}: the args contradict the file",
                    dtype_name(t.dtype),
                    t.shape,
                    args.tp
                ))));
            }
            // Two TP axes (1 < ETP < TP): the dense tensors split over both, outer
            // first, as over TP ranks `outer x ETP + inner`; the experts over the inner.
            let mut placements = if mesh.axis_index(ETP_AXIS).is_some() {
                let outer = if parts == args.tp {
                    placement
                } else {
                    Placement::Replicate
                };
                vec![outer, placement]
            } else {
                vec![placement]
            };
            if has_stage_axis {
                placements.insert(0, Placement::Replicate);
            }
            let mut layout = TensorLayout::new(shape.clone(), t.dtype, placements);
            if has_stage_axis {
                layout = layout.with_stage(stage_of(expert));
            }
            let placed_at = if expert { rank } else { args.dense_rank(rank) };
            if layout.local_shape(mesh, placed_at).as_deref() != Some(&t.shape[..]) {
                return Err(bad(by(format!(
                    "holds {:?}, but a {split:?} split of {shape:?} over {} ranks gives rank tp={tp_rank} another shape",
                    t.shape, args.tp
                ))));
            }
            insert_layout(strategy, &global, layout, pp_rank).map_err(&at)?;
            t.name = global;
            entries.push(t);
            deferred_entries.push(deferred);
        }
    }
    let metadata = BTreeMap::from([
        ("format".to_string(), "megatron".to_string()),
        ("rank".to_string(), rank.to_string()),
    ]);
    let mut f = TensorFile::from_parts(file, map, FileFormat::TorchSave, entries, metadata)?;
    Deferred::attach_all(&mut f, deferred_entries);
    Ok(f)
}

/// Records `layout` as `name`'s, or checks it against the one other ranks gave it.
fn insert_layout(
    strategy: &mut Strategy,
    name: &str,
    layout: TensorLayout,
    pp_rank: u64,
) -> Result<()> {
    match strategy.tensors.get(name) {
        Some(l) if l != &layout => Err(Error::InvalidTensor {
            tensor: name.to_string(),
            problem: format!(
                "it is {} {:?} on stage {pp_rank}, but other ranks hold {} {:?} (stage {:?})",
                dtype_name(layout.dtype),
                layout.shape,
                dtype_name(l.dtype),
                l.shape,
                l.stage
            ),
        }),
        Some(_) => Ok(()),
        None => strategy.insert(name.to_string(), layout),
    }
}

/// A dist_ckpt's stacked layer tensors (`decoder.layers.<param>`, `[layers, ...]`: the
/// layer is the offset on the first axis, global over the pipeline stages) given as one
/// tensor a layer, named as the legacy format names them
/// (`decoder.layers.<l>.<param>`); the experts, stacked `[layers, experts, …]`
/// (`decoder.layers.mlp.experts.experts.<param>`), as one tensor a layer and expert
/// (`decoder.layers.<l>.mlp.experts.local_experts.<e>.<param>`, global expert ids, the
/// offset on the experts axis). Each stored chunk's layers (and experts) become chunks
/// of their own, parts of the chunk's archive ([`ChunkPart`]), so the same bytes are
/// read.
/// Optimizer state and flattened chunks keep their names.
///
/// # Errors
/// Size arithmetic that overflows.
pub(crate) fn unstack_layers(m: &mut DcpMetadata) -> Result<()> {
    // `rest` after `decoder.layers.`, and how many leading axes are stacked: the layers,
    // and for experts (`mlp.experts.experts.<param>`, `[layers, experts, …]`) the
    // experts too.
    // (A wrapper's prefix before `decoder.layers.` is kept: NeMo's `module.`.)
    const LAYERS: &str = "decoder.layers.";
    let stacked = |name: &str| {
        let at = name
            .match_indices(LAYERS)
            .map(|(i, _)| i)
            .find(|&i| i == 0 || name[..i].ends_with('.'))?;
        let rest = &name[at + LAYERS.len()..];
        (!rest.starts_with(|c: char| c.is_ascii_digit())).then(|| {
            let lead = if rest.starts_with(STACKED_EXPERTS) {
                2
            } else {
                1
            };
            (name[..at].to_string(), rest.to_string(), lead)
        })
    };
    // The name of one layer's (and expert's) tensor: legacy names, global numbers.
    let one = |prefix: &str, rest: &str, at: &[u64]| match at {
        [l, e] => format!(
            "{prefix}{LAYERS}{l}.mlp.experts.local_experts.{e}.{}",
            &rest[STACKED_EXPERTS.len()..]
        ),
        [l] => format!("{prefix}{LAYERS}{l}.{rest}"),
        _ => unreachable!("one or two stacked axes"),
    };
    let flat: BTreeSet<String> = m
        .chunks
        .iter()
        .filter(|c| c.part.is_some() || c.flat.is_some())
        .map(|c| c.fqn.clone())
        .collect();
    let names: Vec<String> = m
        .tensors
        .iter()
        .filter(|(n, t)| {
            stacked(n).is_some_and(|(_, _, lead)| t.shape.len() > lead) && !flat.contains(*n)
        })
        .map(|(n, _)| n.clone())
        .collect();
    let overflow = |what: &str| overflow(format!("unstacking `{what}`"));
    // Every index of the leading `lead` axes of `sizes`, row-major.
    let indices = |sizes: &[u64], lead: usize| -> Vec<Vec<u64>> {
        let mut out = vec![vec![]];
        for &n in &sizes[..lead] {
            out = out
                .into_iter()
                .flat_map(|p| (0..n).map(move |i| [p.clone(), vec![i]].concat()))
                .collect();
        }
        out
    };
    for name in &names {
        let Some(t) = m.tensors.remove(name) else {
            continue;
        };
        let (prefix, rest, lead) = stacked(name).unwrap_or_default();
        let per: Vec<String> = indices(&t.shape, lead)
            .iter()
            .map(|at| one(&prefix, &rest, at))
            .collect();
        for n in &per {
            m.tensors.insert(
                n.clone(),
                DcpTensor {
                    dtype: t.dtype,
                    shape: t.shape[lead..].to_vec(),
                },
            );
        }
        if let Some(i) = m.order.iter().position(|n| n == name) {
            m.order.splice(i..=i, per);
        }
    }
    let mut chunks = Vec::with_capacity(m.chunks.len());
    for c in std::mem::take(&mut m.chunks) {
        let Some((prefix, rest, lead)) = stacked(&c.fqn).filter(|_| names.contains(&c.fqn)) else {
            chunks.push(c);
            continue;
        };
        let inner: u64 = c.sizes[lead..]
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .ok_or_else(|| overflow(&c.fqn))?;
        for (k, at) in indices(&c.sizes, lead).into_iter().enumerate() {
            let global = at
                .iter()
                .zip(&c.offsets)
                .map(|(i, o)| o.checked_add(*i))
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| overflow(&c.fqn))?;
            chunks.push(DcpChunk {
                fqn: one(&prefix, &rest, &global),
                offsets: c.offsets[lead..].to_vec(),
                sizes: c.sizes[lead..].to_vec(),
                file: c.file.clone(),
                start: c.start,
                len: c.len,
                part: Some(ChunkPart {
                    stored: c.sizes.clone(),
                    elements: FlatRange::new(
                        (k as u64)
                            .checked_mul(inner)
                            .ok_or_else(|| overflow(&c.fqn))?,
                        inner,
                    ),
                }),
                flat: None,
            });
        }
    }
    m.chunks = chunks;
    Ok(())
}

/// A dist_ckpt's experts of one kind, stacked over layers and experts (after
/// `decoder.layers.`): `SequentialMLP.sharded_state_dict`'s `experts.experts.` prefix.
const STACKED_EXPERTS: &str = "mlp.experts.experts.";

#[cfg(test)]
mod tests {
    use super::*;

    /// The directories and readers `RankDirs` gives equal those of Megatron's rule
    /// enumerated process by process (one stage, CP 1): a process writes when its dense
    /// DP rank (`r / TP`) or its expert DP rank (`r / (ETP x EP)`) is 0, into
    /// `(r % TP, (r / ETP) % EP)`; whatever the data-parallel size.
    #[test]
    fn rank_dirs_follow_megatrons_save_rule() {
        for tp in 1..=6u64 {
            for ep in 1..=6u64 {
                for etp in (1..=tp).filter(|e| tp % e == 0) {
                    let lcm = |a: u64, b: u64| a / gcd(a, b) * b;
                    fn gcd(a: u64, b: u64) -> u64 {
                        if b == 0 {
                            a
                        } else {
                            gcd(b, a % b)
                        }
                    }
                    let dirs = RankDirs { tp, ep, etp };
                    for k in 1..=3 {
                        let world = k * lcm(tp, etp * ep);
                        let mut want = BTreeSet::new();
                        for r in 0..world {
                            if r / tp == 0 || r / (etp * ep) == 0 {
                                want.insert((r % tp, (r / etp) % ep));
                            }
                        }
                        let got: BTreeSet<(u64, u64)> = (0..tp)
                            .flat_map(|t| (0..ep).map(move |e| (t, e)))
                            .filter(|&(t, e)| dirs.written(t, e))
                            .collect();
                        assert_eq!(got, want, "tp {tp} ep {ep} etp {etp} world {world}");
                        for t in 0..tp {
                            let first = want.iter().find(|d| d.0 == t).map(|d| d.1);
                            assert_eq!(Some(dirs.dense_from(t)), first, "dense of tp {t}");
                        }
                        // Each EP rank's experts (each expert-TP part) read once.
                        for e in 0..ep {
                            let readers: Vec<u64> = (0..tp)
                                .filter(|&t| dirs.written(t, e) && dirs.experts_from(t, e))
                                .collect();
                            let parts: BTreeSet<u64> = readers.iter().map(|t| t % etp).collect();
                            assert_eq!(readers.len() as u64, etp, "experts of ep {e}");
                            assert_eq!(parts.len() as u64, etp, "experts of ep {e}");
                        }
                    }
                }
            }
        }
    }

    fn args() -> Args {
        Args {
            tp: 2,
            pp: 2,
            num_layers: Some(4),
            hidden: Some(16),
            ffn_hidden: Some(32),
            heads: Some(4),
            query_groups: Some(2),
            padded_vocab: Some(64),
            max_positions: Some(8),
            ..Args::default()
        }
    }

    #[test]
    fn layers_are_renumbered_by_stage_and_chunk() {
        let a = args();
        assert_eq!(
            global_name("decoder.layers.1.mlp.linear_fc1.weight", &a, 1, 0).unwrap(),
            "decoder.layers.3.mlp.linear_fc1.weight"
        );
        let v = Args { vp: Some(2), ..a };
        // 4 layers, 2 stages, 2 chunks: one layer per chunk; chunk 1 of stage 0 is layer 2.
        assert_eq!(
            global_name("decoder.layers.0.input_layernorm.weight", &v, 0, 1).unwrap(),
            "decoder.layers.2.input_layernorm.weight"
        );
        assert!(global_name("decoder.layers.1.x", &v, 0, 0)
            .unwrap_err()
            .contains("stage of 1 layers"));
    }

    #[test]
    fn written_args_read_back_with_the_new_sizes() {
        use crate::formats::pickle::{parse, Emitter};
        // A Namespace as torch.save pickles it: NEWOBJ of the class, then BUILD.
        let mut e = Emitter::new();
        e.global("argparse", "Namespace").empty_tuple().new_obj();
        e.empty_dict().mark();
        e.str("tensor_model_parallel_size").int(2);
        e.str("pipeline_model_parallel_size").int(2);
        e.str("num_layers").int(4);
        e.str("params_dtype").global("torch", "float32");
        e.str("lr").float(-1.5e-4);
        e.set_items().build();
        let state = SourceState {
            args_value: parse(&e.finish()).unwrap(),
            args: args(),
            iteration: 7,
            release: false,
        };
        let fragment = extra_entries(&state, (4, 1, 1), None, None, LEGACY_FORMAT).unwrap();
        let mut d = Emitter::new();
        d.empty_dict().mark().raw(&fragment).set_items();
        let back = parse(&d.finish()).unwrap();
        let a = Args::from_value(back.get("args").unwrap(), Path::new("x")).unwrap();
        assert_eq!((a.tp, a.pp, a.num_layers), (4, 1, Some(4)));
        assert_eq!(back.get("iteration"), Some(&Value::Int(7)));
        assert_eq!(back.get("checkpoint_version"), Some(&Value::Float(3.0)));
        let fields = namespace_fields(back.get("args").unwrap()).unwrap();
        let get = |k: &str| {
            fields
                .iter()
                .find(|(n, _)| *n == Value::Str(k.into()))
                .map(|(_, v)| v)
        };
        assert_eq!(get("lr"), Some(&Value::Float(-1.5e-4)));
        assert_eq!(get("no_save_rng"), Some(&Value::Bool(true)));
        assert_eq!(
            get("params_dtype"),
            Some(&Value::Global {
                module: "torch".into(),
                name: "float32".into()
            })
        );
    }

    #[test]
    fn stage_names_invert_global_names() {
        let a = args();
        for pp in [1, 2, 4] {
            for g in 0..4u64 {
                let name = format!("decoder.layers.{g}.mlp.linear_fc2.weight");
                let (s, local) = stage_name(&name, &a, pp).unwrap();
                let per = 4 / pp;
                let b = Args { pp, ..a.clone() };
                assert_eq!(global_name(&local, &b, s, 0).unwrap(), name);
                assert_eq!(s, g / per);
            }
        }
        assert_eq!(stage_name("output_layer.weight", &a, 4).unwrap().0, 3);
        assert_eq!(
            stage_name("embedding.word_embeddings.weight", &a, 4)
                .unwrap()
                .0,
            0
        );
        assert!(stage_name("decoder.layers.0.x", &a, 3).is_err());
    }

    #[test]
    fn rules_give_splits_and_shapes_from_args() {
        let a = args();
        let (s, _, shape) = rule("decoder.layers.0.self_attention.linear_qkv.weight", &a).unwrap();
        assert_eq!(s, Split::Dim { dim: 0, blocks: 1 });
        // (4 heads + 2 x 2 groups) x 4 channels.
        assert_eq!(shape, Some(vec![32, 16]));
        let (s, _, _) = rule("decoder.layers.3.self_attention.linear_proj.weight", &a).unwrap();
        assert_eq!(s, Split::Dim { dim: 1, blocks: 1 });
        let (s, st, _) = rule("output_layer.weight", &a).unwrap();
        assert_eq!((s, st), (Split::Dim { dim: 0, blocks: 1 }, Stage::Last));
        let g = Args {
            swiglu: true,
            ..a.clone()
        };
        let (s, _, shape) = rule("decoder.layers.0.mlp.linear_fc1.weight", &g).unwrap();
        assert_eq!(
            (s, shape),
            (Split::Dim { dim: 0, blocks: 2 }, Some(vec![64, 16]))
        );
        assert!(rule("decoder.layers.0.mystery.weight", &a).is_none());
        assert!(rule("lm_head.weight", &a).is_none());
    }
}

/// Megatron's `metadata.json` beside a DCP directory's `.metadata` (dist_ckpt): the
/// backend must be torch_dist (the one whose files are DCP's); what `common.pt` holds
/// is said, since ckpt does not carry it.
///
/// # Errors
/// A metadata.json that is not JSON, or names another sharded backend.
pub(crate) fn dist_ckpt_notes(dir: &Path) -> Result<Vec<String>> {
    let meta = dir.join(DIST_METADATA_FILE);
    let text = String::from_utf8_lossy(&crate::formats::read_small(&meta)?).into_owned();
    let doc: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| unknown(format!("{}: not JSON: {e}", meta.display())))?;
    let backend = doc.get("sharded_backend").and_then(|b| b.as_str());
    if backend != Some("torch_dist") {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: Megatron dist_ckpt with sharded_backend {}: ckpt reads the torch_dist backend only",
                meta.display(),
                backend.map_or("(none)".to_string(), |b| format!("`{b}`"))
            ),
        });
    }
    let mut notes = vec![];
    let common = dir.join(COMMON_FILE);
    if common.is_file() {
        notes.push(match common_keys(&common) {
            Ok((keys, args)) => format!(
                "{}: Megatron dist_ckpt (torch_dist){}; common.pt holds {} (not carried)",
                dir.display(),
                args.map_or(String::new(), |a| format!(
                    ", saved on tensor parallel {} x pipeline {}",
                    a.tp, a.pp
                )),
                if keys.is_empty() {
                    "nothing".to_string()
                } else {
                    keys.join(", ")
                }
            ),
            Err(e) => format!("{}: unreadable ({e}); not carried", common.display()),
        });
    }
    Ok(notes)
}

/// Megatron dist_ckpt's own metadata file.
pub(crate) const DIST_METADATA_FILE: &str = "metadata.json";
/// dist_ckpt's file of the state that is not sharded (args, iteration, ...).
pub(crate) const COMMON_FILE: &str = "common.pt";

/// A `common.pt`'s object, read with the globals Megatron's pickles may name.
fn common_object(path: &Path) -> Result<Value> {
    let map = map_file(path)?;
    pickled::object(map.as_deref().unwrap_or(&[]))
}

/// The top-level keys of a `common.pt`, and its args when they are Megatron's.
fn common_keys(path: &Path) -> Result<(Vec<String>, Option<Args>)> {
    let obj = common_object(path)?;
    let Value::Dict(kv) = &obj else {
        return Ok((vec![], None));
    };
    let keys = kv
        .iter()
        .filter_map(|(k, _)| match k {
            Value::Str(s) => Some(s.clone()),
            _ => None,
        })
        .collect();
    let args = obj.get("args").and_then(|a| Args::from_value(a, path).ok());
    Ok((keys, args))
}

/// The args in a dist_ckpt's `common.pt` (Megatron-LM saves them there), when `dir`
/// is a dist_ckpt whose common state has Megatron's args.
///
/// # Errors
/// A `common.pt` that cannot be read, or args that are not Megatron's.
pub(crate) fn dist_ckpt_args(dir: &Path) -> Result<Option<Args>> {
    let common = dir.join(COMMON_FILE);
    if !common.is_file() || !dir.join(DIST_METADATA_FILE).is_file() {
        return Ok(None);
    }
    let obj = common_object(&common).map_err(|e| e.with_path(&common))?;
    obj.get("args")
        .map(|a| Args::from_value(a, &common))
        .transpose()
}

/// The model's sizes a trainer recorded in its own run config, in Megatron's
/// (TransformerConfig's) names, as Megatron-LM's args: Megatron-Bridge's
/// `run_config.yaml` (`section` `model`, a GPTModelProvider) and NeMo 2's
/// `context/model.yaml` (`section` `config`). Each field is renamed where Megatron-LM's
/// args spell it otherwise (`share_embeddings_and_output_weights` is the negation of
/// `untie_embeddings_and_output_weights`, `gated_linear_unit` with SiLU is `swiglu`,
/// `num_moe_experts` is `num_experts`). Where NeMo's config does not give
/// `vocab_size`, NeMo takes the tokenizer's ([`nemo_tokenizer_vocab`]).
///
/// # Errors
/// Not YAML; no such section; a record that does not give the vocabulary's size and
/// whose tokenizer does not say it, or another field the export needs.
pub(crate) fn args_of_run_config(path: &Path, section: &str) -> Result<Args> {
    let text = String::from_utf8(crate::formats::read_small(path)?)
        .map_err(|_| unknown(format!("{}: not UTF-8 text", path.display())))?;
    args_of_run_config_text(&text, section, path)
}

/// [`args_of_run_config`] of the file's text (`path` is for messages).
pub(crate) fn args_of_run_config_text(text: &str, section: &str, path: &Path) -> Result<Args> {
    let bad = |what: String| unknown(format!("{}: {what}", path.display()));
    let doc: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| bad(format!("not YAML: {e}")))?;
    let model = doc
        .get(section)
        .and_then(serde_yaml::Value::as_mapping)
        .ok_or_else(|| bad(format!("no `{section}` section (the model's config)")))?;
    let scalar = |v: &serde_yaml::Value| -> Option<Value> {
        match v {
            serde_yaml::Value::Null => Some(Value::None),
            serde_yaml::Value::Bool(b) => Some(Value::Bool(*b)),
            serde_yaml::Value::Number(n) => n
                .as_i64()
                .map(Value::Int)
                .or_else(|| n.as_f64().map(Value::Float)),
            serde_yaml::Value::String(s) => Some(Value::Str(s.clone())),
            _ => None,
        }
    };
    let mut fields: Vec<(Value, Value)> = vec![];
    let get = |k: &str| model.get(k).and_then(scalar);
    for (k, v) in model {
        let (Some(key), Some(value)) = (k.as_str(), scalar(v)) else {
            continue;
        };
        let key = match key {
            "num_moe_experts" => "num_experts",
            other => other,
        };
        fields.push((Value::Str(key.to_string()), value));
    }
    if let Some(Value::Bool(share)) = get("share_embeddings_and_output_weights") {
        fields.push((
            Value::Str("untie_embeddings_and_output_weights".into()),
            Value::Bool(!share),
        ));
    }
    // SwiGLU: a gated linear unit of SiLU (`activation_func` is a `{_target_: ...silu}`).
    let silu = model
        .get("activation_func")
        .and_then(|a| a.get("_target_"))
        .and_then(serde_yaml::Value::as_str)
        .is_none_or(|t| t.ends_with("silu"));
    if matches!(get("gated_linear_unit"), Some(Value::Bool(true))) && silu {
        fields.push((Value::Str("swiglu".into()), Value::Bool(true)));
    }
    if let (Some(Value::Int(groups)), Some(Value::Int(heads))) =
        (get("num_query_groups"), get("num_attention_heads"))
    {
        fields.push((
            Value::Str("group_query_attention".into()),
            Value::Bool(groups != heads),
        ));
    }
    if !matches!(get("vocab_size"), Some(Value::Int(v)) if v > 0) {
        let vocab = match doc.get("tokenizer") {
            Some(t) if section == "config" => nemo_tokenizer_vocab(t, path),
            _ => Err("the trainer takes it from its tokenizer".into()),
        }
        .map_err(|why| bad(format!("`{section}.vocab_size` is not recorded, and {why}")))?;
        fields.retain(|(k, _)| *k != Value::Str("vocab_size".into()));
        fields.push((Value::Str("vocab_size".into()), Value::Int(vocab)));
    }
    Args::from_fields(&fields, path)
}

/// The vocabulary NeMo 2's model takes from its tokenizer where its config has no
/// `vocab_size` (`GPTConfig.configure_model`: `tokenizer.vocab_size`, then padded as
/// the weights are): model.yaml's `tokenizer` (NeMo
/// `8cfedd7203462cb251a914e700e5605444277561`):
/// - `NullTokenizer(vocab_size=n)`: `n + 1` (its `vocab_size` adds the end-of-document
///   token, `null_tokenizer.py`);
/// - `AutoTokenizer(pretrained_model_name=DIR)`: `len(tokenizer)`, the tokenizer's
///   vocabulary and its added tokens, read from `DIR/tokenizer.json` (`DIR` relative to
///   the model.yaml's directory, where NeMo's artifact keeps it: `nemo_tokenizer`).
///
/// # Errors
/// Another tokenizer, or one whose size its files do not say: why, in words.
fn nemo_tokenizer_vocab(t: &serde_yaml::Value, path: &Path) -> std::result::Result<i64, String> {
    let target = t
        .get("_target_")
        .and_then(serde_yaml::Value::as_str)
        .unwrap_or("");
    let class = target.rsplit('.').next().unwrap_or("");
    match class {
        "NullTokenizer" => t
            .get("vocab_size")
            .and_then(serde_yaml::Value::as_i64)
            .filter(|n| *n >= 0)
            .map(|n| n + 1)
            .ok_or_else(|| "`tokenizer.vocab_size` (NullTokenizer's) is not a size".into()),
        "AutoTokenizer" => {
            let name = t
                .get("pretrained_model_name")
                .and_then(serde_yaml::Value::as_str)
                .ok_or("`tokenizer.pretrained_model_name` (AutoTokenizer's) is not given")?;
            let dir = path.parent().unwrap_or(Path::new(".")).join(name);
            let file = dir.join("tokenizer.json");
            let bytes = crate::formats::read_small(&file).map_err(|e| {
                format!("the AutoTokenizer's {} cannot be read ({e})", file.display())
            })?;
            hf_tokenizer_len(&bytes).map_err(|why| format!("{}: {why}", file.display()))
        }
        _ => Err(format!(
            "its tokenizer `{target}` keeps its size in a form ckpt does not read (NullTokenizer and AutoTokenizer are read)"
        )),
    }
}

/// `len(tokenizer)` of a Hugging Face fast tokenizer's `tokenizer.json`: the model's
/// vocabulary (a `{token: id}` map, or Unigram's list of pieces) and the added tokens
/// that are not in it (`get_vocab_size(with_added_tokens=True)`).
fn hf_tokenizer_len(bytes: &[u8]) -> std::result::Result<i64, String> {
    let doc: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let vocab = &doc["model"]["vocab"];
    let added = doc["added_tokens"].as_array().cloned().unwrap_or_default();
    let n = if let Some(map) = vocab.as_object() {
        let ids: std::collections::BTreeSet<i64> =
            map.values().filter_map(serde_json::Value::as_i64).collect();
        let extra: std::collections::BTreeSet<i64> = added
            .iter()
            .filter(|a| a["content"].as_str().is_some_and(|c| !map.contains_key(c)))
            .filter_map(|a| a["id"].as_i64())
            .filter(|id| !ids.contains(id))
            .collect();
        ids.len() + extra.len()
    } else if let Some(pieces) = vocab.as_array() {
        let inside: std::collections::BTreeSet<&str> = pieces
            .iter()
            .filter_map(|p| p.get(0).and_then(serde_json::Value::as_str))
            .collect();
        pieces.len()
            + added
                .iter()
                .filter(|a| a["content"].as_str().is_some_and(|c| !inside.contains(c)))
                .count()
    } else {
        return Err("no `model.vocab` (the tokenizer's vocabulary)".into());
    };
    i64::try_from(n).map_err(|_| "a vocabulary too large".into())
}

/// What a legacy output carries from its source: the pickled args (updated for the new
/// sizes) and the iteration.
#[derive(Clone, Debug)]
pub(crate) struct SourceState {
    args_value: Value,
    pub(crate) args: Args,
    pub(crate) iteration: u64,
    /// A `release` checkpoint (Megatron's name for one converted from another framework,
    /// loaded at iteration 0): `release/` and a tracker that says `release`.
    pub(crate) release: bool,
}

impl SourceState {
    /// Where rank `(tp, pp)` of `pp_size` stages goes.
    pub(crate) fn rank_path(&self, tp: u64, pp: u64, pp_size: u64) -> PathBuf {
        let path = rank_path(self.iteration, tp, pp, pp_size);
        if self.release {
            let mut parts = path.components();
            parts.next();
            Path::new("release").join(parts.as_path())
        } else {
            path
        }
    }

    /// What the tracker file says.
    pub(crate) fn tracker_text(&self) -> String {
        if self.release {
            "release".into()
        } else {
            self.iteration.to_string()
        }
    }
}

/// The fields of Megatron-LM's args (arguments.py's names) for a model imported from
/// another framework: what a training run of it would be started with.
pub(crate) struct ImportedModel<'a> {
    pub(crate) layers: u64,
    pub(crate) hidden: u64,
    pub(crate) heads: u64,
    pub(crate) groups: u64,
    pub(crate) kv_channels: u64,
    pub(crate) ffn: u64,
    pub(crate) vocab: u64,
    pub(crate) max_positions: u64,
    pub(crate) eps: f64,
    pub(crate) rotary_base: f64,
    pub(crate) swiglu: bool,
    pub(crate) rms_norm: bool,
    pub(crate) learned_positions: bool,
    pub(crate) bias: bool,
    pub(crate) qkv_bias: bool,
    pub(crate) qk_layernorm: bool,
    pub(crate) tied: bool,
    /// A mixture of experts in every layer.
    pub(crate) experts: Option<ImportedExperts>,
    /// torch's dtype name (`float32`, `bfloat16`).
    pub(crate) dtype: &'a str,
}

/// The experts of an imported model (docs/moe.md's args).
pub(crate) struct ImportedExperts {
    pub(crate) experts: u64,
    pub(crate) topk: u64,
    pub(crate) ffn: u64,
    /// 0: no shared expert.
    pub(crate) shared_ffn: u64,
    pub(crate) shared_gate: bool,
    /// The top-k router weights renormalised (`moe_router_pre_softmax` false).
    pub(crate) norm_topk: bool,
}

/// The state a legacy output of an imported model carries: an `argparse.Namespace` of
/// Megatron-LM's args for it (TP 1 x PP 1: the writer sets the output's sizes), as a
/// `release` checkpoint. The vocabulary is not padded: `padded_vocab_size` is the
/// vocabulary and `make_vocab_size_divisible_by` 1 (a run must keep that padding).
pub(crate) fn imported_state(m: &ImportedModel<'_>) -> Result<SourceState> {
    let int = |v: u64| Value::Int(i64::try_from(v).unwrap_or(i64::MAX));
    // Megatron-LM's MoE args (docs/moe.md), every layer sparse, experts on one
    // expert-parallel rank (the writer sets the output's sizes).
    let moe: Vec<(&str, Value)> = match &m.experts {
        None => vec![("num_experts", Value::None)],
        Some(e) => vec![
            ("num_experts", int(e.experts)),
            ("moe_router_topk", int(e.topk)),
            ("moe_ffn_hidden_size", int(e.ffn)),
            (
                "moe_shared_expert_intermediate_size",
                if e.shared_ffn > 0 {
                    int(e.shared_ffn)
                } else {
                    Value::None
                },
            ),
            ("moe_shared_expert_gate", Value::Bool(e.shared_gate)),
            ("moe_router_pre_softmax", Value::Bool(!e.norm_topk)),
            ("moe_router_score_function", Value::Str("softmax".into())),
            ("moe_router_enable_expert_bias", Value::Bool(false)),
            ("moe_layer_freq", int(1)),
            ("moe_grouped_gemm", Value::Bool(false)),
            ("expert_model_parallel_size", int(1)),
            ("expert_tensor_parallel_size", Value::None),
        ],
    };
    let fields: Vec<(&str, Value)> = vec![
        ("tensor_model_parallel_size", int(1)),
        ("pipeline_model_parallel_size", int(1)),
        ("virtual_pipeline_model_parallel_size", Value::None),
        ("num_layers", int(m.layers)),
        ("hidden_size", int(m.hidden)),
        ("ffn_hidden_size", int(m.ffn)),
        ("num_attention_heads", int(m.heads)),
        ("group_query_attention", Value::Bool(m.groups != m.heads)),
        ("num_query_groups", int(m.groups)),
        ("kv_channels", int(m.kv_channels)),
        ("vocab_size", int(m.vocab)),
        ("padded_vocab_size", int(m.vocab)),
        ("make_vocab_size_divisible_by", int(1)),
        ("max_position_embeddings", int(m.max_positions)),
        ("seq_length", int(m.max_positions)),
        (
            "position_embedding_type",
            Value::Str(
                if m.learned_positions {
                    "learned_absolute"
                } else {
                    "rope"
                }
                .into(),
            ),
        ),
        ("rotary_base", Value::Int(m.rotary_base as i64)),
        ("rotary_percent", Value::Float(1.0)),
        (
            "normalization",
            Value::Str(if m.rms_norm { "RMSNorm" } else { "LayerNorm" }.into()),
        ),
        ("norm_epsilon", Value::Float(m.eps)),
        ("swiglu", Value::Bool(m.swiglu)),
        ("add_bias_linear", Value::Bool(m.bias)),
        ("add_qkv_bias", Value::Bool(m.qkv_bias)),
        ("qk_layernorm", Value::Bool(m.qk_layernorm)),
        ("untie_embeddings_and_output_weights", Value::Bool(!m.tied)),
        (
            "params_dtype",
            Value::Global {
                module: "torch".into(),
                name: m.dtype.into(),
            },
        ),
        ("bf16", Value::Bool(m.dtype == "bfloat16")),
        ("fp16", Value::Bool(m.dtype == "float16")),
        ("num_layers_in_first_pipeline_stage", Value::None),
        ("num_layers_in_last_pipeline_stage", Value::None),
        ("ckpt_format", Value::Str("torch".into())),
        ("no_save_optim", Value::Bool(true)),
        ("no_save_rng", Value::Bool(true)),
        ("iteration", int(0)),
    ]
    .into_iter()
    .chain(moe)
    .collect();
    let args_value = Value::Build {
        object: Box::new(Value::Call {
            callable: Box::new(Value::Global {
                module: "argparse".into(),
                name: "Namespace".into(),
            }),
            args: Box::new(Value::Tuple(vec![])),
        }),
        state: Box::new(Value::Dict(
            fields
                .into_iter()
                .map(|(k, v)| (Value::Str(k.into()), v))
                .collect(),
        )),
    };
    let args = Args::from_value(&args_value, Path::new("(imported model)"))?;
    Ok(SourceState {
        args_value,
        args,
        iteration: 0,
        release: true,
    })
}

/// The strategy of an imported model's tensors (global names) on one rank of a
/// `pp=1,tp=1` mesh, each placed by megatron-core's rule (its tensor-parallel split):
/// what a reshard to another TP x PP starts from.
///
/// # Errors
/// A tensor no rule places, or whose shape the args contradict.
pub(crate) fn imported_strategy(
    args: &Args,
    tensors: &[(String, Dtype, Vec<u64>)],
) -> Result<Strategy> {
    let mesh = Mesh::new(vec![(PP_AXIS.into(), 1), (TP_AXIS.into(), 1)])?.with_pipeline(PP_AXIS)?;
    let mut strategy = Strategy::new(mesh);
    for (name, dtype, shape) in tensors {
        let bad = |problem: String| Error::InvalidTensor {
            tensor: name.clone(),
            problem,
        };
        let (split, _, want) = rule(name, args).ok_or_else(|| bad(no_rule(name)))?;
        if let Some(w) = want.filter(|w| w != shape) {
            return Err(bad(format!(
                "has shape {shape:?}, but the model's sizes give Megatron's tensor {w:?}"
            )));
        }
        let placement = match split {
            Split::Replicated => Placement::Replicate,
            Split::Dim { dim, blocks } => Placement::blocked(dim, blocks),
        };
        let layout =
            TensorLayout::new(shape.clone(), *dtype, vec![Placement::Replicate, placement])
                .with_stage(0);
        strategy.tensors.insert(name.clone(), layout);
    }
    Ok(strategy)
}

/// Reads `args` and `iteration` again from a source rank file.
///
/// # Errors
/// A file that is not a Megatron rank file.
pub(crate) fn source_state(file: &Path) -> Result<SourceState> {
    let map = map_file(file)?;
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let at = |e: Error| e.with_path(file);
    let obj = Archive::open(all).and_then(|a| a.object()).map_err(at)?;
    let args_value = obj
        .get("args")
        .cloned()
        .ok_or_else(|| at(unknown("no `args`: not a Megatron rank file".into())))?;
    let args = Args::from_value(&args_value, file)?;
    let iteration = match obj.get("iteration") {
        Some(Value::Int(i)) if *i >= 0 => *i as u64,
        _ => 0,
    };
    // (`<save>/release/mp_rank_*/model_optim_rng.pt`.)
    let release = file
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .is_some_and(|n| n == "release");
    Ok(SourceState {
        args_value,
        args,
        iteration,
        release,
    })
}

/// Why a Megatron output cannot place tensor `name`.
fn no_rule(name: &str) -> String {
    if name.starts_with("optim.") {
        // The distributed optimizer's state read from the source.
        "the distributed optimizer's state is read, not written in Megatron's layouts: add --exclude 'optim.*' to write the weights".into()
    } else {
        "no rule of megatron-core's GPT model places it".into()
    }
}

/// The stage and stage-local name of a global name on `pp` uniform stages (no virtual
/// stages): the inverse of [`global_name`].
pub(crate) fn stage_name(
    global: &str,
    args: &Args,
    pp: u64,
) -> std::result::Result<(u64, String), String> {
    let last = pp - 1;
    let Some(rest) = global.strip_prefix("decoder.layers.") else {
        let stage = match rule(global, args) {
            Some((_, Stage::First, _)) => 0,
            Some((_, Stage::Last, _)) => last,
            _ => return Err(no_rule(global)),
        };
        return Ok((stage, global.to_string()));
    };
    let (g, tail) = rest
        .split_once('.')
        .ok_or_else(|| "a layer name without a parameter".to_string())?;
    let g: u64 = g
        .parse()
        .map_err(|_| format!("layer `{g}` is not a number"))?;
    let l = args.num_layers.ok_or("args have no num_layers")?;
    if l % pp != 0 {
        return Err(format!("{l} layers do not split into {pp} equal stages"));
    }
    let per = l / pp;
    Ok((g / per, format!("decoder.layers.{}.{tail}", g % per)))
}

/// `iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt` (get_checkpoint_name).
/// The path of the expert-parallel rank `ep` of a rank file at `path`
/// (`…/mp_rank_TT[_PPP]/model_optim_rng.pt` becomes `…/mp_rank_TT[_PPP]_EEE/…`,
/// Megatron-LM's get_checkpoint_name).
pub(crate) fn expert_rank_path(path: &Path, ep: u64) -> PathBuf {
    let dir = path.parent().unwrap_or(Path::new(""));
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    dir.with_file_name(format!("{name}_{ep:03}"))
        .join(RANK_FILE)
}

/// An expert's global name (`…local_experts.<g>.…`) as expert-parallel rank `ep` of
/// `per` experts names it, when that rank holds it: `Some(local name)`; `None` for
/// another rank's expert; the name itself for a tensor that is not an expert's.
pub(crate) fn local_expert_name(name: &str, ep: u64, per: u64) -> Option<String> {
    const LOCAL: &str = ".mlp.experts.local_experts.";
    let Some(at) = name.find(LOCAL).map(|i| i + LOCAL.len()) else {
        return Some(name.to_string());
    };
    let (g, tail) = name[at..].split_once('.')?;
    let g: u64 = g.parse().ok()?;
    (g / per == ep).then(|| format!("{}{}.{tail}", &name[..at], g % per))
}

/// Where expert-parallel rank `e` of `ep` keeps a GroupedMLP weight
/// (`…mlp.experts.weight1`/`weight2`) in the grouped weight of all experts, which an
/// EP 1 model holds (docs/moe.md, "The legacy grouped GEMM layer"): the ranks' memory
/// back to back. `weight2` `[E_l*F, H]` is rows `e*E_l*F..` of `[E*F, H]`; `weight1`
/// `[H, E_l*F1]` is, as its memory is, rows `e*H/EP..` of `[H, E*F1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GroupedSplit {
    /// The grouped weight's shape.
    pub(crate) global: Vec<u64>,
    /// The rank's rows of it.
    pub(crate) rows: std::ops::Range<u64>,
    /// The shape the rank's file records (GroupedMLP's parameter).
    pub(crate) stored: Vec<u64>,
}

impl GroupedSplit {
    /// The shape of the rank's rows.
    pub(crate) fn rows_shape(&self) -> Vec<u64> {
        vec![self.rows.end - self.rows.start, self.global[1]]
    }
}

/// [`GroupedSplit`] of `name` for expert-parallel rank `e` of `ep`, `None` for a tensor
/// that is not a GroupedMLP weight.
///
/// # Errors
/// Args without the sizes; experts or (for `weight1`) a hidden size that `ep` does not
/// divide; sizes that overflow.
pub(crate) fn grouped_split(
    name: &str,
    args: &Args,
    ep: u64,
    e: u64,
) -> std::result::Result<Option<GroupedSplit>, String> {
    if !is_grouped_weight(name) {
        return Ok(None);
    }
    let gate = if args.swiglu { 2 } else { 1 };
    let dense_ffn = args
        .ffn_hidden
        .or_else(|| args.hidden.and_then(|h| h.checked_mul(4)));
    let (Some(h), Some(experts), Some(f)) = (
        args.hidden,
        args.moe.experts,
        args.moe.expert_ffn(dense_ffn),
    ) else {
        return Err(format!(
            "a GroupedMLP weight, but args lack hidden_size, num_experts or the FFN size ({:?}, {:?}, {:?})",
            args.hidden, args.moe.experts, args.moe.ffn.or(dense_ffn)
        ));
    };
    if ep == 0 || experts % ep != 0 {
        return Err(format!(
            "{experts} experts do not divide into {ep} expert-parallel ranks"
        ));
    }
    let local = experts / ep;
    let too_big = || format!("the grouped size of {experts} experts overflows");
    let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(too_big);
    let split = if name.ends_with("weight1") {
        if h % ep != 0 {
            return Err(format!(
                "GroupedMLP's weight1 at expert-parallel size {ep}: hidden_size {h} does not divide by it, so a rank's weight1 is not rows of the grouped one (not read or written yet)"
            ));
        }
        let (rows, f1) = (h / ep, mul(f, gate)?);
        GroupedSplit {
            global: vec![h, mul(experts, f1)?],
            rows: e * rows..(e + 1) * rows,
            stored: vec![h, mul(local, f1)?],
        }
    } else {
        let rows = mul(local, f)?;
        GroupedSplit {
            global: vec![mul(experts, f)?, h],
            rows: e * rows..(e + 1) * rows,
            stored: vec![rows, h],
        }
    };
    Ok(Some(split))
}

/// The strategy a mixture-of-experts Megatron checkpoint is written back with: every
/// tensor under its global name placed by megatron-core's rule on a `pp=1,tp=1` mesh
/// (whatever axes the source was read on), for the target's sizes to resize; `None` for
/// a dense model (its source strategy is resized as it is).
///
/// # Errors
/// A tensor no rule places.
pub(crate) fn moe_strategy(
    state: &SourceState,
    tensors: &[(String, Dtype, Vec<u64>)],
) -> Result<Option<Strategy>> {
    if state.args.moe.experts.is_none() {
        return Ok(None);
    }
    imported_strategy(&state.args, tensors).map(Some)
}

pub(crate) fn rank_path(iteration: u64, tp: u64, pp: u64, pp_size: u64) -> PathBuf {
    let dir = if pp_size == 1 {
        format!("mp_rank_{tp:02}")
    } else {
        format!("mp_rank_{tp:02}_{pp:03}")
    };
    Path::new(&format!("iter_{iteration:07}"))
        .join(dir)
        .join(RANK_FILE)
}

/// The entries beside `model` in a written rank file: `args` with the new sizes (and
/// `no_save_optim`: ckpt writes no optimizer state, as Megatron's own converter does
/// not), `checkpoint_version` 3.0, `iteration`, and `rng`'s `rng_state` with its
/// storages from key `rng.1` on; without one (another grid, or a source saved without
/// it), `no_save_rng`. A pickle fragment.
///
/// # Errors
/// Args or an RNG state that cannot be written back.
pub(crate) fn extra_entries(
    state: &SourceState,
    (tp, pp, ep): (u64, u64, u64),
    expert_tp: Option<u64>,
    rng: Option<(&RankRng, usize)>,
    ckpt_format: &str,
) -> Result<Vec<u8>> {
    let mut args = state.args_value.clone();
    if let Value::Build { state: fields, .. } = &mut args {
        if let Value::Dict(kv) = fields.as_mut() {
            let mut set = |key: &str, v: Value| match kv
                .iter_mut()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
            {
                Some((_, old)) => *old = v,
                None => kv.push((Value::Str(key.into()), v)),
            };
            let int = |v: u64| Value::Int(i64::try_from(v).unwrap_or(i64::MAX));
            set("tensor_model_parallel_size", int(tp));
            set("pipeline_model_parallel_size", int(pp));
            if state.args.moe.experts.is_some() {
                set("expert_model_parallel_size", int(ep));
                // Unset: experts split over the tensor-parallel ranks, as the dense
                // layers.
                set(
                    "expert_tensor_parallel_size",
                    expert_tp.map_or(Value::None, int),
                );
            }
            set("virtual_pipeline_model_parallel_size", Value::None);
            set("ckpt_format", Value::Str(ckpt_format.into()));
            set("no_save_optim", Value::Bool(true));
            if rng.is_none() {
                set("no_save_rng", Value::Bool(true));
            }
        }
    }
    let mut e = super::pickle::Emitter::new();
    e.str("args");
    e.value(&args).map_err(|p| Error::Unsupported {
        problem: format!("the source's args cannot be written back: {p}"),
    })?;
    e.str("checkpoint_version").float(3.0);
    e.str("iteration").int(state.iteration.min(i64::MAX as u64));
    if let Some((rng, first_key)) = rng {
        rng.emit(&mut e, first_key)?;
    }
    Ok(e.fragment())
}
