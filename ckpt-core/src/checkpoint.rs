//! `Checkpoint`: a set of safetensors files read as pieces of global tensors.
//!
//! Three kinds are understood: ckpt's sliced rank directories (`ckpt_<r>/` with
//! `model.safetensors` and `strategy.json`), Hugging Face integrated checkpoints
//! (`model.safetensors` or shards with `model.safetensors.index.json`), and PyTorch
//! DCP sharded safetensors (`DCP_SHARDING_INFO` offsets, layout inferred).

use crate::error::{Error, IoContext, Problems, Result};
use crate::formats::distcp::{self, DcpMetadata};
use crate::formats::{FileFormat, PieceKind, ReadCache, TensorFile};
use crate::layout::coverage::{check_tiling, Defect};
use crate::layout::mesh::Mesh;
use crate::layout::region::Region;
use crate::layout::select::Selection;
use crate::layout::source::{PieceSource, SourcePiece, SourceTensor};
use crate::layout::strategy::{dtype_name, Strategy};
use crate::layout::TensorLayout;
use crate::Dtype;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub use crate::layout::plan::DCP_SHARDING_INFO;
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
/// Beside an integrated model, the file of its optimizer state (`merge` puts tensors
/// named [`OPTIMIZER_PREFIX`]`*` there, so that model.safetensors holds weights only).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The names of optimizer state, in ckpt's training checkpoints (`optim.<param>.<state>`)
/// and torch's (`optim.state.<i>.<state>`).
pub const OPTIMIZER_PREFIX: &str = "optim.";
/// In a training output directory, the file naming its newest checkpoint.
pub(crate) const LATEST_FILE: &str = "latest";
/// Files carried through from input to output when present.
pub const CARRIED_FILES: [&str; 2] = ["config.json", "trainer_state.json"];

/// How the note on a prefix every name shares begins.
const SHARED_PREFIX_NOTE: &str = "every tensor name starts with";

/// Bytes of two copies compared at once (a compressed file decompresses that much).
const COMPARE_WINDOW: u64 = 4 << 20;

/// Most problems of one kind listed one by one; the rest are counted.
pub(crate) const MAX_LISTED: usize = 20;

/// The parts of a file's tensor `read_mindspore` looks at (a split slice's records
/// together).
struct TensorEntryView<'a> {
    name: &'a String,
    dtype: Dtype,
    shape: &'a [u64],
}

/// What kind of checkpoint a set of inputs is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// ckpt rank directories with a strategy.
    Sliced,
    /// Whole tensors (Hugging Face layout).
    Integrated,
    /// PyTorch DCP sharded safetensors.
    Dcp,
}

/// An opened, checked checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    /// The kind of the inputs.
    pub kind: Kind,
    /// The mapped files.
    pub files: Vec<TensorFile>,
    /// Rank of each file (sliced checkpoints).
    pub ranks: Vec<Option<u64>>,
    /// The strategy (sliced checkpoints).
    pub strategy: Option<Strategy>,
    /// The tensors by name.
    pub tensors: BTreeMap<String, SourceTensor>,
    /// Carried files found beside the inputs (`config.json`, ...), by name.
    pub carried: BTreeMap<String, PathBuf>,
    /// What could not be checked from these inputs (not problems; said by inspect
    /// and verify so that an ok is not read as more than it is).
    pub notes: Vec<String>,
}

/// The first dotted component every name shares (`module.`), when there are at least
/// two names.
fn shared_prefix<'a>(mut names: impl Iterator<Item = &'a str>) -> Option<String> {
    let first = names.next()?;
    let p = &first[..=first.find('.')?];
    let mut n = 1;
    for name in names {
        if !name.starts_with(p) || name.len() == p.len() {
            return None;
        }
        n += 1;
    }
    (n > 1).then(|| p.to_string())
}

/// An input file and what we know of it before reading it.
struct Input {
    path: PathBuf,
    strategy: Option<PathBuf>,
    /// For a `.distcp` file, its directory (whose `.metadata` says what it holds).
    dcp: Option<PathBuf>,
}

/// What expanding the command line's paths finds.
#[derive(Default)]
struct Expanded {
    inputs: Vec<Input>,
    carried: BTreeMap<String, PathBuf>,
    ms: MsStrategies,
    notes: Vec<String>,
    /// DCP directories' metadata, by directory.
    dcp: BTreeMap<PathBuf, DcpMetadata>,
    /// The training step asked for (`--step`), where the inputs hold several.
    step: Option<u64>,
    /// DeepSpeed tag directories (read whole: their files are pieces of one another).
    deepspeed: Vec<PathBuf>,
    /// DeepSpeed universal checkpoints' tag directories (read whole, as DeepSpeed's).
    ucp: Vec<PathBuf>,
    /// A Megatron legacy checkpoint (save or iteration directory): read on its own.
    megatron: Option<PathBuf>,
}

impl Expanded {
    /// The optimizer state `merge` writes beside an integrated model, when present.
    fn push_optimizer_file(&mut self, dir: &Path) {
        let plain = dir.join(OPTIMIZER_FILE);
        // Or compressed (`merge --compress` writes `optimizer.ckptz`).
        let p = if plain.is_file() {
            plain
        } else {
            plain.with_extension(crate::formats::ckptz::EXTENSION)
        };
        if p.is_file() {
            self.inputs.push(Input {
                path: p,
                strategy: None,
                dcp: None,
            });
        }
    }

    /// Reads a DCP directory's `.metadata` once, noting the values it holds that are
    /// not tensors (ckpt does not carry them).
    fn read_dcp(&mut self, dir: &Path) -> Result<&DcpMetadata> {
        if !self.dcp.contains_key(dir) {
            let m = distcp::read_metadata(dir)?;
            if !m.bytes.is_empty() {
                let shown = m
                    .bytes
                    .iter()
                    .take(8)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ");
                let more = if m.bytes.len() > 8 { ", ..." } else { "" };
                self.notes.push(format!(
                    "{}: {} value(s) that are not tensors (BYTE_IO) are not carried: {shown}{more}",
                    dir.join(distcp::METADATA_FILE).display(),
                    m.bytes.len()
                ));
            }
            self.dcp.insert(dir.to_path_buf(), m);
        }
        Ok(&self.dcp[dir])
    }
}

