//! ckpt-reshard: from the training strategy to any predict strategy, M ranks to N.
//!
//! This crate only derives the target strategy and chooses the writer of the output's
//! format (ckpt-core's [`Writer`]s: the strategy is their constructor's argument);
//! ckpt-core's [`CopyPlan`] (box intersection) and [`execute_with`] do the copying, the
//! same engine merge uses.

use ckpt_core::checkpoint::Computations;
use ckpt_core::engine::copy::{execute_with, CopyStats};
use ckpt_core::formats::ckptz::Compression;
use ckpt_core::formats::output::{check_output_outside_inputs, StagedDir};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::plan::CopyPlan;
use ckpt_core::layout::select::Selection;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::{Placement, TensorLayout};
use ckpt_core::write::dcp::Dcp;
use ckpt_core::write::megatron::MegatronLegacy;
use ckpt_core::write::megatron_bridge::MegatronBridge;
use ckpt_core::write::megatron_dist::MegatronDist;
use ckpt_core::write::nemo2::Nemo2;
use ckpt_core::write::orbax::OrbaxStep;
use ckpt_core::write::ranks::RankOptions;
pub use ckpt_core::write::ranks::{Ranks, MAX_TARGET_RANKS};
use ckpt_core::write::sliced::Sliced;
use ckpt_core::write::{TargetLayout, Writer};
use ckpt_core::{Checkpoint, Error, Result};
use std::path::{Path, PathBuf};

/// The target layout, as the user gives it.
#[derive(Clone, Debug)]
pub enum Target {
    /// Keep every placement; the innermost mesh axis becomes `N`, the others 1.
    To(u64),
    /// New sizes for the named axes.
    Mesh(Vec<(String, u64)>),
    /// A whole target strategy.
    Strategy(Strategy),
    /// A MindSpore (predict) strategy file's layouts, shapes taken from the source.
    MindSpore(
        std::collections::BTreeMap<String, ckpt_core::formats::mindspore_strategy::MindSporeParam>,
    ),
}

impl Target {
    /// The target a strategy file gives: ckpt's JSON strategy, or a MindSpore (predict)
    /// strategy file (protobuf or its JSON form), told apart by content.
    ///
    /// # Errors
    /// The file cannot be read; it is neither kind of strategy, or an invalid one.
    pub fn from_strategy_file(path: &Path) -> Result<Target> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(
            if ckpt_core::formats::mindspore_strategy::looks_like(&bytes) {
                Target::MindSpore(
                    ckpt_core::formats::mindspore_strategy::read_mindspore_strategies(&[path])?,
                )
            } else {
                Target::Strategy(Strategy::read(path)?)
            },
        )
    }

    /// The target a mesh specification gives (`pp=1,tp=2`): new sizes for its axes.
    ///
    /// # Errors
    /// An invalid specification.
    pub fn from_mesh(spec: &str) -> Result<Target> {
        let mesh = Mesh::parse(spec)?;
        Ok(Target::Mesh(
            mesh.axes()
                .iter()
                .map(|x| (x.name.clone(), x.size))
                .collect(),
        ))
    }
}

