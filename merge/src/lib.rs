//! ckpt-merge: per-rank slices into one integrated Hugging Face checkpoint.
//!
//! Merging is resharding to a single rank that holds every tensor whole, so this crate
//! only decides the output files (one `model.safetensors`, or shards of at most
//! `max_shard_size` bytes filled greedily in tensor order with an index); ckpt-core's
//! [`CopyPlan`] and [`execute`] do the copying.

use ckpt_core::{
    check_output_outside_inputs, copy_carried, execute_with, write_file_atomic, Checkpoint,
    Compression, CopyPlan, CopyStats, HfModel, HfTarget, Piece, Region, Result, Selection,
    StagedDir, TargetFile, TargetTensor, CKPTZ_EXTENSION, COMPRESSED_INDEX_FILE, INDEX_FILE,
    MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_PREFIX,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What to merge and how.
#[derive(Clone, Debug, Default)]
pub struct MergeRequest {
    /// Rank directories, rank files, or a DCP directory.
    pub inputs: Vec<PathBuf>,
    /// The output directory (must not exist unless `force`).
    pub output: PathBuf,
    /// Split into shards of at most this many bytes (plus an index).
    pub max_shard_size: Option<u64>,
    /// Tensor selection and casting.
    pub selection: Selection,
    /// Replace an existing output.
    pub force: bool,
    /// The output's format.
    pub format: MergeFormat,
    /// Keep optimizer state in the model file(s) (safetensors): by default it goes to
    /// `optimizer.safetensors` beside them.
    pub one_file: bool,
    /// Write only share `index` of `count` of the output files (file `k` when
    /// `k % count == index`): one process of a job started by mpirun or srun. Each file
    /// appears atomically; share 0 also writes the index and carried files.
    pub share: Option<(u64, u64)>,
    /// Write compressed `.ckptz` files (and `model.ckptz.index.json`).
    pub compression: Option<Compression>,
    /// With [`MergeFormat::Hf`]: the model's config or family, where the source does
    /// not record them.
    pub hf: HfTarget,
    /// With [`MergeFormat::Hf`]: a directory whose tokenizer files are copied beside the
    /// model.
    pub tokenizer: Option<PathBuf>,
}

/// transformers' `save_pretrained` default `max_shard_size` ("50GB", 10^9 bytes a GB;
/// transformers 5.24 `modeling_utils.py`).
pub const HF_MAX_SHARD_SIZE: u64 = 50_000_000_000;

/// The tokenizer files `--tokenizer DIR` copies (those transformers' tokenizers save).
pub use ckpt_core::HF_TOKENIZER_FILES as TOKENIZER_FILES;

/// The format of a merge's output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MergeFormat {
    /// Hugging Face's layout: `model.safetensors`, or shards and an index.
    #[default]
    Safetensors,
    /// One `model.ckpt` that `mindspore.load_checkpoint` reads.
    MindSpore,
    /// One `model.pth` that `torch.load(weights_only=True)` reads (a dict of tensors).
    Torch,
    /// DeepSpeed's universal checkpoint (from a DeepSpeed ZeRO source):
    /// `latest_universal` and `<tag>_universal/` with `zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`,
    /// which `engine.load_checkpoint` reads with `"load_universal": true` on any
    /// data-parallel size.
    Ucp,
    /// A Hugging Face model that `from_pretrained` loads: the tensors renamed and cut by
    /// the model family's table, `config.json`, shards as `save_pretrained` writes them.
    Hf,
}

impl MergeFormat {
    /// Every format by the name the CLI and the Python package take (`--format`).
    pub const NAMES: [(&'static str, MergeFormat); 5] = [
        ("safetensors", MergeFormat::Safetensors),
        ("hf", MergeFormat::Hf),
        ("mindspore", MergeFormat::MindSpore),
        ("torch", MergeFormat::Torch),
        ("ucp", MergeFormat::Ucp),
    ];

    /// The format named `name` ([`MergeFormat::NAMES`]).
    pub fn from_name(name: &str) -> Option<MergeFormat> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, f)| f)
    }
}

