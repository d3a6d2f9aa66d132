//! `ckpt inspect`: the tensors (global shape, dtype, placements, bytes), the bytes per
//! file, notes and problems.

use super::human_bytes;
use crate::checkpoint::{Checkpoint, Kind};
use crate::draw::{pieces_json, placements};
use crate::error::Error;
use crate::formats::FileFormat;
use crate::layout::plan::bytes_of;
use crate::layout::strategy::dtype_name;
use serde_json::{json, Value};
use std::fmt::Write;

/// How tensor `name` is placed: its strategy's placements per mesh axis (and pipeline
/// stage), `whole`, or the number of pieces (the words of the HTML report too).
#[must_use]
pub fn placements_text(ck: &Checkpoint, name: &str) -> String {
    placements(ck, name)
}

/// Bytes of tensor data in each file.
fn per_file(ck: &Checkpoint) -> Vec<u64> {
    ck.files
        .iter()
        .map(|f| f.tensors().iter().map(|t| t.end - t.start).sum())
        .collect()
}

/// `ckpt inspect --json`.
#[must_use]
pub fn inspect_json(ck: &Checkpoint, problems: &[Error]) -> Value {
    let per_file = per_file(ck);
    let total: u64 = per_file.iter().sum();
    let tensors: Vec<_> = ck
        .tensors
        .iter()
        .map(|(name, t)| {
            json!({
                "name": name, "shape": t.shape, "dtype": dtype_name(t.dtype),
                "placements": placements_text(ck, name),
                "pieces": pieces_json(ck, name).unwrap_or_default(),
                "bytes": bytes_of(t.dtype, t.shape.iter().product()),
            })
        })
        .collect();
    let files: Vec<_> = ck
        .files
        .iter()
        .enumerate()
        .map(|(i, f)| json!({"path": f.path(), "rank": ck.ranks[i], "bytes": per_file[i], "tensors": f.tensors().len(), "format": f.format().name()}))
        .collect();
    // What the files are, each once, in file order: `kind` says only how pieces are
    // placed (an Orbax item places them by offsets, as DCP does).
    let mut formats: Vec<&str> = Vec::new();
    for f in &ck.files {
        if !formats.contains(&f.format().name()) {
            formats.push(f.format().name());
        }
    }
    json!({
        "kind": format!("{:?}", ck.kind).to_lowercase(),
        "formats": formats,
        "mesh": ck.strategy.as_ref().map(|s| s.mesh.to_string()),
        "tensors": tensors, "files": files, "total_bytes": total,
        "problems": problems.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "notes": ck.notes,
    })
}

/// `ckpt inspect`'s table, one line each, ending in a newline.
#[must_use]
pub fn inspect_text(ck: &Checkpoint, problems: &[Error]) -> String {
    let per_file = per_file(ck);
    let total: u64 = per_file.iter().sum();
    let mut out = String::new();
    let mesh = ck
        .strategy
        .as_ref()
        .map(|s| format!(" on mesh {}", s.mesh))
        .unwrap_or_default();
    let kind = match ck.kind {
        Kind::Sliced => "sliced",
        Kind::Integrated => "integrated",
        // Per-rank torch.save files of DTensors place their pieces as DCP's do.
        Kind::Dcp if ck.files.iter().all(|f| f.format() == FileFormat::TorchSave) => {
            "per-rank torch.save (DTensor)"
        }
        Kind::Dcp if ck.files.iter().all(|f| f.format() == FileFormat::Orbax) => "Orbax",
        // DeepSpeed's partitions are flat pieces placed as DCP's boxes are (its model
        // states beside them plain torch.save files): said as what they are.
        Kind::Dcp if ck.files.iter().any(|f| f.format() == FileFormat::DeepSpeed) => {
            "DeepSpeed ZeRO"
        }
        Kind::Dcp => "PyTorch DCP",
    };
    // (Writing to a String cannot fail.)
    let _ = writeln!(
        out,
        "{kind} checkpoint, {} file(s){mesh}, {} tensors",
        ck.files.len(),
        ck.tensors.len()
    );
    let w = ck.tensors.keys().map(String::len).max().unwrap_or(4).max(6);
    let _ = writeln!(
        out,
        "{:<w$}  {:<6}  {:<18}  {:>12}  placements",
        "tensor", "dtype", "shape", "bytes"
    );
    for (name, t) in &ck.tensors {
        let _ = writeln!(
            out,
            "{name:<w$}  {:<6}  {:<18}  {:>12}  {}",
            dtype_name(t.dtype),
            format!("{:?}", t.shape),
            bytes_of(t.dtype, t.shape.iter().product()),
            placements_text(ck, name)
        );
    }
    out.push_str("bytes per file:\n");
    for (i, f) in ck.files.iter().enumerate() {
        let r = ck.ranks[i]
            .map(|r| format!("rank {r}: "))
            .unwrap_or_default();
        // Compressed files: what they take on disk too.
        let stored = match f.format() {
            FileFormat::Ckptz => std::fs::metadata(f.path())
                .map(|m| format!(" ({} compressed)", human_bytes(m.len())))
                .unwrap_or_default(),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  {r}{}  {}{stored}",
            f.path().display(),
            human_bytes(per_file[i])
        );
    }
    let _ = writeln!(out, "total: {} ({total} bytes)", human_bytes(total));
    for note in &ck.notes {
        let _ = writeln!(out, "note: {note}");
    }
    for p in problems {
        let _ = writeln!(out, "problem: {p}");
    }
    out
}