/// MindSpore strategy files: given as inputs (`--source-strategy` adds one), or found
/// in the root of a directory of rank directories.
#[derive(Default)]
struct MsStrategies {
    given: Vec<PathBuf>,
    found: BTreeMap<PathBuf, Vec<PathBuf>>,
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

/// The checkpoint file of a MindSpore rank directory: its only `.ckpt`/`.safetensors`
/// (or `ckpt compress`ed `.ckptz`) file, or the newest `<prefix>-<epoch>_<step>` of
/// several.
fn ms_rank_file(dir: &Path, step: Option<u64>, notes: &mut Vec<String>) -> Result<Option<PathBuf>> {
    let files: Vec<PathBuf> = list_dir(dir)?
        .into_iter()
        .filter(|p| p.is_file())
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "ckpt" || e == "safetensors" || e == "ckptz")
        })
        .collect();
    if files.len() <= 1 && step.is_none() {
        return Ok(files.into_iter().next());
    }
    let epoch_step = |p: &Path| -> Option<(u64, u64)> {
        let stem = p.file_stem()?.to_str()?;
        let (_, tail) = stem.rsplit_once('-')?;
        let (e, s) = tail.split_once('_')?;
        Some((e.parse().ok()?, s.parse().ok()?))
    };
    let mut dated: Vec<((u64, u64), PathBuf)> = Vec::new();
    for f in &files {
        match epoch_step(f) {
            Some(k) => dated.push((k, f.clone())),
            None => {
                return Err(unknown(format!(
                    "{}: several checkpoint files and `{}` is not named <prefix>-<epoch>_<step>: pass the file to use",
                    dir.display(),
                    f.display()
                )))
            }
        }
    }
    dated.sort();
    if let Some(want) = step {
        let have: Vec<String> = dated.iter().map(|((_, s), _)| s.to_string()).collect();
        let mut at = dated.into_iter().filter(|((_, s), _)| *s == want);
        return match (at.next(), at.next()) {
            (Some((_, f)), None) => Ok(Some(f)),
            (Some(_), Some(_)) => Err(unknown(format!(
                "{}: several checkpoint files of step {want} (different epochs): pass the file to use",
                dir.display()
            ))),
            (None, _) => Err(unknown(format!(
                "{}: no checkpoint file of step {want} (<prefix>-<epoch>_{want}.ckpt); steps here: {}",
                dir.display(),
                if have.is_empty() { "none".to_string() } else { have.join(", ") }
            ))),
        };
    }
    let (_, newest) = dated.pop().expect("several files");
    notes.push(format!(
        "{}: {} checkpoint files, using the newest, {}",
        dir.display(),
        files.len(),
        newest.file_name().unwrap_or_default().to_string_lossy()
    ));
    Ok(Some(newest))
}

fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

/// The rank of a `ckpt_<r>` (ckpt, MindSpore) or `rank_<r>` (MindSpore) directory.
fn rank_dir_number(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    name.strip_prefix("ckpt_")
        .or_else(|| name.strip_prefix("rank_"))?
        .parse()
        .ok()
}

fn list_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .at(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    v.sort();
    Ok(v)
}

fn expand(path: &Path, x: &mut Expanded) -> Result<()> {
    if path.is_file() && is_ms_strategy(path) {
        x.ms.given.push(path.to_path_buf());
        return Ok(());
    }
    if path.is_file() && path.extension().is_some_and(|e| e == "distcp") {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        note_carried(&dir, &mut x.carried);
        x.read_dcp(&dir)?;
        x.inputs.push(Input {
            path: path.to_path_buf(),
            strategy: None,
            dcp: Some(dir),
        });
        return Ok(());
    }
    if path.is_file() {
        let dir = path.parent().unwrap_or(Path::new("."));
        let s = dir.join(STRATEGY_FILE);
        note_carried(dir, &mut x.carried);
        // (A MindSpore JSON strategy may be called strategy.json too: not ckpt's.)
        x.inputs.push(Input {
            path: path.to_path_buf(),
            strategy: (s.is_file() && !is_ms_strategy(&s)).then_some(s),
            dcp: None,
        });
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
    if crate::formats::megatron::looks_like(path) {
        if let Some(other) = x.megatron.replace(path.to_path_buf()) {
            return Err(unknown(format!(
                "two Megatron checkpoints given ({} and {}): one at a time",
                other.display(),
                path.display()
            )));
        }
        return Ok(());
    }
    // A training output directory: `latest` names its newest complete checkpoint.
    let latest = path.join(LATEST_FILE);
    if let (true, Some(step)) = (latest.is_file(), x.step) {
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
        return expand(&target, x);
    }
    // A DeepSpeed save directory holding only a universal checkpoint: its
    // `latest_universal` names the tag (`latest`, when there too, wins: the ZeRO one).
    let universal = path.join(crate::formats::ucp::LATEST_UNIVERSAL);
    let latest = if !latest.is_file() && universal.is_file() {
        universal
    } else {
        latest
    };
    if latest.is_file() {
        let name = std::fs::read_to_string(&latest).at(&latest)?;
        let target = path.join(name.trim());
        if name.trim().is_empty() || name.contains('/') || !target.is_dir() {
            return Err(unknown(format!(
                "{}: names `{}`, which is not a checkpoint directory beside it",
                latest.display(),
                name.trim()
            )));
        }
        return expand(&target, x);
    }
    if crate::formats::deepspeed::looks_like(path) {
        x.deepspeed.push(path.to_path_buf());
        return Ok(());
    }
    if crate::formats::ucp::looks_like(path) {
        x.ucp.push(path.to_path_buf());
        return Ok(());
    }
    note_carried(path, &mut x.carried);
    let model = model_file(path);
    let strategy = path.join(STRATEGY_FILE);
    if model.is_file() && strategy.is_file() {
        x.inputs.push(Input {
            path: model,
            strategy: Some(strategy),
            dcp: None,
        });
        return Ok(());
    }
    let entries = list_dir(path)?;
    let mut rank_dirs: Vec<(u64, PathBuf)> = entries
        .iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| Some((rank_dir_number(p)?, p.clone())))
        .collect();
    if !rank_dirs.is_empty() {
        rank_dirs.sort();
        for (_, d) in rank_dirs {
            let own = d.join(STRATEGY_FILE);
            let own = (own.is_file() && !is_ms_strategy(&own)).then_some(own);
            if own.is_some() && model_file(&d).is_file() {
                expand(&d, x)?;
            } else if let Some(f) = ms_rank_file(&d, x.step, &mut x.notes)? {
                // MindSpore's files; with ckpt's strategy.json when ckpt wrote them.
                note_carried(&d, &mut x.carried);
                x.inputs.push(Input {
                    path: f,
                    strategy: own,
                    dcp: None,
                });
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
        return Ok(());
    }
    let index = match path.join(INDEX_FILE) {
        i if !i.is_file() && path.join(COMPRESSED_INDEX_FILE).is_file() => {
            path.join(COMPRESSED_INDEX_FILE)
        }
        i => i,
    };
    if index.is_file() {
        let text = std::fs::read_to_string(&index).at(&index)?;
        let doc: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| unknown(format!("{}: not JSON: {e}", index.display())))?;
        let map = doc
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| unknown(format!("{}: no `weight_map` object", index.display())))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        for f in files {
            x.inputs.push(Input {
                path: path.join(f),
                strategy: None,
                dcp: None,
            });
        }
        x.push_optimizer_file(path);
        return Ok(());
    }
    if model.is_file() {
        x.inputs.push(Input {
            path: model,
            strategy: None,
            dcp: None,
        });
        x.push_optimizer_file(path);
        return Ok(());
    }
    let has_ext = |p: &Path, exts: &[&str]| {
        p.is_file()
            && p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
    };
    let mut st: Vec<PathBuf> = entries
        .iter()
        .filter(|p| has_ext(p, &["safetensors", "ckpt", "ckptz"]))
        .filter(|p| !is_ms_strategy(p))
        .cloned()
        .collect();
    if st.is_empty() && path.join(distcp::METADATA_FILE).is_file() {
        // PyTorch DCP's default format: every file the metadata names. Megatron's
        // torch_dist adds `common.pt` and `metadata.json` (its own state, not tensors of
        // the model): said, not read.
        let files = x.read_dcp(path)?.files(path);
        for extra in ["common.pt", "metadata.json"] {
            if path.join(extra).is_file() {
                x.notes.push(format!(
                    "{}: Megatron's {extra} is not read into the output or carried (ckpt reads the DCP tensors beside it)",
                    path.join(extra).display()
                ));
            }
        }
        if path
            .join(crate::formats::megatron::DIST_METADATA_FILE)
            .is_file()
        {
            let notes = crate::formats::megatron::dist_ckpt_notes(path)?;
            x.notes.extend(notes);
        }
        for f in files {
            x.inputs.push(Input {
                path: f,
                strategy: None,
                dcp: Some(path.to_path_buf()),
            });
        }
        return Ok(());
    }
    if st.is_empty() {
        // torch.save files, only where no safetensors stand beside them (Hugging Face
        // directories often hold both forms of the same weights).
        st = entries
            .iter()
            .filter(|p| has_ext(p, &["pth", "pt", "bin"]))
            .cloned()
            .collect();
    }
    if st.is_empty() && entries.iter().any(|p| has_ext(p, &["distcp"])) {
        return Err(unknown(format!(
            "{}: .distcp files without the `.metadata` that says what they hold",
            path.display()
        )));
    }
    if st.is_empty() {
        return Err(unknown(format!(
            "{}: no checkpoint here (expected ckpt_<r>/ or rank_<r>/ rank directories, {MODEL_FILE}, {INDEX_FILE}, *.safetensors, *.ckptz, *.ckpt or torch.save *.pth/*.pt/*.bin)",
            path.display()
        )));
    }
    for p in st {
        x.inputs.push(Input {
            path: p,
            strategy: None,
            dcp: None,
        });
    }
    Ok(())
}

