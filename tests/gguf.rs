//! `merge --format gguf` (issue 47): the GGUF file llama.cpp's `convert_hf_to_gguf.py`
//! writes, byte for byte, against the converter's own outputs on the committed fixture
//! (tests/fixtures/serving/gguf/, made at llama.cpp d8a24cce; the README's "GGUF
//! semantics" states the rules), from the model directory and from a sliced source;
//! and the refusals (no tokenizer, a family llama.cpp's Llama converter does not
//! write), with nothing written.

use crate::util::{copy_dir, Dir};
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/serving")
        .join(rel)
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Where two files first differ, for the message.
fn first_difference(a: &[u8], b: &[u8]) -> String {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => format!(
            "first difference at byte {i} (of {} and {})",
            a.len(),
            b.len()
        ),
        None => format!("lengths {} and {}", a.len(), b.len()),
    }
}

fn assert_same_file(got: &Path, want: &Path) {
    let (g, w) = (
        std::fs::read(got).expect("read"),
        std::fs::read(want).expect("read"),
    );
    assert!(
        g == w,
        "{} differs from {}: {}",
        got.display(),
        want.display(),
        first_difference(&g, &w)
    );
}

#[test]
fn gguf_of_each_type_is_the_converters_file_byte_for_byte() {
    let d = Dir::new();
    for ty in ["f32", "f16", "bf16", "q8_0"] {
        let out = d.path(&format!("base-{ty}.gguf"));
        d.ok(&[
            "merge",
            s(&fixture("base")),
            "--format",
            "gguf",
            "--dtype",
            ty,
            "-o",
            s(&out),
            "-q",
        ]);
        assert!(out.is_file(), "the output is one file");
        assert_same_file(&out, &fixture(&format!("gguf/base-{ty}.gguf")));
    }
    // Without --dtype: the converter's `auto`, BF16 for this BF16 model.
    let out = d.path("default.gguf");
    d.ok(&[
        "merge",
        s(&fixture("base")),
        "--format",
        "gguf",
        "-o",
        s(&out),
        "-q",
    ]);
    assert_same_file(&out, &fixture("gguf/base-bf16.gguf"));
    // Only the GGUF file: no staged directory left beside it.
    let left: Vec<_> = std::fs::read_dir(d.tmp.path())
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".gguf"))
        .collect();
    assert!(left.is_empty(), "left beside the outputs: {left:?}");
}

