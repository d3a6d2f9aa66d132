//! `merge --format hf`: Megatron checkpoints written by megatron-core itself
//! (tests/fixtures/hf/<family>/{legacy,dist_ckpt}, made by
//! scripts/fixtures/hf_megatron.py on TP=2 x PP=2) exported as Hugging Face models.
//! That transformers loads them with Megatron's logits is scripts/hf_interop.py's check;
//! here: the names, shapes, bytes and config, and the refusals.

use crate::util::{full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::Path;

/// The fixtures' sizes (scripts/fixtures/hf_megatron.py): 4 layers, hidden 32, 4 heads,
/// MLP 64, a vocabulary of 50 padded to 64 rows; fp32.
const LAYERS: usize = 4;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const FFN: usize = 64;
const VOCAB: usize = 50;
const F32: usize = 4;

fn fx(family: &str, layout: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(family)
        .join(layout)
        .display()
        .to_string()
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

/// Rows `rows` of a row-major fp32 matrix of `cols` columns (or a vector: cols 1).
fn rows(t: &[u8], rows: std::ops::Range<usize>, cols: usize) -> Vec<u8> {
    t[rows.start * cols * F32..rows.end * cols * F32].to_vec()
}

/// The Hugging Face tensor names of a Llama-like model of `LAYERS` layers.
fn llama_names(qkv_bias: bool, qk_norm: bool) -> Vec<String> {
    let mut n = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
        "lm_head.weight".into(),
    ];
    for l in 0..LAYERS {
        let mut per = vec![
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ];
        if qkv_bias {
            per.extend([
                "self_attn.q_proj.bias",
                "self_attn.k_proj.bias",
                "self_attn.v_proj.bias",
            ]);
        }
        if qk_norm {
            per.extend(["self_attn.q_norm.weight", "self_attn.k_norm.weight"]);
        }
        n.extend(per.iter().map(|p| format!("model.layers.{l}.{p}")));
    }
    n.sort();
    n
}

/// Every family from both layouts: the names transformers expects, the same bytes from
/// the legacy and the dist_ckpt layout, and each tensor cut from Megatron's as the
/// family's table says (checked here against ckpt's plain merge, which keeps Megatron's
/// names and is tested against megatron-core's gathered tensors in megatron.rs).
#[test]
fn megatron_families_export_to_hugging_face_names_and_bytes() {
    let d = Dir::new();
    for (family, arch, qkv_bias, qk_norm, head_dim) in [
        ("llama", "LlamaForCausalLM", false, false, 8),
        ("qwen2", "Qwen2ForCausalLM", true, false, 8),
        ("qwen3", "Qwen3ForCausalLM", false, true, 16),
    ] {
        let legacy = d.path(&format!("{family}-legacy"));
        let dist = d.path(&format!("{family}-dist"));
        let plain = d.path(&format!("{family}-plain"));
        d.ok(&[
            "merge",
            &fx(family, "legacy"),
            "--format",
            "hf",
            "-o",
            legacy.to_str().unwrap(),
        ]);
        d.ok(&[
            "merge",
            &fx(family, "dist_ckpt"),
            "--format",
            "hf",
            "-o",
            dist.to_str().unwrap(),
        ]);
        d.ok(&[
            "merge",
            &fx(family, "legacy"),
            "-o",
            plain.to_str().unwrap(),
        ]);
        let got = full_tensors(&legacy);
        assert_eq!(
            got.keys().cloned().collect::<Vec<_>>(),
            llama_names(qkv_bias, qk_norm),
            "{family}"
        );
        assert_eq!(
            got,
            full_tensors(&dist),
            "{family}: legacy and dist_ckpt exports differ"
        );
        let c = config(&legacy);
        assert_eq!(c["architectures"][0], arch);
        assert_eq!(c["num_key_value_heads"], 2);
        assert_eq!(c["head_dim"], head_dim);
        assert_eq!(c["vocab_size"], VOCAB);
        assert_eq!(c["tie_word_embeddings"], false);
        assert_eq!(c["dtype"], "float32");
        // Megatron's fused QKV, per group: 2 query heads, a key head, a value head.
        let m = full_tensors(&plain);
        let qkv = &m["decoder.layers.2.self_attention.linear_qkv.weight"];
        let group = 4 * head_dim;
        let q = [
            rows(qkv, 0..2 * head_dim, HIDDEN),
            rows(qkv, group..group + 2 * head_dim, HIDDEN),
        ]
        .concat();
        let k = [
            rows(qkv, 2 * head_dim..3 * head_dim, HIDDEN),
            rows(qkv, group + 2 * head_dim..group + 3 * head_dim, HIDDEN),
        ]
        .concat();
        let v = [
            rows(qkv, 3 * head_dim..group, HIDDEN),
            rows(qkv, group + 3 * head_dim..2 * group, HIDDEN),
        ]
        .concat();
        assert_eq!(got["model.layers.2.self_attn.q_proj.weight"], q, "{family}");
        assert_eq!(got["model.layers.2.self_attn.k_proj.weight"], k, "{family}");
        assert_eq!(got["model.layers.2.self_attn.v_proj.weight"], v, "{family}");
        let fc1 = &m["decoder.layers.1.mlp.linear_fc1.weight"];
        assert_eq!(
            got["model.layers.1.mlp.gate_proj.weight"],
            rows(fc1, 0..FFN, HIDDEN)
        );
        assert_eq!(
            got["model.layers.1.mlp.up_proj.weight"],
            rows(fc1, FFN..2 * FFN, HIDDEN)
        );
        assert_eq!(
            got["model.embed_tokens.weight"], m["embedding.word_embeddings.weight"],
            "{family}: the plain merge drops the padding too"
        );
        assert_eq!(got["model.embed_tokens.weight"].len(), VOCAB * HIDDEN * F32);
        assert_eq!(got["lm_head.weight"], m["output_layer.weight"]);
        assert_eq!(
            got["model.layers.3.self_attn.o_proj.weight"],
            m["decoder.layers.3.self_attention.linear_proj.weight"]
        );
        if qkv_bias {
            let b = &m["decoder.layers.0.self_attention.linear_qkv.bias"];
            let qb = [
                rows(b, 0..2 * head_dim, 1),
                rows(b, group..group + 2 * head_dim, 1),
            ]
            .concat();
            assert_eq!(got["model.layers.0.self_attn.q_proj.bias"], qb);
        }
        if qk_norm {
            assert_eq!(
                got["model.layers.0.self_attn.q_norm.weight"],
                m["decoder.layers.0.self_attention.q_layernorm.weight"]
            );
        }
    }
}

/// Megatron's GPT-2-style model (LayerNorm, GELU, learned positions, biases, tied
/// embeddings) as GPTBigCode: Megatron's tensors as they are, no lm_head.
#[test]
fn gpt_exports_as_gpt_bigcode_with_tied_embeddings() {
    let d = Dir::new();
    d.ok(&["merge", &fx("gpt", "legacy"), "--format", "hf", "-o", "hf"]);
    d.ok(&[
        "merge",
        &fx("gpt", "dist_ckpt"),
        "--format",
        "hf",
        "-o",
        "hf2",
    ]);
    d.ok(&["merge", &fx("gpt", "legacy"), "-o", "plain"]);
    let got = full_tensors(&d.path("hf"));
    assert_eq!(got, full_tensors(&d.path("hf2")));
    assert!(!got.contains_key("lm_head.weight"));
    assert_eq!(got.len(), 4 + LAYERS * 12);
    let m = full_tensors(&d.path("plain"));
    assert_eq!(
        got["transformer.h.1.attn.c_attn.weight"],
        m["decoder.layers.1.self_attention.linear_qkv.weight"]
    );
    assert_eq!(
        got["transformer.h.1.attn.c_attn.weight"].len(),
        3 * HIDDEN * HIDDEN * F32
    );
    assert_eq!(
        got["transformer.wpe.weight"],
        m["embedding.position_embeddings.weight"]
    );
    assert_eq!(got["transformer.wte.weight"].len(), VOCAB * HIDDEN * F32);
    let c = config(&d.path("hf"));
    assert_eq!(c["architectures"][0], "GPTBigCodeForCausalLM");
    assert_eq!(c["multi_query"], false);
    assert_eq!(c["activation_function"], "gelu");
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["n_head"], HEADS);
}