fn note_carried(dir: &Path, carried: &mut BTreeMap<String, PathBuf>) {
    for name in CARRIED_FILES {
        let p = dir.join(name);
        if p.is_file() {
            carried.entry(name.to_string()).or_insert(p);
        }
    }
}

impl Checkpoint {
    /// Opens inputs and checks them; any problem is an error (all problems listed).
    ///
    /// # Errors
    /// Unreadable or malformed files, and every consistency or coverage problem.
    pub fn open(paths: &[PathBuf]) -> Result<Checkpoint> {
        Checkpoint::open_selected(paths, &Selection::default())
    }

    /// Like [`Checkpoint::open`], for the tensors `selection` keeps: the others are
    /// dropped, and their problems (coverage, shapes) do not count, so a merge that
    /// leaves out, say, incomplete optimizer state can go ahead. Patterns that match no
    /// tensor are added to [`Checkpoint::notes`].
    ///
    /// # Errors
    /// As [`Checkpoint::open`], for the kept tensors; a selection that keeps nothing.
    pub fn open_selected(paths: &[PathBuf], selection: &Selection) -> Result<Checkpoint> {
        let (mut ck, mut problems) = Checkpoint::scan_step(paths, selection.step())?;
        ck.apply_renames(selection, &mut problems)?;
        let warnings = selection.review(ck.tensors.keys().map(String::as_str))?;
        ck.notes.extend(warnings);
        let keep = |name: &str| selection.keeps(name);
        ck.tensors.retain(|name, _| keep(name));
        problems.retain(|e| match e {
            Error::CoverageGap { tensor, .. }
            | Error::Overlap { tensor, .. }
            | Error::InvalidTensor { tensor, .. }
            | Error::Ambiguous { tensor, .. } => keep(tensor),
            _ => true,
        });
        if problems.is_empty() {
            Ok(ck)
        } else {
            Err(Error::Many(Problems(problems)))
        }
    }

    /// Opens inputs, collecting per-file and per-tensor problems instead of stopping at
    /// the first. Fails outright only when the inputs cannot be understood at all.
    ///
    /// # Errors
    /// Inputs that are not a checkpoint, or mixed kinds.
    pub fn scan(paths: &[PathBuf]) -> Result<(Checkpoint, Vec<Error>)> {
        Checkpoint::scan_step(paths, None)
    }