/// How the target ranks' files are laid out: each format is one of ckpt-core's
/// [`Writer`]s (chosen by the constructor table, `writer`), but DeepSpeed's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputFormat {
    /// `OUT/ckpt_<r>/model.safetensors` with `strategy.json` in each (ckpt's own).
    #[default]
    Ranks,
    /// PyTorch DCP's sharded safetensors, flat: `OUT/shard-<r+1>-model-00001-of-00001.safetensors`,
    /// loadable by `torch.distributed.checkpoint.HuggingFaceStorageReader(OUT)`.
    Dcp,
    /// MindSpore's per-rank layout: `OUT/rank_<r>/checkpoint_<r>.ckpt` (protobuf, as
    /// `mindspore.save_checkpoint` writes it), with ckpt's `strategy.json` beside.
    MindSpore,
    /// PyTorch DCP's default format: `OUT/__<r>_0.distcp` (one `torch.save` archive per
    /// chunk) and `OUT/.metadata`, loadable by `torch.distributed.checkpoint.load`.
    Distcp,
    /// A Megatron legacy checkpoint (from a Megatron legacy source, whose args it
    /// carries): `OUT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt` and
    /// `OUT/latest_checkpointed_iteration.txt`.
    Megatron,
    /// A megatron-core dist_ckpt (`torch_dist`, from a Megatron legacy source or a
    /// Hugging Face model): `OUT/<iter_NNNNNNN|release>/` with `__<r>_0.distcp`,
    /// `.metadata`, `common.pt` and `metadata.json`, and
    /// `OUT/latest_checkpointed_iteration.txt`, loadable by megatron-core's
    /// `dist_checkpointing.load`.
    MegatronDist,
    /// A Hugging Face Llama or Qwen2 as Megatron-Bridge's `AutoBridge.import_ckpt` saves it (the
    /// dist_ckpt in `OUT/iter_0000000/` with `run_config.yaml`, `train_state.pt` and
    /// `tokenizer/`, `OUT/latest_train_state.pt` and `OUT/latest_checkpointed_iteration.txt`),
    /// what Bridge's `load_checkpoint` starts training from.
    MegatronBridge,
    /// A Hugging Face Llama or Qwen2 as NeMo 2's `llm.import_ckpt` saves it (`OUT/weights/`,
    /// the dist_ckpt under NeMo's `module.` prefix with its `common.pt`, and
    /// `OUT/context/` with fiddle's `io.json`, `model.yaml` and `nemo_tokenizer/`), what
    /// NeMo's `load_context` and `RestoreConfig(path=OUT)` start from.
    Nemo2,
    /// PyTorch DCP's default format in torchtitan's names (from a Hugging Face Llama
    /// and its config.json): what torchtitan's `CheckpointManager` loads as a
    /// model-only checkpoint (`initial_load_path`).
    Torchtitan,
    /// A DeepSpeed ZeRO-1/2 checkpoint for `--to N` data-parallel ranks (from a
    /// DeepSpeed source): `OUT/latest`, `OUT/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt`
    /// and `OUT/<tag>/mp_rank_00_model_states.pt`, loadable by DeepSpeed's
    /// `engine.load_checkpoint` on N ranks ([`reshard_deepspeed`]).
    DeepSpeed,
    /// An Orbax step directory (`OUT/_CHECKPOINT_METADATA`, `OUT/default/` with the
    /// arrays in OCDBT + zarr v3 and `_sharding`), each array a `jax.Array` sharded on
    /// the target mesh as a `NamedSharding`, each device's box one chunk: what
    /// orbax-checkpoint restores without a target and onto a JAX mesh.
    Orbax,
    /// MaxText's scanned parameter tree (from a Hugging Face Llama, Mistral or Qwen3
    /// and its config.json) as an Orbax step with MaxText's item `items`: what
    /// MaxText's `load_parameters_path=OUT/items` restores.
    MaxText,
}

/// `--format dcp`, the old name of `dcp-safetensors` (DCP's sharded safetensors), still
/// read as it: said to the user, since DCP's default format is `distcp`.
pub const OLD_DCP_NAME: &str = "dcp";

/// What `--format dcp` means now, said on stderr when it is given.
pub const OLD_DCP_NOTE: &str = "--format dcp is read as --format dcp-safetensors (PyTorch DCP's sharded safetensors, for torch's HuggingFaceStorageReader); DCP's default format (__<r>_0.distcp + .metadata, for torch.distributed.checkpoint.load) is --format distcp";

