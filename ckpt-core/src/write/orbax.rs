//! An Orbax step directory (`--format orbax`), as a `CheckpointManager` writes
//! `save(step, args=StandardSave(tree))` with `use_zarr3=True` and no compression:
//! `_CHECKPOINT_METADATA`, `commit_success.txt` and one item directory (`default/`
//! unless told) holding `_METADATA` (the tree: ckpt's dotted names as nested dict
//! keys, every leaf a numpy array), `commit_success.txt` and the arrays in a new OCDBT
//! database, written by the copy engine through the Orbax file codec
//! (`formats/orbax/encode.rs`; docs/orbax.md, "What ckpt writes"). orbax-checkpoint
//! 0.12.8 restores it without a target (numpy arrays) and onto any mesh with one.

use super::safetensors::whole_tensors;
use super::Writer;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::orbax::encode::{check, MANIFEST_FILE};
use crate::formats::orbax::steps::{step_metadata_json, CHECKPOINT_METADATA, COMMIT_FILE};
use crate::formats::orbax::tree::{metadata_json, METADATA_FILE};
use crate::formats::output::write_file_atomic;
use crate::formats::writer::TensorSpec;
use crate::layout::plan::{CopyPlan, TargetFile};
use crate::layout::select::Selection;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// The item name orbax gives a step's one item when `save` is given no `Composite`.
pub const ORBAX_DEFAULT_ITEM: &str = "default";

/// `merge --format orbax`: one step directory with one item.
#[derive(Clone, Debug)]
pub struct OrbaxStep {
    /// The item directory's name.
    item: String,
    /// When the save began (`init_timestamp_nsecs`).
    started_ns: u128,
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

impl OrbaxStep {
    /// The writer of a step whose item is `item` ([`ORBAX_DEFAULT_ITEM`] when `None`),
    /// refusing the options that do not apply to an Orbax step.
    ///
    /// # Errors
    /// An item name that is no directory name of its own (empty, `.`, `..`, with a
    /// `/`, or one of the step's own files); a compression, a shard size or
    /// `--one-file` asked for.
    pub fn checked(
        item: Option<String>,
        compressed: bool,
        max_shard_size: Option<u64>,
        one_file: bool,
    ) -> Result<OrbaxStep> {
        let refuse = |what: &str| {
            Err(Error::Unsupported {
                problem: format!(
                    "--format orbax writes a step directory orbax restores: {what} does not apply"
                ),
            })
        };
        if compressed {
            return refuse("--compress");
        }
        if max_shard_size.is_some() {
            return refuse("--max-shard-size");
        }
        if one_file {
            return refuse("--one-file");
        }
        let item = item.unwrap_or_else(|| ORBAX_DEFAULT_ITEM.to_string());
        if item.is_empty()
            || item == "."
            || item == ".."
            || item.contains('/')
            || item.contains('\0')
            || item == CHECKPOINT_METADATA
            || item == COMMIT_FILE
        {
            return Err(Error::Unsupported {
                problem: format!("--orbax-item `{item}` is not a name for an item directory"),
            });
        }
        Ok(OrbaxStep {
            item,
            started_ns: now_ns(),
        })
    }
}

impl Writer for OrbaxStep {
    fn name(&self) -> &'static str {
        "orbax"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        let tensors = whole_tensors(source, selection)?;
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            })
            .collect();
        check(&specs)?;
        let file = TargetFile {
            path: Path::new(&self.item).join(MANIFEST_FILE),
            tensors,
            metadata: BTreeMap::new(),
        };
        CopyPlan::build(source, vec![file])
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn finish(&self, _: &Checkpoint, _: &Selection, plan: &CopyPlan, dir: &Path) -> Result<()> {
        let item = dir.join(&self.item);
        let names = plan
            .files
            .iter()
            .flat_map(|f| &f.tensors)
            .map(|t| t.target.name.as_str());
        write_file_atomic(&item.join(METADATA_FILE), metadata_json(names).as_bytes())?;
        let committed = |what: &str| format!("Checkpoint commit was successful to {what}");
        write_file_atomic(&item.join(COMMIT_FILE), committed(&self.item).as_bytes())?;
        let meta = step_metadata_json(&self.item, self.started_ns, now_ns());
        write_file_atomic(&dir.join(CHECKPOINT_METADATA), meta.as_bytes())?;
        // Last: the mark of a committed step.
        write_file_atomic(&dir.join(COMMIT_FILE), committed("this step").as_bytes())
    }
}
