//! Writing a merge's output as a DeepSpeed universal checkpoint (`merge --format ucp`)
//! straight from a ZeRO checkpoint: `OUT/latest_universal` naming `OUT/<tag>_universal/`,
//! which holds what `ds_to_universal.py` writes (formats/ucp.rs describes the tree), so
//! `engine.load_checkpoint(OUT)` with `"load_universal": true` loads it on any
//! data-parallel size.
//!
//! Beside the checkpoint, not in the engine (as megatron_output.rs): the parameters'
//! states are a plan of whole tensors, one per file, that the engine executes like any
//! other (streamed, in parallel, each file staged); [`ucp_finish`] then writes the
//! optimizer's global state, the steps, the module's other entries and the model states.

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::pickle::Emitter;
use crate::formats::torch_write::{hex, BARE_FLAT, PREFIX};
use crate::formats::ucp::{self, state_file, LATEST_UNIVERSAL, STATES};
use crate::layout::plan::{CopyPlan, TargetFile, TargetTensor};
use crate::layout::region::Region;
use crate::layout::select::Selection;
use crate::layout::{Dtype, Piece};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The ZeRO tag directory and stage a checkpoint was read from.
fn zero_source(source: &Checkpoint) -> Result<(PathBuf, u64)> {
    let f = source
        .files
        .iter()
        .find(|f| f.metadata().get("format").map(String::as_str) == Some("deepspeed"))
        .ok_or_else(|| Error::Unsupported {
            problem: "--format ucp writes DeepSpeed's universal checkpoint from a DeepSpeed ZeRO checkpoint (its optimizer and model states are carried): this source is not one".into(),
        })?;
    if let Some(n) = f.metadata().get(crate::formats::deepspeed::TP_SIZE) {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: --format ucp from a tensor-parallel DeepSpeed checkpoint (mp_world_size {n}) is not written yet",
                f.path().display()
            ),
        });
    }
    let stage = f
        .metadata()
        .get("deepspeed.zero_stage")
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let tag = f.path().parent().unwrap_or(Path::new(".")).to_path_buf();
    Ok((tag, stage))
}

/// The universal tag directory's name for the ZeRO tag `tag` (`global_step2` →
/// `global_step2_universal`, as DeepSpeed's examples name it).
fn universal_tag(tag: &Path) -> String {
    let name = tag
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().to_string());
    format!("{name}_universal")
}

/// The trainable parameters the output holds: the ZeRO checkpoint's `param_shapes`
/// that the selection keeps and the source has.
fn params(source: &Checkpoint, selection: &Selection) -> Result<(PathBuf, u64, BTreeSet<String>)> {
    let (tag, stage) = zero_source(source)?;
    let names = ucp::zero_params(&tag, stage)?
        .into_iter()
        .map(|(_, n, _)| n)
        .filter(|n| selection.keeps(n) && source.tensors.contains_key(n))
        .collect();
    Ok((tag, stage, names))
}

