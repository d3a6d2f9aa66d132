//! `ckpt reshard --format deepspeed --to N`: DeepSpeed ZeRO-1/2 checkpoints (the
//! fixtures of tests/fixtures/deepspeed, 2 data-parallel ranks) written for another
//! data-parallel size. That DeepSpeed itself loads them is
//! scripts/deepspeed_reshard_interop.py's part; here, without the library: the
//! partitions come back byte for byte, merges agree, and what cannot be written
//! exactly is refused with nothing written.

use crate::util::{full_tensors, Dir};
use ckpt_core::formats::TensorFile;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The ZeRO-1/2 fixtures (bf16 runs: the same files, named `bf16_zero_pp_rank_*`).
const WRITABLE: [&str; 6] = [
    "zero1_fp32",
    "zero1_fp16",
    "zero1_bf16",
    "zero2_fp32",
    "zero2_fp16",
    "zero2_bf16",
];

/// The ZeRO-3 fixtures.
const ZERO3: [&str; 3] = ["zero3_fp32", "zero3_fp16", "zero3_bf16"];

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

/// Rank r's optimizer states of variant `v` (`bf16_` named for bf16 runs).
fn optim_of(dir: &Path, v: &str, r: u64) -> PathBuf {
    let prefix = if v.ends_with("_bf16") { "bf16_" } else { "" };
    dir.join(format!(
        "global_step2/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
    ))
}

fn optim(dir: &Path, r: u64) -> PathBuf {
    optim_of(dir, "", r)
}

