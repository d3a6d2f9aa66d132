//! ckpt-merge: per-rank slices into one integrated Hugging Face checkpoint.
//!
//! Merging is resharding to a single rank that holds every tensor whole, so this crate
//! only decides the output files (one `model.safetensors`, or shards of at most
//! `max_shard_size` bytes filled greedily in tensor order with an index); ckpt-core's
//! [`CopyPlan`] and [`execute`] do the copying.

use ckpt_core::checkpoint::{Computations, HfModel, HfTarget};
use ckpt_core::engine::copy::{execute_with, CopyStats};
use ckpt_core::formats::ckptz::Compression;
use ckpt_core::formats::gguf::GgmlType;
use ckpt_core::formats::output::{check_output_outside_inputs, StagedDir};
use ckpt_core::layout::plan::CopyPlan;
use ckpt_core::layout::select::Selection;
use ckpt_core::write::gguf::GgufExport;
use ckpt_core::write::hf::HfExport;
use ckpt_core::write::one_file::OneFile;
use ckpt_core::write::orbax::OrbaxStep;
use ckpt_core::write::safetensors::Integrated;
use ckpt_core::write::ucp::Universal;
use ckpt_core::write::Writer;
use ckpt_core::{Checkpoint, Result};
use std::path::PathBuf;

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
    /// What is computed on the way: LoRA adapters merged, FP8 quantization (and FP8
    /// dequantization, which `selection`'s cast asks for).
    pub computations: Computations,
    /// With [`MergeFormat::Orbax`]: the item directory's name (`default` when `None`).
    pub orbax_item: Option<String>,
    /// With [`MergeFormat::Gguf`]: the ggml type of the weights (`--dtype`: f32, f16,
    /// bf16, q8_0; `None`: the converter's `auto`, BF16 for a BF16 model, else F16).
    pub gguf_type: Option<GgmlType>,
}

/// The tokenizer files `--tokenizer DIR` copies (those transformers' tokenizers save).
pub use ckpt_core::hf::TOKENIZER_FILES;
/// transformers' `save_pretrained` default `max_shard_size`.
pub use ckpt_core::write::hf::HF_MAX_SHARD_SIZE;

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
    /// An Orbax step directory that orbax-checkpoint restores (`_CHECKPOINT_METADATA`,
    /// `commit_success.txt`, `default/` with the tree and the arrays: zarr v3 in an
    /// OCDBT database).
    Orbax,
    /// One GGUF file for llama.cpp, as its `convert_hf_to_gguf.py` writes it (Llama).
    Gguf,
}

impl MergeFormat {
    /// Every format by the name the CLI and the Python package take (`--format`).
    pub const NAMES: [(&'static str, MergeFormat); 7] = [
        ("safetensors", MergeFormat::Safetensors),
        ("hf", MergeFormat::Hf),
        ("mindspore", MergeFormat::MindSpore),
        ("torch", MergeFormat::Torch),
        ("ucp", MergeFormat::Ucp),
        ("orbax", MergeFormat::Orbax),
        ("gguf", MergeFormat::Gguf),
    ];

    /// The format named `name` ([`MergeFormat::NAMES`]).
    pub fn from_name(name: &str) -> Option<MergeFormat> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, f)| f)
    }
}

/// The writer `req.format` names, configured by the request (`hf`: the source seen as
/// the Hugging Face model, for `--format hf`).
fn writer(req: &MergeRequest, hf: Option<HfModel>) -> Result<Box<dyn Writer>> {
    let compressed = req.compression.is_some();
    Ok(match (req.format, hf) {
        (MergeFormat::Hf, Some(model)) => Box::new(HfExport {
            model,
            tokenizer: req.tokenizer.clone(),
            max_shard_size: req.max_shard_size,
        }),
        (MergeFormat::Gguf, Some(model)) => Box::new(GgufExport {
            model,
            out_type: req.gguf_type,
            tokenizer: req.tokenizer.clone(),
        }),
        (MergeFormat::Safetensors | MergeFormat::Hf | MergeFormat::Gguf, _) => {
            Box::new(Integrated {
                max_shard_size: req.max_shard_size,
                one_file: req.one_file,
                compression: req.compression,
            })
        }
        (MergeFormat::Torch, _) => {
            Box::new(OneFile::TORCH.checked(compressed, req.max_shard_size)?)
        }
        (MergeFormat::MindSpore, _) => {
            Box::new(OneFile::MINDSPORE.checked(compressed, req.max_shard_size)?)
        }
        (MergeFormat::Orbax, _) => Box::new(OrbaxStep::checked(
            req.orbax_item.clone(),
            compressed,
            req.max_shard_size,
            req.one_file,
        )?),
        (MergeFormat::Ucp, _) => Box::new(Universal::checked(
            compressed,
            req.max_shard_size,
            req.one_file,
        )?),
    })
}

