//! Directory discovery: which files of the paths given belong to the checkpoint. A
//! file is an input as it is; a directory is offered to the rows of [`DIRECTORIES`].
//! A format's own directory (Megatron's, DeepSpeed's, a DCP `.metadata`, a Hugging
//! Face index, ...) is read by the one row that claims it; when two such rows claim
//! the same directory it holds two checkpoints (a merge written into a directory of
//! rank directories, `latest` beside `latest_universal`, ...) and is refused, naming
//! both, because which one is meant is the user's to say. Only where no format claims
//! the directory are its loose files (safetensors, torch.save, ...) read, by the first
//! loose-file row that finds some; a directory nothing claims gets one message for all.
//! What a format's directory holds is decided in the format's own module
//! (`megatron::looks_like`, `mindspore_ckpt::rank_file`, `safetensors::index_shards`,
//! ...); a row only puts its answer into the [`Discovery`].

use super::trainers::{self, TrainerSave};
use crate::error::{Error, Result};
use crate::formats::distcp::{self, DcpMetadata};
use crate::formats::{
    ckptz, deepspeed, list_dir, megatron, mindspore_ckpt, orbax, safetensors, ucp,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Name of a strategy file.
pub const STRATEGY_FILE: &str = "strategy.json";
/// Name of a single-file integrated checkpoint and of a rank's file.
pub const MODEL_FILE: &str = "model.safetensors";
/// Name of a Hugging Face shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The file of an integrated or rank checkpoint written compressed (`--compress`).
pub const COMPRESSED_MODEL_FILE: &str = "model.ckptz";
/// The index of a sharded integrated checkpoint written compressed.
pub const COMPRESSED_INDEX_FILE: &str = "model.ckptz.index.json";
/// Beside an integrated model, the file of its optimizer state (`merge` puts tensors
/// named `optim.*` there, so that model.safetensors holds weights only).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// In a training output directory, the file naming its newest checkpoint.
pub(crate) const LATEST_FILE: &str = "latest";
/// Files carried through from input to output when present: a model's configuration,
/// a trainer's state, and the non-tensor state (optimizer `param_groups`, schedulers,
/// step counters) the Python package's `save_state_dict` writes as JSON.
pub const CARRIED_FILES: [&str; 3] = ["config.json", "trainer_state.json", "non_tensor_state.json"];

/// `dir`'s model file: `model.safetensors`, else `model.ckptz` when that one is there.
fn model_file(dir: &Path) -> PathBuf {
    let plain = dir.join(MODEL_FILE);
    let compressed = dir.join(COMPRESSED_MODEL_FILE);
    if !plain.is_file() && compressed.is_file() {
        compressed
    } else {
        plain
    }
}

/// An input file and what we know of it before reading it.
pub(crate) struct Input {
    pub(crate) path: PathBuf,
    pub(crate) strategy: Option<PathBuf>,
    /// For a `.distcp` file, its directory (whose `.metadata` says what it holds).
    pub(crate) dcp: Option<PathBuf>,
}

/// MindSpore strategy files: given as inputs (`--source-strategy` adds one), or found
/// in the root of a directory of rank directories.
#[derive(Default)]
pub(crate) struct MsStrategies {
    pub(crate) given: Vec<PathBuf>,
    pub(crate) found: BTreeMap<PathBuf, Vec<PathBuf>>,
}

/// What discovering the command line's paths finds.
#[derive(Default)]
pub(crate) struct Discovery {
    pub(crate) inputs: Vec<Input>,
    pub(crate) carried: BTreeMap<String, PathBuf>,
    pub(crate) ms: MsStrategies,
    pub(crate) notes: Vec<String>,
    /// DCP directories' metadata, by directory.
    pub(crate) dcp: BTreeMap<PathBuf, DcpMetadata>,
    /// The training step asked for (`--step`), where the inputs hold several.
    pub(crate) step: Option<u64>,
    /// Whether a row chose among steps by [`Discovery::step`] (else `--step` is refused:
    /// the inputs hold one checkpoint, which may be of another step).
    pub(crate) step_taken: bool,
    /// DeepSpeed tag directories (read whole: their files are pieces of one another).
    pub(crate) deepspeed: Vec<PathBuf>,
    /// DeepSpeed universal checkpoints' tag directories (read whole, as DeepSpeed's).
    pub(crate) ucp: Vec<PathBuf>,
    /// A Megatron legacy checkpoint (save or iteration directory): read on its own.
    pub(crate) megatron: Option<PathBuf>,
    /// Orbax item directories (read whole: their zarr arrays are pieces of one file).
    pub(crate) orbax: Vec<PathBuf>,
    /// Give a Megatron dist_ckpt's stacked layer tensors one tensor a layer
    /// ([`megatron::unstack_layers`]).
    pub(crate) per_layer: bool,
    /// Only the model's tensors are wanted (`Views::model_only`).
    pub(crate) model_only: bool,
    /// A trainer's save, read as a whole ([`trainers`]): its weights are the inputs.
    pub(crate) trainer: Option<TrainerSave>,
    /// The model's sizes the trainer recorded in Megatron's terms, and where.
    pub(crate) record: Option<(megatron::Args, PathBuf)>,
    /// Where the trainer records a LoRA run's rank and alpha (verl's
    /// `lora_train_meta.json`).
    pub(crate) lora_meta: Option<PathBuf>,
}

/// A row of the directory table.
struct DirRow {
    /// What it reads, as the refusal of a directory two rows claim names it.
    what: &'static str,
    /// A format's own directory (claimed by at most one such row), or loose files of a
    /// kind, read only where no format claims the directory.
    own: bool,
    /// Whether the carried files (`config.json`, ...) of a directory it reads are noted.
    carries: bool,
    /// Whether the directory is this row's (cheap, no error: a directory that cannot be
    /// listed is claimed by none and refused by the row that reads it, or as unknown).
    claims: fn(&Path) -> bool,
    /// Adds the directory's files to the [`Discovery`].
    read: fn(&Path, &mut Discovery) -> Result<()>,
    /// What to pass instead to read only this row's checkpoint, where there is one
    /// path that does (the tag directory a pointer file names, the model file).
    alone: Option<fn(&Path) -> Option<PathBuf>>,
}

/// The directory table. Adding a format that is a directory of files is one `claims`
/// and one `read` function in its module and one row here (see docs/architecture.md).
static DIRECTORIES: [DirRow; 14] = [
    DirRow {
        what: "a Megatron legacy checkpoint",
        own: true,
        carries: false,
        claims: megatron::looks_like,
        read: megatron_dir,
        alone: None,
    },
    DirRow {
        what: "a save directory whose `latest` names a checkpoint",
        own: true,
        carries: false,
        claims: has_latest,
        read: training_output,
        alone: Some(latest_target),
    },
    DirRow {
        what: "a DeepSpeed ZeRO checkpoint",
        own: true,
        carries: false,
        claims: deepspeed::looks_like,
        read: deepspeed_dir,
        alone: None,
    },
    DirRow {
        what: "a DeepSpeed universal checkpoint (`latest_universal` or its tag directory)",
        own: true,
        carries: false,
        claims: is_ucp,
        read: ucp_dir,
        alone: Some(universal_target),
    },
    DirRow {
        what: "a ckpt rank directory (model file and strategy.json)",
        own: true,
        carries: true,
        claims: is_ckpt_rank_dir,
        read: ckpt_rank_dir,
        alone: None,
    },
    DirRow {
        what: "rank directories (ckpt_<r>/ or rank_<r>/)",
        own: true,
        carries: true,
        claims: has_rank_dirs,
        read: rank_dirs,
        alone: None,
    },
    DirRow {
        what: "a Hugging Face shard index",
        own: true,
        carries: true,
        claims: has_index,
        read: hf_index,
        alone: None,
    },
    DirRow {
        what: "an integrated model file",
        own: true,
        carries: true,
        claims: is_integrated,
        read: integrated,
        alone: Some(integrated_target),
    },
    DirRow {
        what: "a PyTorch DCP checkpoint (.metadata)",
        own: true,
        carries: true,
        claims: has_dcp_metadata,
        read: dcp_dir,
        alone: None,
    },
    // A CheckpointManager's root and step directories are the trainers' table's
    // (detect/trainers.rs): the step chosen, its item is read here.
    DirRow {
        what: "an Orbax checkpoint (_METADATA, _CHECKPOINT_METADATA)",
        own: true,
        carries: false,
        claims: orbax::claims,
        read: orbax_dir,
        alone: None,
    },
    // Before the loose-file rows: the files beside `.distcp` data (Megatron's
    // `common.pt`) are not the checkpoint, and reading them instead would be silent.
    DirRow {
        what: "PyTorch DCP data without its .metadata",
        own: false,
        carries: true,
        claims: has_distcp_files,
        read: dcp_without_metadata,
        alone: None,
    },
    // Before the loose-file rows: a GGUF is one whole model, never a part of one, so a
    // directory holding one is that file (and one holding several, or other tensor
    // files beside it, is refused: which to read is the user's choice).
    DirRow {
        what: "a GGUF file (*.gguf)",
        own: false,
        carries: false,
        claims: has_gguf_files,
        read: gguf_file,
        alone: None,
    },
    DirRow {
        what: "loose tensor files (*.safetensors, *.ckptz, *.ckpt)",
        own: false,
        carries: true,
        claims: has_loose_files,
        read: loose_files,
        alone: None,
    },
    DirRow {
        what: "torch.save files (*.pth, *.pt, *.bin)",
        own: false,
        carries: true,
        claims: has_torch_files,
        read: torch_files,
        alone: None,
    },
];

pub(crate) fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

/// The rank of a `ckpt_<r>` (ckpt, MindSpore) or `rank_<r>` (MindSpore) directory.
pub(crate) fn rank_dir_number(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    name.strip_prefix("ckpt_")
        .or_else(|| name.strip_prefix("rank_"))?
        .parse()
        .ok()
}

/// Whether `path` is a MindSpore strategy file (by content). Only small files are
/// read whole: a strategy is kilobytes, a checkpoint may be gigabytes.
fn is_ms_strategy(path: &Path) -> bool {
    const MAX_STRATEGY_BYTES: u64 = 64 << 20;
    let Ok(head) = crate::formats::read_head(path, 64) else {
        return false;
    };
    if crate::formats::sniff(&head).is_some() {
        return false;
    }
    if std::fs::metadata(path).map_or(true, |m| m.len() > MAX_STRATEGY_BYTES) {
        return false;
    }
    let Ok(bytes) = crate::formats::read_small(path) else {
        return false;
    };
    crate::formats::mindspore_strategy::looks_like(&bytes)
}

fn note_carried(dir: &Path, carried: &mut BTreeMap<String, PathBuf>) {
    for name in CARRIED_FILES {
        let p = dir.join(name);
        if p.is_file() {
            carried.entry(name.to_string()).or_insert(p);
        }
    }
}

fn has_ext(p: &Path, exts: &[&str]) -> bool {
    p.is_file()
        && p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| exts.contains(&e))
}

