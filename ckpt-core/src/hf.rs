//! Hugging Face model families: one table per family says which Megatron GPT tensor
//! each Hugging Face tensor is and how it is cut from it, so that export (Megatron → HF)
//! and import (HF → Megatron) are read off the same rows and cannot drift.
//!
//! A row names a Megatron tensor (with `{l}` for the layer; aliases where megatron-core
//! saves the same parameter under two names: the local layer spec's
//! `input_layernorm.weight` is TransformerEngine's fused
//! `self_attention.linear_qkv.layer_norm_weight` in dist_ckpt), the Hugging Face
//! tensor(s) it becomes, and the [`Cut`]: the whole tensor, the fused QKV projection
//! split per query group, the SwiGLU `linear_fc1` split into gate and up, or the
//! vocabulary rows without Megatron's padding. Every cut is a set of row blocks along
//! the tensor's first dimension ([`Block`]), so the export is a view of the stored
//! pieces and nothing is copied before the output is written.
//!
//! The families, from the models' own code (transformers 5.24: `modeling_llama.py`,
//! `modeling_mistral.py`, `modeling_qwen2.py`, `modeling_qwen3.py`,
//! `modeling_gpt_bigcode.py`; megatron-core 0.16.1: `SelfAttention`,
//! `get_gpt_layer_local_spec`):
//! - `llama` (Llama 1-3, GQA), `mistral`: RMSNorm, SwiGLU, RoPE (rotate-half, as
//!   megatron-core's), no biases.
//! - `qwen2` (Qwen2, Qwen2.5): as llama with a bias on the Q, K and V projections
//!   (`add_qkv_bias`).
//! - `qwen3`: as llama with RMSNorm on each query and key head (`qk_layernorm`) and a
//!   head dimension of its own (`kv_channels` = `head_dim`).
//! - `gpt_bigcode` (Megatron's GPT-2-style model: LayerNorm, GELU, learned absolute
//!   positions, biases, multi-head attention): `GPTBigCodeForCausalLM` with
//!   `multi_query: false` computes exactly Megatron's GPT: its `c_attn` is an
//!   `nn.Linear` whose output rows are, head by head, the head's query, key and value —
//!   Megatron's fused QKV with one query group per head — so every tensor is stored as
//!   Megatron stores it. (`GPT2LMHeadModel` stores its projections transposed, as
//!   `Conv1D`; its `gelu_new` is not Megatron's exact GELU.)
//!
//! Tied embeddings (`share_embeddings_and_output_weights`, args'
//! `untie_embeddings_and_output_weights: false`) are `tie_word_embeddings: true`: no
//! `lm_head.weight` in the export (the last stage's copy of the embedding is dropped).

use crate::error::{Error, Result};
use crate::layout::source::Block;
use serde_json::{json, Map, Value};

/// The tokenizer files transformers' tokenizers save (`save_pretrained`): copied beside
/// a Hugging Face export from `--tokenizer DIR` or from where a trainer kept them.
pub const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
];

/// A model family ckpt converts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (Llama's tensors; sliding window off).
    Mistral,
    /// `Qwen2ForCausalLM` (QKV bias).
    Qwen2,
    /// `Qwen3ForCausalLM` (q/k norm, own head dim).
    Qwen3,
    /// `GPTBigCodeForCausalLM`: Megatron's GPT-2-style model.
    GptBigCode,
    /// `MixtralForCausalLM`: Llama's attention, every layer a mixture of experts
    /// (`block_sparse_moe`, top-k renormalised).
    Mixtral,
    /// `Qwen2MoeForCausalLM`: Qwen2's attention, experts plus a gated shared expert.
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention, experts.
    Qwen3Moe,
}

/// How a Hugging Face tensor is cut from its Megatron tensor (rows of dimension 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// The whole tensor.
    Whole,
    /// The fused QKV projection (weight or bias) into query, key and value.
    Qkv,
    /// SwiGLU's `linear_fc1` into gate and up.
    GateUp,
    /// An expert's `linear_fc1` into gate and up (the experts' FFN size).
    ExpertGateUp,
    /// The shared expert's `linear_fc1` into gate and up (its own FFN size).
    SharedGateUp,
    /// The first `vocab_size` rows (Megatron pads the vocabulary for the TP size).
    Vocab,
}

/// When a row applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    Always,
    /// The model has linear biases (`add_bias_linear`).
    Bias,
    /// QKV bias (`add_qkv_bias`, or `add_bias_linear`).
    QkvBias,
    /// q/k layernorm.
    QkNorm,
    /// An output layer of its own (untied embeddings).
    Untied,
    /// A dense MLP (no experts).
    Dense,
    /// Experts (and their router).
    Moe,
    /// A shared expert.
    Shared,
    /// A gate on the shared expert.
    SharedGate,
}

/// One row of a family's table.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// Megatron's names of the tensor (`{l}` the global layer number, `{e}` the global
    /// expert id), first the legacy local spec's.
    pub megatron: &'static [&'static str],
    /// The Hugging Face tensor(s) it becomes, in the cut's order.
    pub hf: &'static [&'static str],
    /// How.
    pub cut: Cut,
    when: When,
}

const fn row(
    megatron: &'static [&'static str],
    hf: &'static [&'static str],
    cut: Cut,
    when: When,
) -> Row {
    Row {
        megatron,
        hf,
        cut,
        when,
    }
}

