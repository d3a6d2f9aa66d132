//! Compressed checkpoints (issues 15 and 26), on real weights, in one run:
//!
//! - compressed/raw size of `.ckptz` version 2's chunk codec (tensors of one dtype
//!   packed into one stream, sign-rotated byte planes, each plane zstd, literal-tuned
//!   zstd or stored) against version 1's (each tensor's chunks byte-grouped, one zstd
//!   frame) and plain zstd at the same level, for the FP32 weights and the AdamW
//!   moments of a trained model, and for the same cast to BF16 (4 MiB chunks, as
//!   `--compress` writes them);
//! - compression and decompression throughput of both codecs (chunks in parallel on
//!   every core, as ckpt runs them; RAYON_NUM_THREADS=1 for one core);
//! - `ckpt compress` / `ckpt decompress` of the whole checkpoint, and `ckpt merge` from
//!   the compressed copy against the same merge from the original.
//!
//! Run: `cargo bench --bench compress` (trains the model once, ~360 MB under
//! target/bench/zstd-mlp, and keeps it for the next runs). Level 1 and 3 are both
//! measured; the commands run at the default level.

use ckpt_core::formats::ckptz::{compress_chunk, decompress_chunk, group_of, CodedChunk};
use ckpt_core::formats::TensorFile;
use ckpt_core::layout::Dtype;
use rayon::prelude::*;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

mod common;
use common::timed;

fn ckpt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
}

