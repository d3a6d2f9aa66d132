//! Megatron checkpoints written by megatron-core itself (tests/fixtures/megatron, made
//! by scripts/fixtures/megatron_fixtures.py): a tiny GPTModel on tensor parallel 2 x
//! pipeline 2, saved as a dist_ckpt (torch_dist) and as a legacy
//! `iter_*/mp_rank_TT_PPP/model_optim_rng.pt` checkpoint, with the full tensors gathered
//! by Megatron's own parameter attributes (`full.safetensors`) and torch's unsharding of
//! the dist_ckpt (`dist_full.safetensors`).

use crate::util::{copy_dir, full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub(crate) fn megatron_fixtures() -> PathBuf {
    fixtures()
}

/// The fixture's sizes (scripts/fixtures/megatron_fixtures.py): hidden 16, a vocabulary
/// of 50 tokens padded to 64 rows for TP=2, 4 attention heads in 2 query groups of
/// kv_channels 4, 4 layers; fp32.
const HIDDEN: usize = 16;
const VOCAB: usize = 50;
const HEADS: usize = 4;
const GROUPS: usize = 2;
const KV: usize = 4;
const F32: usize = 4;

/// `full` with the vocabulary's padding rows dropped, as `merge` gives it by default.
pub(crate) fn unpadded(mut full: BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Vec<u8>> {
    for name in ["embedding.word_embeddings.weight", "output_layer.weight"] {
        let t = full.get_mut(name).unwrap();
        assert!(t.len() > VOCAB * HIDDEN * F32, "{name} is not padded");
        t.truncate(VOCAB * HIDDEN * F32);
    }
    full
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/tp2pp2")
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).display().to_string()
}

/// A copy of the legacy checkpoint to damage.
pub(crate) fn legacy_copy(d: &Dir) -> PathBuf {
    let to = d.path("legacy");
    copy_dir(&fixtures().join("legacy"), &to);
    to
}

/// Replaces the one occurrence of `old` in a file by `new` (same length: the pickle's
/// framing and the zip directory stay valid).
pub(crate) fn patch(path: &Path, old: &[u8], new: &[u8]) {
    assert_eq!(old.len(), new.len());
    let mut b = std::fs::read(path).unwrap();
    let at: Vec<usize> = b
        .windows(old.len())
        .enumerate()
        .filter(|(_, w)| *w == old)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        at.len(),
        1,
        "{} occurrences in {}",
        at.len(),
        path.display()
    );
    b[at[0]..at[0] + old.len()].copy_from_slice(new);
    std::fs::write(path, b).unwrap();
}

const RANK_01_001: &str = "iter_0000001/mp_rank_01_001/model_optim_rng.pt";

#[test]
fn legacy_tp_pp_merges_byte_exactly() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("full.safetensors"));
    let o = d.ok(&["inspect", &fx("legacy")]);
    assert!(
        o.stdout
            .contains("sliced checkpoint, 4 file(s) on mesh pp=2,tp=2, 53 tensors"),
        "{}",
        o.stdout
    );
    // Layer 1 of stage 1 is layer 3; its qkv split on dim 0, proj on dim 1.
    assert!(
        o.stdout.lines().any(|l| l
            .starts_with("decoder.layers.3.self_attention.linear_qkv.weight ")
            && l.contains("[32, 16]")
            && l.contains("tp:Shard(0) stage 1")),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.lines().any(|l| l
            .starts_with("decoder.layers.3.self_attention.linear_proj.weight ")
            && l.contains("tp:Shard(1) stage 1")),
        "{}",
        o.stdout
    );
    let notes = format!("{}{}", o.stdout, o.stderr);
    assert!(
        notes.contains("args, checkpoint_version, iteration, rng_state")
            && notes.contains("padded from 50 to 64 rows"),
        "{notes}"
    );
    let o = d.ok(&["verify", &fx("legacy")]);
    assert!(
        o.stdout.contains("every element owned exactly once"),
        "{}",
        o.stdout
    );
    d.ok(&["merge", &fx("legacy"), "-o", "m", "--keep-vocab-padding"]);
    assert_eq!(full_tensors(&d.path("m")), want);
    // The iteration directory itself reads the same.
    d.ok(&[
        "merge",
        &fx("legacy/iter_0000001"),
        "-o",
        "m2",
        "--keep-vocab-padding",
    ]);
    assert_eq!(full_tensors(&d.path("m2")), want);
    // By default the padding rows args.vocab_size says are padding are dropped.
    let o = d.ok(&["merge", &fx("legacy"), "-o", "m3"]);
    assert!(
        o.stderr.contains("unpadded from 64 to 50 rows"),
        "{}",
        o.stderr
    );
    assert_eq!(full_tensors(&d.path("m3")), unpadded(want));
}

