//! Per-rank `torch.save` files of DTensors written by torch itself (tests/fixtures/dtensor,
//! made by scripts/fixtures/dtensor_pickles.py: `distribute_tensor` on gloo CPU ranks, a
//! mesh of 2 and one of 2x2, Shard/Replicate placements, uneven and empty pieces, each
//! rank's state dict `torch.save`d as verl names it; FSDP1's `SHARDED_STATE_DICT` and
//! `optim_state_dict` the same way): merged and resharded, compared byte for byte with
//! the DTensors' `full_tensor()`.

use crate::util::{full_tensors, Dir};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dtensor")
}

/// The fixture directories: meshes of 2 and 2x2 (`distribute_tensor`), FSDP1's model
/// and optimizer state.
const VARIANTS: [&str; 4] = ["ws2", "ws4", "fsdp1", "fsdp1_optim"];

fn dir(v: &str) -> String {
    fixtures().join(v).display().to_string()
}

fn expected_path(v: &str) -> PathBuf {
    fixtures().join(format!("{v}_expected.safetensors"))
}

fn expected(v: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
    full_tensors(&expected_path(v))
}

/// `(dtype, shape)` of every tensor, by name.
fn described(path: &Path) -> Vec<(String, String, Vec<u64>)> {
    let ck = ckpt_core::Checkpoint::open(&[path.to_path_buf()]).expect("open");
    ck.tensors
        .iter()
        .map(|(n, t)| {
            let dtype = ckpt_core::layout::strategy::dtype_name(t.dtype).to_string();
            (n.clone(), dtype, t.shape.clone())
        })
        .collect()
}

#[test]
fn merge_equals_full_tensor_byte_for_byte() {
    let d = Dir::new();
    for v in VARIANTS {
        let out = format!("m-{v}");
        let o = d.ok(&["merge", &dir(v), "-o", &out]);
        // Plain values beside the DTensors are named, not dropped silently.
        let plain = match v {
            "fsdp1" => "",
            "fsdp1_optim" => "param_groups",
            _ => "epoch",
        };
        assert!(o.stderr.contains(plain), "{v}: {}", o.stderr);
        let want = expected(v);
        assert!(want.len() >= 6, "{v}");
        assert_eq!(full_tensors(&d.path(&out)), want, "{v}");
        assert_eq!(
            described(&d.path(&out).join("model.safetensors")),
            described(&expected_path(v)),
            "{v}"
        );
    }
}

#[test]
fn reshard_to_three_then_merge_gives_the_same_bytes() {
    let d = Dir::new();
    for v in VARIANTS {
        let (r, m) = (format!("r-{v}"), format!("b-{v}"));
        d.ok(&["reshard", &dir(v), "--to", "3", "-o", &r]);
        d.ok(&["merge", &r, "-o", &m]);
        assert_eq!(full_tensors(&d.path(&m)), expected(v), "{v}");
    }
}

#[test]
fn a_missing_rank_file_is_refused_by_name() {
    let d = Dir::new();
    for gone in [1, 3] {
        let src = d.path(&format!("ranks{gone}"));
        std::fs::create_dir_all(&src).unwrap();
        for r in (0..4).filter(|&r| r != gone) {
            let name = format!("model_world_size_4_rank_{r}.pt");
            std::fs::copy(fixtures().join("ws4").join(&name), src.join(&name)).unwrap();
        }
        let out = format!("m{gone}");
        let o = d.fails(&["merge", &src.display().to_string(), "-o", &out]);
        let want = format!("model_world_size_4_rank_{gone}.pt");
        assert!(
            o.stderr.contains(&format!("rank {gone} of 4 is missing")) && o.stderr.contains(&want),
            "{}",
            o.stderr
        );
        assert!(!d.path(&out).exists());
    }
}

#[test]
fn inspect_shows_the_global_shapes() {
    let d = Dir::new();
    let o = d.ok(&["inspect", &dir("ws4")]);
    assert!(
        o.stdout
            .starts_with("per-rank torch.save (DTensor) checkpoint, 4 file(s), 6 tensors"),
        "{}",
        o.stdout
    );
    // embed.weight is 9x6 cut by a 2x2 mesh (Shard(0), Shard(1)); norm.weight is
    // replicated on all four.
    let line = |name: &str| {
        o.stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(
        line("embed.weight").contains("[9, 6] 216 4 pieces"),
        "{}",
        o.stdout
    );
    assert!(
        line("norm.weight").contains("[6] 24 1 pieces"),
        "{}",
        o.stdout
    );
}

#[test]
fn model_and_optimizer_files_of_one_rank_side_by_side_say_which_to_pass() {
    let d = Dir::new();
    let src = d.path("actor");
    std::fs::create_dir_all(&src).unwrap();
    for v in ["fsdp1", "fsdp1_optim"] {
        for e in std::fs::read_dir(fixtures().join(v)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, src.join(p.file_name().unwrap())).unwrap();
        }
    }
    let o = d.fails(&["merge", "actor", "-o", "all"]);
    assert!(
        o.stderr.contains("rank 0 appears twice") && o.stderr.contains("model_world_size_*.pt"),
        "{}",
        o.stderr
    );
    // The model files alone, passed by name, merge.
    let files: Vec<String> = (0..2)
        .map(|r| format!("actor/model_world_size_2_rank_{r}.pt"))
        .collect();
    d.ok(&["merge", &files[0], &files[1], "-o", "model"]);
    assert_eq!(full_tensors(&d.path("model")), expected("fsdp1"));
}

#[test]
fn partial_and_strided_placements_written_by_torch_are_refused_by_name() {
    let d = Dir::new();
    for (v, class) in [
        ("refused_partial", "Partial"),
        ("refused_strided", "_StridedShard"),
    ] {
        let out = format!("o-{v}");
        let o = d.fails(&["merge", &dir(v), "-o", &out]);
        let want = format!("tensor `w`: a DTensor: placement `{class}` on mesh dim 0 is not read");
        assert!(o.stderr.contains(&want), "{v}: {}", o.stderr);
        assert!(!d.path(&out).exists(), "{v}");
    }
}