    /// [`Checkpoint::scan`] of the checkpoint of training step `step`, where the inputs
    /// hold several (see [`Selection::with_step`]).
    ///
    /// # Errors
    /// As [`Checkpoint::scan`]; no checkpoint of that step.
    pub fn scan_step(paths: &[PathBuf], step: Option<u64>) -> Result<(Checkpoint, Vec<Error>)> {
        let mut x = Expanded {
            step,
            ..Expanded::default()
        };
        for p in paths {
            expand(p, &mut x)?;
        }
        let Expanded {
            inputs,
            carried,
            ms,
            mut notes,
            dcp,
            deepspeed,
            ucp,
            megatron,
            ..
        } = x;
        if let Some(dir) = megatron {
            if !inputs.is_empty() || !ms.given.is_empty() {
                return Err(unknown(format!(
                    "{}: a Megatron checkpoint is read on its own, not with other inputs",
                    dir.display()
                )));
            }
            return Checkpoint::read_megatron(&dir, carried, notes);
        }
        let ms_strategy = match (ms.given.is_empty(), ms.found.len()) {
            (false, _) => ms.given,
            (true, 0) => vec![],
            (true, _) => {
                let found: Vec<PathBuf> = ms.found.into_values().flatten().collect();
                if found.len() > 1 {
                    return Err(unknown(format!(
                        "several MindSpore strategy files beside the rank directories ({}): say which with --source-strategy (several for pipeline stages)",
                        found.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                    )));
                }
                notes.push(format!("MindSpore strategy: {}", found[0].display()));
                found
            }
        };
        let mut problems = Vec::new();
        let mut files = Vec::new();
        let mut strategies = Vec::new();
        for input in inputs {
            let opened = match &input.dcp {
                Some(dir) => dcp[dir].open(&input.path),
                None => TensorFile::open(&input.path),
            };
            match opened {
                Ok(f) => {
                    files.push(f);
                    strategies.push(input.strategy);
                }
                Err(e) => problems.push(e),
            }
        }
        // Flat element ranges (ZeRO, Megatron) are described by their readers but not
        // planned yet: refused by name rather than read as boxes.
        for f in &files {
            for (i, t) in f.tensors().iter().enumerate() {
                if let PieceKind::Flat { start, len } = f.piece(i) {
                    problems.push(Error::FlatPiece {
                        path: f.path().to_path_buf(),
                        tensor: t.name.clone(),
                        start,
                        end: start.saturating_add(len),
                    });
                }
            }
        }
        let mut ds = Vec::new();
        for dir in &deepspeed {
            match crate::formats::deepspeed::read(dir) {
                Ok(d) => ds.push(d),
                Err(e) => problems.push(e),
            }
        }
        for dir in &ucp {
            match crate::formats::ucp::read(dir) {
                Ok(d) => ds.push(d),
                Err(e) => problems.push(e),
            }
        }
        for d in &mut ds {
            strategies.extend(d.files.iter().map(|_| None));
            files.append(&mut d.files);
            notes.append(&mut d.notes);
        }
        if files.is_empty() && !problems.is_empty() {
            // Nothing could be read: there is no checkpoint to describe, only why.
            return Err(Error::Many(Problems(problems)));
        }
        let sliced = strategies.iter().filter(|s| s.is_some()).count();
        // (MindSpore's split records carry offsets too, within a file's own tensor.)
        let with_offsets = files
            .iter()
            .filter(|f| f.format() != FileFormat::MindSporeCkpt)
            .filter(|f| f.tensors().iter().any(|t| t.offsets.is_some()))
            .count();
        let kind = if !ms_strategy.is_empty() {
            if sliced > 0 {
                return Err(unknown(
                    "a MindSpore strategy was given for ckpt rank directories, which have their own strategy.json".into(),
                ));
            }
            Kind::Sliced
        } else if sliced > 0 {
            if sliced != strategies.len() {
                return Err(unknown(
                    "inputs mix rank directories (with strategy.json) and other files".into(),
                ));
            }
            Kind::Sliced
        } else if with_offsets > 0 || !dcp.is_empty() {
            Kind::Dcp
        } else {
            Kind::Integrated
        };
        let mut ck = Checkpoint {
            kind,
            ranks: vec![None; files.len()],
            files,
            strategy: None,
            tensors: BTreeMap::new(),
            carried,
            notes,
        };
        let mut raw: BTreeMap<String, Vec<SourcePiece>> = BTreeMap::new();
        match kind {
            Kind::Sliced if !ms_strategy.is_empty() => {
                let refs: Vec<&Path> = ms_strategy.iter().map(PathBuf::as_path).collect();
                let params = crate::formats::mindspore_strategy::read_mindspore_strategies(&refs)?;
                ck.read_mindspore(&params, &mut raw, &mut problems)?;
            }
            Kind::Sliced => ck.read_sliced(&strategies, &mut raw, &mut problems)?,
            Kind::Dcp | Kind::Integrated => ck.read_boxes(&mut raw, &mut problems),
        }
        if kind == Kind::Dcp {
            ck.check_dcp_ranks(&mut problems);
            ck.declare_dcp_shapes(&dcp, &mut problems);
        }
        for d in &ds {
            ck.declare_shapes(&d.shapes, &mut problems);
        }
        ck.assemble(raw, &mut problems);
        for (alias, of) in ds.iter().flat_map(|d| &d.aliases) {
            if let Some(t) = ck.tensors.get(of).cloned() {
                ck.tensors.insert(alias.clone(), t);
            }
        }
        for f in &ck.files {
            if let Some(list) = f.metadata().get("torch.non_tensor") {
                let all: Vec<&str> = list.split(',').collect();
                let shown = all.iter().take(8).copied().collect::<Vec<_>>().join(", ");
                let more = if all.len() > 8 { ", ..." } else { "" };
                ck.notes.push(format!(
                    "{}: {} value(s) that are not tensors are not carried: {shown}{more}",
                    f.path().display(),
                    all.len()
                ));
            }
        }
        if let Some(p) = shared_prefix(ck.tensors.keys().map(String::as_str)) {
            ck.notes.push(format!(
                "{SHARED_PREFIX_NOTE} `{p}` (DDP's `module.` wrapper, for one): --strip-prefix {p} removes it"
            ));
        }
        Ok((ck, problems))
    }

    /// Applies a selection's renames (`--strip-prefix`, `--add-prefix`) to the tensors
    /// and to the problems found so far, which name them; the note suggesting a strip
    /// goes once it is done.
    ///
    /// # Errors
    /// Two tensors that would get the same name.
    pub fn apply_renames(&mut self, selection: &Selection, problems: &mut [Error]) -> Result<()> {
        if !selection.renames() {
            return Ok(());
        }
        self.rename(|n| selection.rename(n))?;
        for e in problems {
            if let Error::CoverageGap { tensor, .. }
            | Error::Overlap { tensor, .. }
            | Error::InvalidTensor { tensor, .. }
            | Error::Ambiguous { tensor, .. } = e
            {
                *tensor = selection.rename(tensor);
            }
        }
        self.notes.retain(|n| !n.starts_with(SHARED_PREFIX_NOTE));
        Ok(())
    }

    /// Renames every tensor by `rename` (the strategy's layouts too).
    ///
    /// # Errors
    /// Two tensors that would get the same name.
    pub fn rename(&mut self, rename: impl Fn(&str) -> String) -> Result<()> {
        let mut out = BTreeMap::new();
        for (name, t) in std::mem::take(&mut self.tensors) {
            let new = rename(&name);
            if out.insert(new.clone(), t).is_some() {
                return Err(Error::Unsupported {
                    problem: format!(
                        "renaming gives two tensors the name `{new}` (one was `{name}`)"
                    ),
                });
            }
        }
        self.tensors = out;
        if let Some(s) = &mut self.strategy {
            s.tensors = std::mem::take(&mut s.tensors)
                .into_iter()
                .map(|(n, l)| (rename(&n), l))
                .collect();
        }
        Ok(())
    }

