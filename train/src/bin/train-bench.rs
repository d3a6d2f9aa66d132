//! Training throughput benchmark: images per second of resnet-20 (CIFAR-shaped data)
//! and the mlp (shipped digits) at global batch 64, on 1 and 4 thread ranks (dp).
//!
//! ```text
//! cargo run --release -p ckpt-train --bin train-bench [-- --steps N --models mlp,resnet --ranks 1,4]
//! ```

use ckpt_train::{train, TrainConfig};
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

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let steps: u64 = arg(&args, "--steps")
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let models = arg(&args, "--models").unwrap_or_else(|| "mlp,resnet".into());
    let ranks = arg(&args, "--ranks").unwrap_or_else(|| "1,4".into());
    let dir = std::env::temp_dir().join(format!("ckpt-train-bench-{}", std::process::id()));
    if let Err(e) =
        std::fs::create_dir_all(&dir).and_then(|()| write_cifar(&dir, 64 * (steps as usize + 1)))
    {
        eprintln!("train-bench: {}: {e}", dir.display());
        return ExitCode::from(2);
    }
    println!(
        "{:<10} {:>6} {:>6} {:>8} {:>12}",
        "model", "ranks", "batch", "steps", "images/s"
    );
    let mut code = ExitCode::SUCCESS;
    for model in models.split(',') {
        for r in ranks.split(',') {
            let data = format!("cifar10:{}", dir.display());
            let mut a = vec![
                "bench".to_string(),
                "--model".into(),
                model.into(),
                "--ranks".into(),
                r.into(),
            ];
            a.extend(["--batch-size", "64", "--no-eval", "--max-steps"].map(String::from));
            a.push((steps + 1).to_string());
            if model == "resnet" {
                a.extend([
                    "--data".to_string(),
                    data,
                    "--optimizer".into(),
                    "sgd".into(),
                ]);
            }
            let cfg = match TrainConfig::try_parse_from(&a) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("train-bench: {e}");
                    return ExitCode::from(2);
                }
            };
            match train(&cfg, false) {
                Ok(rep) => println!(
                    "{:<10} {:>6} {:>6} {:>8} {:>12.1}",
                    model,
                    r,
                    64,
                    rep.losses.len(),
                    rep.images_per_sec
                ),
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