/// Shards as save_pretrained writes them, `--dtype bf16` casting the weights, the
/// config saying so, tokenizer files and a user's config copied.
#[test]
fn shards_dtype_tokenizer_and_user_config() {
    let d = Dir::new();
    d.ok(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "-o",
        "s",
        "--max-shard-size",
        "40KB",
    ]);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.path("s/model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shards: std::collections::BTreeSet<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert!(shards.len() > 2, "{shards:?}");
    let n = shards.len();
    for (k, s) in shards.iter().enumerate() {
        assert_eq!(s, &format!("model-{:05}-of-{n:05}.safetensors", k + 1));
    }
    let total: u64 = shards
        .iter()
        .map(|s| std::fs::metadata(d.path(&format!("s/{s}"))).unwrap().len())
        .sum();
    let data: u64 = full_tensors(&d.path("s"))
        .values()
        .map(|v| v.len() as u64)
        .sum();
    assert_eq!(index["metadata"]["total_size"], data);
    assert!(total > data);
    assert!(d.path("s/config.json").is_file());

    // bf16: every tensor half the bytes, the config says bfloat16.
    d.ok(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "-o",
        "b",
        "--dtype",
        "bf16",
    ]);
    let f32s = full_tensors(&d.path("s"));
    let bf16 = full_tensors(&d.path("b"));
    for (k, v) in &f32s {
        assert_eq!(bf16[k].len() * 2, v.len(), "{k}");
    }
    assert_eq!(config(&d.path("b"))["dtype"], "bfloat16");

    // A user's config is written as it is, generation_config.json beside it and the
    // tokenizer files copied.
    std::fs::create_dir(d.path("user")).unwrap();
    let text = std::fs::read_to_string(d.path("s/config.json"))
        .unwrap()
        .replace(
            "\"rms_norm_eps\"",
            "\"_name_or_path\": \"mine\",\n  \"rms_norm_eps\"",
        );
    std::fs::write(d.path("user/config.json"), &text).unwrap();
    std::fs::write(
        d.path("user/generation_config.json"),
        "{\"do_sample\": false}\n",
    )
    .unwrap();
    std::fs::create_dir(d.path("tok")).unwrap();
    std::fs::write(d.path("tok/tokenizer.json"), "{}\n").unwrap();
    std::fs::write(d.path("tok/tokenizer_config.json"), "{\"x\": 1}\n").unwrap();
    d.ok(&[
        "merge",
        &fx("llama", "dist_ckpt"),
        "--format",
        "hf",
        "-o",
        "u",
        "--hf-config",
        "user/config.json",
        "--tokenizer",
        "tok",
    ]);
    assert_eq!(
        std::fs::read_to_string(d.path("u/config.json")).unwrap(),
        text
    );
    assert_eq!(
        std::fs::read(d.path("u/generation_config.json")).unwrap(),
        b"{\"do_sample\": false}\n"
    );
    assert_eq!(
        std::fs::read(d.path("u/tokenizer_config.json")).unwrap(),
        b"{\"x\": 1}\n"
    );
    assert_eq!(full_tensors(&d.path("u")), f32s);
}

