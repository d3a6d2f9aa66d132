//! Writing a Hugging Face model as Megatron-Bridge imports it (`reshard --format
//! megatron-bridge`): what `AutoBridge.import_ckpt(hf_model_id, OUT)` leaves
//! (Megatron-Bridge v0.6.0, `training/model_load_save.py` `save_megatron_model`, then
//! `training/checkpointing.py` `save_checkpoint` at step 0, `save_optim` and `save_rng`
//! false), and what Bridge's `load_checkpoint` (`checkpoint.load` or
//! `checkpoint.pretrained_checkpoint` = OUT) and `AutoBridge.load_megatron_model` start
//! from:
//!
//! ```text
//! OUT/latest_checkpointed_iteration.txt   "0" (Megatron-LM's tracker, no newline)
//! OUT/latest_train_state.pt               a copy of iter_0000000/train_state.pt
//! OUT/iter_0000000/__<r>_0.distcp, .metadata, metadata.json   the model's dist_ckpt
//! OUT/iter_0000000/common.pt              checkpoint_version 3.0, iteration 0, content_metadata
//! OUT/iter_0000000/train_state.pt         TrainState() at step 0 (0-d tensors)
//! OUT/iter_0000000/run_config.yaml        the ConfigContainer save_megatron_model builds
//! OUT/iter_0000000/tokenizer/             the source's tokenizer files
//! ```
//!
//! The dist_ckpt is [`super::megatron_dist`]'s (the same keys and chunks: no `model.`
//! or `module.` prefix, the layers stacked) with Bridge's `common.pt`. `run_config.yaml`'s
//! `model` is the `GPTModelProvider` that `LlamaBridge.provider_bridge` (or
//! `Qwen2Bridge`'s) makes of the config.json (`CONFIG_MAPPING`, then the family's
//! settings), with the output's tensor and
//! pipeline sizes; fields the mapping does not set are left out, as are the sections
//! the import leaves at their defaults: Bridge's `instantiate` fills them from the
//! classes (docs/trainers.md, "The way back").

use super::megatron_dist::{MegatronDist, Saver, BRIDGE_ITERATION_DIR};
use super::ranks::RankOptions;
use super::{TargetLayout, Writer};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::megatron::TRACKER_FILE;
use crate::formats::output::write_file_atomic;
use crate::formats::torch_write::TorchWriter;
use crate::formats::writer::TensorSpec;
use crate::hf::TOKENIZER_FILES;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use crate::layout::Dtype;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `reshard --format megatron-bridge`: a Hugging Face Llama or Qwen2 as Megatron-Bridge's
/// `AutoBridge.import_ckpt` saves it (module docs).
#[derive(Clone, Debug)]
pub struct MegatronBridge {
    dist: MegatronDist,
    /// `run_config.yaml`'s text.
    run_config: String,
    /// The source's tokenizer files (copied into `iter_0000000/tokenizer/`).
    tokenizer: Vec<PathBuf>,
}

impl MegatronBridge {
    /// The writer of `source` (a Hugging Face model) as Bridge imports it, on the grid
    /// `target` asks for, for the output directory `output` (recorded in
    /// `checkpoint.save`).
    ///
    /// # Errors
    /// A source that is not a Hugging Face model with its config.json; a model family or
    /// a config field Bridge's Llama mapping does not take (named); what
    /// [`MegatronDist::new`] refuses.
    pub fn new(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
        output: &Path,
    ) -> Result<MegatronBridge> {
        if source.is_megatron() {
            return Err(unsupported(
                "the source is a Megatron checkpoint; --format megatron-bridge writes a Hugging Face model (its config.json and weights) as Megatron-Bridge's AutoBridge.import_ckpt saves it".into(),
            ));
        }
        let config_path = source.carried.get("config.json").cloned().ok_or_else(|| {
            unsupported("--format megatron-bridge: the source has no config.json beside its weights (Bridge's provider is made from it)".into())
        })?;
        let config: Json = serde_json::from_slice(&crate::formats::read_small(&config_path)?)
            .map_err(|e| unsupported(format!("{}: not JSON: {e}", config_path.display())))?;
        // Checked before the weights are looked at: the family decides the mapping.
        let provider = provider(&config, &config_path)?;
        let dist = MegatronDist::saved_by(source, target, options, Saver::Bridge)?;
        let (tp, pp) = dist.sizes(source)?;
        let hf_dir = absolute(config_path.parent().unwrap_or(Path::new(".")));
        let output = absolute(output);
        let run_config = run_config(provider, (tp, pp), &hf_dir, &output);
        let tokenizer = TOKENIZER_FILES
            .iter()
            .filter_map(|f| source.carried.get(*f).cloned())
            .collect();
        Ok(MegatronBridge {
            dist,
            run_config,
            tokenizer,
        })
    }
}

