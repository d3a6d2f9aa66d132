//! Trainers' save directories read as a whole (docs/trainers.md): the step chosen as
//! the trainer resumes, only the weights read, the model config and tokenizer the
//! trainer kept used, and a directory of side files no trainer row knows refused.

use crate::util::{assert_same_tensors, copy_dir, full_tensors, Dir};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A Hugging Face Trainer's output directory as `Trainer._save_checkpoint` lays it out
/// without FSDP (model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
/// trainer_state.json in each `checkpoint-<N>/`; the model's config.json above them),
/// from transformers' own files of the tiny Llama; the side files are torch.save files
/// holding tensors (the RNG state's `cpu`) that must never be read as the model.
fn hf_trainer_out(d: &Dir, steps: &[u64]) -> PathBuf {
    let model = fixtures().join("hf_models/llama");
    let side = fixtures().join("hf_models/gpt2_tied.pt");
    let out = d.path("trainer_out");
    for s in steps {
        let c = out.join(format!("checkpoint-{s}"));
        std::fs::create_dir_all(&c).unwrap();
        std::fs::copy(model.join("model.safetensors"), c.join("model.safetensors")).unwrap();
        for f in ["rng_state.pth", "scheduler.pt", "optimizer.pt"] {
            std::fs::copy(&side, c.join(f)).unwrap();
        }
        std::fs::write(
            c.join("trainer_state.json"),
            format!("{{\"global_step\": {s}}}"),
        )
        .unwrap();
    }
    std::fs::copy(model.join("config.json"), out.join("config.json")).unwrap();
    out
}