/// What ckpt refuses, naming the problem and writing nothing.
#[test]
fn refusals_name_the_problem_and_write_nothing() {
    let d = Dir::new();
    let gone = |d: &Dir, rel: &str| assert!(!d.path(rel).exists(), "{rel} was written");
    // megatron_fixtures.py's model: LayerNorm, learned positions, no SwiGLU, GQA: no family.
    let other = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/tp2pp2/legacy");
    let o = d.fails(&[
        "merge",
        other.to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "o1",
    ]);
    assert!(
        o.stderr.contains("match no Hugging Face family") && o.stderr.contains("--hf-arch"),
        "{}",
        o.stderr
    );
    gone(&d, "o1");
    // A family the model's features contradict.
    let o = d.fails(&[
        "merge",
        &fx("gpt", "legacy"),
        "--format",
        "hf",
        "--hf-arch",
        "llama",
        "-o",
        "o2",
    ]);
    assert!(
        o.stderr.contains("LlamaForCausalLM does not"),
        "{}",
        o.stderr
    );
    gone(&d, "o2");
    let o = d.fails(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "--hf-arch",
        "bert",
        "-o",
        "o3",
    ]);
    assert!(
        o.stderr.contains("--hf-arch bert: not a family"),
        "{}",
        o.stderr
    );
    // Args that contradict the config; a vocabulary larger than the embedding.
    d.ok(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "-o",
        "ref",
    ]);
    let c = std::fs::read_to_string(d.path("ref/config.json")).unwrap();
    std::fs::write(
        d.path("heads.json"),
        c.replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 8"),
    )
    .unwrap();
    let o = d.fails(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "--hf-config",
        "heads.json",
        "-o",
        "o4",
    ]);
    assert!(
        o.stderr.contains("disagree: attention heads 4 vs 8"),
        "{}",
        o.stderr
    );
    gone(&d, "o4");
    // Missing layers: layer 3 selected out.
    let o = d.fails(&[
        "merge",
        &fx("qwen3", "dist_ckpt"),
        "--format",
        "hf",
        "--exclude",
        "decoder.layers.3.*",
        "-o",
        "o5",
    ]);
    assert!(
        o.stderr.contains("decoder.layers.3.") && o.stderr.contains("missing"),
        "{}",
        o.stderr
    );
    gone(&d, "o5");
    // A config whose vocabulary is larger than the embedding: on the export itself (HF
    // names, its config beside it), with the config made to say 100 tokens.
    std::fs::write(
        d.path("vocab.json"),
        c.replace("\"vocab_size\": 50", "\"vocab_size\": 100"),
    )
    .unwrap();
    let o = d.fails(&[
        "merge",
        "ref",
        "--format",
        "hf",
        "--hf-config",
        "vocab.json",
        "-o",
        "o6",
    ]);
    assert!(
        o.stderr.contains("fewer than the vocabulary of 100"),
        "{}",
        o.stderr
    );
    gone(&d, "o6");
    // The same against Megatron's args: they disagree.
    let o = d.fails(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "--hf-config",
        "vocab.json",
        "-o",
        "o6",
    ]);
    assert!(o.stderr.contains("vocabulary 50 vs 100"), "{}", o.stderr);
    gone(&d, "o6");
    // Options that go with --format hf only, and --split-qkv with it: usage errors.
    let o = d.ckpt(&[
        "merge",
        &fx("llama", "legacy"),
        "--hf-arch",
        "llama",
        "-o",
        "o7",
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let o = d.ckpt(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "--split-qkv",
        "-o",
        "o8",
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    gone(&d, "o7");
    gone(&d, "o8");
}

/// A source already in Hugging Face's names, its config beside it, passes through.
#[test]
fn hf_named_source_with_its_config() {
    let d = Dir::new();
    d.ok(&["merge", &fx("qwen2", "legacy"), "--format", "hf", "-o", "a"]);
    // The export is itself a source: HF names and an HF config.json beside them.
    d.ok(&["merge", "a", "--format", "hf", "-o", "b"]);
    assert_eq!(full_tensors(&d.path("a")), full_tensors(&d.path("b")));
    assert_eq!(
        std::fs::read_to_string(d.path("a/config.json")).unwrap(),
        std::fs::read_to_string(d.path("b/config.json")).unwrap()
    );
    let names: BTreeMap<String, Vec<u8>> = full_tensors(&d.path("a"));
    assert!(names.contains_key("model.layers.0.self_attn.k_proj.bias"));
}

/// Models written by transformers' own save_pretrained (tests/fixtures/hf_models, made by
/// scripts/fixtures/hf_transformers.py; transformers 5's config form): into Megatron
/// legacy TP x PP and back, every tensor byte kept; Megatron's layout checked in
/// scripts/hf_interop.py against megatron-core itself.
#[test]
fn hugging_face_models_into_megatron_and_back() {
    let d = Dir::new();
    for family in ["llama", "mistral", "qwen2", "qwen3"] {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf_models")
            .join(family);
        // The model alone (its reference logits sit beside it).
        let model = d.path(&format!("{family}-model"));
        std::fs::create_dir(&model).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), model.join(f)).unwrap();
        }
        let want = full_tensors(&model);
        for (mesh, format) in [
            ("tp=2,pp=2", "megatron"),
            ("tp=1,pp=4", "megatron"),
            ("tp=2,pp=1", "megatron"),
            ("tp=2,pp=2", "megatron-dist"),
            ("tp=1,pp=1", "megatron-dist"),
        ] {
            let meg = d.path(&format!("{family}-{mesh}-{format}"));
            let back = d.path(&format!("{family}-{mesh}-{format}-back"));
            d.ok(&[
                "reshard",
                model.to_str().unwrap(),
                "--format",
                format,
                "--mesh",
                mesh,
                "-o",
                meg.to_str().unwrap(),
            ]);
            assert_eq!(
                std::fs::read_to_string(meg.join("latest_checkpointed_iteration.txt")).unwrap(),
                "release"
            );
            d.ok(&[
                "merge",
                meg.to_str().unwrap(),
                "--format",
                "hf",
                "-o",
                back.to_str().unwrap(),
            ]);
            assert_eq!(full_tensors(&back), want, "{family} {mesh} {format}");
            // (Megatron's args do not say Mistral: its tensors come back as Llama's,
            // `--hf-arch mistral` names it.)
            let arch = config(&model)["architectures"][0]
                .as_str()
                .unwrap()
                .replace("Mistral", "Llama");
            assert_eq!(config(&back)["architectures"][0], arch.as_str());
        }
        // The plain merge gives Megatron's fused tensors: QKV rows per group.
        let meg = d.path(&format!("{family}-tp=2,pp=2-megatron"));
        let plain = d.path(&format!("{family}-plain"));
        d.ok(&[
            "merge",
            meg.to_str().unwrap(),
            "-o",
            plain.to_str().unwrap(),
        ]);
        let m = full_tensors(&plain);
        let head_dim = if family == "qwen3" { 16 } else { 8 };
        let qkv = &m["decoder.layers.0.self_attention.linear_qkv.weight"];
        let q = &want["model.layers.0.self_attn.q_proj.weight"];
        let k = &want["model.layers.0.self_attn.k_proj.weight"];
        // Group 1: query heads 2 and 3, then key head 1.
        let group = 4 * head_dim;
        assert_eq!(
            rows(qkv, group..group + 2 * head_dim, HIDDEN),
            rows(q, 2 * head_dim..4 * head_dim, HIDDEN)
        );
        assert_eq!(
            rows(qkv, group + 2 * head_dim..group + 3 * head_dim, HIDDEN),
            rows(k, head_dim..2 * head_dim, HIDDEN)
        );
    }
}