#[test]
fn gguf_of_a_sliced_source_on_any_thread_count_gives_the_same_bytes() {
    let d = Dir::new();
    let ranks = d.path("tp2");
    // Rows of the projections on two ranks, lm_head's columns: the permuted query and
    // key rows and the Q8_0 blocks assembled from slices.
    d.ok(&[
        "reshard",
        s(&fixture("base/model.safetensors")),
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
    for threads in [1, 4] {
        for ty in ["bf16", "q8_0"] {
            let out = d.path(&format!("tp2-{ty}-{threads}.gguf"));
            d.ok_with_threads(
                &[
                    "merge",
                    s(&ranks.join("ckpt_0")),
                    s(&ranks.join("ckpt_1")),
                    "--format",
                    "gguf",
                    "--dtype",
                    ty,
                    "--hf-config",
                    s(&fixture("base/config.json")),
                    "--tokenizer",
                    s(&fixture("base")),
                    "-o",
                    s(&out),
                    "-q",
                ],
                threads,
            );
            assert_same_file(&out, &fixture(&format!("gguf/base-{ty}.gguf")));
        }
    }
}

#[test]
fn gguf_without_a_tokenizer_is_refused_naming_the_flag() {
    let d = Dir::new();
    let src = d.path("model");
    copy_dir(&fixture("base"), &src);
    std::fs::remove_file(src.join("tokenizer.model")).expect("remove");
    let out = d.path("model.gguf");
    let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
    assert!(o.stderr.contains("--tokenizer"), "{}", o.stderr);
    assert!(!out.exists(), "nothing written");
    // Given with --tokenizer, the same model converts.
    d.ok(&[
        "merge",
        s(&src),
        "--format",
        "gguf",
        "--tokenizer",
        s(&fixture("base")),
        "-o",
        s(&out),
        "-q",
    ]);
    assert!(out.is_file());
}

#[test]
fn gguf_of_an_architecture_it_does_not_write_is_refused_by_name() {
    let d = Dir::new();
    // Megatron's GPT (tests/fixtures/hf/gpt), which `--format hf` exports as
    // GPTBigCode: llama.cpp has `starcoder`, ckpt does not write it.
    let gpt = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/gpt/legacy");
    let out = d.path("model.gguf");
    let o = d.fails(&[
        "merge",
        s(&gpt),
        "--format",
        "gguf",
        "--tokenizer",
        s(&fixture("base")),
        "-o",
        s(&out),
    ]);
    assert!(o.stderr.contains("GPTBigCodeForCausalLM"), "{}", o.stderr);
    assert!(o.stderr.contains("not built"), "{}", o.stderr);
    assert!(!out.exists(), "nothing written");
    // A config without what llama.cpp needs.
    copy_dir(&fixture("base"), &d.path("m2"));
    let config = d.path("m2/config.json");
    let text = std::fs::read_to_string(&config)
        .expect("read")
        .replace("\"rms_norm_eps\"", "\"not_rms_norm_eps\"");
    std::fs::write(&config, text).expect("write");
    let out = d.path("m2.gguf");
    let o = d.fails(&["merge", s(&d.path("m2")), "--format", "gguf", "-o", s(&out)]);
    assert!(o.stderr.contains("rms_norm_eps"), "{}", o.stderr);
    assert!(!out.exists(), "nothing written");
}

#[test]
fn gguf_options_that_do_not_apply_are_usage_errors() {
    let d = Dir::new();
    let out = d.path("x.gguf");
    // q8_0 is a GGUF type only.
    let o = d.ckpt(&[
        "merge",
        s(&fixture("base")),
        "--dtype",
        "q8_0",
        "-o",
        s(&out),
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("--format gguf"), "{}", o.stderr);
    // A dtype GGUF does not take.
    let o = d.ckpt(&[
        "merge",
        s(&fixture("base")),
        "--format",
        "gguf",
        "--dtype",
        "f64",
        "-o",
        s(&out),
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(!out.exists());
}

#[test]
fn gguf_of_a_lora_merge_is_the_gguf_of_the_merged_model() {
    // The query and key rows of a merged (computed) weight are permuted by an
    // operation, not a view: the same bytes as the GGUF of PEFT's merged model.
    let d = Dir::new();
    let merged = d.path("ref/base");
    std::fs::create_dir_all(&merged).expect("mkdir");
    for f in ["config.json", "tokenizer.model", "tokenizer_config.json"] {
        std::fs::copy(fixture("base").join(f), merged.join(f)).expect("copy");
    }
    std::fs::copy(
        fixture("lora/b_rslora_patterns/merged.safetensors"),
        merged.join("model.safetensors"),
    )
    .expect("copy");
    for ty in ["f32", "q8_0"] {
        let want = d.path(&format!("want-{ty}.gguf"));
        d.ok(&[
            "merge",
            s(&merged),
            "--format",
            "gguf",
            "--dtype",
            ty,
            "-o",
            s(&want),
            "-q",
        ]);
        for threads in [1, 4] {
            let got = d.path(&format!("lora-{ty}-{threads}.gguf"));
            d.ok_with_threads(
                &[
                    "merge",
                    s(&fixture("base")),
                    "--lora",
                    s(&fixture("lora/b_rslora_patterns")),
                    "--format",
                    "gguf",
                    "--dtype",
                    ty,
                    "-o",
                    s(&got),
                    "-q",
                ],
                threads,
            );
            assert_same_file(&got, &want);
        }
    }
}

/// The tensors of `path` with their dtypes and shapes, from `inspect --json`.
fn described(d: &Dir, path: &Path) -> Vec<(String, String, Vec<u64>)> {
    let o = d.ok(&["inspect", s(path), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).expect("json");
    v["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| {
            (
                t["name"].as_str().expect("name").to_string(),
                t["dtype"].as_str().expect("dtype").to_string(),
                t["shape"]
                    .as_array()
                    .expect("shape")
                    .iter()
                    .map(|x| x.as_u64().expect("dim"))
                    .collect(),
            )
        })
        .collect()
}

/// A GGUF is a source: llama.cpp's converter's file is read under its own names, its
/// tensors in row-major shapes (GGUF's dims reversed), and `--dtype` dequantizes the
/// Q8_0 blocks as gguf-py's `quants.dequantize` does, bit for bit, on any thread count.
#[test]
fn a_gguf_is_read_and_its_q8_0_blocks_dequantize_as_gguf_py_does() {
    let d = Dir::new();
    let src = fixture("gguf/base-q8_0.gguf");
    let want = fixture("gguf_read/base-q8_0-f32.safetensors");
    let mut outputs = Vec::new();
    for threads in [1, 4] {
        let out = d.path(&format!("f32-{threads}"));
        let o = d.ok_with_threads(
            &["merge", s(&src), "--dtype", "f32", "-o", s(&out)],
            threads,
        );
        assert!(
            o.stderr.contains("16 Q8_0 tensors dequantized to F32"),
            "{}",
            o.stderr
        );
        crate::util::assert_same_tensors(
            &crate::util::full_tensors(&out),
            &crate::util::full_tensors(&want),
            "Q8_0 dequantized against gguf-py",
        );
        assert_eq!(
            described(&d, &out),
            described(&d, &want),
            "names, dtypes, shapes"
        );
        outputs.push(std::fs::read(out.join("model.safetensors")).expect("read"));
    }
    assert!(
        outputs[0] == outputs[1],
        "1 and 4 threads give the same bytes"
    );
    // Without --dtype the blocks are kept: each row its 2 blocks of 34 bytes.
    let q = described(&d, &src);
    assert!(
        q.contains(&("blk.0.attn_q.weight".into(), "U8".into(), vec![64, 68])),
        "{q:?}"
    );
    let o = d.ok(&["verify", s(&src)]);
    assert!(o.stdout.contains("21 tensors"), "{}", o.stdout);
    let o = d.ok(&["inspect", s(&src), "--json"]);
    assert!(o.stdout.contains("\"GGUF\""), "{}", o.stdout);
}

/// The F32 file's tensors are the model's own values: those llama.cpp does not permute
/// equal the Hugging Face weights cast to F32.
#[test]
fn a_gguf_of_f32_holds_the_hugging_face_weights() {
    let d = Dir::new();
    let hf = d.path("hf-f32");
    d.ok(&[
        "merge",
        s(&fixture("base")),
        "--dtype",
        "f32",
        "-o",
        s(&hf),
        "-q",
    ]);
    let hf = crate::util::full_tensors(&hf);
    let gguf = crate::util::full_tensors(&fixture("gguf/base-f32.gguf"));
    let pairs = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        (
            "blk.1.ffn_down.weight",
            "model.layers.1.mlp.down_proj.weight",
        ),
        (
            "blk.0.attn_v.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ];
    for (g, h) in pairs {
        assert!(gguf[g] == hf[h], "{g} differs from {h}");
    }
}

/// Damaged files: named errors (the file, the problem), exit 1, nothing written.
#[test]
fn damaged_gguf_files_are_refused_by_name() {
    let d = Dir::new();
    let good = std::fs::read(fixture("gguf/base-q8_0.gguf")).expect("read");
    let name = b"blk.0.attn_k.weight";
    let at = good
        .windows(name.len())
        .position(|w| w == name)
        .expect("a tensor info")
        + name.len();
    // After the name: n_dims (2), two dims, then the type.
    let type_at = at + 4 + 16;
    assert_eq!(good[type_at..type_at + 4], 8u32.to_le_bytes(), "Q8_0's id");
    let mut q4_k = good.clone();
    q4_k[type_at..type_at + 4].copy_from_slice(&12u32.to_le_bytes());
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("header", good[..at].to_vec(), "truncated"),
        ("data", good[..good.len() - 100].to_vec(), "truncated?"),
        ("q4_k", q4_k, "ggml type 12 is not read"),
        ("v1", v1, "version 1"),
    ];
    for (case, bytes, problem) in cases {
        let path = d.path(&format!("{case}.gguf"));
        std::fs::write(&path, bytes).expect("write");
        let out = d.path(&format!("{case}-out"));
        let o = d.fails(&["merge", s(&path), "--dtype", "f32", "-o", s(&out)]);
        assert!(
            o.stderr.contains(&format!("{case}.gguf")) && o.stderr.contains(problem),
            "{case}: {}",
            o.stderr
        );
        assert!(!out.exists(), "{case}: nothing is written");
    }
}

/// The Hugging Face model transformers' own GGUF loader makes of each fixture
/// (`from_pretrained(gguf_file=...)`, scripts/fixtures/gguf_to_hf_reference.py) is what
/// `merge --format hf` writes: the same names, the query and key rows back in Hugging
/// Face's halves, Q8_0 dequantized in F32 (its default dtype), every byte equal, and a
/// config of the same sizes.
#[test]
fn a_gguf_becomes_the_model_transformers_loads_from_it() {
    let d = Dir::new();
    for (ty, dtype) in [("q8_0", None), ("f16", Some("f32"))] {
        let out = d.path(&format!("hf-{ty}"));
        let src = fixture(&format!("gguf/base-{ty}.gguf"));
        let mut args = vec!["merge", s(&src), "--format", "hf", "-o", s(&out)];
        args.extend(dtype.iter().flat_map(|d| ["--dtype", *d]));
        let o = d.ok(&args);
        // The notes say what was renamed, never that the names were already Hugging
        // Face's.
        assert!(
            o.stderr.contains("llama.cpp") && !o.stderr.contains("already in"),
            "{}",
            o.stderr
        );
        let got = crate::util::full_tensors(&out.join("model.safetensors"));
        let want =
            crate::util::full_tensors(&fixture(&format!("gguf_read/base-{ty}-hf.safetensors")));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{ty}"
        );
        for (name, bytes) in &want {
            assert!(got[name] == *bytes, "{ty}: {name} differs");
        }
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("config.json")).expect("config"),
        )
        .expect("json");
        let reference: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(&format!("gguf_read/base-{ty}-hf.config.json")))
                .expect("reference"),
        )
        .expect("json");
        for key in [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "tie_word_embeddings",
        ] {
            assert_eq!(config[key], reference[key], "{ty}: {key}");
        }
        // transformers keeps the f32 the file holds; ckpt its shortest decimal.
        let eps = |c: &serde_json::Value| c["rms_norm_eps"].as_f64().expect("eps") as f32;
        assert_eq!(eps(&config), eps(&reference), "{ty}: rms_norm_eps");
        assert_eq!(config["rms_norm_eps"], serde_json::json!(1e-5));
        assert_eq!(
            config["rope_parameters"]["rope_theta"],
            reference["rope_parameters"]["rope_theta"]
        );
        assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    }
}