/// `merge --split-qkv`: each fused projection becomes linear_q, linear_k and linear_v,
/// cut from the full tensors Megatron gathered by megatron-core's own split
/// (get_query_key_value_tensors: per query group, HEADS/GROUPS query heads, one key
/// head, one value head, KV rows each); every other tensor as without the option.
#[test]
fn legacy_merge_splits_fused_qkv_in_megatron_order() {
    let d = Dir::new();
    let full = unpadded(full_tensors(&fixtures().join("full.safetensors")));
    d.ok(&["merge", &fx("legacy"), "-o", "s", "--split-qkv"]);
    let got = full_tensors(&d.path("s"));
    let per_group = HEADS / GROUPS;
    let mut want = BTreeMap::new();
    for (name, bytes) in &full {
        let Some(at) = name.find("linear_qkv.") else {
            want.insert(name.clone(), bytes.clone());
            continue;
        };
        // A weight's row is HIDDEN values, a bias's one.
        let row = if name.ends_with(".weight") {
            HIDDEN * F32
        } else {
            F32
        };
        let rows = |r: std::ops::Range<usize>| bytes[r.start * row..r.end * row].to_vec();
        let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
        for g in 0..GROUPS {
            let base = g * (per_group + 2) * KV;
            q.extend(rows(base..base + per_group * KV));
            k.extend(rows(base + per_group * KV..base + (per_group + 1) * KV));
            v.extend(rows(
                base + (per_group + 1) * KV..base + (per_group + 2) * KV,
            ));
        }
        let rest = &name[at + "linear_qkv".len()..];
        for (part, b) in [("linear_q", q), ("linear_k", k), ("linear_v", v)] {
            want.insert(format!("{}{part}{rest}", &name[..at]), b);
        }
    }
    assert!(
        got.keys().any(|n| n.contains("linear_k.bias")),
        "{:?}",
        got.keys()
    );
    assert_eq!(got, want);
    // Shapes: q [HEADS*KV, HIDDEN], k and v [GROUPS*KV, HIDDEN].
    let o = d.ok(&["inspect", "s"]);
    for (part, rows) in [("linear_q", HEADS * KV), ("linear_k", GROUPS * KV)] {
        let line = format!("decoder.layers.0.self_attention.{part}.weight");
        assert!(
            o.stdout
                .lines()
                .any(|l| l.starts_with(&line) && l.contains(&format!("[{rows}, {HIDDEN}]"))),
            "{}",
            o.stdout
        );
    }
    // Only a Megatron legacy checkpoint has projections ckpt splits: refused elsewhere.
    let o = d.fails(&["merge", "s", "-o", "t", "--split-qkv"]);
    assert!(
        o.stderr
            .contains("--split-qkv: only a Megatron legacy checkpoint"),
        "{}",
        o.stderr
    );
    assert!(!d.path("t").exists());
}

#[test]
fn legacy_reshards_to_other_tensor_parallel_sizes() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("full.safetensors"));
    for (how, n) in [("--to", "1"), ("--to", "4"), ("--mesh", "pp=1,tp=2")] {
        let out = format!("r{n}{}", how.len());
        d.ok(&["reshard", &fx("legacy"), how, n, "-o", &out]);
        let m = format!("m{out}");
        d.ok(&["merge", &out, "-o", &m]);
        assert_eq!(full_tensors(&d.path(&m)), want, "{how} {n}");
    }
    let s = std::fs::read_to_string(d.path("r44/strategy.json")).unwrap();
    let s: serde_json::Value = serde_json::from_str(&s).unwrap();
    let t = &s["tensors"]["decoder.layers.2.mlp.linear_fc2.weight"];
    assert_eq!(
        t["placements"][t["placements"].as_array().unwrap().len() - 1],
        "Shard(1)"
    );
}

