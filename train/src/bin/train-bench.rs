//! Training throughput benchmark: images per second of resnet-20 (CIFAR-shaped data),
//! ResNet-50 (the same data) and the mlp (shipped digits) at global batch 64, on 1 and 4
//! thread ranks (dp) unless told otherwise, over the steps after a few warm-up steps.
//!
//! ```text
//! cargo run --release -p ckpt-train --bin train-bench [-- --steps N --models mlp,resnet,resnet50 --ranks 1,2,4]
//! cargo run --release -p ckpt-train --bin train-bench -- --save [--ranks 1,2]
//! ```
//!
//! With `CKPT_TORCH_PYTHON` naming a Python that has torch, each 1-rank row is followed
//! by PyTorch's figure for the same model, optimizer and batch on all cores
//! (`scripts/torch_train_bench.py`, one process) and the ratio, from the same run.
//!
//! `--save` measures how long a checkpoint save stops training, `--sync-save` against
//! the default background save, for a ResNet-50-sized state (an mlp of 25.4 M parameters, AdamW: 305
//! MB of weights and moments), next to the time of copying that state once in memory.

use ckpt_train::{configure_cpu_threads, train, TrainConfig};
use std::process::ExitCode;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// Writes CIFAR-10 binary files of random images (the content does not matter for speed).
fn write_cifar(dir: &std::path::Path, n: usize) -> std::io::Result<()> {
    let mut state = 1u64;
    let mut rec = Vec::with_capacity(n * 3073);
    for i in 0..n {
        rec.push((i % 10) as u8);
        for _ in 0..3072 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            rec.push((state >> 56) as u8);
        }
    }
    std::fs::write(dir.join("data_batch_1.bin"), &rec)?;
    std::fs::write(dir.join("test_batch.bin"), &rec[..3073 * 10])
}

/// Parameters of the mlp `{in 64, hidden 4096, width 2048, blocks 2, classes 10}`:
/// 64x4096 + 4096x2048 + 2048x4096 + 4096x2048 weights, their biases, and the head.
const SAVE_MODEL: &str = r#"{"in_features":64,"hidden":4096,"width":2048,"blocks":2,"classes":10}"#;

