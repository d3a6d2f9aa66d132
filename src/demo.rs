//! `ckpt demo`: the whole story on the shipped digits in a couple of minutes. Trains a
//! tensor-parallel MLP on 4 thread ranks and saves sliced checkpoints, verifies them,
//! merges them and infers on one rank, reshards to 2 ranks and infers there, then
//! resumes training on 2 ranks from the 4-rank slices; prints a table of it all.

use crate::report::human_bytes;
use anyhow::{ensure, Context, Result};
use ckpt_core::layout::select::Selection;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One line of the demo's table.
struct Row {
    step: String,
    what: String,
    files: String,
    secs: f64,
    accuracy: Option<f32>,
}

fn dir_size(p: &Path) -> (u64, u64) {
    let mut files = 0;
    let mut bytes = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                let (f, b) = dir_size(&path);
                files += f;
                bytes += b;
            } else if path.extension().is_some_and(|x| x == "safetensors") {
                files += 1;
                bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
    }
    (files, bytes)
}

fn files_of(p: &Path) -> String {
    let (f, b) = dir_size(p);
    format!(
        "{f} file{}, {}",
        if f == 1 { "" } else { "s" },
        human_bytes(b)
    )
}

fn infer(ck: &Path, ranks: Option<u64>) -> Result<ckpt_infer::InferReport> {
    Ok(ckpt_infer::infer(&ckpt_infer::InferRequest {
        checkpoint: ck.into(),
        ranks,
        batch_size: 256,
        ..Default::default()
    })?)
}

/// Runs the demo in `dir` (created; must not hold an earlier demo unless `force`).
pub(crate) fn run(dir: &Path, force: bool, progress: bool) -> Result<()> {
    if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
        ensure!(
            force,
            "{} is not empty (use --force to reuse it)",
            dir.display()
        );
        for sub in ["train", "merged", "tp2", "resumed"] {
            let _ = std::fs::remove_dir_all(dir.join(sub));
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut rows: Vec<Row> = Vec::new();
    let say = |s: &str| {
        if progress {
            eprintln!("==> {s}");
        }
    };

    say("training a tensor-parallel MLP on 4 thread ranks (mesh tp=4), saving sliced checkpoints");
    let run_dir = dir.join("train");
    let cfg = ckpt_train::TrainConfig {
        mesh: Some("tp=4".into()),
        out: Some(run_dir.clone()),
        ..Default::default()
    };
    let t = Instant::now();
    let trained = ckpt_train::train(&cfg, progress)?;
    let ck: PathBuf = trained
        .checkpoints
        .last()
        .cloned()
        .context("training wrote no checkpoint")?;
    rows.push(Row {
        step: "train".into(),
        what: format!(
            "mlp, 4 ranks (tp=4), {} steps, {:.0} images/s",
            trained.steps, trained.images_per_sec
        ),
        files: files_of(&ck),
        secs: t.elapsed().as_secs_f64(),
        accuracy: trained.final_accuracy(),
    });

    say("verifying the slices");
    let t = Instant::now();
    let (checked, problems) = ckpt_core::engine::verify::verify(
        std::slice::from_ref(&ck),
        ckpt_core::engine::verify::VerifyDepth {
            checksums: true,
            deep: true,
        },
    )?;
    ensure!(
        problems.is_empty(),
        "verify found problems:\n{}",
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    rows.push(Row {
        step: "verify".into(),
        what: format!(
            "{} tensors, every element owned once",
            checked.tensors.len()
        ),
        files: files_of(&ck),
        secs: t.elapsed().as_secs_f64(),
        accuracy: None,
    });

    say("merging the 4 slices into one integrated checkpoint");
    let merged = dir.join("merged");
    let t = Instant::now();
    ckpt_merge::merge(
        &ckpt_merge::MergeRequest {
            inputs: vec![ck.clone()],
            output: merged.clone(),
            force: true,
            ..Default::default()
        },
        &|_| {},
        &|_, _| {},
    )?;
    rows.push(Row {
        step: "merge".into(),
        what: "4 slices -> model.safetensors (+ optimizer.safetensors)".into(),
        files: files_of(&merged),
        secs: t.elapsed().as_secs_f64(),
        accuracy: None,
    });

    say("inference on one rank from the merged checkpoint");
    let t = Instant::now();
    let one = infer(&merged, None)?;
    rows.push(Row {
        step: "infer".into(),
        what: format!("1 rank, integrated, {:.0} images/s", one.images_per_sec),
        files: files_of(&merged),
        secs: t.elapsed().as_secs_f64(),
        accuracy: Some(one.accuracy),
    });

    say("resharding the 4-rank slices to 2 ranks");
    let tp2 = dir.join("tp2");
    let t = Instant::now();
    ckpt_reshard::reshard(
        &ckpt_reshard::ReshardRequest {
            inputs: vec![ck.clone()],
            output: tp2.clone(),
            target: ckpt_reshard::Target::To(2),
            ranks: ckpt_reshard::Ranks::All,
            selection: Selection::default(),
            keep_all: false,
            force: true,
            format: ckpt_reshard::OutputFormat::Ranks,
            shard: Vec::new(),
            compression: None,
            computations: Default::default(),
            orbax_item: None,
            maxtext_unscanned: false,
        },
        &|_| {},
        &|_, _| {},
    )?;
    rows.push(Row {
        step: "reshard".into(),
        what: "tp=4 -> tp=2".into(),
        files: files_of(&tp2),
        secs: t.elapsed().as_secs_f64(),
        accuracy: None,
    });

    say("tensor-parallel inference on 2 ranks");
    let t = Instant::now();
    let two = infer(&tp2, Some(2))?;
    rows.push(Row {
        step: "infer".into(),
        what: format!(
            "2 ranks, tensor parallel, {:.0} images/s",
            two.images_per_sec
        ),
        files: files_of(&tp2),
        secs: t.elapsed().as_secs_f64(),
        accuracy: Some(two.accuracy),
    });
    ensure!(
        one.predicted == two.predicted,
        "1-rank and 2-rank inference disagree"
    );

    say("resuming training on 2 ranks (tp=2) from the 4-rank slices, 2 more epochs");
    let resume = ckpt_train::TrainConfig {
        mesh: Some("tp=2".into()),
        resume: Some(run_dir.clone()),
        epochs: trained.epochs + 2,
        out: Some(dir.join("resumed")),
        ..Default::default()
    };
    let t = Instant::now();
    let resumed = ckpt_train::train(&resume, progress)?;
    rows.push(Row {
        step: "resume".into(),
        what: format!(
            "2 ranks (tp=2) from step {}, loss {} -> {}",
            resumed.start_step,
            trained
                .losses
                .last()
                .map_or("-".into(), |l| format!("{l:.3}")),
            resumed
                .losses
                .last()
                .map_or("-".into(), |l| format!("{l:.3}"))
        ),
        files: resumed
            .checkpoints
            .last()
            .map(|p| files_of(p))
            .unwrap_or_default(),
        secs: t.elapsed().as_secs_f64(),
        accuracy: resumed.final_accuracy(),
    });

    println!("ckpt demo in {}", dir.display());
    println!("| step | what | files | seconds | test accuracy |");
    println!("|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.2} | {} |",
            r.step,
            r.what,
            r.files,
            r.secs,
            r.accuracy.map_or("".into(), |a| format!("{a:.4}"))
        );
    }
    Ok(())
}
