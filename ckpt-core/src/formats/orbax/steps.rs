//! Orbax's step directories (docs/orbax.md, "Manager root and step directories";
//! orbax-checkpoint 0.12.8, `_src/path/step.py`, `atomicity.py`): which directories
//! of a `CheckpointManager` root are steps, which of them are committed, and which
//! item directory of a step holds the arrays. The step itself is chosen by the
//! trainers' table (`detect/trainers.rs`: the highest committed step, or `--step N`).

use super::tree::{self, LeafKind, METADATA_FILE};
use crate::error::{Error, Result};
use crate::formats::list_dir;
use std::path::{Path, PathBuf};

/// The step metadata orbax writes into every step directory.
pub(crate) const CHECKPOINT_METADATA: &str = "_CHECKPOINT_METADATA";
/// The commit marker of a step (and of an item) directory.
pub(crate) const COMMIT_FILE: &str = "commit_success.txt";
/// The suffix of a step directory orbax is still writing (atomic-rename mode).
pub(crate) const TMP_SUFFIX: &str = ".orbax-checkpoint-tmp";

/// orbax's handler for a `StandardSave`d item, as `_CHECKPOINT_METADATA` names it.
pub(crate) const STANDARD_HANDLER: &str =
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler";

/// `_CHECKPOINT_METADATA` of a step holding the one item `item`, as a
/// `CheckpointManager` writes it after `save(step, args=StandardSave(tree))`: the
/// item's handler (which a restore without arguments uses), the times in nanoseconds
/// since the epoch, empty metrics.
pub(crate) fn step_metadata_json(item: &str, init_ns: u128, commit_ns: u128) -> String {
    serde_json::json!({
        "item_handlers": {item: STANDARD_HANDLER},
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": init_ns as u64,
        "commit_timestamp_nsecs": commit_ns as u64,
        "custom_metadata": {},
    })
    .to_string()
}

/// Largest `_CHECKPOINT_METADATA` read (orbax's are a few hundred bytes; metrics may
/// add some).
const MAX_STEP_METADATA_BYTES: u64 = 16 << 20;

/// The step a step directory's name says: the decimal number (`1000`, zero-padded
/// `000100`), or `<prefix>_<number>` (orbax's `step_prefix`). Temporary names
/// (`4.orbax-checkpoint-tmp`) are no step.
pub(crate) fn step_of(name: &str) -> Option<u64> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if digits(name) {
        return name.parse().ok();
    }
    let (prefix, n) = name.rsplit_once('_')?;
    (!prefix.is_empty() && digits(n)).then(|| n.parse().ok())?
}

/// Whether `dir` is one of orbax's step directories (named as a step, and holding
/// orbax's step metadata or an item), committed or not.
pub(crate) fn is_step_dir(dir: &Path) -> bool {
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(step_of)
        .is_some();
    named && (dir.join(CHECKPOINT_METADATA).is_file() || !items_in(dir).is_empty())
}

/// The item directories of a step directory: itself where it holds `_METADATA` (a
/// `Checkpointer`'s directory is both), else its subdirectories that do.
fn items_in(dir: &Path) -> Vec<PathBuf> {
    if dir.join(METADATA_FILE).is_file() {
        return vec![dir.to_path_buf()];
    }
    list_dir(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.is_dir() && p.join(METADATA_FILE).is_file())
        .collect()
}

/// Why the step directory `dir` is not committed; `None` when it is: it holds
/// `commit_success.txt`, or (older orbax, which wrote that file only on GCS) its
/// `_CHECKPOINT_METADATA` has a `commit_timestamp_nsecs`, or (older still) it has no
/// `_CHECKPOINT_METADATA`. A temporary name is never committed.
pub(crate) fn uncommitted(dir: &Path) -> Option<String> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.contains(TMP_SUFFIX) {
        return Some(format!(
            "its name ends in `{TMP_SUFFIX}`: orbax had not finished writing it"
        ));
    }
    if dir.join(COMMIT_FILE).is_file() {
        return None;
    }
    let meta = dir.join(CHECKPOINT_METADATA);
    if !meta.exists() {
        return None;
    }
    let text = match std::fs::metadata(&meta) {
        Ok(m) if m.len() <= MAX_STEP_METADATA_BYTES => crate::formats::read_small(&meta),
        Ok(m) => {
            return Some(format!(
            "no {COMMIT_FILE}, and its {CHECKPOINT_METADATA} is {} bytes, too large to be orbax's",
            m.len()
        ))
        }
        Err(e) => return Some(format!("{CHECKPOINT_METADATA}: {e}")),
    };
    let doc: Option<serde_json::Value> = text.ok().and_then(|t| serde_json::from_slice(&t).ok());
    match doc.as_ref().and_then(|d| d.get("commit_timestamp_nsecs")) {
        Some(t) if t.is_u64() => None,
        Some(serde_json::Value::Null) | None if doc.is_some() => Some(format!(
            "no {COMMIT_FILE}, and `commit_timestamp_nsecs` is null in its {CHECKPOINT_METADATA}: \
             a save cut off before orbax committed it"
        )),
        _ => Some(format!(
            "no {COMMIT_FILE}, and its {CHECKPOINT_METADATA} is not orbax's step metadata \
             (JSON with commit_timestamp_nsecs)"
        )),
    }
}

