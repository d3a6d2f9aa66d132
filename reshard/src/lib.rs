//! ckpt-reshard: from the training strategy to any predict strategy, M ranks to N.
//!
//! This crate only derives the target strategy and the files of each target rank;
//! ckpt-core's [`CopyPlan`] (box intersection) and [`execute`] do the copying, the same
//! engine merge uses.

use ckpt_core::{
    check_output_outside_inputs, copy_carried, execute, rank_metadata, rank_tensors,
    write_file_atomic, Checkpoint, CopyPlan, CopyStats, Error, Mesh, Result, Selection, StagedDir,
    Strategy, TargetFile, MODEL_FILE, STRATEGY_FILE,
};
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
}

/// Which target ranks to build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ranks {
    /// All of them.
    #[default]
    All,
    /// Only this one (partitioned work across machines).
    One(u64),
}

/// How the target ranks' files are laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputFormat {
    /// `OUT/ckpt_<r>/model.safetensors` with `strategy.json` in each (ckpt's own).
    #[default]
    Ranks,
    /// PyTorch DCP's sharded safetensors, flat: `OUT/shard-<r+1>-model-00001-of-00001.safetensors`,
    /// loadable by `torch.distributed.checkpoint.HuggingFaceStorageReader(OUT)`.
    Dcp,
}

