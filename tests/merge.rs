//! `ckpt merge`: byte-exact results, atomic failure, options.

use crate::util::{example_originals, full_tensors, Dir};

#[test]
fn merge_gives_back_every_original_byte() {
    let d = Dir::new();
    d.example("ex", "dp=2,tp=3");
    let o = d.ok(&["merge", "ex", "-o", "merged", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["tensors"], 12);
    assert_eq!(
        full_tensors(&d.path("merged")),
        example_originals("dp=2,tp=3")
    );
    // One integrated file, readable as a plain safetensors file of whole tensors.
    let f = ckpt_core::formats::TensorFile::open(&d.path("merged/model.safetensors")).unwrap();
    let qkv = f.find("layers.1.attn.qkv.weight").unwrap();
    assert_eq!(f.tensors()[qkv].shape, vec![48, 16]);
}

#[test]
fn merge_from_rank_dirs_given_one_by_one() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    d.ok(&[
        "merge",
        "ex/ckpt_0",
        "ex/ckpt_1",
        "ex/ckpt_2",
        "ex/ckpt_3",
        "-o",
        "m",
    ]);
    assert_eq!(full_tensors(&d.path("m")), example_originals("tp=4"));
}

#[test]
fn missing_rank_fails_and_writes_nothing() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    let o = d.fails(&["merge", "ex/ckpt_0", "ex/ckpt_1", "ex/ckpt_3", "-o", "m"]);
    assert!(o.stderr.contains("rank 2 of 4 is missing"), "{}", o.stderr);
    assert!(!d.path("m").exists());
    let leftovers: Vec<_> = std::fs::read_dir(d.tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("ex")]);
}

#[test]
fn existing_output_needs_force_and_output_inside_input_is_refused() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    std::fs::create_dir(d.path("m")).unwrap();
    std::fs::write(d.path("m/keep"), "x").unwrap();
    let o = d.fails(&["merge", "ex", "-o", "m"]);
    assert!(
        o.stderr
            .contains("m already exists (use --force to replace it)"),
        "{}",
        o.stderr
    );
    assert!(d.path("m/keep").exists());
    d.ok(&["merge", "ex", "-o", "m", "--force"]);
    assert!(!d.path("m/keep").exists() && d.path("m/model.safetensors").exists());
    let o = d.fails(&["merge", "ex", "-o", "ex/merged"]);
    assert!(o.stderr.contains("overlaps input"), "{}", o.stderr);
}

#[test]
fn sharded_output_with_index() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    d.ok(&["merge", "ex", "-o", "m", "--max-shard-size", "2kB"]);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.path("m/model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() > 2, "{files:?}");
    for f in &files {
        assert!(d.path(&format!("m/{f}")).exists());
    }
    let total: u64 = example_originals("tp=2")
        .values()
        .map(|v| v.len() as u64)
        .sum();
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(full_tensors(&d.path("m")), example_originals("tp=2"));
}

