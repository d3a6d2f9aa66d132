//! What `ckpt train` says at the end of a run, as text or JSON.

use crate::trainer::TrainReport;
use serde_json::{json, Value};
use std::fmt::Write;
use std::path::Path;

impl TrainReport {
    /// The run's summary as JSON; `events` is the TensorBoard file written beside the
    /// checkpoints, if any.
    #[must_use]
    pub fn summary_json(&self, events: Option<&Path>) -> Value {
        json!({
            "mesh": self.mesh, "model": self.model, "start_step": self.start_step, "steps": self.steps,
            "epochs": self.epochs, "final_loss": self.losses.last(), "test_accuracy": self.test_accuracy,
            "images_per_sec": self.images_per_sec, "seconds": self.seconds, "checkpoints": self.checkpoints,
            "save_stall_seconds": self.save_stalls, "events": events,
        })
    }

    /// The run's summary lines, each ending in a newline.
    #[must_use]
    pub fn summary_text(&self, events: Option<&Path>) -> String {
        let mut out = String::new();
        // (Writing to a String cannot fail.)
        let _ = writeln!(
            out,
            "trained {} on {}: steps {}..{}, epochs {}, final loss {}, test accuracy {}, {:.0} images/s, {:.1} s",
            self.model.kind(),
            self.mesh,
            self.start_step,
            self.steps,
            self.epochs,
            self.losses.last().map_or("-".into(), |l| format!("{l:.4}")),
            self.final_accuracy().map_or("-".into(), |a| format!("{a:.4}")),
            self.images_per_sec,
            self.seconds
        );
        if let Some(last) = self.checkpoints.last() {
            let _ = writeln!(out, "checkpoint: {}", last.display());
        }
        if let Some(e) = events {
            let _ = writeln!(out, "tensorboard: {}", e.display());
        }
        out
    }
}