/// The item directory of a committed step directory to read, and what was decided:
/// the one item, or among several the one that holds arrays.
///
/// # Errors
/// A step not committed (why); no item; several items holding arrays (named).
pub(crate) fn step_item(dir: &Path) -> Result<(PathBuf, Vec<String>)> {
    if let Some(why) = uncommitted(dir) {
        return Err(unknown(format!("{}: not committed: {why}", dir.display())));
    }
    let items = items_in(dir);
    match &items[..] {
        [] => Err(unknown(format!(
            "{}: no item directory (none of its subdirectories holds {METADATA_FILE})",
            dir.display()
        ))),
        [one] => Ok((one.clone(), vec![])),
        _ => {
            let with_arrays: Vec<&PathBuf> = items.iter().filter(|p| holds_arrays(p)).collect();
            let names = |ps: &[&PathBuf]| {
                ps.iter()
                    .filter_map(|p| p.file_name()?.to_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            match &with_arrays[..] {
                [one] => {
                    let others: Vec<&PathBuf> = items.iter().filter(|p| p != one).collect();
                    Ok((
                        (*one).clone(),
                        vec![format!(
                            "{}: the item holding arrays; {} hold(s) none",
                            one.display(),
                            names(&others)
                        )],
                    ))
                }
                [] => Err(unknown(format!(
                    "{}: none of its items ({}) holds arrays ckpt reads",
                    dir.display(),
                    names(&items.iter().collect::<Vec<_>>())
                ))),
                many => Err(unknown(format!(
                    "{}: holds {} items with arrays ({}); which one is the model is not ckpt's \
                     to guess: pass the item directory meant (e.g. {})",
                    dir.display(),
                    many.len(),
                    names(many),
                    many[0].display()
                ))),
            }
        }
    }
}

/// Whether an item's `_METADATA` lists an array (an unreadable one counts: reading it
/// then says what is wrong).
fn holds_arrays(item: &Path) -> bool {
    let p = item.join(METADATA_FILE);
    let Ok(m) = std::fs::metadata(&p) else {
        return false;
    };
    if m.len() > tree::MAX_METADATA_BYTES {
        return true;
    }
    match crate::formats::read_small(&p).map(|b| tree::parse(&b)) {
        Ok(Ok(t)) => t.leaves.iter().any(|l| l.kind == LeafKind::Array),
        _ => true,
    }
}

/// The step of the item directory `item`: its step directory's name's (its parent's,
/// or its own where it is both); `None` where that is no step's name.
pub(crate) fn item_step(item: &Path) -> Option<u64> {
    let own = item.file_name().and_then(|n| n.to_str()).and_then(step_of);
    if item.join(CHECKPOINT_METADATA).is_file() {
        return own;
    }
    let parent = item.parent()?;
    parent
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(step_of)
}

/// The step directory holding the item directory `item`, where it is one of orbax's
/// (itself, for a `Checkpointer`'s directory).
pub(crate) fn step_dir_of(item: &Path) -> Option<PathBuf> {
    if item.join(CHECKPOINT_METADATA).is_file() {
        return Some(item.to_path_buf());
    }
    let parent = item.parent()?;
    parent
        .join(CHECKPOINT_METADATA)
        .is_file()
        .then(|| parent.to_path_buf())
}

fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_as_orbax_parses_them() {
        assert_eq!(step_of("2"), Some(2));
        assert_eq!(step_of("000100"), Some(100));
        assert_eq!(step_of("step_7"), Some(7));
        assert_eq!(step_of("4.orbax-checkpoint-tmp"), None);
        assert_eq!(step_of("_7"), None);
        assert_eq!(step_of("items"), None);
        assert_eq!(step_of(""), None);
    }

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/orbax")
            .join(rel)
    }

    #[test]
    fn committed_steps_of_the_fixtures() {
        let root = fixture("ocdbt_zarr3/ckpt");
        assert_eq!(uncommitted(&root.join("1")), None);
        assert_eq!(uncommitted(&root.join("2")), None);
        let why = uncommitted(&root.join("3")).unwrap();
        assert!(why.contains("commit_timestamp_nsecs"), "{why}");
        let why = uncommitted(&root.join("4.orbax-checkpoint-tmp")).unwrap();
        assert!(why.contains(TMP_SUFFIX), "{why}");
        assert!(is_step_dir(&root.join("3")));
        assert!(!is_step_dir(&root.join("4.orbax-checkpoint-tmp")));
        assert!(!is_step_dir(&root.join("2/items")));
        let (item, notes) = step_item(&root.join("2")).unwrap();
        assert_eq!(item, root.join("2/items"));
        assert!(notes.is_empty());
        let e = step_item(&root.join("3")).unwrap_err().to_string();
        assert!(e.contains("not committed"), "{e}");
        assert_eq!(item_step(&root.join("2/items")), Some(2));
        assert_eq!(item_step(&fixture("zarr_no_ocdbt/ckpt")), None);
        assert_eq!(step_dir_of(&root.join("3/items")), Some(root.join("3")));
    }

    #[test]
    fn several_items_are_chosen_by_their_arrays_or_refused() {
        let d = tempfile::tempdir().unwrap();
        let step = d.path().join("5");
        let arrays = r#"{"tree_metadata": {"a": {"key_metadata": [{"key": "a"}], "value_metadata": {"value_type": "jax.Array"}}}}"#;
        let none = r#"{"tree_metadata": {"s": {"key_metadata": [{"key": "s"}], "value_metadata": {"value_type": "string"}}}}"#;
        for (item, doc) in [("state", arrays), ("meta", none)] {
            std::fs::create_dir_all(step.join(item)).unwrap();
            std::fs::write(step.join(item).join(METADATA_FILE), doc).unwrap();
        }
        std::fs::write(step.join(COMMIT_FILE), "").unwrap();
        let (item, notes) = step_item(&step).unwrap();
        assert_eq!(item, step.join("state"));
        assert!(notes[0].contains("meta hold(s) none"), "{notes:?}");
        std::fs::write(step.join("meta").join(METADATA_FILE), arrays).unwrap();
        let e = step_item(&step).unwrap_err().to_string();
        assert!(e.contains("2 items with arrays (meta, state)"), "{e}");
    }
}