impl OutputFormat {
    /// Every format by the name the CLI and the Python package take (`--format`;
    /// `distcp` and `dcp-safetensors` are PyTorch's two DCP layouts, `dcp` the old name
    /// of the second, [`OLD_DCP_NAME`]).
    pub const NAMES: [(&'static str, OutputFormat); 13] = [
        ("ckpt", OutputFormat::Ranks),
        ("dcp-safetensors", OutputFormat::Dcp),
        ("distcp", OutputFormat::Distcp),
        ("mindspore", OutputFormat::MindSpore),
        ("megatron", OutputFormat::Megatron),
        ("megatron-dist", OutputFormat::MegatronDist),
        ("megatron-bridge", OutputFormat::MegatronBridge),
        ("nemo2", OutputFormat::Nemo2),
        ("torchtitan", OutputFormat::Torchtitan),
        ("deepspeed", OutputFormat::DeepSpeed),
        ("orbax", OutputFormat::Orbax),
        ("maxtext", OutputFormat::MaxText),
        // The old name of `dcp-safetensors`, kept: it reads as either DCP format.
        (OLD_DCP_NAME, OutputFormat::Dcp),
    ];

    /// The format named `name` ([`OutputFormat::NAMES`]).
    pub fn from_name(name: &str) -> Option<OutputFormat> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, f)| f)
    }
}

/// What to reshard and how.
#[derive(Clone, Debug)]
pub struct ReshardRequest {
    /// Rank directories, a DCP directory or an integrated checkpoint.
    pub inputs: Vec<PathBuf>,
    /// The output directory.
    pub output: PathBuf,
    /// The target layout.
    pub target: Target,
    /// Which ranks to build.
    pub ranks: Ranks,
    /// Tensor selection and casting.
    pub selection: Selection,
    /// Write replicated tensors on every rank, not only their owner.
    pub keep_all: bool,
    /// Replace an existing output.
    pub force: bool,
    /// The layout of the output files.
    pub format: OutputFormat,
    /// For `--to N` on a source without a strategy (one whole copy): `(glob, dim)`
    /// rules, the first match splits that dim over the N ranks; unmatched tensors are
    /// replicated.
    pub shard: Vec<(String, usize)>,
    /// Write compressed `.ckptz` rank files (`ckpt_<r>/model.ckptz`); ckpt's own layout
    /// only.
    pub compression: Option<Compression>,
    /// What is computed on the way: LoRA adapters merged (and FP8 dequantization,
    /// which `selection`'s cast asks for).
    pub computations: Computations,
    /// `--format orbax`: the item directory's name in the step (`None`: orbax's
    /// `default`); `--format maxtext` writes MaxText's `items`.
    pub orbax_item: Option<String>,
    /// `--format maxtext`: MaxText's unscanned tree (`decoder.layers_<l>.*`, each
    /// layer its own arrays: `scan_layers=False`) instead of the scanned one.
    pub maxtext_unscanned: bool,
}

/// The dimension a tensor's pieces divide, for sources that record pieces but no
/// strategy (PyTorch DCP): the one with the most distinct piece starts (the first of
/// equals, so FSDP's dim-0 shard wins over a TP split of a 2-D mesh). `None` for a
/// tensor stored whole.
fn split_dim(t: &ckpt_core::layout::source::SourceTensor) -> Option<usize> {
    (0..t.shape.len())
        .map(|d| {
            let starts: std::collections::BTreeSet<u64> =
                t.pieces.iter().map(|p| p.global.start[d]).collect();
            (starts.len(), std::cmp::Reverse(d))
        })
        .max()
        .filter(|&(n, _)| n > 1)
        .map(|(_, std::cmp::Reverse(d))| d)
}

/// Whether any tensor of a source without a strategy is stored in pieces.
fn is_split(source: &Checkpoint) -> bool {
    source.tensors.values().any(|t| split_dim(t).is_some())
}

