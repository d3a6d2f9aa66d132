//! Every writer's output on committed fixtures, file by file, against checksums
//! committed before the write side was restructured (issue 46): moving a writer must
//! not change one byte it writes. `tests/golden/writers.txt` lists, per case, every
//! output file and its SHA-256; `CKPT_BLESS=1 cargo test --test tests writers_golden`
//! rewrites it (a change to review, never to make in passing).

use crate::util::Dir;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `(case, ckpt's arguments)`: `{fx}` is the fixtures directory, the output is `out`.
const CASES: &[(&str, &[&str])] = &[
    (
        "merge-safetensors",
        &["merge", "{fx}/torch/dcp_mesh", "-o", "out"],
    ),
    (
        "merge-shards",
        &[
            "merge",
            "{fx}/torch/dcp_mesh",
            "--max-shard-size",
            "300",
            "-o",
            "out",
        ],
    ),
    (
        "merge-hf",
        &[
            "merge",
            "{fx}/hf/llama/legacy",
            "--format",
            "hf",
            "-o",
            "out",
        ],
    ),
    (
        "merge-hf-bf16",
        &[
            "merge",
            "{fx}/hf/qwen2/dist_ckpt",
            "--format",
            "hf",
            "--dtype",
            "bf16",
            "-o",
            "out",
        ],
    ),
    (
        "merge-torch",
        &[
            "merge",
            "{fx}/torch/dcp_mesh",
            "--format",
            "torch",
            "-o",
            "out",
        ],
    ),
    (
        "merge-mindspore",
        &[
            "merge",
            "{fx}/torch/dcp_mesh",
            "--format",
            "mindspore",
            "-o",
            "out",
        ],
    ),
    (
        "merge-ucp",
        &[
            "merge",
            "{fx}/deepspeed/zero2_fp32/ckpt",
            "--format",
            "ucp",
            "-o",
            "out",
        ],
    ),
    (
        "merge-ckptz",
        &[
            "merge",
            "{fx}/torch/dcp_mesh",
            "--compress",
            "zstd",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-ckpt",
        &["reshard", "{fx}/torch/dcp_mesh", "--to", "3", "-o", "out"],
    ),
    (
        "reshard-ckptz",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--compress",
            "zstd",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-distcp",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--format",
            "distcp",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-dcp-safetensors",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--format",
            "dcp-safetensors",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-mindspore",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--format",
            "mindspore",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-megatron",
        &[
            "reshard",
            "{fx}/megatron/tp2pp2/legacy",
            "--format",
            "megatron",
            "--mesh",
            "tp=1,pp=4",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-megatron-dist",
        &[
            "reshard",
            "{fx}/hf/llama/legacy",
            "--format",
            "megatron-dist",
            "--mesh",
            "tp=2,pp=2",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-megatron-from-hf",
        &[
            "reshard",
            "{fx}/hf_models/llama",
            "--format",
            "megatron",
            "--mesh",
            "tp=2,pp=2",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-torchtitan",
        &[
            "reshard",
            "{fx}/hf_models/llama",
            "--format",
            "torchtitan",
            "--to",
            "2",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-megatron-moe",
        &[
            "reshard",
            "{fx}/moe/megatron/ep2tp2/legacy",
            "--format",
            "megatron",
            "--mesh",
            "ep=2,tp=1,pp=2",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-megatron-dist-grouped",
        &[
            "reshard",
            "{fx}/moe/megatron/ep2grouped/legacy",
            "--format",
            "megatron-dist",
            "--mesh",
            "tp=2,pp=1",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-ckpt-rank",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--rank",
            "1",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-ckptz-rank",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--rank",
            "2",
            "--compress",
            "zstd",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-distcp-rank",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--format",
            "distcp",
            "--rank",
            "2",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-mindspore-rank",
        &[
            "reshard",
            "{fx}/torch/dcp_mesh",
            "--to",
            "3",
            "--format",
            "mindspore",
            "--rank",
            "0",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-deepspeed",
        &[
            "reshard",
            "{fx}/deepspeed/zero2_fp32/ckpt",
            "--format",
            "deepspeed",
            "--to",
            "3",
            "-o",
            "out",
        ],
    ),
    (
        "reshard-deepspeed-zero3",
        &[
            "reshard",
            "{fx}/deepspeed/zero3_bf16/ckpt",
            "--format",
            "deepspeed",
            "--to",
            "3",
            "-o",
            "out",
        ],
    ),
];

fn golden_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/writers.txt")
}

/// Every file under `dir`, by its path relative to `dir`, with its SHA-256.
fn checksums(dir: &Path, under: &Path, out: &mut BTreeMap<String, String>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            checksums(&p, under, out);
        } else {
            let digest = Sha256::digest(std::fs::read(&p).unwrap());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            let rel = p.strip_prefix(under).unwrap().display().to_string();
            out.insert(rel, hex);
        }
    }
}

#[test]
fn every_writers_output_is_byte_identical_to_the_committed_checksums() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let fx = fx.to_str().unwrap();
    let mut got = String::new();
    for (case, args) in CASES {
        let d = Dir::new();
        let args: Vec<String> = args.iter().map(|a| a.replace("{fx}", fx)).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        d.ok(&args);
        let out = d.path("out");
        let mut sums = BTreeMap::new();
        if out.is_dir() {
            checksums(&out, &out, &mut sums);
        } else {
            checksums(d.tmp.path(), d.tmp.path(), &mut sums);
        }
        for (file, sum) in sums {
            got.push_str(&format!("{case} {file} {sum}\n"));
        }
    }
    let path = golden_file();
    if std::env::var_os("CKPT_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want =
        std::fs::read_to_string(&path).expect("tests/golden/writers.txt (CKPT_BLESS=1 writes it)");
    if got != want {
        let (g, w): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
        let differ: Vec<String> = w
            .iter()
            .filter(|l| !g.contains(l))
            .map(|l| format!("- {l}"))
            .chain(
                g.iter()
                    .filter(|l| !w.contains(l))
                    .map(|l| format!("+ {l}")),
            )
            .collect();
        panic!(
            "writers' outputs differ from tests/golden/writers.txt (committed before the restructure):\n{}",
            differ.join("\n")
        );
    }
}
