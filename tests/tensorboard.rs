//! `ckpt train --out`'s TensorBoard event file, read with TensorBoard's own reader
//! (`EventAccumulator`) while the run goes, and after the run is killed midway. Needs
//! `CKPT_PYTHON` (set by scripts/test.sh, whose venv has `tensorboard`) or a python3 with
//! tensorboard; without either the test says it is skipped.

use crate::util::Dir;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Python with TensorBoard, or `None` (said on the terminal) when there is none here.
fn python_with_tensorboard() -> Option<String> {
    let set = std::env::var("CKPT_PYTHON").ok();
    let py = set.clone().unwrap_or_else(|| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    // scripts/test.sh installs tensorboard into CKPT_PYTHON's venv: missing there is a
    // failure, not a skip.
    assert!(set.is_none(), "CKPT_PYTHON={py} cannot import tensorboard");
    // Straight to the terminal: libtest captures `eprintln!` of passing tests.
    let _ = writeln!(
        std::io::stderr(),
        "tensorboard::*: SKIPPED: no python3 with tensorboard (set CKPT_PYTHON or run scripts/test.sh)"
    );
    None
}

/// Reads `DIR` with one `EventAccumulator`, reloading as TensorBoard does until it has
/// `min_loss` losses and `min_acc` accuracies (or `timeout` seconds pass); prints the
/// scalars of each tag as `[step, value]` and the number of losses seen at each reload.
const WATCH: &str = r#"
import json, sys, time
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
d, min_loss, min_acc, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
acc = EventAccumulator(d)
seen, deadline = [], time.time() + timeout
while True:
    acc.Reload()
    tags = acc.Tags()["scalars"]
    out = {t: [[e.step, e.value] for e in acc.Scalars(t)] if t in tags else []
           for t in ("train/loss", "train/images_per_sec", "test/accuracy")}
    seen.append(len(out["train/loss"]))
    if (seen[-1] >= min_loss and len(out["test/accuracy"]) >= min_acc) or time.time() > deadline:
        break
    time.sleep(0.1)
out["seen"] = seen
print(json.dumps(out))
"#;

struct Curves {
    loss: Vec<(i64, f32)>,
    ips: Vec<(i64, f32)>,
    acc: Vec<(i64, f32)>,
    /// Losses read at each reload of the accumulator.
    seen: Vec<u64>,
}

fn watch(py: &str, dir: &Path, min_loss: usize, min_acc: usize, timeout: u64) -> Curves {
    let o = Command::new(py)
        .args(["-c", WATCH])
        .arg(dir)
        .args([
            min_loss.to_string(),
            min_acc.to_string(),
            timeout.to_string(),
        ])
        .output()
        .expect("run python");
    assert!(
        o.status.success(),
        "EventAccumulator failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let points = |tag: &str| -> Vec<(i64, f32)> {
        v[tag]
            .as_array()
            .unwrap()
            .iter()
            // The reader's f64 is the event's f32 exactly.
            .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect()
    };
    Curves {
        loss: points("train/loss"),
        ips: points("train/images_per_sec"),
        acc: points("test/accuracy"),
        seen: v["seen"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect(),
    }
}

/// The one event file in `dir`.
fn event_file(dir: &Path) -> Option<std::path::PathBuf> {
    let files: Vec<_> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("events.out.tfevents."))
        })
        .collect();
    assert!(files.len() <= 1, "{files:?}");
    files.into_iter().next()
}

/// Each training step 10 updates of 64 images, an evaluation after each: a run that
/// would take hours unless stopped.
const RUN: &[&str] = &[
    "train",
    "--ranks",
    "1",
    "--epochs",
    "100000",
    "--batch-size",
    "64",
    "--train-limit",
    "640",
    "--test-limit",
    "64",
    "-q",
];

