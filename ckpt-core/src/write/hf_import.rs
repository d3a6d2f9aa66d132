//! A Hugging Face model as the Megatron trainers' importers take it: its config.json
//! read into megatron-core's `TransformerConfig` fields (the mapping Megatron-Bridge's
//! `CONFIG_MAPPING` and NeMo 2's `HFLlamaImporter.config` / `HFQwen2Importer.config`
//! share), its tokenizer files, and the YAML those trainers dump their configs as
//! (PyYAML's `safe_dump`: keys sorted, block style). Shared by
//! [`super::megatron_bridge`] and [`super::nemo2`].

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::hf::TOKENIZER_FILES;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// A YAML value of a trainer's config dump.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Y {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    /// A class or function (`{_call_: false, _target_: ...}`: Bridge's
    /// `safe_yaml_representers` and nemo_run's for torch dtypes and functions).
    Target(&'static str),
    /// A mapping (`{}` when empty), its keys sorted as `safe_dump` sorts them.
    Map(BTreeMap<String, Y>),
    /// An empty list (`[]`).
    EmptyList,
}

impl Y {
    /// An empty mapping.
    pub(crate) fn empty() -> Y {
        Y::Map(BTreeMap::new())
    }
}

/// The families whose import ckpt writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    /// Bridge's `LlamaBridge`, NeMo's `HFLlamaImporter`.
    Llama,
    /// Bridge's `Qwen2Bridge`, NeMo's `HFQwen2Importer`.
    Qwen2,
    /// Bridge's `Qwen3MoEBridge` (a mixture of experts: [`hf_fields`] with `moe`).
    Qwen3Moe,
}

/// A Hugging Face source of an import: its config.json and tokenizer files.
#[derive(Clone, Debug)]
pub(crate) struct HfSource {
    pub(crate) config: Json,
    pub(crate) config_path: PathBuf,
    /// The tokenizer files beside the weights or config.json.
    pub(crate) tokenizer: Vec<PathBuf>,
}

impl HfSource {
    /// The Hugging Face model `source` is, for `--format {format}` (`saves` says whose
    /// import that is).
    ///
    /// # Errors
    /// A Megatron source; a source without config.json, or one that is not JSON.
    pub(crate) fn of(source: &Checkpoint, format: &str, saves: &str) -> Result<HfSource> {
        if source.is_megatron() {
            return Err(unsupported(format!(
                "the source is a Megatron checkpoint; --format {format} writes a Hugging Face model (its config.json and weights) as {saves} saves it"
            )));
        }
        let config_path = source.carried.get("config.json").cloned().ok_or_else(|| {
            unsupported(format!("--format {format}: the source has no config.json beside its weights (the import's model config is made from it)"))
        })?;
        let config: Json = serde_json::from_slice(&crate::formats::read_small(&config_path)?)
            .map_err(|e| unsupported(format!("{}: not JSON: {e}", config_path.display())))?;
        // Carried with the weights, else beside config.json (where the model's directory
        // keeps them: the checkpoint carries config.json alone).
        let dir = config_path.parent().unwrap_or(Path::new("."));
        let tokenizer = TOKENIZER_FILES
            .iter()
            .filter_map(|f| {
                source
                    .carried
                    .get(*f)
                    .cloned()
                    .or_else(|| Some(dir.join(f)).filter(|p| p.is_file()))
            })
            .collect();
        Ok(HfSource {
            config,
            config_path,
            tokenizer,
        })
    }

    /// The config's directory, absolute.
    pub(crate) fn dir(&self) -> PathBuf {
        absolute(self.config_path.parent().unwrap_or(Path::new(".")))
    }

    /// Copies the tokenizer files into `dir` (made if there are any).
    ///
    /// # Errors
    /// I/O errors.
    pub(crate) fn copy_tokenizer(&self, dir: &Path) -> Result<()> {
        if self.tokenizer.is_empty() {
            return Ok(());
        }
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        for f in &self.tokenizer {
            let name = f.file_name().unwrap_or_default();
            crate::formats::output::write_file_atomic(
                &dir.join(name),
                &crate::formats::read_small(f)?,
            )?;
        }
        Ok(())
    }
}

pub(crate) fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

pub(crate) fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// What the importers read of a config.json, in megatron-core's names.
#[derive(Clone, Debug)]
pub(crate) struct HfFields {
    pub(crate) family: Family,
    /// `num_layers`, `hidden_size`, `ffn_hidden_size`, `num_attention_heads`,
    /// `num_query_groups`, `vocab_size`, `seq_length`, `kv_channels` (where known),
    /// `layernorm_epsilon`, `init_method_std`, `attention_dropout`,
    /// `share_embeddings_and_output_weights`, `add_qkv_bias`, `add_bias_linear`,
    /// `rotary_base` (an integer where it is one), `fp16`, `bf16`, `params_dtype`,
    /// `activation_func`, `position_embedding_type`.
    pub(crate) fields: BTreeMap<&'static str, Y>,
    /// The RoPE base as the config gives it (`rope_theta`, or transformers 5's
    /// `rope_parameters.rope_theta`; 10000.0 where absent).
    pub(crate) theta: f64,
    /// The RoPE scaling, where it is not the default.
    pub(crate) scaling: Option<Json>,
}

