//! `ckpt verify`'s verdict: notes, one line per problem, or what was found sound.

use crate::checkpoint::Checkpoint;
use crate::engine::verify::VerifyDepth;
use crate::error::Error;
use serde_json::{json, Value};
use std::fmt::Write;

/// `ckpt verify --json`.
#[must_use]
pub fn verify_json(ck: &Checkpoint, problems: &[Error]) -> Value {
    json!({"ok": problems.is_empty(), "files": ck.files.len(), "tensors": ck.tensors.len(),
        "problems": problems.iter().map(ToString::to_string).collect::<Vec<_>>(), "notes": ck.notes})
}

/// `ckpt verify`'s lines, each ending in a newline: the notes, then each problem on one
/// line, or `ok: ...` saying what was checked.
#[must_use]
pub fn verify_text(ck: &Checkpoint, problems: &[Error], depth: VerifyDepth) -> String {
    let mut out = String::new();
    // (Writing to a String cannot fail.)
    for note in &ck.notes {
        let _ = writeln!(out, "note: {note}");
    }
    for p in problems {
        // One line per problem (multi-line errors are already split per problem).
        let _ = writeln!(out, "{}", p.to_string().replace('\n', " "));
    }
    if problems.is_empty() {
        let recorded = ck.recorded_checksums();
        // Whole-file checksums (MindSpore's crc_num).
        let file_sums = ck
            .files
            .iter()
            .filter(|f| f.metadata().contains_key("crc_num"))
            .count();
        let sums = match (recorded, file_sums, depth.checksums) {
            (0, 0, _) => ", no checksums recorded".to_string(),
            (n, 0, true) => format!(", {n} checksums match"),
            (0, k, true) => format!(", {k} file checksums (crc_num) match"),
            (n, k, true) => format!(", {n} checksums and {k} file checksums (crc_num) match"),
            (_, _, false) => ", checksums not read (--fast)".to_string(),
        };
        // Pieces stored encoded with no checksum of their own: decoded whole.
        let decoded: usize = ck
            .files
            .iter()
            .filter(|f| f.is_compressed())
            .map(|f| {
                (0..f.tensors().len())
                    .filter(|&i| f.checksum(i).is_none())
                    .count()
            })
            .sum();
        let decoded = if depth.checksums && decoded > 0 {
            format!(", {decoded} encoded chunks decoded")
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "ok: {} file(s), {} tensors, every element owned exactly once{sums}{decoded}{}",
            ck.files.len(),
            ck.tensors.len(),
            if depth.deep {
                ", replicated copies identical"
            } else {
                ""
            }
        );
    }
    out
}
