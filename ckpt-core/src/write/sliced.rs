//! A sliced checkpoint: one directory per target rank with its file and the target
//! strategy beside it, `strategy.json` and the carried files also at the top. ckpt's own
//! layout (`ckpt_<r>/model.safetensors`, or `model.ckptz` when compressed), or
//! MindSpore's (`rank_<r>/checkpoint_<r>.ckpt`, as `mindspore.save_checkpoint` writes
//! it). The file's codec is the format's, chosen by the file's name.

use super::ranks::{finish_dir, rank_plan, RankFiles, RankOptions};
use super::Writer;
use crate::checkpoint::{Checkpoint, MODEL_FILE};
use crate::error::Result;
use crate::formats::ckptz::{Compression, EXTENSION as CKPTZ_EXTENSION};
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use std::path::{Path, PathBuf};

/// `reshard --format ckpt` (the default) and `--format mindspore`.
#[derive(Clone, Debug)]
pub struct Sliced {
    /// The format's name (`--format`).
    name: &'static str,
    /// Its rank files.
    files: RankFiles,
    strategy: Strategy,
    options: RankOptions,
}

fn ckpt_file(r: u64) -> PathBuf {
    Path::new(&format!("ckpt_{r}")).join(MODEL_FILE)
}

fn mindspore_file(r: u64) -> PathBuf {
    Path::new(&format!("rank_{r}")).join(format!("checkpoint_{r}.ckpt"))
}

impl Sliced {
    /// ckpt's rank directories for `strategy`, `.ckptz` files when `options` asks for a
    /// compression.
    #[must_use]
    pub fn ckpt(strategy: Strategy, options: RankOptions) -> Sliced {
        Sliced {
            name: "ckpt",
            files: RankFiles {
                path: ckpt_file,
                one_box: false,
                once: false,
            },
            strategy,
            options,
        }
    }

    /// MindSpore's rank directories for `strategy`.
    ///
    /// # Errors
    /// A compression asked for.
    pub fn mindspore(strategy: Strategy, options: RankOptions) -> Result<Sliced> {
        options.uncompressed()?;
        Ok(Sliced {
            name: "mindspore",
            files: RankFiles {
                path: mindspore_file,
                one_box: false,
                once: false,
            },
            strategy,
            options,
        })
    }
}

impl Writer for Sliced {
    fn name(&self) -> &'static str {
        self.name
    }

    fn plan(&self, source: &Checkpoint, _: &Selection) -> Result<CopyPlan> {
        let o = &self.options;
        let mut plan = rank_plan(source, &self.strategy, o.ranks, o.keep_all, self.files)?;
        if o.compression.is_some() {
            for f in &mut plan.files {
                f.path.set_extension(CKPTZ_EXTENSION);
            }
        }
        Ok(plan)
    }

    fn compression(&self) -> Option<Compression> {
        self.options.compression
    }

    fn strategy(&self) -> Option<&Strategy> {
        Some(&self.strategy)
    }

    fn finish(&self, src: &Checkpoint, _: &Selection, plan: &CopyPlan, dir: &Path) -> Result<()> {
        let json = self.strategy.to_json();
        for f in &plan.files {
            if let Some(rank_dir) = f.path.parent().filter(|p| !p.as_os_str().is_empty()) {
                finish_dir(&dir.join(rank_dir), &json, src)?;
            }
        }
        finish_dir(dir, &json, src)
    }

    fn finish_part(&self, source: &Checkpoint, dir: &Path) -> Result<()> {
        finish_dir(dir, &self.strategy.to_json(), source)
    }
}
