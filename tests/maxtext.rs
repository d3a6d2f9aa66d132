//! MaxText <-> Hugging Face (issue 48): the tiny MaxText Llama 3.1 step that
//! orbax-checkpoint wrote (tests/fixtures/maxtext, README there) exported with
//! `merge --format hf`, each Hugging Face tensor checked against the stored arrays
//! transformed here, independently of ckpt's conversion (MaxText's conventions:
//! layers stacked on axis 1, kernels `[in, out]`, the query kernel times
//! `1/sqrt(head_dim)`, Llama 3.1's interleaved rotary rows); `reshard --format
//! maxtext` back to the same tree, byte for byte; the refusals named.

use crate::util::Dir;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const L: usize = 2;
const E: usize = 64;
const H: usize = 4;
const KV: usize = 2;
const D: usize = 16;
const F: usize = 128;
const V: usize = 128;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/maxtext")
        .join(rel)
}

/// A safetensors file's tensors: shape and bytes, by name.
fn tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The fixture's stored arrays (a plain merge: the tree's names, as orbax holds them).
fn stored(d: &Dir) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let ckpt = fixture("ckpt");
    d.ok(&["merge", ckpt.to_str().unwrap(), "-o", "plain"]);
    tensors(&d.path("plain/model.safetensors"))
        .into_iter()
        .filter(|(n, _)| n.starts_with("params.params."))
        .map(|(n, (s, b))| (n, (s, f32s(&b))))
        .collect()
}

/// Hugging Face's tensors of the fixture, from its MaxText arrays: MaxText's
/// `to_huggingface` hooks (`LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN`) spelled out.
fn expected_hf(m: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) -> BTreeMap<String, Vec<f32>> {
    let a = |n: &str| &m[&format!("params.params.{n}")].1;
    let mut out = BTreeMap::new();
    out.insert(
        "model.embed_tokens.weight".into(),
        a("token_embedder.embedding").clone(),
    );
    out.insert(
        "model.norm.weight".into(),
        a("decoder.decoder_norm.scale").clone(),
    );
    let head = a("decoder.logits_dense.kernel"); // [E, V]
    out.insert(
        "lm_head.weight".into(),
        (0..V)
            .flat_map(|v| (0..E).map(move |e| head[e * V + v]))
            .collect(),
    );
    let scale = (D as f64).sqrt() as f32;
    for l in 0..L {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        // [E, L, heads, D] -> [heads * D, E]; HF row h*D + half*D/2 + j is MaxText's
        // 2j + half (interleaved pairs), the query times sqrt(D).
        let heads_of = |k: &Vec<f32>, n: usize, rope: bool, s: f32| -> Vec<f32> {
            let mut w = vec![0f32; n * D * E];
            for h in 0..n {
                for r in 0..D {
                    let d = if rope {
                        2 * (r % (D / 2)) + r / (D / 2)
                    } else {
                        r
                    };
                    for e in 0..E {
                        let x = k[((e * L + l) * n + h) * D + d];
                        w[(h * D + r) * E + e] = if s == 1.0 { x } else { x * s };
                    }
                }
            }
            w
        };
        let q = a("decoder.layers.self_attention.query.kernel");
        out.insert(p("self_attn.q_proj.weight"), heads_of(q, H, true, scale));
        let k = a("decoder.layers.self_attention.key.kernel");
        out.insert(p("self_attn.k_proj.weight"), heads_of(k, KV, true, 1.0));
        let v = a("decoder.layers.self_attention.value.kernel");
        out.insert(p("self_attn.v_proj.weight"), heads_of(v, KV, false, 1.0));
        // out [H, L, D, E] -> o_proj [E, H * D].
        let o = a("decoder.layers.self_attention.out.kernel");
        let mut w = vec![0f32; E * H * D];
        for e in 0..E {
            for h in 0..H {
                for d in 0..D {
                    w[e * H * D + h * D + d] = o[((h * L + l) * D + d) * E + e];
                }
            }
        }
        out.insert(p("self_attn.o_proj.weight"), w);
        // [in, L, out] -> [out, in].
        let dense = |k: &Vec<f32>, i: usize, o: usize| -> Vec<f32> {
            (0..o)
                .flat_map(|y| (0..i).map(move |x| k[(x * L + l) * o + y]))
                .collect()
        };
        out.insert(
            p("mlp.gate_proj.weight"),
            dense(a("decoder.layers.mlp.wi_0.kernel"), E, F),
        );
        out.insert(
            p("mlp.up_proj.weight"),
            dense(a("decoder.layers.mlp.wi_1.kernel"), E, F),
        );
        out.insert(
            p("mlp.down_proj.weight"),
            dense(a("decoder.layers.mlp.wo.kernel"), F, E),
        );
        // [E, L] -> [E].
        let col = |k: &Vec<f32>| -> Vec<f32> { (0..E).map(|e| k[e * L + l]).collect() };
        out.insert(
            p("input_layernorm.weight"),
            col(a("decoder.layers.pre_self_attention_layer_norm.scale")),
        );
        out.insert(
            p("post_attention_layernorm.weight"),
            col(a("decoder.layers.post_self_attention_layer_norm.scale")),
        );
    }
    out
}