#[test]
fn dist_ckpt_merges_and_reshards_byte_exactly() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("dist_full.safetensors"));
    let o = d.ok(&["inspect", &fx("dist_ckpt")]);
    assert!(o.stdout.contains("17 tensors"), "{}", o.stdout);
    let notes = format!("{}{}", o.stdout, o.stderr);
    assert!(
        notes.contains("Megatron dist_ckpt (torch_dist), saved on tensor parallel 2 x pipeline 2")
            && notes.contains("common.pt holds args, checkpoint_version, iteration"),
        "{notes}"
    );
    d.ok(&["verify", &fx("dist_ckpt")]);
    d.ok(&["merge", &fx("dist_ckpt"), "-o", "m"]);
    assert_eq!(full_tensors(&d.path("m")), want);
    d.ok(&["reshard", &fx("dist_ckpt"), "--to", "3", "-o", "r3"]);
    d.ok(&["merge", "r3", "-o", "m3"]);
    assert_eq!(full_tensors(&d.path("m3")), want);
    // The stacked layer tensors of the dist_ckpt are the legacy layers, one per index.
    let legacy = full_tensors(&fixtures().join("full.safetensors"));
    let stacked = &want["decoder.layers.self_attention.linear_qkv.weight"];
    let one = &legacy["decoder.layers.2.self_attention.linear_qkv.weight"];
    assert_eq!(&stacked[2 * one.len()..3 * one.len()], &one[..]);
}