impl Writer for MegatronBridge {
    fn name(&self) -> &'static str {
        "megatron-bridge"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        self.dist.plan(source, selection)
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn strategy(&self) -> Option<&Strategy> {
        self.dist.strategy()
    }

    fn finish(&self, src: &Checkpoint, sel: &Selection, plan: &CopyPlan, dir: &Path) -> Result<()> {
        self.dist.finish(src, sel, plan, dir)?;
        let iter = dir.join(BRIDGE_ITERATION_DIR);
        write_file_atomic(&iter.join("run_config.yaml"), self.run_config.as_bytes())?;
        train_state(&iter.join("train_state.pt"))?;
        train_state(&dir.join("latest_train_state.pt"))?;
        // `f.write(str(step))`: no newline.
        write_file_atomic(&dir.join(TRACKER_FILE), b"0")?;
        if !self.tokenizer.is_empty() {
            let tok = iter.join("tokenizer");
            std::fs::create_dir_all(&tok).map_err(|source| Error::Io {
                path: tok.clone(),
                source,
            })?;
            for f in &self.tokenizer {
                let name = f.file_name().unwrap_or_default();
                write_file_atomic(&tok.join(name), &crate::formats::read_small(f)?)?;
            }
        }
        Ok(())
    }
}

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// `TrainState().state_dict()` as the save's finalize step writes it: 0-d tensors,
/// `floating_point_operations_so_far` replaced by a float32 tensor (the import's 0).
fn train_state(dest: &Path) -> Result<()> {
    // (name, dtype, bytes of one element)
    let fields: [(&str, Dtype, usize); 8] = [
        ("step", Dtype::I64, 8),
        ("consumed_train_samples", Dtype::I64, 8),
        ("skipped_train_samples", Dtype::I64, 8),
        ("consumed_valid_samples", Dtype::I64, 8),
        ("floating_point_operations_so_far", Dtype::F32, 4),
        ("do_train", Dtype::BOOL, 1),
        ("do_valid", Dtype::BOOL, 1),
        ("do_test", Dtype::BOOL, 1),
    ];
    let specs: Vec<TensorSpec> = fields
        .iter()
        .map(|(n, d, _)| TensorSpec {
            name: (*n).into(),
            dtype: *d,
            shape: vec![],
        })
        .collect();
    let w = TorchWriter::create_wrapped(dest, &specs, false, None)?;
    for (i, (_, _, len)) in fields.iter().enumerate() {
        w.write_at(i, 0, &vec![0u8; *len])?;
    }
    w.finish()
}

/// A YAML value of `run_config.yaml`.
#[derive(Clone, Debug, PartialEq)]
enum Y {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    /// A class or function (`{_call_: false, _target_: ...}`: Bridge's
    /// `safe_yaml_representers` for torch dtypes and functions).
    Target(&'static str),
    /// An empty mapping (`{}`).
    Empty,
}

/// The families whose import ckpt writes: Bridge's bridge class of each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// `LlamaBridge` (`models/llama/llama_bridge.py`).
    Llama,
    /// `Qwen2Bridge` (`models/qwen/qwen2_bridge.py`).
    Qwen2,
}