impl OutputFormat {
    /// The file of target rank `r`.
    #[must_use]
    pub fn file(self, r: u64) -> PathBuf {
        match self {
            OutputFormat::Ranks => Path::new(&format!("ckpt_{r}")).join(MODEL_FILE),
            // PyTorch numbers shards from 1.
            OutputFormat::Dcp => PathBuf::from(format!(
                "shard-{:05}-model-00001-of-00001.safetensors",
                r + 1
            )),
        }
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
}

/// Reads the rank of this process from launcher variables: Open MPI, PMI (MPICH,
/// Slurm's PMI), Slurm, torchrun. `None` when none is set.
#[must_use]
pub fn rank_from_env() -> Option<u64> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The strategy the request asks for, derived from the source's.
///
/// # Errors
/// `--to`/`--mesh` without a source strategy, unknown axes, invalid layouts.
pub fn target_strategy(
    source: &Checkpoint,
    target: &Target,
    selection: &Selection,
) -> Result<Strategy> {
    let mut strategy = match target {
        Target::Strategy(s) => s.clone(),
        Target::To(_) | Target::Mesh(_) => {
            let src = source.strategy.as_ref().ok_or_else(|| Error::Unsupported {
                problem: "--to and --mesh resize the source's strategy, and this source has none (integrated or DCP): give --strategy".into(),
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
                            mesh: old.to_string(),
                            problem: format!(
                                "--mesh names axis `{name}`, which the source mesh does not have"
                            ),
                        })?;
                        sizes[i].1 = *size;
                    }
                }
                Target::Strategy(_) => unreachable!("handled above"),
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
    Ok(strategy)
}

/// The plan for the requested ranks.
///
/// # Errors
/// See [`CopyPlan::build`].
pub fn plan(
    source: &Checkpoint,
    strategy: &Strategy,
    ranks: Ranks,
    keep_all: bool,
    format: OutputFormat,
) -> Result<CopyPlan> {
    let world = strategy.mesh.world_size();
    let list: Vec<u64> = match ranks {
        Ranks::All => (0..world).collect(),
        Ranks::One(r) if r < world => vec![r],
        Ranks::One(r) => {
            return Err(Error::Unsupported {
                problem: format!("--rank {r} but the target has {world} ranks"),
            })
        }
    };
    let files = list
        .into_iter()
        .map(|r| {
            let tensors = rank_tensors(strategy, r, keep_all, &|_, l| Some(l.dtype));
            if format == OutputFormat::Dcp {
                if let Some(t) = tensors.iter().find(|t| t.pieces.len() > 1) {
                    return Err(Error::Unsupported {
                        problem: format!(
                            "tensor `{}`: rank {r} holds it as {} boxes (a blocked shard) and PyTorch DCP stores one box per tensor: use blocks=1 in the target strategy or --exclude it",
                            t.name,
                            t.pieces.len()
                        ),
                    });
                }
            }
            Ok(TargetFile { path: format.file(r), metadata: rank_metadata(strategy, r, &tensors), tensors })
        })
        .collect::<Result<Vec<_>>>()?;
    CopyPlan::build(source, files)
}

/// Opens the source and derives the target strategy and plan (for `--plan`).
///
/// # Errors
/// Any input problem.
pub fn prepare(req: &ReshardRequest) -> Result<(Checkpoint, Strategy, CopyPlan)> {
    let source = Checkpoint::open(&req.inputs)?;
    let strategy = target_strategy(&source, &req.target, &req.selection)?;
    let plan = plan(&source, &strategy, req.ranks, req.keep_all, req.format)?;
    Ok((source, strategy, plan))
}

/// Reshards: checks everything, then writes the output atomically (the whole output
/// directory, or with one rank, that rank's directory inside it).
///
/// # Errors
/// Any input problem (nothing is written then), an existing output without `force`,
/// an output inside an input, I/O errors.
pub fn reshard(
    req: &ReshardRequest,
    progress: &(dyn Fn(u64) + Sync),
    on_plan: &dyn Fn(&CopyPlan),
) -> Result<CopyStats> {
    check_output_outside_inputs(&req.output, &req.inputs)?;
    // What appears atomically: the whole output, or with one rank that rank's directory
    // (ckpt layout) or file (DCP layout, written atomically by the file writer).
    let staged_path = match (req.ranks, req.format) {
        (Ranks::All, _) => Some(req.output.clone()),
        (Ranks::One(r), OutputFormat::Ranks) => Some(req.output.join(format!("ckpt_{r}"))),
        (Ranks::One(_), OutputFormat::Dcp) => None,
    };
    let exists = match (&staged_path, req.ranks) {
        (Some(p), _) => p.clone(),
        (None, Ranks::One(r)) => req.output.join(req.format.file(r)),
        (None, Ranks::All) => unreachable!("all ranks are always staged"),
    };
    if exists.exists() && !req.force {
        return Err(Error::OutputExists { path: exists });
    }
    let (source, strategy, mut plan) = prepare(req)?;
    on_plan(&plan);
    let json = strategy.to_json();
    let staged = staged_path
        .as_deref()
        .map(|p| StagedDir::new(p, req.force))
        .transpose()?;
    let root = match &staged {
        Some(s) => s.path().to_path_buf(),
        None => {
            std::fs::create_dir_all(&req.output).map_err(|source| Error::Io {
                path: req.output.clone(),
                source,
            })?;
            req.output.clone()
        }
    };
    // A single rank's directory is staged on its own: its file lands at the top of it.
    if let (Ranks::One(_), OutputFormat::Ranks) = (req.ranks, req.format) {
        for f in &mut plan.files {
            f.path = PathBuf::from(MODEL_FILE);
        }
    }
    let stats = execute(&plan, &source, &root, progress)?;
    let rank_dirs: Vec<PathBuf> = match (req.ranks, req.format) {
        (_, OutputFormat::Dcp) => vec![],
        (Ranks::All, OutputFormat::Ranks) => (0..strategy.mesh.world_size())
            .map(|r| root.join(format!("ckpt_{r}")))
            .collect(),
        (Ranks::One(_), OutputFormat::Ranks) => vec![root.clone()],
    };
    for d in &rank_dirs {
        std::fs::create_dir_all(d).map_err(|source| Error::Io {
            path: d.clone(),
            source,
        })?;
        write_file_atomic(&d.join(STRATEGY_FILE), json.as_bytes())?;
        copy_carried(&source.carried, d)?;
    }
    if req.ranks == Ranks::All || req.format == OutputFormat::Dcp {
        write_file_atomic(&root.join(STRATEGY_FILE), json.as_bytes())?;
        copy_carried(&source.carried, &root)?;
    }
    if let Some(s) = staged {
        s.commit()?;
    }
    if let (Ranks::One(_), OutputFormat::Ranks) = (req.ranks, req.format) {
        // The shared top-level strategy, written by whichever rank gets there (same bytes).
        write_file_atomic(&req.output.join(STRATEGY_FILE), json.as_bytes())?;
    }
    Ok(stats)
}
