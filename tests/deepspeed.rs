//! DeepSpeed ZeRO-1/2/3 checkpoints written by DeepSpeed itself (tests/fixtures/deepspeed,
//! made by scripts/fixtures/deepspeed_fixtures.py: 2 data-parallel ranks on CPU, fp32,
//! fp16 and bf16 training), merged and compared byte for byte with what DeepSpeed's
//! `zero_to_fp32` makes of the same files, and the moments with what DeepSpeed's
//! engine gathers.

use crate::util::{copy_dir, full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const VARIANTS: [&str; 9] = [
    "zero1_fp32",
    "zero1_fp16",
    "zero1_bf16",
    "zero2_fp32",
    "zero2_fp16",
    "zero2_bf16",
    "zero3_fp32",
    "zero3_fp16",
    "zero3_bf16",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepspeed")
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).display().to_string()
}

/// `(dtype, shape)` of every tensor, by name.
fn described(path: &Path) -> BTreeMap<String, (String, Vec<u64>)> {
    let ck = ckpt_core::Checkpoint::open(&[path.to_path_buf()]).expect("open");
    ck.tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                (
                    ckpt_core::layout::strategy::dtype_name(t.dtype).to_string(),
                    t.shape.clone(),
                ),
            )
        })
        .collect()
}

fn split(all: BTreeMap<String, Vec<u8>>) -> (BTreeMap<String, Vec<u8>>, BTreeMap<String, Vec<u8>>) {
    all.into_iter().partition(|(k, _)| !k.starts_with("optim."))
}

#[test]
fn merge_equals_zero_to_fp32_byte_for_byte() {
    let d = Dir::new();
    for v in VARIANTS {
        let out = format!("m-{v}");
        d.ok(&["merge", &fx(&format!("{v}/ckpt")), "-o", &out]);
        let expected_path = fixtures().join(v).join("expected.safetensors");
        let expected = full_tensors(&expected_path);
        let (weights, moments) = split(full_tensors(&d.path(&out)));
        assert_eq!(
            weights.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>(),
            "{v}"
        );
        for (name, bytes) in &expected {
            assert!(
                weights[name] == *bytes,
                "{v}: tensor `{name}` differs from zero_to_fp32's"
            );
        }
        // Same dtypes and shapes, as well as bytes.
        let mine: BTreeMap<_, _> = described(&d.path(&out).join("model.safetensors"));
        assert_eq!(mine, described(&expected_path), "{v}");
        // The moments are DeepSpeed's own (gathered by its engine).
        let want = full_tensors(&fixtures().join(v).join("moments.safetensors"));
        assert!(!want.is_empty(), "{v}");
        assert_eq!(moments, want, "{v}: moments");
        assert!(d.path(&out).join("optimizer.safetensors").is_file(), "{v}");
    }
}

#[test]
fn the_tag_directory_and_latest_are_both_accepted() {
    let d = Dir::new();
    d.ok(&["merge", &fx("zero2_fp32/ckpt/global_step2"), "-o", "tag"]);
    d.ok(&["merge", &fx("zero2_fp32/ckpt"), "-o", "latest"]);
    assert_eq!(
        full_tensors(&d.path("tag")),
        full_tensors(&d.path("latest"))
    );
    // Inspect says what the records are, without failing on them.
    let o = d.ok(&["inspect", &fx("zero3_bf16/ckpt")]);
    assert!(o.stdout.contains("fc2.weight"), "{}", o.stdout);
    assert!(
        o.stdout.starts_with("DeepSpeed ZeRO checkpoint, "),
        "{}",
        o.stdout
    );
}

#[test]
fn reshard_from_zero_like_any_source() {
    let d = Dir::new();
    for v in ["zero2_bf16", "zero3_fp32"] {
        let out = format!("r-{v}");
        d.ok(&[
            "reshard",
            &fx(&format!("{v}/ckpt")),
            "--to",
            "3",
            "-o",
            &out,
        ]);
        let back = format!("b-{v}");
        d.ok(&["merge", &out, "-o", &back]);
        let (w, _) = split(full_tensors(&d.path(&back)));
        assert_eq!(
            w,
            full_tensors(&fixtures().join(v).join("expected.safetensors")),
            "{v}"
        );
    }
}

