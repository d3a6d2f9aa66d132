//! Merge and reshard throughput against `cat` of the same bytes, peak memory, bytes read
//! per `--rank` run, and the coverage check on a million pieces.
//!
//! Run: `cargo bench --bench copy` (about 2 GB of disk under target/bench; set
//! CKPT_BENCH_LAYERS to change the size: 19 layers of hidden 2048 is ~2 GB).
//! Figures are ratios measured in one run, since these machines are noisy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

mod common;

fn ckpt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
}

/// Runs a command, returns (seconds, peak RSS of the child in MiB).
fn timed(cmd: &mut Command) -> (f64, f64) {
    let (secs, rss, _) = common::timed(cmd);
    (secs, rss)
}

fn rank_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("model.safetensors"))
        .filter(|p| p.exists())
        .collect();
    v.sort();
    v
}

fn main() {
    // `cargo bench` passes --bench; no other arguments are used.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&root).unwrap();
    let layers: u64 = std::env::var("CKPT_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(19);
    // (`-c`: written with per-tensor checksums, which merge and reshard check.)
    let src = root.join(format!("tp8-h2048-l{layers}-c"));
    if !src.exists() {
        let (s, _) = timed(ckpt().args(["example"]).arg(&src).args([
            "--mesh",
            "tp=8",
            "--hidden",
            "2048",
            "--layers",
            &layers.to_string(),
            "--vocab",
            "32003",
        ]));
        println!("generated the source checkpoint in {s:.1} s");
    }
    let files = rank_files(&src);
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len())
        .sum();
    println!(
        "source: {} rank files, {:.2} GB (column/row-sharded BF16, fused QKV, replicated norms)",
        files.len(),
        bytes as f64 / 1e9
    );
    // Warm the page cache so every run reads from memory (in a child: reading here would
    // raise this process's peak RSS, which forked children inherit in ru_maxrss).
    let list = files
        .iter()
        .map(|f| f.display().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    timed(
        Command::new("sh")
            .arg("-c")
            .arg(format!("cat {list} > /dev/null")),
    );
    let out = root.join("out");
    let cat_out = root.join("cat.out");
    // Before every run: remove the last output and write back every dirty page, so no
    // run pays for the previous one's writes.
    let clean = || {
        let _ = std::fs::remove_dir_all(&out);
        let _ = std::fs::remove_file(&cat_out);
        let _ = Command::new("sync").status();
    };
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    // Each figure is the best of three, all in this one run.
    let best = |f: &mut dyn FnMut() -> (f64, f64)| -> (f64, f64) {
        (0..3)
            .map(|_| f())
            .fold((f64::MAX, 0.0), |(s, r), (s2, r2)| {
                (s.min(s2), f64::max(r, r2))
            })
    };
    let (cat, cat_rss) = best(&mut || {
        clean();
        timed(
            Command::new("sh")
                .arg("-c")
                .arg(format!("cat {list} > {}", cat_out.display())),
        )
    });
    rows.push(("cat (same bytes, one file)".into(), cat, cat_rss));
    let (cat_sync, _) = best(&mut || {
        clean();
        timed(
            Command::new("sh")
                .arg("-c")
                .arg(format!("cat {list} > {0} && sync {0}", cat_out.display())),
        )
    });
    rows.push(("cat + fsync".into(), cat_sync, 0.0));
    let (merge, merge_rss) = best(&mut || {
        clean();
        timed(ckpt().args(["merge", "-q"]).arg(&src).arg("-o").arg(&out))
    });
    rows.push(("ckpt merge (fsyncs its output)".into(), merge, merge_rss));
    // What checksums cost: the same merge neither checking the sources' nor recording
    // the output's.
    let (bare, bare_rss) = best(&mut || {
        clean();
        timed(
            ckpt()
                .args(["merge", "-q", "--no-checksums"])
                .arg(&src)
                .arg("-o")
                .arg(&out),
        )
    });
    rows.push(("ckpt merge --no-checksums".into(), bare, bare_rss));
    let (reshard, reshard_rss) = best(&mut || {
        clean();
        timed(
            ckpt()
                .args(["reshard", "-q", "--to", "2"])
                .arg(&src)
                .arg("-o")
                .arg(&out),
        )
    });
    rows.push(("ckpt reshard --to 2".into(), reshard, reshard_rss));
    clean();
    // Where the time goes: the copy, and the fsync that makes it durable (cat has none).
    for args in [&["merge"][..], &["reshard", "--to", "2"][..]] {
        clean();
        let t = Instant::now();
        let o = ckpt()
            .args(args)
            .arg("--json")
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let total = t.elapsed().as_secs_f64();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let sync = v["sync_seconds"].as_f64().unwrap();
        clean();
        println!(
            "\nckpt {}: {total:.2} s = {:.2} s copying ({:.2} x cat) + {sync:.2} s fsync",
            args.join(" "),
            total - sync,
            (total - sync) / cat
        );
    }
    println!(
        "\nchecksums (every source tensor checked, every output tensor recorded): merge takes {:.3} x the time of merge --no-checksums",
        merge / bare
    );
    println!("\n| run | seconds | x cat | x (cat + fsync) | peak RSS MiB |");
    println!("|---|---|---|---|---|");
    for (name, s, rss) in &rows {
        println!(
            "| {name} | {s:.2} | {:.2} | {:.2} | {} |",
            s / cat,
            s / cat_sync,
            if *rss > 0.0 {
                format!("{rss:.1}")
            } else {
                "-".into()
            }
        );
    }
    // Bytes read per target rank of partitioned runs (from the plan: no data moves).
    let plan = ckpt()
        .args(["reshard", "--to", "2", "--plan", "--json"])
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    println!("\n| --rank | bytes read | bytes written | read / written |");
    println!("|---|---|---|---|");
    for f in v["files"].as_array().unwrap() {
        let (r, w) = (
            f["bytes_read"].as_f64().unwrap(),
            f["bytes_written"].as_f64().unwrap(),
        );
        println!(
            "| {} | {:.0} | {:.0} | {:.4} |",
            f["output"].as_str().unwrap(),
            r,
            w,
            r / w
        );
    }
    // The coverage check on a million pieces (a 1000 x 1000 grid).
    let boxes: Vec<ckpt_core::layout::region::Region> = (0..1000u64)
        .flat_map(|i| {
            (0..1000u64).map(move |j| {
                ckpt_core::layout::region::Region::new(vec![i * 7, j * 5], vec![7, 5])
            })
        })
        .collect();
    let t = Instant::now();
    ckpt_core::layout::coverage::check_tiling(&[7000, 5000], &boxes).unwrap();
    println!(
        "\ncoverage check of 1,000,000 pieces: {:.2} s",
        t.elapsed().as_secs_f64()
    );
}
