//! Compressed checkpoints (issue 15): `--compress` outputs, `ckpt compress` and
//! `decompress`, and every command reading `.ckptz` inputs to the same bytes as the
//! uncompressed ones; damaged compressed files are named errors.

use crate::util::Dir;
use std::collections::BTreeMap;
use std::path::Path;

/// Every file below `root` with its bytes, by path relative to `root`.
fn tree(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// A 4-rank example with BF16 weights and F32 optimizer moments, and its compressed
/// copy `exz`, in chunks small enough that tensors span several.
fn compressed_example(d: &Dir) {
    d.ok(&[
        "example",
        "ex",
        "--mesh",
        "dp=2,tp=2",
        "--hidden",
        "64",
        "--vocab",
        "301",
        "--optimizer",
    ]);
    d.ok(&["compress", "ex", "-o", "exz", "--chunk-bytes", "1000"]);
}

#[test]
fn decompress_of_compress_is_byte_identical() {
    let d = Dir::new();
    compressed_example(&d);
    let z = tree(&d.path("exz"));
    assert!(z.contains_key("ckpt_3/model.ckptz"), "{:?}", z.keys());
    assert_eq!(
        z["strategy.json"],
        std::fs::read(d.path("ex/strategy.json")).unwrap()
    );
    assert!(z["ckpt_0/model.ckptz"].starts_with(ckpt_core::formats::ckptz::MAGIC.as_slice()));
    d.ok(&["decompress", "exz", "-o", "back"]);
    assert_eq!(tree(&d.path("back")), tree(&d.path("ex")));
    // One file too, to a file.
    d.ok(&["merge", "ex", "-o", "m", "-q"]);
    d.ok(&[
        "compress",
        "m/model.safetensors",
        "-o",
        "m.ckptz",
        "--level",
        "9",
    ]);
    d.ok(&["decompress", "m.ckptz", "-o", "m2.safetensors"]);
    assert_eq!(
        std::fs::read(d.path("m2.safetensors")).unwrap(),
        std::fs::read(d.path("m/model.safetensors")).unwrap()
    );
    // The wrong way round is refused by name.
    let o = d.fails(&["decompress", "m/model.safetensors", "-o", "x"]);
    assert!(
        o.stderr.contains("a safetensors file, not ckptz"),
        "{}",
        o.stderr
    );
    assert!(!d.path("x").exists());
}

#[test]
fn commands_read_compressed_inputs_as_the_originals() {
    let d = Dir::new();
    compressed_example(&d);
    let o = d.ok(&["verify", "exz"]);
    assert!(o.stdout.contains("checksums match"), "{}", o.stdout);
    d.ok(&["verify", "exz", "--deep"]);
    d.ok(&["inspect", "exz"]);
    d.ok(&["merge", "ex", "-o", "m", "-q"]);
    d.ok(&["merge", "exz", "-o", "mz", "-q"]);
    assert_eq!(tree(&d.path("mz")), tree(&d.path("m")));
    d.ok(&["reshard", "ex", "-o", "r3", "--to", "3", "-q"]);
    d.ok(&["reshard", "exz", "-o", "r3z", "--to", "3", "-q"]);
    assert_eq!(tree(&d.path("r3z")), tree(&d.path("r3")));
    // A partial read: one target rank, from compressed slices.
    d.ok(&[
        "reshard", "exz", "-o", "one", "--to", "3", "--rank", "1", "-q",
    ]);
    assert_eq!(
        std::fs::read(d.path("one/ckpt_1/model.safetensors")).unwrap(),
        std::fs::read(d.path("r3/ckpt_1/model.safetensors")).unwrap()
    );
    // With a cast, through the decompressed bytes.
    d.ok(&[
        "merge",
        "ex",
        "-o",
        "h",
        "--dtype",
        "f16",
        "--exclude",
        "step",
        "-q",
    ]);
    d.ok(&[
        "merge",
        "exz",
        "-o",
        "hz",
        "--dtype",
        "f16",
        "--exclude",
        "step",
        "-q",
    ]);
    assert_eq!(tree(&d.path("hz")), tree(&d.path("h")));
}

#[test]
fn compressed_outputs_read_back_to_the_same_bytes() {
    let d = Dir::new();
    compressed_example(&d);
    d.ok(&["merge", "ex", "-o", "m", "-q"]);
    // Sharded, compressed: .ckptz shards and their own index.
    d.ok(&[
        "merge",
        "ex",
        "-o",
        "mz",
        "-q",
        "--compress",
        "zstd:1",
        "--max-shard-size",
        "40KB",
    ]);
    let z = tree(&d.path("mz"));
    assert!(z.contains_key("model.ckptz.index.json"), "{:?}", z.keys());
    assert!(z
        .keys()
        .all(|k| k.ends_with(".ckptz") || k.ends_with(".index.json")));
    let index = String::from_utf8(z["model.ckptz.index.json"].clone()).unwrap();
    assert!(
        index.contains("-of-000") && index.contains(".ckptz\""),
        "{index}"
    );
    d.ok(&["verify", "mz"]);
    d.ok(&["merge", "mz", "-o", "m2", "-q"]);
    assert_eq!(tree(&d.path("m2")), tree(&d.path("m")));
    // Resharded compressed, then back to one plain file.
    d.ok(&[
        "reshard",
        "ex",
        "-o",
        "rz",
        "--to",
        "3",
        "--compress",
        "zstd",
        "-q",
    ]);
    assert!(d.path("rz/ckpt_2/model.ckptz").is_file());
    d.ok(&["verify", "rz"]);
    d.ok(&["merge", "rz", "-o", "m3", "-q"]);
    assert_eq!(tree(&d.path("m3")), tree(&d.path("m")));
    // Formats other programs read are not written compressed.
    let o = d.fails(&[
        "reshard",
        "ex",
        "-o",
        "dz",
        "--to",
        "2",
        "--format",
        "dcp-safetensors",
        "--compress",
        "zstd",
    ]);
    assert!(
        o.stderr
            .contains("does not combine with --format dcp-safetensors"),
        "{}",
        o.stderr
    );
    assert!(!d.path("dz").exists());
    let o = d.ckpt(&["merge", "ex", "-o", "bad", "--compress", "zstd:99"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let o = d.ckpt(&["merge", "ex", "-o", "bad", "--compress", "gzip"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
}

/// The data area's start of a `.ckptz` file.
fn data_start(bytes: &[u8]) -> usize {
    16 + u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize
}

#[test]
fn damaged_compressed_files_are_named_errors() {
    let d = Dir::new();
    compressed_example(&d);
    let f = d.path("exz/ckpt_1/model.ckptz");
    let good = std::fs::read(&f).unwrap();
    // A flipped byte in the middle of the data area: the chunk's CRC-32C (or zstd's
    // decoder) catches it, whichever chunk it lands in.
    let mut bad = good.clone();
    let at = data_start(&good) + (good.len() - data_start(&good)) / 2;
    bad[at] ^= 0x5a;
    std::fs::write(&f, &bad).unwrap();
    let o = d.fails(&["verify", "exz"]);
    assert!(
        o.stdout.contains("ckpt_1/model.ckptz: tensor `"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("compressed chunk") && o.stdout.contains("is damaged"),
        "{}",
        o.stdout
    );
    let o = d.fails(&["merge", "exz", "-o", "out", "-q"]);
    assert!(
        o.stderr.contains("ckpt_1/model.ckptz: tensor `") && o.stderr.contains("is damaged"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
    // Intact chunks but a recorded checksum that disagrees: the copy checks it from
    // the chunks it decompressed.
    // The header is the zstd frame that ends a version 2 file: edit its text.
    let n = u64::from_le_bytes(good[8..16].try_into().unwrap()) as usize;
    let at = good.len() - n;
    let mut text = zstd::bulk::decompress(&good[at..], 1 << 24).unwrap();
    let meta = text
        .windows(12)
        .rposition(|w| w == b"__metadata__")
        .unwrap();
    let c = meta
        + text[meta..]
            .windows(7)
            .position(|w| w == b"crc32c:")
            .unwrap()
        + 7;
    text[c] = if text[c] == b'0' { b'1' } else { b'0' };
    let frame = zstd::bulk::compress(&text, 1).unwrap();
    let mut wrong = good[..8].to_vec();
    wrong.extend_from_slice(&(frame.len() as u64).to_le_bytes());
    wrong.extend_from_slice(&good[16..at]);
    wrong.extend_from_slice(&frame);
    std::fs::write(&f, &wrong).unwrap();
    let o = d.fails(&["merge", "exz", "-o", "out", "-q"]);
    assert!(
        o.stderr.contains("ckpt_1/model.ckptz: tensor `") && o.stderr.contains("checksum mismatch"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
    let o = d.fails(&["verify", "exz"]);
    assert!(o.stdout.contains("checksum mismatch"), "{}", o.stdout);
    // Truncated: refused when opened, naming the file.
    std::fs::write(&f, &good[..good.len() - 100]).unwrap();
    let o = d.fails(&["merge", "exz", "-o", "out", "-q"]);
    assert!(
        o.stderr.contains("ckpt_1/model.ckptz") && o.stderr.contains("truncated"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
    // A header cut short.
    std::fs::write(&f, &good[..40]).unwrap();
    let o = d.fails(&["verify", "exz"]);
    assert!(
        o.stdout.contains("invalid .ckptz header: header of"),
        "{}",
        o.stdout
    );
}

#[test]
fn training_saves_compressed_and_resumes_from_it() {
    let d = Dir::new();
    let common = ["--no-eval", "-q", "--max-steps"];
    d.ok(&[
        &["train", "--out", "run", "--compress", "zstd"][..],
        &common,
        &["5"],
    ]
    .concat());
    assert!(d.path("run/step_5/ckpt_3/model.ckptz").is_file());
    assert!(!d.path("run/step_5/ckpt_3/model.safetensors").exists());
    d.ok(&["verify", "run"]);
    // Resuming from the compressed save and from its decompressed copy trains to the
    // same bytes.
    d.ok(&["decompress", "run/step_5", "-o", "plain"]);
    d.ok(&[
        &["train", "--resume", "run", "--out", "a"][..],
        &common,
        &["8"],
    ]
    .concat());
    d.ok(&[
        &["train", "--resume", "plain", "--out", "b"][..],
        &common,
        &["8"],
    ]
    .concat());
    d.ok(&["merge", "a", "-o", "ma", "-q"]);
    d.ok(&["merge", "b", "-o", "mb", "-q"]);
    assert_eq!(tree(&d.path("ma")), tree(&d.path("mb")));
    let o = d.ok(&["infer", "run", "--limit", "40", "--json"]);
    let p = d.ok(&["infer", "plain", "--limit", "40", "--json"]);
    let acc = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap()["accuracy"].clone();
    assert_eq!(acc(&o.stdout), acc(&p.stdout));
    // Integrated saves too.
    d.ok(&[
        &[
            "train",
            "--out",
            "int",
            "--save",
            "integrated",
            "--compress",
            "zstd:1",
        ][..],
        &common,
        &["2"],
    ]
    .concat());
    assert!(d.path("int/step_2/model.ckptz").is_file());
    d.ok(&["verify", "int"]);
}

/// A compressed input truncated by another program after it was opened: compressed
/// files are read with positional reads, not mapped, so this is a named I/O error (no
/// bus error), and nothing is left at the output.
#[test]
fn compressed_input_truncated_while_read_is_a_named_error() {
    let d = Dir::new();
    compressed_example(&d);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["merge", "exz", "-o", "out", "-q"])
        .current_dir(d.tmp.path())
        .env("CKPT_TEST_TRUNCATE_BEFORE_COPY", "exz/ckpt_1/model.ckptz")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("exz/ckpt_1/model.ckptz: the file shrank while it was being read"),
        "{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(d.tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "ex" && n != "exz")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