/// Plans a merge: the integrated output files, one tensor per full piece.
///
/// # Errors
/// Impossible casts or tensors the source cannot provide.
pub fn plan(source: &Checkpoint, req: &MergeRequest) -> Result<CopyPlan> {
    if req.format == MergeFormat::Ucp {
        if req.compression.is_some() || req.max_shard_size.is_some() || req.one_file {
            return Err(ckpt_core::Error::Unsupported {
                problem: "--format ucp writes DeepSpeed's tree of .pt files: --compress, --max-shard-size and --one-file do not apply".into(),
            });
        }
        return ckpt_core::ucp_plan(source, &req.selection);
    }
    let mut tensors = Vec::new();
    for (name, t) in &source.tensors {
        if !req.selection.keeps(name) {
            continue;
        }
        let dtype = req.selection.dtype(name, t.dtype)?;
        let full = Region::full(&t.shape);
        tensors.push(TargetTensor {
            name: name.clone(),
            dtype,
            shape: t.shape.clone(),
            pieces: vec![Piece {
                global: full.clone(),
                local: full,
            }],
        });
    }
    let single = match req.format {
        MergeFormat::Safetensors | MergeFormat::Hf => None,
        MergeFormat::MindSpore => Some(("mindspore", "model.ckpt")),
        MergeFormat::Torch => Some(("torch", "model.pth")),
        MergeFormat::Ucp => None,
    };
    let files = match single {
        Some((name, file)) => {
            if req.compression.is_some() {
                return Err(ckpt_core::Error::Unsupported {
                    problem: format!(
                        "--format {name} writes {file}, which {name} reads: --compress does not apply"
                    ),
                });
            }
            if req.max_shard_size.is_some() {
                return Err(ckpt_core::Error::Unsupported {
                    problem: format!(
                        "--format {name} writes one {file}: --max-shard-size does not apply"
                    ),
                });
            }
            vec![TargetFile {
                path: file.into(),
                tensors,
                metadata: BTreeMap::new(),
            }]
        }
        None => {
            // Hugging Face users expect weights only in model.safetensors: optimizer
            // state (ckpt's and torch's `optim.` names) goes beside it.
            let (optim, weights): (Vec<_>, Vec<_>) = tensors
                .into_iter()
                .partition(|t| !req.one_file && t.name.starts_with(OPTIMIZER_PREFIX));
            let max = match req.format {
                MergeFormat::Hf => Some(req.max_shard_size.unwrap_or(HF_MAX_SHARD_SIZE)),
                _ => req.max_shard_size,
            };
            let mut files = shard(weights, max);
            if !optim.is_empty() {
                files.push(TargetFile {
                    path: OPTIMIZER_FILE.into(),
                    tensors: optim,
                    metadata: [("format".to_string(), "pt".to_string())].into(),
                });
            }
            if req.compression.is_some() {
                for f in &mut files {
                    f.path.set_extension(CKPTZ_EXTENSION);
                }
            }
            files
        }
    };
    CopyPlan::build(source, files)
}

