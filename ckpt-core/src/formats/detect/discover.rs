//! Directory discovery: which files of the paths given belong to the checkpoint. A
//! file is an input as it is; a directory is offered to the rows of [`DIRECTORIES`] in
//! order and read by the first that claims it (as a file is read by the first reader
//! that recognises it: the order settles a directory two formats could claim), and
//! refused the same way, with the same message, when none does. What a format's
//! directory holds is decided in the format's own module (`megatron::looks_like`,
//! `mindspore_ckpt::rank_file`, `safetensors::index_shards`, ...); a row only puts its
//! answer into the [`Discovery`].

use crate::error::{Error, IoContext, Result};
use crate::formats::distcp::{self, DcpMetadata};
use crate::formats::{ckptz, deepspeed, list_dir, megatron, mindspore_ckpt, safetensors, ucp};
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
/// Files carried through from input to output when present.
pub const CARRIED_FILES: [&str; 2] = ["config.json", "trainer_state.json"];

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
    /// DeepSpeed tag directories (read whole: their files are pieces of one another).
    pub(crate) deepspeed: Vec<PathBuf>,
    /// DeepSpeed universal checkpoints' tag directories (read whole, as DeepSpeed's).
    pub(crate) ucp: Vec<PathBuf>,
    /// A Megatron legacy checkpoint (save or iteration directory): read on its own.
    pub(crate) megatron: Option<PathBuf>,
}

/// A row of the directory table: whether the carried files (`config.json`, ...) of a
/// directory it is offered are noted, and its discovery: `Ok(true)` when it claims the
/// directory (its files then added to the [`Discovery`]), `Ok(false)` to let the next
/// row try.
struct DirRow {
    carries: bool,
    discover: fn(&Path, &mut Discovery) -> Result<bool>,
}

/// The directory table, tried in this order. Adding a format that is a directory of
/// files is one function in its module and one row here (see docs/architecture.md).
static DIRECTORIES: [DirRow; 12] = [
    // Megatron legacy save or iteration directory
    DirRow {
        carries: false,
        discover: megatron_dir,
    },
    // ckpt training output (`latest`, step_<n>/)
    DirRow {
        carries: false,
        discover: training_output,
    },
    // DeepSpeed ZeRO tag directory
    DirRow {
        carries: false,
        discover: deepspeed_dir,
    },
    // DeepSpeed universal checkpoint (`latest_universal`, or the tag directory)
    DirRow {
        carries: false,
        discover: ucp_dir,
    },
    // ckpt rank directory (model file + strategy.json)
    DirRow {
        carries: true,
        discover: ckpt_rank_dir,
    },
    // directory of rank directories (ckpt_<r>/, rank_<r>/: ckpt, MindSpore)
    DirRow {
        carries: true,
        discover: rank_dirs,
    },
    // Hugging Face shard index
    DirRow {
        carries: true,
        discover: hf_index,
    },
    // integrated model file (model.safetensors, model.ckptz)
    DirRow {
        carries: true,
        discover: integrated,
    },
    // loose *.safetensors, *.ckptz, MindSpore *.ckpt files
    DirRow {
        carries: true,
        discover: loose_files,
    },
    // PyTorch DCP (.metadata + .distcp)
    DirRow {
        carries: true,
        discover: dcp_dir,
    },
    // torch.save files (*.pth, *.pt, *.bin)
    DirRow {
        carries: true,
        discover: torch_files,
    },
    // PyTorch DCP data without its .metadata (refused)
    DirRow {
        carries: true,
        discover: dcp_without_metadata,
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
    use std::io::Read;
    const MAX_STRATEGY_BYTES: u64 = 64 << 20;
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = [0u8; 64];
    let n = f.read(&mut head).unwrap_or(0);
    if crate::formats::sniff(&head[..n]).is_some() {
        return false;
    }
    if f.metadata().map_or(true, |m| m.len() > MAX_STRATEGY_BYTES) {
        return false;
    }
    let Ok(bytes) = std::fs::read(path) else {
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
        for row in &DIRECTORIES {
            if row.carries {
                note_carried(path, &mut self.carried);
            }
            if (row.discover)(path, self)? {
                return Ok(());
            }
        }
        Err(unknown(format!(
            "{}: no checkpoint here (expected ckpt_<r>/ or rank_<r>/ rank directories, {MODEL_FILE}, {INDEX_FILE}, *.safetensors, *.ckptz, *.ckpt or torch.save *.pth/*.pt/*.bin)",
            path.display()
        )))
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
            let m = distcp::read_metadata(dir)?;
            self.notes.extend(m.non_tensor_note(dir));
            self.dcp.insert(dir.to_path_buf(), m);
        }
        Ok(&self.dcp[dir])
    }
}

fn megatron_dir(path: &Path, x: &mut Discovery) -> Result<bool> {
    if !megatron::looks_like(path) {
        return Ok(false);
    }
    if let Some(other) = x.megatron.replace(path.to_path_buf()) {
        return Err(unknown(format!(
            "two Megatron checkpoints given ({} and {}): one at a time",
            other.display(),
            path.display()
        )));
    }
    Ok(true)
}

