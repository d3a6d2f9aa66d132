//! `Checkpoint`: a set of safetensors files read as pieces of global tensors.
//!
//! Three kinds are understood: ckpt's sliced rank directories (`ckpt_<r>/` with
//! `model.safetensors` and `strategy.json`), Hugging Face integrated checkpoints
//! (`model.safetensors` or shards with `model.safetensors.index.json`), and PyTorch
//! DCP sharded safetensors (`DCP_SHARDING_INFO` offsets, layout inferred).

use crate::coverage::{check_tiling, Defect};
use crate::error::{Error, IoContext, Problems, Result};
use crate::formats::TensorFile;
use crate::region::Region;
use crate::select::Selection;
use crate::strategy::{dtype_name, Strategy};
use crate::Dtype;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Metadata key of PyTorch DCP's per-tensor offsets.
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";
/// Name of a strategy file.
pub const STRATEGY_FILE: &str = "strategy.json";
/// Name of a single-file integrated checkpoint and of a rank's file.
pub const MODEL_FILE: &str = "model.safetensors";
/// Name of a Hugging Face shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// In a training output directory, the file naming its newest checkpoint.
pub(crate) const LATEST_FILE: &str = "latest";
/// Files carried through from input to output when present.
pub const CARRIED_FILES: [&str; 2] = ["config.json", "trainer_state.json"];

/// Most problems of one kind listed one by one; the rest are counted.
pub(crate) const MAX_LISTED: usize = 20;

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

/// One box of a tensor held by one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePiece {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Index of the tensor within that file.
    pub tensor: usize,
    /// Where the box lies in the global tensor.
    pub global: Region,
    /// Where it lies in the file's tensor.
    pub local: Region,
}

/// A global tensor assembled from pieces.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The pieces to read: disjoint, each element exactly once (lowest rank first).
    pub pieces: Vec<SourcePiece>,
    /// Further copies of pieces (replicated data kept by non-owners), for deep checks.
    pub copies: Vec<(usize, SourcePiece)>,
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

/// An input file and what we know of it before reading it.
struct Input {
    path: PathBuf,
    strategy: Option<PathBuf>,
}

fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

fn rank_dir_number(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("ckpt_")?
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

fn expand(
    path: &Path,
    out: &mut Vec<Input>,
    carried: &mut BTreeMap<String, PathBuf>,
) -> Result<()> {
    if path.is_file() {
        let dir = path.parent().unwrap_or(Path::new("."));
        let s = dir.join(STRATEGY_FILE);
        note_carried(dir, carried);
        out.push(Input {
            path: path.to_path_buf(),
            strategy: s.is_file().then_some(s),
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
    // A training output directory: `latest` names its newest complete checkpoint.
    let latest = path.join(LATEST_FILE);
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
        return expand(&target, out, carried);
    }
    note_carried(path, carried);
    let model = path.join(MODEL_FILE);
    let strategy = path.join(STRATEGY_FILE);
    if model.is_file() && strategy.is_file() {
        out.push(Input {
            path: model,
            strategy: Some(strategy),
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
            expand(&d, out, carried)?;
        }
        return Ok(());
    }
    let index = path.join(INDEX_FILE);
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
            out.push(Input {
                path: path.join(f),
                strategy: None,
            });
        }
        return Ok(());
    }
    if model.is_file() {
        out.push(Input {
            path: model,
            strategy: None,
        });
        return Ok(());
    }
    let st: Vec<PathBuf> = entries
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    if st.is_empty() {
        return Err(unknown(format!(
            "{}: no checkpoint here (expected ckpt_<r>/ rank directories, {MODEL_FILE}, {INDEX_FILE} or *.safetensors)",
            path.display()
        )));
    }
    for p in st {
        out.push(Input {
            path: p,
            strategy: None,
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
        let (mut ck, mut problems) = Checkpoint::scan(paths)?;
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
        let mut inputs = Vec::new();
        let mut carried = BTreeMap::new();
        for p in paths {
            expand(p, &mut inputs, &mut carried)?;
        }
        let mut problems = Vec::new();
        let mut files = Vec::new();
        let mut strategies = Vec::new();
        for input in inputs {
            match TensorFile::open(&input.path) {
                Ok(f) => {
                    files.push(f);
                    strategies.push(input.strategy);
                }
                Err(e) => problems.push(e),
            }
        }
        if files.is_empty() && !problems.is_empty() {
            // Nothing could be read: there is no checkpoint to describe, only why.
            return Err(Error::Many(Problems(problems)));
        }
        let sliced = strategies.iter().filter(|s| s.is_some()).count();
        let dcp = files
            .iter()
            .filter(|f| f.tensors().iter().any(|t| t.offsets.is_some()))
            .count();
        let kind = if sliced > 0 {
            if sliced != strategies.len() {
                return Err(unknown(
                    "inputs mix rank directories (with strategy.json) and other files".into(),
                ));
            }
            Kind::Sliced
        } else if dcp > 0 {
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
            notes: Vec::new(),
        };
        let mut raw: BTreeMap<String, Vec<SourcePiece>> = BTreeMap::new();
        match kind {
            Kind::Sliced => ck.read_sliced(&strategies, &mut raw, &mut problems)?,
            Kind::Dcp | Kind::Integrated => ck.read_boxes(&mut raw, &mut problems),
        }
        if kind == Kind::Dcp {
            ck.check_dcp_ranks(&mut problems);
        }
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

    /// DCP's sharded safetensors record neither global shapes nor the world size, so
    /// shapes are inferred from the pieces present. ckpt's own DCP output also records
    /// `rank` and `world_size`: with them, every rank must be among the inputs.
    fn check_dcp_ranks(&mut self, problems: &mut Vec<Error>) {
        let mut worlds = BTreeSet::new();
        let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
        let mut recorded = 0;
        for (fi, f) in self.files.iter().enumerate() {
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
        if recorded < self.files.len() {
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
            if self.files[fi].data(ti) != self.files[f0].data(t0) {
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