impl HfFields {
    /// An integer field of [`HfFields::fields`] (0 where absent).
    pub(crate) fn int(&self, name: &str) -> i64 {
        match self.fields.get(name) {
            Some(Y::Int(v)) => *v,
            _ => 0,
        }
    }
}

/// The fields both importers set from `config` (Bridge's
/// `MegatronModelBridge.CONFIG_MAPPING` and `hf_config_to_provider_kwargs`; NeMo's
/// `HFLlamaImporter.config` reads the same config fields), for `--format {format}`:
/// Llama and Qwen2.
///
/// # Errors
/// A config of another family (a mixture of experts too), or a field the mapping cannot
/// take, named.
pub(crate) fn hf_fields(config: &Json, path: &Path, format: &str) -> Result<HfFields> {
    hf_fields_of(config, path, format, false)
}

/// [`hf_fields`], the mixtures of experts Megatron-Bridge v0.6.0 maps taken too
/// (Qwen3-MoE: `Qwen3MoEBridge`), with `CONFIG_MAPPING`'s MoE fields: `num_moe_experts`,
/// `moe_router_topk`, `moe_ffn_hidden_size` (transformers' `Qwen3MoeConfig` defaults
/// where config.json leaves them out, as Bridge reads the config object; its
/// `router_aux_loss_coef` is mapped too, then overwritten by `Qwen3MoEBridge`).
///
/// # Errors
/// As [`hf_fields`]; Mixtral and Qwen2-MoE, for which Bridge v0.6.0 registers no
/// bridge, named.
pub(crate) fn hf_fields_moe(config: &Json, path: &Path, format: &str) -> Result<HfFields> {
    hf_fields_of(config, path, format, true)
}