/// Llama, Mistral, Qwen2 and Qwen3 (rows that a model lacks do not apply to it).
const LLAMA: &[Row] = &[
    row(
        &["embedding.word_embeddings.weight"],
        &["model.embed_tokens.weight"],
        Cut::Vocab,
        When::Always,
    ),
    row(
        &[
            "decoder.layers.{l}.input_layernorm.weight",
            "decoder.layers.{l}.self_attention.linear_qkv.layer_norm_weight",
        ],
        &["model.layers.{l}.input_layernorm.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_qkv.weight"],
        &[
            "model.layers.{l}.self_attn.q_proj.weight",
            "model.layers.{l}.self_attn.k_proj.weight",
            "model.layers.{l}.self_attn.v_proj.weight",
        ],
        Cut::Qkv,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_qkv.bias"],
        &[
            "model.layers.{l}.self_attn.q_proj.bias",
            "model.layers.{l}.self_attn.k_proj.bias",
            "model.layers.{l}.self_attn.v_proj.bias",
        ],
        Cut::Qkv,
        When::QkvBias,
    ),
    row(
        &["decoder.layers.{l}.self_attention.q_layernorm.weight"],
        &["model.layers.{l}.self_attn.q_norm.weight"],
        Cut::Whole,
        When::QkNorm,
    ),
    row(
        &["decoder.layers.{l}.self_attention.k_layernorm.weight"],
        &["model.layers.{l}.self_attn.k_norm.weight"],
        Cut::Whole,
        When::QkNorm,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_proj.weight"],
        &["model.layers.{l}.self_attn.o_proj.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &[
            "decoder.layers.{l}.pre_mlp_layernorm.weight",
            "decoder.layers.{l}.mlp.linear_fc1.layer_norm_weight",
        ],
        &["model.layers.{l}.post_attention_layernorm.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.mlp.linear_fc1.weight"],
        &[
            "model.layers.{l}.mlp.gate_proj.weight",
            "model.layers.{l}.mlp.up_proj.weight",
        ],
        Cut::GateUp,
        When::Dense,
    ),
    row(
        &["decoder.layers.{l}.mlp.linear_fc2.weight"],
        &["model.layers.{l}.mlp.down_proj.weight"],
        Cut::Whole,
        When::Dense,
    ),
    row(
        &["decoder.final_layernorm.weight"],
        &["model.norm.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["output_layer.weight"],
        &["lm_head.weight"],
        Cut::Vocab,
        When::Untied,
    ),
];

/// Mixtral's experts and router (`modeling_mixtral.py`: `block_sparse_moe`, `w1` the
/// gate, `w3` the up, `w2` the down projection), beside Llama's rows.
const MIXTRAL_EXPERTS: &[Row] = &[
    row(
        &["decoder.layers.{l}.mlp.router.weight"],
        &["model.layers.{l}.block_sparse_moe.gate.weight"],
        Cut::Whole,
        When::Moe,
    ),
    row(
        &["decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight"],
        &[
            "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
            "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
        ],
        Cut::ExpertGateUp,
        When::Moe,
    ),
    row(
        &["decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight"],
        &["model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight"],
        Cut::Whole,
        When::Moe,
    ),
];

/// transformers (5 and later) keeps a layer's experts as one module, its parameters
/// stacked over the experts (transformers/conversion_mapping.py, "mixtral" and
/// "qwen2_moe", the latter Qwen3-MoE's too): `mlp.experts.gate_up_proj`
/// `[experts, 2 * ffn, hidden]` (each expert's gate rows, then its up rows: the
/// per-expert tensors of the table's gate/up row, concatenated) and
/// `mlp.experts.down_proj` `[experts, hidden, ffn]`. A trainer that saves the live
/// module (a DCP of its state dict) saves these; `save_pretrained` writes them back as
/// the table's per-expert rows.
pub(crate) const FUSED_EXPERTS_GATE_UP: &str = "mlp.experts.gate_up_proj";
/// The fused experts' down projections ([`FUSED_EXPERTS_GATE_UP`]).
pub(crate) const FUSED_EXPERTS_DOWN: &str = "mlp.experts.down_proj";

/// Qwen2-MoE's and Qwen3-MoE's experts, router and (Qwen2-MoE) gated shared expert
/// (`modeling_qwen2_moe.py`, `modeling_qwen3_moe.py`), beside Llama's rows.
const QWEN_EXPERTS: &[Row] = &[
    row(
        &["decoder.layers.{l}.mlp.router.weight"],
        &["model.layers.{l}.mlp.gate.weight"],
        Cut::Whole,
        When::Moe,
    ),
    row(
        &["decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight"],
        &[
            "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
            "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        ],
        Cut::ExpertGateUp,
        When::Moe,
    ),
    row(
        &["decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight"],
        &["model.layers.{l}.mlp.experts.{e}.down_proj.weight"],
        Cut::Whole,
        When::Moe,
    ),
    row(
        &["decoder.layers.{l}.mlp.shared_experts.linear_fc1.weight"],
        &[
            "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
            "model.layers.{l}.mlp.shared_expert.up_proj.weight",
        ],
        Cut::SharedGateUp,
        When::Shared,
    ),
    row(
        &["decoder.layers.{l}.mlp.shared_experts.linear_fc2.weight"],
        &["model.layers.{l}.mlp.shared_expert.down_proj.weight"],
        Cut::Whole,
        When::Shared,
    ),
    row(
        &["decoder.layers.{l}.mlp.shared_experts.gate_weight"],
        &["model.layers.{l}.mlp.shared_expert_gate.weight"],
        Cut::Whole,
        When::SharedGate,
    ),
];

/// Megatron's GPT-2-style model as `GPTBigCodeForCausalLM`.
const GPT_BIGCODE: &[Row] = &[
    row(
        &["embedding.word_embeddings.weight"],
        &["transformer.wte.weight"],
        Cut::Vocab,
        When::Always,
    ),
    row(
        &["embedding.position_embeddings.weight"],
        &["transformer.wpe.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &[
            "decoder.layers.{l}.input_layernorm.weight",
            "decoder.layers.{l}.self_attention.linear_qkv.layer_norm_weight",
        ],
        &["transformer.h.{l}.ln_1.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &[
            "decoder.layers.{l}.input_layernorm.bias",
            "decoder.layers.{l}.self_attention.linear_qkv.layer_norm_bias",
        ],
        &["transformer.h.{l}.ln_1.bias"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_qkv.weight"],
        &["transformer.h.{l}.attn.c_attn.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_qkv.bias"],
        &["transformer.h.{l}.attn.c_attn.bias"],
        Cut::Whole,
        When::Bias,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_proj.weight"],
        &["transformer.h.{l}.attn.c_proj.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.self_attention.linear_proj.bias"],
        &["transformer.h.{l}.attn.c_proj.bias"],
        Cut::Whole,
        When::Bias,
    ),
    row(
        &[
            "decoder.layers.{l}.pre_mlp_layernorm.weight",
            "decoder.layers.{l}.mlp.linear_fc1.layer_norm_weight",
        ],
        &["transformer.h.{l}.ln_2.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &[
            "decoder.layers.{l}.pre_mlp_layernorm.bias",
            "decoder.layers.{l}.mlp.linear_fc1.layer_norm_bias",
        ],
        &["transformer.h.{l}.ln_2.bias"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.mlp.linear_fc1.weight"],
        &["transformer.h.{l}.mlp.c_fc.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.mlp.linear_fc1.bias"],
        &["transformer.h.{l}.mlp.c_fc.bias"],
        Cut::Whole,
        When::Bias,
    ),
    row(
        &["decoder.layers.{l}.mlp.linear_fc2.weight"],
        &["transformer.h.{l}.mlp.c_proj.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.layers.{l}.mlp.linear_fc2.bias"],
        &["transformer.h.{l}.mlp.c_proj.bias"],
        Cut::Whole,
        When::Bias,
    ),
    row(
        &["decoder.final_layernorm.weight"],
        &["transformer.ln_f.weight"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["decoder.final_layernorm.bias"],
        &["transformer.ln_f.bias"],
        Cut::Whole,
        When::Always,
    ),
    row(
        &["output_layer.weight"],
        &["lm_head.weight"],
        Cut::Vocab,
        When::Untied,
    ),
];

/// Every family by the names users give (`--hf-arch`), its architecture class and
/// `model_type`.
const NAMES: [(Family, &str, &str); 8] = [
    (Family::Llama, "LlamaForCausalLM", "llama"),
    (Family::Mistral, "MistralForCausalLM", "mistral"),
    (Family::Qwen2, "Qwen2ForCausalLM", "qwen2"),
    (Family::Qwen3, "Qwen3ForCausalLM", "qwen3"),
    (Family::GptBigCode, "GPTBigCodeForCausalLM", "gpt_bigcode"),
    (Family::Mixtral, "MixtralForCausalLM", "mixtral"),
    (Family::Qwen2Moe, "Qwen2MoeForCausalLM", "qwen2_moe"),
    (Family::Qwen3Moe, "Qwen3MoeForCausalLM", "qwen3_moe"),
];

impl Family {
    /// The family named `name`: its `model_type` (`llama`), its architecture
    /// (`LlamaForCausalLM`), or `gpt` for `gpt_bigcode`.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Family> {
        let name = if name == "gpt" { "gpt_bigcode" } else { name };
        NAMES
            .iter()
            .find(|(_, arch, ty)| name.eq_ignore_ascii_case(arch) || name.eq_ignore_ascii_case(ty))
            .map(|(f, _, _)| *f)
    }

    /// The names `--hf-arch` takes, for messages.
    #[must_use]
    pub fn known() -> String {
        NAMES
            .iter()
            .map(|(_, _, t)| *t)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The Hugging Face architecture class.
    #[must_use]
    pub fn architecture(self) -> &'static str {
        NAMES
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or("", |(_, a, _)| a)
    }

    /// The Hugging Face `model_type`.
    #[must_use]
    pub fn model_type(self) -> &'static str {
        NAMES
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or("", |(_, _, t)| t)
    }

    /// The family's table (a mixture-of-experts family: Llama's rows and its experts').
    #[must_use]
    pub fn rows(self) -> Vec<Row> {
        match self {
            Family::GptBigCode => GPT_BIGCODE.to_vec(),
            Family::Mixtral => [LLAMA, MIXTRAL_EXPERTS].concat(),
            Family::Qwen2Moe | Family::Qwen3Moe => [LLAMA, QWEN_EXPERTS].concat(),
            _ => LLAMA.to_vec(),
        }
    }

    /// What transformers' modules of the family call a part of the table's names
    /// (`(checkpoint's, module's)`): Mixtral's `block_sparse_moe` is the module's `mlp`
    /// (its conversion mapping's `WeightRenaming`), so a save of the live module holds
    /// `mlp.gate.weight` for the router.
    #[must_use]
    pub fn module_renames(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Family::Mixtral => &[(".block_sparse_moe.", ".mlp.")],
            _ => &[],
        }
    }

    /// Whether the family's layers are mixtures of experts.
    #[must_use]
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Mixtral | Family::Qwen2Moe | Family::Qwen3Moe)
    }

    /// Whether `row` applies to a model of this family of `shape`.
    #[must_use]
    pub fn applies(self, row: &Row, shape: &Shape) -> bool {
        match row.when {
            When::Always => true,
            When::Bias => shape.bias,
            When::QkvBias => shape.qkv_bias || shape.bias,
            When::QkNorm => shape.qk_norm,
            When::Untied => !shape.tied,
            When::Dense => shape.experts == 0,
            When::Moe => shape.experts > 0,
            When::Shared => shape.experts > 0 && shape.shared_ffn > 0,
            When::SharedGate => shape.experts > 0 && shape.shared_ffn > 0 && shape.shared_gate,
        }
    }

    /// What the family fixes of a model: refuses a `shape` it cannot describe.
    ///
    /// # Errors
    /// A feature the family's Hugging Face model does not have.
    pub fn check(self, shape: &Shape) -> Result<()> {
        let lacks = |what: &str| {
            Err(unsupported(format!(
                "the model has {what}, which {} does not: name another family with --hf-arch ({})",
                self.architecture(),
                Family::known()
            )))
        };
        if self.is_moe() && shape.experts == 0 {
            return lacks("no experts (args.num_experts)");
        }
        if !self.is_moe() && shape.experts > 0 {
            return lacks(&format!("{} experts in each layer", shape.experts));
        }
        if let Some(why) = &shape.moe_unsupported {
            return Err(unsupported(format!(
                "the model's experts: {why}, which no Hugging Face family ckpt writes has"
            )));
        }
        match self {
            Family::Mixtral if !shape.norm_topk => {
                return lacks("router weights kept as the softmax over all experts gives them (moe_router_pre_softmax); Mixtral renormalises the top-k");
            }
            Family::Mixtral | Family::Qwen3Moe if shape.shared_ffn > 0 => {
                return lacks("a shared expert");
            }
            Family::Qwen2Moe if shape.shared_ffn == 0 || !shape.shared_gate => {
                return lacks("no gated shared expert (moe_shared_expert_intermediate_size, moe_shared_expert_gate)");
            }
            _ => {}
        }
        let llama_like = self != Family::GptBigCode;
        if llama_like && !shape.swiglu {
            return lacks("no SwiGLU (args.swiglu false)");
        }
        if llama_like && shape.learned_positions {
            return lacks("learned absolute position embeddings");
        }
        if llama_like && shape.layer_norm {
            return lacks("LayerNorm (not RMSNorm)");
        }
        if llama_like && shape.bias {
            return lacks("biases on its linear layers (add_bias_linear)");
        }
        let qwen3 = matches!(self, Family::Qwen3 | Family::Qwen3Moe);
        let qwen2 = matches!(self, Family::Qwen2 | Family::Qwen2Moe);
        if shape.qk_norm && !qwen3 {
            return lacks("q/k layernorm");
        }
        if qwen3 && !shape.qk_norm {
            return lacks("no q/k layernorm");
        }
        if shape.qkv_bias && !shape.bias && !qwen2 {
            return lacks("a QKV bias without other linear biases");
        }
        if qwen2 && !shape.qkv_bias {
            return lacks("no QKV bias");
        }
        if self == Family::GptBigCode {
            if shape.swiglu || !shape.layer_norm || !shape.learned_positions || !shape.bias {
                return lacks("SwiGLU, RMSNorm, rotary positions or no biases");
            }
            if shape.groups != shape.heads {
                return lacks(
                    "grouped-query attention (GPTBigCode takes multi-head attention here)",
                );
            }
        }
        Ok(())
    }
}