/// Hugging Face's greedy sharding: tensors in order, a new file when the next tensor
/// would overflow the current one (a tensor larger than the limit gets a file alone).
fn shard(tensors: Vec<TargetTensor>, max: Option<u64>) -> Vec<TargetFile> {
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
        let n = ckpt_core::bytes_of(t.dtype, t.shape.iter().product());
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

/// The source as the merge reads it: opened with the selection, refused when it holds no
/// tensors, and, for `--format hf`, seen as the Hugging Face model it becomes.
fn open(req: &MergeRequest) -> Result<(Checkpoint, Option<HfModel>)> {
    let mut source = Checkpoint::open_selected(&req.inputs, &req.selection)?;
    if let Some(e) = source.no_tensors() {
        return Err(e);
    }
    let hf = if req.format == MergeFormat::Hf {
        if req.compression.is_some() || req.one_file {
            return Err(ckpt_core::Error::Unsupported {
                problem: "--format hf writes what transformers loads: --compress and --one-file do not apply".into(),
            });
        }
        Some(source.hf_view(&req.hf)?)
    } else {
        None
    };
    Ok((source, hf))
}

/// Opens the source and plans the merge, writing nothing (`ckpt merge --plan`): with
/// `share`, the output files that process writes.
///
/// # Errors
/// As [`merge`], before anything would be written.
pub fn prepare(req: &MergeRequest) -> Result<(Checkpoint, CopyPlan)> {
    let (source, _) = open(req)?;
    let mut plan = plan(&source, req)?;
    if let Some((share, count)) = req.share {
        plan.files = std::mem::take(&mut plan.files)
            .into_iter()
            .enumerate()
            .filter(|(k, _)| *k as u64 % count.max(1) == share)
            .map(|(_, f)| f)
            .collect();
    }
    Ok((source, plan))
}

/// Merges: checks everything, then writes the output atomically.
///
/// # Errors
/// Any problem with the inputs (nothing is written then), an existing output without
/// `force`, an output inside an input, I/O errors.
pub fn merge(
    req: &MergeRequest,
    progress: &(dyn Fn(u64) + Sync),
    on_plan: &dyn Fn(&Checkpoint, &CopyPlan),
) -> Result<CopyStats> {
    check_output_outside_inputs(&req.output, &req.inputs)?;
    if req.share.is_none() && req.output.exists() && !req.force {
        return Err(ckpt_core::Error::OutputExists {
            path: req.output.clone(),
        });
    }
    let (source, hf) = open(req)?;
    let plan = plan(&source, req)?;
    // (A universal checkpoint is DeepSpeed's tree: no Hugging Face index.)
    let index = (req.format != MergeFormat::Ucp)
        .then(|| index_json(&plan))
        .flatten();
    let index_file = if req.compression.is_some() {
        COMPRESSED_INDEX_FILE
    } else {
        INDEX_FILE
    };
    let Some((share, count)) = req.share else {
        on_plan(&source, &plan);
        let staged = StagedDir::new(&req.output, req.force)?;
        let stats = execute_with(&plan, &source, staged.path(), progress, req.compression)?;
        if let Some(index) = &index {
            write_file_atomic(&staged.path().join(index_file), index.as_bytes())?;
        }
        if req.format == MergeFormat::Ucp {
            ckpt_core::ucp_finish(&source, &req.selection, staged.path())?;
        } else if let Some(hf) = &hf {
            write_hf_files(hf, &plan, req, &source.carried, staged.path())?;
        } else {
            copy_carried(&source.carried, staged.path())?;
        }
        staged.commit()?;
        return Ok(stats);
    };
    if req.format == MergeFormat::Ucp {
        return Err(ckpt_core::Error::Unsupported {
            problem: "--format ucp writes the whole tree at once (no --rank)".into(),
        });
    }
    let mine = CopyPlan {
        files: plan
            .files
            .into_iter()
            .enumerate()
            .filter(|(k, _)| *k as u64 % count.max(1) == share)
            .map(|(_, f)| f)
            .collect(),
    };
    for f in &mine.files {
        let p = req.output.join(&f.path);
        if p.exists() && !req.force {
            return Err(ckpt_core::Error::OutputExists { path: p });
        }
    }
    on_plan(&source, &mine);
    std::fs::create_dir_all(&req.output).map_err(|source| ckpt_core::Error::Io {
        path: req.output.clone(),
        source,
    })?;
    let stats = execute_with(&mine, &source, &req.output, progress, req.compression)?;
    if share == 0 {
        if let Some(index) = &index {
            write_file_atomic(&req.output.join(index_file), index.as_bytes())?;
        }
        match &hf {
            Some(hf) => write_hf_files(hf, &mine, req, &source.carried, &req.output)?,
            None => copy_carried(&source.carried, &req.output)?,
        }
    }
    Ok(stats)
}

/// Beside a Hugging Face model's weights: `config.json` (the user's, or made from the
/// model's shape for the dtype written), the `generation_config.json` beside the user's
/// config, and the tokenizer files of `--tokenizer`.
fn write_hf_files(
    hf: &HfModel,
    plan: &CopyPlan,
    req: &MergeRequest,
    carried: &std::collections::BTreeMap<String, PathBuf>,
    dir: &Path,
) -> Result<()> {
    let dtype = plan
        .files
        .iter()
        .flat_map(|f| &f.tensors)
        .map(|t| t.target.dtype)
        .find(|d| {
            matches!(
                d,
                ckpt_core::Dtype::BF16
                    | ckpt_core::Dtype::F16
                    | ckpt_core::Dtype::F32
                    | ckpt_core::Dtype::F64
            )
        })
        .unwrap_or(ckpt_core::Dtype::F32);
    write_file_atomic(
        &dir.join("config.json"),
        hf.config_json(ckpt_core::torch_dtype_name(dtype).unwrap_or("float32"))?
            .as_bytes(),
    )?;
    let mut copies: Vec<PathBuf> = vec![];
    if let Some(gen) = hf
        .user_config
        .as_deref()
        .and_then(Path::parent)
        .map(|d| d.join("generation_config.json"))
        .filter(|p| p.is_file())
    {
        copies.push(gen);
    }
    // Without --tokenizer: the tokenizer a trainer kept beside its weights.
    if req.tokenizer.is_none() {
        copies.extend(
            TOKENIZER_FILES
                .iter()
                .filter_map(|name| carried.get(*name))
                .cloned(),
        );
    }
    if let Some(tok) = &req.tokenizer {
        let found: Vec<PathBuf> = TOKENIZER_FILES
            .iter()
            .map(|f| tok.join(f))
            .filter(|p| p.is_file())
            .collect();
        if found.is_empty() {
            return Err(ckpt_core::Error::UnknownInput {
                problem: format!(
                    "--tokenizer {}: holds none of the tokenizer files ({})",
                    tok.display(),
                    TOKENIZER_FILES.join(", ")
                ),
            });
        }
        copies.extend(found);
    }
    for from in copies {
        // Through the storage layer: beside a bucket's checkpoint, the file may stand
        // for an object not yet fetched.
        let bytes = ckpt_core::read_file(&from)?;
        if let Some(name) = from.file_name() {
            write_file_atomic(&dir.join(name), &bytes)?;
        }
    }
    Ok(())
}

/// Parses a size such as `5GB`, `500MB`, `2GiB` or `1000`.
///
/// # Errors
/// Text that is not a size.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a size like 5GB"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        u => return Err(format!("unknown size unit `{u}` in `{text}`")),
    };
    Ok((n * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_core::Dtype;

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

    #[test]
    fn sizes() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert!(parse_size("5XB").is_err());
    }
}