/// Plans the parameters' states of a universal checkpoint: for each trainable parameter
/// `p`, `<tag>_universal/zero/p/fp32.pt` and, where the source has its moments,
/// `exp_avg.pt` and `exp_avg_sq.pt`, each one whole fp32 tensor (ZeRO-1/2: the dict
/// `{'cat_dim': 0, 'param': t}`; ZeRO-3: `t` alone, flat), as `ds_to_universal.py` writes.
///
/// # Errors
/// A source that is not a DeepSpeed ZeRO checkpoint; a parameter name that cannot be a
/// directory; states that are not fp32; a cast asked for (the master weights stay fp32).
pub fn ucp_plan(source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
    // DeepSpeed's universal checkpoints of `deepspeed.moe` layers (ds_to_universal's
    // expert handling) are not written yet: refused rather than guessed.
    if let Some(n) = source
        .tensors
        .keys()
        .find(|n| n.contains("deepspeed_experts."))
    {
        return Err(crate::error::Error::Unsupported {
            problem: format!(
                "tensor `{n}`: a mixture-of-experts checkpoint: --format ucp does not write expert parameters yet"
            ),
        });
    }
    let (tag, stage, names) = params(source, selection)?;
    let dir = PathBuf::from(universal_tag(&tag));
    let metadata: BTreeMap<String, String> = if stage == 3 {
        [(BARE_FLAT.to_string(), "1".to_string())].into()
    } else {
        let mut e = Emitter::new();
        e.str("cat_dim").int(0);
        [(PREFIX.to_string(), hex(&e.fragment()))].into()
    };
    let mut files = Vec::new();
    for p in &names {
        for k in 0..STATES.len() {
            let name = ucp::state_name(p, k);
            let Some(t) = source.tensors.get(&name) else {
                continue;
            };
            if t.dtype != Dtype::F32 || selection.dtype(&name, t.dtype)? != Dtype::F32 {
                return Err(Error::Unsupported {
                    problem: format!(
                        "tensor `{name}`: a universal checkpoint holds fp32 master weights and moments, not {} (no --dtype with --format ucp)",
                        crate::layout::strategy::dtype_name(selection.dtype(&name, t.dtype)?)
                    ),
                });
            }
            let full = Region::full(&t.shape);
            files.push(TargetFile {
                path: dir.join(state_file(p, k)?),
                tensors: vec![TargetTensor {
                    name,
                    dtype: Dtype::F32,
                    shape: t.shape.clone(),
                    pieces: vec![Piece {
                        global: full.clone(),
                        local: full,
                    }],
                }],
                metadata: metadata.clone(),
            });
        }
    }
    let mut plan = CopyPlan::build(source, files)?;
    // DeepSpeed's key for the tensor in every state file.
    for f in &mut plan.files {
        for t in &mut f.tensors {
            t.target.name = "param".into();
        }
    }
    Ok(plan)
}

/// Completes a universal checkpoint whose [`ucp_plan`] was executed into `out`: the
/// optimizer's global state, each parameter's step and (ZeRO-1/2) the module's entries
/// without master weights, the model-states files, and `latest_universal`. Returns
/// notes on what was left out.
///
/// # Errors
/// As [`ucp_plan`]; missing or damaged source files; I/O errors.
pub fn ucp_finish(source: &Checkpoint, selection: &Selection, out: &Path) -> Result<Vec<String>> {
    let (tag, stage, names) = params(source, selection)?;
    let name = universal_tag(&tag);
    let notes = ucp::write_extras(&tag, stage, &out.join(&name), &names, &|n| {
        selection.keeps(n)
    })?;
    crate::formats::output::write_file_atomic(&out.join(LATEST_UNIVERSAL), name.as_bytes())?;
    Ok(notes)
}

/// `merge --format ucp`: DeepSpeed's universal checkpoint of a ZeRO source.
#[derive(Clone, Copy, Debug, Default)]
pub struct Universal;

impl Universal {
    /// The writer, refusing what does not apply to DeepSpeed's tree of `.pt` files.
    ///
    /// # Errors
    /// A compression, a shard size or one file asked for.
    pub fn checked(
        compressed: bool,
        max_shard_size: Option<u64>,
        one_file: bool,
    ) -> Result<Universal> {
        if compressed || max_shard_size.is_some() || one_file {
            return Err(Error::Unsupported {
                problem: "--format ucp writes DeepSpeed's tree of .pt files: --compress, --max-shard-size and --one-file do not apply".into(),
            });
        }
        Ok(Universal)
    }
}

impl super::Writer for Universal {
    fn name(&self) -> &'static str {
        "ucp"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        ucp_plan(source, selection)
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn finish(
        &self,
        source: &Checkpoint,
        selection: &Selection,
        _: &CopyPlan,
        dir: &Path,
    ) -> Result<()> {
        ucp_finish(source, selection, dir).map(|_| ())
    }
}