/// An HF model imported as a megatron-core dist_ckpt on TP 2 x PP 2 holds what
/// megatron-core itself saved for that model (the fixture's dist_ckpt, written by
/// `dist_checkpointing.save`): the same tensors under the same stacked keys, every byte
/// equal but the vocabulary's padding rows (the import writes none), and the files
/// megatron-core's loader reads; a legacy source gives the same tensors.
#[test]
fn hugging_face_model_into_a_dist_ckpt_as_megatron_core_saves_it() {
    let d = Dir::new();
    for family in ["llama", "qwen3", "gpt"] {
        let hf = d.path(&format!("{family}-hf"));
        d.ok(&[
            "merge",
            &fx(family, "dist_ckpt"),
            "--format",
            "hf",
            "-o",
            hf.to_str().unwrap(),
        ]);
        let dist = d.path(&format!("{family}-dist"));
        d.ok(&[
            "reshard",
            hf.to_str().unwrap(),
            "--format",
            "megatron-dist",
            "--mesh",
            "tp=2,pp=2",
            "-o",
            dist.to_str().unwrap(),
        ]);
        assert_eq!(
            std::fs::read_to_string(dist.join("latest_checkpointed_iteration.txt")).unwrap(),
            "release"
        );
        let it = dist.join("release");
        let mut files: Vec<String> = std::fs::read_dir(&it)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [
                ".metadata",
                "__0_0.distcp",
                "__0_1.distcp",
                "__1_0.distcp",
                "__2_0.distcp",
                "__3_0.distcp",
                "common.pt",
                "metadata.json"
            ],
            "{family}"
        );
        assert!(std::fs::read_to_string(it.join("metadata.json"))
            .unwrap()
            .contains("\"sharded_backend\": \"torch_dist\""));
        // Read back as a dist_ckpt (layers unstacked by ckpt's reader): megatron-core's
        // own save of the same model, key for key.
        let ours = full_tensors(&it);
        let theirs = full_tensors(Path::new(&fx(family, "dist_ckpt")));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{family}"
        );
        for (name, bytes) in &ours {
            if name.ends_with("word_embeddings.weight") || name == "output_layer.weight" {
                assert_eq!(
                    bytes[..],
                    theirs[name][..VOCAB * HIDDEN * F32],
                    "{family} {name}"
                );
            } else {
                assert_eq!(bytes, &theirs[name], "{family} {name}");
            }
        }
        // From the legacy checkpoint megatron-core wrote: the same tensors, padding kept.
        let from_legacy = d.path(&format!("{family}-legacy-dist"));
        d.ok(&[
            "reshard",
            &fx(family, "legacy"),
            "--format",
            "megatron-dist",
            "--mesh",
            "tp=1,pp=2",
            "-o",
            from_legacy.to_str().unwrap(),
        ]);
        assert_eq!(
            full_tensors(&from_legacy.join("iter_0000001")),
            theirs,
            "{family}"
        );
    }
}