/// The family a Megatron GPT model is, from its recorded features; `None` where they
/// do not settle it.
#[must_use]
pub(crate) fn family_of(shape: &Shape) -> Option<Family> {
    let f = if shape.experts > 0 {
        if shape.qk_norm {
            Family::Qwen3Moe
        } else if shape.shared_ffn > 0 || shape.qkv_bias {
            Family::Qwen2Moe
        } else {
            Family::Mixtral
        }
    } else if shape.learned_positions && shape.layer_norm && !shape.swiglu {
        Family::GptBigCode
    } else if shape.qk_norm {
        Family::Qwen3
    } else if shape.qkv_bias && !shape.bias {
        Family::Qwen2
    } else {
        Family::Llama
    };
    f.check(shape).ok().map(|()| f)
}

/// A model's sizes and features: what a Hugging Face config says and what Megatron's
/// args record.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shape {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention (query) heads.
    pub heads: u64,
    /// Key/value heads (query groups).
    pub groups: u64,
    /// Channels per head.
    pub head_dim: u64,
    /// MLP hidden size.
    pub ffn: u64,
    /// Vocabulary (without padding).
    pub vocab: u64,
    /// Maximum sequence length.
    pub max_positions: u64,
    /// Normalisation epsilon.
    pub eps: f64,
    /// Rotary base (theta).
    pub rope_theta: f64,
    /// SwiGLU MLP.
    pub swiglu: bool,
    /// LayerNorm (not RMSNorm).
    pub layer_norm: bool,
    /// Learned absolute position embeddings (not rotary).
    pub learned_positions: bool,
    /// Biases on every linear layer.
    pub bias: bool,
    /// Bias on the QKV projection.
    pub qkv_bias: bool,
    /// q/k layernorm.
    pub qk_norm: bool,
    /// Output layer tied to the word embedding.
    pub tied: bool,
    /// Experts of each layer (0: a dense model).
    pub experts: u64,
    /// Experts each token is routed to.
    pub topk: u64,
    /// An expert's FFN size.
    pub moe_ffn: u64,
    /// The shared expert's FFN size (0: none).
    pub shared_ffn: u64,
    /// A sigmoid gate on the shared expert's output.
    pub shared_gate: bool,
    /// The top-k router weights renormalised to sum to 1 (Megatron's softmax over the
    /// top-k logits; Hugging Face's `norm_topk_prob`).
    pub norm_topk: bool,
    /// What of the model's experts no family here has (sigmoid routing, expert bias,
    /// layers without experts), said when a family is asked for.
    pub moe_unsupported: Option<String>,
}

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