/// The strategy the request asks for, derived from the source's.
///
/// # Errors
/// `--to`/`--mesh` without a source strategy, unknown axes, invalid layouts.
pub fn target_strategy(
    source: &Checkpoint,
    target: &Target,
    selection: &Selection,
    shard: &[(String, usize)],
) -> Result<Strategy> {
    let mut strategy = match target {
        Target::Strategy(s) => s.clone(),
        Target::To(k) if source.strategy.is_none() && (!shard.is_empty() || is_split(source)) => {
            let rules = shard
                .iter()
                .map(|(g, d)| Ok((Selection::new(std::slice::from_ref(g), &[], None)?, *d, g)))
                .collect::<Result<Vec<_>>>()?;
            let mut s = Strategy::new(Mesh::new(vec![("tp".to_string(), *k)])?);
            for (name, t) in &source.tensors {
                let placement = match rules.iter().find(|(sel, _, _)| sel.keeps(name)) {
                    Some(&(_, dim, _)) if dim < t.shape.len() => Placement::shard(dim),
                    Some((_, dim, glob)) => {
                        return Err(Error::Unsupported {
                            problem: format!(
                                "--shard {glob}={dim}: tensor `{name}` has {} dimension(s)",
                                t.shape.len()
                            ),
                        })
                    }
                    None => match split_dim(t) {
                        Some(dim) => Placement::shard(dim),
                        None => Placement::Replicate,
                    },
                };
                s.insert(
                    name.clone(),
                    TensorLayout::new(t.shape.clone(), t.dtype, vec![placement]),
                )?;
            }
            s
        }
        Target::MindSpore(params) => {
            ckpt_core::formats::mindspore_strategy::mindspore_target_strategy(params, source)?
        }
        Target::To(_) | Target::Mesh(_) => {
            let src = source.strategy.as_ref().ok_or_else(|| Error::Unsupported {
                problem: "--to and --mesh resize the source's strategy, and this source has none (integrated or DCP): give --strategy, or --shard NAME_GLOB=DIM rules for a whole copy (--mesh needs the source's mesh axes: use --to N on a DCP source)".into(),
            })?;
            let old = &src.mesh;
            let n = old.axes().len();
            let mut sizes: Vec<(String, u64)> = old
                .axes()
                .iter()
                .map(|a| (a.name.clone(), a.size))
                .collect();
            match target {
                Target::To(k) => {
                    for (i, s) in sizes.iter_mut().enumerate() {
                        s.1 = if i + 1 == n { *k } else { 1 };
                    }
                }
                Target::Mesh(m) => {
                    for (name, size) in m {
                        let i = old.axis_index(name).ok_or_else(|| Error::InvalidMesh {
                            mesh: m
                                .iter()
                                .map(|(n, s)| format!("{n}={s}"))
                                .collect::<Vec<_>>()
                                .join(","),
                            problem: format!(
                                "axis `{name}` is not an axis of the source mesh {old}"
                            ),
                        })?;
                        sizes[i].1 = *size;
                    }
                }
                Target::Strategy(_) | Target::MindSpore(_) => unreachable!("handled above"),
            }
            let mut mesh = Mesh::new(sizes)?;
            if let Some(p) = old.pipeline() {
                mesh = mesh.with_pipeline(&old.axes()[p].name)?;
            }
            let mut s = Strategy::new(mesh.clone());
            for (name, l) in &src.tensors {
                let mut l = l.clone();
                // Stages map proportionally onto a resized pipeline axis (PP=2 to 1: all 0).
                if let (Some(p), Some(st)) = (old.pipeline(), l.stage) {
                    l.stage = Some(st * mesh.axes()[p].size / old.axes()[p].size);
                }
                s.insert(name.clone(), l)?;
            }
            s
        }
    };
    // Selection and casting apply to the target too.
    let names: Vec<String> = strategy.tensors.keys().cloned().collect();
    for name in names {
        if !selection.keeps(&name) {
            strategy.tensors.remove(&name);
            continue;
        }
        if let Some(l) = strategy.tensors.get_mut(&name) {
            l.dtype = selection.dtype(
                &name,
                source.tensors.get(&name).map_or(l.dtype, |t| t.dtype),
            )?;
        }
    }
    // A target strategy that does not place some of the source's tensors would drop
    // them (optimizer state with them) without a word: they must be excluded by name.
    let unplaced: Vec<&str> = source
        .tensors
        .keys()
        .filter(|n| !strategy.tensors.contains_key(*n))
        .map(String::as_str)
        .collect();
    if !unplaced.is_empty() {
        let shown: Vec<String> = unplaced.iter().take(5).map(|n| format!("`{n}`")).collect();
        let more = match unplaced.len() {
            n if n > 5 => format!(" and {} more", n - 5),
            _ => String::new(),
        };
        return Err(Error::Unsupported {
            problem: format!(
                "the target strategy does not place {} tensor(s) of the source: {}{more}; add them to the strategy, or leave them out with --exclude",
                unplaced.len(),
                shown.join(", ")
            ),
        });
    }
    Ok(strategy)
}

