//! What a [`CopyPlan`] will read, per output file: which source files, which byte
//! ranges of them and how many bytes, with the totals the copy then reports.

use crate::checkpoint::Checkpoint;
use crate::layout::plan::{CopyPlan, FilePlan};
use crate::layout::region::Runs;
use serde_json::{json, Value};
use std::fmt::Write;
use std::path::PathBuf;

/// One source tensor's part read for one output file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceRead {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// The source tensor's name in that file.
    pub tensor: String,
    /// First and one-past-last byte read, counted from the start of the file (for
    /// `.ckptz` files, of the decompressed tensor data laid end to end).
    pub span: (u64, u64),
    /// Bytes read (less than the span when the part is strided: a column slice).
    pub bytes: u64,
    /// Contiguous runs the bytes are read in.
    pub runs: u64,
}

/// Everything one output file reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetReads {
    /// The output file, relative to the output directory.
    pub path: PathBuf,
    /// The reads, in plan order.
    pub reads: Vec<SourceRead>,
    /// Bytes read, the sum of the reads.
    pub bytes_read: u64,
    /// Bytes of tensor data written.
    pub bytes_written: u64,
}

/// A plan's reads, per output file, with totals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanReport {
    /// Per output file.
    pub targets: Vec<TargetReads>,
    /// Bytes read in all (what the copy reports as read).
    pub bytes_read: u64,
    /// Bytes written in all (what the copy reports as written).
    pub bytes_written: u64,
    /// The output file that reads most, and how much.
    pub largest_read: Option<(PathBuf, u64)>,
    /// The longest contiguous run read, in bytes.
    pub longest_run: u64,
}

/// Byte offset of element `e` for `bits`-bit elements (sub-byte types round down, as
/// the copy engine reads them).
fn byte_of(e: u64, bits: u64) -> u64 {
    e * bits / 8
}

fn reads_of(source: &Checkpoint, f: &FilePlan) -> Vec<SourceRead> {
    let mut out = Vec::new();
    for t in &f.tensors {
        let bits = t.src_dtype.bitsize() as u64;
        for op in &t.ops {
            let entry = &source.files[op.file].tensors()[op.tensor];
            let src = op.stored_box(&op.src);
            let numel = src.numel();
            if numel == 0 {
                continue;
            }
            let runs = Runs::new(
                &src.shape,
                &op.src_shape,
                &src.start,
                &src.shape,
                &vec![0; src.shape.len()],
            );
            let run_len = runs.run_len().max(1);
            // The first and last elements of the box, row-major, bound its bytes.
            let span = src.element_span(&op.src_shape).unwrap_or(0..0);
            out.push(SourceRead {
                file: op.file,
                tensor: entry.name.clone(),
                span: (
                    entry.start + byte_of(span.start, bits),
                    entry.start + byte_of(span.end, bits),
                ),
                bytes: crate::layout::plan::bytes_of(t.src_dtype, numel),
                runs: numel / run_len,
            });
        }
    }
    out
}

impl PlanReport {
    /// The reads of `plan` over `source`.
    #[must_use]
    pub fn new(source: &Checkpoint, plan: &CopyPlan) -> PlanReport {
        let targets: Vec<TargetReads> = plan
            .files
            .iter()
            .map(|f| {
                let reads = reads_of(source, f);
                TargetReads {
                    path: f.path.clone(),
                    bytes_read: reads.iter().map(|r| r.bytes).sum(),
                    bytes_written: f.bytes_written(),
                    reads,
                }
            })
            .collect();
        let longest_run = plan
            .files
            .iter()
            .flat_map(|f| &f.tensors)
            .flat_map(|t| {
                t.ops.iter().map(|op| {
                    let src = op.stored_box(&op.src);
                    let r = Runs::new(
                        &src.shape,
                        &op.src_shape,
                        &src.start,
                        &src.shape,
                        &vec![0; src.shape.len()],
                    );
                    crate::layout::plan::bytes_of(
                        t.src_dtype,
                        if op.src.numel() == 0 { 0 } else { r.run_len() },
                    )
                })
            })
            .max()
            .unwrap_or(0);
        PlanReport {
            bytes_read: targets.iter().map(|t| t.bytes_read).sum(),
            bytes_written: targets.iter().map(|t| t.bytes_written).sum(),
            largest_read: targets
                .iter()
                .max_by_key(|t| t.bytes_read)
                .map(|t| (t.path.clone(), t.bytes_read)),
            longest_run,
            targets,
        }
    }

