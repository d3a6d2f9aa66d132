//! MindSpore checkpoints written by MindSpore itself (tests/fixtures/mindspore, made by
//! scripts/fixtures/mindspore.py): per-rank `.ckpt` and safetensors files of a 2x2
//! device matrix with dim-0, dim-1 and 2-D splits, replicated, BF16, F16, I64 and 0-d
//! parameters, and their strategy files in both of MindSpore's forms.

use crate::util::{full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mindspore")
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).display().to_string()
}

/// The full tensors MindSpore sliced, by name.
fn originals() -> BTreeMap<String, Vec<u8>> {
    full_tensors(&fixtures().join("full.safetensors"))
}

/// Every tensor of one file, by name.
fn file_tensors(path: &Path) -> BTreeMap<String, (Vec<u64>, Vec<u8>)> {
    let f = ckpt_core::formats::TensorFile::open(path).unwrap();
    f.tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.clone(),
                (t.shape.clone(), f.data(i).unwrap().to_vec()),
            )
        })
        .collect()
}

#[test]
fn ckpt_files_with_either_strategy_form_merge_byte_exactly() {
    let d = Dir::new();
    for (dir, strategy) in [
        ("ckpt_fmt", "strategy.ckpt"),
        ("ckpt_fmt", "strategy.json"),
        ("safetensors_fmt", "strategy.ckpt"),
    ] {
        let out = format!("m-{dir}-{strategy}");
        let o = d.ok(&["verify", &fx(dir), "--source-strategy", &fx(strategy)]);
        assert!(
            o.stdout.starts_with("ok: 4 file(s), 7 tensors"),
            "{}",
            o.stdout
        );
        d.ok(&[
            "merge",
            &fx(dir),
            "--source-strategy",
            &fx(strategy),
            "-o",
            &out,
        ]);
        assert_eq!(
            full_tensors(&d.path(&out)),
            originals(),
            "{dir} with {strategy}"
        );
    }
    let o = d.ok(&[
        "inspect",
        &fx("ckpt_fmt"),
        "--source-strategy",
        &fx("strategy.ckpt"),
    ]);
    assert!(
        o.stdout
            .contains("sliced checkpoint, 4 file(s) on mesh d1=2,d0=2"),
        "{}",
        o.stdout
    );
    // The column split (tensor_map [-1, 0]) and the BF16 2-D split, as MindSpore laid them out.
    assert!(
        o.stdout.contains("proj.weight   F16     [4, 6]"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("d1:Replicate d0:Shard(1)"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("mlp.weight    BF16    [4, 8]"),
        "{}",
        o.stdout
    );
}

#[test]
fn the_only_strategy_beside_the_rank_directories_is_found() {
    let d = Dir::new();
    let root = d.path("run");
    std::fs::create_dir(&root).unwrap();
    for r in 0..4 {
        let rd = root.join(format!("rank_{r}"));
        std::fs::create_dir(&rd).unwrap();
        let f = format!("checkpoint_{r}.ckpt");
        std::fs::copy(
            fixtures().join(format!("ckpt_fmt/rank_{r}/{f}")),
            rd.join(&f),
        )
        .unwrap();
    }
    std::fs::copy(
        fixtures().join("strategy.ckpt"),
        root.join("src_strategy.ckpt"),
    )
    .unwrap();
    let o = d.ok(&["verify", "run"]);
    assert!(
        o.stdout
            .contains("note: MindSpore strategy: run/src_strategy.ckpt"),
        "{}",
        o.stdout
    );
    // Two strategy files: which one is meant is not guessed.
    std::fs::copy(fixtures().join("strategy.json"), root.join("other.json")).unwrap();
    let o = d.fails(&["verify", "run"]);
    assert!(
        o.stdout.contains("several MindSpore strategy files"),
        "{}",
        o.stdout
    );
}

#[test]
fn reshard_four_to_three_is_uneven_and_exact() {
    // MindSpore itself refuses 4 -> 3; ckpt splits unevenly (torch.chunk) and merges back.
    let d = Dir::new();
    d.ok(&[
        "reshard",
        &fx("ckpt_fmt"),
        "--source-strategy",
        &fx("strategy.ckpt"),
        "-o",
        "r3",
        "--to",
        "3",
    ]);
    let o = d.ok(&["inspect", "r3"]);
    assert!(
        o.stdout.contains("3 file(s) on mesh d1=1,d0=3"),
        "{}",
        o.stdout
    );
    assert_eq!(full_tensors(&d.path("r3")), originals());
}

#[test]
fn a_predict_strategy_slices_like_mindspore() {
    // The full tensors resharded by MindSpore's own strategy file give, rank by rank,
    // the very bytes MindSpore's slicing wrote into its per-rank checkpoints.
    let d = Dir::new();
    d.ok(&[
        "reshard",
        &fx("full.safetensors"),
        "-o",
        "p",
        "--strategy",
        &fx("strategy.json"),
        "--keep-all",
    ]);
    for r in 0..4 {
        let ours = file_tensors(&d.path(&format!("p/ckpt_{r}/model.safetensors")));
        let theirs =
            file_tensors(&fixtures().join(format!("ckpt_fmt/rank_{r}/checkpoint_{r}.ckpt")));
        assert_eq!(ours, theirs, "rank {r}");
    }
}

#[test]
fn without_a_strategy_per_rank_slices_are_refused() {
    let d = Dir::new();
    let o = d.fails(&["merge", &fx("ckpt_fmt"), "-o", "m"]);
    assert!(
        o.stderr.contains("tensor `embed.weight` is ambiguous: held by 4 files with the same shape [4, 6] but different bytes"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

#[test]
fn damaged_mindspore_inputs_are_named() {
    let d = Dir::new();
    let copy = |name: &str| {
        let root = d.path(name);
        for r in 0..4 {
            std::fs::create_dir_all(root.join(format!("rank_{r}"))).unwrap();
            let f = format!("rank_{r}/checkpoint_{r}.ckpt");
            std::fs::copy(fixtures().join("ckpt_fmt").join(&f), root.join(&f)).unwrap();
        }
        root
    };
    let s = fx("strategy.ckpt");
    // Truncated.
    let root = copy("trunc");
    let f = root.join("rank_1/checkpoint_1.ckpt");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() - 5]).unwrap();
    let o = d.fails(&["merge", "trunc", "--source-strategy", &s, "-o", "m"]);
    assert!(
        o.stderr
            .contains("trunc/rank_1/checkpoint_1.ckpt: invalid safetensors header: byte")
            || o.stderr.contains("truncated?"),
        "{}",
        o.stderr
    );
    // An unknown dtype name.
    let root = copy("dtype");
    let f = root.join("rank_2/checkpoint_2.ckpt");
    let b = std::fs::read(&f).unwrap();
    let i = b.windows(7).position(|w| w == b"Float32").unwrap();
    let mut b2 = b.clone();
    b2[i..i + 7].copy_from_slice(b"Floot32");
    std::fs::write(&f, b2).unwrap();
    let o = d.fails(&["merge", "dtype", "--source-strategy", &s, "-o", "m"]);
    assert!(
        o.stderr
            .contains("tensor_type `Floot32` is not a dtype ckpt reads"),
        "{}",
        o.stderr
    );
    // A missing rank.
    let root = copy("missing");
    std::fs::remove_dir_all(root.join("rank_2")).unwrap();
    let o = d.fails(&["verify", "missing", "--source-strategy", &s]);
    assert!(
        o.stdout
            .contains("rank 2 of 4 is missing (no rank_2/ checkpoint among the inputs)"),
        "{}",
        o.stdout
    );
    // A strategy that disagrees with the files: a parameter it does not describe, and
    // one it calls replicated though the ranks hold different columns (found by --deep).
    let json = std::fs::read_to_string(fixtures().join("strategy.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let items = doc["parallel_layout_item"].as_object_mut().unwrap();
    items.remove("tokens");
    items["proj.weight"]["tensor_map"] = serde_json::json!([-1, -1]);
    std::fs::write(d.path("wrong.json"), doc.to_string()).unwrap();
    let o = d.fails(&[
        "verify",
        &fx("ckpt_fmt"),
        "--source-strategy",
        "wrong.json",
        "--deep",
    ]);
    assert!(o.stdout.contains("tensor `tokens`: in "), "{}", o.stdout);
    assert!(
        o.stdout.contains("but not in the MindSpore strategy"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout
            .contains("tensor `proj.weight`: the copy of [0..4, 0..3] in "),
        "{}",
        o.stdout
    );
    assert!(!d.path("m").exists());
    // Not a strategy at all.
    let o = d.ckpt(&[
        "verify",
        &fx("ckpt_fmt"),
        "--source-strategy",
        &fx("full.safetensors"),
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("not a MindSpore strategy file"),
        "{}",
        o.stderr
    );
}

#[test]
fn pipeline_stage_files_combine() {
    let params = ckpt_core::formats::mindspore_strategy::read_mindspore_strategies(&[
        &fixtures().join("pipeline_stage0.ckpt"),
        &fixtures().join("pipeline_stage1.json"),
    ])
    .unwrap();
    let stages: BTreeMap<&str, u64> = params.iter().map(|(n, p)| (n.as_str(), p.stage)).collect();
    assert_eq!(
        stages,
        BTreeMap::from([
            ("embed.weight", 0),
            ("proj.weight", 0),
            ("mlp.weight", 0),
            ("norm.bias", 1),
            ("tokens", 1),
            ("global_step", 1),
        ])
    );
}

#[test]
fn mindspore_format_outputs_read_back_exactly() {
    // Our writer mirrors the layout of mindspore.save_checkpoint (checked with MindSpore
    // itself by scripts/mindspore_interop.py); our reader reads it back.
    let d = Dir::new();
    let s = fx("strategy.ckpt");
    d.ok(&[
        "merge",
        &fx("ckpt_fmt"),
        "--source-strategy",
        &s,
        "-o",
        "m",
        "--format",
        "mindspore",
    ]);
    assert_eq!(full_tensors(&d.path("m/model.ckpt")), originals());
    // A merged .ckpt holds the same framing MindSpore writes: same bytes as MindSpore's
    // own rank file for a tensor that is whole on every rank.
    let ours = file_tensors(&d.path("m/model.ckpt"));
    let theirs = file_tensors(&fixtures().join("ckpt_fmt/rank_0/checkpoint_0.ckpt"));
    assert_eq!(ours["norm.bias"], theirs["norm.bias"]);
    d.ok(&[
        "reshard",
        &fx("ckpt_fmt"),
        "--source-strategy",
        &s,
        "-o",
        "r3",
        "--to",
        "3",
        "--format",
        "mindspore",
    ]);
    for r in 0..3 {
        assert!(d
            .path(&format!("r3/rank_{r}/checkpoint_{r}.ckpt"))
            .is_file());
    }
    assert_eq!(full_tensors(&d.path("r3")), originals());
    let o = d.fails(&[
        "merge",
        "m",
        "-o",
        "m2",
        "--format",
        "mindspore",
        "--max-shard-size",
        "1KB",
    ]);
    assert!(
        o.stderr.contains("--max-shard-size does not apply"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_model_saved_in_mindspore_form_infers_and_resumes() {
    let d = Dir::new();
    d.ok(&[
        "train",
        "--ranks",
        "2",
        "--max-steps",
        "20",
        "--out",
        "run",
        "-q",
    ]);
    d.ok(&[
        "reshard",
        "run",
        "-o",
        "ms",
        "--to",
        "2",
        "--format",
        "mindspore",
    ]);
    // Data parallel: every rank's file holds every tensor, as MindSpore loads it.
    for r in 0..2 {
        let t = file_tensors(&d.path(&format!("ms/rank_{r}/checkpoint_{r}.ckpt")));
        assert_eq!(t.len(), 18, "rank {r}");
    }
    let a = d.ok(&["infer", "run", "--limit", "300"]);
    let b = d.ok(&["infer", "ms", "--limit", "300"]);
    let acc = |s: &str| {
        s.lines()
            .next()
            .unwrap()
            .rsplit("test accuracy ")
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(acc(&a.stdout), acc(&b.stdout));
    d.ok(&[
        "train",
        "--resume",
        "ms",
        "--ranks",
        "2",
        "--max-steps",
        "25",
        "--out",
        "run2",
        "-q",
    ]);
    d.ok(&["verify", "run2"]);
}

#[test]
fn the_newest_of_several_checkpoints_is_used_and_said_or_files_are_named() {
    let d = Dir::new();
    for r in 0..4 {
        let rd = d.path(&format!("run/rank_{r}"));
        std::fs::create_dir_all(&rd).unwrap();
        let src = fixtures().join(format!("ckpt_fmt/rank_{r}/checkpoint_{r}.ckpt"));
        std::fs::copy(&src, rd.join("net-2_20.ckpt")).unwrap();
        // An older one whose bytes are not a checkpoint: picking it would fail.
        std::fs::write(rd.join("net-1_10.ckpt"), b"not this one").unwrap();
    }
    std::fs::copy(
        fixtures().join("strategy.ckpt"),
        d.path("run/strategy.ckpt"),
    )
    .unwrap();
    let o = d.ok(&["verify", "run"]);
    assert!(
        o.stdout
            .contains("note: run/rank_0: 2 checkpoint files, using the newest, net-2_20.ckpt"),
        "{}",
        o.stdout
    );
    // Naming the files (a shell glob) chooses another step.
    let o = d.fails(&[
        "verify",
        "run/rank_0/net-1_10.ckpt",
        "--source-strategy",
        "run/strategy.ckpt",
    ]);
    assert!(
        o.stdout
            .contains("run/rank_0/net-1_10.ckpt: not a checkpoint file"),
        "{}",
        o.stdout
    );
    // So does --step, in every rank directory.
    d.ok(&["verify", "run", "--step", "20"]);
    let o = d.fails(&["verify", "run", "--step", "10"]);
    assert!(
        o.stdout
            .contains("rank_0/net-1_10.ckpt: not a checkpoint file"),
        "{}",
        o.stdout
    );
    let o = d.fails(&["merge", "run", "--step", "30", "-o", "m"]);
    assert!(
        o.stderr
            .contains("run/rank_0: no checkpoint file of step 30")
            && o.stderr.contains("steps here: 10, 20"),
        "{}",
        o.stderr
    );
}

/// `--step` picks a training output's step_<N>/ instead of `latest`.
#[test]
fn step_picks_a_training_checkpoint() {
    let d = Dir::new();
    d.ok(&[
        "train",
        "--out",
        "run",
        "--mesh",
        "tp=2",
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--keep",
        "2",
        "-q",
    ]);
    let latest = std::fs::read_to_string(d.path("run/latest")).unwrap();
    assert_eq!(latest.trim(), "step_4");
    d.ok(&["merge", "run", "--step", "2", "-o", "two"]);
    d.ok(&["merge", "run/step_2", "-o", "direct"]);
    assert_eq!(
        full_tensors(&d.path("two")),
        full_tensors(&d.path("direct"))
    );
    d.ok(&["merge", "run", "-o", "four"]);
    assert_ne!(full_tensors(&d.path("two")), full_tensors(&d.path("four")));
    let o = d.fails(&["inspect", "run", "--step", "3"]);
    assert!(
        o.stderr
            .contains("no checkpoint of step 3 (step_3/ or global_step3/); steps here: 2, 4"),
        "{}",
        o.stderr
    );
}

/// MindSpore writes a tensor over 512 MiB as several records (runs of its bytes, cut
/// mid-row): the fixture's files were saved with that limit lowered to 1 KiB, and with
/// crc_check=True.
#[test]
fn split_records_and_crc_num_from_mindspore() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("split_full.safetensors"));
    let src = fx("split_fmt");
    let o = d.ok(&["verify", &src]);
    assert!(
        o.stdout.contains("3 tensors") && o.stdout.contains("4 file checksums (crc_num) match"),
        "{}",
        o.stdout
    );
    d.ok(&["merge", &src, "-o", "m"]);
    assert_eq!(full_tensors(&d.path("m")), want);
    d.ok(&["reshard", &src, "--to", "3", "-o", "r3"]);
    d.ok(&["merge", "r3", "-o", "m3"]);
    assert_eq!(full_tensors(&d.path("m3")), want);
    // One flipped byte: the file's crc_num no longer matches.
    std::fs::create_dir_all(d.path("bad")).unwrap();
    for r in 0..4 {
        let from = fixtures().join(format!("split_fmt/rank_{r}/checkpoint_{r}.ckpt"));
        let dir = d.path(&format!("bad/rank_{r}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = std::fs::read(from).unwrap();
        if r == 2 {
            let n = b.len();
            b[n / 2] ^= 1;
        }
        std::fs::write(dir.join(format!("checkpoint_{r}.ckpt")), b).unwrap();
    }
    std::fs::copy(
        fixtures().join("split_fmt/strategy.ckpt"),
        d.path("bad/strategy.ckpt"),
    )
    .unwrap();
    let o = d.fails(&["verify", "bad"]);
    assert!(
        o.stdout
            .contains("rank_2/checkpoint_2.ckpt: checksum mismatch: MindSpore's crc_num"),
        "{}{}",
        o.stdout,
        o.stderr
    );
}
