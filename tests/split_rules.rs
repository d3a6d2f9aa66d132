//! Split rules given by the user (`--source-strategy` with a `rules` section) for
//! checkpoints whose files do not say how tensors are split: Megatron legacy tensors
//! megatron-core's table does not know, and DeepSpeed with tensor parallelism
//! (tests/fixtures/deepspeed_tp, made by scripts/fixtures/deepspeed_tp_fixtures.py with
//! DeepSpeed itself on 4 CPU ranks, tensor parallel 2 x data parallel 2).

use crate::megatron::{legacy_copy, megatron_fixtures, patch, unpadded};
use crate::util::{full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn ds_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepspeed_tp")
}

fn ds(rel: &str) -> String {
    ds_fixtures().join(rel).display().to_string()
}

/// The fixture's own split, as the user would write it (the committed
/// tests/fixtures/deepspeed_tp/rules.json, which docs/examples.md's example passes too).
const DS_RULES: &str = include_str!("fixtures/deepspeed_tp/rules.json");

/// Renames every stage's `mlp.linear_fc2.weight` (layers 0 and 1 of each stage) to
/// `mlp.linear_xx2.weight`, a name megatron-core's table does not know (same length:
/// the files stay valid).
fn unknown_fc2(l: &Path) {
    for rank in [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ] {
        let f = l.join("iter_0000001").join(rank).join("model_optim_rng.pt");
        for n in ["0", "1"] {
            patch(
                &f,
                format!("layers.{n}.mlp.linear_fc2.weight").as_bytes(),
                format!("layers.{n}.mlp.linear_xx2.weight").as_bytes(),
            );
        }
    }
}

#[test]
fn megatron_tensor_outside_the_table_is_refused_then_merged_by_a_user_rule() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    unknown_fc2(&l);
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("decoder.layers.0.mlp.linear_xx2.weight")
            && o.stderr.contains("no rule places")
            && o.stderr.contains("--source-strategy"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
    std::fs::write(
        d.path("rules.json"),
        r#"{"rules": [{"match": "decoder.layers.*.mlp.linear_xx2.weight", "split": 1}]}"#,
    )
    .unwrap();
    // Megatron's own full tensors, under the new name.
    let want: BTreeMap<String, Vec<u8>> =
        full_tensors(&megatron_fixtures().join("full.safetensors"))
            .into_iter()
            .map(|(k, v)| (k.replace("linear_fc2.weight", "linear_xx2.weight"), v))
            .collect();
    let rules = ["--source-strategy", "rules.json"];
    let o = d.ok(&[&["inspect", "legacy"][..], &rules].concat());
    assert!(
        o.stdout
            .lines()
            .any(|l| l.starts_with("decoder.layers.3.mlp.linear_xx2.weight ")
                && l.contains("tp:Shard(1) stage 1")),
        "{}",
        o.stdout
    );
    d.ok(&[&["verify", "legacy"][..], &rules].concat());
    d.ok(&[&["merge", "legacy", "-o", "m"][..], &rules].concat());
    // (merge drops the vocabulary's padding rows; a reshard keeps them.)
    assert_eq!(full_tensors(&d.path("m")), unpadded(want.clone()));
    d.ok(&[&["reshard", "legacy", "--to", "4", "-o", "r4"][..], &rules].concat());
    d.ok(&["merge", "r4", "-o", "m4"]);
    assert_eq!(full_tensors(&d.path("m4")), want);
}

