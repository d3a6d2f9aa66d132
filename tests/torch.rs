//! PyTorch `torch.save` files written by torch itself (tests/fixtures/torch, made by
//! scripts/fixtures/torch.py): DDP state dicts (`module.` prefix) as `.pth` and `.bin`,
//! views into shared storages, a nested model + AdamW state, a non-contiguous view;
//! DCP's default format (`.metadata` + `.distcp`).

use crate::util::{full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch")
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).display().to_string()
}

/// Every tensor of ddp.pth and optim.pt, contiguous, as torch holds them.
fn originals() -> BTreeMap<String, Vec<u8>> {
    full_tensors(&fixtures().join("full_torch_save.safetensors"))
}

fn starting(prefix: &str) -> BTreeMap<String, Vec<u8>> {
    originals()
        .into_iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .collect()
}

#[test]
fn ddp_pth_and_bin_merge_byte_exactly() {
    let d = Dir::new();
    for f in ["ddp.pth", "ddp.bin"] {
        let out = format!("m-{f}");
        d.ok(&["merge", &fx(f), "-o", &out]);
        assert_eq!(full_tensors(&d.path(&out)), starting("module."), "{f}");
    }
    let o = d.ok(&["verify", &fx("ddp.pth")]);
    assert!(
        o.stdout.contains("ok: 1 file(s), 8 tensors"),
        "{}",
        o.stdout
    );
}

#[test]
fn strip_and_add_prefix_rename_every_tensor() {
    let d = Dir::new();
    let o = d.ok(&["inspect", &fx("ddp.pth")]);
    assert!(o.stdout.contains("module.split.b"), "{}", o.stdout);
    assert!(
        o.stdout.contains("every tensor name starts with `module.`")
            || o.stderr.contains("every tensor name starts with `module.`"),
        "{}{}",
        o.stdout,
        o.stderr
    );
    // On inspect and verify too; the note suggesting it goes once it is done.
    let o = d.ok(&["inspect", &fx("ddp.pth"), "--strip-prefix", "module."]);
    assert!(
        o.stdout.contains("\nsplit.b ")
            && !o.stdout.contains("module.")
            && !o.stderr.contains("starts with"),
        "{}{}",
        o.stdout,
        o.stderr
    );
    d.ok(&["verify", &fx("ddp.pth"), "--strip-prefix", "module."]);
    let o = d.ok(&[
        "merge",
        &fx("ddp.pth"),
        "--strip-prefix",
        "module.",
        "-o",
        "s",
    ]);
    assert!(!o.stderr.contains("starts with"), "{}", o.stderr);
    let want: BTreeMap<String, Vec<u8>> = starting("module.")
        .into_iter()
        .map(|(k, v)| (k["module.".len()..].to_string(), v))
        .collect();
    assert_eq!(full_tensors(&d.path("s")), want);
    d.ok(&[
        "merge",
        &fx("ddp.pth"),
        "--strip-prefix",
        "module.",
        "--add-prefix",
        "model.",
        "--include",
        "model.layer.*",
        "-o",
        "a",
    ]);
    let got = full_tensors(&d.path("a"));
    assert_eq!(
        got.keys().cloned().collect::<Vec<_>>(),
        [
            "model.layer.norm.weight",
            "model.layer.o.weight",
            "model.layer.q.weight"
        ]
    );
    assert_eq!(
        got["model.layer.q.weight"],
        originals()["module.layer.q.weight"]
    );
}

#[test]
fn nested_optimizer_state_is_named_by_path() {
    let d = Dir::new();
    let o = d.ok(&["inspect", &fx("optim.pt")]);
    assert!(
        o.stdout.contains("optim.state.0.exp_avg_sq"),
        "{}",
        o.stdout
    );
    d.ok(&["merge", &fx("optim.pt"), "-o", "m"]);
    let mut want = starting("model.");
    want.extend(starting("optim."));
    assert_eq!(full_tensors(&d.path("m")), want);
}