/// The source as the merge reads it (opened with the selection, refused when it holds
/// no tensors, and, for `--format hf`, seen as the Hugging Face model it becomes), and
/// the writer of the output's format, and the selection as the writer takes it (what
/// is computed in a dtype of its own left out of the cast).
fn open(req: &MergeRequest) -> Result<(Checkpoint, Box<dyn Writer>, Selection)> {
    let mut source = Checkpoint::open_selected(&req.inputs, &req.selection)?;
    if let Some(e) = source.no_tensors() {
        return Err(e);
    }
    let hf = if matches!(req.format, MergeFormat::Hf | MergeFormat::Gguf) {
        if req.compression.is_some()
            || req.one_file
            || req.max_shard_size.is_some() && req.format == MergeFormat::Gguf
        {
            return Err(ckpt_core::Error::Unsupported {
                problem: format!("--format {} writes what {} loads: --compress and --one-file (and, for gguf, --max-shard-size) do not apply", if req.format == MergeFormat::Hf { "hf" } else { "gguf" }, if req.format == MergeFormat::Hf { "transformers" } else { "llama.cpp" }),
            });
        }
        // A PEFT-wrapped model (verl's LoRA shards) becomes the model it stands for.
        source.merge_peft_wrapped(req.computations.lora_alpha)?;
        Some(source.hf_view(&req.hf)?)
    } else {
        None
    };
    // The dtype the model takes where the source says one and --dtype does not.
    let selection = match hf.as_ref().and_then(|m| m.dtype) {
        Some(d) => req.selection.clone().or_cast(d),
        None => req.selection.clone(),
    };
    // On the names the output takes (a Hugging Face model's, for --format hf).
    let selection = source.compute(&req.computations, &selection)?;
    let writer = writer(req, hf)?;
    Ok((source, writer, selection))
}

/// The files of `plan` that share `share` of `count` writes (file `k` when
/// `k % count == share`).
fn share_of(plan: CopyPlan, share: u64, count: u64) -> CopyPlan {
    CopyPlan {
        files: plan
            .files
            .into_iter()
            .enumerate()
            .filter(|(k, _)| *k as u64 % count.max(1) == share)
            .map(|(_, f)| f)
            .collect(),
    }
}

/// Opens the source and plans the merge, writing nothing (`ckpt merge --plan`): with
/// `share`, the output files that process writes.
///
/// # Errors
/// As [`merge`], before anything would be written.
pub fn prepare(req: &MergeRequest) -> Result<(Checkpoint, CopyPlan)> {
    let (source, writer, selection) = open(req)?;
    let mut plan = writer.plan(&source, &selection)?;
    if let Some((share, count)) = req.share {
        plan = share_of(plan, share, count);
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
    let (mut source, writer, selection) = open(req)?;
    let plan = writer.plan(&source, &selection)?;
    let compression = writer.compression();
    let Some((share, count)) = req.share else {
        on_plan(&source, &plan);
        source.release_pieces();
        let staged = StagedDir::new(&req.output, req.force)?;
        let stats = execute_with(&plan, &source, staged.path(), progress, compression)?;
        writer.finish(&source, &selection, &plan, staged.path())?;
        match writer.output_file() {
            Some(name) => staged.commit_file(name)?,
            None => staged.commit()?,
        }
        return Ok(stats);
    };
    if !writer.shares_files() {
        return Err(ckpt_core::Error::Unsupported {
            problem: format!(
                "--format {} writes the whole tree at once (no --rank)",
                writer.name()
            ),
        });
    }
    let mine = share_of(plan.clone(), share, count);
    for f in &mine.files {
        let p = req.output.join(&f.path);
        if p.exists() && !req.force {
            return Err(ckpt_core::Error::OutputExists { path: p });
        }
    }
    on_plan(&source, &mine);
    source.release_pieces();
    std::fs::create_dir_all(&req.output).map_err(|source| ckpt_core::Error::Io {
        path: req.output.clone(),
        source,
    })?;
    let stats = execute_with(&mine, &source, &req.output, progress, compression)?;
    if share == 0 {
        writer.finish(&source, &selection, &plan, &req.output)?;
    }
    Ok(stats)
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

    #[test]
    fn sizes() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert!(parse_size("5XB").is_err());
    }
}