/// torchtitan's Llama (a DCP save written by torchtitan 0.3 itself) exported to Hugging
/// Face's names equals torchtitan's own `Llama3StateDictAdapter.to_hf` of the model,
/// every tensor byte (the query and key rows permuted from torchtitan's rotary pairs);
/// and the way back, `--format torchtitan` of that HF model, holds torchtitan's own
/// save, every tensor byte.
#[test]
fn torchtitan_llama_to_hugging_face_and_back() {
    let d = Dir::new();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torchtitan/llama");
    let config = fx.join("config.json");
    d.ok(&[
        "merge",
        fx.join("dcp").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        "hf",
    ]);
    let anchor = full_tensors(&fx.join("adapter_to_hf.safetensors"));
    assert_eq!(anchor.len(), 21);
    assert_eq!(full_tensors(&d.path("hf")), anchor);
    // The permutation is not the identity here: the rows moved.
    let titan = full_tensors(&fx.join("dcp"));
    assert_ne!(
        titan["layers.0.attention.qkv_linear.wq.weight"],
        anchor["model.layers.0.self_attn.q_proj.weight"]
    );
    d.ok(&[
        "reshard",
        "hf",
        "--format",
        "torchtitan",
        "--to",
        "1",
        "-o",
        "titan",
    ]);
    assert!(d.path("titan/.metadata").is_file());
    assert_eq!(full_tensors(&d.path("titan")), titan);
    // Without a config the heads (and so the rotary rows) are not known: refused.
    let o = d.fails(&[
        "merge",
        fx.join("dcp").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "o1",
    ]);
    assert!(o.stderr.contains("--hf-config"), "{}", o.stderr);
    assert!(!d.path("o1").exists());
    // A config of another family than torchtitan's Llama.
    let qwen = std::fs::read_to_string(&config)
        .unwrap()
        .replace("LlamaForCausalLM", "Qwen2ForCausalLM")
        .replace("\"llama\"", "\"qwen2\"");
    std::fs::write(d.path("qwen.json"), qwen).unwrap();
    let o = d.fails(&[
        "merge",
        fx.join("dcp").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        "qwen.json",
        "-o",
        "o2",
    ]);
    assert!(
        o.stderr
            .contains("torchtitan's names are known for its Llama"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o2").exists());
}

/// What a dist_ckpt import refuses, nothing written: one rank (`--rank`), heads that
/// do not divide by TP, a dist_ckpt source.
#[test]
fn dist_ckpt_import_refusals() {
    let d = Dir::new();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_models/llama");
    let o = d.fails(&[
        "reshard",
        model.to_str().unwrap(),
        "--format",
        "megatron-dist",
        "--mesh",
        "tp=2,pp=1",
        "--rank",
        "0",
        "-o",
        "o1",
    ]);
    assert!(
        o.stderr.contains("write every rank at once"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o1").exists());
    // 4 attention heads over 3 TP ranks: megatron-core could not build the model.
    let o = d.fails(&[
        "reshard",
        model.to_str().unwrap(),
        "--format",
        "megatron-dist",
        "--mesh",
        "tp=3,pp=1",
        "-o",
        "o4",
    ]);
    assert!(
        o.stderr
            .contains("num_attention_heads 4 does not divide by tensor parallel 3"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o4").exists());
    let o = d.fails(&[
        "reshard",
        &fx("llama", "dist_ckpt"),
        "--format",
        "megatron-dist",
        "--mesh",
        "tp=2,pp=1",
        "-o",
        "o2",
    ]);
    assert!(
        o.stderr.contains("--format hf` and import that"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o2").exists());
}

/// What an import refuses: no config beside the model, a TP size that splits a head,
/// tensors that are not the family's.
#[test]
fn import_refusals() {
    let d = Dir::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_models/llama");
    std::fs::create_dir(d.path("bare")).unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        d.path("bare/model.safetensors"),
    )
    .unwrap();
    let o = d.fails(&[
        "reshard",
        "bare",
        "--format",
        "megatron",
        "--mesh",
        "tp=2,pp=1",
        "-o",
        "o1",
    ]);
    assert!(
        o.stderr.contains("needs its Hugging Face config.json"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o1").exists());
    std::fs::copy(src.join("config.json"), d.path("bare/config.json")).unwrap();
    // 4 attention heads over 3 TP ranks.
    let o = d.fails(&[
        "reshard",
        "bare",
        "--format",
        "megatron",
        "--mesh",
        "tp=3,pp=1",
        "-o",
        "o2",
    ]);
    assert!(
        o.stderr
            .contains("num_attention_heads 4 does not divide by tensor parallel 3"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o2").exists());
    // A config of another family than the tensors: Qwen3 wants q/k norms.
    let c = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(
        d.path("bare/config.json"),
        c.replace("LlamaForCausalLM", "Qwen3ForCausalLM")
            .replace("\"llama\"", "\"qwen3\""),
    )
    .unwrap();
    let o = d.fails(&[
        "reshard",
        "bare",
        "--format",
        "megatron",
        "--mesh",
        "tp=2,pp=1",
        "-o",
        "o3",
    ]);
    assert!(
        o.stderr.contains("q_norm") && o.stderr.contains("missing"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o3").exists());
}

/// A torch.save whose tensors share storage (GPT-2's tied `lm_head.weight` and
/// `transformer.wte.weight`, written by torch from transformers' own model; a row view
/// with an offset): read as the tensors they are, equal to the copies the generator
/// saved with safetensors.
#[test]
fn torch_save_with_shared_storage() {
    let d = Dir::new();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_models");
    d.ok(&[
        "merge",
        dir.join("gpt2_tied.pt").to_str().unwrap(),
        "-o",
        "m",
    ]);
    let got = full_tensors(&d.path("m"));
    let want = full_tensors(&dir.join("gpt2_tied_expected.safetensors"));
    assert_eq!(got, want);
    assert_eq!(got["lm_head.weight"], got["transformer.wte.weight"]);
    assert_eq!(
        got["row_view"],
        rows(&got["transformer.wpe.weight"], 3..4, HIDDEN)
    );
}

/// DeepSpeed ZeRO-2 of transformers' LlamaForCausalLM (written by DeepSpeed itself):
/// exported with the model's config, its tensors are DeepSpeed's own zero_to_fp32 state
/// dict's.
#[test]
fn deepspeed_zero_of_a_hugging_face_model() {
    let d = Dir::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let ds = root.join("hf_deepspeed");
    let cfg = root.join("hf_models/llama/config.json");
    d.ok(&[
        "merge",
        ds.join("ckpt").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        cfg.to_str().unwrap(),
        "-o",
        "hf",
    ]);
    assert_eq!(
        full_tensors(&d.path("hf")),
        full_tensors(&ds.join("expected.safetensors"))
    );
    assert_eq!(
        std::fs::read(d.path("hf/config.json")).unwrap(),
        std::fs::read(&cfg).unwrap()
    );
    // Without a config there is nothing to say what model it is.
    let o = d.fails(&[
        "merge",
        ds.join("ckpt").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "bare",
    ]);
    assert!(o.stderr.contains("--hf-config"), "{}", o.stderr);
}

/// Args that do not record whether the output layer is tied, beside an output layer:
/// refused (dropping it as Megatron-LM's default would is a guess), settled by a config;
/// the export is the same at 1 and 4 threads.
#[test]
fn untie_not_recorded_is_refused_and_settled_by_a_config() {
    let d = Dir::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_variants/llama_untie_unrecorded");
    let o = d.fails(&["merge", src.to_str().unwrap(), "--format", "hf", "-o", "o"]);
    assert!(
        o.stderr.contains("untie_embeddings_and_output_weights")
            && o.stderr.contains("--hf-config"),
        "{}",
        o.stderr
    );
    assert!(!d.path("o").exists());
    d.ok(&[
        "merge",
        &fx("llama", "legacy"),
        "--format",
        "hf",
        "-o",
        "ref",
    ]);
    d.ok(&[
        "merge",
        src.to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        "ref/config.json",
        "-o",
        "o",
    ]);
    assert_eq!(full_tensors(&d.path("o")), full_tensors(&d.path("ref")));
    // Same bytes whatever the thread count (the Megatron legacy and dist_ckpt paths).
    for (layout, name) in [("legacy", "t"), ("dist_ckpt", "u")] {
        d.ok_with_threads(
            &[
                "merge",
                &fx("qwen3", layout),
                "--format",
                "hf",
                "-o",
                &format!("{name}1"),
            ],
            1,
        );
        d.ok_with_threads(
            &[
                "merge",
                &fx("qwen3", layout),
                "--format",
                "hf",
                "-o",
                &format!("{name}4"),
            ],
            4,
        );
        for f in ["model.safetensors", "config.json"] {
            assert_eq!(
                std::fs::read(d.path(&format!("{name}1/{f}"))).unwrap(),
                std::fs::read(d.path(&format!("{name}4/{f}"))).unwrap(),
                "{layout} {f}"
            );
        }
    }
    d.ok_with_threads(
        &[
            "reshard",
            "ref",
            "--format",
            "megatron",
            "--mesh",
            "tp=2,pp=2",
            "-o",
            "m1",
        ],
        1,
    );
    d.ok_with_threads(
        &[
            "reshard",
            "ref",
            "--format",
            "megatron",
            "--mesh",
            "tp=2,pp=2",
            "-o",
            "m4",
        ],
        4,
    );
    for r in ["mp_rank_00_000", "mp_rank_01_001"] {
        let f = format!("release/{r}/model_optim_rng.pt");
        assert_eq!(
            std::fs::read(d.path(&format!("m1/{f}"))).unwrap(),
            std::fs::read(d.path(&format!("m4/{f}"))).unwrap()
        );
    }
}