/// CPU seconds used by this process so far (all threads).
fn cpu_now() -> f64 {
    // SAFETY: clock_gettime writes the timespec it is given.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Wall and CPU seconds of `f`.
fn clocked<T>(f: impl FnOnce() -> T) -> (T, f64, f64) {
    let (t, c) = (Instant::now(), cpu_now());
    let out = f();
    (out, t.elapsed().as_secs_f64(), cpu_now() - c)
}

/// Best (lowest) time of three runs, the highest peak RSS, the lowest CPU time.
fn best(f: &mut dyn FnMut() -> (f64, f64, f64)) -> (f64, f64, f64) {
    (0..3)
        .map(|_| f())
        .fold((f64::MAX, 0.0, f64::MAX), |(s, r, c), (s2, r2, c2)| {
            (s.min(s2), f64::max(r, r2), c.min(c2))
        })
}

/// One set of tensors: its raw bytes cut into element-aligned 4 MiB chunks, tensor by
/// tensor (version 1) and packed into one stream (version 2).
struct Set {
    name: String,
    dtype: Dtype,
    group: usize,
    chunks: Vec<Vec<u8>>,
    packed: Vec<Vec<u8>>,
}

impl Set {
    fn new(name: &str, dtype: Dtype, tensors: &[Vec<u8>]) -> Set {
        let chunks = tensors
            .iter()
            .flat_map(|t| t.chunks(ckpt_core::formats::ckptz::DEFAULT_CHUNK_BYTES as usize))
            .map(<[u8]>::to_vec)
            .collect();
        let stream = tensors.concat();
        let packed = stream
            .chunks(ckpt_core::formats::ckptz::DEFAULT_CHUNK_BYTES as usize)
            .map(<[u8]>::to_vec)
            .collect();
        Set {
            name: name.into(),
            dtype,
            group: group_of(dtype),
            chunks,
            packed,
        }
    }

    /// Codes every packed chunk as version 2 in parallel: (chunks, wall, CPU seconds).
    fn encode_v2(&self, level: i32) -> (Vec<CodedChunk>, f64, f64) {
        clocked(|| {
            self.packed
                .par_iter()
                .map(|c| CodedChunk::encode(c, self.dtype, level).expect("encode"))
                .collect()
        })
    }

    /// Decodes every version 2 chunk in parallel into buffers reused per thread, as
    /// the reader does: (wall, CPU seconds). Compared afterwards, outside the timing.
    fn decode_v2(&self, coded: &[CodedChunk]) -> (f64, f64) {
        let ((), wall, cpu) = clocked(|| {
            coded.par_iter().for_each_init(Vec::new, |out, c| {
                c.decode(out).expect("decode");
            });
        });
        for (c, raw) in coded.iter().zip(&self.packed) {
            let mut out = Vec::new();
            c.decode(&mut out).expect("decode");
            assert!(out == *raw, "version 2 round trip");
        }
        (wall, cpu)
    }

    fn raw(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }

    /// Compresses every chunk in parallel: (frames, wall seconds, CPU seconds).
    fn compress(&self, group: usize, level: i32) -> (Vec<Vec<u8>>, f64, f64) {
        clocked(|| {
            self.chunks
                .par_iter()
                .map(|c| {
                    let mut out = Vec::new();
                    compress_chunk(c, group, level, &mut out).expect("compress");
                    out
                })
                .collect()
        })
    }

    /// Decompresses every frame in parallel: (wall seconds, CPU seconds). The bytes are
    /// compared afterwards, outside the timing.
    fn decompress(&self, frames: &[Vec<u8>]) -> (f64, f64) {
        let (outs, wall, cpu) = clocked(|| {
            frames
                .par_iter()
                .zip(&self.chunks)
                .map(|(f, c)| {
                    let mut out = Vec::new();
                    decompress_chunk(f, self.group, c.len(), &mut out).expect("decompress");
                    out
                })
                .collect::<Vec<_>>()
        });
        assert!(outs == self.chunks, "round trip");
        (wall, cpu)
    }
}

fn bf16_of(f32_bytes: &[u8]) -> Vec<u8> {
    f32_bytes
        .chunks_exact(4)
        .flat_map(|c| {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            half::bf16::from_f32(v).to_le_bytes()
        })
        .collect()
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        n += if p.is_dir() {
            dir_bytes(&p)
        } else {
            std::fs::metadata(&p).unwrap().len()
        };
    }
    n
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&root).unwrap();
    // Real weights: a 30M-parameter MLP trained with AdamW on 2 tensor-parallel ranks
    // (F32 weights, exp_avg, exp_avg_sq), saved sliced.
    let run = root.join("zstd-mlp");
    if !run.exists() {
        let (s, _, _) = timed(
            ckpt()
                .args([
                    "train",
                    "--model-config",
                    r#"{"in_features":64,"hidden":4096,"width":1024,"blocks":4,"classes":10}"#,
                    "--mesh",
                    "dp=1,tp=2",
                    "--optimizer",
                    "adamw",
                    "--save",
                    "sliced",
                    "--max-steps",
                    "40",
                    "--no-eval",
                    "-q",
                    "--out",
                ])
                .arg(&run),
        );
        println!("trained the model in {s:.1} s");
    }
    // End to end first, while this process is small: children report their own peak
    // RSS, not pages inherited from a large parent.
    end_to_end(&root, &run);
    let merged = root.join("zstd-merged");
    if !merged.exists() {
        timed(
            ckpt()
                .args(["merge", "-q"])
                .arg(&run)
                .arg("-o")
                .arg(&merged),
        );
    }
    let f = TensorFile::open(&merged.join("model.safetensors")).unwrap();
    let (mut weights, mut moments) = (Vec::new(), Vec::new());
    for (i, t) in f.tensors().iter().enumerate() {
        assert_eq!(t.dtype, Dtype::F32, "{}", t.name);
        let bytes = f.data(i).unwrap().to_vec();
        if t.name.starts_with("optim.") {
            moments.push(bytes);
        } else {
            weights.push(bytes);
        }
    }
    let bf = |v: &[Vec<u8>]| v.iter().map(|t| bf16_of(t)).collect::<Vec<_>>();
    let sets = [
        Set::new("weights F32", Dtype::F32, &weights),
        Set::new("AdamW moments F32", Dtype::F32, &moments),
        Set::new("weights BF16", Dtype::BF16, &bf(&weights)),
        Set::new("AdamW moments BF16", Dtype::BF16, &bf(&moments)),
    ];
    println!(
        "\n{} MiB chunks, {} threads; sizes are compressed/raw; speeds in GB/s of raw bytes, best of 3: wall clock (per CPU-second x threads)\n",
        ckpt_core::formats::ckptz::DEFAULT_CHUNK_BYTES >> 20,
        rayon::current_num_threads()
    );
    println!("| tensors | raw MB | level | .ckptz v2 | v1 byte-grouped zstd | plain zstd | v2: compress | v2: decompress | v1: compress | v1: decompress | plain: compress |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    // Each speed twice: wall clock on every thread, and per CPU-second x threads (what
    // the threads would do with the cores to themselves: the machine is shared).
    let threads = rayon::current_num_threads() as f64;
    for s in &sets {
        let raw = s.raw() as f64;
        let size = |frames: &[Vec<u8>]| frames.iter().map(|f| f.len() as f64).sum::<f64>();
        for level in [1, 3] {
            // Best of three for the timings; sizes are the same every time.
            let best_of = |group: usize| {
                let mut out = (Vec::new(), f64::MAX, f64::MAX);
                for _ in 0..3 {
                    let (frames, wall, cpu) = s.compress(group, level);
                    out = (frames, out.1.min(wall), out.2.min(cpu));
                }
                out
            };
            let mut v2 = (Vec::new(), f64::MAX, f64::MAX);
            for _ in 0..3 {
                let (coded, wall, cpu) = s.encode_v2(level);
                v2 = (coded, v2.1.min(wall), v2.2.min(cpu));
            }
            let v2_size: f64 = v2.0.iter().map(|c| c.bytes.len() as f64).sum();
            let v2_dec = (0..3)
                .map(|_| s.decode_v2(&v2.0))
                .fold((f64::MAX, f64::MAX), |a, b| (a.0.min(b.0), a.1.min(b.1)));
            let grouped = best_of(s.group);
            let plain = best_of(1);
            let dec = (0..3)
                .map(|_| s.decompress(&grouped.0))
                .fold((f64::MAX, f64::MAX), |a, b| (a.0.min(b.0), a.1.min(b.1)));
            let speed = |wall: f64, cpu: f64| {
                format!("{:.2} ({:.2})", raw / wall / 1e9, raw / cpu * threads / 1e9)
            };
            println!(
                "| {} | {:.1} | {level} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {} | {} |",
                s.name,
                raw / 1e6,
                v2_size / raw,
                size(&grouped.0) / raw,
                size(&plain.0) / raw,
                speed(v2.1, v2.2),
                speed(v2_dec.0, v2_dec.1),
                speed(grouped.1, grouped.2),
                speed(dec.0, dec.1),
                speed(plain.1, plain.2),
            );
        }
    }
}