#[test]
fn side_files_beside_loose_torch_files_are_refused_not_merged() {
    let d = Dir::new();
    let dir = d.path("run");
    std::fs::create_dir_all(&dir).unwrap();
    let side = fixtures().join("hf_models/gpt2_tied.pt");
    // What the silently wrong merge read: a step directory of unknown naming, its model
    // in a subdirectory, RNG state and scheduler beside it.
    std::fs::copy(&side, dir.join("rng_state_0.pth")).unwrap();
    std::fs::copy(&side, dir.join("scheduler.pt")).unwrap();
    let o = d.fails(&["merge", "run", "-o", "out"]);
    assert!(
        o.stderr.contains("rng_state_0.pth")
            && o.stderr.contains("scheduler.pt")
            && o.stderr.contains("not the model"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists(), "nothing written on a refusal");
    // The model file itself, given as a file, is read as it is.
    std::fs::copy(&side, dir.join("model.pt")).unwrap();
    d.fails(&["merge", "run", "-o", "out"]);
    d.ok(&["merge", "run/model.pt", "-o", "out"]);
}

#[test]
fn hf_trainer_output_directory_gives_the_highest_complete_step() {
    let d = Dir::new();
    let out = hf_trainer_out(&d, &[1, 2]);
    // A third step cut off before trainer_state.json: skipped, said.
    let cut = out.join("checkpoint-3");
    std::fs::create_dir_all(&cut).unwrap();
    std::fs::copy(
        out.join("checkpoint-2/rng_state.pth"),
        cut.join("rng_state.pth"),
    )
    .unwrap();
    let o = d.ok(&["merge", "trainer_out", "--format", "hf", "-o", "hf"]);
    let want = full_tensors(&fixtures().join("hf_models/llama/model.safetensors"));
    assert_same_tensors(
        &full_tensors(&d.path("hf/model.safetensors")),
        &want,
        "hf export",
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.path("hf/config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "llama");
    let i = d.ok(&["inspect", "trainer_out"]);
    assert!(
        i.stdout.contains("Hugging Face Trainer save")
            && i.stdout.contains("checkpoint-2")
            && i.stdout.contains("the highest complete step")
            && i.stdout.contains("step 3 skipped")
            && i.stdout.contains("config.json (kept by the trainer)"),
        "{}",
        i.stdout
    );
    // Plain merge: the model's tensors only, none of the side files'.
    d.ok(&["merge", "trainer_out", "-o", "plain"]);
    assert_same_tensors(&full_tensors(&d.path("plain")), &want, "plain merge");
    let _ = o;
}

#[test]
fn hf_trainer_steps_are_chosen_with_step_and_refused_by_name() {
    let d = Dir::new();
    let out = hf_trainer_out(&d, &[1, 2]);
    d.ok(&["merge", "trainer_out", "--step", "1", "-o", "one"]);
    d.ok(&[
        "merge",
        "trainer_out/checkpoint-1",
        "--step",
        "1",
        "-o",
        "one-again",
    ]);
    let o = d.fails(&["merge", "trainer_out", "--step", "5", "-o", "five"]);
    assert!(o.stderr.contains("steps here: 1, 2"), "{}", o.stderr);
    assert!(!d.path("five").exists());
    let o = d.fails(&[
        "merge",
        "trainer_out/checkpoint-2",
        "--step",
        "1",
        "-o",
        "x",
    ]);
    assert!(o.stderr.contains("step 2"), "{}", o.stderr);
    // No step complete: every one named with why.
    for s in [1, 2] {
        std::fs::remove_file(out.join(format!("checkpoint-{s}/model.safetensors"))).unwrap();
    }
    let o = d.fails(&["merge", "trainer_out", "-o", "none"]);
    assert!(
        o.stderr.contains("none complete") && o.stderr.contains("step 2 skipped"),
        "{}",
        o.stderr
    );
    assert!(!d.path("none").exists());
}

#[test]
fn a_trainers_save_is_found_below_the_directory_given() {
    let d = Dir::new();
    hf_trainer_out(&d, &[4]);
    let runs = d.path("runs/llama");
    std::fs::create_dir_all(&runs).unwrap();
    std::fs::rename(d.path("trainer_out"), runs.join("trainer_out")).unwrap();
    let o = d.ok(&["inspect", "runs"]);
    assert!(o.stdout.contains("found below"), "{}", o.stdout);
    // Two runs below: which one is meant is the user's to say.
    copy_dir(&runs.join("trainer_out"), &d.path("runs/other/trainer_out"));
    let o = d.fails(&["merge", "runs", "-o", "x"]);
    assert!(o.stderr.contains("in 2 places"), "{}", o.stderr);
}

/// megatron-core's `dist_checkpointing.save` without Megatron-LM's args (common.pt holds
/// `{}`: Megatron-Bridge, NeMo 2, a user's own loop; tests/fixtures/*/dist_ckpt_noargs,
/// the same weights as the fixtures' dist_ckpt, scripts/fixtures/hf_megatron.py and
/// moe_hf.py): `--format hf --hf-config` gives every tensor of the export of the same
/// model from its Megatron-LM save, byte for byte.
#[test]
fn megatron_core_dist_ckpt_without_args_exports_with_its_config() {
    let d = Dir::new();
    for (family, root) in [
        ("llama", "hf/llama"),
        ("qwen2", "hf/qwen2"),
        ("mixtral", "moe/hf/mixtral"),
    ] {
        let fx = fixtures().join(root);
        let with_args = d.path(&format!("{family}-args"));
        d.ok(&[
            "merge",
            fx.join("dist_ckpt").to_str().unwrap(),
            "--format",
            "hf",
            "-o",
            with_args.to_str().unwrap(),
        ]);
        let config = with_args.join("config.json");
        let noargs = fx.join("dist_ckpt_noargs");
        let out = d.path(&format!("{family}-noargs"));
        let o = d.ok(&[
            "merge",
            noargs.to_str().unwrap(),
            "--format",
            "hf",
            "--hf-config",
            config.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(
            o.stdout.contains("no Megatron-LM args") || o.stderr.contains("no Megatron-LM args"),
            "{family}: {}{}",
            o.stdout,
            o.stderr
        );
        assert_same_tensors(
            &full_tensors(&out.join("model.safetensors")),
            &full_tensors(&with_args.join("model.safetensors")),
            family,
        );
        // Without a config the sizes are unknown: the flag that settles it is named.
        let o = d.fails(&[
            "merge",
            noargs.to_str().unwrap(),
            "--format",
            "hf",
            "-o",
            "none",
        ]);
        assert!(o.stderr.contains("--hf-config"), "{family}: {}", o.stderr);
        assert!(!d.path("none").exists());
    }
}

/// A config that contradicts the tensors is refused, naming the tensor and both sizes.
#[test]
fn megatron_core_dist_ckpt_without_args_refuses_a_config_that_disagrees() {
    let d = Dir::new();
    let fx = fixtures().join("hf/llama");
    d.ok(&[
        "merge",
        fx.join("dist_ckpt").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "ref",
    ]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.path("ref/config.json")).unwrap()).unwrap();
    let noargs = fx.join("dist_ckpt_noargs");
    for (field, value, said) in [
        ("num_attention_heads", 8, "linear_qkv.weight"),
        ("hidden_size", 64, "embedding.word_embeddings.weight"),
        ("num_hidden_layers", 2, "decoder.layers.2"),
        ("vocab_size", 1000, "fewer than the vocabulary of 1000"),
    ] {
        let mut c = config.clone();
        c[field] = serde_json::json!(value);
        if field == "num_attention_heads" {
            c["head_dim"] = serde_json::json!(4);
        }
        std::fs::write(d.path("bad.json"), c.to_string()).unwrap();
        let o = d.fails(&[
            "merge",
            noargs.to_str().unwrap(),
            "--format",
            "hf",
            "--hf-config",
            "bad.json",
            "-o",
            "bad",
        ]);
        assert!(o.stderr.contains(said), "{field}: {}", o.stderr);
        assert!(!d.path("bad").exists(), "{field}: nothing written");
    }
}

/// A save written by a trainer's own code on CPU (tests/fixtures/trainers/<fixture>,
/// each with a README naming versions, files and the functions that wrote them).
struct TrainerCase {
    trainer: &'static str,
    /// The versions that wrote it (the fixture's README).
    versions: &'static str,
    fixture: &'static str,
    /// The output directory as the trainer leaves it.
    output: &'static str,
    /// The step directory ckpt must choose.
    step: &'static str,
    /// The model's config, where the trainer keeps none (relative to the fixture).
    config: Option<&'static str>,
    /// The library's own Hugging Face state dict of the model at that step.
    expected: &'static str,
    /// Who made `expected`.
    anchor: &'static str,
    /// What plain `merge` (every tensor, optimizer state included) says, where it is
    /// refused: a part of its error.
    plain_refused: Option<&'static str>,
    /// The way back: how a Hugging Face model becomes what this trainer starts from.
    import_back: &'static str,
}

const LLAMA_CONFIG: &str = "../../hf_models/llama/config.json";
const MIXTRAL_CONFIG: &str = "../../moe/hf/mixtral/hf/config.json";
const QWEN3_MOE_CONFIG: &str = "../../moe/hf/qwen3_moe/hf/config.json";
/// verl 0.9 keeps no Hugging Face config beside a `model/dist_ckpt/` save: the one the
/// 0.4.1-0.8 layout kept for the same model.
const VERL_MEGATRON_CONFIG: &str = "verl_out/global_step_2/actor/huggingface/config.json";

const TRAINER_CASES: [TrainerCase; 13] = [
    TrainerCase {
        trainer: "Hugging Face Trainer + accelerate FSDP2 (SHARDED_STATE_DICT)",
        versions: "transformers 5.25.0, accelerate 1.16.0, torch 2.15.0",
        fixture: "hf_trainer_fsdp",
        output: "trainer_out",
        step: "checkpoint-2",
        config: Some(LLAMA_CONFIG),
        expected: "expected.safetensors",
        anchor: "accelerate's `merge_fsdp_weights`",
        plain_refused: None,
        import_back: "none needed: the Trainer starts from the Hugging Face model (`from_pretrained`)",
    },
    TrainerCase {
        trainer: "Hugging Face Trainer + accelerate FSDP2, a mixture of experts (Mixtral; transformers' fused experts)",
        versions: "transformers 5.25.0, accelerate 1.16.0, torch 2.15.0",
        fixture: "hf_trainer_fsdp_moe",
        output: "trainer_out",
        step: "checkpoint-2",
        config: Some(MIXTRAL_CONFIG),
        expected: "expected.safetensors",
        anchor: "accelerate's `merge_fsdp_weights`, written by `save_pretrained` (per-expert names)",
        plain_refused: None,
        import_back: "none needed: the Trainer starts from the Hugging Face model (`from_pretrained`)",
    },
    TrainerCase {
        trainer: "Hugging Face Trainer + accelerate FSDP2, a mixture of experts (Qwen3-MoE; transformers' fused experts)",
        versions: "transformers 5.25.0, accelerate 1.16.0, torch 2.15.0",
        fixture: "hf_trainer_fsdp_qwen3_moe",
        output: "trainer_out",
        step: "checkpoint-2",
        config: Some(QWEN3_MOE_CONFIG),
        expected: "expected.safetensors",
        anchor: "accelerate's `merge_fsdp_weights`, written by `save_pretrained` (per-expert names)",
        plain_refused: None,
        import_back: "none needed: the Trainer starts from the Hugging Face model (`from_pretrained`)",
    },
    TrainerCase {
        trainer: "Hugging Face Trainer (no FSDP)",
        versions: "transformers 5.25.0, torch 2.15.0",
        fixture: "hf_trainer_plain",
        output: "trainer_out",
        step: "checkpoint-2",
        config: None,
        expected: "expected.safetensors",
        anchor: "`from_pretrained(checkpoint-2)`",
        plain_refused: None,
        import_back: "none needed: the Trainer starts from the Hugging Face model (`from_pretrained`)",
    },
    TrainerCase {
        trainer: "Lightning FSDPStrategy (sharded)",
        versions: "lightning 2.6.6, torch 2.15.0",
        fixture: "lightning_fsdp",
        output: "lightning_out",
        step: "step=2",
        config: Some(LLAMA_CONFIG),
        expected: "expected.safetensors",
        anchor: "Lightning's own consolidation",
        plain_refused: None,
        import_back: "none needed: the LightningModule loads the Hugging Face model itself",
    },
    TrainerCase {
        trainer: "Lightning DeepSpeedStrategy (ZeRO stage 2)",
        versions: "lightning 2.6.6, deepspeed 0.19.8, torch 2.15.0",
        fixture: "lightning_deepspeed",
        output: "lightning_out",
        step: "step=2",
        config: Some(LLAMA_CONFIG),
        expected: "expected.safetensors",
        anchor: "Lightning's `convert_zero_checkpoint_to_fp32_state_dict`",
        plain_refused: None,
        import_back: "none needed: the LightningModule loads the Hugging Face model itself",
    },
    TrainerCase {
        trainer: "verl FSDP checkpoint manager",
        versions: "verl 0.9.1, transformers 5.10.4, torch 2.15.0",
        fixture: "verl_fsdp",
        output: "verl_out",
        step: "global_step_2",
        config: None,
        expected: "expected.safetensors",
        anchor: "verl's `get_fsdp_full_state_dict`",
        plain_refused: None,
        import_back: "none needed: verl starts from the Hugging Face model (`actor_rollout_ref.model.path`)",
    },
    TrainerCase {
        trainer: "verl FSDP checkpoint manager, a LoRA run (peft; `lora_rank` 4, `lora_alpha` 12, all-linear): the PEFT-wrapped shards merged",
        versions: "verl 0.9.1, peft 0.22.0, transformers 5.10.4, torch 2.15.0",
        fixture: "verl_fsdp_lora",
        output: "verl_out",
        step: "global_step_1",
        config: None,
        expected: "expected.safetensors",
        anchor: "PEFT's `merge_and_unload()` of the trained model (fp32, gathered by verl's `get_fsdp_full_state_dict`)",
        plain_refused: None,
        import_back: "none needed: verl starts from the Hugging Face model (`actor_rollout_ref.model.path`)",
    },
    TrainerCase {
        trainer: "verl Megatron checkpoint manager, 0.4.1-0.8 layout (`actor/dist_ckpt/`; layout from its source, megatron-core wrote the files)",
        versions: "verl `b178a3cd` (0.8.0.dev, source), megatron-core 0.16.1, transformers 5.25.0",
        fixture: "verl_megatron",
        output: "verl_out",
        step: "global_step_2",
        config: None,
        expected: "../megatron_bridge/expected.safetensors",
        anchor: "the Megatron-LM save of the same weights (`tests/fixtures/hf/llama`), exported",
        plain_refused: Some("distributed optimizer's bucket layout"),
        import_back: "none needed: verl starts from the Hugging Face model (`actor_rollout_ref.model.path`)",
    },
    TrainerCase {
        trainer: "verl Megatron checkpoint manager, 0.9 layout (`actor/model/dist_ckpt/`, `use_dist_checkpointing`; layout from its source, megatron-core wrote the files)",
        versions: "verl 0.9.1 (source), megatron-core 0.16.1",
        fixture: "verl_megatron",
        output: "verl_v2_out",
        step: "global_step_2",
        config: Some(VERL_MEGATRON_CONFIG),
        expected: "../megatron_bridge/expected.safetensors",
        anchor: "the Megatron-LM save of the same weights (`tests/fixtures/hf/llama`), exported",
        plain_refused: None,
        import_back: "none needed: verl starts from the Hugging Face model (`actor_rollout_ref.model.path`)",
    },
    TrainerCase {
        trainer: "torchtitan CheckpointManager",
        versions: "torchtitan 0.3.0, torch 2.15.0",
        fixture: "torchtitan",
        output: "outputs",
        step: "step-2",
        config: Some("config.json"),
        expected: "adapter_to_hf.safetensors",
        anchor: "torchtitan's `Llama3StateDictAdapter.to_hf`",
        plain_refused: None,
        import_back: "`reshard HF --format torchtitan` (Llama; `initial_load_path`)",
    },
    TrainerCase {
        trainer: "Megatron-Bridge `save_checkpoint` (layout from its source; megatron-core wrote the files)",
        versions: "Megatron-Bridge v0.6.0 (source), megatron-core 0.16.1",
        fixture: "megatron_bridge",
        output: "nemo_experiments",
        step: "iter_0000002",
        config: None,
        expected: "expected.safetensors",
        anchor: "the Megatron-LM save of the same weights (`tests/fixtures/hf/llama`), exported",
        plain_refused: Some("distributed optimizer's bucket layout"),
        import_back: "`reshard HF --format megatron-bridge --mesh tp=..,pp=..[,ep=..,etp=..]` (Llama, Qwen2, Qwen3-MoE): `AutoBridge.import_ckpt`'s layout, `iter_0000000/`",
    },
    TrainerCase {
        trainer: "NeMo 2 `MegatronCheckpointIO` (layout from its source; megatron-core wrote the files)",
        versions: "NeMo 2.6.0rc0 (source), megatron-core 0.16.1",
        fixture: "nemo2",
        output: "nemo_experiments",
        step: "consumed_samples=4.0-last",
        config: None,
        expected: "expected.safetensors",
        anchor: "the Megatron-LM save of the same weights (`tests/fixtures/hf/llama`), exported",
        plain_refused: None,
        import_back: "`reshard HF --format nemo2 --mesh tp=..,pp=..` (Llama, Qwen2): `llm.import_ckpt`'s layout, `weights/` + `context/`",
    },
];

/// The output directory as each trainer leaves it, `--format hf` with no other flag
/// where the trainer kept the model's config (`--hf-config` where it did not), gives the
/// library's own Hugging Face state dict, byte for byte; plain merge reads the same step.
#[test]
fn trainers_saves_export_to_the_libraries_own_state_dicts() {
    let d = Dir::new();
    let root = fixtures().join("trainers");
    for c in &TRAINER_CASES {
        let fx = root.join(c.fixture);
        let out = d.path(&format!("{}-{}", c.fixture, c.output));
        let mut args = vec![
            "merge",
            c.output,
            "--format",
            "hf",
            "-o",
            out.to_str().unwrap(),
        ];
        if let Some(config) = c.config {
            args.extend(["--hf-config", config]);
        }
        let o = d.run_in(&fx, &args);
        assert_eq!(o.code, 0, "{}: {}{}", c.fixture, o.stdout, o.stderr);
        assert!(
            o.stderr.contains(c.step),
            "{}: the step said: {}",
            c.fixture,
            o.stderr
        );
        let want = full_tensors(&fx.join(c.expected));
        assert_same_tensors(
            &full_tensors(&out.join("model.safetensors")),
            &want,
            c.fixture,
        );
        // Plain merge: the same step's weights (in the trainer's names), nothing else.
        let plain = d.path(&format!("{}-{}-plain", c.fixture, c.output));
        let o = d.run_in(&fx, &["merge", c.output, "-o", plain.to_str().unwrap()]);
        match c.plain_refused {
            None => {
                assert_eq!(o.code, 0, "{}: {}", c.fixture, o.stderr);
                assert!(o.stderr.contains(c.step), "{}: {}", c.fixture, o.stderr);
                // (In the trainer's names: Megatron's layers stay stacked.)
                assert!(!full_tensors(&plain).is_empty(), "{}", c.fixture);
            }
            Some(why) => {
                assert_eq!(o.code, 1, "{}: {}", c.fixture, o.stderr);
                assert!(o.stderr.contains(why), "{}: {}", c.fixture, o.stderr);
                assert!(!plain.exists(), "{}", c.fixture);
            }
        }
        // Without the config a trainer did not keep, the flag is named.
        if c.config.is_some() {
            let none = d.path("none");
            let o = d.run_in(
                &fx,
                &[
                    "merge",
                    c.output,
                    "--format",
                    "hf",
                    "-o",
                    none.to_str().unwrap(),
                ],
            );
            assert_eq!(o.code, 1, "{}: {}", c.fixture, o.stderr);
            assert!(
                o.stderr.contains("--hf-config"),
                "{}: {}",
                c.fixture,
                o.stderr
            );
            assert!(!none.exists());
        }
    }
}

/// A config edited from `from` (a fixture's `config.json`) by replacing `was` with `is`.
fn edited_config(d: &Dir, from: &str, name: &str, was: &str, is: &str) -> PathBuf {
    let text = std::fs::read_to_string(fixtures().join(from)).unwrap();
    assert!(text.contains(was), "{from}: no `{was}`");
    let p = d.path(name);
    std::fs::write(&p, text.replace(was, is)).unwrap();
    p
}

/// The HF Trainer's FSDP2 save of a Mixtral (transformers' fused experts in the DCP):
/// a config that contradicts the stacked experts, or the rows of any projection, is
/// refused naming the tensor and both sizes; a step cut off before its DCP's
/// `.metadata` is skipped, said; nothing is written on a refusal.
#[test]
fn hf_trainer_moe_save_refuses_what_contradicts_its_experts() {
    let d = Dir::new();
    let out = d.path("trainer_out");
    copy_dir(
        &fixtures().join("trainers/hf_trainer_fsdp_moe/trainer_out"),
        &out,
    );
    let mixtral = "moe/hf/mixtral/hf/config.json";
    for (name, was, is, tensor, said) in [
        (
            "experts8.json",
            "\"num_local_experts\": 4",
            "\"num_local_experts\": 8",
            "model.model.layers.0.mlp.experts.gate_up_proj",
            "is [4, 32, 16], but 8 experts of FFN 16 and hidden 16 make [8, 32, 16]",
        ),
        (
            "ffn8.json",
            "\"intermediate_size\": 16",
            "\"intermediate_size\": 8",
            "model.model.layers.0.mlp.experts.gate_up_proj",
            "is [4, 32, 16], but 4 experts of FFN 8 and hidden 16 make [4, 16, 16]",
        ),
        (
            "kv4.json",
            "\"num_key_value_heads\": 2",
            "\"num_key_value_heads\": 4",
            "model.layers.0.self_attn.k_proj.weight",
            "has 8 rows, but",
        ),
    ] {
        let config = edited_config(&d, mixtral, name, was, is);
        let o = d.fails(&[
            "merge",
            "trainer_out",
            "--format",
            "hf",
            "--hf-config",
            config.to_str().unwrap(),
            "-o",
            "hf",
        ]);
        assert!(
            o.stderr.contains(tensor) && o.stderr.contains(said),
            "{name}: {}",
            o.stderr
        );
        assert!(!d.path("hf").exists(), "{name}: nothing written");
    }
    // A third step whose model DCP was cut off before its .metadata: step 2 is read.
    let cut = out.join("checkpoint-3");
    copy_dir(&out.join("checkpoint-2"), &cut);
    std::fs::remove_file(cut.join("pytorch_model_fsdp_0/.metadata")).unwrap();
    let config = fixtures().join(mixtral);
    let o = d.ok(&[
        "merge",
        "trainer_out",
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        "hf",
    ]);
    assert!(
        o.stderr.contains("checkpoint-2") && o.stderr.contains("step 3 skipped"),
        "{}",
        o.stderr
    );
    assert_same_tensors(
        &full_tensors(&d.path("hf/model.safetensors")),
        &full_tensors(&fixtures().join("trainers/hf_trainer_fsdp_moe/expected.safetensors")),
        "fused experts",
    );
}

/// Lightning's DeepSpeed strategy: a step without the `latest` DeepSpeed writes last is
/// skipped (and refused when asked for), a `latest` naming no tag directory and a
/// missing rank's ZeRO partition are refused by name, as is a config that contradicts
/// the tensors; nothing is written on a refusal.
#[test]
fn lightning_deepspeed_save_refuses_half_written_steps_by_name() {
    let d = Dir::new();
    copy_dir(
        &fixtures().join("trainers/lightning_deepspeed/lightning_out"),
        &d.path("lightning_out"),
    );
    let steps = d.path("lightning_out/lightning_logs/version_0/checkpoints");
    let llama = fixtures().join("hf_models/llama/config.json");
    let llama = llama.to_str().unwrap();
    let export = |o: &'static str| {
        [
            "merge",
            "lightning_out",
            "--format",
            "hf",
            "--hf-config",
            llama,
            "-o",
            o,
        ]
    };
    // Step 3 cut off before `latest`.
    let cut = steps.join("epoch=0-step=3.ckpt");
    copy_dir(&steps.join("epoch=0-step=2.ckpt"), &cut);
    std::fs::remove_file(cut.join("latest")).unwrap();
    let o = d.ok(&export("hf"));
    assert!(
        o.stderr.contains("epoch=0-step=2.ckpt") && o.stderr.contains("step 3 skipped"),
        "{}",
        o.stderr
    );
    assert_same_tensors(
        &full_tensors(&d.path("hf/model.safetensors")),
        &full_tensors(&fixtures().join("trainers/lightning_deepspeed/expected.safetensors")),
        "lightning deepspeed",
    );
    let o = d.fails(&["merge", "lightning_out", "--step", "3", "-o", "three"]);
    assert!(
        o.stderr.contains("step 3 (--step) is incomplete"),
        "{}",
        o.stderr
    );
    assert!(!d.path("three").exists());
    // A config that contradicts the tensors.
    let config = edited_config(
        &d,
        "hf_models/llama/config.json",
        "ffn48.json",
        "\"intermediate_size\": 64",
        "\"intermediate_size\": 48",
    );
    let o = d.fails(&[
        "merge",
        "lightning_out",
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        "ffn",
    ]);
    assert!(
        o.stderr.contains("model.layers.0.mlp.gate_proj.weight")
            && o.stderr.contains("has 64 rows")
            && o.stderr.contains("48"),
        "{}",
        o.stderr
    );
    assert!(!d.path("ffn").exists());
    // `latest` naming a tag that is not there: that step skipped, said; asked for, refused.
    std::fs::write(cut.join("latest"), "global_step3").unwrap();
    let o = d.ok(&export("tag"));
    assert!(
        o.stderr.contains("step 3 skipped")
            && o.stderr
                .contains("names `global_step3`, which is not a DeepSpeed tag directory"),
        "{}",
        o.stderr
    );
    let o = d.fails(&["merge", "lightning_out", "--step", "3", "-o", "tag3"]);
    assert!(
        o.stderr
            .contains("names `global_step3`, which is not a DeepSpeed tag directory"),
        "{}",
        o.stderr
    );
    assert!(!d.path("tag3").exists());
    // A rank's ZeRO partition missing from the step read.
    std::fs::remove_dir_all(&cut).unwrap();
    std::fs::remove_file(
        steps.join("epoch=0-step=2.ckpt/checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    )
    .unwrap();
    let o = d.fails(&export("rank"));
    assert!(
        o.stderr
            .contains("zero_pp_rank_1_mp_rank_00_optim_states.pt")
            && o.stderr.contains("rank 1 of 2 is missing"),
        "{}",
        o.stderr
    );
    assert!(!d.path("rank").exists());
}

/// docs/trainers.md's table of what is proven is this file's cases, so that it cannot
/// go stale: a case added, removed or changed here changes the table there.
#[test]
fn the_docs_table_of_trainers_is_the_tests_cases() {
    let mut table = String::from(
        "| trainer | versions | fixture | output directory given | step read | `--format hf` flags | equal to | plain `merge` | import back |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in &TRAINER_CASES {
        table.push_str(&format!(
            "| {} | {} | `tests/fixtures/trainers/{}` | `{}/` | `{}` | {} | {} | {} | {} |\n",
            c.trainer,
            c.versions,
            c.fixture,
            c.output,
            c.step,
            match (c.config, c.fixture) {
                (Some(_), _) => "`--hf-config` (no Hugging Face config kept)",
                (None, "megatron_bridge") => "none (`run_config.yaml`'s sizes)",
                (None, "nemo2") =>
                    "none (`model.yaml`'s sizes; the vocabulary its NullTokenizer's, 49 + 1)",
                (None, _) => "none",
            },
            c.anchor,
            c.plain_refused
                .map_or("the same step".to_string(), |why| format!(
                    "refused: {why} (no args)"
                )),
            c.import_back
        ));
    }
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/trainers.md"))
            .unwrap();
    assert!(
        doc.contains(&table),
        "docs/trainers.md must hold this table (generated from tests/trainers.rs's TRAINER_CASES) as it is:\n\n{table}"
    );
}

/// verl keeps the model's config and tokenizer in `actor/huggingface/`: both come along;
/// its tracker names the step; the actor's directory and the step directory given
/// directly read the same.
#[test]
fn verl_save_carries_its_config_and_tokenizer() {
    let d = Dir::new();
    let fx = fixtures().join("trainers/verl_fsdp/verl_out");
    d.ok(&["merge", fx.to_str().unwrap(), "--format", "hf", "-o", "a"]);
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(d.path("a").join(f)).unwrap(),
            std::fs::read(fx.join("global_step_2/actor/huggingface").join(f)).unwrap(),
            "{f}"
        );
    }
    d.ok(&[
        "merge",
        fx.join("global_step_2/actor").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "b",
    ]);
    assert_same_tensors(
        &full_tensors(&d.path("b/model.safetensors")),
        &full_tensors(&d.path("a/model.safetensors")),
        "actor dir",
    );
    // A tracker naming a step that is not there is refused: the trainer would not resume.
    let copy = d.path("verl_out");
    copy_dir(&fx, &copy);
    std::fs::write(copy.join("latest_checkpointed_iteration.txt"), "3").unwrap();
    let o = d.fails(&["merge", "verl_out", "--format", "hf", "-o", "c"]);
    assert!(
        o.stderr.contains("step 3") && o.stderr.contains("steps here: 1, 2"),
        "{}",
        o.stderr
    );
    // A rank's model shard missing: named.
    std::fs::write(copy.join("latest_checkpointed_iteration.txt"), "2").unwrap();
    std::fs::remove_file(copy.join("global_step_2/actor/model_world_size_2_rank_1.pt")).unwrap();
    let o = d.fails(&["merge", "verl_out", "-o", "c"]);
    assert!(
        o.stderr.contains("model_world_size_2_rank_1.pt"),
        "{}",
        o.stderr
    );
    assert!(!d.path("c").exists());
}

/// verl's LoRA run (issue 45): the shards hold the PEFT-wrapped model and
/// `lora_train_meta.json` its rank and alpha. `inspect` says so; `--format hf` merges
/// the adapters with that scale (the bytes of PEFT's `merge_and_unload`: the table's
/// case above); a scale nobody recorded, and a save of the LoRA parameters alone, are
/// refused by name with nothing written.
#[test]
fn verl_lora_save_is_merged_with_its_recorded_alpha_or_refused() {
    let d = Dir::new();
    let fx = fixtures().join("trainers/verl_fsdp_lora");
    let o = d.ok(&["inspect", fx.join("verl_out").to_str().unwrap()]);
    let said = format!("{}{}", o.stdout, o.stderr);
    assert!(
        said.contains("verl save")
            && said.contains("global_step_1")
            && said.contains("lora_train_meta.json: a LoRA run (r 4, lora_alpha 12)")
            && said.contains("PEFT-wrapped model's")
            && said
                .contains("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"),
        "{said}"
    );
    let o = d.ok(&[
        "merge",
        fx.join("verl_out").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "a",
    ]);
    // 4 layers x 7 linear layers (all-linear; lm_head is left out by PEFT).
    assert!(
        o.stderr
            .contains("LoRA adapters merged into 28 weights (r 4, lora_alpha 12"),
        "{}",
        o.stderr
    );
    let want = full_tensors(&fx.join("expected.safetensors"));
    let got = full_tensors(&d.path("a/model.safetensors"));
    assert_same_tensors(&got, &want, "verl LoRA");
    assert!(d.path("a/config.json").is_file() && d.path("a/tokenizer.json").is_file());

    // No record of the alpha: refused, naming the file and the flag; with the flag, the
    // same bytes (the rank read from the adapters' shapes).
    let copy = d.path("verl_out");
    copy_dir(&fx.join("verl_out"), &copy);
    let meta = copy.join("global_step_1/actor/lora_train_meta.json");
    std::fs::remove_file(&meta).unwrap();
    let o = d.fails(&["merge", "verl_out", "--format", "hf", "-o", "b"]);
    assert!(
        o.stderr.contains("lora_train_meta.json: missing") && o.stderr.contains("--lora-alpha"),
        "{}",
        o.stderr
    );
    assert!(!d.path("b").exists());
    d.ok(&[
        "merge",
        "verl_out",
        "--format",
        "hf",
        "--lora-alpha",
        "12",
        "-o",
        "b",
    ]);
    assert_same_tensors(
        &full_tensors(&d.path("b/model.safetensors")),
        &want,
        "--lora-alpha",
    );
    // A record of alpha 0 (what verl's own merger falls back to): refused likewise.
    std::fs::write(
        &meta,
        r#"{"r": 4, "lora_alpha": 0, "task_type": "CAUSAL_LM"}"#,
    )
    .unwrap();
    let o = d.fails(&["merge", "verl_out", "--format", "hf", "-o", "c"]);
    assert!(
        o.stderr.contains("lora_alpha is 0") && o.stderr.contains("--lora-alpha"),
        "{}",
        o.stderr
    );
    assert!(!d.path("c").exists());
    // A record that says another rank than the adapters have: the merge names the misfit.
    std::fs::write(
        &meta,
        r#"{"r": 8, "lora_alpha": 12, "task_type": "CAUSAL_LM"}"#,
    )
    .unwrap();
    let o = d.fails(&["merge", "verl_out", "--format", "hf", "-o", "c"]);
    assert!(o.stderr.contains("r = 8"), "{}", o.stderr);
    assert!(!d.path("c").exists());

    // save_lora_only: the shards hold no base weights; refused, naming why.
    let o = d.fails(&[
        "merge",
        fx.join("verl_lora_only").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "e",
    ]);
    assert!(
        o.stderr.contains("only the LoRA parameters")
            && o.stderr.contains("save_lora_only")
            && o.stderr.contains("the base model is needed"),
        "{}",
        o.stderr
    );
    assert!(!d.path("e").exists());
}

/// verl's Megatron backend (issue 45): the output directory gives the step its tracker
/// names, the actor's dist_ckpt with `huggingface/`'s config and tokenizer carried; the
/// trainer, step and config are named; what is incomplete or ambiguous is refused by
/// name with nothing written.
#[test]
fn verl_megatron_save_is_read_as_verl_lays_it_out() {
    let d = Dir::new();
    let fx = fixtures().join("trainers/verl_megatron");
    let hf = fx.join("verl_out/global_step_2/actor/huggingface");
    let o = d.ok(&[
        "merge",
        fx.join("verl_out").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "a",
    ]);
    assert!(
        o.stderr.contains("verl (Megatron backend) save")
            && o.stderr.contains("step 2, named by")
            && o.stderr
                .contains("huggingface/config.json (kept by the trainer)")
            && o.stderr
                .contains("distributed optimizer's 12 bucket entries are not read"),
        "{}",
        o.stderr
    );
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(d.path("a").join(f)).unwrap(),
            std::fs::read(hf.join(f)).unwrap(),
            "{f}"
        );
    }
    // The actor's directory and the step directory read the same; `inspect` names it.
    for (name, p) in [
        ("b", fx.join("verl_out/global_step_2/actor")),
        ("c", fx.join("verl_out/global_step_2")),
    ] {
        d.ok(&["merge", p.to_str().unwrap(), "--format", "hf", "-o", name]);
        assert_same_tensors(
            &full_tensors(&d.path(name).join("model.safetensors")),
            &full_tensors(&d.path("a/model.safetensors")),
            name,
        );
    }
    let o = d.ok(&["inspect", fx.join("verl_v2_out").to_str().unwrap()]);
    let said = format!("{}{}", o.stdout, o.stderr);
    assert!(
        said.contains("verl (Megatron backend) save")
            && said.contains("step 2")
            && said.contains("verl 0.9 layout")
            && said.contains("optimizer: not read"),
        "{said}"
    );
    // A dist_ckpt whose metadata.json (megatron-core writes it last) is missing.
    let copy = d.path("verl_out");
    copy_dir(&fx.join("verl_out"), &copy);
    std::fs::remove_file(copy.join("global_step_2/actor/dist_ckpt/metadata.json")).unwrap();
    let o = d.fails(&["merge", "verl_out", "--format", "hf", "-o", "x"]);
    assert!(
        o.stderr.contains("dist_ckpt") && o.stderr.contains("no metadata.json"),
        "{}",
        o.stderr
    );
    // Without a tracker, that step is skipped as incomplete and none is left.
    std::fs::remove_file(copy.join("latest_checkpointed_iteration.txt")).unwrap();
    let o = d.fails(&["merge", "verl_out", "--format", "hf", "-o", "x"]);
    assert!(
        o.stderr.contains("step 2 skipped") && o.stderr.contains("no metadata.json"),
        "{}",
        o.stderr
    );
    // verl 0.9's layout cut off before its manifest.
    let v2 = d.path("verl_v2_out");
    copy_dir(&fx.join("verl_v2_out"), &v2);
    let actor2 = v2.join("global_step_2/actor");
    std::fs::remove_file(actor2.join("ckpt_contents.json")).unwrap();
    let o = d.fails(&["merge", "verl_v2_out", "--format", "hf", "-o", "x"]);
    assert!(o.stderr.contains("no ckpt_contents.json"), "{}", o.stderr);
    // Both layouts in one actor directory: which dist_ckpt is meant is not guessed.
    std::fs::copy(
        fx.join("verl_v2_out/global_step_2/actor/ckpt_contents.json"),
        actor2.join("ckpt_contents.json"),
    )
    .unwrap();
    copy_dir(
        &fx.join("verl_out/global_step_2/actor/dist_ckpt"),
        &actor2.join("dist_ckpt"),
    );
    let o = d.fails(&["merge", "verl_v2_out", "-o", "x"]);
    assert!(
        o.stderr.contains("holds both") && o.stderr.contains("model/"),
        "{}",
        o.stderr
    );
    // DCP's .metadata without the common.pt megatron-core writes first and the
    // metadata.json it writes last: no megatron-core save cut off but verl's
    // Megatron-FSDP layout (DTensors), refused by name rather than called incomplete.
    let fsdp = d.path("verl_fsdp_out");
    copy_dir(&fx.join("verl_out"), &fsdp);
    let dist = fsdp.join("global_step_2/actor/dist_ckpt");
    for f in ["metadata.json", "common.pt"] {
        std::fs::remove_file(dist.join(f)).unwrap();
    }
    let o = d.fails(&["merge", "verl_fsdp_out", "--format", "hf", "-o", "x"]);
    assert!(
        o.stderr.contains("Megatron-FSDP")
            && o.stderr.contains("use_megatron_fsdp")
            && !o.stderr.contains("incomplete"),
        "{}",
        o.stderr
    );
    assert!(!d.path("x").exists());
}

/// A trainer's record of the model that contradicts the tensors is refused, naming the
/// tensor; nothing is written.
#[test]
fn a_bridge_record_that_disagrees_with_the_tensors_is_refused() {
    let d = Dir::new();
    let save = d.path("save");
    copy_dir(
        &fixtures().join("trainers/megatron_bridge/nemo_experiments"),
        &save,
    );
    let yaml = save.join("default/checkpoints/iter_0000002/run_config.yaml");
    let text = std::fs::read_to_string(&yaml).unwrap();
    assert!(
        text.contains("  num_attention_heads: 4\n"),
        "the fixture's record"
    );
    std::fs::write(
        &yaml,
        text.replace("  num_attention_heads: 4\n", "  num_attention_heads: 8\n"),
    )
    .unwrap();
    let o = d.fails(&["merge", "save", "--format", "hf", "-o", "out"]);
    assert!(o.stderr.contains("linear_qkv.weight"), "{}", o.stderr);
    assert!(!d.path("out").exists());
}

/// The same save exports to the same bytes on 1 and 4 threads (a wrapper's prefix
/// removed, layers unstacked under NeMo's prefix, the optimizer's buckets left out).
#[test]
fn trainer_exports_are_the_same_bytes_on_1_and_4_threads() {
    let d = Dir::new();
    let root = fixtures().join("trainers");
    let llama = fixtures().join("hf_models/llama/config.json");
    let nemo = root.join("nemo2/hf_config.json");
    for (name, src, config) in [
        ("fsdp", root.join("hf_trainer_fsdp/trainer_out"), llama),
        ("nemo", root.join("nemo2/nemo_experiments"), nemo),
    ] {
        let mut outs = vec![];
        for threads in [1, 4] {
            let out = d.path(&format!("{name}-{threads}"));
            d.ok_with_threads(
                &[
                    "merge",
                    src.to_str().unwrap(),
                    "--format",
                    "hf",
                    "--hf-config",
                    config.to_str().unwrap(),
                    "-o",
                    out.to_str().unwrap(),
                ],
                threads,
            );
            outs.push(std::fs::read(out.join("model.safetensors")).unwrap());
        }
        assert!(outs[0] == outs[1], "{name}: 1 and 4 threads differ");
    }
}

/// The tiny Llama of tests/fixtures/hf_models (transformers' own save_pretrained) alone
/// in `d`'s `name/`, with a config edited by `edit`.
fn hf_llama(d: &Dir, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    hf_model(d, "llama", name, edit)
}

/// [`hf_llama`] of the tests/fixtures/hf_models model `family`.
fn hf_model(
    d: &Dir,
    family: &str,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let src = fixtures().join("hf_models").join(family);
    let model = d.path(name);
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(model.join("config.json"), c.to_string()).unwrap();
    model
}

/// Issue 45, the way back: a Hugging Face Llama (and a Qwen2) written as Megatron-Bridge's
/// `AutoBridge.import_ckpt` saves it (`iter_0000000/` with `run_config.yaml` and
/// `train_state.pt`, both trackers) is read back as a Megatron-Bridge save (inspect says
/// so, with the step and the record) and exports to the same bytes, with no flag.
#[test]
fn hugging_face_llama_into_megatron_bridge_and_back() {
    let d = Dir::new();
    for (family, mesh) in [
        ("llama", "tp=2,pp=2"),
        ("llama", "tp=1,pp=1"),
        ("llama", "tp=2,pp=1"),
        ("qwen2", "tp=2,pp=2"),
    ] {
        let model = hf_model(&d, family, family, |_| {});
        let want = full_tensors(&model);
        let out = d.path(&format!("bridge-{family}-{mesh}"));
        d.ok(&[
            "reshard",
            model.to_str().unwrap(),
            "--format",
            "megatron-bridge",
            "--mesh",
            mesh,
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(
            std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
            "0"
        );
        let iter = out.join("iter_0000000");
        for f in [
            "run_config.yaml",
            "train_state.pt",
            "common.pt",
            "metadata.json",
            ".metadata",
            "__0_0.distcp",
        ] {
            assert!(iter.join(f).is_file(), "{mesh}: {f}");
        }
        assert_eq!(
            std::fs::read(out.join("latest_train_state.pt")).unwrap(),
            std::fs::read(iter.join("train_state.pt")).unwrap()
        );
        let yaml = std::fs::read_to_string(iter.join("run_config.yaml")).unwrap();
        let (tp, pp) = mesh.split_once(',').unwrap();
        for line in [
            format!("  tensor_model_parallel_size: {}\n", &tp[3..]),
            format!("  pipeline_model_parallel_size: {}\n", &pp[3..]),
            "  num_query_groups: 2\n".into(),
            "  vocab_size: 64\n".into(),
            "  normalization: RMSNorm\n".into(),
        ] {
            assert!(yaml.contains(&line), "{mesh}: {line:?} in\n{yaml}");
        }
        let i = d.ok(&["inspect", out.to_str().unwrap()]);
        let said = format!("{}{}", i.stdout, i.stderr);
        assert!(said.contains("Megatron-Bridge"), "{mesh}: {said}");
        assert!(said.contains("iter_0000000"), "{mesh}: {said}");
        assert!(said.contains("run_config.yaml"), "{mesh}: {said}");
        if family == "qwen2" {
            assert!(yaml.contains("  add_qkv_bias: true\n"), "{yaml}");
        }
        let back = d.path(&format!("back-{family}-{mesh}"));
        d.ok(&[
            "merge",
            out.to_str().unwrap(),
            "--format",
            "hf",
            "-o",
            back.to_str().unwrap(),
        ]);
        assert_eq!(full_tensors(&back), want, "{family} {mesh}");
    }
}

/// What Bridge's Llama import does not take is refused by the file and field that say
/// it, before anything is written: another family, a RoPE scaling Bridge's Llama does
/// not keep, a source that is already Megatron's.
#[test]
fn megatron_bridge_refusals_name_the_field_and_write_nothing() {
    let d = Dir::new();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 3] = [
        (
            "mistral",
            |c| c["architectures"] = serde_json::json!(["MistralForCausalLM"]),
            "`architectures` is \"MistralForCausalLM\"",
        ),
        (
            "yarn",
            |c| c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            "`rope_scaling` has type Some(\"yarn\")",
        ),
        (
            "gelu",
            |c| c["hidden_act"] = serde_json::json!("gelu"),
            "`hidden_act` is \"gelu\"",
        ),
    ];
    for (name, edit, said) in cases {
        let model = hf_llama(&d, name, edit);
        let out = d.path(&format!("{name}-out"));
        let o = d.fails(&[
            "reshard",
            model.to_str().unwrap(),
            "--format",
            "megatron-bridge",
            "--mesh",
            "tp=1,pp=1",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.stderr.contains(said), "{name}: {}", o.stderr);
        assert!(o.stderr.contains("config.json"), "{name}: {}", o.stderr);
        assert!(!out.exists(), "{name}: nothing written");
    }
    let legacy = fixtures().join("hf/llama/legacy");
    let o = d.fails(&[
        "reshard",
        legacy.to_str().unwrap(),
        "--format",
        "megatron-bridge",
        "--mesh",
        "tp=1,pp=1",
        "-o",
        "from-megatron",
    ]);
    assert!(o.stderr.contains("Megatron checkpoint"), "{}", o.stderr);
    assert!(!d.path("from-megatron").exists());
}

/// Issue 45, the way back for a mixture of experts: the Qwen3-MoE of
/// tests/fixtures/moe/hf (transformers' own save) written as Bridge v0.6.0's
/// `Qwen3MoEBridge` import saves it: the provider's MoE fields in `run_config.yaml`, the
/// experts stacked `[layers, experts, ...]` under the keys TEGroupedMLP shares with
/// SequentialMLP, `pre_mlp_layernorm` under its own name (Transformer Engine's MoE
/// layer); every source tensor back byte for byte through `merge --format hf`.
#[test]
fn hugging_face_qwen3_moe_into_megatron_bridge_and_back() {
    let d = Dir::new();
    let model = fixtures().join("moe/hf/qwen3_moe/hf");
    let want = full_tensors(&model);
    // (name, stacked shape): 2 layers, hidden 16, 4 heads of 8 in 2 groups, 4 experts of
    // FFN 16, vocabulary 64.
    let shapes: [(&str, &[u64]); 12] = [
        ("embedding.word_embeddings.weight", &[64, 16]),
        ("output_layer.weight", &[64, 16]),
        ("decoder.final_layernorm.weight", &[16]),
        (
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            &[2, 16],
        ),
        (
            "decoder.layers.self_attention.linear_qkv.weight",
            &[2, 64, 16],
        ),
        (
            "decoder.layers.self_attention.linear_proj.weight",
            &[2, 16, 32],
        ),
        ("decoder.layers.self_attention.q_layernorm.weight", &[2, 8]),
        ("decoder.layers.self_attention.k_layernorm.weight", &[2, 8]),
        ("decoder.layers.pre_mlp_layernorm.weight", &[2, 16]),
        ("decoder.layers.mlp.router.weight", &[2, 4, 16]),
        (
            "decoder.layers.mlp.experts.experts.linear_fc1.weight",
            &[2, 4, 32, 16],
        ),
        (
            "decoder.layers.mlp.experts.experts.linear_fc2.weight",
            &[2, 4, 16, 16],
        ),
    ];
    for (mesh, tp, pp, ep, etp) in [
        ("tp=1,pp=1,ep=2", 1, 1, 2, None),
        ("tp=2,pp=2", 2, 2, 1, None),
        ("tp=2,pp=1,ep=4,etp=1", 2, 1, 4, Some(1)),
    ] {
        let out = d.path(&format!("bridge-qwen3moe-{mesh}"));
        d.ok(&[
            "reshard",
            model.to_str().unwrap(),
            "--format",
            "megatron-bridge",
            "--mesh",
            mesh,
            "-o",
            out.to_str().unwrap(),
        ]);
        let iter = out.join("iter_0000000");
        for f in [
            "run_config.yaml",
            "train_state.pt",
            "common.pt",
            "metadata.json",
            ".metadata",
        ] {
            assert!(iter.join(f).is_file(), "{mesh}: {f}");
        }
        for r in 0..tp * pp {
            assert!(
                iter.join(format!("__{r}_0.distcp")).is_file(),
                "{mesh}: rank {r}"
            );
        }
        let ck = ckpt_core::Checkpoint::open(std::slice::from_ref(&iter)).expect("open");
        let got: std::collections::BTreeMap<&str, &[u64]> = ck
            .tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape.as_slice()))
            .collect();
        let expected: std::collections::BTreeMap<&str, &[u64]> = shapes.iter().copied().collect();
        assert_eq!(got, expected, "{mesh}: the dist_ckpt's keys and shapes");
        // Every expert's linear layers keep an `_extra_state` object per layer and expert.
        let keys = strings_with(&std::fs::read(iter.join(".metadata")).unwrap(), "decoder.");
        for m in ["linear_fc1", "linear_fc2"] {
            for (l, e) in [(0, 0), (1, 3)] {
                let k = format!(
                    "decoder.layers.mlp.experts.experts.{m}._extra_state/shard_{l}.{e}_2.4"
                );
                assert!(keys.contains(&k), "{mesh}: {k} in {keys:?}");
            }
        }
        let yaml = std::fs::read_to_string(iter.join("run_config.yaml")).unwrap();
        let mut lines = vec![
            format!("  tensor_model_parallel_size: {tp}\n"),
            format!("  pipeline_model_parallel_size: {pp}\n"),
            format!("  expert_model_parallel_size: {ep}\n"),
            "  num_moe_experts: 4\n".into(),
            "  moe_router_topk: 2\n".into(),
            "  moe_ffn_hidden_size: 16\n".into(),
            "  moe_grouped_gemm: true\n".into(),
            "  moe_router_load_balancing_type: aux_loss\n".into(),
            "  moe_aux_loss_coeff: 0.001\n".into(),
            // norm_topk_prob true
            "  moe_router_pre_softmax: false\n".into(),
            "  moe_token_dispatcher_type: alltoall\n".into(),
            "  moe_permute_fusion: true\n".into(),
            "  qk_layernorm: true\n".into(),
            "  add_qkv_bias: false\n".into(),
            "  kv_channels: 8\n".into(),
            "  num_query_groups: 2\n".into(),
            "  rotary_base: 1000000\n".into(),
            "  layernorm_epsilon: 1.0e-06\n".into(),
            "  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n".into(),
        ];
        if let Some(e) = etp {
            lines.push(format!("  expert_tensor_parallel_size: {e}\n"));
        } else {
            assert!(!yaml.contains("expert_tensor_parallel_size"), "{yaml}");
        }
        for line in lines {
            assert!(yaml.contains(&line), "{mesh}: {line:?} in\n{yaml}");
        }
        let i = d.ok(&["inspect", out.to_str().unwrap()]);
        let said = format!("{}{}", i.stdout, i.stderr);
        assert!(said.contains("Megatron-Bridge"), "{mesh}: {said}");
        let back = d.path(&format!("back-qwen3moe-{mesh}"));
        d.ok(&[
            "merge",
            out.to_str().unwrap(),
            "--format",
            "hf",
            "-o",
            back.to_str().unwrap(),
        ]);
        assert_eq!(full_tensors(&back), want, "qwen3_moe {mesh}");
    }
}

/// The mixtures of experts Bridge v0.6.0 has no bridge for (Mixtral, Qwen2-MoE), an EP
/// size that does not divide the experts, expert axes for a dense model, and a
/// Qwen3-MoE with dense layers are refused by name, exit 1, nothing written.
#[test]
fn megatron_bridge_moe_refusals_are_named_and_write_nothing() {
    let d = Dir::new();
    let moe = |f: &str| fixtures().join("moe/hf").join(f).join("hf");
    let dense = hf_llama(&d, "llama", |_| {});
    let mut sparse: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(moe("qwen3_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    sparse["mlp_only_layers"] = serde_json::json!([1]);
    let with_dense = d.path("qwen3moe-dense-layer");
    copy_dir(&moe("qwen3_moe"), &with_dense);
    std::fs::write(with_dense.join("config.json"), sparse.to_string()).unwrap();
    let cases: [(&str, PathBuf, &str, &str); 5] = [
        (
            "mixtral",
            moe("mixtral"),
            "tp=1,pp=1",
            "`architectures` is \"MixtralForCausalLM\", a mixture of experts Megatron-Bridge v0.6.0 registers no bridge for",
        ),
        (
            "qwen2moe",
            moe("qwen2_moe"),
            "tp=1,pp=1",
            "`architectures` is \"Qwen2MoeForCausalLM\", a mixture of experts Megatron-Bridge v0.6.0 registers no bridge for",
        ),
        (
            "ep3",
            moe("qwen3_moe"),
            "tp=1,pp=1,ep=3",
            "ep=3: the 4 experts (num_moe_experts) do not divide into 3 expert-parallel ranks",
        ),
        (
            "dense-ep",
            dense,
            "tp=1,pp=1,ep=2",
            "ep=2: the model has no experts",
        ),
        (
            "mlp-only",
            with_dense,
            "tp=1,pp=1",
            "`mlp_only_layers` is [1]: Bridge's Qwen3-MoE provider makes every layer a mixture of experts",
        ),
    ];
    for (name, model, mesh, said) in cases {
        let out = d.path(&format!("{name}-out"));
        let o = d.fails(&[
            "reshard",
            model.to_str().unwrap(),
            "--format",
            "megatron-bridge",
            "--mesh",
            mesh,
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.code, 1, "{name}: {}", o.stderr);
        assert!(o.stderr.contains(said), "{name}: {}", o.stderr);
        assert!(!out.exists(), "{name}: nothing written");
    }
    // NeMo 2's import of a mixture of experts is not written: refused by name too.
    let out = d.path("nemo2-qwen3moe");
    let o = d.fails(&[
        "reshard",
        moe("qwen3_moe").to_str().unwrap(),
        "--format",
        "nemo2",
        "--mesh",
        "tp=1,pp=1",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(
        o.stderr
            .contains("Qwen3MoeForCausalLM\", a mixture of experts"),
        "{}",
        o.stderr
    );
    assert!(!out.exists());
}

/// The committed NeMo 2 save (`scripts/fixtures/trainers_nemo2.py`): its `-last` step.
fn nemo2_fixture_step() -> PathBuf {
    fixtures().join("trainers/nemo2/nemo_experiments/default/checkpoints/default--reduced_train_loss=4.1851-epoch=0-consumed_samples=4.0-last")
}

/// The strings a pickle holds (`SHORT_BINUNICODE`, `BINUNICODE`) that start with
/// `prefix`: the keys of DCP's `.metadata` and of `common.pt`.
fn strings_with(bytes: &[u8], prefix: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for i in 0..bytes.len() {
        let (start, len) = match bytes[i] {
            0x8c if i + 1 < bytes.len() => (i + 2, usize::from(bytes[i + 1])),
            b'X' if i + 5 <= bytes.len() => {
                let n = u32::from_le_bytes(bytes[i + 1..i + 5].try_into().unwrap());
                (i + 5, n as usize)
            }
            _ => continue,
        };
        if let Some(Ok(s)) = bytes
            .get(start..start.saturating_add(len))
            .map(std::str::from_utf8)
        {
            if s.starts_with(prefix) {
                out.insert(s.to_string());
            }
        }
    }
    out
}

/// io.json's objects as (the class or type's module and name, the first path), in order.
fn io_objects(doc: &serde_json::Value) -> Vec<(String, String, String)> {
    doc["objects"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|o| {
            let path = o["paths"][0].as_str()?.to_string();
            let t = &o["type"];
            let (module, name) = if t["name"] == "Config" {
                // The class is the metadata's `fn_or_cls`.
                let meta = &doc["objects"][o["metadata"]["key"].as_str().unwrap()];
                let cls = &meta["items"][0][1];
                (cls["module"].as_str()?, cls["name"].as_str()?)
            } else {
                (t["module"].as_str()?, t["name"].as_str()?)
            };
            Some((module.to_string(), name.to_string(), path))
        })
        .collect()
}

/// Issue 45, the way back into NeMo 2: a Hugging Face Llama (and a Qwen2) written as
/// NeMo 2's `llm.import_ckpt` saves it (`weights/` under `module.`, `context/` with
/// fiddle's `io.json`, `model.yaml` and the tokenizer) has the committed NeMo 2
/// fixture's layout, is read back as a NeMo 2 save with no flag, and exports to the
/// same bytes.
#[test]
fn hugging_face_llama_into_nemo2_and_back() {
    let d = Dir::new();
    let fx = nemo2_fixture_step();
    let fx_yaml: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(fx.join("context/model.yaml")).unwrap())
            .unwrap();
    let fx_io: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("context/io.json")).unwrap())
            .unwrap();
    let fx_meta = std::fs::read(fx.join("weights/.metadata")).unwrap();
    let fx_common = std::fs::read(fx.join("weights/common.pt")).unwrap();
    let keys = |m: &serde_yaml::Value| -> Vec<String> {
        m.as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap().to_string())
            .collect()
    };
    for (family, mesh, tokenizer) in [
        ("llama", "tp=2,pp=2", true),
        ("llama", "tp=1,pp=1", false),
        ("qwen2", "tp=2,pp=1", true),
    ] {
        let model = hf_model(&d, family, &format!("{family}-{mesh}"), |_| {});
        if tokenizer {
            std::fs::write(
                model.join("tokenizer_config.json"),
                r#"{"model_max_length": 32}"#,
            )
            .unwrap();
            std::fs::write(model.join("tokenizer.json"), r#"{"version": "1.0"}"#).unwrap();
        }
        let want = full_tensors(&model);
        let out = d.path(&format!("nemo2-{family}-{mesh}"));
        d.ok(&[
            "reshard",
            model.to_str().unwrap(),
            "--format",
            "nemo2",
            "--mesh",
            mesh,
            "-o",
            out.to_str().unwrap(),
        ]);
        let at = format!("{family} {mesh}");
        // weights/: the fixture's side files, its keys all under `module.`.
        for f in ["common.pt", "metadata.json", ".metadata", "__0_0.distcp"] {
            assert!(out.join("weights").join(f).is_file(), "{at}: weights/{f}");
        }
        assert_eq!(
            std::fs::read(out.join("weights/metadata.json")).unwrap(),
            std::fs::read(fx.join("weights/metadata.json")).unwrap(),
            "{at}"
        );
        let meta = std::fs::read(out.join("weights/.metadata")).unwrap();
        let ours = strings_with(&meta, "module.");
        assert!(
            !ours.is_empty()
                && strings_with(&meta, "decoder.")
                    .iter()
                    .all(|k| ours.iter().any(|o| o.ends_with(k.as_str()))),
            "{at}: a key outside module."
        );
        if family == "llama" {
            // The same model as the fixture's: the same keys, extra states included.
            assert_eq!(ours, strings_with(&fx_meta, "module."), "{at}");
        }
        let common = std::fs::read(out.join("weights/common.pt")).unwrap();
        for k in [
            "epoch",
            "global_step",
            "state_dict",
            "content_metadata",
            "distrib_optim_sharding_type",
            "fully_sharded_model_space",
        ] {
            assert!(
                !strings_with(&common, k).is_empty(),
                "{at}: common.pt lacks {k}"
            );
            assert!(
                !strings_with(&fx_common, k).is_empty(),
                "fixture's common.pt lacks {k}"
            );
        }
        // context/model.yaml: NeMo's sections; every config field one of the fixture's
        // (Llama3Config's every argument), the architecture's values the fixture's.
        let yaml: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(out.join("context/model.yaml")).unwrap())
                .unwrap();
        assert_eq!(keys(&yaml), keys(&fx_yaml), "{at}");
        let (c, fc) = (&yaml["config"], &fx_yaml["config"]);
        for k in keys(c) {
            assert!(
                fc.get(&k).is_some(),
                "{at}: config.{k} is not a config field"
            );
        }
        for k in [
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "normalization",
            "gated_linear_unit",
            "activation_func",
            "position_embedding_type",
            "add_bias_linear",
            "rotary_base",
            "rotary_percent",
            "share_embeddings_and_output_weights",
            "params_dtype",
            "init_method_std",
        ] {
            // Numbers as numbers: the importer gives `rope_theta` as the config's float.
            match (c[k].as_f64(), fc[k].as_f64()) {
                (Some(a), Some(b)) => assert_eq!(a, b, "{at}: config.{k}"),
                _ => assert_eq!(c[k], fc[k], "{at}: config.{k}"),
            }
        }
        assert_eq!(c["vocab_size"], serde_yaml::Value::from(64), "{at}");
        assert_eq!(
            c["add_qkv_bias"],
            serde_yaml::Value::from(family == "qwen2"),
            "{at}"
        );
        let family_module = format!("nemo.collections.llm.gpt.model.{family}");
        assert!(
            c["_target_"].as_str().unwrap().starts_with(&family_module),
            "{at}"
        );
        assert_eq!(yaml["tokenizer"].is_mapping(), tokenizer, "{at}");
        // context/io.json: fiddle's document, as the fixture's: the TrainerContext at the
        // root, the model, its config and the trainer's strategy at the fixture's paths,
        // every Config with its BuildableTraverserMetadata, a refcount for every object.
        let io: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("context/io.json")).unwrap())
                .unwrap();
        let top =
            |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(top(&io), top(&fx_io), "{at}");
        assert_eq!(io["version"], fx_io["version"]);
        assert_eq!(io["root"], fx_io["root"], "{at}");
        assert_eq!(top(&io["objects"]), top(&io["refcounts"]), "{at}");
        let (objects, fx_objects) = (io_objects(&io), io_objects(&fx_io));
        let by_path = |v: &[(String, String, String)], p: &str| {
            v.iter()
                .find(|o| o.2 == p)
                .map(|o| (o.0.clone(), o.1.clone()))
        };
        for p in [
            "<root>",
            "<root>.model",
            "<root>.trainer",
            "<root>.trainer.strategy",
        ] {
            let (m, n) = by_path(&objects, p).unwrap_or_else(|| panic!("{at}: no {p}"));
            let (fm, fname) = by_path(&fx_objects, p).unwrap();
            if p == "<root>.model" {
                assert_eq!(m, family_module, "{at}: {p}");
            }
            if p != "<root>.model" || family == "llama" {
                assert_eq!((m, n), (fm, fname), "{at}: {p}");
            }
        }
        let (m, _) = by_path(&objects, "<root>.model.config").unwrap();
        assert_eq!(m, family_module, "{at}");
        assert_eq!(
            by_path(&objects, "<root>.model.tokenizer").map(|o| o.1),
            tokenizer.then(|| "AutoTokenizer".to_string()),
            "{at}"
        );
        for o in io["objects"].as_object().unwrap().values() {
            if o["type"]["name"] == "Config" {
                let meta = &io["objects"][o["metadata"]["key"].as_str().unwrap()];
                let names: Vec<&str> = meta["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i[0].as_str().unwrap())
                    .collect();
                assert_eq!(
                    names,
                    [
                        "Attr(name='fn_or_cls')",
                        "Attr(name='argument_names')",
                        "Attr(name='argument_tags')",
                        "Attr(name='argument_history')"
                    ]
                );
            }
        }
        let strategy = io["objects"]["megatron_strategy_1"]["items"]
            .as_array()
            .unwrap();
        let (tp, pp) = mesh.split_once(',').unwrap();
        for (name, v) in [("tensor", &tp[3..]), ("pipeline", &pp[3..])] {
            let attr = format!("Attr(name='{name}_model_parallel_size')");
            let item = strategy.iter().find(|i| i[0] == attr.as_str()).unwrap();
            assert_eq!(item[1]["value"].to_string(), v, "{at}: {name}");
        }
        assert_eq!(
            out.join("context/nemo_tokenizer/tokenizer.json").is_file(),
            tokenizer,
            "{at}"
        );
        // Read back as NeMo 2's save, with no flag.
        let i = d.ok(&["inspect", out.to_str().unwrap()]);
        let said = format!("{}{}", i.stdout, i.stderr);
        assert!(said.contains("NeMo 2"), "{at}: {said}");
        assert!(said.contains("model.yaml"), "{at}: {said}");
        let back = d.path(&format!("back-{family}-{mesh}"));
        d.ok(&[
            "merge",
            out.to_str().unwrap(),
            "--format",
            "hf",
            "-o",
            back.to_str().unwrap(),
        ]);
        assert_eq!(full_tensors(&back), want, "{at}");
    }
}

/// What NeMo's importers do not take is refused by the file and field that say it, or
/// by the flag that is missing, before anything is written: a mixture of experts,
/// biases NeMo's Llama has none of, a tied Qwen2, a RoPE scaling other than Llama
/// 3.1's, no --mesh, a Megatron source.
#[test]
fn nemo2_refusals_name_the_field_and_write_nothing() {
    let d = Dir::new();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, &str, Edit, &str); 4] = [
        (
            "llama",
            "bias",
            |c| c["attention_bias"] = serde_json::json!(true),
            "`attention_bias` is true",
        ),
        (
            "qwen2",
            "tied",
            |c| c["tie_word_embeddings"] = serde_json::json!(true),
            "`tie_word_embeddings` is true",
        ),
        (
            "llama",
            "linear",
            |c| c["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0}),
            "`rope_scaling` is",
        ),
        (
            "llama",
            "gelu",
            |c| c["hidden_act"] = serde_json::json!("gelu"),
            "`hidden_act` is \"gelu\"",
        ),
    ];
    let reshard = |src: &Path, out: &Path, mesh: Option<&str>| -> crate::util::Out {
        let mut args = vec![
            "reshard".to_string(),
            src.to_str().unwrap().into(),
            "--format".into(),
            "nemo2".into(),
            "-o".into(),
            out.to_str().unwrap().into(),
        ];
        if let Some(m) = mesh {
            args.extend(["--mesh".into(), m.into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        if mesh.is_some() {
            d.fails(&args)
        } else {
            // A usage error (exit 2): the grid is the flag's to give.
            let o = d.ckpt(&args);
            assert_eq!(o.code, 2, "{}", o.stderr);
            o
        }
    };
    for (family, name, edit, said) in cases {
        let model = hf_model(&d, family, name, edit);
        let out = d.path(&format!("{name}-out"));
        let o = reshard(&model, &out, Some("tp=1,pp=1"));
        assert!(o.stderr.contains(said), "{name}: {}", o.stderr);
        assert!(
            o.stderr.contains("config.json") && o.stderr.contains("--format nemo2"),
            "{name}: {}",
            o.stderr
        );
        assert!(!out.exists(), "{name}: nothing written");
    }
    let mixtral = fixtures().join("moe/hf/mixtral/hf");
    let out = d.path("mixtral-out");
    let o = reshard(&mixtral, &out, Some("tp=1,pp=1"));
    assert!(
        o.stderr
            .contains("`architectures` is \"MixtralForCausalLM\""),
        "{}",
        o.stderr
    );
    assert!(!out.exists());
    let model = hf_llama(&d, "no-mesh", |_| {});
    let out = d.path("no-mesh-out");
    let o = reshard(&model, &out, None);
    assert!(o.stderr.contains("--mesh"), "{}", o.stderr);
    assert!(!out.exists());
    let legacy = fixtures().join("hf/llama/legacy");
    let out = d.path("from-megatron");
    let o = reshard(&legacy, &out, Some("tp=1,pp=1"));
    assert!(o.stderr.contains("Megatron checkpoint"), "{}", o.stderr);
    assert!(!out.exists());
}
