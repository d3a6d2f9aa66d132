//! One integrated checkpoint in safetensors (or `.ckptz`) files: `model.safetensors`,
//! or shards filled greedily in tensor order with Hugging Face's index; optimizer state
//! (ckpt's and torch's `optim.` names) in `optimizer.safetensors` beside the weights;
//! the carried files (`config.json`, ...) copied beside them.

use super::Writer;
use crate::checkpoint::{
    Checkpoint, COMPRESSED_INDEX_FILE, INDEX_FILE, MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_PREFIX,
};
use crate::error::Result;
use crate::formats::ckptz::{Compression, EXTENSION as CKPTZ_EXTENSION};
use crate::formats::output::{copy_carried, write_file_atomic};
use crate::layout::plan::{bytes_of, CopyPlan, TargetFile, TargetTensor};
use crate::layout::region::Region;
use crate::layout::select::Selection;
use crate::layout::Piece;
use std::collections::BTreeMap;
use std::path::Path;

/// `merge`'s default output (`--format safetensors`).
#[derive(Clone, Debug, Default)]
pub struct Integrated {
    /// Shards of at most this many bytes (plus an index); one file when `None`.
    pub max_shard_size: Option<u64>,
    /// Optimizer state in the model file(s) too, not in `optimizer.safetensors`.
    pub one_file: bool,
    /// `.ckptz` files (and `model.ckptz.index.json`).
    pub compression: Option<Compression>,
}

/// Every tensor `selection` keeps, whole, in the dtype it asks for.
pub(crate) fn whole_tensors(
    source: &Checkpoint,
    selection: &Selection,
) -> Result<Vec<TargetTensor>> {
    let mut tensors = Vec::new();
    for (name, t) in &source.tensors {
        if !selection.keeps(name) {
            continue;
        }
        let full = Region::full(&t.shape);
        tensors.push(TargetTensor {
            name: name.clone(),
            dtype: selection.dtype(name, t.dtype)?,
            shape: t.shape.clone(),
            pieces: vec![Piece {
                global: full.clone(),
                local: full,
            }],
        });
    }
    Ok(tensors)
}

impl Integrated {
    /// The plan's files: the weights in one file or shards, the optimizer state beside.
    pub(crate) fn files(&self, tensors: Vec<TargetTensor>) -> Vec<TargetFile> {
        // Hugging Face users expect weights only in model.safetensors: optimizer
        // state (ckpt's and torch's `optim.` names) goes beside it.
        let (optim, weights): (Vec<_>, Vec<_>) = tensors
            .into_iter()
            .partition(|t| !self.one_file && t.name.starts_with(OPTIMIZER_PREFIX));
        let mut files = shard(weights, self.max_shard_size);
        if !optim.is_empty() {
            files.push(TargetFile {
                path: OPTIMIZER_FILE.into(),
                tensors: optim,
                metadata: [("format".to_string(), "pt".to_string())].into(),
            });
        }
        if self.compression.is_some() {
            for f in &mut files {
                f.path.set_extension(CKPTZ_EXTENSION);
            }
        }
        files
    }

    /// Writes the index of a sharded plan (`plan`: the whole output's).
    pub(crate) fn write_index(&self, plan: &CopyPlan, dir: &Path) -> Result<()> {
        let Some(index) = index_json(plan) else {
            return Ok(());
        };
        let name = if self.compression.is_some() {
            COMPRESSED_INDEX_FILE
        } else {
            INDEX_FILE
        };
        write_file_atomic(&dir.join(name), index.as_bytes())
    }
}

impl Writer for Integrated {
    fn name(&self) -> &'static str {
        "safetensors"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        CopyPlan::build(source, self.files(whole_tensors(source, selection)?))
    }

    fn compression(&self) -> Option<Compression> {
        self.compression
    }

    fn finish(
        &self,
        source: &Checkpoint,
        _: &Selection,
        plan: &CopyPlan,
        dir: &Path,
    ) -> Result<()> {
        self.write_index(plan, dir)?;
        copy_carried(&source.carried, dir)
    }
}

/// Hugging Face's greedy sharding: tensors in order, a new file when the next tensor
/// would overflow the current one (a tensor larger than the limit gets a file alone).
pub(crate) fn shard(tensors: Vec<TargetTensor>, max: Option<u64>) -> Vec<TargetFile> {
    let meta: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let Some(max) = max else {
        return vec![TargetFile {
            path: MODEL_FILE.into(),
            tensors,
            metadata: meta,
        }];
    };
    let mut groups: Vec<Vec<TargetTensor>> = vec![];
    let mut size = 0u64;
    for t in tensors {
        let n = bytes_of(t.dtype, t.shape.iter().product());
        if groups.is_empty() || (size + n > max && size > 0) {
            groups.push(vec![]);
            size = 0;
        }
        size += n;
        if let Some(g) = groups.last_mut() {
            g.push(t)
        }
    }
    let total = groups.len();
    if total == 1 {
        // Everything fits in one shard: Hugging Face writes a plain model.safetensors.
        return vec![TargetFile {
            path: MODEL_FILE.into(),
            tensors: groups.remove(0),
            metadata: meta,
        }];
    }
    groups
        .into_iter()
        .enumerate()
        .map(|(i, tensors)| TargetFile {
            path: format!("model-{:05}-of-{total:05}.safetensors", i + 1).into(),
            tensors,
            metadata: meta.clone(),
        })
        .collect()
}

/// The Hugging Face index of a sharded plan: the model's shards (not the optimizer
/// file), when there are several.
fn index_json(plan: &CopyPlan) -> Option<String> {
    let shards: Vec<_> = plan
        .files
        .iter()
        // (`optimizer.ckptz` when compressed.)
        .filter(|f| f.path.file_stem() != Path::new(OPTIMIZER_FILE).file_stem())
        .collect();
    if shards.len() < 2 {
        return None;
    }
    // Hugging Face's `total_size`: the tensor bytes of the shards the weight_map lists.
    let total: u64 = shards.iter().map(|f| f.bytes_written()).sum();
    let mut map = serde_json::Map::new();
    for f in shards {
        for t in &f.tensors {
            map.insert(
                t.target.name.clone(),
                serde_json::Value::String(f.path.display().to_string()),
            );
        }
    }
    let doc = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    Some(serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Dtype;
    use std::path::PathBuf;

    fn t(name: &str, n: u64) -> TargetTensor {
        TargetTensor {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![n],
            pieces: vec![],
        }
    }

    #[test]
    fn greedy_sharding_like_hugging_face() {
        let files = shard(vec![t("a", 4), t("b", 4), t("c", 9), t("d", 1)], Some(8));
        let names: Vec<Vec<&str>> = files
            .iter()
            .map(|f| f.tensors.iter().map(|t| t.name.as_str()).collect())
            .collect();
        assert_eq!(names, vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
        assert_eq!(
            files[2].path,
            PathBuf::from("model-00003-of-00003.safetensors")
        );
        let one = shard(vec![t("a", 4)], Some(8));
        assert_eq!(one[0].path, PathBuf::from(MODEL_FILE));
    }
}