/// The request's target, as the writers that lay part of it out ask it.
impl TargetLayout for ReshardRequest {
    fn strategy(&self, source: &Checkpoint, laid_out: Option<Strategy>) -> Result<Strategy> {
        match laid_out {
            Some(s) => target_strategy(source, &Target::Strategy(s), &self.selection, &self.shard),
            None => target_strategy(source, &self.target, &self.selection, &self.shard),
        }
    }

    fn grid(&self) -> Option<Vec<(String, u64)>> {
        match &self.target {
            Target::Mesh(m) => Some(m.clone()),
            Target::To(k) => Some(vec![("tp".into(), *k), ("pp".into(), 1)]),
            Target::Strategy(_) | Target::MindSpore(_) => None,
        }
    }
}

/// The writer of `req.format` for `source` (the constructor table): the target strategy
/// derived from the request, for the formats that see the source in their framework's
/// names or lay out part of the target by its rules, by the writer from `req`.
fn writer(req: &ReshardRequest, source: &mut Checkpoint) -> Result<Box<dyn Writer>> {
    let options = RankOptions {
        ranks: req.ranks,
        keep_all: req.keep_all,
        compression: req.compression,
    };
    let strategy = |source: &Checkpoint| req.strategy(source, None);
    Ok(match req.format {
        OutputFormat::Ranks => Box::new(Sliced::ckpt(strategy(source)?, options)),
        OutputFormat::MindSpore => Box::new(Sliced::mindspore(strategy(source)?, options)?),
        OutputFormat::Dcp => Box::new(Dcp::safetensors(strategy(source)?, options)?),
        OutputFormat::Distcp => Box::new(Dcp::distcp(strategy(source)?, options)?),
        OutputFormat::Torchtitan => Box::new(Dcp::torchtitan(source, req, options)?),
        OutputFormat::Megatron => Box::new(MegatronLegacy::new(source, req, options)?),
        OutputFormat::MegatronDist => Box::new(MegatronDist::new(source, req, options)?),
        OutputFormat::MegatronBridge => Box::new(MegatronBridge::new(
            source,
            req,
            options,
            &req.output,
        )?),
        OutputFormat::Nemo2 => Box::new(Nemo2::new(source, req, options)?),
        OutputFormat::Orbax => Box::new(OrbaxStep::sharded(
            strategy(source)?,
            options,
            req.orbax_item.clone(),
        )?),
        OutputFormat::MaxText => Box::new(OrbaxStep::maxtext(
            source,
            req,
            options,
            req.maxtext_unscanned,
        )?),
        OutputFormat::DeepSpeed => {
            return Err(Error::Unsupported {
                problem: "--format deepspeed re-cuts DeepSpeed's flat partitions directly: it has no copy plan to show (--plan)".into(),
            })
        }
    })
}

/// Opens the source and derives the target strategy and plan (for `--plan`).
///
/// # Errors
/// Any input problem.
pub fn prepare(req: &ReshardRequest) -> Result<(Checkpoint, Strategy, CopyPlan)> {
    let p = prepare_output(req)?;
    let strategy = p
        .writer
        .strategy()
        .cloned()
        .ok_or_else(|| Error::Unsupported {
            problem: format!("--format {} has no target strategy", p.writer.name()),
        })?;
    Ok((p.source, strategy, p.plan))
}

/// What a reshard writes: the source, the writer of the output's format, its plan, and
/// the selection as the writer takes it.
struct Prepared {
    source: Checkpoint,
    writer: Box<dyn Writer>,
    plan: CopyPlan,
    selection: Selection,
}