impl Discovery {
    /// An empty discovery, for the checkpoint of training step `step` where the inputs
    /// hold several.
    pub(crate) fn new(step: Option<u64>) -> Discovery {
        Discovery {
            step,
            ..Discovery::default()
        }
    }

    /// Adds what `path` holds: a file as it is (a MindSpore strategy file as a
    /// strategy), a directory by the first row of [`DIRECTORIES`] that claims it.
    ///
    /// # Errors
    /// A path that is not there; a directory no row claims or one a row refuses.
    pub(crate) fn add(&mut self, path: &Path) -> Result<()> {
        if path.is_file() && is_ms_strategy(path) {
            self.ms.given.push(path.to_path_buf());
            return Ok(());
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "distcp") {
            let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            if !has_dcp_metadata(&dir) {
                return Err(missing_dcp_metadata(&dir));
            }
            note_carried(&dir, &mut self.carried);
            self.read_dcp(&dir)?;
            self.push(path.to_path_buf(), None, Some(dir));
            return Ok(());
        }
        if path.is_file() {
            let dir = path.parent().unwrap_or(Path::new("."));
            let s = dir.join(STRATEGY_FILE);
            note_carried(dir, &mut self.carried);
            // (A MindSpore JSON strategy may be called strategy.json too: not ckpt's.)
            let strategy = (s.is_file() && !is_ms_strategy(&s)).then_some(s);
            self.push(path.to_path_buf(), strategy, None);
            return Ok(());
        }
        if !path.is_dir() {
            // Say why: absent, a symlink loop, unreadable (the metadata call tells which).
            let why = match std::fs::metadata(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if std::fs::symlink_metadata(path).is_ok() {
                        "a dangling symbolic link".to_string()
                    } else {
                        "no such file or directory".to_string()
                    }
                }
                Err(e) if e.raw_os_error() == Some(40) => "a symbolic link loop".to_string(),
                Err(e) => e.to_string(),
                Ok(_) => "neither a file nor a directory".to_string(),
            };
            return Err(unknown(format!("{}: {why}", path.display())));
        }
        // A trainer's save is read as a whole before any format looks at its files
        // (they hold RNG states and optimizer shards beside the weights).
        if let Some(save) = trainers::find(path, self.step, false)? {
            return self.add_trainer_save(save);
        }
        self.add_format_dir(path)
    }

    /// A directory offered to the formats' rows (a trainer's weights, or any directory
    /// no trainer claims); where none claims it, a trainer's save a few levels below.
    fn add_format_dir(&mut self, path: &Path) -> Result<()> {
        let own: Vec<&DirRow> = DIRECTORIES
            .iter()
            .filter(|r| r.own && (r.claims)(path))
            .collect();
        if let [a, b, ..] = own[..] {
            return Err(two_checkpoints(path, a, b));
        }
        let row = match own.first() {
            Some(row) => Some(*row),
            None => DIRECTORIES.iter().find(|r| !r.own && (r.claims)(path)),
        };
        let Some(row) = row else {
            if let Some(save) = trainers::find(path, self.step, true)? {
                return self.add_trainer_save(save);
            }
            return Err(unknown(format!(
                "{}: no checkpoint here (expected ckpt_<r>/ or rank_<r>/ rank directories, {MODEL_FILE}, {INDEX_FILE}, *.safetensors, *.ckptz, *.ckpt, torch.save *.pth/*.pt/*.bin, a *.gguf, or an Orbax item's _METADATA)",
                path.display()
            )));
        };
        if row.carries {
            note_carried(path, &mut self.carried);
        }
        (row.read)(path, self)
    }

    /// Adds a trainer's save: its weights (offered to the formats' rows, not to the
    /// trainers' again), the model config and tokenizer it kept (carried), and notes
    /// saying which trainer, which step and why.
    fn add_trainer_save(&mut self, save: TrainerSave) -> Result<()> {
        if let Some(other) = &self.trainer {
            return Err(unknown(format!(
                "two trainers' saves given ({} and {}): one at a time",
                other.step_dir.display(),
                save.step_dir.display()
            )));
        }
        self.step_taken |= save.step_taken;
        let c = &save.contents;
        self.notes.push(format!(
            "{} save: {} ({}{})",
            save.trainer,
            save.step_dir.display(),
            save.step.map_or(String::new(), |s| format!("step {s}, ")),
            save.why
        ));
        self.notes.push(match (&c.config, &c.record) {
            (Some(p), _) => format!("model config: {} (kept by the trainer)", p.display()),
            (None, Some((_, p))) => format!(
                "model config: {} (the trainer's record of the model, in Megatron's terms)",
                p.display()
            ),
            (None, None) => format!(
                "model config: no Hugging Face config.json kept by {} (--format hf needs --hf-config)",
                save.trainer
            ),
        });
        self.record = c.record.clone();
        self.lora_meta = c.lora_meta.clone();
        self.notes.extend(c.notes.iter().cloned());
        if let Some(p) = &c.config {
            self.carried.insert("config.json".into(), p.clone());
        }
        for p in &c.tokenizer {
            if let Some(name) = p.file_name().and_then(|n| n.to_str()) {
                self.carried.insert(name.to_string(), p.clone());
            }
        }
        // The step is the trainer's: the formats below read the one checkpoint given.
        let step = self.step.take();
        let weights = c.weights.clone();
        self.trainer = Some(save);
        let added = weights.iter().try_for_each(|w| {
            if w.is_dir() {
                self.add_format_dir(w)
            } else {
                self.add(w)
            }
        });
        self.step = step;
        added
    }

    fn push(&mut self, path: PathBuf, strategy: Option<PathBuf>, dcp: Option<PathBuf>) {
        self.inputs.push(Input {
            path,
            strategy,
            dcp,
        });
    }

    /// The optimizer state `merge` writes beside an integrated model, when present.
    fn push_optimizer_file(&mut self, dir: &Path) {
        let plain = dir.join(OPTIMIZER_FILE);
        // Or compressed (`merge --compress` writes `optimizer.ckptz`).
        let p = if plain.is_file() {
            plain
        } else {
            plain.with_extension(ckptz::EXTENSION)
        };
        if p.is_file() {
            self.push(p, None, None);
        }
    }

    /// Reads a DCP directory's `.metadata` once, noting the values it holds that are
    /// not tensors (ckpt does not carry them).
    fn read_dcp(&mut self, dir: &Path) -> Result<&DcpMetadata> {
        if !self.dcp.contains_key(dir) {
            let mut m = distcp::read_metadata(dir)?;
            self.notes.extend(m.non_tensor_note(dir));
            // Megatron's dist_ckpt: the distributed optimizer's per-bucket state, mapped
            // to the parameters.
            if dir.join(megatron::DIST_METADATA_FILE).is_file() {
                if self.model_only && megatron::dist_ckpt_args(dir)?.is_none() {
                    // megatron-core's own save (Megatron-Bridge, NeMo 2): the buckets'
                    // layout needs args it does not record; the model does not.
                    if let Some(note) = megatron::dist_optim::drop_buckets(dir, &mut m) {
                        self.notes.push(note);
                    }
                }
                megatron::dist_optim::map_buckets(dir, &mut m)?;
                megatron::dist_optim::name_states(dir, &mut m)?;
                if self.per_layer {
                    megatron::unstack_layers(&mut m)?;
                }
            }
            self.dcp.insert(dir.to_path_buf(), m);
        }
        Ok(&self.dcp[dir])
    }
}