fn hf_fields_of(config: &Json, path: &Path, format: &str, moe: bool) -> Result<HfFields> {
    let bad = |field: &str, problem: String| {
        unsupported(format!(
            "{}: `{field}` {problem} (--format {format})",
            path.display()
        ))
    };
    let arch = config["architectures"]
        .as_array()
        .and_then(|a| a.first())
        .and_then(Json::as_str)
        .unwrap_or("");
    let family = match arch {
        "LlamaForCausalLM" => Family::Llama,
        "Qwen2ForCausalLM" => Family::Qwen2,
        "Qwen3MoeForCausalLM" if moe => Family::Qwen3Moe,
        "Qwen3MoeForCausalLM" => {
            return Err(bad(
                "architectures",
                format!(
                    "is {arch:?}, a mixture of experts: ckpt writes this import of LlamaForCausalLM and Qwen2ForCausalLM only so far (--format megatron-bridge takes it)"
                ),
            ))
        }
        "MixtralForCausalLM" | "Qwen2MoeForCausalLM" if moe => {
            return Err(bad(
                "architectures",
                format!(
                    "is {arch:?}, a mixture of experts Megatron-Bridge v0.6.0 registers no bridge for (its AutoBridge.import_ckpt refuses it; Qwen3MoeForCausalLM is the mixture of experts it maps)"
                ),
            ))
        }
        _ => {
            return Err(bad(
                "architectures",
                format!(
                    "is {arch:?}: ckpt writes this import of LlamaForCausalLM and Qwen2ForCausalLM only so far"
                ),
            ))
        }
    };
    let int = |k: &str| config.get(k).and_then(Json::as_i64);
    let float = |k: &str| config.get(k).and_then(Json::as_f64);
    let mut m: BTreeMap<&'static str, Y> = BTreeMap::new();
    // CONFIG_MAPPING, (hf_name, megatron_name), where the config has the field.
    for (hf, meg) in [
        ("num_hidden_layers", "num_layers"),
        ("hidden_size", "hidden_size"),
        ("intermediate_size", "ffn_hidden_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_query_groups"),
        ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "seq_length"),
    ] {
        let v = int(hf).ok_or_else(|| bad(hf, "is missing or not an integer".into()))?;
        m.insert(meg, Y::Int(v));
    }
    let hidden = int("hidden_size").unwrap_or(0);
    let heads = int("num_attention_heads").unwrap_or(1).max(1);
    // transformers' LlamaConfig always has `head_dim` (hidden / heads when not given);
    // Qwen2Config only where config.json gives it.
    // Qwen3MoeConfig (transformers 5) has no head_dim field either.
    let head_dim = match config.get("head_dim") {
        None | Some(Json::Null) => (family == Family::Llama).then_some(hidden / heads),
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| bad("head_dim", "is not an integer".into()))?,
        ),
    };
    if let Some(h) = head_dim {
        m.insert("kv_channels", Y::Int(h));
    }
    for (hf, meg, default) in [
        ("rms_norm_eps", "layernorm_epsilon", 1e-6),
        ("initializer_range", "init_method_std", 0.02),
        ("attention_dropout", "attention_dropout", 0.0),
    ] {
        let v = match config.get(hf) {
            None | Some(Json::Null) => default,
            Some(v) => v
                .as_f64()
                .ok_or_else(|| bad(hf, "is not a number".into()))?,
        };
        m.insert(meg, Y::Float(v));
    }
    for (hf, meg) in [
        ("tie_word_embeddings", "share_embeddings_and_output_weights"),
        ("attention_bias", "add_qkv_bias"),
        ("mlp_bias", "add_bias_linear"),
    ] {
        let v = match config.get(hf) {
            None | Some(Json::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(hf, "is not a boolean".into()))?,
        };
        m.insert(meg, Y::Bool(v));
    }
    // rope_theta, or transformers 5's rope_parameters (rope_theta_from_hf).
    let theta = float("rope_theta")
        .or_else(|| config["rope_parameters"]["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    #[allow(clippy::cast_possible_truncation)]
    let theta_y = if theta.fract() == 0.0 && theta.abs() < 9e15 {
        Y::Int(theta as i64)
    } else {
        Y::Float(theta)
    };
    m.insert("rotary_base", theta_y);
    // dtype_from_hf(config, default=float32).
    let dtype = config
        .get("torch_dtype")
        .or_else(|| config.get("dtype"))
        .and_then(Json::as_str)
        .unwrap_or("float32");
    let target = match dtype {
        "float32" => "torch.float32",
        "bfloat16" => "torch.bfloat16",
        "float16" => "torch.float16",
        other => {
            return Err(bad(
                "torch_dtype",
                format!("is {other:?}, not a dtype the import maps"),
            ))
        }
    };
    m.insert("fp16", Y::Bool(dtype == "float16"));
    m.insert("bf16", Y::Bool(dtype == "bfloat16"));
    m.insert("params_dtype", Y::Target(target));
    let act = config
        .get("hidden_act")
        .and_then(Json::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(bad(
            "hidden_act",
            format!("is {act:?}: a Llama's gated unit is SiLU's"),
        ));
    }
    m.insert("activation_func", Y::Target("torch.nn.functional.silu"));
    m.insert("position_embedding_type", Y::Str("rope".into()));
    // transformers 5 keeps the scaling in `rope_parameters` (its `rope_type` not
    // `default`), which its config also answers as `rope_scaling`.
    let scaling = config.get("rope_scaling").or_else(|| {
        config
            .get("rope_parameters")
            .filter(|p| p["rope_type"].as_str().is_some_and(|t| t != "default"))
    });
    let scaling = scaling
        .filter(|s| {
            !s.is_null()
                && !s.as_object().is_some_and(serde_json::Map::is_empty)
                && s["rope_type"].as_str().or_else(|| s["type"].as_str()) != Some("default")
        })
        .cloned();
    if family == Family::Qwen3Moe {
        moe_fields(config, &mut m, &bad)?;
    }
    Ok(HfFields {
        family,
        fields: m,
        theta,
        scaling,
    })
}

/// `CONFIG_MAPPING`'s MoE entries of a Qwen3-MoE config (`num_experts` or
/// `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`),
/// `Qwen3MoeConfig`'s defaults where absent; the layout
/// Bridge's provider assumes checked: every layer a mixture of experts
/// (`decoder_sparse_step` 1, no `mlp_only_layers`: the provider's `moe_layer_freq` is 1),
/// no attention bias (`Qwen3MoEBridge` sets `add_qkv_bias` false).
fn moe_fields(
    config: &Json,
    m: &mut BTreeMap<&'static str, Y>,
    bad: &dyn Fn(&str, String) -> Error,
) -> Result<()> {
    let int = |k: &str, default: i64| -> Result<i64> {
        match config.get(k) {
            None | Some(Json::Null) => Ok(default),
            Some(v) => v.as_i64().ok_or_else(|| bad(k, "is not an integer".into())),
        }
    };
    let experts = match config.get("num_experts").filter(|v| !v.is_null()) {
        Some(_) => int("num_experts", 128)?,
        None => int("num_local_experts", 128)?,
    };
    if experts < 1 {
        return Err(bad("num_experts", format!("is {experts}")));
    }
    m.insert("num_moe_experts", Y::Int(experts));
    m.insert("moe_router_topk", Y::Int(int("num_experts_per_tok", 8)?));
    m.insert(
        "moe_ffn_hidden_size",
        Y::Int(int("moe_intermediate_size", 768)?),
    );
    let step = int("decoder_sparse_step", 1)?;
    if step != 1 {
        return Err(bad(
            "decoder_sparse_step",
            format!(
                "is {step}: Bridge's Qwen3-MoE provider makes every layer a mixture of experts"
            ),
        ));
    }
    let dense = &config["mlp_only_layers"];
    if dense.as_array().is_some_and(|l| !l.is_empty()) {
        return Err(bad(
            "mlp_only_layers",
            format!(
                "is {dense}: Bridge's Qwen3-MoE provider makes every layer a mixture of experts"
            ),
        ));
    }
    if m.get("add_qkv_bias") == Some(&Y::Bool(true)) {
        return Err(bad(
            "attention_bias",
            "is true: Bridge's Qwen3-MoE provider has no QKV bias (add_qkv_bias false)".into(),
        ));
    }
    Ok(())
}

/// A mapping's text as PyYAML's `safe_dump` writes it at `indent` spaces (keys sorted,
/// block style; a class or function as its `{_call_: false, _target_: ...}` mapping).
pub(crate) fn yaml_block(out: &mut String, indent: usize, map: &BTreeMap<String, Y>) {
    let pad = " ".repeat(indent);
    for (k, v) in map {
        match v {
            Y::Target(t) => {
                let _ = writeln!(out, "{pad}{k}:\n{pad}  _call_: false\n{pad}  _target_: {t}");
            }
            Y::Map(m) if !m.is_empty() => {
                let _ = writeln!(out, "{pad}{k}:");
                yaml_block(out, indent + 2, m);
            }
            y => {
                let _ = writeln!(out, "{pad}{k}: {}", scalar(y));
            }
        }
    }
}

/// A scalar as PyYAML's `safe_dump` writes it (floats as Python's `repr`, with the
/// `.` and two-digit exponent its resolver needs to read them back as floats).
pub(crate) fn scalar(y: &Y) -> String {
    match y {
        Y::Null => "null".into(),
        Y::Bool(b) => b.to_string(),
        Y::Int(v) => v.to_string(),
        Y::Float(f) => yaml_float(*f),
        Y::Str(s) => {
            let plain = !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._/-".contains(c))
                && s.parse::<f64>().is_err()
                && !["null", "true", "false", "yes", "no", "on", "off", "~"]
                    .contains(&s.to_ascii_lowercase().as_str());
            if plain {
                s.clone()
            } else {
                format!("'{}'", s.replace('\'', "''"))
            }
        }
        Y::Target(t) => (*t).to_string(),
        Y::Map(_) => "{}".into(),
        Y::EmptyList => "[]".into(),
    }
}

/// Python's `repr` of a float (what `json.dumps` writes): `0.02`, `10000.0`, `1e-05`.
pub(crate) fn py_float(f: f64) -> String {
    if f != 0.0 && (f.abs() < 1e-4 || f.abs() >= 1e16) {
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
        format!("{mant}e{sign}{digits:0>2}")
    } else {
        format!("{f:?}")
    }
}

/// A float as PyYAML writes it: Python's `repr` with a `.` in the mantissa
/// (`1.0e-05`), which YAML 1.1's resolver needs to read it back as a float.
pub(crate) fn yaml_float(f: f64) -> String {
    let s = py_float(f);
    match s.split_once('e') {
        Some((mant, exp)) if !mant.contains('.') => format!("{mant}.0e{exp}"),
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_and_pyyaml_write_them() {
        assert_eq!(yaml_float(1e-5), "1.0e-05");
        assert_eq!(yaml_float(1e-6), "1.0e-06");
        assert_eq!(yaml_float(0.02), "0.02");
        assert_eq!(yaml_float(0.0), "0.0");
        assert_eq!(yaml_float(10000.0), "10000.0");
        assert_eq!(yaml_float(2.5e-7), "2.5e-07");
        assert_eq!(py_float(1e-5), "1e-05");
        assert_eq!(py_float(2.5e-7), "2.5e-07");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(0.02), "0.02");
        assert_eq!(scalar(&Y::Str("RMSNorm".into())), "RMSNorm");
        assert_eq!(scalar(&Y::Str("1e5".into())), "'1e5'");
        assert_eq!(scalar(&Y::Str("/a b".into())), "'/a b'");
        let mut m = BTreeMap::new();
        m.insert("b".to_string(), Y::Target("torch.float32"));
        m.insert("a".to_string(), Y::EmptyList);
        m.insert("_target_".to_string(), Y::Str("x.Y".into()));
        m.insert("c".to_string(), Y::empty());
        let mut out = String::new();
        yaml_block(&mut out, 2, &m);
        assert_eq!(
            out,
            "  _target_: x.Y\n  a: []\n  b:\n    _call_: false\n    _target_: torch.float32\n  c: {}\n"
        );
    }
}