/// The row blocks of the query, key and value parts of a fused QKV projection of
/// `groups` query groups of `per_group` query heads, `kv` rows a head: megatron-core's
/// `SelfAttention.get_query_key_value_tensors` views the rows as `[groups, (per_group
/// + 2) * kv]`, each group its query heads, one key head and one value head. Each part
/// is given with its row count; the query heads come out in their natural order, as
/// Hugging Face's `q_proj` holds them, and the key/value heads one per group.
#[must_use]
pub(crate) fn qkv_blocks(groups: u64, per_group: u64, kv: u64) -> [(Vec<Block>, u64); 3] {
    let group_rows = (per_group + 2) * kv;
    let blocks = |offset: u64, len: u64| -> Vec<Block> {
        (0..groups)
            .map(|g| Block {
                from: g * group_rows + offset,
                len,
                to: g * len,
            })
            .collect()
    };
    [
        (blocks(0, per_group * kv), groups * per_group * kv),
        (blocks(per_group * kv, kv), groups * kv),
        (blocks((per_group + 1) * kv, kv), groups * kv),
    ]
}

/// The rows of SwiGLU's gate and up parts of `linear_fc1` (`ffn` rows each, gate
/// first, as megatron-core's `glu` chunks it: `torch.chunk(x, 2, dim=-1)`).
#[must_use]
pub(crate) fn gate_up_blocks(ffn: u64) -> [(Vec<Block>, u64); 2] {
    [
        (
            vec![Block {
                from: 0,
                len: ffn,
                to: 0,
            }],
            ffn,
        ),
        (
            vec![Block {
                from: ffn,
                len: ffn,
                to: 0,
            }],
            ffn,
        ),
    ]
}