/// The provider's fields the family's `provider_bridge` sets from `config` (Bridge's
/// `MegatronModelBridge.CONFIG_MAPPING`, `hf_config_to_provider_kwargs`, then the
/// family's own settings), by name.
///
/// # Errors
/// A config of another family, or a field the mapping cannot take, named.
fn provider(config: &Json, path: &Path) -> Result<BTreeMap<&'static str, Y>> {
    let bad = |field: &str, problem: String| {
        unsupported(format!(
            "{}: `{field}` {problem} (--format megatron-bridge)",
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
        _ => {
            return Err(bad(
                "architectures",
                format!(
                    "is {arch:?}: ckpt writes Bridge's import of LlamaForCausalLM (LlamaBridge) and Qwen2ForCausalLM (Qwen2Bridge) only so far"
                ),
            ))
        }
    };
    let int = |k: &str| config.get(k).and_then(Json::as_i64);
    let float = |k: &str| config.get(k).and_then(Json::as_f64);
    let mut m: BTreeMap<&'static str, Y> = BTreeMap::new();
    // CONFIG_MAPPING, (hf_name, megatron_name), where the config has the field.
    // transformers' LlamaConfig always has head_dim (hidden / heads when not given).
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
    // make_vocab_size_divisible_by: the largest power of 2 up to 128 dividing the
    // vocabulary.
    let vocab = int("vocab_size").unwrap_or(1);
    let mut base = 128;
    while base > 1 && vocab % base != 0 {
        base /= 2;
    }
    m.insert("make_vocab_size_divisible_by", Y::Int(base));
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
                format!("is {other:?}, not a dtype Bridge maps"),
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
    let scaling = scaling.filter(|s| {
        !s.is_null()
            && !s.as_object().is_some_and(serde_json::Map::is_empty)
            && s["rope_type"].as_str().or_else(|| s["type"].as_str()) != Some("default")
    });
    if family == Family::Qwen2 {
        // Qwen2Bridge.provider_bridge.
        if let Some(s) = scaling {
            return Err(bad(
                "rope_scaling",
                format!("is {s}: Bridge's Qwen2 keeps no RoPE scaling but YaRN's, whose yarn_* fields ckpt does not write"),
            ));
        }
        m.insert("normalization", Y::Str("RMSNorm".into()));
        m.insert("gated_linear_unit", Y::Bool(true));
        m.insert("add_bias_linear", Y::Bool(false));
        m.insert("add_qkv_bias", Y::Bool(true));
        m.insert("hidden_dropout", Y::Float(0.0));
        m.insert("autocast_dtype", Y::Target("torch.bfloat16"));
        m.insert("perform_initialization", Y::Bool(false));
        m.insert(
            "_target_",
            Y::Str("megatron.bridge.models.gpt_provider.GPTModelProvider".into()),
        );
        return Ok(m);
    }
    // LlamaBridge.provider_bridge.
    m.insert("normalization", Y::Str("RMSNorm".into()));
    m.insert("gated_linear_unit", Y::Bool(true));
    m.insert("hidden_dropout", Y::Float(0.0));
    for f in [
        "bias_activation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
        "bias_dropout_fusion",
        "apply_rope_fusion",
    ] {
        m.insert(f, Y::Bool(true));
    }
    m.insert("rotary_percent", Y::Float(1.0));
    match scaling {
        None => {}
        Some(s) => {
            let kind = s["rope_type"].as_str().or_else(|| s["type"].as_str());
            match kind {
                Some("llama3") => {
                    m.insert("rope_scaling", Y::Bool(true));
                    m.insert(
                        "rope_scaling_factor",
                        Y::Float(s["factor"].as_f64().unwrap_or(8.0)),
                    );
                }
                Some("linear") => {
                    let f = s["factor"].as_f64().ok_or_else(|| {
                        bad("rope_scaling.factor", "is missing (linear scaling)".into())
                    })?;
                    m.insert("seq_len_interpolation_factor", Y::Float(f));
                }
                other => {
                    return Err(bad(
                        "rope_scaling",
                        format!(
                        "has type {other:?}: Bridge's Llama keeps llama3 and linear scaling only"
                    ),
                    ))
                }
            }
        }
    }
    // to_megatron_provider(load_weights=True).
    m.insert("perform_initialization", Y::Bool(false));
    m.insert(
        "_target_",
        Y::Str("megatron.bridge.models.gpt_provider.GPTModelProvider".into()),
    );
    Ok(m)
}

/// `run_config.yaml`: the `ConfigContainer` of `save_megatron_model`, as
/// `ConfigContainerBase.to_yaml` dumps it (keys sorted, block style), with the
/// sections and fields it sets.
fn run_config(
    mut model: BTreeMap<&'static str, Y>,
    (tp, pp): (u64, u64),
    hf_dir: &Path,
    output: &Path,
) -> String {
    let i = |v: u64| Y::Int(i64::try_from(v).unwrap_or(i64::MAX));
    model.insert("tensor_model_parallel_size", i(tp));
    model.insert("pipeline_model_parallel_size", i(pp));
    let hf = hf_dir.display().to_string();
    model.insert("hf_model_id", Y::Str(hf.clone()));
    let section = |target: &str, fields: Vec<(&'static str, Y)>| {
        let mut m: BTreeMap<&'static str, Y> = fields.into_iter().collect();
        m.insert("_target_", Y::Str(target.into()));
        Some(m)
    };
    let mut top: BTreeMap<&'static str, Option<BTreeMap<&'static str, Y>>> = BTreeMap::new();
    top.insert(
        "checkpoint",
        section(
            "megatron.bridge.training.config.CheckpointConfig",
            vec![
                ("async_save", Y::Bool(false)),
                ("save", Y::Str(output.display().to_string())),
                ("save_optim", Y::Bool(false)),
                ("save_rng", Y::Bool(false)),
                ("ckpt_format", Y::Str("torch_dist".into())),
                ("dist_ckpt_optim_fully_reshardable", Y::Bool(true)),
            ],
        ),
    );
    top.insert(
        "optimizer",
        section(
            "megatron.bridge.training.config.OptimizerConfig",
            vec![("use_distributed_optimizer", Y::Bool(false))],
        ),
    );
    top.insert(
        "logger",
        section("megatron.bridge.training.config.LoggerConfig", vec![]),
    );
    top.insert(
        "tokenizer",
        section(
            "megatron.bridge.training.tokenizers.config.TokenizerConfig",
            vec![
                ("tokenizer_type", Y::Str("HuggingFaceTokenizer".into())),
                ("tokenizer_model", Y::Str(hf)),
                ("hf_tokenizer_kwargs", Y::Empty),
            ],
        ),
    );
    for none in ["train", "ddp", "scheduler", "dataset", "dist"] {
        top.insert(none, None);
    }
    top.insert("model", Some(model));
    let mut out = String::from("_target_: megatron.bridge.training.config.ConfigContainer\n");
    for (k, v) in &top {
        match v {
            None => {
                let _ = writeln!(out, "{k}: null");
            }
            Some(m) => {
                let _ = writeln!(out, "{k}:");
                for (f, y) in m {
                    match y {
                        Y::Target(t) => {
                            let _ = writeln!(out, "  {f}:\n    _call_: false\n    _target_: {t}");
                        }
                        y => {
                            let _ = writeln!(out, "  {f}: {}", scalar(y));
                        }
                    }
                }
            }
        }
    }
    out
}

/// A scalar as PyYAML's `safe_dump` writes it (floats as Python's `repr`, with the
/// `.` and two-digit exponent its resolver needs to read them back as floats).
fn scalar(y: &Y) -> String {
    match y {
        Y::Bool(b) => b.to_string(),
        Y::Int(v) => v.to_string(),
        Y::Float(f) => py_float(*f),
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
        Y::Empty => "{}".into(),
    }
}

/// Python's `repr` of a float, as PyYAML writes it: `0.02`, `10000.0`, `1.0e-05`.
fn py_float(f: f64) -> String {
    if f != 0.0 && (f.abs() < 1e-4 || f.abs() >= 1e16) {
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let mant = if mant.contains('.') {
            mant.to_string()
        } else {
            format!("{mant}.0")
        };
        let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
        format!("{mant}e{sign}{digits:0>2}")
    } else {
        format!("{f:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_pyyaml_writes_them() {
        assert_eq!(py_float(1e-5), "1.0e-05");
        assert_eq!(py_float(1e-6), "1.0e-06");
        assert_eq!(py_float(0.02), "0.02");
        assert_eq!(py_float(0.0), "0.0");
        assert_eq!(py_float(10000.0), "10000.0");
        assert_eq!(py_float(2.5e-7), "2.5e-07");
        assert_eq!(scalar(&Y::Str("RMSNorm".into())), "RMSNorm");
        assert_eq!(scalar(&Y::Str("1e5".into())), "'1e5'");
        assert_eq!(scalar(&Y::Str("/a b".into())), "'/a b'");
    }

    #[test]
    fn the_llama_mapping_is_bridges() {
        let config: Json = serde_json::from_str(
            r#"{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 32,
               "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 50, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": false, "rope_theta": 10000.0, "torch_dtype": "float32"}"#,
        )
        .unwrap();
        let m = provider(&config, Path::new("config.json")).unwrap();
        assert_eq!(m["kv_channels"], Y::Int(8));
        assert_eq!(m["num_query_groups"], Y::Int(2));
        assert_eq!(m["make_vocab_size_divisible_by"], Y::Int(2));
        assert_eq!(m["rotary_base"], Y::Int(10000));
        assert_eq!(m["layernorm_epsilon"], Y::Float(1e-5));
        assert_eq!(m["share_embeddings_and_output_weights"], Y::Bool(false));
        let text = run_config(m, (2, 2), Path::new("/m"), Path::new("/o"));
        assert!(
            text.contains("\n  tensor_model_parallel_size: 2\n"),
            "{text}"
        );
        assert!(
            text.contains("\n  params_dtype:\n    _call_: false\n    _target_: torch.float32\n")
        );
        assert!(text.contains("\ntrain: null\n"));
        let mut qwen = config.clone();
        qwen["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        let q = provider(&qwen, Path::new("config.json")).unwrap();
        assert_eq!(q["add_qkv_bias"], Y::Bool(true));
        assert_eq!(q["autocast_dtype"], Y::Target("torch.bfloat16"));
        assert!(!q.contains_key("kv_channels") && !q.contains_key("apply_rope_fusion"));
        let mut mistral = config.clone();
        mistral["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        let e = provider(&mistral, Path::new("config.json")).unwrap_err();
        assert!(e.to_string().contains("`architectures`"), "{e}");
        let mut yarn = config;
        yarn["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        let e = provider(&yarn, Path::new("config.json")).unwrap_err();
        assert!(e.to_string().contains("`rope_scaling`"), "{e}");
    }
}
