//! tensorstore and orbax read what the writer writes. These run only where
//! `CKPT_PYTHON_JAX` names a Python with tensorstore (and orbax-checkpoint, jax,
//! zstandard for the orbax check), e.g. `/work/venv-jax/bin/python`; elsewhere they
//! print SKIPPED and pass without checking anything.

use std::path::{Path, PathBuf};
use std::process::Command;

use ckpt_ocdbt::{Compression, Database, Writer, WriterOptions};

use crate::round_trip::orbax_like_items;
use crate::util::{contents, copy_dir, fixture, hex, script};

fn python(test: &str) -> Option<PathBuf> {
    match std::env::var_os("CKPT_PYTHON_JAX") {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => {
            println!("SKIPPED {test}: set CKPT_PYTHON_JAX to a python with tensorstore (e.g. /work/venv-jax/bin/python)");
            None
        }
    }
}

fn run(py: &Path, args: &[&Path]) {
    let out = Command::new(py).args(args).output().expect("run python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "{args:?} failed:\n{text}");
}

/// Writes `items` with `options`, the expected JSON beside, and has tensorstore check.
fn check_with_tensorstore(
    py: &Path,
    name: &str,
    items: &[(Vec<u8>, Vec<u8>, bool)],
    options: WriterOptions,
) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    let mut w = Writer::create(&dir, options).unwrap();
    for (k, v, reserve) in items {
        if *reserve {
            let r = w.reserve(k, v.len() as u64).unwrap();
            std::os::unix::fs::FileExt::write_all_at(
                &std::fs::OpenOptions::new()
                    .write(true)
                    .open(&r.path)
                    .unwrap(),
                v,
                r.offset,
            )
            .unwrap();
        } else {
            w.put(k, v).unwrap();
        }
    }
    let summary = w.finish().unwrap();
    println!(
        "{name}: {} keys, height {}, {} nodes",
        summary.keys, summary.height, summary.nodes
    );
    let expected: serde_json::Map<String, serde_json::Value> = items
        .iter()
        .map(|(k, v, _)| (String::from_utf8(k.clone()).unwrap(), hex(v).into()))
        .collect();
    let json = tmp.path().join("expected.json");
    std::fs::write(&json, serde_json::to_vec(&expected).unwrap()).unwrap();
    // Our reader agrees first.
    assert_eq!(contents(&Database::open(&dir).unwrap()).len(), items.len());
    run(py, &[&script("ocdbt_check.py"), &dir, &json]);
}

#[test]
fn tensorstore_reads_what_the_writer_writes() {
    let Some(py) = python("tensorstore_reads_what_the_writer_writes") else {
        return;
    };
    let small: Vec<(Vec<u8>, Vec<u8>, bool)> = vec![
        (b"w/.zarray".to_vec(), br#"{"a":1}"#.to_vec(), false),
        (b"w/0.0".to_vec(), (0..20).collect(), false),
        (b"w/0.1".to_vec(), b"xyz".to_vec(), false),
        (
            "\u{e9}t\u{e9}/\u{fc}".as_bytes().to_vec(),
            b"utf-8 key".to_vec(),
            false,
        ),
        (b"".to_vec(), b"empty key".to_vec(), false),
        (b"z/empty".to_vec(), Vec::new(), false),
    ];
    let uncompressed = WriterOptions::new()
        .max_inline_value_bytes(8)
        .compression(Compression::None);
    check_with_tensorstore(&py, "single_leaf_uncompressed", &small, uncompressed);
    let all_out_of_line = WriterOptions::new().max_inline_value_bytes(0);
    check_with_tensorstore(&py, "all_out_of_line", &small, all_out_of_line);
    check_with_tensorstore(&py, "empty", &[], WriterOptions::new());
    let items = orbax_like_items(60, 40);
    // Orbax's configuration: one leaf, zstd, inline up to 1024, some values reserved.
    check_with_tensorstore(&py, "orbax_defaults", &items, WriterOptions::new());
    for (name, c) in [
        ("multi_level_zstd", Compression::Zstd { level: 3 }),
        ("multi_level_raw", Compression::None),
    ] {
        let options = WriterOptions::new()
            .max_inline_value_bytes(16)
            .max_decoded_node_bytes(300)
            .compression(c);
        check_with_tensorstore(&py, name, &items, options);
    }
    // Long keys sharing long prefixes, in a tree of several levels.
    let long: Vec<(Vec<u8>, Vec<u8>, bool)> = (0..40u32)
        .map(|i| {
            let mut k = "p/".repeat(3000).into_bytes();
            k.extend(format!("{:04}/{}", i / 7, i).bytes());
            (k, vec![i as u8; (i * 13 % 50) as usize], i % 3 == 0)
        })
        .collect();
    let options = WriterOptions::new()
        .max_inline_value_bytes(10)
        .max_decoded_node_bytes(2000);
    check_with_tensorstore(&py, "long_keys", &long, options);
}

/// An orbax item directory whose OCDBT database the writer rewrote (every key and
/// value of the fixture's, the orbax files beside copied): orbax restores it to the
/// reference arrays, as numpy arrays and onto a 4-device mesh (`scripts/orbax_check.py`).
#[test]
fn orbax_restores_items_the_writer_rewrote() {
    let Some(py) = python("orbax_restores_items_the_writer_rewrote") else {
        return;
    };
    for (item, reference) in [
        (
            "ocdbt_zarr3/ckpt/2/items",
            "ocdbt_zarr3/reference.safetensors",
        ),
        (
            "ocdbt_zarr2/ckpt/1/default",
            "ocdbt_zarr2/reference.safetensors",
        ),
    ] {
        let src = fixture(item);
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("items");
        let mut w = Writer::create(&dir, WriterOptions::new()).unwrap();
        for (k, v) in contents(&Database::open(&src).unwrap()) {
            w.put(&k, &v).unwrap();
        }
        w.finish().unwrap();
        for f in ["_METADATA", "_sharding"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        copy_dir(&src.join("array_metadatas"), &dir.join("array_metadatas"));
        run(&py, &[&script("orbax_check.py"), &dir, &fixture(reference)]);
    }
}