/// The Hugging Face `config.json` of a model of `family` and `shape` whose tensors are
/// `dtype` (torch's name: `float32`, `bfloat16`). Both config forms are written where
/// they differ (`rope_theta` and transformers 5's `rope_parameters`; `torch_dtype` and
/// `dtype`), so that transformers 4 and 5 read the same model.
#[must_use]
pub fn config_json(family: Family, shape: &Shape, dtype: &str) -> String {
    let mut c = Map::new();
    c.insert("architectures".into(), json!([family.architecture()]));
    c.insert("model_type".into(), json!(family.model_type()));
    if family == Family::GptBigCode {
        for (k, v) in [
            ("n_embd", json!(shape.hidden)),
            ("n_layer", json!(shape.layers)),
            ("n_head", json!(shape.heads)),
            ("n_inner", json!(shape.ffn)),
            ("n_positions", json!(shape.max_positions)),
            ("vocab_size", json!(shape.vocab)),
            ("layer_norm_epsilon", json!(shape.eps)),
            // Megatron's F.gelu is the exact (erf) GELU.
            ("activation_function", json!("gelu")),
            ("multi_query", json!(false)),
            ("scale_attn_weights", json!(true)),
            ("attn_pdrop", json!(0.0)),
            ("embd_pdrop", json!(0.0)),
            ("resid_pdrop", json!(0.0)),
        ] {
            c.insert(k.into(), v);
        }
    } else {
        for (k, v) in [
            ("hidden_size", json!(shape.hidden)),
            ("intermediate_size", json!(shape.ffn)),
            ("num_hidden_layers", json!(shape.layers)),
            ("num_attention_heads", json!(shape.heads)),
            ("num_key_value_heads", json!(shape.groups)),
            ("head_dim", json!(shape.head_dim)),
            ("vocab_size", json!(shape.vocab)),
            ("max_position_embeddings", json!(shape.max_positions)),
            ("rms_norm_eps", json!(shape.eps)),
            ("hidden_act", json!("silu")),
            ("rope_theta", json!(shape.rope_theta)),
            (
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": shape.rope_theta}),
            ),
            ("attention_dropout", json!(0.0)),
        ] {
            c.insert(k.into(), v);
        }
        match family {
            Family::Llama => {
                c.insert("attention_bias".into(), json!(false));
                c.insert("mlp_bias".into(), json!(false));
            }
            Family::Mistral => {
                c.insert("sliding_window".into(), Value::Null);
            }
            Family::Qwen2 => {
                c.insert("use_sliding_window".into(), json!(false));
                c.insert("sliding_window".into(), Value::Null);
            }
            Family::Qwen3 => {
                c.insert("attention_bias".into(), json!(false));
                c.insert("use_sliding_window".into(), json!(false));
                c.insert("sliding_window".into(), Value::Null);
            }
            Family::Mixtral => {
                c.insert("sliding_window".into(), Value::Null);
            }
            Family::Qwen2Moe => {
                c.insert("qkv_bias".into(), json!(true));
                c.insert("use_sliding_window".into(), json!(false));
                c.insert("sliding_window".into(), Value::Null);
            }
            Family::Qwen3Moe => {
                c.insert("attention_bias".into(), json!(false));
                c.insert("use_sliding_window".into(), json!(false));
                c.insert("sliding_window".into(), Value::Null);
            }
            Family::GptBigCode => {}
        }
        if family.is_moe() {
            // transformers' MoE configs: Mixtral's FFN size is `intermediate_size`,
            // the Qwen families' `moe_intermediate_size`; every layer sparse.
            let moe = [
                ("num_local_experts", json!(shape.experts)),
                ("num_experts", json!(shape.experts)),
                ("num_experts_per_tok", json!(shape.topk)),
                ("moe_intermediate_size", json!(shape.moe_ffn)),
                ("norm_topk_prob", json!(shape.norm_topk)),
                ("decoder_sparse_step", json!(1)),
                ("mlp_only_layers", json!([])),
                ("output_router_logits", json!(false)),
                ("router_aux_loss_coef", json!(0.0)),
            ];
            for (k, v) in moe {
                c.insert(k.into(), v);
            }
            if family == Family::Mixtral {
                c.insert("intermediate_size".into(), json!(shape.moe_ffn));
                c.insert("router_jitter_noise".into(), json!(0.0));
            }
            if family == Family::Qwen2Moe {
                c.insert(
                    "shared_expert_intermediate_size".into(),
                    json!(shape.shared_ffn),
                );
            }
        }
    }
    c.insert("tie_word_embeddings".into(), json!(shape.tied));
    c.insert("torch_dtype".into(), json!(dtype));
    c.insert("dtype".into(), json!(dtype));
    serde_json::to_string_pretty(&Value::Object(c)).unwrap_or_default() + "\n"
}

/// What a Hugging Face `config.json` says of a model: its family and shape (the
/// features its family fixes, the sizes it gives). `path` is for messages.
///
/// # Errors
/// Not JSON, an architecture the tables do not know, a size missing.
pub fn read_config(text: &str, path: &str) -> Result<(Family, Shape)> {
    let doc: Value = serde_json::from_str(text)
        .map_err(|e| unknown(format!("{path}: not a JSON config: {e}")))?;
    let arch = doc
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .or_else(|| doc.get("model_type").and_then(Value::as_str))
        .ok_or_else(|| {
            unknown(format!(
                "{path}: no `architectures` or `model_type`: not a Hugging Face config"
            ))
        })?;
    let family = Family::from_name(arch).ok_or_else(|| {
        unsupported(format!(
            "{path}: architecture `{arch}` is not in ckpt's model tables ({})",
            Family::known()
        ))
    })?;
    let int = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| doc.get(*k).and_then(Value::as_u64))
    };
    let need =
        |keys: &[&str]| int(keys).ok_or_else(|| unknown(format!("{path}: no `{}`", keys[0])));
    let float = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| doc.get(*k).and_then(Value::as_f64))
    };
    let flag = |key: &str| doc.get(key).and_then(Value::as_bool);
    let gpt = family == Family::GptBigCode;
    let hidden = need(&["hidden_size", "n_embd"])?;
    let heads = need(&["num_attention_heads", "n_head"])?;
    let groups = if gpt {
        if flag("multi_query").unwrap_or(true) {
            1
        } else {
            heads
        }
    } else {
        int(&["num_key_value_heads"]).unwrap_or(heads)
    };
    let head_dim = int(&["head_dim"]).unwrap_or(hidden.checked_div(heads).unwrap_or(0));
    let rope_theta = float(&["rope_theta"])
        .or_else(|| {
            doc.get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
        })
        .unwrap_or(10000.0);
    let shape = Shape {
        layers: need(&["num_hidden_layers", "n_layer"])?,
        hidden,
        heads,
        groups,
        head_dim,
        ffn: if gpt {
            int(&["n_inner"]).unwrap_or(hidden.saturating_mul(4))
        } else {
            need(&["intermediate_size"])?
        },
        vocab: need(&["vocab_size"])?,
        max_positions: int(&["max_position_embeddings", "n_positions"]).unwrap_or(0),
        eps: float(&["rms_norm_eps", "layer_norm_epsilon"]).unwrap_or(1e-6),
        rope_theta,
        swiglu: !gpt,
        layer_norm: gpt,
        learned_positions: gpt,
        bias: gpt || flag("attention_bias").unwrap_or(false) && flag("mlp_bias").unwrap_or(false),
        qkv_bias: family == Family::Qwen2 || gpt || flag("attention_bias").unwrap_or(false),
        qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
        tied: flag("tie_word_embeddings").unwrap_or(gpt),
        ..Shape::default()
    };
    let mut shape = shape;
    if family.is_moe() {
        shape.qkv_bias = family == Family::Qwen2Moe && flag("qkv_bias").unwrap_or(true);
        shape.experts = need(&["num_local_experts", "num_experts"])?;
        shape.topk = need(&["num_experts_per_tok"])?;
        shape.moe_ffn = if family == Family::Mixtral {
            need(&["intermediate_size"])?
        } else {
            need(&["moe_intermediate_size"])?
        };
        if family == Family::Qwen2Moe {
            shape.shared_ffn = need(&["shared_expert_intermediate_size"])?;
            shape.shared_gate = true;
        }
        shape.norm_topk = family == Family::Mixtral || flag("norm_topk_prob").unwrap_or(false);
        let sparse_step = int(&["decoder_sparse_step"]).unwrap_or(1);
        let dense_layers = doc
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        if sparse_step != 1 || dense_layers {
            return Err(unsupported(format!(
                "{path}: layers without experts (decoder_sparse_step {sparse_step}, mlp_only_layers) are not converted yet: every layer must be sparse"
            )));
        }
    }
    Ok((family, shape))
}

fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

/// The sizes two descriptions of one model disagree on (`what` names each side).
#[must_use]
pub(crate) fn disagreements(a: &Shape, b: &Shape) -> Vec<String> {
    let mut out = vec![];
    for (name, x, y) in [
        ("layers", a.layers, b.layers),
        ("hidden size", a.hidden, b.hidden),
        ("attention heads", a.heads, b.heads),
        ("key/value heads (query groups)", a.groups, b.groups),
        ("head dim (kv_channels)", a.head_dim, b.head_dim),
        // A mixture of experts has no dense MLP (Mixtral's intermediate_size is the
        // experts' size, compared below).
        (
            "MLP size (ffn_hidden_size)",
            if a.experts > 0 { 0 } else { a.ffn },
            if b.experts > 0 { 0 } else { b.ffn },
        ),
        ("vocabulary", a.vocab, b.vocab),
        ("experts", a.experts, b.experts),
        ("experts per token", a.topk, b.topk),
        ("expert MLP size", a.moe_ffn, b.moe_ffn),
        ("shared expert MLP size", a.shared_ffn, b.shared_ffn),
    ] {
        if x != y {
            out.push(format!("{name} {x} vs {y}"));
        }
    }
    out
}

/// Which heads a projection's rows are in another program's interleaved rotary
/// layout (torchtitan's, llama.cpp's: the pairs of one rotation on adjacent rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RopeRows {
    /// Not rotated (or rotated as Hugging Face's `rotate_half`): rows as they are.
    AsTheyAre,
    /// The query heads (`Shape::heads`).
    Query,
    /// The key heads (`Shape::groups`).
    Key,
}

/// A tensor of a Llama in another program's names and the Hugging Face tensor it is;
/// `{l}` is the layer. One table gives both directions, as the Megatron rows do.
pub(crate) struct NamesRow {
    pub(crate) other: &'static str,
    pub(crate) hf: &'static str,
    pub(crate) rope: RopeRows,
}

/// A program whose Llama differs from Hugging Face's only by its names and its
/// interleaved query/key rows.
pub(crate) struct InterleavedNames {
    /// The program, as messages name it.
    pub(crate) program: &'static str,
    /// Its tensors (the first the embedding, by which a checkpoint is told apart).
    pub(crate) rows: &'static [NamesRow],
    /// Whether a tied model keeps its head under the program's own name (torchtitan:
    /// the embedding's copy) or has none (llama.cpp: no `output.weight`).
    pub(crate) tied_head_kept: bool,
    /// Prefixes of entries that are training state beside the model, left out with a
    /// note.
    pub(crate) state: &'static [&'static str],
}

const fn names(other: &'static str, hf: &'static str, rope: RopeRows) -> NamesRow {
    NamesRow { other, hf, rope }
}

/// torchtitan's Llama (torchtitan 0.3, `Llama3Model`), from torchtitan's own
/// `Llama3StateDictAdapter.from_hf_map` (`torchtitan/models/llama3/state_dict_adapter.py`);
/// its `CheckpointManager` saves the training state beside the model's flattened keys.
pub(crate) const TORCHTITAN: InterleavedNames = {
    use RopeRows::{AsTheyAre as N, Key as K, Query as Q};
    InterleavedNames {
        program: "torchtitan",
        rows: &[
            names("tok_embeddings.weight", "model.embed_tokens.weight", N),
            names(
                "layers.{l}.attention.qkv_linear.wq.weight",
                "model.layers.{l}.self_attn.q_proj.weight",
                Q,
            ),
            names(
                "layers.{l}.attention.qkv_linear.wk.weight",
                "model.layers.{l}.self_attn.k_proj.weight",
                K,
            ),
            names(
                "layers.{l}.attention.qkv_linear.wv.weight",
                "model.layers.{l}.self_attn.v_proj.weight",
                N,
            ),
            names(
                "layers.{l}.attention.wo.weight",
                "model.layers.{l}.self_attn.o_proj.weight",
                N,
            ),
            names(
                "layers.{l}.feed_forward.w1.weight",
                "model.layers.{l}.mlp.gate_proj.weight",
                N,
            ),
            names(
                "layers.{l}.feed_forward.w3.weight",
                "model.layers.{l}.mlp.up_proj.weight",
                N,
            ),
            names(
                "layers.{l}.feed_forward.w2.weight",
                "model.layers.{l}.mlp.down_proj.weight",
                N,
            ),
            names(
                "layers.{l}.attention_norm.weight",
                "model.layers.{l}.input_layernorm.weight",
                N,
            ),
            names(
                "layers.{l}.ffn_norm.weight",
                "model.layers.{l}.post_attention_layernorm.weight",
                N,
            ),
            names("norm.weight", "model.norm.weight", N),
            names("lm_head.weight", "lm_head.weight", N),
        ],
        tied_head_kept: true,
        state: &["optimizer.", "lr_scheduler.", "dataloader.", "train_state"],
    }
};

