//! DeepSpeed's universal checkpoint (UCP): `ckpt merge --format ucp` of a ZeRO
//! checkpoint against the tree DeepSpeed's own `ds_to_universal.py` made of the same
//! files (tests/fixtures/deepspeed/zero{2,3}_fp32/ucp, by
//! scripts/fixtures/deepspeed_fixtures.py), tensor for tensor; and UCP trees (DeepSpeed's
//! and ckpt's) read back as sources.

use crate::util::{copy_dir, full_tensors, Dir};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const VARIANTS: [&str; 2] = ["zero2_fp32", "zero3_fp32"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepspeed")
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).display().to_string()
}

/// Every file under `dir`, relative to it.
fn files(dir: &Path) -> BTreeSet<PathBuf> {
    fn walk(root: &Path, d: &Path, out: &mut BTreeSet<PathBuf>) {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

/// A tensor of a `.pt` file: dtype, shape, bytes.
type PtTensor = (String, Vec<u64>, Vec<u8>);

/// A `.pt` file's tensors: name (its key in the pickled object), dtype, shape, bytes;
/// and the plain values beside them (`cat_dim`), by name.
fn pt(path: &Path) -> (BTreeMap<String, PtTensor>, Option<String>) {
    let f = ckpt_core::formats::TensorFile::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let bytes = full_tensors(path);
    let tensors = f
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                (
                    ckpt_core::layout::strategy::dtype_name(t.dtype).to_string(),
                    t.shape.clone(),
                    bytes[&t.name].clone(),
                ),
            )
        })
        .collect();
    (tensors, f.metadata().get("torch.non_tensor").cloned())
}

#[test]
fn ucp_output_equals_ds_to_universal_tensor_for_tensor() {
    let d = Dir::new();
    for v in VARIANTS {
        let out = format!("u-{v}");
        d.ok(&[
            "merge",
            &fx(&format!("{v}/ckpt")),
            "--format",
            "ucp",
            "-o",
            &out,
        ]);
        let latest = std::fs::read_to_string(d.path(&out).join("latest_universal")).unwrap();
        assert_eq!(latest, "global_step2_universal", "{v}");
        let mine = d.path(&out).join(&latest);
        let theirs = fixtures().join(v).join("ucp");
        // The same files: every parameter's states (and step), the module's other
        // entries (ZeRO-2), the optimizer state, the model states.
        assert_eq!(files(&mine), files(&theirs), "{v}");
        let mut compared = 0;
        for rel in files(&theirs) {
            let (a, b) = (mine.join(&rel), theirs.join(&rel));
            let name = rel.file_name().unwrap().to_str().unwrap();
            if name.ends_with("_model_states.pt") {
                // Copied as they are.
                assert_eq!(
                    std::fs::read(&a).unwrap(),
                    std::fs::read(&b).unwrap(),
                    "{v}: {rel:?}"
                );
            } else if name != "optimizer_state.pt" {
                assert_eq!(pt(&a), pt(&b), "{v}: {rel:?}");
                compared += 1;
            }
        }
        assert!(compared >= 15, "{v}: {compared} state files compared");
    }
}

#[test]
fn optimizer_state_keeps_ds_to_universal_entries() {
    // The global optimizer state has no tensors (ZeRO-2) or rank 0's partitions
    // (ZeRO-3): its tensors are compared where it has some, and the plain values it
    // lists beside them must be the same.
    let d = Dir::new();
    for v in VARIANTS {
        let out = format!("u-{v}");
        d.ok(&[
            "merge",
            &fx(&format!("{v}/ckpt")),
            "--format",
            "ucp",
            "-o",
            &out,
        ]);
        let rel = "global_step2_universal/zero/optimizer_state.pt";
        let a = d.path(&out).join(rel);
        let b = fixtures().join(v).join("ucp/zero/optimizer_state.pt");
        let (ta, na) = (
            ckpt_core::formats::TensorFile::open(&a),
            ckpt_core::formats::TensorFile::open(&b),
        );
        match (ta, na) {
            (Ok(x), Ok(y)) => {
                // ZeRO-3: DeepSpeed's pickle refers to `optimizer_state_dict.param_groups`
                // a second time as `param_groups` (a memo reference, which ckpt's reader
                // lists once); ckpt writes the value twice. torch.load gives equal values.
                let listed = |f: &ckpt_core::formats::TensorFile| -> BTreeSet<String> {
                    f.metadata()["torch.non_tensor"]
                        .split(',')
                        .map(|n| {
                            n.strip_prefix("optimizer_state_dict.")
                                .unwrap_or(n)
                                .to_string()
                        })
                        .collect()
                };
                assert_eq!(listed(&x), listed(&y), "{v}");
                assert_eq!(full_tensors(&a), full_tensors(&b), "{v}");
            }
            (x, y) => assert_eq!(
                x.map(|_| ())
                    .map_err(|e| e.to_string().replace(&a.display().to_string(), "F")),
                y.map(|_| ())
                    .map_err(|e| e.to_string().replace(&b.display().to_string(), "F")),
                "{v}"
            ),
        }
    }
}

