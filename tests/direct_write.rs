//! The copy engine's direct path (slabs written straight from the inputs: runs copied
//! file to file by the kernel with `copy_file_range`, or from the mappings with
//! `pwritev`) against its gathered path (`CKPT_TEST_NO_DIRECT`): the same bytes, file
//! for file, on the reshards and merges that take it (Megatron legacy TP x PP, with
//! row- and column-sharded matrices) and on one that casts (gathered either way).

use crate::util::Dir;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron/tp2pp2/legacy")
        .display()
        .to_string()
}

/// Every file under `dir` (or `dir` itself, a file), by relative path, with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    if dir.is_file() {
        out.insert(PathBuf::new(), std::fs::read(dir).unwrap());
        return out;
    }
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// How the copy engine writes a slab (set through its test variables).
#[derive(Clone, Copy, Debug)]
enum WritePath {
    /// Every run of an input file copied by the kernel, however short.
    Kernel,
    /// Every run written from the mappings (the kernel copy's fallback).
    Mapped,
    /// Every slab gathered into a buffer first.
    Gathered,
}

fn run(d: &Dir, args: &[&str], path: WritePath) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    cmd.args(args).current_dir(d.tmp.path());
    match path {
        WritePath::Kernel => cmd.env("CKPT_TEST_COPY_RANGE", "1"),
        WritePath::Mapped => cmd.env("CKPT_TEST_COPY_RANGE", "off"),
        WritePath::Gathered => cmd.env("CKPT_TEST_NO_DIRECT", "1"),
    };
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "ckpt {args:?} ({path:?}) failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn direct_and_gathered_writes_give_the_same_files() {
    let d = Dir::new();
    let src = fixture();
    let cases: [&[&str]; 5] = [
        &["reshard", &src, "--to", "1"],
        &["reshard", &src, "--to", "4"],
        &[
            "reshard",
            &src,
            "--mesh",
            "pp=4,tp=1",
            "--format",
            "megatron",
        ],
        &["merge", &src],
        &["merge", &src, "--dtype", "bf16"],
    ];
    for (i, args) in cases.iter().enumerate() {
        let paths = [WritePath::Gathered, WritePath::Mapped, WritePath::Kernel];
        let mut outs = Vec::new();
        for path in paths {
            let out = format!("o{i}{path:?}");
            let mut a = args.to_vec();
            a.extend(["-o", &out]);
            run(&d, &a, path);
            outs.push(files(&d.path(&out)));
        }
        assert!(!outs[0].is_empty(), "{args:?} wrote nothing");
        for (path, out) in paths.iter().zip(&outs).skip(1) {
            assert_eq!(
                outs[0].keys().collect::<Vec<_>>(),
                out.keys().collect::<Vec<_>>(),
                "{args:?} {path:?}"
            );
            for (name, bytes) in &outs[0] {
                assert!(
                    bytes == &out[name],
                    "{args:?}: {} differs between the gathered and the {path:?} path",
                    name.display()
                );
            }
        }
    }
}