/// llama.cpp's Llama (and Mistral's: the converter writes both as `llama`), from
/// gguf-py's `TENSOR_NAMES` and `TensorNameMap` at llama.cpp d8a24cce; the query and
/// key rows permuted by `LlamaModel.permute` (`n_head`, `n_head_kv`), which is
/// torchtitan's interleaving.
pub(crate) const LLAMA_CPP: InterleavedNames = {
    use RopeRows::{AsTheyAre as N, Key as K, Query as Q};
    InterleavedNames {
        program: "llama.cpp",
        rows: &[
            names("token_embd.weight", "model.embed_tokens.weight", N),
            names("output.weight", "lm_head.weight", N),
            names("output_norm.weight", "model.norm.weight", N),
            names(
                "blk.{l}.attn_norm.weight",
                "model.layers.{l}.input_layernorm.weight",
                N,
            ),
            names(
                "blk.{l}.attn_q.weight",
                "model.layers.{l}.self_attn.q_proj.weight",
                Q,
            ),
            names(
                "blk.{l}.attn_k.weight",
                "model.layers.{l}.self_attn.k_proj.weight",
                K,
            ),
            names(
                "blk.{l}.attn_v.weight",
                "model.layers.{l}.self_attn.v_proj.weight",
                N,
            ),
            names(
                "blk.{l}.attn_output.weight",
                "model.layers.{l}.self_attn.o_proj.weight",
                N,
            ),
            names(
                "blk.{l}.ffn_norm.weight",
                "model.layers.{l}.post_attention_layernorm.weight",
                N,
            ),
            names(
                "blk.{l}.ffn_gate.weight",
                "model.layers.{l}.mlp.gate_proj.weight",
                N,
            ),
            names(
                "blk.{l}.ffn_up.weight",
                "model.layers.{l}.mlp.up_proj.weight",
                N,
            ),
            names(
                "blk.{l}.ffn_down.weight",
                "model.layers.{l}.mlp.down_proj.weight",
                N,
            ),
        ],
        tied_head_kept: false,
        state: &[],
    }
};

/// The rows llama.cpp's Qwen2 and Qwen3 add to [`LLAMA_CPP`]'s (gguf-py's
/// `TensorNameMap`: the attention biases of Qwen2, the query/key norms of Qwen3); their
/// query and key rows are not permuted (llama.cpp rotates Qwen's halves as they are).
pub(crate) const LLAMA_CPP_QWEN: &[NamesRow] = {
    use RopeRows::AsTheyAre as N;
    &[
        names(
            "blk.{l}.attn_q.bias",
            "model.layers.{l}.self_attn.q_proj.bias",
            N,
        ),
        names(
            "blk.{l}.attn_k.bias",
            "model.layers.{l}.self_attn.k_proj.bias",
            N,
        ),
        names(
            "blk.{l}.attn_v.bias",
            "model.layers.{l}.self_attn.v_proj.bias",
            N,
        ),
        names(
            "blk.{l}.attn_q_norm.weight",
            "model.layers.{l}.self_attn.q_norm.weight",
            N,
        ),
        names(
            "blk.{l}.attn_k_norm.weight",
            "model.layers.{l}.self_attn.k_norm.weight",
            N,
        ),
    ]
};

/// The rows llama.cpp's Qwen2-MoE and Qwen3-MoE add to [`LLAMA_CPP_QWEN`]'s (gguf-py's
/// `TensorNameMap`, "qwen2moe"): the router and Qwen2-MoE's shared expert with its
/// gate. The experts themselves are [`LLAMA_CPP_EXPERTS`].
pub(crate) const LLAMA_CPP_QWEN_MOE: &[NamesRow] = {
    use RopeRows::AsTheyAre as N;
    &[
        names(
            "blk.{l}.ffn_gate_inp.weight",
            "model.layers.{l}.mlp.gate.weight",
            N,
        ),
        names(
            "blk.{l}.ffn_gate_shexp.weight",
            "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
            N,
        ),
        names(
            "blk.{l}.ffn_up_shexp.weight",
            "model.layers.{l}.mlp.shared_expert.up_proj.weight",
            N,
        ),
        names(
            "blk.{l}.ffn_down_shexp.weight",
            "model.layers.{l}.mlp.shared_expert.down_proj.weight",
            N,
        ),
        names(
            "blk.{l}.ffn_gate_inp_shexp.weight",
            "model.layers.{l}.mlp.shared_expert_gate.weight",
            N,
        ),
    ]
};

/// The row llama.cpp's Mixtral adds to [`LLAMA_CPP`]'s (gguf-py's `TensorNameMap`,
/// `FFN_GATE_INP`: "mixtral"): the router. The experts are [`LLAMA_CPP_MIXTRAL_EXPERTS`].
pub(crate) const LLAMA_CPP_MIXTRAL: &[NamesRow] = &[names(
    "blk.{l}.ffn_gate_inp.weight",
    "model.layers.{l}.block_sparse_moe.gate.weight",
    RopeRows::AsTheyAre,
)];

/// A family's per-expert tensors as `save_pretrained` writes them
/// (`model.layers.{l}.{module}.{e}.{proj}.weight`), which llama.cpp's converter stacks
/// into one `[experts, rows, cols]` tensor per projection and layer (`torch.stack`
/// over the experts in order).
pub(crate) struct LlamaCppExperts {
    /// The experts' module in the layer (`mlp.experts`).
    pub(crate) module: &'static str,
    /// `(GGUF name, proj)`, in the order the converter writes the three stacks.
    pub(crate) stacks: [(&'static str, &'static str); 3],
}

/// Qwen2-MoE's and Qwen3-MoE's experts (`Qwen2MoeModel.modify_tensors`: down, gate, up).
pub(crate) const LLAMA_CPP_EXPERTS: LlamaCppExperts = LlamaCppExperts {
    module: "mlp.experts",
    stacks: [
        ("blk.{l}.ffn_down_exps.weight", "down_proj"),
        ("blk.{l}.ffn_gate_exps.weight", "gate_proj"),
        ("blk.{l}.ffn_up_exps.weight", "up_proj"),
    ],
};

