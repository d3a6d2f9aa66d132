//! `ckpt reshard`: M to N, back again, single ranks, plans and strategies.

use crate::util::{example_originals, full_tensors, originals_of, Dir};

fn files_equal(a: &std::path::Path, b: &std::path::Path) {
    assert_eq!(
        std::fs::read(a).unwrap(),
        std::fs::read(b).unwrap(),
        "{} != {}",
        a.display(),
        b.display()
    );
}

#[test]
fn the_summary_counts_tensors_and_says_pieces() {
    let d = Dir::new();
    d.example("ex", "dp=2,tp=3");
    let o = d.ok(&["reshard", "ex", "--to", "2", "-o", "r", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["tensors"], 12);
    assert_eq!(v["files"], 2);
    assert!(v["pieces"].as_u64().unwrap() > 12, "{v}");
    let o = d.ok(&["reshard", "ex", "--to", "2", "-o", "r2"]);
    assert!(
        o.stdout.starts_with("resharded 12 tensors as ")
            && o.stdout.contains(" pieces in 2 file(s)"),
        "{}",
        o.stdout
    );
    let o = d.ok(&["merge", "ex", "-o", "m"]);
    assert!(
        o.stdout.starts_with("merged 12 tensors in 1 file(s)"),
        "{}",
        o.stdout
    );
}

#[test]
fn eight_to_three_and_back_is_identity() {
    let d = Dir::new();
    d.example("ex", "dp=2,tp=4");
    d.ok(&["reshard", "ex", "-o", "r3", "--to", "3"]);
    d.ok(&["verify", "r3"]);
    let s = ckpt_core::layout::strategy::Strategy::read(&d.path("r3/strategy.json")).unwrap();
    assert_eq!(s.mesh.to_string(), "dp=1,tp=3");
    assert_eq!(full_tensors(&d.path("r3")), example_originals("dp=2,tp=4"));
    d.ok(&["reshard", "r3", "-o", "back", "--mesh", "dp=2,tp=4"]);
    for r in 0..8 {
        files_equal(
            &d.path(&format!("ex/ckpt_{r}/model.safetensors")),
            &d.path(&format!("back/ckpt_{r}/model.safetensors")),
        );
    }
}

#[test]
fn one_rank_reads_only_what_it_needs() {
    let d = Dir::new();
    d.example("ex", "tp=8");
    let o = d.ok(&[
        "reshard", "ex", "-o", "r2", "--to", "2", "--rank", "1", "--plan", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let f = &v["files"][0];
    assert_eq!(f["output"], "ckpt_1/model.safetensors");
    let (read, written) = (
        f["bytes_read"].as_u64().unwrap(),
        f["bytes_written"].as_u64().unwrap(),
    );
    assert!(
        read as f64 <= 1.05 * written as f64 && read >= written,
        "read {read} written {written}"
    );
    assert!(!d.path("r2").exists(), "--plan writes nothing");
    d.ok(&["reshard", "ex", "-o", "r2", "--to", "2", "--rank", "1"]);
    assert!(d.path("r2/ckpt_1/model.safetensors").exists() && !d.path("r2/ckpt_0").exists());
    d.ok(&["reshard", "ex", "-o", "r2", "--to", "2", "--rank", "0"]);
    assert_eq!(full_tensors(&d.path("r2")), example_originals("tp=8"));
}

#[test]
fn rank_auto_takes_this_process_share_of_the_target_ranks() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // Process 1 of 2 (as srun starts it) builds target ranks 1 and 3 of 4.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["reshard", "ex", "-o", "r", "--to", "4", "--rank", "auto"])
        .env("SLURM_PROCID", "1")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_LOCALID", "1")
        .current_dir(d.tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut built: Vec<String> = std::fs::read_dir(d.path("r"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    built.sort();
    assert_eq!(built, vec!["ckpt_1", "ckpt_3", "strategy.json"]);
    // Process 0 completes the output.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["reshard", "ex", "-o", "r", "--to", "4", "--rank", "auto"])
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        .current_dir(d.tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    d.ok(&["verify", "r"]);
    assert_eq!(full_tensors(&d.path("r")), example_originals("tp=2"));
    let o = d.fails(&["reshard", "ex", "-o", "r", "--to", "4", "--rank", "auto"]);
    assert!(
        o.stderr.contains("--rank auto: no launcher variables"),
        "{}",
        o.stderr
    );
}

#[test]
fn integrated_to_sliced_with_a_strategy_then_merge() {
    let d = Dir::new();
    d.example("ex", "tp=3");
    d.ok(&["merge", "ex", "-o", "full"]);
    // A predict strategy of another kind: shard the embedding by columns on 2 ranks.
    let mut s = ckpt_core::layout::strategy::Strategy::read(&d.path("ex/strategy.json")).unwrap();
    let mut t = ckpt_core::layout::strategy::Strategy::new(
        ckpt_core::layout::mesh::Mesh::parse("tp=2").unwrap(),
    );
    for (name, mut l) in std::mem::take(&mut s.tensors) {
        if name == "embed.weight" {
            l.placements = vec![ckpt_core::layout::Placement::shard(1)];
        } else {
            l.placements.truncate(1);
        }
        t.insert(name, l).unwrap();
    }
    std::fs::write(d.path("predict.json"), t.to_json()).unwrap();
    let o = d.fails(&["reshard", "full", "-o", "x", "--to", "2"]);
    assert!(o.stderr.contains("give --strategy"), "{}", o.stderr);
    d.ok(&["reshard", "full", "-o", "p", "--strategy", "predict.json"]);
    d.ok(&["verify", "p"]);
    let f = ckpt_core::formats::TensorFile::open(&d.path("p/ckpt_1/model.safetensors")).unwrap();
    let e = f.find("embed.weight").unwrap();
    assert_eq!(f.tensors()[e].shape, vec![37, 8]);
    assert_eq!(full_tensors(&d.path("p")), example_originals("tp=3"));
}

#[test]
fn unknown_axis_is_named() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // A usage error (exit 2): the mesh asked for, not the input, is wrong (issue 35).
    let o = d.ckpt(&["reshard", "ex", "-o", "x", "--mesh", "ep=2"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("invalid mesh `ep=2`: axis `ep` is not an axis of the source mesh tp=2"),
        "{}",
        o.stderr
    );
}

fn example_with(d: &Dir, rel: &str, mesh: &str) {
    d.ok(&[
        "example",
        rel,
        "--mesh",
        mesh,
        "--hidden",
        "16",
        "--vocab",
        "37",
        "--layers",
        "4",
        "--optimizer",
    ]);
}

#[test]
fn pipeline_two_to_one_and_back_with_optimizer_state() {
    let d = Dir::new();
    example_with(&d, "ex", "pp=2,dp=2,tp=2");
    let s = ckpt_core::layout::strategy::Strategy::read(&d.path("ex/strategy.json")).unwrap();
    assert_eq!(s.tensors["layers.3.mlp.up.weight"].stage, Some(1));
    // PP=2 -> PP=1 (every stage 0), dp 2 -> 1: the ZeRO-sharded moments follow their weights.
    d.ok(&["reshard", "ex", "-o", "pp1", "--mesh", "pp=1,dp=1,tp=2"]);
    d.ok(&["verify", "pp1"]);
    let s1 = ckpt_core::layout::strategy::Strategy::read(&d.path("pp1/strategy.json")).unwrap();
    assert_eq!(s1.tensors["layers.3.mlp.up.weight"].stage, Some(0));
    let f = ckpt_core::formats::TensorFile::open(&d.path("pp1/ckpt_1/model.safetensors")).unwrap();
    let m = f
        .find("optim.layers.3.mlp.up.weight.exp_avg")
        .expect("moment on tp rank 1");
    assert_eq!(f.tensors()[m].shape, vec![32, 16]);
    assert_eq!(
        full_tensors(&d.path("pp1")),
        originals_of("pp=2,dp=2,tp=2", 4, true)
    );
    // And back to the training strategy, byte for byte.
    d.ok(&[
        "reshard",
        "pp1",
        "-o",
        "pp2",
        "--strategy",
        "ex/strategy.json",
    ]);
    for r in 0..8 {
        files_equal(
            &d.path(&format!("ex/ckpt_{r}/model.safetensors")),
            &d.path(&format!("pp2/ckpt_{r}/model.safetensors")),
        );
    }
    // Dropping the optimizer state on the way.
    d.ok(&[
        "reshard",
        "ex",
        "-o",
        "weights",
        "--to",
        "2",
        "--exclude",
        "optim.*",
    ]);
    let got = full_tensors(&d.path("weights"));
    assert!(
        got.keys().all(|k| !k.starts_with("optim.")) && got.len() == 22,
        "{:?}",
        got.keys()
    );
}

#[test]
fn sharded_dim_changes_from_rows_to_columns() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    let mut s = ckpt_core::layout::strategy::Strategy::read(&d.path("ex/strategy.json")).unwrap();
    for (name, l) in s.tensors.iter_mut() {
        if name.ends_with("mlp.up.weight") {
            l.placements = vec![ckpt_core::layout::Placement::shard(1)];
        }
    }
    std::fs::write(d.path("cols.json"), s.to_json()).unwrap();
    d.ok(&["reshard", "ex", "-o", "cols", "--strategy", "cols.json"]);
    let f = ckpt_core::formats::TensorFile::open(&d.path("cols/ckpt_3/model.safetensors")).unwrap();
    assert_eq!(
        f.tensors()[f.find("layers.0.mlp.up.weight").unwrap()].shape,
        vec![64, 4]
    );
    assert_eq!(full_tensors(&d.path("cols")), example_originals("tp=4"));
}