fn save_bench(args: &[String]) -> ExitCode {
    configure_cpu_threads(1);
    let ranks = arg(args, "--ranks").unwrap_or_else(|| "1".into());
    let dir = std::env::temp_dir().join(format!("ckpt-save-bench-{}", std::process::id()));
    println!(
        "{:<6} {:<6} {:>10} {:>14} {:>14} {:>16}",
        "ranks", "save", "state MB", "stalls (s)", "median (s)", "memcpy once (s)"
    );
    let mut code = ExitCode::SUCCESS;
    for r in ranks.split(',') {
        for mode in ["sync", "async"] {
            let out = dir.join(format!("{mode}-{r}"));
            let mut a: Vec<String> = [
                "bench",
                "--model",
                "mlp",
                "--model-config",
                SAVE_MODEL,
                "--ranks",
                r,
                "--batch-size",
                "64",
                "--no-eval",
                "--max-steps",
                "6",
                "--save-every",
                "2",
                "--keep",
                "1",
                "--out",
            ]
            .map(String::from)
            .to_vec();
            a.push(out.display().to_string());
            if mode == "sync" {
                a.push("--sync-save".into());
            }
            let cfg = TrainConfig::try_parse_from(&a).expect("valid arguments");
            match train(&cfg, false) {
                Ok(rep) => {
                    let floats: usize = rep
                        .weights
                        .as_ref()
                        .map_or(0, |w| w.values().map(|t| t.data.len()).sum());
                    let state = if floats > 0 { floats } else { 3 * 25_190_410 };
                    // The floor: copying the state once in memory.
                    let src = vec![1.0f32; state];
                    let t = std::time::Instant::now();
                    let copy = std::hint::black_box(src.clone());
                    let memcpy = t.elapsed().as_secs_f64();
                    drop(copy);
                    let mut stalls = rep.save_stalls.clone();
                    stalls.sort_by(f64::total_cmp);
                    println!(
                        "{:<6} {:<6} {:>10.0} {:>14} {:>14.3} {:>16.3}",
                        r,
                        mode,
                        (state * 4) as f64 / 1e6,
                        rep.save_stalls
                            .iter()
                            .map(|s| format!("{s:.2}"))
                            .collect::<Vec<_>>()
                            .join(","),
                        stalls[stalls.len() / 2],
                        memcpy
                    );
                }
                Err(e) => {
                    eprintln!("train-bench: --save {mode} on {r} ranks: {e:#}");
                    code = ExitCode::from(1);
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    code
}

/// Steps run before the timed ones (allocator, caches), here and in PyTorch's script.
fn warm_up(model: &str) -> usize {
    if model == "mlp" {
        20
    } else {
        2
    }
}

/// ResNet-50 (bottleneck blocks 3-4-6-3) on CIFAR shapes, as the guides train it.
const RESNET50: &str = r#"{"depth":50,"channels":3,"classes":10}"#;

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// PyTorch's images per second for the same job, when `CKPT_TORCH_PYTHON` has torch.
fn torch_figure(model: &str, steps: u64) -> Option<f64> {
    let py = std::env::var_os("CKPT_TORCH_PYTHON")?;
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/torch_train_bench.py");
    let out = std::process::Command::new(py)
        .arg(script)
        .args([model, &steps.to_string(), &cores().to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "train-bench: torch: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--save") {
        return save_bench(&args);
    }
    let steps: u64 = arg(&args, "--steps")
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let models = arg(&args, "--models").unwrap_or_else(|| "mlp,resnet".into());
    let ranks = arg(&args, "--ranks").unwrap_or_else(|| "1,4".into());
    let dir = std::env::temp_dir().join(format!("ckpt-train-bench-{}", std::process::id()));
    // Each measurement in a process of its own: the CPU thread pools are sized once per
    // process, for its number of ranks (`configure_cpu_threads`).
    let child = std::env::var_os("TRAIN_BENCH_CHILD").is_some();
    if !child {
        println!(
            "{:<10} {:>6} {:>6} {:>8} {:>12}",
            "model", "ranks", "batch", "steps", "images/s"
        );
    }
    let mut code = ExitCode::SUCCESS;
    for model in models.split(',') {
        for r in ranks.split(',') {
            if !child {
                let status = std::env::current_exe().and_then(|exe| {
                    std::process::Command::new(exe)
                        .args([
                            "--models",
                            model,
                            "--ranks",
                            r,
                            "--steps",
                            &steps.to_string(),
                        ])
                        .env("TRAIN_BENCH_CHILD", "1")
                        .status()
                });
                if !status.is_ok_and(|s| s.success()) {
                    code = ExitCode::from(1);
                }
                continue;
            }
            configure_cpu_threads(r.parse().unwrap_or(1));
            if model.starts_with("resnet") {
                let images = 64 * (steps as usize + warm_up(model));
                if let Err(e) =
                    std::fs::create_dir_all(&dir).and_then(|()| write_cifar(&dir, images))
                {
                    eprintln!("train-bench: {}: {e}", dir.display());
                    return ExitCode::from(2);
                }
            }
            let data = format!("cifar10:{}", dir.display());
            let mut a = vec![
                "bench".to_string(),
                "--model".into(),
                model.into(),
                "--ranks".into(),
                r.into(),
            ];
            // Enough epochs that --max-steps ends the run (the digits are 22 batches).
            a.extend(
                [
                    "--batch-size",
                    "64",
                    "--no-eval",
                    "--epochs",
                    "100000",
                    "--max-steps",
                ]
                .map(String::from),
            );
            a.push((steps as usize + warm_up(model)).to_string());
            if model.starts_with("resnet") {
                a.extend([
                    "--data".to_string(),
                    data,
                    "--optimizer".into(),
                    "sgd".into(),
                ]);
            }
            if model == "resnet50" {
                a[2] = "resnet".into();
                a.extend(["--model-config".into(), RESNET50.into()]);
            }
            let cfg = match TrainConfig::try_parse_from(&a) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("train-bench: {e}");
                    return ExitCode::from(2);
                }
            };
            match train(&cfg, false) {
                Ok(rep) => {
                    let timed = rep.step_seconds.get(warm_up(model)..).unwrap_or_default();
                    let ips = (64 * timed.len()) as f64 / timed.iter().sum::<f64>().max(1e-9);
                    println!(
                        "{:<10} {:>6} {:>6} {:>8} {:>12.1}",
                        model,
                        r,
                        64,
                        timed.len(),
                        ips
                    );
                    if r == "1" {
                        if let Some(t) = torch_figure(model, steps) {
                            println!(
                                "{:<10} {:>6} {:>6} {:>8} {:>12.1}   ckpt / torch = {:.2}",
                                format!("torch-{model}"),
                                format!("1x{}", cores()),
                                64,
                                steps,
                                t,
                                ips / t
                            );
                        }
                    }
                }
                Err(e) => {
                    eprintln!("train-bench: {model} on {r} ranks: {e:#}");
                    code = ExitCode::from(1);
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    code
}