#[test]
fn dist_ckpt_of_another_backend_is_refused() {
    let d = Dir::new();
    let to = d.path("dc");
    copy_dir(&fixtures().join("dist_ckpt"), &to);
    std::fs::write(to.join("metadata.json"), r#"{"sharded_backend": "zarr"}"#).unwrap();
    let o = d.fails(&["merge", "dc", "-o", "m"]);
    assert!(
        o.stderr.contains("sharded_backend `zarr`") && o.stderr.contains("metadata.json"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

#[test]
fn missing_rank_directory_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    std::fs::remove_dir_all(l.join("iter_0000001/mp_rank_01_000")).unwrap();
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr
            .contains("mp_rank_01_000/model_optim_rng.pt: missing")
            && o.stderr.contains("rank tp=1 pp=0"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

#[test]
fn truncated_rank_file_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    let f = l.join(RANK_01_001);
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_01_001/model_optim_rng.pt") && o.stderr.contains("zip archive"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

/// A storage's zip local header, where the central directory puts it, damaged: named
/// (file, zip entry, byte), exit 1, nothing written. (A local file's headers are read at
/// open; an object's when its tensor is copied: tests/storage.rs.)
#[test]
fn a_damaged_local_header_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    damage_local_header(&l.join(RANK_01_001), "/data/10");
    for cmd in [&["merge", "legacy", "-o", "m"][..], &["verify", "legacy"]] {
        let o = d.fails(cmd);
        let said = format!("{}{}", o.stdout, o.stderr);
        assert!(
            said.contains("mp_rank_01_001/model_optim_rng.pt")
                && said.contains("/data/10`: no local header at byte"),
            "{cmd:?}: {said}"
        );
    }
    assert!(!d.path("m").exists());
}

/// Breaks the signature of the local header of the zip entry whose name ends in `entry`.
pub(crate) fn damage_local_header(file: &Path, entry: &str) {
    let mut b = std::fs::read(file).unwrap();
    let header = (0..b.len() - 30)
        .find(|&i| {
            let n = u16::from_le_bytes([b[i + 26], b[i + 27]]) as usize;
            b[i..].starts_with(b"PK\x03\x04")
                && b.get(i + 30..i + 30 + n)
                    .is_some_and(|name| name.ends_with(entry.as_bytes()))
        })
        .expect("the entry's local header");
    b[header] = b'X';
    std::fs::write(file, &b).unwrap();
}

#[test]
fn args_that_contradict_the_files_are_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    // args.padded_vocab_size 64 -> 96 in the file args are read from (BININT1 0x40).
    let first = l.join("iter_0000001/mp_rank_00_000/model_optim_rng.pt");
    patch(
        &first,
        b"padded_vocab_sizeq\x13K\x40",
        b"padded_vocab_sizeq\x13K\x60",
    );
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_00_000/model_optim_rng.pt")
            && o.stderr.contains("`embedding.word_embeddings.weight`")
            && o.stderr.contains("args give it the global shape [96, 16]")
            && o.stderr.contains("contradict"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

#[test]
fn a_tensor_the_rules_cannot_place_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    patch(
        &l.join(RANK_01_001),
        b"output_layer.weight",
        b"output_layex.weight",
    );
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_01_001/model_optim_rng.pt")
            && o.stderr.contains("`output_layex.weight`")
            && o.stderr.contains("no rule places")
            && o.stderr.contains("--source-strategy"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

#[test]
fn a_stage_holding_another_stages_tensor_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    // Stage 0's file where stage 1's should be: its embedding is on the wrong stage.
    std::fs::copy(
        l.join("iter_0000001/mp_rank_01_000/model_optim_rng.pt"),
        l.join(RANK_01_001),
    )
    .unwrap();
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("`embedding.word_embeddings.weight`")
            && o.stderr.contains("held by pipeline stage 1"),
        "{}",
        o.stderr
    );
}

/// The fuzz target's body (fuzz/fuzz_targets/megatron.rs) on damaged copies of its seed,
/// so that every test run covers it without cargo-fuzz: truncations and flipped bytes of
/// the rank file args are read from give errors or a checked checkpoint, never a panic.
#[test]
fn damaged_rank_files_never_panic() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    let f = l.join("iter_0000001/mp_rank_00_000/model_optim_rng.pt");
    let orig = std::fs::read(&f).unwrap();
    let mut cases: Vec<Vec<u8>> = (0..orig.len())
        .step_by(orig.len() / 40 + 1)
        .map(|cut| orig[..cut].to_vec())
        .collect();
    for i in (0..orig.len()).step_by(61) {
        let mut b = orig.clone();
        b[i] ^= 0xff;
        cases.push(b);
    }
    let (mut opened, mut refused) = (0, 0);
    for b in cases {
        std::fs::write(&f, &b).unwrap();
        match ckpt_core::Checkpoint::scan(std::slice::from_ref(&l)) {
            Ok((ck, _)) => {
                opened += 1;
                for file in &ck.files {
                    // A storage's local header is read with its tensor: damaged, the
                    // tensor has no bytes and locating it says why.
                    let damaged = file.locate_all();
                    for (i, t) in file.tensors().iter().enumerate() {
                        match file.data(i) {
                            Some(bytes) => assert_eq!(bytes.len() as u64, t.end - t.start),
                            None => assert!(!damaged.is_empty(), "{}: no bytes", t.name),
                        }
                    }
                }
            }
            Err(_) => refused += 1,
        }
    }
    // Both kinds happen: flips inside tensor data still open, truncations do not.
    assert!(
        opened > 0 && refused > 0,
        "{opened} opened, {refused} refused"
    );
}

/// `reshard --format megatron`: Megatron's legacy layout for another TP x PP, read back
/// by ckpt's own reader to the same full tensors.
#[test]
fn legacy_written_back_for_other_sizes_reads_back() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("full.safetensors"));
    for (how, n, dirs) in [
        ("--to", "4", vec!["mp_rank_00", "mp_rank_03"]),
        (
            "--mesh",
            "pp=4,tp=1",
            vec!["mp_rank_00_000", "mp_rank_00_003"],
        ),
        ("--mesh", "pp=2,tp=2", vec!["mp_rank_01_001"]),
    ] {
        let out = format!("w{}", n.replace([',', '='], "_"));
        d.ok(&[
            "reshard",
            &fx("legacy"),
            how,
            n,
            "--format",
            "megatron",
            "-o",
            &out,
        ]);
        assert_eq!(
            std::fs::read_to_string(d.path(&out).join("latest_checkpointed_iteration.txt"))
                .unwrap(),
            "1"
        );
        for dir in dirs {
            let f = d
                .path(&out)
                .join("iter_0000001")
                .join(dir)
                .join("model_optim_rng.pt");
            assert!(f.is_file(), "{}", f.display());
        }
        let m = format!("m{out}");
        d.ok(&["merge", &out, "-o", &m, "--keep-vocab-padding"]);
        assert_eq!(full_tensors(&d.path(&m)), want, "{how} {n}");
    }
    // Stage 3 of 4 holds layer 3 as its layer 0, and the last stage's tensors.
    let o = d.ok(&["inspect", "wpp_4_tp_1"]);
    assert!(o.stdout.contains("on mesh pp=4,tp=1"), "{}", o.stdout);
    // The args say the new sizes: the written files read back as that mesh.
    let o = d.ok(&["inspect", "w4"]);
    assert!(o.stdout.contains("on mesh tp=4"), "{}", o.stdout);
    // 4 heads (and 64 vocabulary rows) do not split over 3 TP ranks: refused, nothing
    // written.
    let o = d.fails(&[
        "reshard",
        &fx("legacy"),
        "--to",
        "3",
        "--format",
        "megatron",
        "-o",
        "w3",
    ]);
    assert!(
        o.stderr
            .contains("num_attention_heads 4 does not divide by tensor parallel 3"),
        "{}",
        o.stderr
    );
    assert!(!d.path("w3").exists());
    // Only from a Megatron source (its args are carried).
    let o = d.fails(&[
        "reshard",
        &fx("dist_ckpt"),
        "--to",
        "2",
        "--format",
        "megatron",
        "-o",
        "wd",
    ]);
    assert!(o.stderr.contains("Megatron legacy source"), "{}", o.stderr);
}

/// Virtual pipeline stages: megatron-core's own interleaved chunks (`model0`, `model1`
/// per rank file, TP=2 x PP=2 x VP=2, scripts/fixtures/megatron_vp_fixtures.py), seeded
/// by global names as the plain fixture is, so they merge to the same full tensors;
/// resharded to Megatron's layout without virtual stages they read back the same.
#[test]
fn legacy_virtual_pipeline_chunks_merge_to_the_same_model() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("full.safetensors"));
    let vp = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron/tp2pp2vp2/legacy")
        .display()
        .to_string();
    let o = d.ok(&["inspect", &vp]);
    // Layer 2 is chunk 1 of stage 0: placed on stage 0 under its global number.
    assert!(
        o.stdout.lines().any(|l| l
            .starts_with("decoder.layers.2.self_attention.linear_qkv.weight ")
            && l.contains("stage 0")),
        "{}",
        o.stdout
    );
    d.ok(&["merge", &vp, "-o", "m", "--keep-vocab-padding"]);
    assert_eq!(full_tensors(&d.path("m")), want);
    d.ok(&[
        "reshard",
        &vp,
        "--mesh",
        "pp=2,tp=1",
        "--format",
        "megatron",
        "-o",
        "w",
    ]);
    d.ok(&["merge", "w", "-o", "mw", "--keep-vocab-padding"]);
    assert_eq!(full_tensors(&d.path("mw")), want);
}

