//! Helpers shared by the tests.

use ckpt_train::{train, TrainConfig, TrainReport};
use std::path::Path;

/// Parses trainer options (without the program name).
pub(crate) fn cfg(args: &[&str]) -> TrainConfig {
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    TrainConfig::try_parse_from(all).expect("valid options")
}

/// Trains quietly.
pub(crate) fn run(args: &[&str]) -> TrainReport {
    train(&cfg(args), false).unwrap_or_else(|e| panic!("train {args:?}: {e}"))
}

/// Largest absolute difference of two loss curves of the same length.
pub(crate) fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "curves of different lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Writes a small CIFAR-10 binary directory: `n_train` and `n_test` records whose
/// pixels carry a class-dependent pattern plus noise (learnable, deterministic).
pub(crate) fn write_cifar(dir: &Path, n_train: usize, n_test: usize) {
    let mut state = 12345u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u8
    };
    let mut records = |n: usize| -> Vec<u8> {
        let mut out = Vec::with_capacity(n * 3073);
        for i in 0..n {
            let label = (i % 10) as u8;
            out.push(label);
            for p in 0..3072usize {
                let base = if (p / 32 + p % 32 + label as usize * 3) % 10 < 5 {
                    160u8
                } else {
                    60
                };
                out.push(base.wrapping_add(next() % 40));
            }
        }
        out
    };
    std::fs::write(dir.join("data_batch_1.bin"), records(n_train)).unwrap();
    std::fs::write(dir.join("test_batch.bin"), records(n_test)).unwrap();
}
