//! What `ckpt infer` says about an evaluation.

use crate::InferReport;
use std::fmt::Write;

impl InferReport {
    /// The report for a terminal: accuracy, per class, the confusion matrix, the
    /// predictions asked for and the speed; each line ending in a newline.
    #[must_use]
    pub fn text(&self) -> String {
        let r = self;
        let mut out = String::new();
        // (Writing to a String cannot fail.)
        let _ = writeln!(
            out,
            "{} checkpoint, model {}, {} rank(s): test accuracy {:.4} on {} images of {}",
            r.kind,
            r.model["model"].as_str().unwrap_or("?"),
            r.ranks,
            r.accuracy,
            r.images,
            r.data
        );
        let _ = writeln!(
            out,
            "per class: {}",
            r.per_class_accuracy
                .iter()
                .enumerate()
                .map(|(c, a)| format!("{c}:{a:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        out.push_str("confusion (rows: true class, columns: predicted):\n");
        for row in &r.confusion {
            let _ = writeln!(
                out,
                "  {}",
                row.iter().map(|n| format!("{n:>4}")).collect::<String>()
            );
        }
        for p in &r.predictions {
            let probs = p
                .probabilities
                .iter()
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join(" ");
            let label = p.label.map_or(String::new(), |l| format!(" (true {l})"));
            let _ = writeln!(
                out,
                "image {}: class {}{label}  p = [{probs}]",
                p.index, p.class
            );
        }
        let _ = writeln!(
            out,
            "{:.0} images/s, {:.2} s in all",
            r.images_per_sec, r.seconds
        );
        out
    }
}
