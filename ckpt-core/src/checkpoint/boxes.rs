//! Checkpoints whose files say where each piece sits (or hold tensors whole): Hugging
//! Face files, DCP, DeepSpeed; the global shapes inferred from the pieces or declared
//! by a format's metadata.

use super::sliced::missing_ranks;
use super::{unplaced, Checkpoint};
use crate::error::Error;
use crate::formats::distcp::{self, DcpMetadata};
use crate::formats::{torch_save, FileFormat, ReadCache};
use crate::layout::region::Region;
use crate::layout::source::SourcePiece;
use crate::layout::strategy::dtype_name;
use crate::layout::Dtype;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Bytes of two copies compared at once (a compressed file decompresses that much).
const COMPARE_WINDOW: u64 = 4 << 20;
impl Checkpoint {
    pub(super) fn read_boxes(
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
                let shape_so_far = self
                    .tensors
                    .entry(t.name.clone())
                    .or_insert_with(|| unplaced(dtype, vec![0; t.shape.len()]));
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
                    view: None,
                    compute: None,
                });
            }
        }
    }

    /// DCP's sharded safetensors record neither global shapes nor the world size, so
    /// shapes are inferred from the pieces present. ckpt's own DCP output also records
    /// `rank` and `world_size`: with them, every rank must be among the inputs.
    pub(super) fn check_dcp_ranks(&mut self, problems: &mut Vec<Error>) {
        let mut worlds = BTreeSet::new();
        let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
        let mut recorded = 0;
        let mut sharded = 0;
        for (fi, f) in self.files.iter().enumerate() {
            if matches!(
                f.format(),
                FileFormat::Distcp | FileFormat::DeepSpeed | FileFormat::Orbax
            ) {
                // `.metadata` (zarr's metadata) lists every chunk: coverage is checked
                // exactly instead.
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
                    // verl saves `model_`, `optim_` and `extra_state_world_size_N_rank_R.pt`
                    // side by side: which of them to merge is the user's to say.
                    let hint = if f.format() == FileFormat::TorchSave
                        && self.files[other].format() == FileFormat::TorchSave
                    {
                        ": several torch.save files per rank (verl's model_, optim_ and \
                         extra_state_ files): pass the files of one kind, e.g. \
                         DIR/model_world_size_*.pt"
                    } else {
                        ""
                    };
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: rank {rank} appears twice (also {}){hint}",
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
        // Per-rank torch.save files of DTensors (`model_world_size_4_rank_0.pt`): the
        // missing one named after a present one.
        // (The path the missing file would have, beside the present one.)
        let torch_name = seen.iter().find_map(|(&r, &fi)| {
            let f = &self.files[fi];
            let name = f.path().file_name()?.to_str()?;
            let at = format!("rank_{r}.");
            (f.format() == FileFormat::TorchSave && name.contains(&at))
                .then(|| (f.path().with_file_name(""), name.to_string(), at))
        });
        problems.extend(missing_ranks(world, &seen, |m| match &torch_name {
            Some((dir, name, at)) => format!(
                "its torch.save file {} is not among the inputs",
                dir.join(name.replace(at, &format!("rank_{m}."))).display()
            ),
            None => "its DCP file is not among the inputs".into(),
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
    pub(super) fn declare_shapes(
        &mut self,
        shapes: &BTreeMap<String, (Dtype, Vec<u64>)>,
        problems: &mut Vec<Error>,
    ) {
        for (name, (dtype, shape)) in shapes {
            let t = self
                .tensors
                .entry(name.clone())
                .or_insert_with(|| unplaced(*dtype, shape.clone()));
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

    /// The global shapes per-rank `torch.save` files of DTensors declare (each file
    /// those of its own DTensors): as DCP's, so a missing piece is a coverage gap; two
    /// files that declare different shapes for one tensor are named.
    pub(super) fn declare_dtensor_shapes(&mut self, problems: &mut Vec<Error>) {
        let mut shapes: BTreeMap<String, (Dtype, Vec<u64>, usize)> = BTreeMap::new();
        for (fi, f) in self.files.iter().enumerate() {
            let Some(text) = f.metadata().get(torch_save::DTENSOR_SHAPES) else {
                continue;
            };
            let declared: BTreeMap<String, Vec<u64>> = match serde_json::from_str(text) {
                Ok(d) => d,
                Err(e) => {
                    problems.push(Error::Mismatch {
                        what: format!("{}: DTensor shapes unreadable: {e}", f.path().display()),
                    });
                    continue;
                }
            };
            for (name, shape) in declared {
                let Some(t) = f.tensors().iter().find(|t| t.name == name) else {
                    continue;
                };
                match shapes.get(&name) {
                    Some((_, s, other)) if *s != shape => problems.push(Error::InvalidTensor {
                        tensor: name.clone(),
                        problem: format!(
                            "a DTensor of global shape {s:?} in {}, {shape:?} in {}",
                            self.files[*other].path().display(),
                            f.path().display()
                        ),
                    }),
                    Some(_) => {}
                    None => {
                        shapes.insert(name, (t.dtype, shape, fi));
                    }
                }
            }
        }
        let shapes = shapes
            .into_iter()
            .map(|(n, (d, s, _))| (n, (d, s)))
            .collect();
        self.declare_shapes(&shapes, problems);
    }

    /// DCP's `.metadata` records every tensor's dtype and global shape: they replace
    /// the shapes inferred from the pieces, so a missing piece is a coverage gap, and a
    /// tensor no input holds a piece of is named.
    pub(super) fn declare_dcp_shapes(
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
                        self.tensors
                            .insert(name.clone(), unplaced(d.dtype, d.shape.clone()));
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
}
