//! The default run on the shipped digits.

use crate::util::run;

/// Issue 5: the default mlp (4 thread ranks, dp=2,tp=2, 10 epochs) reaches at least
/// 0.95 test accuracy on the shipped digits (0.969 measured; a few seconds).
#[test]
fn default_mlp_reaches_095_on_digits() {
    let r = ckpt_train::train(&ckpt_train::TrainConfig::default(), false).unwrap();
    assert_eq!(r.mesh, "dp=2,tp=2");
    assert_eq!(r.steps, 220);
    let acc = r.final_accuracy().unwrap();
    assert!(acc >= 0.95, "test accuracy {acc}");
}

#[test]
fn vit_and_sgd_learn_digits() {
    // The default ViT on 8x8 digits: 4x4 patches, 2 blocks, 4 heads (0.93 measured).
    let r = run(&[
        "--model",
        "vit",
        "--mesh",
        "dp=2,tp=2",
        "--epochs",
        "4",
        "--lr",
        "0.002",
    ]);
    let acc = r.final_accuracy().unwrap();
    assert!(acc > 0.85, "vit accuracy {acc}");
    let r = run(&["--optimizer", "sgd", "--ranks", "2", "--epochs", "3"]);
    let acc = r.final_accuracy().unwrap();
    assert!(acc > 0.9, "sgd accuracy {acc}");
}

/// Fashion-MNIST from Debian's `dataset-fashion-mnist` (a failure when not installed:
/// scripts/test.sh installs it):
/// one epoch over the first 6,000 images on 2 ranks gives at least 0.7 test accuracy.
#[test]
fn fashion_mnist_when_installed() {
    if !std::path::Path::new(ckpt_train::FASHION_MNIST_DIR)
        .join("train-labels-idx1-ubyte.gz")
        .is_file()
    {
        // scripts/test.sh installs the package: a missing data set is a failure, never a
        // test that did nothing and passed.
        panic!(
            "{} is missing: apt-get install dataset-fashion-mnist (scripts/test.sh installs it)",
            ckpt_train::FASHION_MNIST_DIR
        );
    }
    let r = run(&[
        "--data",
        "fashion-mnist",
        "--ranks",
        "2",
        "--epochs",
        "1",
        "--train-limit",
        "6000",
        "--test-limit",
        "2000",
    ]);
    let acc = r.final_accuracy().unwrap();
    assert!(acc > 0.7, "accuracy {acc}");
}
