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
//!
//! A mixture of experts: Qwen3-MoE, as `Qwen3MoEBridge.provider_bridge` maps it (the
//! provider's MoE fields, `expert_model_parallel_size` and `expert_tensor_parallel_size`
//! from `--mesh`'s `ep` and `etp`). Bridge v0.6.0 registers no bridge for Mixtral or
//! Qwen2-MoE: refused by name. The provider's `default_layer_spec` is Transformer
//! Engine's, whose experts are `TEGroupedMLP` (`moe_grouped_gemm`), saved under
//! SequentialMLP's stacked keys (megatron-core's `TEGroupedMLP.sharded_state_dict`
//! without `singleton_local_shards`): [`super::megatron_dist`]'s experts, with the MoE
//! layers' `pre_mlp_layernorm` unfused, as that spec keeps it.

use super::hf_import::{absolute, hf_fields_moe, yaml_block, Family, HfSource, Y};
use super::megatron_dist::{MegatronDist, Saver, BRIDGE_ITERATION_DIR};
use super::ranks::RankOptions;
use super::{TargetLayout, Writer};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::formats::megatron::TRACKER_FILE;
use crate::formats::output::write_file_atomic;
use crate::formats::torch_write::TorchWriter;
use crate::formats::writer::TensorSpec;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use crate::layout::Dtype;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

/// `reshard --format megatron-bridge`: a Hugging Face Llama, Qwen2 or Qwen3-MoE as
/// Megatron-Bridge's `AutoBridge.import_ckpt` saves it (module docs).
#[derive(Clone, Debug)]
pub struct MegatronBridge {
    dist: MegatronDist,
    /// `run_config.yaml`'s text.
    run_config: String,
    /// The source (its tokenizer files are copied into `iter_0000000/tokenizer/`).
    hf: HfSource,
}