/// Hugging Face → GGUF (llama.cpp's converter) → Hugging Face is the identity: the
/// BF16 GGUF read back as a model is the base, byte for byte, in its dtype (the
/// norms the converter kept in F32 cast back exactly), on any thread count; and a
/// GGUF requantized by ckpt (BF16 → Q8_0, given the config and tokenizer the GGUF
/// writer reads) is the converter's own Q8_0 file.
#[test]
fn hugging_face_to_gguf_and_back_is_the_identity() {
    let d = Dir::new();
    let want = crate::util::full_tensors(&fixture("base/model.safetensors"));
    for threads in [1, 4] {
        let out = d.path(&format!("hf-{threads}"));
        d.ok_with_threads(
            &[
                "merge",
                s(&fixture("gguf/base-bf16.gguf")),
                "--format",
                "hf",
                "-o",
                s(&out),
            ],
            threads,
        );
        let got = crate::util::full_tensors(&out.join("model.safetensors"));
        assert_eq!(got, want, "{threads} threads");
    }
    let q8 = d.path("requantized.gguf");
    d.ok(&[
        "merge",
        s(&fixture("gguf/base-bf16.gguf")),
        "--format",
        "gguf",
        "--dtype",
        "q8_0",
        "--hf-config",
        s(&fixture("base/config.json")),
        "--tokenizer",
        s(&fixture("base")),
        "-o",
        s(&q8),
    ]);
    assert_same_file(&q8, &fixture("gguf/base-q8_0.gguf"));
    // Without them, the GGUF's own keys (its tokenizer included) are carried with the
    // new file type: the same files, from the BF16 GGUF alone.
    for (ty, want) in [
        ("q8_0", "gguf/base-q8_0.gguf"),
        ("f32", "gguf/base-f32.gguf"),
    ] {
        let out = d.path(&format!("requantized-{ty}.gguf"));
        d.ok(&[
            "merge",
            s(&fixture("gguf/base-bf16.gguf")),
            "--format",
            "gguf",
            "--dtype",
            ty,
            "-o",
            s(&out),
        ]);
        assert_same_file(&out, &fixture(want));
    }
}

