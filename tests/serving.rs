//! Computed outputs (issue 47): PEFT LoRA adapters merged, block-scaled FP8 dequantized
//! and quantized, in the copy's own pass, against the references PEFT, DeepSeek-V3's
//! `weight_dequant` and vLLM's `per_block_cast_to_fp8` made
//! (tests/fixtures/serving/README.md says how, and with what arithmetic).

use crate::util::{assert_same_tensors, copy_dir, full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/serving")
        .join(rel)
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The tensors of `path` whose names `keep` keeps.
fn some_tensors(path: &Path, keep: impl Fn(&str) -> bool) -> BTreeMap<String, Vec<u8>> {
    full_tensors(path)
        .into_iter()
        .filter(|(k, _)| keep(k))
        .collect()
}

/// Every file of a directory, by name, for byte comparisons.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| {
            let e = e.expect("entry");
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).expect("read"),
            )
        })
        .collect()
}

/// Edits a JSON file in place (a copy of a fixture).
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).expect("read")).expect("json");
    edit(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).expect("json")).expect("write");
}

#[test]
fn lora_merges_equal_peft_merge_and_unload_bit_for_bit() {
    // a: dyadic values (exact whatever the summation order); b: Gaussian values with
    // rsLoRA and overlapping rank/alpha patterns (the first match in key order wins);
    // c: modules_to_save (lm_head and embed_tokens replaced by the adapter's copies).
    for adapter in ["a_qv_r4", "b_rslora_patterns", "c_modules_to_save"] {
        let d = Dir::new();
        let out = d.path("merged");
        let o = d.ok(&[
            "merge",
            s(&fixture("base")),
            "--lora",
            s(&fixture(&format!("lora/{adapter}"))),
            "-o",
            s(&out),
        ]);
        assert!(o.stderr.contains("LoRA adapter"), "{}", o.stderr);
        let want = full_tensors(&fixture(&format!("lora/{adapter}/merged.safetensors")));
        assert_same_tensors(&full_tensors(&out), &want, adapter);
        // The base's config comes along.
        assert!(out.join("config.json").exists());
    }
}

#[test]
fn lora_into_a_sliced_base_and_on_any_thread_count_gives_the_same_bytes() {
    let d = Dir::new();
    let ranks = d.path("tp2");
    // Rows of the projections on two ranks, lm_head's columns: each weight's update
    // computed piece by piece.
    d.ok(&[
        "reshard",
        s(&fixture("base")),
        "--to",
        "2",
        "--shard",
        "*_proj.weight=0",
        "--shard",
        "lm_head.weight=1",
        "-o",
        s(&ranks),
        "-q",
    ]);
    let adapter = fixture("lora/b_rslora_patterns");
    let mut outputs = Vec::new();
    for threads in [1, 4] {
        let out = d.path(&format!("merged-{threads}"));
        let o = d.ok_with_threads(
            &[
                "merge",
                s(&ranks.join("ckpt_0")),
                s(&ranks.join("ckpt_1")),
                "--lora",
                s(&adapter),
                "-o",
                s(&out),
            ],
            threads,
        );
        // The ranks' recorded checksums are checked through the computation's reads.
        assert!(!o.stdout.contains("could not be"), "{}", o.stdout);
        assert_same_tensors(
            &full_tensors(&out),
            &full_tensors(&adapter.join("merged.safetensors")),
            "sliced base",
        );
        outputs.push(files_of(&out));
    }
    assert_eq!(outputs[0], outputs[1], "1 and 4 threads");
}

#[test]
fn two_adapters_merge_in_turn_as_two_merges_would() {
    let d = Dir::new();
    let (a, c) = (fixture("lora/a_qv_r4"), fixture("lora/c_modules_to_save"));
    d.ok(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&a),
        "--lora",
        s(&c),
        "-o",
        s(&d.path("both")),
        "-q",
    ]);
    d.ok(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&a),
        "-o",
        s(&d.path("first")),
        "-q",
    ]);
    d.ok(&[
        "merge",
        s(&d.path("first")),
        "--lora",
        s(&c),
        "-o",
        s(&d.path("then")),
        "-q",
    ]);
    assert_same_tensors(
        &full_tensors(&d.path("both")),
        &full_tensors(&d.path("then")),
        "a then c",
    );
    assert_ne!(
        full_tensors(&d.path("both")),
        full_tensors(&d.path("first"))
    );
}