#[test]
fn ucp_reads_back_as_the_zero_checkpoint() {
    let d = Dir::new();
    for v in VARIANTS {
        // The ZeRO checkpoint's trainable weights and moments, as ckpt reads them.
        let zero = full_tensors(&fixtures().join(v).join("ckpt"));
        d.ok(&[
            "merge",
            &fx(&format!("{v}/ckpt")),
            "--format",
            "ucp",
            "-o",
            &format!("u-{v}"),
        ]);
        for src in [fixtures().join(v).join("ucp"), d.path(&format!("u-{v}"))] {
            let got = full_tensors(&src);
            let mut trainable = 0;
            for (name, bytes) in &got {
                let Some(want) = zero.get(name) else {
                    panic!("{v}: {src:?} has `{name}`, which the ZeRO checkpoint has not");
                };
                if name.starts_with("optim.") || zero.contains_key(&format!("optim.{name}.exp_avg"))
                {
                    assert!(want == bytes, "{v}: `{name}` of {src:?}");
                    trainable += 1;
                }
            }
            // fc1/fc2 weight and bias, embed: 5 parameters, 3 states each.
            assert_eq!(trainable, 15, "{v}: {src:?}");
            // The shapes are the parameters' (ZeRO-3's files are flat).
            let ck = ckpt_core::Checkpoint::open(std::slice::from_ref(&src)).unwrap();
            assert_eq!(ck.tensors["fc1.weight"].shape, vec![7, 6], "{v}");
        }
        // Through `latest_universal`, as DeepSpeed finds it, and with inspect.
        let o = d.ok(&["inspect", &format!("u-{v}")]);
        assert!(o.stdout.contains("fc1.weight"), "{}", o.stdout);
        d.ok(&["merge", &format!("u-{v}"), "-o", &format!("m-{v}")]);
        let merged = full_tensors(&d.path(&format!("m-{v}")));
        assert_eq!(merged["fc1.weight"], zero["fc1.weight"], "{v}");
    }
}