/// What the keys do not settle is refused with what would, nothing written: a rope
/// scaling kept as llama.cpp's `rope_freqs.weight` (then `--hf-config` settles it and
/// the tensor is left out), a config that disagrees with the keys, an architecture not
/// mapped back.
#[test]
fn a_gguf_the_keys_do_not_settle_is_refused_with_what_would() {
    let d = Dir::new();
    let freqs = fixture("gguf_read/base-q8_0-rope-freqs.gguf");
    let out = d.path("r");
    let o = d.fails(&["merge", s(&freqs), "--format", "hf", "-o", s(&out)]);
    assert!(
        o.stderr.contains("base-q8_0-rope-freqs.gguf")
            && o.stderr.contains("rope_freqs.weight")
            && o.stderr.contains("--hf-config"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing is written");
    let o = d.ok(&[
        "merge",
        s(&freqs),
        "--format",
        "hf",
        "--hf-config",
        s(&fixture("base/config.json")),
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("rope_freqs.weight left out"),
        "{}",
        o.stderr
    );
    let got = crate::util::full_tensors(&out.join("model.safetensors"));
    let want = crate::util::full_tensors(&fixture("gguf_read/base-q8_0-hf.safetensors"));
    assert_eq!(got, want);

    let config = d.path("config.json");
    let text = std::fs::read_to_string(fixture("base/config.json")).expect("config");
    std::fs::write(
        &config,
        text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"),
    )
    .expect("write");
    let out = d.path("c");
    let o = d.fails(&[
        "merge",
        s(&fixture("gguf/base-q8_0.gguf")),
        "--format",
        "hf",
        "--hf-config",
        s(&config),
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("disagree") && o.stderr.contains("key/value heads (query groups) 2 vs 4"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing is written");

    // `general.architecture` "llama" made "gemma" (same length): not mapped back.
    let mut bytes = std::fs::read(fixture("gguf/base-q8_0.gguf")).expect("read");
    let key = b"general.architecture";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the key")
        + key.len()
        + 4
        + 8;
    assert_eq!(&bytes[at..at + 5], b"llama");
    bytes[at..at + 5].copy_from_slice(b"gemma");
    let gemma = d.path("gemma.gguf");
    std::fs::write(&gemma, bytes).expect("write");
    let out = d.path("g");
    let o = d.fails(&["merge", s(&gemma), "--format", "hf", "-o", s(&out)]);
    assert!(
        o.stderr.contains("gemma.gguf") && o.stderr.contains("`gemma`"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing is written");
}

/// Qwen2 and Qwen3 (issue 47): the file llama.cpp's converter writes, byte for byte
/// (tests/fixtures/serving/qwen/gguf/, made by scripts/fixtures/gguf_qwen_fixtures.py
/// with llama-cpp-python 0.3.36's vendored converter, the tiny tokenizer's hash
/// registered as `qwen2`): `qwen2.*`/`qwen3.*` keys, Qwen's biases and q/k norms, no
/// rotary permutation, and the byte-level BPE `tokenizer.json` as `gpt2` tokens, types
/// and merges; on 1 and 4 threads.
#[test]
fn gguf_of_qwen2_and_qwen3_is_the_converters_file_byte_for_byte() {
    let d = Dir::new();
    for model in ["qwen2", "qwen3"] {
        for ty in ["f32", "f16"] {
            for threads in [1, 4] {
                assert_gguf_is_the_converters(&d, "qwen", model, ty, threads);
            }
        }
    }
}

/// `merge tests/fixtures/serving/<root>/<model> --format gguf --dtype <ty>` on
/// `threads` threads writes the file the converter wrote (`<root>/gguf/<model>-<ty>.gguf`).
fn assert_gguf_is_the_converters(d: &Dir, root: &str, model: &str, ty: &str, threads: usize) {
    let out = d.path(&format!("{model}-{ty}-{threads}.gguf"));
    d.ok_with_threads(
        &[
            "merge",
            s(&fixture(&format!("{root}/{model}"))),
            "--format",
            "gguf",
            "--dtype",
            ty,
            "-o",
            s(&out),
            "-q",
        ],
        threads,
    );
    assert_same_file(&out, &fixture(&format!("{root}/gguf/{model}-{ty}.gguf")));
}

/// Every tensor of ckpt's Qwen3 F32 file is the Hugging Face tensor of that name (by
/// llama.cpp's table), same shape, same bytes: the query and key rows as stored.
#[test]
fn a_qwen_gguf_holds_the_hugging_face_tensors_under_llama_cpps_names() {
    let d = Dir::new();
    let out = d.path("qwen3.gguf");
    d.ok(&[
        "merge",
        s(&fixture("qwen/qwen3")),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "-o",
        s(&out),
        "-q",
    ]);
    let hf = crate::util::full_tensors(&fixture("qwen/qwen3/model.safetensors"));
    let gguf = crate::util::full_tensors(&out);
    let layer = |g: &str, h: &str| {
        (0..2)
            .map(|l| (format!("blk.{l}.{g}"), format!("model.layers.{l}.{h}")))
            .collect::<Vec<_>>()
    };
    let mut pairs = vec![
        (
            "token_embd.weight".to_string(),
            "model.embed_tokens.weight".to_string(),
        ),
        ("output.weight".into(), "lm_head.weight".into()),
        ("output_norm.weight".into(), "model.norm.weight".into()),
    ];
    for (g, h) in [
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_v.weight", "self_attn.v_proj.weight"),
        ("attn_output.weight", "self_attn.o_proj.weight"),
        ("attn_q_norm.weight", "self_attn.q_norm.weight"),
        ("attn_k_norm.weight", "self_attn.k_norm.weight"),
        ("attn_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("ffn_gate.weight", "mlp.gate_proj.weight"),
        ("ffn_up.weight", "mlp.up_proj.weight"),
        ("ffn_down.weight", "mlp.down_proj.weight"),
    ] {
        pairs.extend(layer(g, h));
    }
    assert_eq!(gguf.len(), pairs.len(), "{:?}", gguf.keys());
    assert_eq!(hf.len(), pairs.len(), "{:?}", hf.keys());
    for (g, h) in &pairs {
        assert!(gguf[g] == hf[h], "{g} differs from {h}");
    }
    // The shapes, as gguf-py reads them (row-major), are the Hugging Face ones.
    let described = described(&d, &out);
    let q = described
        .iter()
        .find(|(n, _, _)| n == "blk.0.attn_q.weight")
        .expect("attn_q listed");
    assert_eq!(q.2, vec![64, 32], "{q:?}");
    // Qwen2: the biases named, the tied head not written.
    let out = d.path("qwen2.gguf");
    d.ok(&[
        "merge",
        s(&fixture("qwen/qwen2")),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "-o",
        s(&out),
        "-q",
    ]);
    let hf = crate::util::full_tensors(&fixture("qwen/qwen2/model.safetensors"));
    let gguf = crate::util::full_tensors(&out);
    assert!(!gguf.contains_key("output.weight"));
    for l in 0..2 {
        for p in ["q", "k", "v"] {
            let (g, h) = (
                format!("blk.{l}.attn_{p}.bias"),
                format!("model.layers.{l}.self_attn.{p}_proj.bias"),
            );
            assert!(gguf[&g] == hf[&h], "{g} differs from {h}");
        }
    }
}

/// The BPE tokenizer's keys, found in the file's bytes:
/// `gpt2`, `qwen2`, one token per config id (the ids past the tokenizer's `[PADn]`,
/// unused), the special tokens control tokens, the merges in the file's order.
#[test]
fn a_qwen_gguf_carries_the_bpe_tokenizer_as_llama_cpp_reads_it() {
    let d = Dir::new();
    let out = d.path("qwen2.gguf");
    d.ok(&[
        "merge",
        s(&fixture("qwen/qwen2")),
        "--format",
        "gguf",
        "-o",
        s(&out),
        "-q",
    ]);
    // GGUF strings are stored as length-prefixed UTF-8: each key and value is found
    // as its bytes with its u64 length before it.
    let bytes = std::fs::read(&out).expect("read");
    let has = |t: &str| {
        let mut want = (t.len() as u64).to_le_bytes().to_vec();
        want.extend_from_slice(t.as_bytes());
        bytes.windows(want.len()).any(|w| w == want.as_slice())
    };
    let tj: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("qwen/qwen2/tokenizer.json")).expect("read"))
            .expect("json");
    for want in [
        "gpt2",
        "qwen2",
        "[PAD351]",
        "<|im_end|>",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template",
        "qwen2.rope.freq_base",
    ] {
        assert!(has(want), "{want} missing");
    }
    let first = &tj["model"]["merges"][0];
    let first = format!(
        "{} {}",
        first[0].as_str().expect("str"),
        first[1].as_str().expect("str")
    );
    assert!(has(&first), "{first} missing");
    // Llama's keys are not Qwen's.
    assert!(!has("qwen2.vocab_size") && !has("qwen2.rope.dimension_count"));
    assert!(!has("llama.vocab_size") && !has("tokenizer.ggml.scores"));
}

/// A BPE tokenizer whose pre-tokenizer ckpt cannot name, and a Qwen model without a
/// tokenizer.json, are refused by name, nothing written.
#[test]
fn a_qwen_tokenizer_ckpt_cannot_name_is_refused_by_name() {
    let d = Dir::new();
    let src = d.path("qwen2");
    copy_dir(&fixture("qwen/qwen2"), &src);
    let path = src.join("tokenizer.json");
    let text = std::fs::read_to_string(&path)
        .expect("read")
        .replace(r"\\p{N}|", r"\\p{N}{1,3}|");
    std::fs::write(&path, text).expect("write");
    let out = d.path("model.gguf");
    let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
    assert!(o.stderr.contains("tokenizer.json"), "{}", o.stderr);
    assert!(o.stderr.contains("pre-tokenizer"), "{}", o.stderr);
    assert!(!out.exists(), "nothing written");
    // No tokenizer.json: --tokenizer named; given it, the model converts.
    std::fs::remove_file(&path).expect("remove");
    let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
    assert!(
        o.stderr.contains("tokenizer.json") && o.stderr.contains("--tokenizer"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing written");
    d.ok(&[
        "merge",
        s(&src),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "--tokenizer",
        s(&fixture("qwen/tokenizer")),
        "-o",
        s(&out),
        "-q",
    ]);
    // Named after the model's directory, as the converter does: the same file.
    assert_same_file(&out, &fixture("qwen/gguf/qwen2-f32.gguf"));
}

/// A directory holding one GGUF file is that file (as a directory of one safetensors
/// file is); several GGUF files (one model's quantizations, typically) or a GGUF
/// beside other tensor files are refused, each file named, nothing written.
#[test]
fn a_directory_of_one_gguf_is_that_file_and_of_several_is_refused() {
    let d = Dir::new();
    let one = d.path("one");
    std::fs::create_dir_all(&one).unwrap();
    std::fs::copy(fixture("gguf/base-f32.gguf"), one.join("model.gguf")).unwrap();
    d.ok(&["merge", s(&one), "-o", "from_dir"]);
    d.ok(&["merge", s(&one.join("model.gguf")), "-o", "from_file"]);
    assert_same_file(
        &d.path("from_dir/model.safetensors"),
        &d.path("from_file/model.safetensors"),
    );

    let two = d.path("two");
    std::fs::create_dir_all(&two).unwrap();
    for f in ["base-f32.gguf", "base-q8_0.gguf"] {
        std::fs::copy(fixture("gguf").join(f), two.join(f)).unwrap();
    }
    let o = d.fails(&["merge", s(&two), "-o", "out"]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("2 GGUF files (base-f32.gguf, base-q8_0.gguf)")
            && o.stderr.contains("give the one to read"),
        "{}",
        o.stderr
    );

    std::fs::remove_file(two.join("base-q8_0.gguf")).unwrap();
    std::fs::copy(
        fixture("gguf_read/base-q8_0-f32.safetensors"),
        two.join("other.safetensors"),
    )
    .unwrap();
    let o = d.fails(&["merge", s(&two), "-o", "out"]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("a GGUF file (base-f32.gguf) beside other tensor files (other.safetensors)"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
}

/// Qwen3-MoE and Qwen2-MoE (issue 47): the file llama.cpp's converter writes, byte for
/// byte (tests/fixtures/serving/qwen/gguf/*_moe-*.gguf, made by
/// scripts/fixtures/gguf_qwen_moe_fixtures.py with llama-cpp-python 0.3.36's vendored
/// converter): `qwen3moe`/`qwen2moe` keys (`expert_count`, `expert_used_count`,
/// `expert_feed_forward_length`, Qwen2-MoE's `expert_shared_feed_forward_length`),
/// each layer's experts stacked into `ffn_{down,gate,up}_exps` where the converter
/// writes them, the routers F32, Qwen2-MoE's shared expert and its gate, and the
/// `4x…` size label; F16 on 1 and 4 threads, and Q8_0 (each expert's blocks computed,
/// then stacked).
#[test]
fn gguf_of_qwen3_moe_and_qwen2_moe_is_the_converters_file_byte_for_byte() {
    let d = Dir::new();
    for (model, ty, threads) in [
        ("qwen3_moe", "f16", 1),
        ("qwen3_moe", "f16", 4),
        ("qwen3_moe", "q8_0", 4),
        ("qwen2_moe", "f16", 1),
        ("qwen2_moe", "f16", 4),
    ] {
        assert_gguf_is_the_converters(&d, "qwen", model, ty, threads);
    }
}

/// ckpt's Qwen3-MoE F32 file read back with ckpt's own GGUF reader: llama.cpp's names,
/// shapes (`ffn_gate_exps`/`ffn_up_exps` `[experts, moe_ffn, hidden]`, `ffn_down_exps`
/// `[experts, hidden, moe_ffn]`, the router `[experts, hidden]` F32) and expert keys;
/// each stacked tensor's bytes are its experts' Hugging Face tensors' bytes, expert 0
/// first; every other tensor is the Hugging Face tensor of its name.
#[test]
fn a_qwen3_moe_gguf_stacks_each_layers_experts_from_their_own_bytes() {
    let d = Dir::new();
    let out = d.path("qwen3_moe.gguf");
    d.ok(&[
        "merge",
        s(&fixture("qwen/qwen3_moe")),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "-o",
        s(&out),
        "-q",
    ]);
    let hf = crate::util::full_tensors(&fixture("qwen/qwen3_moe/model.safetensors"));
    let gguf = crate::util::full_tensors(&out);
    let (entries, metadata) =
        ckpt_core::formats::gguf::parse_gguf(&std::fs::read(&out).expect("read"))
            .expect("ckpt reads it");
    let shape = |n: &str| {
        entries
            .iter()
            .find(|e| e.name == n)
            .map(|e| {
                (
                    ckpt_core::layout::strategy::dtype_name(e.dtype).to_string(),
                    e.shape.clone(),
                )
            })
            .unwrap_or_else(|| panic!("{n} not in the file"))
    };
    let f32 = "F32".to_string();
    for l in 0..2 {
        for (g, proj, want) in [
            ("ffn_gate_exps", "gate_proj", vec![4, 64, 32]),
            ("ffn_up_exps", "up_proj", vec![4, 64, 32]),
            ("ffn_down_exps", "down_proj", vec![4, 32, 64]),
        ] {
            let g = format!("blk.{l}.{g}.weight");
            assert_eq!(shape(&g), (f32.clone(), want), "{g}");
            let mut experts = Vec::new();
            for e in 0..4 {
                experts.extend_from_slice(
                    &hf[&format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight")],
                );
            }
            assert!(
                gguf[&g] == experts,
                "{g} is not experts 0..4's {proj} bytes, stacked"
            );
        }
        let router = format!("blk.{l}.ffn_gate_inp.weight");
        assert_eq!(shape(&router), (f32.clone(), vec![4, 32]));
        assert!(gguf[&router] == hf[&format!("model.layers.{l}.mlp.gate.weight")]);
    }
    // 2 layers of 12 tensors (norms, attention, q/k norms, router, 3 stacks) and 3 more.
    assert_eq!(gguf.len(), 27, "{:?}", gguf.keys());
    let stacked = gguf.keys().filter(|n| n.contains("_exps.")).count();
    assert_eq!(
        hf.len() - gguf.len(),
        2 * (12 - 3),
        "each layer's 12 expert tensors are 3"
    );
    assert_eq!(stacked, 6);
    for (name, g) in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("lm_head.weight", "output.weight"),
        (
            "model.layers.1.self_attn.k_norm.weight",
            "blk.1.attn_k_norm.weight",
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "blk.0.attn_q.weight",
        ),
    ] {
        assert!(gguf[g] == hf[name], "{g} differs from {name}");
    }
    let kv: serde_json::Value = serde_json::from_str(&metadata["gguf.kv"]).expect("kv json");
    let value = |k: &str| {
        kv.as_array()
            .expect("pairs")
            .iter()
            .find(|p| p[0] == k)
            .map(|p| p[1].clone())
            .unwrap_or_else(|| panic!("{k} missing"))
    };
    assert_eq!(
        value("general.architecture"),
        serde_json::json!(["str", "qwen3moe"])
    );
    assert_eq!(
        value("qwen3moe.expert_count"),
        serde_json::json!(["u32", 4])
    );
    assert_eq!(
        value("qwen3moe.expert_used_count"),
        serde_json::json!(["u32", 2])
    );
    assert_eq!(
        value("qwen3moe.expert_feed_forward_length"),
        serde_json::json!(["u32", 64])
    );
    assert_eq!(
        value("general.size_label"),
        serde_json::json!(["str", "4x48K"])
    );
    assert_eq!(
        value("tokenizer.ggml.model"),
        serde_json::json!(["str", "gpt2"])
    );
}

/// What llama.cpp would run otherwise than transformers, refused by the config's key
/// with nothing written: a Qwen3-MoE whose top-k router weights are not renormalised
/// (`norm_topk_prob: false`; llama.cpp's qwen3moe always renormalises), a Qwen2-MoE
/// whose are (`true`; llama.cpp's qwen2moe never does).
#[test]
fn a_qwen_moe_llama_cpp_would_run_otherwise_is_refused_by_name() {
    let d = Dir::new();
    for (model, from, to) in [
        (
            "qwen3_moe",
            "\"norm_topk_prob\": true",
            "\"norm_topk_prob\": false",
        ),
        (
            "qwen2_moe",
            "\"norm_topk_prob\": false",
            "\"norm_topk_prob\": true",
        ),
    ] {
        let says = "norm_topk_prob";
        let src = d.path(model);
        copy_dir(&fixture(&format!("qwen/{model}")), &src);
        let config = src.join("config.json");
        let text = std::fs::read_to_string(&config).expect("read");
        assert!(text.contains(from), "{from} in the fixture's config");
        std::fs::write(&config, text.replace(from, to)).expect("write");
        let out = d.path(&format!("{model}.gguf"));
        let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
        assert!(o.stderr.contains(says), "{}", o.stderr);
        assert!(o.stderr.contains("renormalises"), "{}", o.stderr);
        assert!(!out.exists(), "nothing written");
    }
}

/// Mixtral (issue 47): the file llama.cpp's converter writes, byte for byte
/// (tests/fixtures/serving/mixtral/gguf/, made by
/// scripts/fixtures/gguf_mixtral_fixture.py with llama-cpp-python 0.3.36's vendored
/// converter): architecture `llama` with `expert_count` and `expert_used_count`, the
/// query and key rows permuted, each layer's `block_sparse_moe.experts.E.w1/w2/w3`
/// stacked into `ffn_gate_exps`, `ffn_down_exps`, `ffn_up_exps` (in that order, where
/// the converter writes them), the router F32, the SentencePiece tokenizer, the `4x…`
/// size label; every type, on 1 and 4 threads.
#[test]
fn gguf_of_mixtral_is_the_converters_file_byte_for_byte() {
    let d = Dir::new();
    for (ty, threads) in [
        ("f32", 1),
        ("f16", 1),
        ("f16", 4),
        ("bf16", 4),
        ("q8_0", 1),
        ("q8_0", 4),
    ] {
        assert_gguf_is_the_converters(&d, "mixtral", "mixtral", ty, threads);
    }
}

/// ckpt's Mixtral F32 file read back: `ffn_gate_exps` is experts 0..4's `w1` bytes,
/// `ffn_down_exps` their `w2`, `ffn_up_exps` their `w3` (not permuted), the router is
/// `block_sparse_moe.gate` as stored, the query and key rows are permuted per head
/// (`LlamaModel.permute`: row `h·hd + 2i + j` is row `h·hd + j·hd/2 + i`), and the
/// keys are Llama's with the experts' counts and no expert FFN length.
#[test]
fn a_mixtral_gguf_stacks_w1_w2_w3_as_gate_down_up() {
    let d = Dir::new();
    let out = d.path("mixtral.gguf");
    d.ok(&[
        "merge",
        s(&fixture("mixtral/mixtral")),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "-o",
        s(&out),
        "-q",
    ]);
    let hf = crate::util::full_tensors(&fixture("mixtral/mixtral/model.safetensors"));
    let gguf = crate::util::full_tensors(&out);
    let (entries, metadata) =
        ckpt_core::formats::gguf::parse_gguf(&std::fs::read(&out).expect("read"))
            .expect("ckpt reads it");
    let shape = |n: &str| {
        entries
            .iter()
            .find(|e| e.name == n)
            .map(|e| e.shape.clone())
            .unwrap_or_else(|| panic!("{n} not in the file"))
    };
    for l in 0..2 {
        for (g, w) in [
            ("ffn_gate_exps", "w1"),
            ("ffn_down_exps", "w2"),
            ("ffn_up_exps", "w3"),
        ] {
            let g = format!("blk.{l}.{g}.weight");
            assert_eq!(shape(&g), vec![4, 32, 32], "{g}");
            let mut experts = Vec::new();
            for e in 0..4 {
                experts.extend_from_slice(
                    &hf[&format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight")],
                );
            }
            assert!(
                gguf[&g] == experts,
                "{g} is not experts 0..4's {w}, stacked"
            );
        }
        let router = format!("blk.{l}.ffn_gate_inp.weight");
        assert_eq!(shape(&router), vec![4, 32]);
        assert!(gguf[&router] == hf[&format!("model.layers.{l}.block_sparse_moe.gate.weight")]);
        // The query (4 heads) and key (2 heads) rows of head_dim 8, 32 F32 columns.
        for (proj, g, heads) in [("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)] {
            let src = &hf[&format!("model.layers.{l}.self_attn.{proj}.weight")];
            let row = 32 * 4;
            let mut want = Vec::with_capacity(src.len());
            for h in 0..heads {
                for i in 0..4 {
                    for j in 0..2 {
                        let r = h * 8 + j * 4 + i;
                        want.extend_from_slice(&src[r * row..(r + 1) * row]);
                    }
                }
            }
            assert!(want != *src, "the permutation moves rows");
            assert!(
                gguf[&format!("blk.{l}.{g}.weight")] == want,
                "blk.{l}.{g}.weight is not {proj}'s rows permuted per head"
            );
        }
    }
    // 2 layers of 10 tensors (2 norms, 4 attention, router, 3 stacks) and 3 more.
    assert_eq!(gguf.len(), 23, "{:?}", gguf.keys());
    assert_eq!(
        hf.len() - gguf.len(),
        2 * (12 - 3),
        "each layer's 12 expert tensors are 3"
    );
    let kv: serde_json::Value = serde_json::from_str(&metadata["gguf.kv"]).expect("kv json");
    let value = |k: &str| {
        kv.as_array()
            .expect("pairs")
            .iter()
            .find(|p| p[0] == k)
            .map(|p| p[1].clone())
    };
    use serde_json::json;
    assert_eq!(value("general.architecture"), Some(json!(["str", "llama"])));
    assert_eq!(value("llama.expert_count"), Some(json!(["u32", 4])));
    assert_eq!(value("llama.expert_used_count"), Some(json!(["u32", 2])));
    assert_eq!(value("llama.feed_forward_length"), Some(json!(["u32", 32])));
    assert_eq!(value("llama.expert_feed_forward_length"), None);
    assert_eq!(value("general.size_label"), Some(json!(["str", "4x21K"])));
    assert_eq!(value("tokenizer.ggml.model"), Some(json!(["str", "llama"])));
}

/// Mixtral from Megatron (tests/fixtures/moe/hf/mixtral: its dist_ckpt on EP 2, and
/// the legacy GroupedMLP files, each expert a transposed run of the grouped weights):
/// the same GGUF bytes as from the Hugging Face model `--format hf` exports them to,
/// F32 and BF16, on 4 threads (hidden 16: no row holds a whole Q8_0 block).
#[test]
fn gguf_of_a_megatron_mixtral_is_the_gguf_of_its_hugging_face_model() {
    let d = Dir::new();
    let moe = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/moe/hf/mixtral");
    let config = moe.join("hf/config.json");
    let gguf = |src: &Path, ty: &str, out: &Path| {
        d.ok_with_threads(
            &[
                "merge",
                s(src),
                "--format",
                "gguf",
                "--dtype",
                ty,
                "--hf-config",
                s(&config),
                "--tokenizer",
                s(&fixture("base")),
                "-o",
                s(out),
                "-q",
            ],
            4,
        );
    };
    for ty in ["f32", "bf16"] {
        let want = d.path(&format!("hf-{ty}.gguf"));
        gguf(&moe.join("hf"), ty, &want);
        for src in ["dist_ckpt", "legacy_grouped"] {
            let got = d.path(&format!("{src}-{ty}.gguf"));
            gguf(&moe.join(src), ty, &got);
            assert_same_file(&got, &want);
        }
    }
}

/// A safetensors tensor: name, dtype, shape, bytes.
type Stored = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// A copy of the model directory `from` at `to` whose `model.safetensors` is `edit`'s
/// tensors: it gets every tensor and returns what to keep in its place.
fn edited_model(from: &Path, to: &Path, edit: impl Fn(Stored) -> Vec<Stored>) {
    copy_dir(from, to);
    let bytes = std::fs::read(from.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut kept = Vec::new();
    for (name, view) in st.tensors() {
        kept.extend(edit((
            name,
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        )));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
        .iter()
        .map(|(n, dt, shape, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, shape.clone(), data).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &to.join("model.safetensors")).expect("write");
}

/// `merge SRC --format gguf` fails (exit 1) saying every one of `says`, nothing written.
fn assert_gguf_refused(d: &Dir, src: &Path, says: &[&str]) {
    let out = d.path(&format!(
        "{}.gguf",
        src.file_name().expect("name").to_string_lossy()
    ));
    let o = d.fails(&["merge", s(src), "--format", "gguf", "-o", s(&out)]);
    for w in says {
        assert!(o.stderr.contains(w), "{w:?} not in: {}", o.stderr);
    }
    assert!(!out.exists(), "nothing written");
}

/// The mixtures of experts ckpt refuses by the config's key, each naming the key and
/// why, nothing written: a tied Qwen2-MoE (its `lm_head.weight` gone, as a tied
/// model's file has none; llama.cpp's qwen2moe needs `output.weight`, which the
/// converter does not write for it), layers without experts
/// (`decoder_sparse_step` 2, `mlp_only_layers` [1]), no top-k, group routing and a
/// router score function, a Qwen2-MoE without its shared expert's size (the Hugging
/// Face view's refusal of the config beside the model, no longer "no model config"), a
/// Mixtral without top-k.
#[test]
fn a_moe_config_llama_cpp_would_not_run_is_refused_by_its_key() {
    let d = Dir::new();
    // (model, case, config text, replaced by, the message's words)
    let cases: &[(&str, &str, &str, &str, &[&str])] = &[
        (
            "qwen/qwen2_moe",
            "tied",
            "\"tie_word_embeddings\": false",
            "\"tie_word_embeddings\": true",
            &["tie_word_embeddings", "output.weight", "qwen2moe"],
        ),
        (
            "qwen/qwen3_moe",
            "step",
            "\"decoder_sparse_step\": 1",
            "\"decoder_sparse_step\": 2",
            &["decoder_sparse_step 2", "layers without experts"],
        ),
        (
            "qwen/qwen3_moe",
            "mlp_only",
            "\"mlp_only_layers\": []",
            "\"mlp_only_layers\": [1]",
            &["mlp_only_layers", "layers without experts"],
        ),
        (
            "qwen/qwen3_moe",
            "top0",
            "\"num_experts_per_tok\": 2",
            "\"num_experts_per_tok\": 0",
            &["num_experts_per_tok", "missing or 0"],
        ),
        (
            "qwen/qwen3_moe",
            "group",
            "\"num_experts_per_tok\": 2",
            "\"num_experts_per_tok\": 2, \"n_group\": 2",
            &["n_group", "group routing"],
        ),
        (
            "qwen/qwen3_moe",
            "score",
            "\"num_experts_per_tok\": 2",
            "\"num_experts_per_tok\": 2, \"scoring_func\": \"sigmoid\"",
            &["scoring_func", "score functions"],
        ),
        (
            "qwen/qwen2_moe",
            "no_shared",
            "\"shared_expert_intermediate_size\": 96",
            "\"not_shared_expert_intermediate_size\": 96",
            &["no `shared_expert_intermediate_size`"],
        ),
        (
            "mixtral/mixtral",
            "top0",
            "\"num_experts_per_tok\": 2",
            "\"num_experts_per_tok\": 0",
            &["num_experts_per_tok", "missing or 0", "MixtralForCausalLM"],
        ),
    ];
    for (model, case, from, to, says) in cases {
        let src = d.path(&format!("{}-{case}", model.replace('/', "-")));
        let tied = *case == "tied";
        edited_model(&fixture(model), &src, |t| {
            if tied && t.0 == "lm_head.weight" {
                vec![]
            } else {
                vec![t]
            }
        });
        let config = src.join("config.json");
        let text = std::fs::read_to_string(&config).expect("read");
        assert!(text.contains(from), "{from} in {model}'s config");
        std::fs::write(&config, text.replacen(from, to, 1)).expect("write");
        assert_gguf_refused(&d, &src, says);
    }
}

/// The mixtures of experts ckpt refuses by their tensors, each naming the tensor and
/// the problem, nothing written: an expert tensor missing from a layer (Qwen's and
/// Mixtral's names), an expert beyond `num_local_experts`, experts of different
/// shapes, a dense MLP in place of a layer's experts (llama.cpp's qwen3moe and
/// Mixtral's `llama` load a router and experts in every layer), a layer with no
/// experts at all, a layer without its router. The Hugging Face view of the source
/// refuses the missing and extra tensors before the GGUF writer sees them; the writer
/// refuses the shapes it cannot stack.
#[test]
fn a_moe_checkpoint_llama_cpp_would_not_load_is_refused_naming_the_tensor() {
    let d = Dir::new();
    type Edit = fn(Stored) -> Vec<Stored>;
    let cases: &[(&str, &str, Edit, &[&str])] = &[
        (
            "qwen/qwen3_moe",
            "missing_expert",
            |(n, dt, sh, b)| {
                if n == "model.layers.1.mlp.experts.2.up_proj.weight" {
                    vec![]
                } else {
                    vec![(n, dt, sh, b)]
                }
            },
            &[
                "model.layers.1.mlp.experts.2.up_proj.weight",
                "missing: Qwen3MoeForCausalLM of 2 layers has it",
            ],
        ),
        (
            "mixtral/mixtral",
            "missing_expert",
            |(n, dt, sh, b)| {
                if n == "model.layers.0.block_sparse_moe.experts.3.w2.weight" {
                    vec![]
                } else {
                    vec![(n, dt, sh, b)]
                }
            },
            &[
                "model.layers.0.block_sparse_moe.experts.3.w2.weight",
                "missing: MixtralForCausalLM of 2 layers has it",
            ],
        ),
        (
            "mixtral/mixtral",
            "expert_beyond",
            // A fifth expert, a copy of the fourth.
            |(n, dt, sh, b)| {
                let extra = n.replace(".experts.3.", ".experts.4.");
                if extra == n {
                    vec![(n, dt, sh, b)]
                } else {
                    vec![(extra, dt, sh.clone(), b.clone()), (n, dt, sh, b)]
                }
            },
            &[
                "model.layers.0.block_sparse_moe.experts.4.w1.weight",
                "is not a tensor of MixtralForCausalLM",
            ],
        ),
        (
            "qwen/qwen3_moe",
            "other_shape",
            |(n, dt, mut sh, mut b)| {
                if n == "model.layers.0.mlp.experts.1.down_proj.weight" {
                    sh[0] /= 2;
                    b.truncate(b.len() / 2);
                }
                vec![(n, dt, sh, b)]
            },
            &[
                "model.layers.0.mlp.experts.1.down_proj.weight",
                "llama.cpp stacks the experts' matrices, one shape and dtype",
            ],
        ),
        (
            "qwen/qwen3_moe",
            "dense_layer",
            // Layer 1's experts and router become a dense MLP (expert 0's matrices).
            |(n, dt, sh, b)| {
                if !n.starts_with("model.layers.1.mlp.") {
                    return vec![(n, dt, sh, b)];
                }
                match n.strip_prefix("model.layers.1.mlp.experts.0.") {
                    Some(proj) => vec![(format!("model.layers.1.mlp.{proj}"), dt, sh, b)],
                    None => vec![],
                }
            },
            &[
                "model.layers.1.mlp.experts.0.down_proj.weight",
                "missing: Qwen3MoeForCausalLM of 2 layers has it",
            ],
        ),
        (
            "mixtral/mixtral",
            "dense_layer",
            |(n, dt, sh, b)| {
                let dense = [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")];
                if !n.starts_with("model.layers.0.block_sparse_moe.") {
                    return vec![(n, dt, sh, b)];
                }
                for (w, proj) in dense {
                    if n == format!("model.layers.0.block_sparse_moe.experts.0.{w}.weight") {
                        return vec![(format!("model.layers.0.mlp.{proj}.weight"), dt, sh, b)];
                    }
                }
                vec![]
            },
            &[
                "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                "missing: MixtralForCausalLM of 2 layers has it",
            ],
        ),
        (
            "qwen/qwen3_moe",
            "no_experts",
            |(n, dt, sh, b)| {
                if n.starts_with("model.layers.0.mlp.experts.") {
                    vec![]
                } else {
                    vec![(n, dt, sh, b)]
                }
            },
            &[
                "model.layers.0.mlp.experts.0.down_proj.weight",
                "missing: Qwen3MoeForCausalLM of 2 layers has it",
            ],
        ),
        (
            "mixtral/mixtral",
            "no_router",
            |(n, dt, sh, b)| {
                if n == "model.layers.1.block_sparse_moe.gate.weight" {
                    vec![]
                } else {
                    vec![(n, dt, sh, b)]
                }
            },
            &[
                "model.layers.1.block_sparse_moe.gate.weight",
                "missing: MixtralForCausalLM of 2 layers has it",
            ],
        ),
    ];
    for (model, case, edit, says) in cases {
        let src = d.path(&format!("{}-{case}", model.replace('/', "-")));
        edited_model(&fixture(model), &src, *edit);
        assert_gguf_refused(&d, &src, says);
    }
}

/// `ckpt_core::write::gguf::read_bpe_tokenizer`, the BPE `tokenizer.json` reader that the GGUF
/// writer and the `bpe_tokenizer` fuzz target call: the committed Qwen tokenizer (the
/// fuzz seeds' file) gives one token and type per id of the config's 352, the 29
/// without a token `[PADi]` (unused, 5), `<|endoftext|>` control (3), its 64 merges;
/// an id not below the vocabulary, a truncated file and a SentencePiece-style BPE are
/// refused, naming the problem.
#[test]
fn the_bpe_tokenizer_reader_takes_qwens_and_refuses_damage_by_name() {
    let json = std::fs::read(fixture("qwen/tokenizer/tokenizer.json")).expect("read");
    let ckpt_core::write::gguf::BpeVocab {
        pre,
        tokens,
        types,
        merges,
    } = ckpt_core::write::gguf::read_bpe_tokenizer(&json, 352).expect("reads");
    assert_eq!(pre, "qwen2");
    assert_eq!((tokens.len(), types.len(), merges.len()), (352, 352, 64));
    assert_eq!((tokens[320].as_str(), types[320]), ("<|endoftext|>", 3));
    assert_eq!(types.iter().filter(|&&t| t == 5).count(), 29);
    assert_eq!((tokens[351].as_str(), types[351]), ("[PAD351]", 5));
    let refused = |json: &[u8], vocab: usize, says: &str| {
        let e = ckpt_core::write::gguf::read_bpe_tokenizer(json, vocab)
            .map(|_| ())
            .expect_err("refused")
            .to_string();
        assert!(e.contains(says), "{says:?} not in {e}");
    };
    refused(&json, 300, "not below the config's vocab_size 300");
    refused(&json[..json.len() / 2], 352, "not JSON");
    let text = String::from_utf8(json.clone()).expect("utf-8");
    let fallback = text.replacen("\"byte_fallback\": false", "\"byte_fallback\": true", 1);
    assert_ne!(fallback, text, "the fixture says byte_fallback");
    refused(fallback.as_bytes(), 352, "byte_fallback");
}

/// Llama 3 (issue 47): a `LlamaForCausalLM` whose tokenizer is Llama 3's byte-level BPE
/// `tokenizer.json` (no `tokenizer.model`) is the file llama.cpp's converter writes,
/// byte for byte (tests/fixtures/serving/llama3/gguf/, made by
/// scripts/fixtures/gguf_llama3_fixture.py with llama-cpp-python 0.3.36's vendored
/// converter, the tiny tokenizer's hash registered as `llama-bpe`): `llama.*` keys,
/// the query/key rows permuted, `gpt2` tokens, types and merges, `llama-bpe`, and
/// add_bos true / add_eos false / add_sep false from the post-processor's
/// `TemplateProcessing`; on 1 and 4 threads.
#[test]
fn gguf_of_llama3_is_the_converters_file_byte_for_byte() {
    let d = Dir::new();
    for ty in ["f32", "f16"] {
        for threads in [1, 4] {
            assert_gguf_is_the_converters(&d, "llama3", "llama3", ty, threads);
        }
    }
}

/// Llama 3's `tokenizer.json` read as the converter writes it: `llama-bpe`, one token
/// per config id (352: 320 trained, 5 special, 27 `[PADn]` unused), the specials
/// control tokens, the 64 merges.
#[test]
fn the_bpe_tokenizer_reader_names_llama3s_llama_bpe() {
    let json = std::fs::read(fixture("llama3/tokenizer/tokenizer.json")).expect("read");
    let ckpt_core::write::gguf::BpeVocab {
        pre,
        tokens,
        types,
        merges,
    } = ckpt_core::write::gguf::read_bpe_tokenizer(&json, 352).expect("reads");
    assert_eq!(pre, "llama-bpe");
    assert_eq!((tokens.len(), types.len(), merges.len()), (352, 352, 64));
    assert_eq!((tokens[320].as_str(), types[320]), ("<|begin_of_text|>", 3));
    assert_eq!((tokens[324].as_str(), types[324]), ("<|eot_id|>", 3));
    assert_eq!(types.iter().filter(|&&t| t == 5).count(), 27);
    assert_eq!(types.iter().filter(|&&t| t == 1).count(), 320);
}

/// A Llama 3 tokenizer llama.cpp would tokenize otherwise (merges not ignored), one
/// whose post-processor ends with a token other than the eos (gguf-py would rewrite
/// the eos), and a Llama model with neither tokenizer file: refused by name, nothing
/// written.
#[test]
fn a_llama3_tokenizer_ckpt_cannot_write_is_refused_by_name() {
    let d = Dir::new();
    let src = d.path("llama3");
    copy_dir(&fixture("llama3/llama3"), &src);
    let path = src.join("tokenizer.json");
    let original = std::fs::read_to_string(&path).expect("read");
    let out = d.path("model.gguf");

    let edited = original.replacen("\"ignore_merges\": true", "\"ignore_merges\": false", 1);
    assert_ne!(edited, original, "the fixture says ignore_merges");
    std::fs::write(&path, edited).expect("write");
    let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
    assert!(
        o.stderr.contains("tokenizer.json")
            && o.stderr.contains("ignore_merges false")
            && o.stderr.contains("the regex llama-bpe's"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing written");

    let mut doc: serde_json::Value = serde_json::from_str(&original).expect("json");
    let single = doc["post_processor"]["processors"][1]["single"]
        .as_array_mut()
        .expect("the template's single");
    single.push(serde_json::json!({"SpecialToken": {"id": "<|eot_id|>", "type_id": 0}}));
    std::fs::write(&path, serde_json::to_string(&doc).expect("json")).expect("write");
    let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
    assert!(
        o.stderr.contains("tokenizer.json")
            && o.stderr
                .contains("\"<|eot_id|>\", not the eos_token \"<|end_of_text|>\""),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing written");

    std::fs::remove_file(&path).expect("remove");
    let o = d.fails(&["merge", s(&src), "--format", "gguf", "-o", s(&out)]);
    assert!(
        o.stderr.contains("tokenizer.model or tokenizer.json") && o.stderr.contains("--tokenizer"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing written");
    // Given with --tokenizer, the same model converts to the converter's file.
    d.ok(&[
        "merge",
        s(&src),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "--tokenizer",
        s(&fixture("llama3/tokenizer")),
        "-o",
        s(&out),
        "-q",
    ]);
    assert_same_file(&out, &fixture("llama3/gguf/llama3-f32.gguf"));
}

/// A Mixtral GGUF back to Hugging Face (issue 47): llama.cpp's stacked
/// `ffn_{gate,down,up}_exps` `[4, rows, cols]` read back as Mixtral's per-expert
/// `block_sparse_moe.experts.E.{w1,w2,w3}`, each a view of its expert's run, the
/// router `ffn_gate_inp` as `block_sparse_moe.gate`, the query/key rows permuted
/// back. The converter's F32 file and ckpt's own F32 GGUF of the model (Hugging Face
/// → GGUF → Hugging Face) merged to safetensors are the model, every tensor byte for
/// byte, on 1 and 4 threads; the config is a `MixtralForCausalLM` of 4 experts, top
/// 2. Stacks in Q8_0 blocks are refused, naming the tensor, nothing written.
#[test]
fn a_mixtral_gguf_becomes_its_hugging_face_model_expert_by_expert() {
    let d = Dir::new();
    let want = crate::util::full_tensors(&fixture("mixtral/mixtral/model.safetensors"));
    let ours = d.path("ours-f32.gguf");
    d.ok(&[
        "merge",
        s(&fixture("mixtral/mixtral")),
        "--format",
        "gguf",
        "--dtype",
        "f32",
        "-o",
        s(&ours),
        "-q",
    ]);
    let converters = fixture("mixtral/gguf/mixtral-f32.gguf");
    for (i, (src, threads)) in [(&converters, 1), (&converters, 4), (&ours, 1)]
        .into_iter()
        .enumerate()
    {
        let out = d.path(&format!("hf-{i}"));
        let o = d.ok_with_threads(&["merge", s(src), "--format", "hf", "-o", s(&out)], threads);
        assert!(o.stderr.contains("per-expert w1, w2, w3"), "{}", o.stderr);
        let got = crate::util::full_tensors(&out.join("model.safetensors"));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{}",
            src.display()
        );
        for (name, bytes) in &want {
            assert!(got[name] == *bytes, "{}: {name} differs", src.display());
        }
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("config.json")).expect("config"),
        )
        .expect("json");
        assert_eq!(config["architectures"][0], "MixtralForCausalLM");
        assert_eq!(config["num_local_experts"], 4);
        assert_eq!(config["num_experts_per_tok"], 2);
        assert_eq!(config["intermediate_size"], 32);
    }
    let out = d.path("q8");
    let o = d.fails(&[
        "merge",
        s(&fixture("mixtral/gguf/mixtral-q8_0.gguf")),
        "--format",
        "hf",
        "-o",
        s(&out),
    ]);
    assert!(
        o.stderr.contains("blk.0.ffn_gate_exps.weight") && o.stderr.contains("Q8_0"),
        "{}",
        o.stderr
    );
    assert!(!out.exists(), "nothing written");
}