/// A copy of a fixture's checkpoint to damage.
fn copy_of(d: &Dir, v: &str) -> PathBuf {
    let src = fixtures().join(v).join("ckpt/global_step2");
    let dst = d.path(&format!("bad-{v}"));
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// Replaces the first `from` after `anchor` in `file` by `to` (same length): the
/// pickle is stored uncompressed in the zip, so a value can be changed in place.
fn patch_after(file: &Path, anchor: &[u8], from: &[u8], to: &[u8]) {
    let mut b = std::fs::read(file).unwrap();
    let a = b
        .windows(anchor.len())
        .position(|w| w == anchor)
        .expect("anchor");
    let at = a + b[a..]
        .windows(from.len())
        .position(|w| w == from)
        .expect("value after anchor");
    b[at..at + to.len()].copy_from_slice(to);
    std::fs::write(file, b).unwrap();
}

fn fails_cleanly(d: &Dir, input: &Path, want: &[&str]) {
    let out = d.path("out");
    let o = d.fails(&[
        "merge",
        &input.display().to_string(),
        "-o",
        &out.display().to_string(),
    ]);
    for w in want {
        assert!(o.stderr.contains(w), "missing `{w}` in: {}", o.stderr);
    }
    assert!(!out.exists(), "output written despite: {}", o.stderr);
}

#[test]
fn a_missing_dp_rank_is_named() {
    let d = Dir::new();
    let c = copy_of(&d, "zero2_fp32");
    std::fs::remove_file(c.join("zero_pp_rank_1_mp_rank_00_optim_states.pt")).unwrap();
    fails_cleanly(
        &d,
        &c,
        &[
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "rank 1 of 2 is missing",
        ],
    );
    let c = copy_of(&d, "zero3_bf16");
    std::fs::remove_file(c.join("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")).unwrap();
    fails_cleanly(
        &d,
        &c,
        &["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "missing"],
    );
}

#[test]
fn a_truncated_pt_is_named() {
    let d = Dir::new();
    let c = copy_of(&d, "zero3_fp16");
    let f = c.join("zero_pp_rank_1_mp_rank_00_optim_states.pt");
    let len = std::fs::metadata(&f).unwrap().len();
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..(len / 2) as usize]).unwrap();
    fails_cleanly(&d, &c, &["zero_pp_rank_1_mp_rank_00_optim_states.pt"]);
}

#[test]
fn partitions_that_do_not_add_up_are_named() {
    let d = Dir::new();
    // ZeRO-2: embed.weight declared 12x6 instead of 11x6 (BININT1 11 -> 12).
    let c = copy_of(&d, "zero2_fp32");
    patch_after(
        &c.join("mp_rank_00_model_states.pt"),
        b"param_shapes",
        b"K\x0bK\x06",
        b"K\x0cK\x06",
    );
    fails_cleanly(&d, &c, &["do not add up", "optim_states.pt"]);
    // ZeRO-3: fc2.weight declared 5x9 instead of 5x7.
    let c = copy_of(&d, "zero3_fp32");
    patch_after(
        &c.join("zero_pp_rank_0_mp_rank_00_model_states.pt"),
        b"param_shapes",
        b"K\x05K\x07",
        b"K\x05K\x09",
    );
    fails_cleanly(&d, &c, &["do not add up", "fc2"]);
}

#[test]
fn padding_not_where_zero_puts_it_is_named() {
    let d = Dir::new();
    // Rank 1 says it dropped 2 elements of padding, not 1: its partition would then
    // be longer than rank 0's.
    let c = copy_of(&d, "zero1_fp32");
    patch_after(
        &c.join("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        b"group_paddings",
        b"K\x01",
        b"K\x02",
    );
    fails_cleanly(
        &d,
        &c,
        &[
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "padding is not where ZeRO puts it",
        ],
    );
}

/// `--step N` on a DeepSpeed save directory reads its tag `global_step<N>` (DeepSpeed's
/// default tag), not `latest`'s; a step that is not there is refused, naming the steps.
#[test]
fn step_picks_a_deepspeed_tag_or_is_refused() {
    let d = Dir::new();
    let save = d.path("save");
    std::fs::create_dir_all(&save).unwrap();
    for tag in ["global_step2", "global_step9"] {
        copy_dir(
            &fixtures().join("zero2_fp32/ckpt/global_step2"),
            &save.join(tag),
        );
    }
    // `latest` names a tag whose optimizer files were lost.
    std::fs::write(save.join("latest"), "global_step9").unwrap();
    std::fs::remove_file(save.join("global_step9/zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        .unwrap();
    d.fails(&["merge", "save", "-o", "newest"]);
    d.ok(&["merge", "save", "--step", "2", "-o", "two"]);
    assert_eq!(
        full_tensors(&d.path("two/model.safetensors")),
        full_tensors(&fixtures().join("zero2_fp32/expected.safetensors"))
    );
    let o = d.fails(&["merge", "save", "--step", "4", "-o", "four"]);
    assert!(
        o.stderr
            .contains("no checkpoint of step 4 (step_4/ or global_step4/); steps here: 2, 9"),
        "{}",
        o.stderr
    );
    assert!(!d.path("newest").exists() && !d.path("four").exists());
}