    /// A Megatron legacy checkpoint: each rank's file placed by the layout its reader
    /// built from megatron-core's rules (a strategy on a `pp`/`tp` mesh, so `--to` and
    /// `--mesh` reshard it as a sliced checkpoint).
    fn read_megatron(
        dir: &Path,
        carried: BTreeMap<String, PathBuf>,
        mut notes: Vec<String>,
    ) -> Result<(Checkpoint, Vec<Error>)> {
        let legacy = crate::formats::megatron::open(dir)?;
        notes.extend(legacy.notes);
        let strategy = legacy.strategy;
        let mut ck = Checkpoint {
            kind: Kind::Sliced,
            files: Vec::with_capacity(legacy.files.len()),
            ranks: Vec::with_capacity(legacy.files.len()),
            strategy: None,
            tensors: BTreeMap::new(),
            carried,
            notes,
        };
        let mut raw: BTreeMap<String, Vec<SourcePiece>> = BTreeMap::new();
        for (fi, (rank, f)) in legacy.files.into_iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                let layout = &strategy.tensors[&t.name];
                let entry = raw.entry(t.name.clone()).or_default();
                for p in layout.pieces(&strategy.mesh, rank) {
                    entry.push(SourcePiece {
                        file: fi,
                        tensor: ti,
                        global: p.global,
                        local: p.local,
                    });
                }
            }
            ck.files.push(f);
            ck.ranks.push(Some(rank));
        }
        for (name, l) in &strategy.tensors {
            ck.tensors.insert(
                name.clone(),
                SourceTensor {
                    dtype: l.dtype,
                    shape: l.shape.clone(),
                    pieces: vec![],
                    copies: vec![],
                },
            );
        }
        ck.strategy = Some(strategy);
        let mut problems = Vec::new();
        ck.assemble(raw, &mut problems);
        Ok((ck, problems))
    }

    fn read_sliced(
        &mut self,
        strategies: &[Option<PathBuf>],
        raw: &mut BTreeMap<String, Vec<SourcePiece>>,
        problems: &mut Vec<Error>,
    ) -> Result<()> {
        let mut parsed: BTreeMap<PathBuf, std::result::Result<Strategy, String>> = BTreeMap::new();
        for s in strategies.iter().flatten() {
            parsed
                .entry(s.clone())
                .or_insert_with(|| Strategy::read(s).map_err(|e| e.to_string()));
        }
        // The reference strategy: the first that parses.
        let Some((ref_path, strategy)) = parsed
            .iter()
            .find_map(|(p, s)| s.as_ref().ok().map(|s| (p.clone(), s.clone())))
        else {
            let first = parsed
                .values()
                .find_map(|s| s.as_ref().err().cloned())
                .unwrap_or_default();
            return Err(unknown(first));
        };
        let hash = strategy.hash();
        for (p, s) in &parsed {
            match s {
                Err(e) => problems.push(unknown(e.clone())),
                Ok(s) if s.hash() != hash => problems.push(Error::Mismatch {
                    what: format!(
                        "{}: strategy differs from {}",
                        p.display(),
                        ref_path.display()
                    ),
                }),
                Ok(_) => {}
            }
        }
        let world = strategy.mesh.world_size();
        let mut seen: BTreeMap<u64, PathBuf> = BTreeMap::new();
        for (fi, f) in self.files.iter().enumerate() {
            let path = f.path().to_path_buf();
            let meta = f.metadata();
            let rank = meta
                .get("rank")
                .and_then(|r| r.parse::<u64>().ok())
                .or_else(|| path.parent().and_then(rank_dir_number));
            let Some(rank) = rank else {
                problems.push(Error::Mismatch {
                    what: format!("{}: no `rank` in __metadata__", path.display()),
                });
                continue;
            };
            if let Some(w) = meta.get("world_size") {
                if w != &world.to_string() {
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: world_size {w} but the strategy's mesh has {world} ranks",
                            path.display()
                        ),
                    });
                }
            }
            if let Some(h) = meta.get("strategy_hash") {
                if h != &hash {
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: strategy_hash {h} does not match strategy.json ({hash})",
                            path.display()
                        ),
                    });
                }
            }
            if rank >= world {
                problems.push(Error::Mismatch {
                    what: format!(
                        "{}: rank {rank} but the world size is {world}",
                        path.display()
                    ),
                });
                continue;
            }
            if let Some(other) = seen.insert(rank, path.clone()) {
                problems.push(Error::Mismatch {
                    what: format!(
                        "{}: rank {rank} appears twice (also {})",
                        path.display(),
                        other.display()
                    ),
                });
                continue;
            }
            self.ranks[fi] = Some(rank);
            for (ti, t) in f.tensors().iter().enumerate() {
                let Some(layout) = strategy.tensors.get(&t.name) else {
                    problems.push(Error::InvalidTensor {
                        tensor: t.name.clone(),
                        problem: format!("in {} but not in the strategy", path.display()),
                    });
                    continue;
                };
                let want = layout.local_shape(&strategy.mesh, rank);
                if want.as_deref() != Some(&t.shape[..]) || t.dtype != layout.dtype {
                    problems.push(Error::InvalidTensor {
                        tensor: t.name.clone(),
                        problem: format!(
                            "{} holds {} {:?} but the strategy gives rank {rank} {} {}",
                            path.display(),
                            dtype_name(t.dtype),
                            t.shape,
                            dtype_name(layout.dtype),
                            want.map_or("nothing (other pipeline stage)".into(), |w| format!(
                                "{w:?}"
                            ))
                        ),
                    });
                    continue;
                }
                let entry = raw.entry(t.name.clone()).or_default();
                for p in layout.pieces(&strategy.mesh, rank) {
                    entry.push(SourcePiece {
                        file: fi,
                        tensor: ti,
                        global: p.global,
                        local: p.local,
                    });
                }
            }
        }
        problems.extend(missing_ranks(world, &seen, |r| {
            format!("no ckpt_{r}/{MODEL_FILE} among the inputs")
        }));
        // Tensors of the strategy that no file holds are reported by the coverage check.
        for (name, st) in &strategy.tensors {
            raw.entry(name.clone()).or_default();
            self.tensors.insert(
                name.clone(),
                SourceTensor {
                    dtype: st.dtype,
                    shape: st.shape.clone(),
                    pieces: vec![],
                    copies: vec![],
                },
            );
        }
        self.strategy = Some(strategy);
        Ok(())
    }

    fn read_boxes(
        &mut self,
        raw: &mut BTreeMap<String, Vec<SourcePiece>>,
        problems: &mut Vec<Error>,
    ) {
        // Tensors stored whole (no offsets) by more than one file: (file, tensor) each.
        let mut whole: BTreeMap<&str, Vec<(usize, usize)>> = BTreeMap::new();
        for (fi, f) in self.files.iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                if t.offsets.is_none() {
                    whole.entry(&t.name).or_default().push((fi, ti));
                }
            }
        }
        let mut ambiguous = BTreeSet::new();
        for (name, at) in whole.iter().filter(|(_, at)| at.len() > 1) {
            if let Some(problem) = self.unequal_copies(at) {
                problems.push(Error::Ambiguous {
                    tensor: (*name).to_string(),
                    files: at
                        .iter()
                        .map(|&(fi, _)| self.files[fi].path().display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    problem,
                });
                ambiguous.insert((*name).to_string());
            }
        }
        for (fi, f) in self.files.iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                if ambiguous.contains(&t.name) {
                    continue;
                }
                let start = t.offsets.clone().unwrap_or_else(|| vec![0; t.shape.len()]);
                let global = Region::new(start, t.shape.clone());
                let dtype = t.dtype;
                let shape_so_far = self.tensors.entry(t.name.clone()).or_insert(SourceTensor {
                    dtype,
                    shape: vec![0; t.shape.len()],
                    pieces: vec![],
                    copies: vec![],
                });
                if shape_so_far.dtype != dtype || shape_so_far.shape.len() != t.shape.len() {
                    problems.push(Error::InvalidTensor {
                        tensor: t.name.clone(),
                        problem: format!(
                            "{} holds {} with {} dims, other files {} with {} dims",
                            f.path().display(),
                            dtype_name(dtype),
                            t.shape.len(),
                            dtype_name(shape_so_far.dtype),
                            shape_so_far.shape.len()
                        ),
                    });
                    continue;
                }
                for d in 0..t.shape.len() {
                    shape_so_far.shape[d] = shape_so_far.shape[d].max(global.end(d));
                }
                raw.entry(t.name.clone()).or_default().push(SourcePiece {
                    file: fi,
                    tensor: ti,
                    local: Region::full(&t.shape),
                    global,
                });
            }
        }
    }

    /// MindSpore per-rank files laid out by a MindSpore strategy: each tensor's global
    /// shape follows from its stored slice and its layout, each rank's pieces from the
    /// layout converted to ours ([`from_mindspore`](crate::from_mindspore)). When every
    /// split tensor has the same device matrix (and there is no pipeline), the layouts
    /// also form one ckpt [`Strategy`], so `--to` and `--mesh` apply as to ckpt's own.
    fn read_mindspore(
        &mut self,
        params: &BTreeMap<String, crate::formats::mindspore_strategy::MindSporeParam>,
        raw: &mut BTreeMap<String, Vec<SourcePiece>>,
        problems: &mut Vec<Error>,
    ) -> Result<()> {
        let mismatch = |what: String| Error::Mismatch { what };
        // Devices per stage: every parameter's device matrix covers one stage.
        let mut per_stage: Option<u64> = None;
        let mut stages = 1u64;
        for (name, p) in params {
            let n = p
                .layout
                .dev_matrix
                .iter()
                .try_fold(1u64, |a, &b| a.checked_mul(b))
                .ok_or_else(|| crate::error::overflow(format!("device matrix of `{name}`")))?;
            match per_stage {
                None => per_stage = Some(n),
                Some(m) if m != n => {
                    return Err(Error::InvalidStrategy {
                        problem: format!(
                            "parameter `{name}` has a device matrix of {n} devices, others of {m}"
                        ),
                    })
                }
                Some(_) => {}
            }
            stages = stages.max(p.stage + 1);
        }
        let per_stage = per_stage.ok_or_else(|| Error::InvalidStrategy {
            problem: "the MindSpore strategy describes no parameter".into(),
        })?;
        let world = per_stage
            .checked_mul(stages)
            .ok_or_else(|| crate::error::overflow("world size".to_string()))?;
        let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
        let mut known: BTreeMap<String, (Mesh, TensorLayout)> = BTreeMap::new();
        for (fi, f) in self.files.iter().enumerate() {
            let path = f.path().display().to_string();
            let rank = f
                .path()
                .parent()
                .and_then(rank_dir_number)
                .or_else(|| f.metadata().get("rank").and_then(|r| r.parse().ok()));
            let Some(rank) = rank else {
                problems.push(mismatch(format!(
                    "{path}: no rank (expected it in a rank_<r>/ or ckpt_<r>/ directory)"
                )));
                continue;
            };
            if rank >= world {
                problems.push(mismatch(format!(
                    "{path}: rank {rank} but the MindSpore strategy has {world} ranks"
                )));
                continue;
            }
            if let Some(other) = seen.insert(rank, fi) {
                problems.push(mismatch(format!(
                    "{path}: rank {rank} appears twice (also {})",
                    self.files[other].path().display()
                )));
                continue;
            }
            self.ranks[fi] = Some(rank);
            let (stage, local) = (rank / per_stage, rank % per_stage);
            // A slice MindSpore split into several records is one tensor of the file,
            // held as boxes (`offsets` within the slice): `records` lists them.
            let mut by_name: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
            for (ti, t) in f.tensors().iter().enumerate() {
                by_name.entry(&t.name).or_default().push(ti);
            }
            for (ti, t) in f.tensors().iter().enumerate() {
                let records = &by_name[t.name.as_str()];
                if records[0] != ti {
                    continue;
                }
                // The slice's shape: a whole record's, or the extent of the boxes.
                let slice_shape: Vec<u64> = match &t.offsets {
                    None => t.shape.clone(),
                    Some(_) => (0..t.shape.len())
                        .map(|d| {
                            records
                                .iter()
                                .map(|&i| {
                                    let e = &f.tensors()[i];
                                    e.offsets.as_ref().map_or(0, |o| o[d]) + e.shape[d]
                                })
                                .max()
                                .unwrap_or(0)
                        })
                        .collect(),
                };
                let t = &TensorEntryView {
                    name: &t.name,
                    dtype: t.dtype,
                    shape: &slice_shape,
                };
                let bad = |problem: String| Error::InvalidTensor {
                    tensor: t.name.clone(),
                    problem,
                };
                let Some(p) = params.get(t.name) else {
                    problems.push(bad(format!("in {path} but not in the MindSpore strategy")));
                    continue;
                };
                if p.stage != stage {
                    problems.push(bad(format!(
                        "{path} (rank {rank}, stage {stage}) holds it, but the strategy puts it in stage {}",
                        p.stage
                    )));
                    continue;
                }
                let global = match ms_global_shape(&p.layout, t.shape) {
                    Ok(g) => g,
                    Err(e) => {
                        problems.push(bad(format!("{path}: {e}")));
                        continue;
                    }
                };
                let (mesh, layout) = match crate::layout::mindspore::from_mindspore(
                    t.name, &p.layout, global, t.dtype,
                ) {
                    Ok(x) => x,
                    Err(e) => {
                        problems.push(e);
                        continue;
                    }
                };
                if let Some((m0, l0)) = known.get(t.name) {
                    if (m0, &l0.shape, l0.dtype) != (&mesh, &layout.shape, layout.dtype) {
                        problems.push(bad(format!(
                            "{path} holds {} {:?}, a slice of {:?}, but other ranks hold slices of {} {:?}",
                            dtype_name(t.dtype),
                            t.shape,
                            layout.shape,
                            dtype_name(l0.dtype),
                            l0.shape
                        )));
                        continue;
                    }
                }
                let want = layout.local_shape(&mesh, local);
                if want.as_deref() != Some(t.shape) {
                    problems.push(bad(format!(
                        "{path} holds {:?} but the strategy gives rank {rank} {want:?}",
                        t.shape
                    )));
                    continue;
                }
                let entry = raw.entry(t.name.clone()).or_default();
                for piece in layout.pieces(&mesh, local) {
                    for &ri in records {
                        // Each record box holds part of the slice: the piece's part in
                        // it, in the record's own coordinates.
                        let e = &f.tensors()[ri];
                        let origin = e.offsets.clone().unwrap_or_else(|| vec![0; e.shape.len()]);
                        let rec = Region::new(origin.clone(), e.shape.clone());
                        let Some(part) = piece.local.overlap(&rec) else {
                            continue;
                        };
                        let shift = part.relative_to(&piece.local.start);
                        entry.push(SourcePiece {
                            file: fi,
                            tensor: ri,
                            global: shift.offset(&piece.global.start),
                            local: part.relative_to(&origin),
                        });
                    }
                }
                known.entry(t.name.clone()).or_insert((mesh, layout));
            }
        }
        problems.extend(missing_ranks(world, &seen, |r| {
            format!("no rank_{r}/ checkpoint among the inputs")
        }));
        for name in params.keys().filter(|n| !known.contains_key(*n)) {
            problems.push(Error::CoverageGap {
                tensor: name.clone(),
                region: "all".into(),
            });
        }
        for (name, (_, l)) in &known {
            self.tensors.insert(
                name.clone(),
                SourceTensor {
                    dtype: l.dtype,
                    shape: l.shape.clone(),
                    pieces: vec![],
                    copies: vec![],
                },
            );
        }
        if stages == 1 {
            self.strategy = crate::layout::mindspore::common_strategy(&known);
        }
        Ok(())
    }

    /// DCP's sharded safetensors record neither global shapes nor the world size, so
    /// shapes are inferred from the pieces present. ckpt's own DCP output also records
    /// `rank` and `world_size`: with them, every rank must be among the inputs.
    fn check_dcp_ranks(&mut self, problems: &mut Vec<Error>) {
        let mut worlds = BTreeSet::new();
        let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
        let mut recorded = 0;
        let mut sharded = 0;
        for (fi, f) in self.files.iter().enumerate() {
            if matches!(f.format(), FileFormat::Distcp | FileFormat::DeepSpeed) {
                // `.metadata` lists every chunk: coverage is checked exactly instead.
                continue;
            }
            sharded += 1;
            let meta = f.metadata();
            let rank = meta.get("rank").and_then(|r| r.parse::<u64>().ok());
            let world = meta.get("world_size").and_then(|w| w.parse::<u64>().ok());
            if let (Some(rank), Some(world)) = (rank, world) {
                recorded += 1;
                worlds.insert(world);
                if let Some(other) = seen.insert(rank, fi) {
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: rank {rank} appears twice (also {})",
                            f.path().display(),
                            self.files[other].path().display()
                        ),
                    });
                }
                self.ranks[fi] = Some(rank);
            }
        }
        if sharded == 0 {
            return;
        }
        if recorded < sharded {
            self.notes.push(
                "shapes inferred from the pieces present (PyTorch's sharded safetensors record \
                 neither global shapes nor the world size): a missing last rank cannot be detected"
                    .into(),
            );
            return;
        }
        if worlds.len() > 1 {
            problems.push(Error::Mismatch {
                what: format!("the files disagree on the world size: {worlds:?}"),
            });
            return;
        }
        let world = worlds.into_iter().next().unwrap_or(0);
        problems.extend(missing_ranks(world, &seen, |_| {
            "its DCP file is not among the inputs".into()
        }));
        if let Some((&r, &fi)) = seen.iter().find(|(&r, _)| r >= world) {
            problems.push(Error::Mismatch {
                what: format!(
                    "{}: rank {r} but the world size is {world}",
                    self.files[fi].path().display()
                ),
            });
        }
    }

    /// Shapes a format's reader declares (DeepSpeed's `param_shapes`): as DCP's.
    fn declare_shapes(
        &mut self,
        shapes: &BTreeMap<String, (Dtype, Vec<u64>)>,
        problems: &mut Vec<Error>,
    ) {
        for (name, (dtype, shape)) in shapes {
            let t = self.tensors.entry(name.clone()).or_insert(SourceTensor {
                dtype: *dtype,
                shape: shape.clone(),
                pieces: vec![],
                copies: vec![],
            });
            if t.dtype != *dtype || t.shape.len() != shape.len() {
                problems.push(Error::InvalidTensor {
                    tensor: name.clone(),
                    problem: format!(
                        "declared {} {shape:?}, its pieces hold {} with {} dims",
                        dtype_name(*dtype),
                        dtype_name(t.dtype),
                        t.shape.len()
                    ),
                });
            } else {
                t.shape.clone_from(shape);
            }
        }
    }

    /// DCP's `.metadata` records every tensor's dtype and global shape: they replace
    /// the shapes inferred from the pieces, so a missing piece is a coverage gap, and a
    /// tensor no input holds a piece of is named.
    fn declare_dcp_shapes(
        &mut self,
        dirs: &BTreeMap<PathBuf, DcpMetadata>,
        problems: &mut Vec<Error>,
    ) {
        for (dir, m) in dirs {
            for (name, d) in &m.tensors {
                match self.tensors.get_mut(name) {
                    Some(t) if t.dtype != d.dtype || t.shape.len() != d.shape.len() => {
                        problems.push(Error::InvalidTensor {
                            tensor: name.clone(),
                            problem: format!(
                                "{} declares {} {:?}, its chunks hold {} with {} dims",
                                dir.join(distcp::METADATA_FILE).display(),
                                dtype_name(d.dtype),
                                d.shape,
                                dtype_name(t.dtype),
                                t.shape.len()
                            ),
                        });
                    }
                    Some(t) => t.shape.clone_from(&d.shape),
                    None => {
                        self.tensors.insert(
                            name.clone(),
                            SourceTensor {
                                dtype: d.dtype,
                                shape: d.shape.clone(),
                                pieces: vec![],
                                copies: vec![],
                            },
                        );
                    }
                }
            }
        }
    }

    /// Why copies of a tensor stored whole in several files cannot be taken as one
    /// tensor replicated: different shapes or dtypes (slices of something larger, laid
    /// out by a strategy the inputs do not include), or different bytes. `None` when
    /// they are byte-equal copies, which is the only case that is not a guess.
    fn unequal_copies(&self, at: &[(usize, usize)]) -> Option<String> {
        let (f0, t0) = at[0];
        let first = &self.files[f0].tensors()[t0];
        for &(fi, ti) in &at[1..] {
            let t = &self.files[fi].tensors()[ti];
            if t.shape != first.shape || t.dtype != first.dtype {
                return Some(format!(
                    "held whole by {} files with different shapes ({} {:?} in {}, {} {:?} in {}) \
                     and no offsets: slices of a larger tensor, but how they were split is not \
                     recorded; give the strategy file that says it",
                    at.len(),
                    dtype_name(first.dtype),
                    first.shape,
                    self.files[f0].path().display(),
                    dtype_name(t.dtype),
                    t.shape,
                    self.files[fi].path().display()
                ));
            }
            if !self.same_bytes((f0, t0), (fi, ti)) {
                return Some(format!(
                    "held by {} files with the same shape {:?} but different bytes ({} and {}), \
                     and no offsets: per-rank slices or diverged copies; give the strategy file \
                     that says how the tensor is split",
                    at.len(),
                    first.shape,
                    self.files[f0].path().display(),
                    self.files[fi].path().display()
                ));
            }
        }
        None
    }

    /// Whether two stored tensors of equal size hold the same bytes, compared a window
    /// at a time (compressed files decompress only that much at once). An unreadable
    /// one counts as different: its copies cannot be trusted to agree.
    fn same_bytes(&self, (fa, ta): (usize, usize), (fb, tb): (usize, usize)) -> bool {
        let (a, b) = (&self.files[fa], &self.files[fb]);
        let len = a.tensors()[ta].end - a.tensors()[ta].start;
        let (mut ca, mut cb) = (ReadCache::new(), ReadCache::new());
        let window = COMPARE_WINDOW;
        let mut pos = 0;
        while pos < len {
            let end = (pos + window).min(len);
            match (a.read(ta, pos..end, &mut ca), b.read(tb, pos..end, &mut cb)) {
                (Ok(x), Ok(y)) if x == y => {}
                _ => return false,
            }
            pos = end;
        }
        true
    }

    /// Dedupes identical pieces (keeping the first as owner), then checks that the
    /// owners tile every tensor.
    fn assemble(&mut self, raw: BTreeMap<String, Vec<SourcePiece>>, problems: &mut Vec<Error>) {
        for (name, mut pieces) in raw {
            let Some(t) = self.tensors.get_mut(&name) else {
                continue;
            };
            pieces.sort_by(|a, b| (&a.global, a.file).cmp(&(&b.global, b.file)));
            let mut owners: Vec<SourcePiece> = Vec::with_capacity(pieces.len());
            for p in pieces {
                match owners.last() {
                    Some(o) if o.global == p.global => {
                        let k = owners.len() - 1;
                        t.copies.push((k, p));
                    }
                    _ => owners.push(p),
                }
            }
            let full = Region::full(&t.shape);
            let mut ok = true;
            for p in &owners {
                if !full.contains(&p.global) {
                    problems.push(Error::InvalidTensor {
                        tensor: name.clone(),
                        problem: format!(
                            "{} holds {} outside the shape {:?}",
                            self.files[p.file].path().display(),
                            p.global,
                            t.shape
                        ),
                    });
                    ok = false;
                }
            }
            if ok {
                let boxes: Vec<Region> = owners.iter().map(|p| p.global.clone()).collect();
                match check_tiling(&t.shape, &boxes) {
                    Ok(()) => {}
                    Err(Defect::Gap { region }) => {
                        problems.push(Error::CoverageGap {
                            tensor: name.clone(),
                            region: region.to_string(),
                        });
                    }
                    Err(Defect::Overlap { a, b, region }) => problems.push(Error::Overlap {
                        tensor: name.clone(),
                        a: self.files[owners[a].file].path().display().to_string(),
                        b: self.files[owners[b].file].path().display().to_string(),
                        region: region.to_string(),
                    }),
                }
            }
            t.pieces = owners;
        }
    }

    /// Label of a file for messages: its path, and rank when known.
    #[must_use]
    pub fn label(&self, file: usize) -> String {
        match self.ranks[file] {
            Some(r) => format!("{} (rank {r})", self.files[file].path().display()),
            None => self.files[file].path().display().to_string(),
        }
    }

    /// Total bytes of tensor data in all input files.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|f| f.tensors().iter().map(|t| t.end - t.start).sum::<u64>())
            .sum()
    }
}