/// `ckpt compress`, `decompress`, and merge from the original and from the compressed
/// copy, at the default level, from the page cache, each output synced before rename.
fn end_to_end(root: &Path, run: &Path) {
    let runz = root.join("zstd-mlp-z");
    let out = root.join("zstd-out");
    let clean = |p: &Path| {
        let _ = std::fs::remove_dir_all(p);
        let _ = Command::new("sync").status();
    };
    let quiet = |c: &mut Command| {
        c.stdout(std::process::Stdio::null());
    };
    let raw_bytes = dir_bytes(run);
    let comp = best(&mut || {
        clean(&runz);
        let mut c = ckpt();
        c.arg("compress").arg(run).arg("-o").arg(&runz);
        quiet(&mut c);
        timed(&mut c)
    });
    let z_bytes = dir_bytes(&runz);
    let decomp = best(&mut || {
        clean(&out);
        let mut c = ckpt();
        c.arg("decompress").arg(&runz).arg("-o").arg(&out);
        quiet(&mut c);
        timed(&mut c)
    });
    let merge_of = |src: &Path, extra: &[&str]| {
        best(&mut || {
            clean(&out);
            timed(
                ckpt()
                    .args(["merge", "-q"])
                    .args(extra)
                    .arg(src)
                    .arg("-o")
                    .arg(&out),
            )
        })
    };
    let merge = merge_of(run, &[]);
    let merge_z = merge_of(&runz, &[]);
    let merge_to_z = merge_of(run, &["--compress", "zstd"]);
    let reshard_z = best(&mut || {
        clean(&out);
        timed(
            ckpt()
                .args(["reshard", "-q", "--to", "4"])
                .arg(&runz)
                .arg("-o")
                .arg(&out),
        )
    });
    let reshard = best(&mut || {
        clean(&out);
        timed(
            ckpt()
                .args(["reshard", "-q", "--to", "4"])
                .arg(run)
                .arg("-o")
                .arg(&out),
        )
    });
    clean(&out);
    println!(
        "whole checkpoint (2 rank files, F32 weights + AdamW moments), default level {}: {:.1} MB -> {:.1} MB ({:.3} x)\n",
        ckpt_core::formats::ckptz::DEFAULT_LEVEL,
        raw_bytes as f64 / 1e6,
        z_bytes as f64 / 1e6,
        z_bytes as f64 / raw_bytes as f64
    );
    println!("| run | seconds | GB/s (raw bytes) | x merge | CPU seconds | peak RSS MiB |");
    println!("|---|---|---|---|---|---|");
    let gbs = |s: f64| raw_bytes as f64 / s / 1e9;
    for (name, (s, rss, cpu)) in [
        ("ckpt merge (original)", merge),
        ("ckpt merge (from compressed)", merge_z),
        ("ckpt merge --compress zstd", merge_to_z),
        ("ckpt reshard --to 4 (original)", reshard),
        ("ckpt reshard --to 4 (from compressed)", reshard_z),
        ("ckpt compress", comp),
        ("ckpt decompress", decomp),
    ] {
        println!(
            "| {name} | {s:.2} | {:.2} | {:.2} | {cpu:.2} | {rss:.1} |",
            gbs(s),
            s / merge.0
        );
    }
}