#[test]
fn megatron_override_contradicting_the_shapes_is_refused_by_name() {
    let d = Dir::new();
    legacy_copy(&d);
    // Row-parallel linear_proj split on dim 0 would make it [32, 8]; args say [16, 16].
    std::fs::write(
        d.path("rules.json"),
        r#"{"rules": [{"match": "decoder.layers.*.self_attention.linear_proj.weight", "split": 0}]}"#,
    )
    .unwrap();
    let o = d.fails(&[
        "merge",
        "legacy",
        "--source-strategy",
        "rules.json",
        "-o",
        "m",
    ]);
    assert!(
        o.stderr.contains("self_attention.linear_proj.weight")
            && o.stderr.contains("args give it the global shape")
            && o.stderr
                .contains("rule `decoder.layers.*.self_attention.linear_proj.weight`")
            && o.stderr.contains("rules.json"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
    // A rule naming a dimension the tensor lacks.
    std::fs::write(
        d.path("rules.json"),
        r#"{"rules": [{"match": "*.final_layernorm.weight", "split": 1}]}"#,
    )
    .unwrap();
    let o = d.fails(&[
        "merge",
        "legacy",
        "--source-strategy",
        "rules.json",
        "-o",
        "m",
    ]);
    assert!(
        o.stderr.contains("decoder.final_layernorm.weight") && o.stderr.contains("dim 1"),
        "{}",
        o.stderr
    );
    // A malformed rules file: named, with the rule.
    std::fs::write(
        d.path("rules.json"),
        r#"{"rules": [{"match": "x", "dim": 0}]}"#,
    )
    .unwrap();
    let o = d.fails(&[
        "merge",
        "legacy",
        "--source-strategy",
        "rules.json",
        "-o",
        "m",
    ]);
    assert!(
        o.stderr
            .contains("rules.json: split rules: rule 0 (`x`): unknown key `dim`"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

fn split(all: BTreeMap<String, Vec<u8>>) -> (BTreeMap<String, Vec<u8>>, BTreeMap<String, Vec<u8>>) {
    all.into_iter().partition(|(k, _)| !k.starts_with("optim."))
}

/// Merges `variant` (with `extra` arguments) and compares weights and moments with
/// DeepSpeed's engines' own.
fn merges_to_expected(d: &Dir, variant: &str, extra: &[&str]) {
    let out = format!("m-{variant}");
    d.ok(&[
        &["merge", &ds(&format!("{variant}/ckpt")), "-o", &out][..],
        extra,
    ]
    .concat());
    let (weights, moments) = split(full_tensors(&d.path(&out)));
    let want = full_tensors(&ds_fixtures().join(variant).join("expected.safetensors"));
    assert_eq!(
        weights.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &want {
        assert!(
            weights[name] == *bytes,
            "{variant}: `{name}` differs from DeepSpeed's"
        );
    }
    let want = full_tensors(&ds_fixtures().join(variant).join("moments.safetensors"));
    assert_eq!(moments, want, "{variant}: moments");
}

#[test]
fn deepspeed_tensor_parallel_with_universal_checkpoint_info_merges_byte_exactly() {
    let d = Dir::new();
    merges_to_expected(&d, "zero2_uci", &[]);
    merges_to_expected(&d, "zero3_uci", &[]);
    let o = d.ok(&["inspect", &ds("zero2_uci/ckpt")]);
    assert!(
        o.stdout.contains("tensor parallel 2"),
        "{}{}",
        o.stdout,
        o.stderr
    );
    // --to N reshards (and merges back to the same bytes).
    d.ok(&["reshard", &ds("zero2_uci/ckpt"), "--to", "3", "-o", "r3"]);
    d.ok(&["merge", "r3", "-o", "m3"]);
    assert_eq!(
        full_tensors(&d.path("m3")),
        full_tensors(&d.path("m-zero2_uci"))
    );
    // Written back as DeepSpeed or UCP: not yet, said by name, nothing written.
    let o = d.fails(&[
        "reshard",
        &ds("zero2_uci/ckpt"),
        "--to",
        "2",
        "--format",
        "deepspeed",
        "-o",
        "w",
    ]);
    assert!(
        o.stderr.contains("mp_rank_01") && o.stderr.contains("not written back"),
        "{}",
        o.stderr
    );
    assert!(!d.path("w").exists());
    let o = d.fails(&["merge", &ds("zero2_uci/ckpt"), "--format", "ucp", "-o", "u"]);
    assert!(
        o.stderr
            .contains("tensor-parallel DeepSpeed checkpoint (mp_world_size 2)"),
        "{}",
        o.stderr
    );
    assert!(!d.path("u").exists());
}

#[test]
fn deepspeed_tensor_parallel_without_it_needs_user_rules() {
    let d = Dir::new();
    for v in ["zero2", "zero1_bf16"] {
        let o = d.fails(&["merge", &ds(&format!("{v}/ckpt")), "-o", "m"]);
        assert!(
            o.stderr.contains("mp_rank_00_model_states.pt")
                && o.stderr.contains("tensor `norm.weight`")
                && o.stderr.contains("--source-strategy"),
            "{v}: {}",
            o.stderr
        );
        assert!(!d.path("m").exists());
    }
    std::fs::write(d.path("rules.json"), DS_RULES).unwrap();
    merges_to_expected(&d, "zero2", &["--source-strategy", "rules.json"]);
    merges_to_expected(&d, "zero1_bf16", &["--source-strategy", "rules.json"]);
}

#[test]
fn deepspeed_tensor_parallel_bad_inputs_are_named_and_nothing_is_written() {
    let d = Dir::new();
    // A missing tensor-parallel rank.
    let to = d.path("ck");
    crate::util::copy_dir(&ds_fixtures().join("zero2_uci/ckpt"), &to);
    let tag = to.join("global_step2");
    for f in [
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ] {
        std::fs::remove_file(tag.join(f)).unwrap();
    }
    let o = d.fails(&["merge", "ck", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_01_model_states.pt")
            && o.stderr.contains("tensor-parallel rank 1 of 2"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
    // A user rule contradicting the shards: fused.weight's 6 rows in 4 blocks.
    std::fs::write(
        d.path("rules.json"),
        r#"{"rules": [{"match": "fused.weight", "split": 0, "blocks": 4}]}"#,
    )
    .unwrap();
    let o = d.fails(&[
        "merge",
        &ds("zero2_uci/ckpt"),
        "--source-strategy",
        "rules.json",
        "-o",
        "m",
    ]);
    assert!(
        o.stderr.contains("tensor `fused.weight`")
            && o.stderr.contains("in 4 block(s)")
            && o.stderr.contains("[6, 6]"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

/// The deepspeed_tp fuzz target's body (fuzz/fuzz_targets/deepspeed_tp.rs) on damaged
/// copies of tensor-parallel rank 1's files, so that every test run covers it without
/// cargo-fuzz: truncations and flipped bytes give errors or a checked checkpoint, never
/// a panic.
#[test]
fn damaged_tensor_parallel_files_never_panic() {
    let d = Dir::new();
    let to = d.path("ck");
    crate::util::copy_dir(&ds_fixtures().join("zero2_uci/ckpt"), &to);
    let (mut opened, mut refused) = (0, 0);
    for name in [
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ] {
        let f = to.join("global_step2").join(name);
        let orig = std::fs::read(&f).unwrap();
        let mut cases: Vec<Vec<u8>> = (0..orig.len())
            .step_by(orig.len() / 30 + 1)
            .map(|cut| orig[..cut].to_vec())
            .collect();
        for i in (0..orig.len()).step_by(53) {
            let mut b = orig.clone();
            b[i] ^= 0xff;
            cases.push(b);
        }
        for b in cases {
            std::fs::write(&f, &b).unwrap();
            match ckpt_core::Checkpoint::open(std::slice::from_ref(&to)) {
                Ok(ck) => {
                    opened += 1;
                    for file in &ck.files {
                        for (i, t) in file.tensors().iter().enumerate() {
                            assert_eq!(
                                file.data(i).map(<[u8]>::len),
                                Some((t.end - t.start) as usize)
                            );
                        }
                    }
                }
                Err(_) => refused += 1,
            }
        }
        std::fs::write(&f, &orig).unwrap();
    }
    assert!(
        opened > 0 && refused > 0,
        "{opened} opened, {refused} refused"
    );
}