/// One problem per rank below `world` that is not in `seen`, the first [`MAX_LISTED`]
/// by name and the rest counted. The work is bounded by the ranks present, not by the
/// world size a file claims (a mesh of 10^12 ranks costs no more than one of 4).
fn missing_ranks<V>(
    world: u64,
    seen: &BTreeMap<u64, V>,
    why: impl Fn(u64) -> String,
) -> Vec<Error> {
    let present = seen.range(..world).count() as u64;
    let total = world - present;
    let mut out = Vec::new();
    let mut r = 0;
    while (out.len() as u64) < total.min(MAX_LISTED as u64) {
        if !seen.contains_key(&r) {
            out.push(Error::Mismatch {
                what: format!("rank {r} of {world} is missing ({})", why(r)),
            });
        }
        r += 1;
    }
    if total > out.len() as u64 {
        out.push(Error::Mismatch {
            what: format!("... and {} more missing ranks", total - out.len() as u64),
        });
    }
    out
}

/// The global shape of a MindSpore tensor whose slice is `local`: each dimension times
/// the device axes that split it (and dimension 0 times the optimizer shard).
fn ms_global_shape(
    l: &crate::layout::mindspore::MindSporeLayout,
    local: &[u64],
) -> std::result::Result<Vec<u64>, String> {
    use crate::layout::mindspore::MapEntry;
    if l.tensor_map.len() != local.len() {
        return Err(format!(
            "a slice of {} dims but a tensor_map of {} entries",
            local.len(),
            l.tensor_map.len()
        ));
    }
    let n = l.dev_matrix.len();
    let mut out = Vec::with_capacity(local.len());
    for (d, (entry, &len)) in l.tensor_map.iter().zip(local).enumerate() {
        let ks: Vec<i64> = match entry {
            MapEntry::One(k) => vec![*k],
            MapEntry::Many(v) => v.clone(),
        };
        let mut splits = 1u64;
        for k in ks.into_iter().filter(|&k| k != -1) {
            let size = usize::try_from(k)
                .ok()
                .filter(|&k| k < n)
                .map(|k| l.dev_matrix[n - 1 - k])
                .ok_or_else(|| {
                    format!("tensor_map value {k} is outside a device matrix of {n} axes")
                })?;
            splits = splits.checked_mul(size).ok_or("split count overflows")?;
        }
        if d == 0 && l.opt_shard_size > 1 {
            splits = splits
                .checked_mul(l.opt_shard_size)
                .ok_or("split count overflows")?;
        }
        out.push(len.checked_mul(splits).ok_or("global shape overflows")?);
    }
    Ok(out)
}

impl PieceSource for Checkpoint {
    fn source_tensors(&self) -> &BTreeMap<String, SourceTensor> {
        &self.tensors
    }

    fn stored_shape(&self, file: usize, tensor: usize) -> &[u64] {
        &self.files[file].tensors()[tensor].shape
    }
}