/// Rank r's model states of a ZeRO-3 checkpoint.
fn models_of(dir: &Path, r: u64) -> PathBuf {
    dir.join(format!(
        "global_step2/zero_pp_rank_{r}_mp_rank_00_model_states.pt"
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
            assert!(optim_of(&three, v, r).is_file(), "{v}: rank {r} of 3");
        }
        assert!(!optim_of(&three, v, 3).exists(), "{v}");
        assert_eq!(
            std::fs::read_to_string(three.join("latest")).unwrap(),
            "global_step2"
        );
        for r in 0..2 {
            let want = tensors_of(&optim_of(&source(v), v, r));
            let got = tensors_of(&optim_of(&back, v, r));
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
    for v in WRITABLE.into_iter().chain(ZERO3) {
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
    // A ZeRO-3 checkpoint written for 3 ranks, then without rank 2's model states; and
    // the 2-rank source with a truncated optimizer file.
    let z3 = d.path("z3");
    d.ok(&[
        "reshard",
        &s(&source("zero3_fp16")),
        "--to",
        "3",
        "--format",
        "deepspeed",
        "-o",
        &s(&z3),
    ]);
    let z3_missing = z3.join("global_step2");
    std::fs::remove_file(models_of(&z3, 2)).unwrap();
    let z3_short = copy_tag(&d, "zero3_fp32", "z3short");
    let f = z3_short.join("zero_pp_rank_1_mp_rank_00_optim_states.pt");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let cases: Vec<(PathBuf, &str)> = vec![
        (z3_missing, "rank 2 of 3: model states missing"),
        (z3_short, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
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

/// The fixtures' trainable parameters in the order the model (and so DeepSpeed's
/// `param_shapes` and flat groups) holds them (scripts/fixtures/deepspeed_fixtures.py,
/// `Tiny`), with their element counts from zero_to_fp32's output.
fn zero3_params(v: &str) -> Vec<u64> {
    let expected = TensorFile::open(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/deepspeed")
            .join(v)
            .join("expected.safetensors"),
    )
    .unwrap();
    [
        "embed.weight",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    .iter()
    .map(|n| {
        let t = expected.tensors().iter().find(|t| t.name == *n).unwrap();
        t.shape.iter().product()
    })
    .collect()
}

/// Which elements of rank r's flat group (of parameters `numels`, `dp` ranks) are
/// padding: each parameter's part is ceil(numel / dp) elements, the tail past numel
/// padding (stage3.py, partition_parameters.py).
fn padding(numels: &[u64], dp: u64, r: u64) -> Vec<bool> {
    numels
        .iter()
        .flat_map(|&n| {
            let p = n.div_ceil(dp);
            (r * p..(r + 1) * p).map(move |i| i >= n)
        })
        .collect()
}

/// `got` equals `want` element for element (`elem` bytes each), except at padding,
/// where `got` is zero (DeepSpeed leaves whatever memory held there; ckpt writes zeros).
fn equal_but_padding(got: &[u8], want: &[u8], pad: &[bool], elem: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert_eq!(got.len(), pad.len() * elem, "{what}: padding mask");
    for (i, &p) in pad.iter().enumerate() {
        let (g, w) = (&got[i * elem..][..elem], &want[i * elem..][..elem]);
        if p {
            assert!(
                g.iter().all(|&b| b == 0),
                "{what}: padding element {i} not zero"
            );
        } else {
            assert_eq!(g, w, "{what}: element {i}");
        }
    }
}

#[test]
fn zero3_two_to_three_to_two_gives_back_every_partition_byte_for_byte() {
    let d = Dir::new();
    for v in ZERO3 {
        let three = d.path(&format!("{v}-3"));
        let back = d.path(&format!("{v}-3-2"));
        for (from, to, n) in [(source(v), &three, "3"), (three.clone(), &back, "2")] {
            d.ok(&[
                "reshard",
                &s(&from),
                "--to",
                n,
                "--format",
                "deepspeed",
                "-o",
                &s(to),
            ]);
        }
        for r in 0..3 {
            assert!(optim_of(&three, v, r).is_file(), "{v}: rank {r} of 3");
            assert!(models_of(&three, r).is_file(), "{v}: rank {r} of 3");
        }
        assert!(!models_of(&three, 3).exists(), "{v}");
        let numels = zero3_params(v);
        for r in 0..2 {
            // Optimizer states: the flat group and the moments re-cut, the step as is.
            let want = tensors_of(&optim_of(&source(v), v, r));
            let got = tensors_of(&optim_of(&back, v, r));
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{v}: rank {r}"
            );
            let pad = padding(&numels, 2, r);
            for (name, (shape, bytes)) in &want {
                assert_eq!(got[name].0, *shape, "{v}: rank {r}: `{name}`");
                if shape.is_empty() {
                    assert!(got[name].1 == *bytes, "{v}: rank {r}: `{name}`");
                } else {
                    let what = format!("{v}: rank {r}: `{name}`");
                    equal_but_padding(&got[name].1, bytes, &pad, 4, &what);
                }
            }
            // Model states: the frozen parameter's part re-cut, everything else (the
            // buffers, the partitioned parameters' empty placeholders) as is.
            let want = tensors_of(&models_of(&source(v), r));
            let got = tensors_of(&models_of(&back, r));
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{v}: rank {r}"
            );
            for (name, (shape, bytes)) in &want {
                assert_eq!(got[name].0, *shape, "{v}: rank {r}: `{name}`");
                if name.starts_with("frozen_param_fragments.") {
                    let elem = bytes.len() / shape[0] as usize;
                    let what = format!("{v}: rank {r}: `{name}`");
                    equal_but_padding(&got[name].1, bytes, &padding(&[21], 2, r), elem, &what);
                } else {
                    assert!(got[name].1 == *bytes, "{v}: rank {r}: `{name}` differs");
                }
            }
        }
        // There and back again is the same files, byte for byte (padding now zero).
        let again = d.path(&format!("{v}-3-2-3-2"));
        let mid = d.path(&format!("{v}-3-2-3"));
        d.ok(&[
            "reshard",
            &s(&back),
            "--to",
            "3",
            "--format",
            "deepspeed",
            "-o",
            &s(&mid),
        ]);
        d.ok(&[
            "reshard",
            &s(&mid),
            "--to",
            "2",
            "--format",
            "deepspeed",
            "-o",
            &s(&again),
        ]);
        for r in 0..2 {
            for f in [optim_of(&back, v, r), models_of(&back, r)] {
                let rel = f.strip_prefix(&back).unwrap();
                assert!(
                    std::fs::read(&f).unwrap() == std::fs::read(again.join(rel)).unwrap(),
                    "{v}: {} differs after a second 2 -> 3 -> 2",
                    rel.display()
                );
            }
        }
    }
}

#[test]
fn zero3_three_ranks_hold_each_parameters_part_in_place() {
    // dp=3: each parameter cut alone into ceil(numel / 3) elements; rank r's flat group
    // is its parts end to end, and the parts of all ranks, padding dropped, are the
    // parameters (zero_to_fp32's output) in order.
    let d = Dir::new();
    let v = "zero3_fp32";
    let out = d.path("o");
    d.ok(&[
        "reshard",
        &s(&source(v)),
        "--to",
        "3",
        "--format",
        "deepspeed",
        "-o",
        &s(&out),
    ]);
    let numels = zero3_params(v);
    let w = "optimizer_state_dict.fp32_flat_groups.0";
    let parts: Vec<Vec<u8>> = (0..3)
        .map(|r| tensors_of(&optim_of(&out, v, r))[w].1.clone())
        .collect();
    let expected = TensorFile::open(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/deepspeed")
            .join(v)
            .join("expected.safetensors"),
    )
    .unwrap();
    let names = [
        "embed.weight",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ];
    let mut at = [0usize; 3];
    for (name, &n) in names.iter().zip(&numels) {
        let k = expected
            .tensors()
            .iter()
            .position(|t| t.name == *name)
            .unwrap();
        let want = expected.data(k).unwrap();
        let p = n.div_ceil(3) as usize;
        let mut whole = Vec::new();
        for r in 0..3 {
            let mine = &parts[r][at[r] * 4..(at[r] + p) * 4];
            let real = (n as usize).saturating_sub(r * p).min(p);
            whole.extend_from_slice(&mine[..real * 4]);
            assert!(
                mine[real * 4..].iter().all(|&b| b == 0),
                "{name}: rank {r} padding"
            );
            at[r] += p;
        }
        assert!(
            whole == want,
            "{name}: the ranks' parts are not the parameter"
        );
    }
    for r in 0..3 {
        assert_eq!(
            at[r] * 4,
            parts[r].len(),
            "rank {r}: nothing else in the group"
        );
    }
}
