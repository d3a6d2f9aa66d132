//! `ckpt reshard --format deepspeed --to N`: DeepSpeed ZeRO-1/2 checkpoints (the
//! fixtures of tests/fixtures/deepspeed, 2 data-parallel ranks) written for another
//! data-parallel size. That DeepSpeed itself loads them is
//! scripts/deepspeed_reshard_interop.py's part; here, without the library: the
//! partitions come back byte for byte, merges agree, and what cannot be written
//! exactly is refused with nothing written.

use crate::util::{full_tensors, Dir};
use ckpt_core::TensorFile;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The ZeRO-1/2 fixtures the writer handles (bf16 runs use DeepSpeed's BF16_Optimizer
/// files, refused below).
const WRITABLE: [&str; 4] = ["zero1_fp32", "zero1_fp16", "zero2_fp32", "zero2_fp16"];

fn source(v: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepspeed")
        .join(v)
        .join("ckpt")
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Every tensor of a torch.save file, by name, with its bytes.
fn tensors_of(path: &Path) -> BTreeMap<String, (Vec<u64>, Vec<u8>)> {
    let f = TensorFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.tensors()
        .iter()
        .enumerate()
        .map(|(k, t)| {
            (
                t.name.clone(),
                (t.shape.clone(), f.data(k).expect("stored bytes").to_vec()),
            )
        })
        .collect()
}

fn optim(dir: &Path, r: u64) -> PathBuf {
    dir.join(format!(
        "global_step2/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
    ))
}

#[test]
fn two_to_three_to_two_gives_back_the_partitions_byte_for_byte() {
    let d = Dir::new();
    for v in WRITABLE {
        let three = d.path(&format!("{v}-3"));
        let back = d.path(&format!("{v}-3-2"));
        d.ok(&[
            "reshard",
            &s(&source(v)),
            "--to",
            "3",
            "--format",
            "deepspeed",
            "-o",
            &s(&three),
        ]);
        d.ok(&[
            "reshard",
            &s(&three),
            "--to",
            "2",
            "--format",
            "deepspeed",
            "-o",
            &s(&back),
        ]);
        for r in 0..3 {
            assert!(optim(&three, r).is_file(), "{v}: rank {r} of 3");
        }
        assert!(!optim(&three, 3).exists(), "{v}");
        assert_eq!(
            std::fs::read_to_string(three.join("latest")).unwrap(),
            "global_step2"
        );
        for r in 0..2 {
            let want = tensors_of(&optim(&source(v), r));
            let got = tensors_of(&optim(&back, r));
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{v}: rank {r}"
            );
            for (name, t) in &want {
                assert!(
                    got[name] == *t,
                    "{v}: rank {r}: `{name}` differs after 2 -> 3 -> 2"
                );
            }
        }
        // The model states change in one integer (dp_world_size) there and back.
        let models = "global_step2/mp_rank_00_model_states.pt";
        let src_models = std::fs::read(source(v).join(models)).unwrap();
        assert!(
            std::fs::read(back.join(models)).unwrap() == src_models,
            "{v}: model states differ after 2 -> 3 -> 2"
        );
        assert!(
            std::fs::read(three.join(models)).unwrap() != src_models,
            "{v}: dp_world_size must say 3"
        );
    }
}

#[test]
fn three_ranks_partitions_are_the_groups_cut_deepspeeds_way() {
    // 155 trainable elements in one group; aligned to 2 * 3 = 6 -> 156, 52 a rank, the
    // last holding 51 and one element of padding (stage_1_and_2.py).
    let d = Dir::new();
    let out = d.path("o");
    d.ok(&[
        "reshard",
        &s(&source("zero2_fp32")),
        "--to",
        "3",
        "--format",
        "deepspeed",
        "-o",
        &s(&out),
    ]);
    let w = "optimizer_state_dict.single_partition_of_fp32_groups.0";
    let m = "optimizer_state_dict.base_optimizer_state.state.0.exp_avg";
    let mut stream = Vec::new();
    for (r, (stored, whole)) in [(52, 52), (52, 52), (51, 52)].into_iter().enumerate() {
        let t = tensors_of(&optim(&out, r as u64));
        assert_eq!(t[w].0, vec![stored], "rank {r}");
        assert_eq!(t[m].0, vec![whole], "rank {r}: moments keep the padding");
        stream.extend_from_slice(&t[w].1);
        if stored < whole {
            assert!(
                t[m].1[stored as usize * 4..].iter().all(|&b| b == 0),
                "padding is zero"
            );
        }
    }
    let mut src = Vec::new();
    for r in 0..2 {
        src.extend_from_slice(&tensors_of(&optim(&source("zero2_fp32"), r))[w].1);
    }
    assert_eq!(
        stream, src,
        "the ranks' partitions end to end are the group"
    );
}

#[test]
fn merge_of_the_resharded_checkpoint_equals_merge_of_the_source() {
    let d = Dir::new();
    for v in WRITABLE {
        let want = d.path(&format!("{v}-m"));
        d.ok(&["merge", &s(&source(v)), "-o", &s(&want)]);
        let want = full_tensors(&want);
        assert!(
            want.keys().any(|k| k.ends_with(".exp_avg_sq")),
            "{v}: moments merged"
        );
        for dp in ["1", "3", "4"] {
            let out = d.path(&format!("{v}-{dp}"));
            d.ok(&[
                "reshard",
                &s(&source(v)),
                "--to",
                dp,
                "--format",
                "deepspeed",
                "-o",
                &s(&out),
            ]);
            let merged = d.path(&format!("{v}-{dp}-m"));
            d.ok(&["merge", &s(&out), "-o", &s(&merged)]);
            assert!(full_tensors(&merged) == want, "{v}: dp={dp}");
        }
    }
}

/// A copy of a fixture's tag directory to damage.
fn copy_tag(d: &Dir, v: &str, name: &str) -> PathBuf {
    let dst = d.path(name);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(source(v).join("global_step2")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

#[test]
fn what_cannot_be_written_exactly_is_refused_and_nothing_written() {
    let d = Dir::new();
    let tp = copy_tag(&d, "zero2_fp32", "tp");
    std::fs::copy(
        tp.join("mp_rank_00_model_states.pt"),
        tp.join("mp_rank_01_model_states.pt"),
    )
    .unwrap();
    let moe = copy_tag(&d, "zero2_fp32", "moe");
    std::fs::copy(
        moe.join("zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        moe.join("expp_rank_0_mp_rank_00_optim_states.pt"),
    )
    .unwrap();
    let missing = copy_tag(&d, "zero2_fp16", "missing");
    std::fs::remove_file(missing.join("zero_pp_rank_1_mp_rank_00_optim_states.pt")).unwrap();
    let cases: Vec<(PathBuf, &str)> = vec![
        (source("zero3_fp32"), "ZeRO-3"),
        (source("zero2_bf16"), "bf16_zero_pp_rank"),
        (tp, "tensor-parallel"),
        (moe, "mixture-of-experts"),
        (missing, "rank 1 of 2 is missing"),
    ];
    for (i, (src, want)) in cases.iter().enumerate() {
        let out = d.path(&format!("out{i}"));
        let e = d.fails(&[
            "reshard",
            &s(src),
            "--to",
            "3",
            "--format",
            "deepspeed",
            "-o",
            &s(&out),
        ]);
        assert!(e.stderr.contains(want), "{want}: {}", e.stderr);
        assert_eq!(e.code, 1, "{want}");
        assert!(!out.exists(), "{want}: nothing written");
        // No temporary left beside it either.
        let left: Vec<_> = std::fs::read_dir(d.path(""))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!(".out{i}"))
            })
            .collect();
        assert!(left.is_empty(), "{want}: {left:?}");
    }
    // What the format cannot carry is refused before anything is read.
    let out = d.path("sel");
    let e = d.fails(&[
        "reshard",
        &s(&source("zero2_fp32")),
        "--to",
        "3",
        "--format",
        "deepspeed",
        "--include",
        "fc1.*",
        "-o",
        &s(&out),
    ]);
    assert!(e.stderr.contains("--format deepspeed"), "{}", e.stderr);
    assert!(!out.exists());
}