#[test]
fn an_adapter_with_lora_alpha_0_is_refused_unless_the_alpha_is_given() {
    let d = Dir::new();
    let out = d.path("merged");
    let adapter = fixture("lora/d_alpha0");
    let o = d.fails(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&adapter),
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("lora_alpha is 0") && o.stderr.contains("--lora-alpha"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing is written");
    d.ok(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&adapter),
        "--lora-alpha",
        "8",
        "-o",
        s(&out),
        "-q",
    ]);
    // q_proj changes (the adapter targets it), nothing else does.
    let q = |k: &str| k.contains("q_proj");
    let base = fixture("base");
    assert_ne!(some_tensors(&out, q), some_tensors(&base, q));
    assert_same_tensors(
        &some_tensors(&out, |k| !q(k)),
        &some_tensors(&base, |k| !q(k)),
        "untargeted",
    );
}

#[test]
fn adapters_that_do_not_fit_or_are_not_plain_lora_are_refused_by_name() {
    let d = Dir::new();
    let out = d.path("merged");
    // Another model's adapter: its modules are not in the base.
    let o = d.fails(&[
        "merge",
        s(&fixture("fp8")),
        "--lora",
        s(&fixture("lora/a_qv_r4")),
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("is not in the base") && o.stderr.contains("self_attn.q_proj.weight"),
        "{}",
        o.stderr
    );
    // A rank that does not fit its matrices.
    let bad = d.path("bad-rank");
    copy_dir(&fixture("lora/a_qv_r4"), &bad);
    edit_json(&bad.join("adapter_config.json"), |v| v["r"] = 2.into());
    let o = d.fails(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&bad),
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("does not fit this base") && o.stderr.contains("r = 2"),
        "{}",
        o.stderr
    );
    // DoRA is another computation: refused, not merged as plain LoRA.
    let dora = d.path("dora");
    copy_dir(&fixture("lora/a_qv_r4"), &dora);
    edit_json(&dora.join("adapter_config.json"), |v| {
        v["use_dora"] = true.into()
    });
    let o = d.fails(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&dora),
        "-o",
        s(&out),
    ]);
    assert!(o.stderr.contains("use_dora"), "{}", o.stderr);
    assert!(!out.exists(), "nothing is written");
}

