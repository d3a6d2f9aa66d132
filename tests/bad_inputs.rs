//! A catalogue of damaged, ambiguous and misused inputs. Each case builds its input
//! under `in`, runs one command (writing to `out` where it writes at all), and checks
//! the exit code, the first line of the message, that the inputs are byte for byte
//! unchanged, and that nothing (not even a temporary) was left at the output.

use crate::util::Dir;
use std::collections::BTreeMap;
use std::path::Path;

/// A safetensors file from a header and data.
fn st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

fn write(d: &Dir, rel: &str, bytes: &[u8]) {
    let p = d.path(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

/// Rewrites a file with `f` applied to its bytes.
fn patch(d: &Dir, rel: &str, f: impl FnOnce(&mut Vec<u8>)) {
    let p = d.path(rel);
    let mut b = std::fs::read(&p).unwrap();
    f(&mut b);
    std::fs::write(p, b).unwrap();
}

/// Replaces text inside a file's safetensors header, keeping its length field right.
fn patch_header(d: &Dir, rel: &str, from: &str, to: &str) {
    patch(d, rel, |b| {
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
        assert!(header.contains(from), "{from} not in {header}");
        let header = header.replacen(from, to, 1);
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&b[8 + n..]);
        *b = out;
    });
}

/// A DCP-style file holding `w` (F32 [2,2]) at `offsets`, with extra metadata.
fn dcp_file(offsets: &str, extra: &str) -> Vec<u8> {
    let info = format!("{{\\\"w\\\":{{\\\"saved_offsets\\\":{offsets}}}}}");
    st(
        &format!(
            r#"{{"__metadata__":{{"DCP_SHARDING_INFO":"{info}"{extra}}},"w":{{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}}}"#
        ),
        &[1; 16],
    )
}

/// Every file below `root` (but not below `skip`) with its bytes.
fn snapshot(root: &Path, skip: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.starts_with(skip) {
                continue;
            }
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_file() {
                out.insert(p.display().to_string(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

struct Case {
    name: &'static str,
    setup: fn(&Dir),
    args: &'static [&'static str],
    code: i32,
    /// Text the first line of the message must contain.
    first_line: &'static str,
}

fn ex(d: &Dir) {
    d.example("in", "tp=2");
}

const R0: &str = "in/ckpt_0/model.safetensors";

const CASES: &[Case] = &[
    // safetensors files damaged
    Case {
        name: "truncated data",
        setup: |d| {
            ex(d);
            patch(d, R0, |b| b.truncate(b.len() - 10));
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "truncated file?",
    },
    Case {
        name: "header length past the limit",
        setup: |d| {
            ex(d);
            patch(d, R0, |b| b[..8].copy_from_slice(&u64::MAX.to_le_bytes()));
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "exceeds the limit",
    },
    Case {
        name: "header length past the end",
        setup: |d| {
            ex(d);
            patch(d, R0, |b| {
                let n = b.len() as u64 + 10;
                b[..8].copy_from_slice(&n.to_le_bytes());
            });
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "runs past the end of the file",
    },
    Case {
        name: "header not JSON",
        setup: |d| write(d, "in/model.safetensors", &st("{not json", &[])),
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "header is not JSON",
    },
    Case {
        name: "header not UTF-8",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &[4, 0, 0, 0, 0, 0, 0, 0, b'{', 0xff, 0xfe, b'}'],
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "header is not UTF-8",
    },
    Case {
        name: "header not an object",
        setup: |d| write(d, "in/model.safetensors", &st("[1]", &[])),
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "not a checkpoint file ckpt reads",
    },
    Case {
        name: "overlapping tensors",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
                    &[0; 4],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "overlap tensor `a`",
    },
    Case {
        name: "gap between tensors",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#,
                    &[0; 5],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "leaving a gap after byte 2",
    },
    Case {
        name: "trailing bytes",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                    &[0; 5],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "trailing bytes",
    },
    Case {
        name: "unknown dtype",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"X9","shape":[2],"data_offsets":[0,2]}}"#,
                    &[0; 2],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "tensor `a`",
    },
    Case {
        name: "shape disagrees with bytes",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "F32 x [2] needs 8 bytes but data_offsets span 4",
    },
    Case {
        name: "shape overflows",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"F32","shape":[18446744073709551615,4],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "overflows",
    },
    Case {
        name: "metadata not strings",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(r#"{"__metadata__":{"k":1}}"#, &[]),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "`__metadata__.k` must be a string",
    },
    Case {
        name: "unknown entry field",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                &st(
                    r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1}}"#,
                    &[0; 2],
                ),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "unknown field `x`",
    },
    Case {
        name: "file shorter than the length",
        setup: |d| write(d, "in/model.safetensors", &[1, 0, 0]),
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "not a checkpoint file ckpt reads",
    },
    Case {
        name: "empty file",
        setup: |d| write(d, "in/model.safetensors", &[]),
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "the file is empty",
    },
    Case {
        name: "text, not safetensors",
        setup: |d| {
            write(
                d,
                "in/model.safetensors",
                b"hello, this is not a checkpoint\n",
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "not a checkpoint file ckpt reads",
    },
    Case {
        name: "flipped data byte (checksum)",
        setup: |d| {
            ex(d);
            patch(d, R0, |b| {
                let n = b.len();
                b[n - 3] ^= 0x40;
            });
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "checksum mismatch: recorded crc32c:",
    },
    Case {
        name: "flipped data byte (verify)",
        setup: |d| {
            ex(d);
            patch(d, R0, |b| {
                let n = b.len();
                b[n - 3] ^= 0x40;
            });
        },
        args: &["verify", "in"],
        code: 1,
        first_line: "checksum mismatch",
    },
    Case {
        name: "malformed checksum",
        setup: |d| {
            ex(d);
            patch_header(d, R0, "crc32c:", "crc32x:");
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "is not a checksum",
    },
    Case {
        name: "checksum for an absent tensor",
        setup: |d| {
            ex(d);
            patch_header(
                d,
                R0,
                r#"\"embed.weight\":\"crc32c:"#,
                r#"\"embed.weighx\":\"crc32c:"#,
            );
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "a checksum is recorded for tensor `embed.weighx`",
    },
    // sliced checkpoints that do not fit together
    Case {
        name: "missing rank",
        setup: |d| {
            ex(d);
            std::fs::remove_dir_all(d.path("in/ckpt_1")).unwrap();
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "rank 1 of 2 is missing",
    },
    Case {
        name: "strategy differs between ranks",
        setup: |d| {
            ex(d);
            patch(d, "in/ckpt_1/strategy.json", |b| {
                let s = String::from_utf8(b.clone())
                    .unwrap()
                    .replacen("37", "38", 1);
                *b = s.into_bytes();
            });
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "strategy",
    },
    Case {
        name: "strategy not JSON",
        setup: |d| {
            ex(d);
            for r in 0..2 {
                write(d, &format!("in/ckpt_{r}/strategy.json"), b"{oops");
            }
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "strategy",
    },
    Case {
        name: "rank file holds a tensor the strategy lacks",
        setup: |d| {
            ex(d);
            patch_header(d, R0, "\"embed.weight\":{", "\"embed.weighz\":{");
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "embed.weigh",
    },
    Case {
        name: "world_size metadata disagrees",
        setup: |d| {
            ex(d);
            patch_header(d, R0, "\"world_size\":\"2\"", "\"world_size\":\"3\"");
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "world_size 3 but the strategy's mesh has 2 ranks",
    },
    Case {
        name: "strategy_hash disagrees",
        setup: |d| {
            ex(d);
            patch_header(d, R0, "\"strategy_hash\":\"", "\"strategy_hash\":\"0");
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "does not match strategy.json",
    },
    Case {
        name: "latest names a missing step",
        setup: |d| {
            ex(d);
            write(d, "run/latest", b"step_9\n");
        },
        args: &["merge", "run", "-o", "out"],
        code: 1,
        first_line: "names `step_9`, which is not a checkpoint directory",
    },
    Case {
        name: "a mesh of 10^12 ranks",
        setup: |d| {
            ex(d);
            for r in 0..2 {
                patch(d, &format!("in/ckpt_{r}/strategy.json"), |b| {
                    let s = String::from_utf8(b.clone()).unwrap();
                    let s = s
                        .replacen("\"size\": 2", "\"size\": 1000000000000", 1)
                        .replacen("\"size\":2", "\"size\":1000000000000", 1);
                    *b = s.into_bytes();
                });
            }
        },
        args: &["verify", "in"],
        code: 1,
        first_line: "world_size 2 but the strategy's mesh has 1000000000000 ranks",
    },
    // files with offsets (DCP) and files without anything saying how they fit
    Case {
        name: "DCP offsets that wrap",
        setup: |d| {
            write(d, "in/a.safetensors", &dcp_file("[0,0]", ""));
            write(
                d,
                "in/b.safetensors",
                &dcp_file("[18446744073709551615,0]", ""),
            );
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line:
            "size overflow: tensor `w`: offset 18446744073709551615 + extent 2 of dim 0 wraps",
    },
    Case {
        name: "DCP offsets of the wrong rank",
        setup: |d| write(d, "in/a.safetensors", &dcp_file("[0]", "")),
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "offsets [0] do not match shape [2, 2]",
    },
    Case {
        name: "DCP_SHARDING_INFO not JSON",
        setup: |d| {
            write(
                d,
                "in/a.safetensors",
                &st(r#"{"__metadata__":{"DCP_SHARDING_INFO":"{oops"}}"#, &[]),
            )
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "DCP_SHARDING_INFO is not JSON",
    },
    Case {
        name: "DCP pieces that leave a gap",
        setup: |d| {
            write(d, "in/a.safetensors", &dcp_file("[0,0]", ""));
            write(d, "in/b.safetensors", &dcp_file("[3,0]", ""));
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "are missing",
    },
    Case {
        name: "ckpt's DCP output missing a rank",
        setup: |d| {
            write(
                d,
                "in/a.safetensors",
                &dcp_file("[0,0]", r#","rank":"0","world_size":"2""#),
            );
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "rank 1 of 2 is missing (its DCP file is not among the inputs)",
    },
    Case {
        name: "per-rank slices without a strategy",
        setup: |d| {
            write(
                d,
                "in/rank_0/a.safetensors",
                &st(
                    r#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                    &[1, 2],
                ),
            );
            write(
                d,
                "in/rank_1/b.safetensors",
                &st(
                    r#"{"w":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#,
                    &[3, 4, 5],
                ),
            );
        },
        args: &[
            "merge",
            "in/rank_0/a.safetensors",
            "in/rank_1/b.safetensors",
            "-o",
            "out",
        ],
        code: 1,
        first_line: "tensor `w` is ambiguous: held whole by 2 files with different shapes",
    },
    Case {
        name: "same-shape slices without a strategy",
        setup: |d| {
            write(
                d,
                "in/a.safetensors",
                &st(
                    r#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                    &[1, 2],
                ),
            );
            write(
                d,
                "in/b.safetensors",
                &st(
                    r#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                    &[3, 4],
                ),
            );
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line:
            "tensor `w` is ambiguous: held by 2 files with the same shape [2] but different bytes",
    },
    Case {
        name: "index not JSON",
        setup: |d| {
            write(d, "in/model.safetensors.index.json", b"{oops");
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "not JSON",
    },
    Case {
        name: "index names a missing shard",
        setup: |d| {
            write(
                d,
                "in/model.safetensors.index.json",
                br#"{"weight_map":{"w":"model-00001-of-00002.safetensors"}}"#,
            );
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "model-00001-of-00002.safetensors",
    },
    Case {
        name: "empty directory",
        setup: |d| std::fs::create_dir_all(d.path("in")).unwrap(),
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "no checkpoint here",
    },
    // A directory holding two checkpoints: which one is meant is the user's to say.
    Case {
        name: "rank directories and a merged model side by side",
        setup: |d| {
            ex(d);
            d.ok(&["merge", "in", "-o", "merged"]);
            std::fs::remove_file(d.path("in/strategy.json")).unwrap();
            std::fs::copy(d.path("merged/model.safetensors"), d.path("in/model.safetensors"))
                .unwrap();
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "in: holds two checkpoints, rank directories (ckpt_<r>/ or rank_<r>/) and an integrated model file; which one is meant is not ckpt's to guess: pass in/model.safetensors, or move the other aside",
    },
    Case {
        name: "a merged model beside the rank directories and their strategy",
        setup: |d| {
            ex(d);
            d.ok(&["merge", "in", "-o", "merged"]);
            std::fs::copy(d.path("merged/model.safetensors"), d.path("in/model.safetensors"))
                .unwrap();
        },
        args: &["reshard", "in", "--to", "1", "-o", "out"],
        code: 1,
        first_line: "in: holds two checkpoints, a ckpt rank directory (model file and strategy.json) and rank directories (ckpt_<r>/ or rank_<r>/)",
    },
    Case {
        name: "DCP metadata beside a Hugging Face index",
        setup: |d| {
            write(d, "in/.metadata", b"not read");
            write(
                d,
                "in/model.safetensors.index.json",
                br#"{"weight_map":{"w":"model-00001-of-00001.safetensors"}}"#,
            );
        },
        args: &["inspect", "in"],
        code: 1,
        first_line: "in: holds two checkpoints, a Hugging Face shard index and a PyTorch DCP checkpoint (.metadata); which one is meant is not ckpt's to guess: move one of them aside",
    },
    // --step asked of inputs that hold one checkpoint: it may be another step's.
    Case {
        name: "--step on one checkpoint",
        setup: ex,
        args: &["merge", "in", "--step", "3", "-o", "out"],
        code: 1,
        first_line: "--step 3: in hold(s) one checkpoint, not several steps to choose from",
    },
    Case {
        name: "input does not exist",
        setup: |_| {},
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "in: no such file or directory",
    },
    Case {
        name: "symlink loop",
        setup: |d| {
            std::os::unix::fs::symlink("loop_b", d.path("in")).unwrap();
            std::os::unix::fs::symlink("in", d.path("loop_b")).unwrap();
        },
        args: &["merge", "in", "-o", "out"],
        code: 1,
        first_line: "in: a symbolic link loop",
    },
    // selections and targets that would lose data
    Case {
        name: "--include keeps nothing",
        setup: ex,
        args: &["merge", "in", "-o", "out", "--include", "nothing.*"],
        code: 1,
        first_line: "--include 'nothing.*' leave none of the input's",
    },
    Case {
        name: "reshard --exclude keeps nothing",
        setup: ex,
        args: &["reshard", "in", "-o", "out", "--to", "1", "--exclude", "*"],
        code: 1,
        first_line: "--exclude '*' leave none",
    },
    Case {
        name: "target strategy leaves tensors out",
        setup: |d| {
            ex(d);
            let s = std::fs::read_to_string(d.path("in/strategy.json")).unwrap();
            let mut v: serde_json::Value = serde_json::from_str(&s).unwrap();
            v["tensors"].as_object_mut().unwrap().remove("embed.weight");
            std::fs::write(d.path("target.json"), v.to_string()).unwrap();
        },
        args: &["reshard", "in", "-o", "out", "--strategy", "target.json"],
        code: 1,
        first_line: "the target strategy does not place 1 tensor(s) of the source: `embed.weight`",
    },
    Case {
        name: "--mesh names an unknown axis",
        setup: ex,
        args: &["reshard", "in", "-o", "out", "--mesh", "zz=2"],
        // The user's mesh, not the input, is wrong: a usage error (issue 35).
        code: 2,
        first_line: "invalid mesh `zz=2`: axis `zz` is not an axis of the source mesh tp=2",
    },
    Case {
        name: "output inside the input",
        setup: ex,
        args: &["merge", "in", "-o", "in/out"],
        code: 1,
        first_line: "output in/out overlaps input in",
    },
    Case {
        name: "a target mesh of 10^12 ranks",
        setup: ex,
        args: &["reshard", "in", "-o", "out", "--to", "1000000000000"],
        code: 1,
        first_line: "has 1000000000000 ranks, more than the 1048576 ckpt writes files for",
    },
    Case {
        name: "infer a missing checkpoint",
        setup: |_| {},
        args: &["infer", "nothing"],
        code: 1,
        first_line: "checkpoint nothing: no such file or directory",
    },
    Case {
        name: "resume from a missing checkpoint",
        setup: |_| {},
        args: &["train", "--resume", "nothing", "--out", "out"],
        code: 1,
        first_line: "checkpoint nothing: no such file or directory",
    },
    // usage errors: exit 2, nothing read or written
    Case {
        name: "--predict 0-5",
        setup: ex,
        args: &["infer", "in", "--predict", "0-5"],
        code: 2,
        first_line: "--predict `0-5`: write the range as 0..5 (the end excluded)",
    },
    Case {
        name: "--predict 5..2",
        setup: ex,
        args: &["infer", "in", "--predict", "5..2"],
        code: 2,
        first_line: "--predict `5..2` is empty",
    },
    Case {
        name: "--to 0",
        setup: ex,
        args: &["reshard", "in", "-o", "out", "--to", "0"],
        code: 2,
        first_line: "--to must be at least 1",
    },
    Case {
        name: "malformed --mesh",
        setup: ex,
        args: &["reshard", "in", "-o", "out", "--mesh", "dp"],
        code: 2,
        first_line: "invalid value 'dp' for '--mesh <MESH>'",
    },
    Case {
        name: "--rank abc",
        setup: ex,
        args: &["reshard", "in", "-o", "out", "--to", "2", "--rank", "abc"],
        code: 2,
        first_line: "`abc` is not a rank number or `auto`",
    },
    Case {
        name: "bad glob",
        setup: ex,
        args: &["merge", "in", "-o", "out", "--exclude", "[a"],
        code: 2,
        first_line: "bad pattern `[a`",
    },
    Case {
        name: "--ranks 0",
        setup: |_| {},
        args: &["train", "--ranks", "0", "--out", "out"],
        code: 2,
        first_line: "invalid value '0' for '--ranks <N>'",
    },
    Case {
        name: "unknown --data",
        setup: ex,
        args: &["infer", "in", "--data", "imagenet"],
        code: 2,
        first_line: "unknown data set `imagenet`",
    },
];

#[test]
fn every_bad_input_is_named_and_nothing_is_written() {
    assert!(CASES.len() >= 40, "{} cases", CASES.len());
    let mut failures = Vec::new();
    for case in CASES {
        let d = Dir::new();
        (case.setup)(&d);
        let out = d.path("out");
        let before = snapshot(d.tmp.path(), &out);
        let o = d.ckpt(case.args);
        // verify prints its problems on stdout; everything else on stderr.
        let text = if o.stderr.trim().is_empty() {
            &o.stdout
        } else {
            &o.stderr
        };
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        let after = snapshot(d.tmp.path(), &out);
        let leftovers: Vec<String> = std::fs::read_dir(d.tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".out") || n == "out")
            .collect();
        let mut why = Vec::new();
        if o.code != case.code {
            why.push(format!("exit {} (want {})", o.code, case.code));
        }
        if !first.contains(case.first_line) {
            why.push(format!("first line lacks `{}`", case.first_line));
        }
        if before != after {
            why.push("inputs changed".to_string());
        }
        if !leftovers.is_empty() {
            why.push(format!("left at the output: {leftovers:?}"));
        }
        if !why.is_empty() {
            failures.push(format!(
                "{}: {}\n    first line: {first}",
                case.name,
                why.join("; ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        CASES.len(),
        failures.join("\n")
    );
}