    /// The report as JSON: `files` (one per output file, each with `output`, `bytes_read`,
    /// `bytes_written` and `reads`: `file`, `path`, `rank`, `tensor`, `span`, `bytes`,
    /// `runs`) and the totals.
    #[must_use]
    pub fn to_json(&self, source: &Checkpoint) -> Value {
        json!({
            "files": self.targets.iter().map(|t| json!({
                "output": t.path,
                "bytes_read": t.bytes_read,
                "bytes_written": t.bytes_written,
                "sources": t.reads.iter().map(|r| r.file).collect::<std::collections::BTreeSet<_>>().into_iter()
                    .map(|i| source.files[i].path().display().to_string()).collect::<Vec<_>>(),
                "reads": t.reads.iter().map(|r| json!({
                    "file": r.file,
                    "path": source.files[r.file].path(),
                    "rank": source.ranks[r.file],
                    "tensor": r.tensor,
                    "span": [r.span.0, r.span.1],
                    "bytes": r.bytes,
                    "runs": r.runs,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "largest_read": self.largest_read.as_ref().map(|(p, b)| json!({"output": p, "bytes": b})),
            "longest_run_bytes": self.longest_run,
        })
    }

    /// The report as text: per output file, per source file the tensors read with
    /// their byte ranges (at most `per_file` lines per source file, the rest counted),
    /// then the totals.
    #[must_use]
    pub fn to_text(&self, source: &Checkpoint, per_file: usize) -> String {
        let mut out = String::new();
        for t in &self.targets {
            let mut by_file: std::collections::BTreeMap<usize, Vec<&SourceRead>> =
                std::collections::BTreeMap::new();
            for r in &t.reads {
                by_file.entry(r.file).or_default().push(r);
            }
            let _ = writeln!(
                out,
                "{}: reads {} from {} file(s), writes {}",
                t.path.display(),
                human(t.bytes_read),
                by_file.len(),
                human(t.bytes_written)
            );
            for (file, reads) in &by_file {
                let bytes: u64 = reads.iter().map(|r| r.bytes).sum();
                let _ = writeln!(
                    out,
                    "    {}: {} in {} tensor part(s)",
                    source.label(*file),
                    human(bytes),
                    reads.len()
                );
                for r in reads.iter().take(per_file) {
                    let _ = writeln!(
                        out,
                        "        {}  bytes {}..{}  {} B in {} run(s)",
                        r.tensor, r.span.0, r.span.1, r.bytes, r.runs
                    );
                }
                if reads.len() > per_file {
                    let _ = writeln!(
                        out,
                        "        ... and {} more (--json lists them all)",
                        reads.len() - per_file
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "total: reads {} ({} B), writes {} ({} B)",
            human(self.bytes_read),
            self.bytes_read,
            human(self.bytes_written),
            self.bytes_written
        );
        if let Some((p, b)) = &self.largest_read {
            let _ = writeln!(
                out,
                "largest read: {} reads {} ({b} B); longest contiguous run {} B",
                p.display(),
                human(*b),
                self.longest_run
            );
        }
        out
    }
}

/// `1.50 MB`.
fn human(n: u64) -> String {
    let f = n as f64;
    for (unit, div) in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)] {
        if f >= div {
            return format!("{:.2} {unit}", f / div);
        }
    }
    format!("{n} B")
}