#[test]
fn fp8_dequantizes_as_deepseeks_weight_dequant_bit_for_bit() {
    let d = Dir::new();
    let out = d.path("bf16");
    let config_before = std::fs::read(fixture("fp8/config.json")).expect("config");
    let o = d.ok(&[
        "merge",
        s(&fixture("fp8")),
        "--dtype",
        "bf16",
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("3 FP8 weights dequantized"),
        "{}",
        o.stderr
    );
    assert_same_tensors(
        &full_tensors(&out),
        &full_tensors(&fixture("fp8/dequantized_bf16.safetensors")),
        "dequantized",
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
            .expect("json");
    assert!(config.get("quantization_config").is_none() && config["model_type"] == "deepseek_v3");
    assert_eq!(
        std::fs::read(fixture("fp8/config.json")).expect("config"),
        config_before,
        "input untouched"
    );
    // To F32: the products themselves, which round to the reference's BF16.
    let f32_out = d.path("f32");
    d.ok(&[
        "merge",
        s(&fixture("fp8")),
        "--dtype",
        "f32",
        "-o",
        s(&f32_out),
        "-q",
    ]);
    let bf16_again = d.path("f32-to-bf16");
    d.ok(&[
        "merge",
        s(&f32_out),
        "--dtype",
        "bf16",
        "-o",
        s(&bf16_again),
        "-q",
    ]);
    assert_same_tensors(
        &full_tensors(&bf16_again),
        &full_tensors(&out),
        "f32 then bf16",
    );
}

#[test]
fn fp8_quantizes_as_vllms_per_block_cast_and_round_trips() {
    let d = Dir::new();
    let out = d.path("fp8");
    d.ok(&[
        "merge",
        s(&fixture("fp8/dequantized_bf16.safetensors")),
        "--quantize",
        "fp8",
        "-o",
        s(&out),
        "-q",
    ]);
    let want = full_tensors(&fixture("fp8/requant_fp8.safetensors"));
    assert_same_tensors(&full_tensors(&out), &want, "quantized");
    // FP8 -> BF16 -> FP8 in one pass gives back the original shards' tensors (the
    // fixture's FP8 came from BF16 with the same quantizer), with the config's
    // quantization_config written again.
    let again = d.path("again");
    d.ok(&[
        "merge",
        s(&fixture("fp8")),
        "--dtype",
        "bf16",
        "--quantize",
        "fp8",
        "-o",
        s(&again),
        "-q",
    ]);
    assert_same_tensors(
        &full_tensors(&again),
        &full_tensors(&fixture("fp8")),
        "round trip",
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(again.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(
        config["quantization_config"]["weight_block_size"],
        serde_json::json!([128, 128])
    );
    // Already FP8: said, not quantized twice.
    let o = d.fails(&[
        "merge",
        s(&fixture("fp8")),
        "--quantize",
        "fp8",
        "-o",
        s(&d.path("twice")),
    ]);
    assert!(o.stderr.contains("FP8 already"), "{}", o.stderr);
}

#[test]
fn fp8_with_scales_that_do_not_fit_or_are_missing_is_refused_by_name() {
    let d = Dir::new();
    let out = d.path("bf16");
    let src = d.path("fp8-64");
    copy_dir(&fixture("fp8"), &src);
    edit_json(&src.join("config.json"), |v| {
        v["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64]);
    });
    let o = d.fails(&["merge", s(&src), "--dtype", "bf16", "-o", s(&out)]);
    assert!(
        o.stderr.contains("_scale_inv") && o.stderr.contains("block size does not fit"),
        "{}",
        o.stderr
    );
    let o = d.fails(&[
        "merge",
        s(&fixture("fp8")),
        "--exclude",
        "*_scale_inv",
        "--dtype",
        "bf16",
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("scales beside it") && o.stderr.contains("F8_E4M3"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing is written");
}

/// One scale per tensor (transformers' FP8 with `weight_block_size: null`) and per tensor
/// or row in BF16 with a static activation scale (compressed-tensors' `float-quantized`,
/// what llm-compressor saves): dequantized as the writing library's own code does, from
/// the model directory and from a two-rank slicing of it.
#[test]
fn fp8_with_per_tensor_and_per_row_scales_dequantizes_as_their_libraries_do() {
    let d = Dir::new();
    for (name, scales, covers) in [
        ("fp8_tensor", "_scale_inv", "14 per tensor"),
        ("fp8_ct", ".weight_scale", "6 per row, 8 per tensor"),
    ] {
        let src = fixture(&format!("{name}/model"));
        let want = full_tensors(&fixture(&format!("{name}/dequantized_bf16.safetensors")));
        let out = d.path(&format!("{name}-bf16"));
        let o = d.ok(&["merge", s(&src), "--dtype", "bf16", "-o", s(&out)]);
        assert!(
            o.stderr.contains(&format!(
                "14 FP8 weights dequantized to BF16 with their scales ({covers};"
            )),
            "{name}: {}",
            o.stderr
        );
        let got = full_tensors(&out);
        assert!(
            got.keys()
                .all(|k| !k.ends_with(scales) && !k.ends_with("input_scale")),
            "{name}: scales left in {:?}",
            got.keys()
        );
        assert_same_tensors(&got, &want, name);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
                .expect("json");
        assert!(
            config.get("quantization_config").is_none(),
            "{name}: {config}"
        );
        // Sliced over two ranks first: the per-row scales are cut with their rows.
        let sliced = d.path(&format!("{name}-tp2"));
        let mut args = vec![
            "reshard",
            s(&src),
            "--to",
            "2",
            "--shard",
            "*_proj.weight=0",
        ];
        if name == "fp8_ct" {
            args.extend(["--shard", "*mlp.*_proj.weight_scale=0"]);
        }
        args.extend(["-o", s(&sliced), "-q"]);
        d.ok(&args);
        let again = d.path(&format!("{name}-tp2-bf16"));
        d.ok(&[
            "merge",
            s(&sliced),
            "--dtype",
            "bf16",
            "-o",
            s(&again),
            "-q",
        ]);
        assert_same_tensors(
            &full_tensors(&again),
            &want,
            &format!("{name} through two ranks"),
        );
    }
    // One scale for a weight larger than the config's stated block: the config and the
    // tensors disagree, refused by name.
    let src = d.path("fp8_tensor-block");
    copy_dir(&fixture("fp8_tensor/model"), &src);
    edit_json(&src.join("config.json"), |v| {
        v["quantization_config"]["weight_block_size"] = serde_json::json!([32, 32]);
    });
    let out = d.path("refused");
    let o = d.fails(&["merge", s(&src), "--dtype", "bf16", "-o", s(&out)]);
    assert!(
        o.stderr.contains("weight_scale_inv")
            && o.stderr.contains("weight_block_size [32, 32]")
            && o.stderr.contains("block size does not fit"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing is written");
}

#[test]
fn reshard_merges_adapters_and_dequantizes_piece_by_piece() {
    let d = Dir::new();
    // LoRA into a base resharded to 2 ranks (rows of the projections), merged back.
    let adapter = fixture("lora/b_rslora_patterns");
    d.ok(&[
        "reshard",
        s(&fixture("base")),
        "--to",
        "2",
        "--shard",
        "*_proj.weight=0",
        "--lora",
        s(&adapter),
        "-o",
        s(&d.path("tp2")),
        "-q",
    ]);
    d.ok(&["merge", s(&d.path("tp2")), "-o", s(&d.path("merged")), "-q"]);
    assert_same_tensors(
        &full_tensors(&d.path("merged")),
        &full_tensors(&adapter.join("merged.safetensors")),
        "reshard --lora",
    );
    // FP8 cut into columns (each rank's box spans a block edge), dequantized.
    d.ok(&[
        "reshard",
        s(&fixture("fp8")),
        "--to",
        "2",
        "--shard",
        "*_proj*.weight=1",
        "--dtype",
        "bf16",
        "-o",
        s(&d.path("fp8-tp2")),
        "-q",
    ]);
    d.ok(&[
        "merge",
        s(&d.path("fp8-tp2")),
        "-o",
        s(&d.path("bf16")),
        "-q",
    ]);
    assert_same_tensors(
        &full_tensors(&d.path("bf16")),
        &full_tensors(&fixture("fp8/dequantized_bf16.safetensors")),
        "reshard --dtype bf16 of FP8",
    );
    let o = d.fails(&[
        "reshard",
        s(&fixture("base")),
        "--to",
        "2",
        "--quantize",
        "fp8",
        "-o",
        s(&d.path("q")),
    ]);
    assert!(
        o.stderr.contains("quantize the merged model"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_verl_lora_adapter_directory_is_found_under_its_parent() {
    // verl's model merger writes the PEFT adapter as `lora_adapter/` into its target
    // directory (its checkpoint manager writes none: docs/trainers.md).
    let d = Dir::new();
    let actor = d.path("global_step_1/actor");
    copy_dir(&fixture("lora/a_qv_r4"), &actor.join("lora_adapter"));
    let out = d.path("merged");
    d.ok(&[
        "merge",
        s(&fixture("base")),
        "--lora",
        s(&actor),
        "-o",
        s(&out),
        "-q",
    ]);
    assert_same_tensors(
        &full_tensors(&out),
        &full_tensors(&fixture("lora/a_qv_r4/merged.safetensors")),
        "verl lora_adapter/",
    );
}