#[test]
fn the_curves_are_readable_while_training_runs_and_after_a_kill() {
    let Some(py) = python_with_tensorboard() else {
        return;
    };
    let d = Dir::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(RUN)
        .args(["--out", "run"])
        .current_dir(d.tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the run whatever happens below.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let started = Instant::now();
    while event_file(&d.path("run")).is_none() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("ckpt train ended ({status}) before writing events:\n{err}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no event file"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut child = Kill(child);

    // TensorBoard's reader, tailing the file of the running process.
    let live = watch(&py, &d.path("run"), 20, 2, 120);
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the run ended: the reader did not read it while it ran"
    );
    assert!(
        live.loss.len() >= 20 && live.acc.len() >= 2,
        "{:?}",
        live.seen
    );
    // The accumulator saw the curve grow between its reloads (as `tensorboard` does),
    // unless the first reload already had enough.
    assert!(
        live.seen.len() == 1 || live.seen.windows(2).any(|w| w[1] > w[0]),
        "{:?}",
        live.seen
    );

    // SIGKILL midway: what was logged stays readable, whatever the last write was.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let killed = watch(&py, &d.path("run"), 0, 0, 0);
    let n = killed.loss.len();
    assert!(n >= live.loss.len());
    assert_eq!(
        killed.loss[..live.loss.len()],
        live.loss[..],
        "read live, then again"
    );
    assert_eq!(
        killed.loss.iter().map(|p| p.0).collect::<Vec<_>>(),
        (1..=n as i64).collect::<Vec<_>>(),
        "a loss at every update"
    );
    assert!(killed.ips.len() + 1 >= n && killed.ips.iter().all(|p| p.1 > 0.0));
    assert!(killed.ips.iter().zip(&killed.loss).all(|(a, b)| a.0 == b.0));

    // The same run to the step where the kill came, finished: the curves of the killed
    // run are its curves, value for value (one rank: the run is deterministic).
    let steps = n.to_string();
    let mut args = RUN.to_vec();
    args.extend(["--max-steps", &steps, "--out", "full", "--json"]);
    let o = d.ok(&args);
    let report: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(report["steps"].as_u64(), Some(n as u64));
    let final_loss = report["final_loss"].as_f64().unwrap() as f32;
    assert_eq!(killed.loss[n - 1].1, final_loss);
    let full = watch(&py, &d.path("full"), 0, 0, 0);
    assert_eq!(full.loss, killed.loss);
    // The killed run may have died between its last update and that epoch's accuracy.
    let full_acc: Vec<(i64, f32)> = report["test_accuracy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap() as f32))
        .collect();
    assert_eq!(full.acc, full_acc);
    assert!(
        killed.acc.len() + 1 >= full_acc.len() && full_acc.starts_with(&killed.acc),
        "{:?} against {full_acc:?}",
        killed.acc
    );
    assert_eq!(
        report["events"].as_str().map(Path::new),
        event_file(&d.path("full"))
            .as_deref()
            .map(|p| p.strip_prefix(d.tmp.path()).unwrap()),
        "--json names the event file"
    );

    // A record cut short (the kill landing inside a write): the reader stops before it
    // and shows every record before it.
    let file = event_file(&d.path("run")).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    // The end of the last complete record (TFRecord: u64 length, 4-byte CRC, data,
    // 4-byte CRC); the killed file may end in a partial one already.
    let (mut at, mut last_end) = (0usize, 0usize);
    while at + 8 <= bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        if at + 16 + len > bytes.len() {
            break;
        }
        at += 16 + len;
        last_end = at;
    }
    let cut = d.path("cut");
    std::fs::create_dir(&cut).unwrap();
    std::fs::write(cut.join(file.file_name().unwrap()), &bytes[..last_end - 3]).unwrap();
    let c = watch(&py, &cut, 0, 0, 0);
    let count = |c: &Curves| c.loss.len() + c.ips.len() + c.acc.len();
    assert_eq!(count(&c) + 1, count(&killed));
    assert!(killed.loss.starts_with(&c.loss) && killed.acc.starts_with(&c.acc));
}