#[test]
fn bad_torch_save_files_are_named_errors() {
    let d = Dir::new();
    let o = d.fails(&["inspect", &fx("noncontig.pth")]);
    assert!(
        o.stderr.contains("`w`") && o.stderr.contains("non-contiguous"),
        "{}",
        o.stderr
    );

    let good = std::fs::read(fixtures().join("ddp.pth")).unwrap();
    let patch = |from: &[u8], to: &[u8], name: &str| {
        assert_eq!(from.len(), to.len());
        let at = good
            .windows(from.len())
            .position(|w| w == from)
            .expect("pattern in ddp.pth");
        let mut b = good.clone();
        b[at..at + to.len()].copy_from_slice(to);
        std::fs::write(d.path(name), b).unwrap();
    };
    // A global outside the allow-list (same length, so the zip stays intact).
    patch(b"torch._utils\n", b"__builtins__\n", "global.pth");
    let o = d.fails(&["inspect", "global.pth"]);
    assert!(
        o.stderr.contains("global.pth")
            && o.stderr.contains("`__builtins__._rebuild_tensor_v2`")
            && o.stderr.contains("not allowed"),
        "{}",
        o.stderr
    );
    // The first storage's element count off by one: its bytes do not match.
    patch(b"cpuq\x06K0", b"cpuq\x06K1", "count.pth");
    let o = d.fails(&["inspect", "count.pth"]);
    assert!(
        o.stderr.contains("`module.embed.weight`") && o.stderr.contains("49 elements"),
        "{}",
        o.stderr
    );
    // Truncated.
    std::fs::write(d.path("trunc.pth"), &good[..good.len() / 2]).unwrap();
    let o = d.fails(&["inspect", "trunc.pth"]);
    assert!(
        o.stderr.contains("trunc.pth") && o.stderr.contains("not a readable zip archive"),
        "{}",
        o.stderr
    );
    // The legacy (pre-1.6) format.
    std::fs::write(
        d.path("legacy.pt"),
        b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.",
    )
    .unwrap();
    let o = d.fails(&["inspect", "legacy.pt"]);
    assert!(
        o.stderr.contains("legacy torch.save format"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_directory_of_torch_save_files_opens() {
    let d = Dir::new();
    std::fs::create_dir(d.path("dir")).unwrap();
    std::fs::copy(fixtures().join("ddp.bin"), d.path("dir/pytorch_model.bin")).unwrap();
    d.ok(&["merge", "dir", "-o", "m"]);
    assert_eq!(full_tensors(&d.path("m")), starting("module."));
}

/// DCP's default format as torch 2.15 writes it: 2 ranks on a 1-D mesh (`dcp/`), and
/// 4 ranks on a 2x2 mesh with nested, uneven and empty pieces plus model and AdamW
/// state from get_state_dict (`dcp_mesh/`).
#[test]
fn dcp_default_format_merges_and_reshards_byte_exactly() {
    let d = Dir::new();
    let small = full_tensors(&fixtures().join("full.safetensors"));
    d.ok(&["merge", &fx("dcp"), "-o", "small"]);
    assert_eq!(full_tensors(&d.path("small")), small);

    let want = full_tensors(&fixtures().join("dcp_mesh_full.safetensors"));
    let o = d.ok(&["inspect", &fx("dcp_mesh")]);
    assert!(
        o.stdout
            .contains("PyTorch DCP checkpoint, 4 file(s), 22 tensors"),
        "{}",
        o.stdout
    );
    let notes = format!("{}{}", o.stdout, o.stderr);
    assert!(
        notes.contains("12 value(s) that are not tensors (BYTE_IO)")
            && notes.contains("optim.param_groups.0.lr"),
        "{notes}"
    );
    let o = d.ok(&["verify", &fx("dcp_mesh")]);
    assert!(
        o.stdout.contains("every element owned exactly once"),
        "{}",
        o.stdout
    );
    assert!(!o.stderr.contains("cannot be detected"), "{}", o.stderr);
    d.ok(&["merge", &fx("dcp_mesh"), "-o", "m"]);
    assert_eq!(full_tensors(&d.path("m")), want);
    for n in ["2", "3"] {
        let out = format!("r{n}");
        d.ok(&["reshard", &fx("dcp_mesh"), "--to", n, "-o", &out]);
        let m = format!("m{n}");
        d.ok(&["merge", &out, "-o", &m]);
        assert_eq!(full_tensors(&d.path(&m)), want, "--to {n}");
    }
    // The split dimension is kept (dim 1 for [Replicate, Shard(1)]), and --shard wins.
    let s = std::fs::read_to_string(d.path("r2/strategy.json")).unwrap();
    let s: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(s["tensors"]["layer.q.weight"]["placements"][0], "Shard(1)");
    assert_eq!(s["tensors"]["model.0.weight"]["placements"][0], "Replicate");
    d.ok(&[
        "reshard",
        &fx("dcp_mesh"),
        "--to",
        "2",
        "--shard",
        "model.*.weight=0",
        "-o",
        "r2s",
    ]);
    let s = std::fs::read_to_string(d.path("r2s/strategy.json")).unwrap();
    let s: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(s["tensors"]["model.0.weight"]["placements"][0], "Shard(0)");
    // Megatron's torch_dist: the same DCP files plus common.pt and metadata.json.
    let meg = d.path("megatron");
    std::fs::create_dir(&meg).unwrap();
    for f in std::fs::read_dir(fixtures().join("dcp_mesh")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, meg.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::copy(fixtures().join("optim.pt"), meg.join("common.pt")).unwrap();
    std::fs::write(
        meg.join("metadata.json"),
        r#"{"sharded_backend": "torch_dist"}"#,
    )
    .unwrap();
    let o = d.ok(&["merge", "megatron", "-o", "meg"]);
    assert!(o.stderr.contains("common.pt is not read"), "{}", o.stderr);
    assert_eq!(full_tensors(&d.path("meg")), want);
    // A single .distcp file: the others' pieces are gaps, named.
    let o = d.fails(&["merge", &fx("dcp_mesh/__1_0.distcp"), "-o", "one"]);
    assert!(
        o.stderr
            .contains("`embed.weight`: elements [0..4, 0..3] are missing"),
        "{}",
        o.stderr
    );
    assert!(!d.path("one").exists());
}

/// ckpt's own torch outputs read back byte-exactly (torch itself reads them in
/// scripts/torch_interop.py): `merge --format torch` (one model.pth) and `reshard
/// --format distcp` (DCP's default format), from every source kind.
#[test]
fn torch_outputs_round_trip() {
    let d = Dir::new();
    let want = full_tensors(&fixtures().join("dcp_mesh_full.safetensors"));
    d.ok(&["merge", &fx("dcp_mesh"), "--format", "torch", "-o", "pth"]);
    assert!(d.path("pth/model.pth").is_file());
    d.ok(&["merge", "pth", "-o", "back"]);
    assert_eq!(full_tensors(&d.path("back")), want);
    let o = d.fails(&[
        "merge",
        &fx("dcp_mesh"),
        "--format",
        "torch",
        "--max-shard-size",
        "1KB",
        "-o",
        "x",
    ]);
    assert!(o.stderr.contains("one model.pth"), "{}", o.stderr);

    for n in ["1", "3", "5"] {
        let out = format!("d{n}");
        d.ok(&[
            "reshard",
            &fx("dcp_mesh"),
            "--to",
            n,
            "--format",
            "distcp",
            "-o",
            &out,
        ]);
        let names: Vec<String> = std::fs::read_dir(d.path(&out))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&".metadata".to_string()), "{names:?}");
        assert!(names.contains(&"__0_0.distcp".to_string()), "{names:?}");
        let o = d.ok(&["verify", &out]);
        assert!(o.stdout.contains("22 tensors"), "{}", o.stdout);
        let m = format!("m{n}");
        d.ok(&["merge", &out, "-o", &m]);
        assert_eq!(full_tensors(&d.path(&m)), want, "--to {n}");
    }
    // From ckpt's own sliced layout too, one rank at a time into one output.
    d.ok(&["reshard", &fx("dcp_mesh"), "--to", "2", "-o", "sliced"]);
    for r in ["0", "1"] {
        d.ok(&[
            "reshard", "sliced", "--to", "2", "--format", "distcp", "--rank", r, "-o", "byrank",
        ]);
    }
    d.ok(&["merge", "byrank", "-o", "mb"]);
    assert_eq!(full_tensors(&d.path("mb")), want);
}

#[test]
fn broken_dcp_directories_are_named_errors() {
    let d = Dir::new();
    let copy = |name: &str| {
        let dir = d.path(name);
        std::fs::create_dir(&dir).unwrap();
        for f in std::fs::read_dir(fixtures().join("dcp_mesh")).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
        dir
    };
    // A missing data file.
    let dir = copy("missing");
    std::fs::remove_file(dir.join("__2_0.distcp")).unwrap();
    let o = d.fails(&["verify", "missing"]);
    let all = format!("{}{}", o.stdout, o.stderr);
    assert!(
        all.contains("__2_0.distcp: No such file")
            && all.contains("`tiny`: elements [2..3] are missing"),
        "{all}"
    );
    // A truncated data file.
    let dir = copy("trunc");
    let f = dir.join("__3_0.distcp");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() - 100]).unwrap();
    let o = d.fails(&["verify", "trunc"]);
    let all = format!("{}{}", o.stdout, o.stderr);
    assert!(
        all.contains("__3_0.distcp") && all.contains("past the end"),
        "{all}"
    );
    // A global outside the allow-list in .metadata (same length: the pickle holds).
    let dir = copy("global");
    let m = dir.join(".metadata");
    let b = std::fs::read(&m).unwrap();
    let from = b"torch.serialization";
    let at = b.windows(from.len()).position(|w| w == from).unwrap();
    let mut b2 = b.clone();
    b2[at..at + from.len()].copy_from_slice(b"subprocess.Popen.xx");
    std::fs::write(&m, &b2).unwrap();
    let o = d.fails(&["inspect", "global"]);
    assert!(
        o.stderr.contains(".metadata") && o.stderr.contains("`subprocess.Popen.xx._get_layout`"),
        "{}",
        o.stderr
    );
    // A truncated .metadata.
    std::fs::write(&m, &b[..b.len() / 2]).unwrap();
    let o = d.fails(&["inspect", "global"]);
    assert!(
        o.stderr.contains(".metadata") && o.stderr.contains("truncated"),
        "{}",
        o.stderr
    );
    // .distcp files without .metadata.
    let dir = copy("nometa");
    std::fs::remove_file(dir.join(".metadata")).unwrap();
    let o = d.fails(&["inspect", "nometa"]);
    assert!(o.stderr.contains("without the `.metadata`"), "{}", o.stderr);
}