fn prepare_output(req: &ReshardRequest) -> Result<Prepared> {
    let mut source = Checkpoint::open_selected(&req.inputs, &req.selection)?;
    if let Some(e) = source.no_tensors() {
        return Err(e);
    }
    if req.computations.quantize_fp8 {
        return Err(Error::Unsupported {
            problem: "--quantize fp8 is a merge's (its scale tensors have no place in the target strategy): quantize the merged model, then reshard it".into(),
        });
    }
    // Computed tensors keep their shapes and names, so the target derives as before.
    let selection = source.compute(&req.computations, &req.selection)?;
    let req = &ReshardRequest {
        selection: selection.clone(),
        ..req.clone()
    };
    let writer = writer(req, &mut source)?;
    let plan = writer.plan(&source, &selection)?;
    Ok(Prepared {
        source,
        writer,
        plan,
        selection,
    })
}

/// The directory of the output a file of the plan sits in (a rank directory), which a
/// process writing some ranks publishes whole; `None` for a file at the top.
fn part_of(file: &Path) -> Option<&Path> {
    file.parent().filter(|p| !p.as_os_str().is_empty())
}

/// Reshards: checks everything, then writes. With all ranks, the whole output appears
/// atomically; otherwise each target rank's directory (ckpt layout) or file (DCP layout)
/// does, so processes sharing one output never see each other's partial work.
///
/// # Errors
/// Any input problem (nothing is written then), an existing output without `force`,
/// an output inside an input, I/O errors.
pub fn reshard(
    req: &ReshardRequest,
    progress: &(dyn Fn(u64) + Sync),
    on_plan: &dyn Fn(&Checkpoint, &CopyPlan),
) -> Result<CopyStats> {
    check_output_outside_inputs(&req.output, &req.inputs)?;
    if req.ranks == Ranks::All && req.output.exists() && !req.force {
        return Err(Error::OutputExists {
            path: req.output.clone(),
        });
    }
    // Every target rank's plan is checked before anything is written.
    let Prepared {
        mut source,
        writer,
        plan,
        selection,
    } = prepare_output(req)?;
    on_plan(&source, &plan);
    source.release_pieces();
    let compression = writer.compression();
    if req.ranks == Ranks::All {
        let staged = StagedDir::new(&req.output, req.force)?;
        let stats = execute_with(&plan, &source, staged.path(), progress, compression)?;
        writer.finish(&source, &selection, &plan, staged.path())?;
        staged.commit()?;
        return Ok(stats);
    }
    for f in &plan.files {
        let p = req.output.join(part_of(&f.path).unwrap_or(&f.path));
        if p.exists() && !req.force {
            return Err(Error::OutputExists { path: p });
        }
    }
    let mut stats = CopyStats::default();
    let mut loose = CopyPlan { files: Vec::new() };
    for mut one in plan.files {
        match part_of(&one.path).map(Path::to_path_buf) {
            Some(dir) => {
                let staged = StagedDir::new(&req.output.join(&dir), req.force)?;
                one.path = one
                    .path
                    .strip_prefix(&dir)
                    .unwrap_or(&one.path)
                    .to_path_buf();
                stats += execute_with(
                    &CopyPlan { files: vec![one] },
                    &source,
                    staged.path(),
                    progress,
                    compression,
                )?;
                writer.finish_part(&source, staged.path())?;
                staged.commit()?;
            }
            // The file writer is atomic on its own.
            None => {
                std::fs::create_dir_all(&req.output).map_err(|source| Error::Io {
                    path: req.output.clone(),
                    source,
                })?;
                let single = CopyPlan { files: vec![one] };
                stats += execute_with(&single, &source, &req.output, progress, compression)?;
                loose.files.extend(single.files);
            }
        }
    }
    // The shared top-level files (strategy, DCP metadata), written by every process
    // (same bytes, atomically).
    writer.finish(&source, &selection, &loose, &req.output)?;
    Ok(stats)
}

