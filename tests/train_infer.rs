//! Train on 4 ranks with sliced checkpoints, then merge and infer on 1 rank, reshard to
//! 2 and to 3 (uneven) ranks and infer there, and with data-parallel copies on top
//! (the test set split over them): the same predictions, the trainer's own accuracy,
//! logits within a stated tolerance; for mlp, vit and resnet.

use crate::util::Dir;
use std::path::Path;

/// Logits may differ across rank counts only by float summation order.
const LOGIT_TOLERANCE: f32 = 1e-4;

fn infer(dir: &Path, ranks: Option<u64>) -> ckpt_infer::InferReport {
    ckpt_infer::infer(&ckpt_infer::InferRequest {
        checkpoint: dir.into(),
        ranks,
        batch_size: 128,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("infer {}: {e}", dir.display()))
}

fn equivalence(train: &[&str], tp: bool) {
    let d = Dir::new();
    let mut args = vec!["train", "--out", "run", "--save", "sliced", "--json", "-q"];
    args.extend_from_slice(train);
    let o = d.ok(&args);
    let report: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
    let trainer_accuracy = report["test_accuracy"].as_array().unwrap().last().unwrap()[1]
        .as_f64()
        .unwrap() as f32;
    d.ok(&["verify", "run"]);
    d.ok(&["merge", "run", "-o", "merged", "-q"]);
    d.ok(&["reshard", "run", "-o", "r2", "--to", "2", "-q"]);
    d.ok(&["reshard", "run", "-o", "r3", "--to", "3", "-q"]);
    let one = infer(&d.path("merged"), None);
    let two = infer(&d.path("r2"), None);
    let three = infer(&d.path("r3"), None);
    let want_ranks = if tp { (1, 2, 3) } else { (1, 1, 1) };
    assert_eq!((one.ranks, two.ranks, three.ranks), want_ranks);
    assert_eq!(one.accuracy, trainer_accuracy, "1 rank against the trainer");
    // Data-parallel copies on top: the test set split over them, gathered in order.
    let dp_one = infer(&d.path("merged"), Some(3));
    let dp_two = infer(&d.path("r2"), Some(2 * two.ranks));
    assert_eq!((dp_one.ranks, dp_two.ranks), (3, 2 * two.ranks));
    for (n, r) in [(2, &two), (3, &three), (30, &dp_one), (20, &dp_two)] {
        assert_eq!(r.predicted, one.predicted, "{n} ranks predict differently");
        assert_eq!(
            r.accuracy, trainer_accuracy,
            "{n} ranks against the trainer"
        );
        let worst = r
            .logits
            .iter()
            .zip(&one.logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= LOGIT_TOLERANCE,
            "{n} ranks: logits differ by {worst}"
        );
    }
    // Well above chance (0.1), so the predictions compared above are not degenerate.
    assert!(
        trainer_accuracy > 0.3,
        "training did not learn: {trainer_accuracy}"
    );
}

#[test]
fn mlp_tensor_parallel() {
    equivalence(
        &["--model", "mlp", "--mesh", "dp=2,tp=2", "--epochs", "3"],
        true,
    );
}

#[test]
fn vit_tensor_parallel() {
    // 12 heads and 48 hidden units: divisible by 4, 2 and 3 tensor-parallel ranks.
    let cfg = r#"{"image_size":8,"channels":1,"patch":2,"dim":48,"depth":1,"heads":12,"mlp_hidden":48,"classes":10}"#;
    equivalence(
        &[
            "--model",
            "vit",
            "--model-config",
            cfg,
            "--mesh",
            "tp=4",
            "--epochs",
            "4",
            "--lr",
            "0.003",
        ],
        true,
    );
}

#[test]
fn resnet_data_parallel() {
    // Synchronized BatchNorm keeps the running statistics equal on every dp rank, as the
    // checkpoint (which stores them once) assumes.
    equivalence(
        &[
            "--model",
            "resnet",
            "--depth",
            "8",
            "--ranks",
            "4",
            "--epochs",
            "1",
            "--sync-bn",
        ],
        false,
    );
}

#[test]
fn checkpoint_that_does_not_fit_the_model_is_named() {
    let d = Dir::new();
    d.ok(&[
        "train", "--out", "run", "--mesh", "tp=2", "--epochs", "1", "-q",
    ]);
    d.ok(&["merge", "run", "-o", "merged", "-q", "--exclude", "*.bias"]);
    let o = d.fails(&["infer", "merged"]);
    assert!(
        o.stderr.contains("merged: tensor `")
            && o.stderr.contains(".bias` of the mlp model is missing"),
        "{}",
        o.stderr
    );
    // A config.json that does not match the weights: the tensor and both shapes are named.
    let cfg = r#"{"model":"mlp","config":{"in_features":64,"hidden":100,"width":256,"blocks":1,"classes":10}}"#;
    d.ok(&["merge", "run", "-o", "full", "-q"]);
    std::fs::write(d.path("full/config.json"), cfg).unwrap();
    let o = d.fails(&["infer", "full"]);
    assert!(
        o.stderr.contains("full: tensor `blocks.0.fc1.bias` has shape [512] in the checkpoint but the mlp model needs [100]"),
        "{}",
        o.stderr
    );
    let o = d.fails(&["infer", "run", "--ranks", "3"]);
    assert!(
        o.stderr.contains("3 ranks, but")
            && o.stderr.contains("is sliced for 2 tensor-parallel ranks")
            && o.stderr.contains("use --ranks 2 or a multiple of it")
            && o.stderr.contains("--to 3` first"),
        "{}",
        o.stderr
    );
    d.ok(&["infer", "run", "--ranks", "4"]);
}

/// This build has no candle CUDA kernels: `--device cuda` stops before any work with an
/// error saying how to build them, and writes nothing.
#[cfg(not(feature = "cuda-candle"))]
#[test]
fn device_cuda_without_the_kernels_is_a_clear_error() {
    let d = Dir::new();
    let o = d.fails(&["train", "--device", "cuda", "--out", "run", "-q"]);
    let says = "device `cuda` unavailable: this binary was built without candle's CUDA kernels";
    assert!(o.stderr.contains(says), "{}", o.stderr);
    assert!(o.stderr.contains("--features cuda-candle"), "{}", o.stderr);
    assert!(!d.path("run").exists(), "nothing is written");
    d.ok(&[
        "train",
        "--out",
        "run",
        "--mesh",
        "tp=2",
        "--max-steps",
        "2",
        "--no-eval",
        "-q",
    ]);
    let o = d.fails(&["infer", "run", "--device", "cuda"]);
    assert!(o.stderr.contains(says), "{}", o.stderr);
    let o = d.ckpt(&["train", "--device", "tpu"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
}

/// `merge` of a training checkpoint: weights in model.safetensors, optimizer state in
/// optimizer.safetensors (`--one-file` keeps one); infer and resume read both. A resume
/// says what it does not take as stored, and one with nothing left to do fails.
#[test]
fn merged_model_and_optimizer_files_and_resume_messages() {
    let d = Dir::new();
    d.ok(&[
        "train", "--out", "run", "--mesh", "tp=2", "--epochs", "2", "-q",
    ]);
    d.ok(&["merge", "run", "-o", "m", "-q"]);
    let model = crate::util::full_tensors(&d.path("m/model.safetensors"));
    let optim = crate::util::full_tensors(&d.path("m/optimizer.safetensors"));
    assert!(
        model.keys().all(|k| !k.starts_with("optim.")),
        "{:?}",
        model.keys()
    );
    assert_eq!(
        optim.len(),
        2 * model.len(),
        "AdamW: two moments per weight"
    );
    assert!(!d.path("m/model.safetensors.index.json").exists());
    d.ok(&["merge", "run", "-o", "one", "--one-file", "-q"]);
    let one = crate::util::full_tensors(&d.path("one/model.safetensors"));
    assert_eq!(one.len(), model.len() + optim.len());
    assert!(!d.path("one/optimizer.safetensors").exists());
    // Both files are read back by every command.
    let o = d.ok(&["inspect", "m"]);
    assert!(o.stdout.contains("optim."), "{}", o.stdout);
    d.ok(&["infer", "m"]);
    let o = d.ok(&[
        "train", "--resume", "m", "--epochs", "3", "--out", "r1", "-q",
    ]);
    assert!(!o.stderr.contains("warning"), "{}", o.stderr);

    // Weights only: the moments restart from zero, said.
    d.ok(&["merge", "run", "-o", "w", "--exclude", "optim.*", "-q"]);
    let o = d.ok(&[
        "train", "--resume", "w", "--epochs", "3", "--out", "r2", "-q",
    ]);
    assert!(
        o.stderr.contains("has no optimizer state for")
            && o.stderr
                .contains("AdamW state (exp_avg, exp_avg_sq) starts from zero"),
        "{}",
        o.stderr
    );
    // Cast to BF16: cast back to F32, said.
    d.ok(&["merge", "run", "-o", "b", "--dtype", "bf16", "-q"]);
    let o = d.ok(&[
        "train", "--resume", "b", "--epochs", "3", "--out", "r3", "-q",
    ]);
    assert!(
        o.stderr.contains("stored as")
            && o.stderr.contains("BF16")
            && o.stderr.contains("cast to F32"),
        "{}",
        o.stderr
    );
    // Nothing left to do.
    let o = d.ckpt(&[
        "train", "--resume", "run", "--epochs", "2", "--out", "r4", "-q",
    ]);
    assert_ne!(o.code, 0);
    assert!(
        o.stderr.contains("nothing left to do") && o.stderr.contains("--epochs 3 or more"),
        "{}",
        o.stderr
    );
    assert!(!d.path("r4").exists());
}