#[test]
fn cast_include_exclude() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // A cast to a float type keeps the integer `step` as it is.
    d.ok(&["merge", "ex", "-o", "m0", "--dtype", "f32"]);
    let whole = full_tensors(&d.path("m0"));
    assert_eq!(whole["step"], example_originals("tp=2")["step"]);
    let o = d.fails(&["merge", "ex", "-o", "m", "--dtype", "i32"]);
    assert!(
        o.stderr.contains("cannot cast") && o.stderr.contains("to I32"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
    d.ok(&[
        "merge",
        "ex",
        "-o",
        "m",
        "--dtype",
        "f32",
        "--exclude",
        "step",
        "--exclude",
        "layers.1.*",
    ]);
    let got = full_tensors(&d.path("m"));
    assert_eq!(got.len(), 6);
    let orig = example_originals("tp=2");
    let norm = &orig["layers.0.norm.weight"];
    let want: Vec<u8> = norm
        .chunks(2)
        .flat_map(|c| {
            half::bf16::from_le_bytes([c[0], c[1]])
                .to_f32()
                .to_le_bytes()
        })
        .collect();
    assert_eq!(got["layers.0.norm.weight"], want);
}

#[test]
fn dcp_sharded_safetensors_merge() {
    // Our rank files carry DCP_SHARDING_INFO; without strategy.json they read as DCP.
    let d = Dir::new();
    d.example("ex", "tp=4");
    std::fs::create_dir(d.path("dcp")).unwrap();
    for r in 0..4 {
        std::fs::copy(
            d.path(&format!("ex/ckpt_{r}/model.safetensors")),
            d.path(&format!(
                "dcp/shard-{r:05}-model-00001-of-00001.safetensors"
            )),
        )
        .unwrap();
    }
    // The fused QKV is several boxes per rank, so it has no single saved_offsets: drop
    // it from the comparison by excluding it.
    let o = d.ckpt(&["merge", "dcp", "-o", "m", "--exclude", "*.qkv.*"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let mut want = example_originals("tp=4");
    want.retain(|k, _| !k.contains(".qkv."));
    assert_eq!(full_tensors(&d.path("m")), want);
}

#[test]
fn partitioned_merge_under_a_launcher() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    for rank in ["1", "0"] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args([
                "merge",
                "ex",
                "-o",
                "m",
                "--max-shard-size",
                "2kB",
                "--rank",
                "auto",
            ])
            .env("OMPI_COMM_WORLD_RANK", rank)
            .env("OMPI_COMM_WORLD_SIZE", "2")
            .env("OMPI_COMM_WORLD_LOCAL_RANK", rank)
            .current_dir(d.tmp.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        if rank == "1" {
            // Process 1 wrote the even-numbered files (the 2nd, 4th, ...) and no index.
            let names: Vec<String> = std::fs::read_dir(d.path("m"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert!(names.len() >= 2, "{names:?}");
            for n in &names {
                let k: u32 = n["model-".len().."model-".len() + 5].parse().unwrap();
                assert_eq!(k % 2, 0, "{names:?}");
            }
        }
    }
    assert_eq!(full_tensors(&d.path("m")), example_originals("tp=2"));
}

#[test]
fn excluded_tensors_need_not_be_complete() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // Drop the embedding from rank 1's file: a hole in `embed.weight` only.
    let f = d.path("ex/ckpt_1/model.safetensors");
    let ck = ckpt_core::formats::TensorFile::open(&f).unwrap();
    let keep: Vec<(String, Vec<u8>)> = ck
        .tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.name != "embed.weight")
        .map(|(i, t)| (t.name.clone(), ck.data(i).unwrap().to_vec()))
        .collect();
    let meta = ck.metadata().clone();
    let specs: Vec<ckpt_core::formats::writer::TensorSpec> = ck
        .tensors()
        .iter()
        .filter(|t| t.name != "embed.weight")
        .map(|t| ckpt_core::formats::writer::TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    drop(ck);
    std::fs::remove_file(&f).unwrap();
    let w = ckpt_core::formats::safetensors::SafetensorsWriter::create(&f, &specs, &meta).unwrap();
    for (i, (_, data)) in keep.iter().enumerate() {
        w.write_at(i, 0, data).unwrap();
    }
    w.finish().unwrap();
    let o = d.fails(&["merge", "ex", "-o", "m"]);
    assert!(
        o.stderr
            .contains("tensor `embed.weight`: elements [19..37, 0..16] are missing"),
        "{}",
        o.stderr
    );
    d.ok(&["merge", "ex", "-o", "m", "--exclude", "embed.*"]);
    let mut want = example_originals("tp=2");
    want.remove("embed.weight");
    assert_eq!(full_tensors(&d.path("m")), want);
}

#[test]
fn temporaries_of_a_killed_run_are_removed() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // What a merge killed by SIGKILL leaves: a staged directory of a process that is gone.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = d.path(&format!(".m.tmp-{dead}-0"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model.safetensors"), b"partial").unwrap();
    d.ok(&["merge", "ex", "-o", "m"]);
    assert!(!stale.exists(), "stale temporary left behind");
    assert_eq!(full_tensors(&d.path("m")), example_originals("tp=2"));
}