/// A training output directory: `latest` names its newest complete checkpoint.
fn training_output(path: &Path, x: &mut Discovery) -> Result<bool> {
    let latest = path.join(LATEST_FILE);
    if !latest.is_file() {
        return Ok(false);
    }
    // DeepSpeed's save directory after ds_to_universal: `latest` names the ZeRO tag,
    // `latest_universal` the universal one, and they may be different steps. Which
    // one is meant is not ours to guess.
    let universal = path.join(ucp::LATEST_UNIVERSAL);
    if universal.is_file() {
        return Err(unknown(format!(
            "{}: both `{LATEST_FILE}` and `{}` name a checkpoint here: pass the tag directory to read ({} or {})",
            path.display(),
            ucp::LATEST_UNIVERSAL,
            named_dir(path, &latest)?.display(),
            named_dir(path, &universal)?.display()
        )));
    }
    if let Some(step) = x.step {
        let target = path.join(format!("step_{step}"));
        if !target.is_dir() {
            let mut steps: Vec<u64> = list_dir(path)?
                .iter()
                .filter(|p| p.is_dir())
                .filter_map(|p| p.file_name()?.to_str()?.strip_prefix("step_")?.parse().ok())
                .collect();
            steps.sort_unstable();
            return Err(unknown(format!(
                "{}: no checkpoint of step {step} (step_{step}/); steps here: {}",
                path.display(),
                steps
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        x.add(&target)?;
        return Ok(true);
    }
    x.add(&named_dir(path, &latest)?)?;
    Ok(true)
}

/// The directory beside it that a pointer file (`latest`, `latest_universal`) names.
fn named_dir(path: &Path, pointer: &Path) -> Result<PathBuf> {
    let name = std::fs::read_to_string(pointer).at(pointer)?;
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

fn deepspeed_dir(path: &Path, x: &mut Discovery) -> Result<bool> {
    if !deepspeed::looks_like(path) {
        return Ok(false);
    }
    x.deepspeed.push(path.to_path_buf());
    Ok(true)
}

/// A DeepSpeed save directory holding only a universal checkpoint (its
/// `latest_universal` names the tag; with a `latest` beside it the directory was
/// refused as ambiguous by the training-output row), or a universal checkpoint's tag
/// directory.
fn ucp_dir(path: &Path, x: &mut Discovery) -> Result<bool> {
    let universal = path.join(ucp::LATEST_UNIVERSAL);
    if universal.is_file() {
        x.add(&named_dir(path, &universal)?)?;
        return Ok(true);
    }
    if !ucp::looks_like(path) {
        return Ok(false);
    }
    x.ucp.push(path.to_path_buf());
    Ok(true)
}

fn ckpt_rank_dir(path: &Path, x: &mut Discovery) -> Result<bool> {
    let model = model_file(path);
    let strategy = path.join(STRATEGY_FILE);
    if !(model.is_file() && strategy.is_file()) {
        return Ok(false);
    }
    x.push(model, Some(strategy), None);
    Ok(true)
}

fn rank_dirs(path: &Path, x: &mut Discovery) -> Result<bool> {
    let entries = list_dir(path)?;
    let mut rank_dirs: Vec<(u64, PathBuf)> = entries
        .iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| Some((rank_dir_number(p)?, p.clone())))
        .collect();
    if rank_dirs.is_empty() {
        return Ok(false);
    }
    rank_dirs.sort();
    for (_, d) in rank_dirs {
        let own = d.join(STRATEGY_FILE);
        let own = (own.is_file() && !is_ms_strategy(&own)).then_some(own);
        if own.is_some() && model_file(&d).is_file() {
            x.add(&d)?;
        } else if let Some(f) = mindspore_ckpt::rank_file(&d, x.step, &mut x.notes)? {
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
    Ok(true)
}

fn hf_index(path: &Path, x: &mut Discovery) -> Result<bool> {
    let index = match path.join(INDEX_FILE) {
        i if !i.is_file() && path.join(COMPRESSED_INDEX_FILE).is_file() => {
            path.join(COMPRESSED_INDEX_FILE)
        }
        i => i,
    };
    if !index.is_file() {
        return Ok(false);
    }
    for f in safetensors::index_shards(path, &index)? {
        x.push(f, None, None);
    }
    x.push_optimizer_file(path);
    Ok(true)
}

fn integrated(path: &Path, x: &mut Discovery) -> Result<bool> {
    let model = model_file(path);
    if !model.is_file() {
        return Ok(false);
    }
    x.push(model, None, None);
    x.push_optimizer_file(path);
    Ok(true)
}

fn loose_files(path: &Path, x: &mut Discovery) -> Result<bool> {
    let files: Vec<PathBuf> = list_dir(path)?
        .into_iter()
        .filter(|p| has_ext(p, &["safetensors", "ckpt", "ckptz"]))
        .filter(|p| !is_ms_strategy(p))
        .collect();
    let found = !files.is_empty();
    for p in files {
        x.push(p, None, None);
    }
    Ok(found)
}

/// PyTorch DCP's default format: every file the metadata names. Megatron's torch_dist
/// adds `common.pt` and `metadata.json` (its own state, not tensors of the model): said,
/// not read.
fn dcp_dir(path: &Path, x: &mut Discovery) -> Result<bool> {
    if !path.join(distcp::METADATA_FILE).is_file() {
        return Ok(false);
    }
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
    Ok(true)
}

/// torch.save files, only where no safetensors stand beside them (Hugging Face
/// directories often hold both forms of the same weights: that row comes first).
fn torch_files(path: &Path, x: &mut Discovery) -> Result<bool> {
    let files: Vec<PathBuf> = list_dir(path)?
        .into_iter()
        .filter(|p| has_ext(p, &["pth", "pt", "bin"]))
        .collect();
    let found = !files.is_empty();
    for p in files {
        x.push(p, None, None);
    }
    Ok(found)
}

fn dcp_without_metadata(path: &Path, _: &mut Discovery) -> Result<bool> {
    if list_dir(path)?.iter().any(|p| has_ext(p, &["distcp"])) {
        return Err(unknown(format!(
            "{}: .distcp files without the `.metadata` that says what they hold",
            path.display()
        )));
    }
    Ok(false)
}