/// Two of the formats' own rows claim `path`: refused, naming both and what to pass to
/// read one of them.
fn two_checkpoints(path: &Path, a: &DirRow, b: &DirRow) -> Error {
    let alone = |r: &DirRow| r.alone.and_then(|f| f(path));
    let choice = match (alone(a), alone(b)) {
        (Some(x), Some(y)) => format!("pass {} or {}", x.display(), y.display()),
        (Some(x), None) | (None, Some(x)) => {
            format!("pass {}, or move the other aside", x.display())
        }
        (None, None) => "move one of them aside".to_string(),
    };
    unknown(format!(
        "{}: holds two checkpoints, {} and {}; which one is meant is not ckpt's to guess: {choice}",
        path.display(),
        a.what,
        b.what
    ))
}

/// The directories of `path` named `<prefix><N>` (N a step number, leading zeros
/// allowed), by step.
fn step_dirs(path: &Path, prefixes: &[&str]) -> Result<BTreeMap<u64, PathBuf>> {
    Ok(list_dir(path)?
        .into_iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            let n = prefixes
                .iter()
                .find_map(|pre| name.strip_prefix(pre)?.parse().ok())?;
            Some((n, p))
        })
        .collect())
}

/// The directory of step `step` among `path`'s `<prefix><N>` directories, or the error
/// listing the steps there are.
fn step_dir(path: &Path, step: u64, prefixes: &[&str], spelled: &str) -> Result<PathBuf> {
    let steps = step_dirs(path, prefixes)?;
    steps.get(&step).cloned().ok_or_else(|| {
        unknown(format!(
            "{}: no checkpoint of step {step} ({spelled}); steps here: {}",
            path.display(),
            steps
                .keys()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// A Megatron save directory (its tracker names the newest iteration; `--step` picks
/// `iter_{step:07}` instead) or one iteration's directory (which must be that step).
fn megatron_dir(path: &Path, x: &mut Discovery) -> Result<()> {
    let mut path = path.to_path_buf();
    if let Some(step) = x.step {
        x.step_taken = true;
        const ITER: &str = "iter_";
        if path.join(megatron::TRACKER_FILE).is_file() {
            path = step_dir(&path, step, &[ITER], &format!("{ITER}{step:07}/"))?;
        } else {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let it: Option<u64> = name.strip_prefix(ITER).and_then(|n| n.parse().ok());
            if it != Some(step) {
                return Err(unknown(format!(
                    "{}: --step {step}, but this is the checkpoint of {}: pass the save directory (iter_*/ beside latest_checkpointed_iteration.txt)",
                    path.display(),
                    it.map_or_else(|| format!("`{name}`"), |i| format!("iteration {i}"))
                )));
            }
        }
    }
    // Megatron-LM's `--ckpt-format torch_dist` saves: the iteration the tracker names
    // is a dist_ckpt, read as one.
    let iteration = megatron::iteration_dir(&path)?;
    if iteration.join(megatron::DIST_METADATA_FILE).is_file() {
        return x.add(&iteration);
    }
    if let Some(other) = x.megatron.replace(path.clone()) {
        return Err(unknown(format!(
            "two Megatron checkpoints given ({} and {}): one at a time",
            other.display(),
            path.display()
        )));
    }
    Ok(())
}

fn has_latest(path: &Path) -> bool {
    path.join(LATEST_FILE).is_file()
}

/// The tag directory `latest` names, where it is one.
fn latest_target(path: &Path) -> Option<PathBuf> {
    named_dir(path, &path.join(LATEST_FILE)).ok()
}

/// A training output directory: `latest` names its newest complete checkpoint.
fn training_output(path: &Path, x: &mut Discovery) -> Result<()> {
    x.step_taken |= x.step.is_some();
    match x.step {
        // ckpt's step_<N>/, DeepSpeed's default tag global_step<N>/.
        Some(step) => x.add(&step_dir(
            path,
            step,
            &["step_", "global_step"],
            &format!("step_{step}/ or global_step{step}/"),
        )?),
        None => x.add(&named_dir(path, &path.join(LATEST_FILE))?),
    }
}

/// The directory beside it that a pointer file (`latest`, `latest_universal`) names.
fn named_dir(path: &Path, pointer: &Path) -> Result<PathBuf> {
    let name = String::from_utf8_lossy(&crate::formats::read_small(pointer)?).into_owned();
    let target = path.join(name.trim());
    if name.trim().is_empty() || name.contains('/') || !target.is_dir() {
        return Err(unknown(format!(
            "{}: names `{}`, which is not a checkpoint directory beside it",
            pointer.display(),
            name.trim()
        )));
    }
    Ok(target)
}

/// With `--step N`, a DeepSpeed tag directory must be DeepSpeed's default tag of that
/// step (`global_step<N>`, with `suffix` for a universal one).
fn check_tag(path: &Path, x: &mut Discovery, suffix: &str) -> Result<()> {
    let Some(step) = x.step else {
        return Ok(());
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name != format!("global_step{step}{suffix}") {
        return Err(unknown(format!(
            "{}: --step {step}, but this is the tag `{name}`: pass the save directory, or this tag without --step",
            path.display()
        )));
    }
    x.step_taken = true;
    Ok(())
}

fn deepspeed_dir(path: &Path, x: &mut Discovery) -> Result<()> {
    check_tag(path, x, "")?;
    x.deepspeed.push(path.to_path_buf());
    Ok(())
}

/// A DeepSpeed save directory whose `latest_universal` names a universal checkpoint
/// (ds_to_universal run into the save directory leaves it beside `latest`, possibly
/// naming another step: then the directory holds two checkpoints), or a universal
/// checkpoint's tag directory.
fn is_ucp(path: &Path) -> bool {
    path.join(ucp::LATEST_UNIVERSAL).is_file() || ucp::looks_like(path)
}

fn universal_target(path: &Path) -> Option<PathBuf> {
    named_dir(path, &path.join(ucp::LATEST_UNIVERSAL)).ok()
}

fn ucp_dir(path: &Path, x: &mut Discovery) -> Result<()> {
    let universal = path.join(ucp::LATEST_UNIVERSAL);
    if universal.is_file() {
        let tag = match x.step {
            Some(step) => {
                let tag = path.join(format!("global_step{step}_universal"));
                if !tag.is_dir() {
                    return Err(unknown(format!(
                        "{}: no universal checkpoint of step {step} (global_step{step}_universal/)",
                        path.display()
                    )));
                }
                tag
            }
            None => named_dir(path, &universal)?,
        };
        return x.add(&tag);
    }
    check_tag(path, x, "_universal")?;
    x.ucp.push(path.to_path_buf());
    Ok(())
}

fn is_ckpt_rank_dir(path: &Path) -> bool {
    model_file(path).is_file() && path.join(STRATEGY_FILE).is_file()
}

fn ckpt_rank_dir(path: &Path, x: &mut Discovery) -> Result<()> {
    x.push(model_file(path), Some(path.join(STRATEGY_FILE)), None);
    Ok(())
}

/// The entries of `path` (none where it cannot be listed: the reading row then says why).
fn entries(path: &Path) -> Vec<PathBuf> {
    list_dir(path).unwrap_or_default()
}

fn has_rank_dirs(path: &Path) -> bool {
    entries(path)
        .iter()
        .any(|p| p.is_dir() && rank_dir_number(p).is_some())
}

fn rank_dirs(path: &Path, x: &mut Discovery) -> Result<()> {
    let entries = list_dir(path)?;
    let mut rank_dirs: Vec<(u64, PathBuf)> = entries
        .iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| Some((rank_dir_number(p)?, p.clone())))
        .collect();
    rank_dirs.sort();
    for (_, d) in rank_dirs {
        let own = d.join(STRATEGY_FILE);
        let own = (own.is_file() && !is_ms_strategy(&own)).then_some(own);
        if own.is_some() && model_file(&d).is_file() {
            x.add(&d)?;
        } else if let Some(f) = mindspore_ckpt::rank_file(&d, x.step, &mut x.notes)? {
            x.step_taken |= x.step.is_some();
            // MindSpore's files; with ckpt's strategy.json when ckpt wrote them.
            note_carried(&d, &mut x.carried);
            x.push(f, own, None);
        }
    }
    // MindSpore keeps its strategy files beside the rank directories.
    let strategies: Vec<PathBuf> = entries
        .iter()
        .filter(|p| p.is_file() && is_ms_strategy(p))
        .cloned()
        .collect();
    if !strategies.is_empty() {
        x.ms.found.insert(path.to_path_buf(), strategies);
    }
    Ok(())
}

/// `path`'s shard index: `model.safetensors.index.json`, else the compressed one.
fn index_file(path: &Path) -> Option<PathBuf> {
    [INDEX_FILE, COMPRESSED_INDEX_FILE]
        .iter()
        .map(|name| path.join(name))
        .find(|p| p.is_file())
}

fn has_index(path: &Path) -> bool {
    index_file(path).is_some()
}

fn hf_index(path: &Path, x: &mut Discovery) -> Result<()> {
    let index = index_file(path).unwrap_or_else(|| path.join(INDEX_FILE));
    for f in safetensors::index_shards(path, &index)? {
        x.push(f, None, None);
    }
    x.push_optimizer_file(path);
    Ok(())
}

/// A model file that is not a rank's (no strategy.json beside it) nor a shard of an
/// index (an index's shards may be called anything, model.safetensors included).
fn is_integrated(path: &Path) -> bool {
    model_file(path).is_file() && !is_ckpt_rank_dir(path) && !has_index(path)
}

fn integrated_target(path: &Path) -> Option<PathBuf> {
    Some(model_file(path))
}

fn integrated(path: &Path, x: &mut Discovery) -> Result<()> {
    x.push(model_file(path), None, None);
    x.push_optimizer_file(path);
    Ok(())
}

fn loose(path: &Path) -> Vec<PathBuf> {
    entries(path)
        .into_iter()
        .filter(|p| has_ext(p, &["safetensors", "ckpt", "ckptz"]))
        .filter(|p| !is_ms_strategy(p))
        .collect()
}

fn has_loose_files(path: &Path) -> bool {
    !loose(path).is_empty()
}

fn gguf_files(path: &Path) -> Vec<PathBuf> {
    entries(path)
        .into_iter()
        .filter(|p| has_ext(p, &["gguf"]))
        .collect()
}

fn has_gguf_files(path: &Path) -> bool {
    !gguf_files(path).is_empty()
}

/// The one GGUF file of a directory (each GGUF is a whole model: several in one
/// directory are usually one model's quantizations, `model-Q8_0.gguf` beside
/// `model-F16.gguf`, and reading them together would be wrong).
fn gguf_file(path: &Path, x: &mut Discovery) -> Result<()> {
    let files = gguf_files(path);
    let others: Vec<PathBuf> = loose(path).into_iter().chain(torch_saves(path)).collect();
    let names = |v: &[PathBuf]| {
        v.iter()
            .filter_map(|p| p.file_name()?.to_str().map(String::from))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match (&files[..], others.is_empty()) {
        ([one], true) => {
            x.push(one.clone(), None, None);
            Ok(())
        }
        ([_], false) => Err(unknown(format!(
            "{}: a GGUF file ({}) beside other tensor files ({}): give the file to read",
            path.display(),
            names(&files),
            names(&others)
        ))),
        _ => Err(unknown(format!(
            "{}: {} GGUF files ({}), each a whole model: give the one to read",
            path.display(),
            files.len(),
            names(&files)
        ))),
    }
}

fn loose_files(path: &Path, x: &mut Discovery) -> Result<()> {
    for p in loose(path) {
        x.push(p, None, None);
    }
    Ok(())
}

fn has_dcp_metadata(path: &Path) -> bool {
    path.join(distcp::METADATA_FILE).is_file()
}

/// PyTorch DCP's default format: every file the metadata names. Megatron's torch_dist
/// adds `common.pt` and `metadata.json` (its own state, not tensors of the model): said,
/// not read.
fn dcp_dir(path: &Path, x: &mut Discovery) -> Result<()> {
    let files = x.read_dcp(path)?.files(path);
    for extra in ["common.pt", "metadata.json"] {
        if path.join(extra).is_file() {
            x.notes.push(format!(
                "{}: Megatron's {extra} is not read into the output or carried (ckpt reads the DCP tensors beside it)",
                path.join(extra).display()
            ));
        }
    }
    if path.join(megatron::DIST_METADATA_FILE).is_file() {
        let notes = megatron::dist_ckpt_notes(path)?;
        x.notes.extend(notes);
    }
    for f in files {
        x.push(f, None, Some(path.to_path_buf()));
    }
    Ok(())
}

/// An Orbax item directory, or a step directory the trainers' table did not take (one
/// not committed: refused, saying why; one not named as a step: its item read). It
/// holds one step, so `--step` must be that one (its step directory's name); an item
/// of a step orbax did not commit, given as it is, is read, said.
fn orbax_dir(path: &Path, x: &mut Discovery) -> Result<()> {
    let item = if orbax::is_item_dir(path) {
        path.to_path_buf()
    } else {
        let (item, notes) = orbax::step_item(path)?;
        x.notes.extend(notes);
        item
    };
    if let Some(step) = x.step {
        let here = orbax::item_step(path);
        if here != Some(step) {
            return Err(unknown(format!(
                "{}: --step {step}, but this is the Orbax item of {}: pass the CheckpointManager's root directory (the one holding the step directories)",
                path.display(),
                here.map_or_else(|| "one checkpoint".to_string(), |h| format!("step {h}"))
            )));
        }
        x.step_taken = true;
    }
    if let Some(step_dir) = orbax::step_dir_of(&item) {
        if let Some(why) = orbax::uncommitted(&step_dir) {
            x.notes.push(format!(
                "{}: its step directory {} is not committed ({why}): read as given",
                item.display(),
                step_dir.display()
            ));
        }
    }
    x.orbax.push(item);
    Ok(())
}

fn torch_saves(path: &Path) -> Vec<PathBuf> {
    entries(path)
        .into_iter()
        .filter(|p| has_ext(p, &["pth", "pt", "bin"]))
        .collect()
}

fn has_torch_files(path: &Path) -> bool {
    !torch_saves(path).is_empty()
}

/// torch.save files, only where no safetensors stand beside them (Hugging Face
/// directories often hold both forms of the same weights: that row comes first).
fn torch_files(path: &Path, x: &mut Discovery) -> Result<()> {
    refuse_side_files(path)?;
    for p in torch_saves(path) {
        x.push(p, None, None);
    }
    Ok(())
}

/// A directory of loose files beside a trainer's side files (RNG states, schedulers,
/// optimizer shards) that no trainer row recognised: its files are not all the model,
/// and which are is not ckpt's to guess.
fn refuse_side_files(path: &Path) -> Result<()> {
    let side = trainers::side_files(path);
    if side.is_empty() {
        return Ok(());
    }
    Err(unknown(format!(
        "{}: holds a trainer's files that are not the model ({}) and is no trainer's save ckpt knows (docs/trainers.md lists them): pass the files of the model's weights themselves",
        path.display(),
        side.iter()
            .filter_map(|p| p.file_name()?.to_str())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

fn has_distcp_files(path: &Path) -> bool {
    entries(path).iter().any(|p| has_ext(p, &["distcp"]))
}

fn dcp_without_metadata(path: &Path, _: &mut Discovery) -> Result<()> {
    Err(missing_dcp_metadata(path))
}

/// The refusal of `.distcp` data whose `.metadata` is not there: named, as the file
/// that is missing (never read as whatever else lies beside it).
fn missing_dcp_metadata(dir: &Path) -> Error {
    unknown(format!(
        "{}: missing: the .distcp files of {} cannot be read without the `{}` that says which tensor each holds (a PyTorch DCP or Megatron dist_ckpt save copied without it?)",
        dir.join(distcp::METADATA_FILE).display(),
        dir.display(),
        distcp::METADATA_FILE
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formats' own rows must not both claim a real checkpoint's directory (that
    /// is refused as holding two checkpoints): every directory of every committed
    /// fixture, from every library, is claimed by one own row at most.
    #[test]
    fn no_fixture_directory_is_claimed_by_two_formats() {
        let dirs = super::super::fixture_dirs();
        let mut claimed = 0;
        for d in &dirs {
            let own: Vec<&str> = DIRECTORIES
                .iter()
                .filter(|r| r.own && (r.claims)(d))
                .map(|r| r.what)
                .collect();
            assert!(own.len() <= 1, "{}: claimed by {own:?}", d.display());
            claimed += own.len();
        }
        // Megatron, DeepSpeed (9 runs), UCP, DCP, MindSpore, torch fixtures at least.
        assert!(
            claimed >= 20,
            "only {claimed} of {} directories claimed",
            dirs.len()
        );
    }
}