fn export(d: &Dir, out: &str) {
    export_from(d, "ckpt", out);
}

/// `merge FIXTURE/step --format hf --hf-config FIXTURE/config.json -o out`.
fn export_from(d: &Dir, step: &str, out: &str) {
    let ckpt = fixture(step);
    let config = fixture("config.json");
    d.ok(&[
        "merge",
        ckpt.to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        out,
    ]);
}

#[test]
fn maxtext_to_hf_is_each_layer_transposed_scaled_and_unrotated() {
    let d = Dir::new();
    let want = expected_hf(&stored(&d));
    export(&d, "hf");
    let got = tensors(&d.path("hf/model.safetensors"));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, w) in &want {
        assert!(got[name].1 == bytes(w), "{name}: bytes differ");
    }
    // The optimizer state and step are left out, said so.
    assert!(!got.keys().any(|n| n.contains("opt_state") || n == "step"));
}

#[test]
fn hf_to_maxtext_and_back_is_the_identity() {
    let d = Dir::new();
    export(&d, "hf");
    // Sharded: several chunks per array, each layer's weights cut across them.
    d.ok(&[
        "reshard",
        d.path("hf").to_str().unwrap(),
        "--format",
        "maxtext",
        "--to",
        "2",
        "--shard",
        "*.query.kernel=2,*.key.kernel=2,*.mlp.wi_*=2,*.mlp.wo.kernel=0,*.out.kernel=0",
        "-o",
        "mx",
    ]);
    assert!(d.path("mx/items/_METADATA").is_file());
    assert!(d.path("mx/_CHECKPOINT_METADATA").is_file());
    // The same tree as MaxText's own (sqrt(16) = 4: the query scaling is exact).
    let original = stored(&d);
    d.ok(&["merge", d.path("mx").to_str().unwrap(), "-o", "mx_plain"]);
    let again = tensors(&d.path("mx_plain/model.safetensors"));
    assert_eq!(
        again.keys().collect::<Vec<_>>(),
        original.keys().collect::<Vec<_>>()
    );
    for (name, (shape, values)) in &original {
        assert_eq!(&again[name].0, shape, "{name}");
        assert!(again[name].1 == bytes(values), "{name}: bytes differ");
    }
    // And back to Hugging Face: byte for byte the first export.
    let config = fixture("config.json");
    d.ok(&[
        "merge",
        d.path("mx").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        "hf2",
    ]);
    let (a, b) = (
        tensors(&d.path("hf/model.safetensors")),
        tensors(&d.path("hf2/model.safetensors")),
    );
    assert_eq!(a, b);
}