/// `--format deepspeed`: the DeepSpeed ZeRO-1/2 checkpoint given as the one input,
/// written for the data-parallel size `--to N` (or `--mesh dp=N`; a mixture of experts
/// also at the EP size `--mesh dp=N,ep=K` asks, else at its own) asks, every rank at
/// once, whole tensors only (no selection, casting or compression: DeepSpeed loads the
/// optimizer state of every parameter it trains).
///
/// # Errors
/// A request that is not one DeepSpeed input and a dp size; what
/// [`ckpt_core::write::deepspeed::write_deepspeed_dp`] refuses.
pub fn reshard_deepspeed(
    req: &ReshardRequest,
) -> Result<ckpt_core::formats::deepspeed_write::DeepSpeedWriteStats> {
    let usage = |p: &str| Error::Unsupported {
        problem: format!("--format deepspeed: {p}"),
    };
    check_output_outside_inputs(&req.output, &req.inputs)?;
    // The new data-parallel size, and for a mixture of experts the new EP size.
    let sizes = match &req.target {
        Target::To(n) => Some((*n, None)),
        Target::Mesh(axes) => {
            let size = |name: &str| axes.iter().find(|(n, _)| n == name).map(|(_, s)| *s);
            match (size("dp"), size("ep")) {
                (Some(dp), ep) if axes.iter().all(|(n, _)| n == "dp" || n == "ep") => {
                    Some((dp, ep))
                }
                _ => None,
            }
        }
        _ => None,
    };
    let Some((dp, ep)) = sizes else {
        return Err(usage(
            "give the new data-parallel size as --to N or --mesh dp=N (and for a mixture of experts --mesh dp=N,ep=K)",
        ));
    };
    let [input] = &req.inputs[..] else {
        return Err(usage("one DeepSpeed checkpoint directory as the input"));
    };
    if req.ranks != Ranks::All {
        return Err(usage("every rank is written at once (no --rank)"));
    }
    if req.compression.is_some() || !req.shard.is_empty() || !req.selection.is_everything() {
        return Err(usage(
            "DeepSpeed loads every parameter's optimizer state: no --include/--exclude/--dtype/--compress/--shard/prefixes",
        ));
    }
    ckpt_core::write::deepspeed::write_deepspeed_dp(input, &req.output, dp, ep, req.force)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(rel)
    }

    /// A strategy file is told apart by content: MindSpore's protobuf and its JSON form
    /// (which may be called strategy.json too) against ckpt's own JSON.
    #[test]
    fn a_strategy_file_is_read_as_the_kind_it_is() {
        for ms in ["mindspore/strategy.ckpt", "mindspore/strategy.json"] {
            match Target::from_strategy_file(&fixture(ms)).unwrap() {
                Target::MindSpore(params) => assert!(!params.is_empty(), "{ms}"),
                other => panic!("{ms}: read as {other:?}"),
            }
        }
        let dir = std::env::temp_dir().join(format!("ckpt-target-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ours = dir.join("strategy.json");
        let mut s = Strategy::new(Mesh::parse("tp=2").unwrap());
        s.insert(
            "w".to_string(),
            TensorLayout::new(
                vec![4, 2],
                ckpt_core::layout::Dtype::F32,
                vec![Placement::shard(0)],
            ),
        )
        .unwrap();
        std::fs::write(&ours, s.to_json()).unwrap();
        match Target::from_strategy_file(&ours).unwrap() {
            Target::Strategy(read) => assert_eq!(read.to_json(), s.to_json()),
            other => panic!("read as {other:?}"),
        }
        let missing = dir.join("missing.json");
        let e = Target::from_strategy_file(&missing).unwrap_err();
        assert!(
            matches!(&e, Error::Io { path, .. } if *path == missing),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_mesh_spec_gives_its_axes_or_is_refused() {
        match Target::from_mesh("pp=1,tp=2").unwrap() {
            Target::Mesh(axes) => {
                assert_eq!(axes, vec![("pp".to_string(), 1), ("tp".to_string(), 2)])
            }
            other => panic!("{other:?}"),
        }
        assert!(Target::from_mesh("tp=x").is_err());
    }
}