impl MegatronBridge {
    /// The writer of `source` (a Hugging Face model) as Bridge imports it, on the grid
    /// `target` asks for, for the output directory `output` (recorded in
    /// `checkpoint.save`).
    ///
    /// # Errors
    /// A source that is not a Hugging Face model with its config.json; a model family or
    /// a config field Bridge's mappings do not take (named); expert-parallel sizes the
    /// model does not divide into; what [`MegatronDist::new`] refuses.
    pub fn new(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
        output: &Path,
    ) -> Result<MegatronBridge> {
        let hf = HfSource::of(
            source,
            "megatron-bridge",
            "Megatron-Bridge's AutoBridge.import_ckpt",
        )?;
        // Checked before the weights are looked at: the family decides the mapping.
        let mut provider = provider(&hf.config, &hf.config_path)?;
        let experts = provider.get("num_moe_experts").cloned();
        expert_sizes(&mut provider, experts, target.grid().as_deref())?;
        let dist = MegatronDist::saved_by(source, target, options, Saver::Bridge)?;
        let (tp, pp) = dist.sizes(source)?;
        let run_config = run_config(provider, (tp, pp), &hf.dir(), &absolute(output));
        Ok(MegatronBridge {
            dist,
            run_config,
            hf,
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
        self.hf.copy_tokenizer(&iter.join("tokenizer"))
    }
}

/// The expert-parallel sizes `--mesh` asks (`ep=`, `etp=`) as the provider's
/// `expert_model_parallel_size` (1 where not asked) and `expert_tensor_parallel_size`
/// (where asked; megatron-core's `TransformerConfig` takes the TP size where unset) of a
/// mixture of experts (`experts`: its `num_moe_experts`).
///
/// # Errors
/// `ep` or `etp` for a model without experts; an `ep` that does not divide the experts;
/// an `etp` megatron-core does not take (0).
fn expert_sizes(
    m: &mut BTreeMap<&'static str, Y>,
    experts: Option<Y>,
    grid: Option<&[(String, u64)]>,
) -> Result<()> {
    let mesh = grid.unwrap_or_default();
    let text = mesh
        .iter()
        .map(|(n, s)| format!("{n}={s}"))
        .collect::<Vec<_>>()
        .join(",");
    // Exit 1, as `--format megatron` refuses such an EP size: the mesh is well formed,
    // the model does not fit it.
    let invalid = |problem: String| {
        super::hf_import::unsupported(format!(
            "--mesh {text}: {problem} (--format megatron-bridge)"
        ))
    };
    let size = |axis: &str| mesh.iter().find(|(n, _)| n == axis).map(|(_, s)| *s);
    let (ep, etp) = (size("ep"), size("etp"));
    let Some(Y::Int(experts)) = experts else {
        if let Some((axis, n)) = [("ep", ep), ("etp", etp)]
            .into_iter()
            .find_map(|(a, s)| s.map(|s| (a, s)))
        {
            return Err(invalid(format!("{axis}={n}: the model has no experts")));
        }
        return Ok(());
    };
    let ep = ep.unwrap_or(1);
    let i = |v: u64| Y::Int(i64::try_from(v).unwrap_or(i64::MAX));
    if ep == 0 || u64::try_from(experts).map_or(true, |e| e % ep != 0) {
        return Err(invalid(format!(
            "ep={ep}: the {experts} experts (num_moe_experts) do not divide into {ep} expert-parallel ranks (megatron-core needs as many local experts on each)"
        )));
    }
    m.insert("expert_model_parallel_size", i(ep));
    match etp {
        Some(0) => return Err(invalid("etp=0".into())),
        Some(e) => {
            m.insert("expert_tensor_parallel_size", i(e));
        }
        None => {}
    }
    Ok(())
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
/// The provider's fields the family's `provider_bridge` sets from `config` (Bridge's
/// `MegatronModelBridge.CONFIG_MAPPING`, `hf_config_to_provider_kwargs`
/// ([`hf_fields`]), then the family's own settings), by name.
///
/// # Errors
/// A config of another family, or a field the mapping cannot take, named.
fn provider(config: &Json, path: &Path) -> Result<BTreeMap<&'static str, Y>> {
    let bad = |field: &str, problem: String| {
        super::hf_import::unsupported(format!(
            "{}: `{field}` {problem} (--format megatron-bridge)",
            path.display()
        ))
    };
    let hf = hf_fields_moe(config, path, "megatron-bridge")?;
    let (family, mut m, scaling) = (hf.family, hf.fields, hf.scaling);
    // make_vocab_size_divisible_by: the largest power of 2 up to 128 dividing the
    // vocabulary.
    let vocab = match m.get("vocab_size") {
        Some(Y::Int(v)) => *v,
        _ => 1,
    };
    let mut base = 128;
    while base > 1 && vocab % base != 0 {
        base /= 2;
    }
    m.insert("make_vocab_size_divisible_by", Y::Int(base));
    if family == Family::Qwen3Moe {
        // Qwen3MoEBridge.provider_bridge: the base mapping (CONFIG_MAPPING, its MoE
        // entries included: hf_fields_moe), then these.
        if let Some(s) = scaling {
            return Err(bad(
                "rope_scaling",
                format!("is {s}: ckpt writes Bridge's Qwen3-MoE without RoPE scaling (YaRN's goes into yarn_* fields ckpt does not write)"),
            ));
        }
        let norm_topk = match config.get("norm_topk_prob") {
            None | Some(Json::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad("norm_topk_prob", "is not a boolean".into()))?,
        };
        m.insert("normalization", Y::Str("RMSNorm".into()));
        m.insert("gated_linear_unit", Y::Bool(true));
        m.insert("add_bias_linear", Y::Bool(false));
        m.insert("add_qkv_bias", Y::Bool(false));
        m.insert("hidden_dropout", Y::Float(0.0));
        m.insert("qk_layernorm", Y::Bool(true));
        m.insert("autocast_dtype", Y::Target("torch.bfloat16"));
        m.insert("moe_grouped_gemm", Y::Bool(true));
        m.insert("moe_router_load_balancing_type", Y::Str("aux_loss".into()));
        m.insert("moe_aux_loss_coeff", Y::Float(1e-3));
        m.insert("moe_router_pre_softmax", Y::Bool(!norm_topk));
        m.insert("moe_token_dispatcher_type", Y::Str("alltoall".into()));
        m.insert("moe_permute_fusion", Y::Bool(true));
        m.insert("perform_initialization", Y::Bool(false));
        m.insert(
            "_target_",
            Y::Str("megatron.bridge.models.gpt_provider.GPTModelProvider".into()),
        );
        return Ok(m);
    }
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
        let mut m: BTreeMap<String, Y> = fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        m.insert("_target_".into(), Y::Str(target.into()));
        Y::Map(m)
    };
    let mut top: BTreeMap<String, Y> = BTreeMap::new();
    top.insert(
        "_target_".into(),
        Y::Str("megatron.bridge.training.config.ConfigContainer".into()),
    );
    top.insert(
        "checkpoint".into(),
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
        "optimizer".into(),
        section(
            "megatron.bridge.training.config.OptimizerConfig",
            vec![("use_distributed_optimizer", Y::Bool(false))],
        ),
    );
    top.insert(
        "logger".into(),
        section("megatron.bridge.training.config.LoggerConfig", vec![]),
    );
    top.insert(
        "tokenizer".into(),
        section(
            "megatron.bridge.training.tokenizers.config.TokenizerConfig",
            vec![
                ("tokenizer_type", Y::Str("HuggingFaceTokenizer".into())),
                ("tokenizer_model", Y::Str(hf)),
                ("hf_tokenizer_kwargs", Y::empty()),
            ],
        ),
    );
    for none in ["train", "ddp", "scheduler", "dataset", "dist"] {
        top.insert(none.into(), Y::Null);
    }
    top.insert(
        "model".into(),
        Y::Map(model.into_iter().map(|(k, v)| (k.to_string(), v)).collect()),
    );
    let mut out = String::new();
    yaml_block(&mut out, 0, &top);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn the_qwen3_moe_mapping_is_bridges() {
        let config: Json = serde_json::from_str(
            r#"{"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 16,
               "intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 8, "rms_norm_eps": 1e-6,
               "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
               "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}"#,
        )
        .unwrap();
        let mut m = provider(&config, Path::new("config.json")).unwrap();
        assert_eq!(m["num_moe_experts"], Y::Int(4));
        assert_eq!(m["moe_router_topk"], Y::Int(2));
        assert_eq!(m["moe_ffn_hidden_size"], Y::Int(12));
        assert_eq!(m["moe_router_pre_softmax"], Y::Bool(false));
        assert_eq!(m["moe_grouped_gemm"], Y::Bool(true));
        assert_eq!(m["qk_layernorm"], Y::Bool(true));
        assert_eq!(m["kv_channels"], Y::Int(8));
        assert_eq!(m["rotary_base"], Y::Int(1_000_000));
        let grid = |s: &[(&str, u64)]| -> Vec<(String, u64)> {
            s.iter().map(|(n, v)| ((*n).to_string(), *v)).collect()
        };
        let experts = m.get("num_moe_experts").cloned();
        expert_sizes(
            &mut m,
            experts.clone(),
            Some(grid(&[("tp", 1), ("ep", 2), ("etp", 1)]).as_slice()),
        )
        .unwrap();
        assert_eq!(m["expert_model_parallel_size"], Y::Int(2));
        assert_eq!(m["expert_tensor_parallel_size"], Y::Int(1));
        let e = expert_sizes(&mut m, experts, Some(grid(&[("ep", 3)]).as_slice())).unwrap_err();
        assert!(e.to_string().contains("do not divide into 3"), "{e}");
        let e = expert_sizes(&mut m, None, Some(grid(&[("ep", 2)]).as_slice())).unwrap_err();
        assert!(e.to_string().contains("no experts"), "{e}");
        // Without norm_topk_prob (Qwen3MoeConfig's default false): softmax before top-k.
        let mut plain = config.clone();
        plain.as_object_mut().unwrap().remove("norm_topk_prob");
        let p = provider(&plain, Path::new("config.json")).unwrap();
        assert_eq!(p["moe_router_pre_softmax"], Y::Bool(true));
        for (arch, field) in [
            ("MixtralForCausalLM", "`architectures`"),
            ("Qwen2MoeForCausalLM", "`architectures`"),
        ] {
            let mut c = config.clone();
            c["architectures"] = serde_json::json!([arch]);
            let e = provider(&c, Path::new("config.json")).unwrap_err();
            assert!(
                e.to_string().contains(field) && e.to_string().contains("no bridge"),
                "{e}"
            );
        }
        let mut biased = config;
        biased["attention_bias"] = serde_json::json!(true);
        let e = provider(&biased, Path::new("config.json")).unwrap_err();
        assert!(e.to_string().contains("`attention_bias`"), "{e}");
    }
}