/// Each rank's `rng_state` is carried to the same rank when the TP x PP grid stays
/// (here: virtual stages dropped), and to no rank of another grid, where Megatron
/// ignores it (scripts/megatron_rng_check.py has torch.load compare the values).
#[test]
fn legacy_rng_state_is_carried_to_the_same_grid_only() {
    let d = Dir::new();
    let vp = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron/tp2pp2vp2/legacy")
        .display()
        .to_string();
    for (mesh, out, carried) in [("pp=2,tp=2", "same", true), ("pp=1,tp=4", "other", false)] {
        d.ok(&[
            "reshard", &vp, "--mesh", mesh, "--format", "megatron", "-o", out,
        ]);
        // ckpt reads back what the written files hold beside their tensors.
        let o = d.ok(&["inspect", out]);
        let note = o
            .stderr
            .lines()
            .chain(o.stdout.lines())
            .find(|l| l.contains("read, not tensors:"))
            .unwrap_or_else(|| {
                panic!(
                    "{mesh}: no note of the entries read: {}{}",
                    o.stdout, o.stderr
                )
            })
            .to_string();
        let held = note
            .split("read, not tensors: ")
            .nth(1)
            .and_then(|l| l.split(" (").next())
            .unwrap_or_default();
        let held: Vec<&str> = held.split(", ").collect();
        assert_eq!(held.contains(&"rng_state"), carried, "{mesh}: {note}");
        assert!(held.contains(&"args"), "{mesh}: {note}");
    }
}

/// `--step N` reads iteration N of a save directory (not the tracker's newest), and is
/// refused, naming the iterations there are, when the save has no such iteration or
/// an iteration directory given is another step: never another step's weights.
#[test]
fn step_picks_an_iteration_or_is_refused() {
    let d = Dir::new();
    let save = legacy_copy(&d);
    // A second iteration beside the first, and the tracker naming it.
    copy_dir(&save.join("iter_0000001"), &save.join("iter_0000007"));
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "7").unwrap();
    let first = save.join("iter_0000001/mp_rank_00_000/model_optim_rng.pt");
    std::fs::remove_file(save.join("iter_0000007/mp_rank_00_000/model_optim_rng.pt")).unwrap();
    // Newest (7, damaged) by default; --step 1 reads iteration 1.
    let o = d.fails(&["merge", "legacy", "-o", "newest"]);
    assert!(o.stderr.contains("iter_0000007"), "{}", o.stderr);
    d.ok(&[
        "merge",
        "legacy",
        "--step",
        "1",
        "-o",
        "one",
        "--keep-vocab-padding",
    ]);
    assert_eq!(
        full_tensors(&d.path("one")),
        full_tensors(&fixtures().join("full.safetensors"))
    );
    let o = d.fails(&["merge", "legacy", "--step", "5", "-o", "five"]);
    assert!(
        o.stderr
            .contains("no checkpoint of step 5 (iter_0000005/); steps here: 1, 7"),
        "{}",
        o.stderr
    );
    let o = d.fails(&["merge", "legacy/iter_0000001", "--step", "7", "-o", "other"]);
    assert!(
        o.stderr
            .contains("--step 7, but this is the checkpoint of iteration 1"),
        "{}",
        o.stderr
    );
    assert!(first.is_file());
    for out in ["newest", "five", "other"] {
        assert!(!d.path(out).exists(), "{out}");
    }
}
