//! The one-line summaries of a copy (merge, reshard) and a conversion, and the
//! reshard plan (`--plan`).

use super::human_bytes;
use crate::checkpoint::Checkpoint;
use crate::draw::PlanReport;
use crate::engine::convert::{Conversion, ConvertStats};
use crate::engine::copy::CopyStats;
use crate::layout::plan::CopyPlan;
use crate::layout::strategy::Strategy;
use serde_json::{json, Value};
use std::path::Path;

/// What a copying command did, for its summary.
#[derive(Clone, Copy, Debug)]
pub struct CopySummary<'a> {
    /// `merged`, `resharded`.
    pub verb: &'a str,
    /// The engine's counts.
    pub stats: &'a CopyStats,
    /// Distinct tensor names written (a reshard writes several pieces of one).
    pub names: u64,
    /// Output files written.
    pub files: u64,
    /// Wall time.
    pub seconds: f64,
    /// The output.
    pub output: &'a Path,
}

impl CopySummary<'_> {
    fn gb_per_s(&self) -> f64 {
        self.stats.bytes_written as f64 / self.seconds.max(1e-9) / 1e9
    }

    /// `--json`.
    #[must_use]
    pub fn json(&self) -> Value {
        let s = self.stats;
        json!({"tensors": self.names, "pieces": s.tensors, "files": self.files, "bytes_written": s.bytes_written, "bytes_read": s.bytes_read,
               "sync_seconds": s.sync_micros as f64 / 1e6,
               "checksums_verified": s.checksums_verified,
               "checksums_unchecked": s.checksums_unchecked,
               "seconds": self.seconds, "gb_per_s": self.gb_per_s(), "output": self.output})
    }

    /// The summary lines, each ending in a newline.
    #[must_use]
    pub fn text(&self) -> String {
        let s = self.stats;
        let (names, secs) = (self.names, self.seconds);
        // Pieces are said only where they differ from tensors (a reshard's slices).
        let pieces = if s.tensors == names {
            String::new()
        } else {
            format!(" as {} pieces", s.tensors)
        };
        let mut out = format!(
            "{} {names} tensors{pieces} in {} file(s), {} in {secs:.2} s ({:.2} GB/s) into {}\n",
            self.verb,
            self.files,
            human_bytes(s.bytes_written),
            self.gb_per_s(),
            self.output.display()
        );
        if s.checksums_unchecked > 0 {
            out.push_str(&format!(
                "checksums: {} source tensors checked; {} read only in part could not be\n",
                s.checksums_verified, s.checksums_unchecked
            ));
        }
        out
    }
}

fn ratio(s: &ConvertStats) -> f64 {
    s.bytes_out as f64 / s.bytes_in.max(1) as f64
}

/// `ckpt compress`/`decompress --json`.
#[must_use]
pub fn convert_json(s: &ConvertStats, seconds: f64, output: &Path) -> Value {
    json!({"files": s.files, "copied": s.copied, "raw_bytes": s.raw_bytes,
           "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "ratio": ratio(s),
           "seconds": seconds, "output": output})
}

/// `ckpt compress`/`decompress`'s summary line, ending in a newline.
#[must_use]
pub fn convert_text(how: Conversion, s: &ConvertStats, seconds: f64, output: &Path) -> String {
    let verb = match how {
        Conversion::Compress(_) => "compressed",
        Conversion::Decompress => "decompressed",
    };
    format!(
        "{verb} {} file(s), {} -> {} ({:.3} x) in {seconds:.2} s into {}\n",
        s.files,
        human_bytes(s.bytes_in),
        human_bytes(s.bytes_out),
        ratio(s),
        output.display()
    )
}

/// `ckpt merge --plan --json`: the plan's report (one integrated output, no mesh).
#[must_use]
pub fn merge_plan_json(source: &Checkpoint, plan: &CopyPlan) -> Value {
    PlanReport::new(source, plan).to_json(source)
}

/// `ckpt merge --plan`: which files each output file reads, and the bytes.
#[must_use]
pub fn merge_plan_text(source: &Checkpoint, plan: &CopyPlan) -> String {
    PlanReport::new(source, plan).to_text(source, 8)
}

/// `ckpt reshard --plan --json`: the plan's report with the target mesh.
#[must_use]
pub fn plan_json(source: &Checkpoint, strategy: &Strategy, plan: &CopyPlan) -> Value {
    let mut doc = PlanReport::new(source, plan).to_json(source);
    doc["mesh"] = json!(strategy.mesh.to_string());
    doc
}

/// `ckpt reshard --plan`: the target mesh, then which files each target rank reads.
#[must_use]
pub fn plan_text(source: &Checkpoint, strategy: &Strategy, plan: &CopyPlan) -> String {
    format!(
        "target mesh {} ({} ranks)\n{}",
        strategy.mesh,
        strategy.mesh.world_size(),
        PlanReport::new(source, plan).to_text(source, 8)
    )
}