#[test]
fn maxtext_refusals_are_named_and_write_nothing() {
    let d = Dir::new();
    let ckpt = fixture("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    // No config: MaxText records none.
    let o = d.fails(&["merge", ckpt, "--format", "hf", "-o", "out"]);
    assert!(o.stderr.contains("--hf-config"), "{}", o.stderr);
    // A family not in the table.
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("config.json")).unwrap()).unwrap();
    let mut mixtral = config.clone();
    mixtral["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    mixtral["model_type"] = serde_json::json!("mixtral");
    mixtral["num_local_experts"] = serde_json::json!(2);
    mixtral["num_experts_per_tok"] = serde_json::json!(1);
    std::fs::write(d.path("mixtral.json"), mixtral.to_string()).unwrap();
    let o = d.fails(&[
        "merge",
        ckpt,
        "--format",
        "hf",
        "--hf-config",
        d.path("mixtral.json").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("MaxText") && o.stderr.contains("Mixtral"),
        "{}",
        o.stderr
    );
    // A config of another size: the tensor named with its shape.
    let mut three = config.clone();
    three["num_hidden_layers"] = serde_json::json!(3);
    std::fs::write(d.path("three.json"), three.to_string()).unwrap();
    let o = d.fails(&[
        "merge",
        ckpt,
        "--format",
        "hf",
        "--hf-config",
        d.path("three.json").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("params.params.decoder.layers.") && o.stderr.contains("axis 1"),
        "{}",
        o.stderr
    );
    // Tied in the config, but the tree has logits_dense: not MaxText's tied model.
    let mut tied = config;
    tied["tie_word_embeddings"] = serde_json::json!(true);
    std::fs::write(d.path("tied.json"), tied.to_string()).unwrap();
    let o = d.fails(&[
        "merge",
        ckpt,
        "--format",
        "hf",
        "--hf-config",
        d.path("tied.json").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(o.stderr.contains("logits_dense"), "{}", o.stderr);
    // reshard --format maxtext of something that is no Hugging Face model.
    let o = d.fails(&[
        "reshard", ckpt, "--format", "maxtext", "--to", "1", "-o", "out",
    ]);
    assert!(o.stderr.contains("config.json"), "{}", o.stderr);
    assert!(!d.path("out").exists());
}

/// The Hugging Face fixtures of the families in MaxText's table (Llama without Llama
/// 3.1's rotary scaling and Mistral: rotate-half rows, no permutation; Qwen3: q/k
/// norms, no query scaling): to MaxText's tree and back, byte for byte (Llama's and
/// Mistral's query within an ulp: their head_dim 8 has no power-of-two square root),
/// and the tree's shapes MaxText's.
#[test]
fn hf_families_to_maxtext_and_back_are_the_identity() {
    for (family, qk_norm) in [("llama", false), ("mistral", false), ("qwen3", true)] {
        let d = Dir::new();
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf_models")
            .join(family);
        let config = src.join("config.json");
        d.ok(&[
            "reshard",
            src.to_str().unwrap(),
            "--format",
            "maxtext",
            "--to",
            "1",
            "-o",
            "mx",
        ]);
        d.ok(&["merge", d.path("mx").to_str().unwrap(), "-o", "plain"]);
        let tree = tensors(&d.path("plain/model.safetensors"));
        let q = &tree["params.params.decoder.layers.self_attention.query.kernel"].0;
        assert_eq!(q.len(), 4, "{family}: {q:?}");
        assert_eq!(
            tree.contains_key("params.params.decoder.layers.self_attention.query_norm.scale"),
            qk_norm,
            "{family}"
        );
        d.ok(&[
            "merge",
            d.path("mx").to_str().unwrap(),
            "--format",
            "hf",
            "--hf-config",
            config.to_str().unwrap(),
            "-o",
            "hf",
        ]);
        let (a, b) = (
            tensors(&src.join("model.safetensors")),
            tensors(&d.path("hf/model.safetensors")),
        );
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        let head_dim = (cfg(&config, "head_dim")).unwrap_or(
            cfg(&config, "hidden_size").unwrap() / cfg(&config, "num_attention_heads").unwrap(),
        );
        for (name, (shape, bytes)) in &a {
            assert_eq!(&b[name].0, shape, "{family}: {name}");
            if name.ends_with("q_proj.weight") && !qk_norm && head_dim == 8 {
                // sqrt(8) is no power of two: the query is rounded going to MaxText
                // (times 1/sqrt(8)) and back (times sqrt(8)), as MaxText's own
                // converter rounds it: within an ulp or two.
                for (x, y) in f32s(bytes).iter().zip(f32s(&b[name].1)) {
                    assert!(
                        (x - y).abs() <= x.abs() * 2.5e-7,
                        "{family}: {name}: {x} vs {y}"
                    );
                }
            } else {
                assert!(&b[name].1 == bytes, "{family}: {name}: bytes differ");
            }
        }
    }
}

fn cfg(path: &Path, key: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    v.get(key).and_then(serde_json::Value::as_u64)
}

// ----------------------------------------------------------------------------------
// MaxText's unscanned tree (`scan_layers=False`: `decoder.layers_<l>.*`, each layer's
// weights without the layer axis): tests/fixtures/maxtext/unscanned, another draw of
// the same model (its config is the scanned fixture's).

/// The unscanned fixture's stored arrays (a plain merge), by name.
fn stored_unscanned(d: &Dir) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let ckpt = fixture("unscanned/ckpt");
    d.ok(&["merge", ckpt.to_str().unwrap(), "-o", "plain_unscanned"]);
    tensors(&d.path("plain_unscanned/model.safetensors"))
        .into_iter()
        .filter(|(n, _)| n.starts_with("params.params."))
        .map(|(n, (s, b))| (n, (s, f32s(&b))))
        .collect()
}

/// An unscanned tree's layers stacked as the scanned tree's (`layers_<l>.<rest>`
/// into `layers.<rest>`, layer `l` at index `l` of a new axis 1), the rest as it is.
fn restack(
    m: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = BTreeMap::new();
    for (name, (shape, values)) in m {
        let Some(rest) = name.strip_prefix("params.params.decoder.layers_") else {
            out.insert(name.clone(), (shape.clone(), values.clone()));
            continue;
        };
        let (l, rest) = rest.split_once('.').unwrap();
        let l: usize = l.parse().unwrap();
        assert!(l < L, "{name}");
        let inner: usize = shape[1..].iter().product();
        let mut stacked_shape = shape.clone();
        stacked_shape.insert(1, L);
        let stacked = out
            .entry(format!("params.params.decoder.layers.{rest}"))
            .or_insert_with(|| (stacked_shape.clone(), vec![f32::NAN; values.len() * L]));
        assert_eq!(stacked.0, stacked_shape, "{name}");
        for i0 in 0..shape[0] {
            let from = i0 * inner;
            let to = (i0 * L + l) * inner;
            stacked.1[to..to + inner].copy_from_slice(&values[from..from + inner]);
        }
    }
    out
}

fn export_unscanned(d: &Dir, out: &str) {
    export_from(d, "unscanned/ckpt", out);
}

#[test]
fn unscanned_maxtext_to_hf_is_each_layer_transposed_scaled_and_unrotated() {
    let d = Dir::new();
    let tree = stored_unscanned(&d);
    // MaxText's unscanned shapes: no layer axis.
    let shape = |n: &str| tree[&format!("params.params.decoder.{n}")].0.clone();
    for l in 0..L {
        assert_eq!(
            shape(&format!("layers_{l}.self_attention.query.kernel")),
            [E, H, D]
        );
        assert_eq!(
            shape(&format!("layers_{l}.self_attention.key.kernel")),
            [E, KV, D]
        );
        assert_eq!(
            shape(&format!("layers_{l}.self_attention.out.kernel")),
            [H, D, E]
        );
        assert_eq!(shape(&format!("layers_{l}.mlp.wo.kernel")), [F, E]);
        assert_eq!(
            shape(&format!("layers_{l}.pre_self_attention_layer_norm.scale")),
            [E]
        );
    }
    assert!(!tree.keys().any(|n| n.contains("decoder.layers.")));
    let stacked = restack(&tree);
    assert!(stacked.values().all(|(_, v)| v.iter().all(|x| !x.is_nan())));
    let want = expected_hf(&stacked);
    export_unscanned(&d, "hf");
    let got = tensors(&d.path("hf/model.safetensors"));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, w) in &want {
        assert!(got[name].1 == bytes(w), "{name}: bytes differ");
    }
}

#[test]
fn hf_to_unscanned_maxtext_and_back_is_the_identity() {
    let d = Dir::new();
    export_unscanned(&d, "hf");
    // Sharded on 2 devices: the heads and the MLP split (no layer axis here).
    d.ok(&[
        "reshard",
        d.path("hf").to_str().unwrap(),
        "--format",
        "maxtext",
        "--maxtext-scan-layers",
        "false",
        "--to",
        "2",
        "--shard",
        "*.query.kernel=1,*.key.kernel=1,*.mlp.wi_*=1,*.mlp.wo.kernel=0,*.out.kernel=0",
        "-o",
        "mx",
    ]);
    // Byte for byte the tree MaxText saved (sqrt(16) = 4: the query scaling is exact).
    let original = stored_unscanned(&d);
    d.ok(&["merge", d.path("mx").to_str().unwrap(), "-o", "mx_plain"]);
    let again = tensors(&d.path("mx_plain/model.safetensors"));
    assert_eq!(
        again.keys().collect::<Vec<_>>(),
        original.keys().collect::<Vec<_>>()
    );
    for (name, (shape, values)) in &original {
        assert_eq!(&again[name].0, shape, "{name}");
        assert!(again[name].1 == bytes(values), "{name}: bytes differ");
    }
    // Each device's box a chunk: the query kernel [E, H, D] cut on the heads.
    let inspect = d.ok(&["inspect", d.path("mx").to_str().unwrap()]);
    assert!(
        inspect
            .stdout
            .contains("params.params.decoder.layers_1.self_attention.query.kernel"),
        "{}",
        inspect.stdout
    );
    // And back to Hugging Face: byte for byte the first export.
    let config = fixture("config.json");
    d.ok(&[
        "merge",
        d.path("mx").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        "hf2",
    ]);
    assert_eq!(
        tensors(&d.path("hf/model.safetensors")),
        tensors(&d.path("hf2/model.safetensors"))
    );
    // The scanned fixture's export written unscanned and read back: the same model.
    export(&d, "hf_scanned");
    d.ok(&[
        "reshard",
        d.path("hf_scanned").to_str().unwrap(),
        "--format",
        "maxtext",
        "--maxtext-scan-layers",
        "false",
        "--to",
        "2",
        "--shard",
        "*.query.kernel=1,*.key.kernel=1,*.mlp.wi_*=1,*.mlp.wo.kernel=0,*.out.kernel=0",
        "-o",
        "mx_scanned",
    ]);
    d.ok(&[
        "merge",
        d.path("mx_scanned").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        config.to_str().unwrap(),
        "-o",
        "hf_scanned2",
    ]);
    assert_eq!(
        tensors(&d.path("hf_scanned/model.safetensors")),
        tensors(&d.path("hf_scanned2/model.safetensors"))
    );
}

#[test]
fn unscanned_refusals_are_named_and_write_nothing() {
    let d = Dir::new();
    let ckpt = fixture("unscanned/ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("config.json")).unwrap()).unwrap();
    // A config of 3 layers: layer 2's first weight named, missing.
    let mut three = config;
    three["num_hidden_layers"] = serde_json::json!(3);
    std::fs::write(d.path("three.json"), three.to_string()).unwrap();
    let o = d.fails(&[
        "merge",
        ckpt,
        "--format",
        "hf",
        "--hf-config",
        d.path("three.json").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(
        o.stderr
            .contains("params.params.decoder.layers_2.self_attention.query.kernel")
            && o.stderr.contains("missing"),
        "{}",
        o.stderr
    );
    // Scanned and unscanned layers in one tree: refused.
    let scanned = fixture("ckpt");
    d.ok(&[
        "merge",
        scanned.to_str().unwrap(),
        "--include",
        "params.params.decoder.layers.*",
        "-o",
        "s",
    ]);
    d.ok(&["merge", ckpt, "-o", "u"]);
    let o = d.fails(&[
        "merge",
        d.path("u/model.safetensors").to_str().unwrap(),
        d.path("s/model.safetensors").to_str().unwrap(),
        "--format",
        "hf",
        "--hf-config",
        fixture("config.json").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("params.params.decoder.layers.") && o.stderr.contains("unscanned layers"),
        "{}",
        o.stderr
    );
    // The flag belongs to --format maxtext: a usage error (exit 2).
    let o = d.ckpt(&[
        "reshard",
        ckpt,
        "--maxtext-scan-layers",
        "false",
        "--to",
        "1",
        "-o",
        "out",
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("--format maxtext"), "{}", o.stderr);
    assert!(!d.path("out").exists());
}