#[test]
fn a_whole_torch_save_copy_reshards_with_shard_rules() {
    let d = Dir::new();
    let o = d.fails(&["reshard", &fx("ddp.pth"), "--to", "2", "-o", "x"]);
    assert!(o.stderr.contains("--shard NAME_GLOB=DIM"), "{}", o.stderr);
    for n in ["2", "3"] {
        let out = format!("r{n}");
        d.ok(&[
            "reshard",
            &fx("ddp.pth"),
            "--strip-prefix",
            "module.",
            "--to",
            n,
            "--shard",
            "*.q.weight=0",
            "--shard",
            "*.o.weight=1",
            "--shard",
            "embed.weight=0",
            "-o",
            &out,
        ]);
        let o = d.ok(&["inspect", &out]);
        assert!(
            o.stdout.contains("S(1)") || o.stdout.contains("Shard(1)"),
            "{}",
            o.stdout
        );
        let m = format!("m{n}");
        d.ok(&["merge", &out, "-o", &m]);
        let want: BTreeMap<String, Vec<u8>> = starting("module.")
            .into_iter()
            .map(|(k, v)| (k["module.".len()..].to_string(), v))
            .collect();
        assert_eq!(full_tensors(&d.path(&m)), want, "--to {n}");
    }
    let o = d.fails(&[
        "reshard",
        &fx("ddp.pth"),
        "--to",
        "2",
        "--shard",
        "*scale=0",
        "-o",
        "y",
    ]);
    assert!(
        o.stderr.contains("module.scale") && o.stderr.contains("0 dimension"),
        "{}",
        o.stderr
    );
}