/// Mixtral's experts (`LlamaModel.modify_tensors`: `w1`, `w2`, `w3`, each stacked as
/// `layers.{l}.feed_forward.experts.{w}.weight`, which gguf-py's `TensorNameMap` names
/// `ffn_gate_exps`, `ffn_down_exps`, `ffn_up_exps`: `w1` the gate, `w2` the down, `w3`
/// the up projection).
pub(crate) const LLAMA_CPP_MIXTRAL_EXPERTS: LlamaCppExperts = LlamaCppExperts {
    module: "block_sparse_moe.experts",
    stacks: [
        ("blk.{l}.ffn_gate_exps.weight", "w1"),
        ("blk.{l}.ffn_down_exps.weight", "w2"),
        ("blk.{l}.ffn_up_exps.weight", "w3"),
    ],
};

/// The row blocks that turn a projection of `heads` heads of `head_dim` rows from
/// torchtitan's rotary layout into Hugging Face's (`to_hf`), or back. torchtitan's
/// `ComplexRoPE` rotates consecutive pairs (rows `2j`, `2j + 1` of a head are the real
/// and imaginary parts of pair `j`); Hugging Face's `rotate_half` pairs row `j` with
/// `j + head_dim / 2`. So Hugging Face's row `half * head_dim / 2 + j` of a head is
/// torchtitan's row `2j + half` (`Llama3StateDictAdapter._permute`:
/// `w.view(heads, head_dim / 2, 2, dim).transpose(1, 2)`). Blocks of one row each.
#[must_use]
pub(crate) fn rope_blocks(heads: u64, head_dim: u64, to_hf: bool) -> Vec<Block> {
    let pairs = head_dim / 2;
    let mut blocks = Vec::with_capacity(usize::try_from(heads * head_dim).unwrap_or(0));
    for h in 0..heads {
        for half in 0..2 {
            for j in 0..pairs {
                let titan = h * head_dim + 2 * j + half;
                let hf = h * head_dim + half * pairs + j;
                let (from, to) = if to_hf { (titan, hf) } else { (hf, titan) };
                blocks.push(Block { from, len: 1, to });
            }
        }
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 heads in 2 groups of 8 channels: rows 0..16 of each 32-row group are the
    /// group's two query heads, 16..24 its key head, 24..32 its value head.
    #[test]
    fn qkv_blocks_follow_megatron_groups() {
        let [(q, qn), (k, kn), (v, vn)] = qkv_blocks(2, 2, 8);
        assert_eq!((qn, kn, vn), (32, 16, 16));
        assert_eq!(
            q,
            vec![
                Block {
                    from: 0,
                    len: 16,
                    to: 0
                },
                Block {
                    from: 32,
                    len: 16,
                    to: 16
                }
            ]
        );
        assert_eq!(
            k,
            vec![
                Block {
                    from: 16,
                    len: 8,
                    to: 0
                },
                Block {
                    from: 48,
                    len: 8,
                    to: 8
                }
            ]
        );
        assert_eq!(
            v,
            vec![
                Block {
                    from: 24,
                    len: 8,
                    to: 0
                },
                Block {
                    from: 56,
                    len: 8,
                    to: 8
                }
            ]
        );
    }

    fn llama() -> Shape {
        Shape {
            layers: 2,
            hidden: 32,
            heads: 4,
            groups: 2,
            head_dim: 8,
            ffn: 64,
            vocab: 50,
            max_positions: 16,
            eps: 1e-5,
            rope_theta: 10000.0,
            swiglu: true,
            ..Shape::default()
        }
    }

    #[test]
    fn families_are_chosen_from_features() {
        assert_eq!(family_of(&llama()), Some(Family::Llama));
        let q2 = Shape {
            qkv_bias: true,
            ..llama()
        };
        assert_eq!(family_of(&q2), Some(Family::Qwen2));
        let q3 = Shape {
            qk_norm: true,
            ..llama()
        };
        assert_eq!(family_of(&q3), Some(Family::Qwen3));
        let gpt = Shape {
            swiglu: false,
            layer_norm: true,
            learned_positions: true,
            bias: true,
            qkv_bias: true,
            groups: 4,
            tied: true,
            ..llama()
        };
        assert_eq!(family_of(&gpt), Some(Family::GptBigCode));
        // SwiGLU with LayerNorm and learned positions: no family has it.
        let odd = Shape {
            layer_norm: true,
            learned_positions: true,
            ..llama()
        };
        assert_eq!(family_of(&odd), None);
        let e = Family::Qwen2.check(&llama()).unwrap_err().to_string();
        assert!(e.contains("no QKV bias") && e.contains("--hf-arch"), "{e}");
    }

    #[test]
    fn config_round_trips_through_read_config() {
        for (family, shape) in [
            (Family::Llama, llama()),
            (
                Family::Qwen2,
                Shape {
                    qkv_bias: true,
                    ..llama()
                },
            ),
            (
                Family::Qwen3,
                Shape {
                    qk_norm: true,
                    head_dim: 16,
                    ..llama()
                },
            ),
        ] {
            let text = config_json(family, &shape, "float32");
            let (f, s) = read_config(&text, "config.json").unwrap();
            assert_eq!(f, family);
            assert!(disagreements(&s, &shape).is_empty(), "{family:?}");
            assert_eq!(
                (s.qkv_bias, s.qk_norm, s.tied),
                (shape.qkv_bias, shape.qk_norm, shape.tied)
            );
        }
        let e = read_config(r#"{"architectures": ["BertModel"]}"#, "c.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`BertModel` is not in ckpt's model tables"),
            "{e}"
        );
    }

    /// torchtitan's interleaved rotary rows to Hugging Face's halves and back: head 1
    /// of 4 rows holds torchtitan's (re0, im0, re1, im1) as (re0, re1, im0, im1); the
    /// two directions are each other's inverse.
    #[test]
    fn rope_blocks_permute_each_head_and_invert() {
        let to_hf = rope_blocks(2, 4, true);
        let map: Vec<(u64, u64)> = to_hf.iter().map(|b| (b.from, b.to)).collect();
        assert!(to_hf.iter().all(|b| b.len == 1));
        assert_eq!(&map[4..], &[(4, 4), (6, 5), (5, 6), (7, 7)]);
        let back = rope_blocks(2, 4, false);
        for b in &to_hf {
            assert!(back.iter().any(|c| c.from == b.to && c.to == b.from));
        }
    }
}