#[test]
fn a_parameter_without_its_fp32_file_is_refused_by_name() {
    let d = Dir::new();
    let tree = d.path("ucp");
    for rel in files(&fixtures().join("zero2_fp32/ucp")) {
        let dest = tree.join(&rel);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(fixtures().join("zero2_fp32/ucp").join(&rel), dest).unwrap();
    }
    std::fs::remove_file(tree.join("zero/fc1.bias/fp32.pt")).unwrap();
    let o = d.fails(&["merge", "ucp", "-o", "out"]);
    assert!(
        o.stderr.contains("fc1.bias/fp32.pt") && o.stderr.contains("universal"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
    // A state file that is truncated.
    std::fs::copy(
        fixtures().join("zero2_fp32/ucp/zero/fc1.bias/fp32.pt"),
        tree.join("zero/fc1.bias/fp32.pt"),
    )
    .unwrap();
    let bytes = std::fs::read(tree.join("zero/fc1.weight/exp_avg.pt")).unwrap();
    std::fs::write(
        tree.join("zero/fc1.weight/exp_avg.pt"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    let o = d.fails(&["merge", "ucp", "-o", "out"]);
    assert!(o.stderr.contains("fc1.weight/exp_avg.pt"), "{}", o.stderr);
    assert!(!d.path("out").exists());
}

#[test]
fn ucp_output_needs_a_zero_source() {
    let d = Dir::new();
    let o = d.fails(&[
        "merge",
        &fx("zero2_fp32/ucp"),
        "--format",
        "ucp",
        "-o",
        "out",
    ]);
    assert!(o.stderr.contains("--format ucp"), "{}", o.stderr);
    assert!(!d.path("out").exists());
}

/// ds_to_universal run into the save directory leaves `latest` (the ZeRO tag) and
/// `latest_universal` side by side, possibly of different steps: which one to read is
/// the user's to say. Refused, naming both; each tag directory reads on its own.
#[test]
fn a_save_directory_with_both_latest_files_is_refused() {
    let d = Dir::new();
    let save = d.path("save");
    copy_dir(&fixtures().join("zero2_fp32/ckpt"), &save);
    copy_dir(
        &fixtures().join("zero2_fp32/ucp"),
        &save.join("global_step2_universal"),
    );
    std::fs::write(save.join("latest_universal"), "global_step2_universal").unwrap();
    let o = d.fails(&["merge", "save", "-o", "out"]);
    assert!(
        o.stderr.contains("latest_universal")
            && o.stderr.contains("global_step2_universal")
            && o.stderr
                .contains("save/global_step2 or save/global_step2_universal"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
    d.ok(&["merge", "save/global_step2", "-o", "zero"]);
    d.ok(&["merge", "save/global_step2_universal", "-o", "universal"]);
    let (zero, universal) = (
        full_tensors(&d.path("zero")),
        full_tensors(&d.path("universal")),
    );
    assert_eq!(zero["fc1.weight"], universal["fc1.weight"]);
}

/// The writers added for DeepSpeed give the same bytes whatever the thread count: the
/// universal checkpoint (its state files are copied by the parallel engine) and the
/// ZeRO checkpoint for another data-parallel size.
#[test]
fn deepspeed_outputs_are_the_same_bytes_on_1_and_4_threads() {
    let d = Dir::new();
    let zero3 = fx("zero3_fp32/ckpt");
    let zero2 = fx("zero2_fp16/ckpt");
    let zero3_bf16 = fx("zero3_bf16/ckpt");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let distopt = fixtures.join("megatron/tp2pp2dp2_distopt/legacy");
    let tp = fixtures.join("deepspeed_tp/zero3_uci/ckpt");
    let (distopt, tp) = (distopt.display().to_string(), tp.display().to_string());
    let path = |rel: &str| fixtures.join(rel).display().to_string();
    let (vp, dp_buckets, flat) = (
        path("megatron/tp2pp2vp2/legacy"),
        path("megatron/tp2pp2dp2_distopt/dist_ckpt_dp"),
        path("megatron/tp2pp2dp2_flat/dist_ckpt"),
    );
    // Every writer this work added: UCP, ZeRO-1/2 and ZeRO-3 write-back, Megatron's
    // distributed-optimizer state with the QKV split, DeepSpeed tensor parallelism,
    // Megatron legacy write-back carrying the RNG state, dist_ckpt optimizer states
    // saved dp_reshardable and flattened (fully_sharded_model_space).
    let runs: [(&str, Vec<&str>); 8] = [
        ("u", vec!["merge", &zero3, "--format", "ucp"]),
        (
            "z",
            vec!["reshard", &zero2, "--to", "3", "--format", "deepspeed"],
        ),
        (
            "z3",
            vec!["reshard", &zero3_bf16, "--to", "3", "--format", "deepspeed"],
        ),
        ("m", vec!["merge", &distopt, "--split-qkv"]),
        ("t", vec!["reshard", &tp, "--to", "3"]),
        (
            "r",
            vec![
                "reshard",
                &vp,
                "--mesh",
                "pp=2,tp=2",
                "--format",
                "megatron",
            ],
        ),
        ("b", vec!["merge", &dp_buckets]),
        ("f", vec!["reshard", &flat, "--to", "2"]),
    ];
    for (out, args) in &runs {
        for t in [1, 4] {
            let o = format!("{out}{t}");
            d.ok_with_threads(&[&args[..], &["-o", &o]].concat(), t);
        }
        let (a, b) = (d.path(&format!("{out}1")), d.path(&format!("{out}4")));
        assert_eq!(files(&a), files(&b));
        for rel in files(&a) {
            let same = std::fs::read(a.join(&rel)).unwrap() == std::fs::read(b.join(&rel)).unwrap();
            assert!(
                same,
                "{} differs between 1 and 4 threads",
                a.join(&rel).display()
            );
        }
    }
}
