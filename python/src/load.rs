//! Loading into memory: a [`LoadPlan`] says, from metadata alone, which bytes every
//! requested tensor (or piece of one) needs; tensors whose bytes are one run of an
//! uncompressed file are handed out as views of the mapping, the others are assembled
//! by ckpt-core's copy engine straight into memory the framework allocated.

use crate::errors::{to_py, usage, IntoPy};
use ckpt_core::engine::copy::{assemble_into, assemble_part_into};
use ckpt_core::formats::FileFormat;
use ckpt_core::layout::plan::{
    bytes_of, check_cast, rank_tensors, CopyPlan, TargetFile, TargetTensor, TensorPlan,
};
use ckpt_core::layout::region::{Region, Runs};
use ckpt_core::layout::strategy::{dtype_name, parse_dtype};
use ckpt_core::layout::{Dtype, Piece};
use ckpt_core::{Checkpoint, Error, Problems};
use pyo3::prelude::*;
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

/// One requested box: `(name, global shape, dtype, start, local shape)`.
pub(crate) type BoxRequest = (String, Vec<u64>, String, Vec<u64>, Vec<u64>);

/// The planned tensors of one load.
#[pyclass(module = "ckpt._ckpt", frozen)]
pub(crate) struct LoadPlan {
    source: Arc<Checkpoint>,
    tensors: Arc<Vec<TensorPlan>>,
}

/// Where tensor `t`'s bytes lie as one run of a plain file: `(path, byte offset)`.
fn view_of(source: &Checkpoint, t: &TensorPlan) -> Option<(PathBuf, u64)> {
    let [op] = &t.ops[..] else {
        return None;
    };
    let dtype = t.target.dtype;
    if dtype != t.src_dtype
        || !(dtype.bitsize()).is_multiple_of(8)
        || op.src.shape[..] != t.target.shape[..]
        || op.axes.is_some()
        || op.compute.is_some()
    {
        return None;
    }
    let file = &source.files[op.file];
    // A compressed file has no run of plain bytes; an object of a bucket has no local
    // file Python could map (its pages come through ckpt's own mapping).
    if file.format() == FileFormat::Ckptz || file.is_remote() {
        return None;
    }
    let numel = op.src.numel();
    let mut runs = Runs::new(
        &op.src.shape,
        &op.src_shape,
        &op.src.start,
        &t.target.shape,
        &op.dst_start,
    );
    let run = runs.next()?;
    if runs.next().is_some() || run.len != numel || run.dst != 0 {
        return None;
    }
    let entry = &file.tensors()[op.tensor];
    Some((
        file.path().to_path_buf(),
        entry.start.checked_add(bytes_of(dtype, run.src))?,
    ))
}

impl LoadPlan {
    fn build(
        py: Python<'_>,
        source: Arc<Checkpoint>,
        tensors: Vec<TargetTensor>,
    ) -> PyResult<LoadPlan> {
        let plan = CopyPlan::build(
            &*source,
            vec![TargetFile {
                path: PathBuf::new(),
                tensors,
                metadata: BTreeMap::new(),
            }],
        )
        .py_err(py)?;
        let tensors = Arc::new(plan.files.into_iter().flat_map(|f| f.tensors).collect());
        Ok(LoadPlan { source, tensors })
    }

    /// Whole tensors (`rank` None, no target), or what target `rank` holds.
    pub(crate) fn for_rank(
        py: Python<'_>,
        source: Arc<Checkpoint>,
        names: Option<Vec<String>>,
        rank: Option<u64>,
        target: Option<ckpt_reshard::Target>,
        cast: Option<Dtype>,
    ) -> PyResult<LoadPlan> {
        if let Some(names) = &names {
            let missing: Vec<&String> = names
                .iter()
                .filter(|n| !source.tensors.contains_key(*n))
                .collect();
            if !missing.is_empty() {
                return Err(crate::errors::raise(
                    py,
                    "MissingData",
                    format!(
                        "not in the checkpoint: {}",
                        missing
                            .iter()
                            .map(|n| format!("`{n}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
        let wanted: Option<BTreeSet<String>> = names.map(|n| n.into_iter().collect());
        let keep = |name: &str| wanted.as_ref().is_none_or(|w| w.contains(name));
        let mut tensors: Vec<TargetTensor> = match (rank, target) {
            (None, None) => source
                .tensors
                .iter()
                .filter(|(n, _)| keep(n))
                .map(|(name, t)| {
                    let full = Region::full(&t.shape);
                    TargetTensor {
                        name: name.clone(),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        pieces: if full.is_empty() {
                            vec![]
                        } else {
                            vec![Piece {
                                global: full.clone(),
                                local: full,
                            }]
                        },
                    }
                })
                .collect(),
            (None, Some(_)) => return Err(usage(
                py,
                "to, mesh and strategy name a target layout: give the target rank too (rank=...)",
            )),
            (Some(r), target) => {
                let target = match (target, &source.strategy) {
                    (Some(t), _) => t,
                    (None, Some(s)) => ckpt_reshard::Target::Strategy(s.clone()),
                    (None, None) => {
                        return Err(usage(py, format!("rank={r}: this {} checkpoint has no strategy of its own: give the target layout (to=, mesh= or strategy=)", crate::names::kind_name(source.kind))))
                    }
                };
                let strategy = ckpt_reshard::target_strategy(
                    &source,
                    &target,
                    &ckpt_core::layout::select::Selection::default(),
                    &[],
                )
                .py_err(py)?;
                let world = strategy.mesh.world_size();
                if r >= world {
                    return Err(usage(
                        py,
                        format!(
                            "rank={r} but the target mesh {} has {world} ranks",
                            strategy.mesh
                        ),
                    ));
                }
                rank_tensors(&strategy, r, true, &|name, l| keep(name).then_some(l.dtype))
            }
        };
        if let Some(c) = cast {
            // As `--dtype`: floating-point tensors convert, the others stay as stored.
            for t in &mut tensors {
                if check_cast(&t.name, t.dtype, c).is_ok() {
                    t.dtype = c;
                }
            }
        }
        LoadPlan::build(py, source, tensors)
    }

    /// Boxes of global tensors, every request checked first.
    pub(crate) fn for_boxes(
        py: Python<'_>,
        source: Arc<Checkpoint>,
        requests: Vec<BoxRequest>,
    ) -> PyResult<LoadPlan> {
        let mut problems = Vec::new();
        let mut tensors = Vec::with_capacity(requests.len());
        for (name, global, dtype, start, local) in requests {
            let dtype: Dtype = match parse_dtype(&dtype) {
                Ok(d) => d,
                Err(e) => return Err(usage(py, format!("tensor `{name}`: {e}"))),
            };
            let Some(src) = source.tensors.get(&name) else {
                problems.push(Error::InvalidTensor {
                    tensor: name,
                    problem: "is in the state dict but not in the checkpoint".into(),
                });
                continue;
            };
            if src.shape != global {
                problems.push(Error::Mismatch {
                    what: format!(
                        "tensor `{name}`: shape {:?} in the checkpoint, {global:?} in the state dict",
                        src.shape
                    ),
                });
                continue;
            }
            if let Err(e) = check_cast(&name, src.dtype, dtype) {
                problems.push(e);
                continue;
            }
            if start.len() != global.len() || local.len() != global.len() {
                return Err(usage(py, format!("tensor `{name}`: start {start:?} and local shape {local:?} do not fit global shape {global:?}")));
            }
            let piece = Region::new(start, local.clone());
            if !Region::full(&global).contains(&piece) && !piece.is_empty() {
                return Err(usage(
                    py,
                    format!("tensor `{name}`: box {piece} lies outside {global:?}"),
                ));
            }
            tensors.push(TargetTensor {
                name,
                dtype,
                pieces: if piece.is_empty() {
                    vec![]
                } else {
                    vec![Piece {
                        local: Region::full(&local),
                        global: piece,
                    }]
                },
                shape: local,
            });
        }
        match problems.len() {
            0 => LoadPlan::build(py, source, tensors),
            1 => Err(to_py(py, problems.remove(0))),
            _ => Err(to_py(py, Error::Many(Problems(problems)))),
        }
    }
}

/// `(name, dtype, local shape, view)` of one planned tensor ([`LoadPlan::entries`]).
type PlanEntry = (String, String, Vec<u64>, Option<(PathBuf, u64)>);

#[pymethods]
impl LoadPlan {
    /// `(name, dtype, local shape, view)` per tensor, `view` being `(path, byte offset)`
    /// where the bytes are one run of an uncompressed file, else None.
    fn entries(&self) -> Vec<PlanEntry> {
        self.tensors
            .iter()
            .map(|t| {
                (
                    t.target.name.clone(),
                    dtype_name(t.target.dtype),
                    t.target.shape.clone(),
                    view_of(&self.source, t),
                )
            })
            .collect()
    }

    /// Bytes the plan reads from the files.
    fn bytes_read(&self) -> u64 {
        self.tensors
            .iter()
            .flat_map(|t| t.ops.iter().map(|o| bytes_of(t.src_dtype, o.src.numel())))
            .sum()
    }

    /// Checks the recorded checksums of every source tensor the plan reads whole (those
    /// read in part cannot be: the CLI does the same). Returns `(checked, unchecked)`.
    fn check_checksums(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let read = ckpt_core::layout::plan::tensors_read(self.tensors.iter().flat_map(|t| &t.ops));
        let source = &self.source;
        let has_sum = |&(f, t): &(usize, usize)| source.files[f].checksum(t).is_some();
        let whole: Vec<(usize, usize)> = read.whole.iter().copied().filter(has_sum).collect();
        let part = read
            .read
            .difference(&read.whole)
            .filter(|k| has_sum(k))
            .count() as u64;
        py.detach(|| {
            whole
                .par_iter()
                .try_for_each(|&(f, t)| source.files[f].check_checksum(t).map(|_| ()))
        })
        .py_err(py)?;
        Ok((whole.len() as u64, part))
    }

    /// Assembles tensors `(index, address, bytes)` into memory the caller owns, in
    /// parallel, without the GIL. Private to `ckpt`: the addresses are those of live
    /// numpy arrays or torch tensors of exactly `bytes` bytes, kept alive by the caller
    /// for the duration of the call.
    fn fill(&self, py: Python<'_>, items: Vec<(usize, usize, usize)>) -> PyResult<()> {
        for &(i, _, n) in &items {
            let Some(t) = self.tensors.get(i) else {
                return Err(usage(py, format!("no tensor {i} in this plan")));
            };
            let want = bytes_of(t.target.dtype, t.target.shape.iter().product());
            if want != n as u64 {
                return Err(usage(
                    py,
                    format!("tensor `{}` has {want} bytes, {n} given", t.target.name),
                ));
            }
        }
        let source = &self.source;
        let tensors = &self.tensors;
        py.detach(|| {
            items.par_iter().try_for_each(|&(i, addr, n)| {
                if n == 0 {
                    return Ok(());
                }
                // SAFETY: `addr` is the start of `n` writable bytes owned by a live
                // array the caller holds for this call (see above), and no two items
                // share memory (each is a distinct tensor's storage).
                let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n) };
                assemble_into(&tensors[i], source, dst)
            })
        })
        .py_err(py)
    }

    /// Cuts tensors `indices` into chunks of at most `max_bytes` for a load through a
    /// bounded buffer (see [`Chunks`]); `part_bytes` bounds the pieces a chunk is
    /// filled in, in parallel.
    fn chunks(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        max_bytes: u64,
        part_bytes: u64,
    ) -> PyResult<Chunks> {
        if max_bytes == 0 || part_bytes == 0 {
            return Err(usage(py, "chunk and part sizes must be positive"));
        }
        let mut chunks: Vec<Vec<ChunkItem>> = vec![];
        let mut used = 0u64;
        for &i in &indices {
            let Some(t) = self.tensors.get(i) else {
                return Err(usage(py, format!("no tensor {i} in this plan")));
            };
            for part in ckpt_core::engine::copy::tensor_parts(t, part_bytes.min(max_bytes)) {
                if part.bytes == 0 {
                    continue;
                }
                if chunks.is_empty() || used + part.bytes > max_bytes {
                    chunks.push(vec![]);
                    used = 0;
                }
                let at = used;
                used += part.bytes;
                chunks.last_mut().expect("pushed").push(ChunkItem {
                    tensor: i,
                    at,
                    part,
                });
            }
        }
        Ok(Chunks {
            source: self.source.clone(),
            tensors: self.tensors.clone(),
            chunks,
        })
    }

    fn __len__(&self) -> usize {
        self.tensors.len()
    }
}

/// One part of a tensor in a chunk, at byte `at` of the chunk's buffer.
struct ChunkItem {
    tensor: usize,
    at: u64,
    part: ckpt_core::engine::copy::TensorPart,
}

/// A load cut into chunks that each fit one reused buffer (Python's device loads: a
/// chunk is assembled into pinned memory while the previous ones are on their way to
/// the GPU). Source pages are released as they are consumed, so the host memory a
/// load adds is the buffers plus a window of the sources, whatever the checkpoint's
/// size.
#[pyclass(module = "ckpt._ckpt", frozen)]
pub(crate) struct Chunks {
    source: Arc<Checkpoint>,
    tensors: Arc<Vec<TensorPlan>>,
    chunks: Vec<Vec<ChunkItem>>,
}

#[pymethods]
impl Chunks {
    fn __len__(&self) -> usize {
        self.chunks.len()
    }

    /// Bytes of the largest chunk: the buffer size a load needs (at most the chunk
    /// size asked for, unless one innermost row is larger).
    fn buffer_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| c.last().map_or(0, |i| i.at + i.part.bytes))
            .max()
            .unwrap_or(0)
    }

    /// `(tensor index, byte offset in the tensor, bytes, byte offset in the buffer)`
    /// of each part of chunk `k`.
    fn layout(&self, py: Python<'_>, k: usize) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let chunk = self
            .chunks
            .get(k)
            .ok_or_else(|| usage(py, format!("no chunk {k}")))?;
        Ok(chunk
            .iter()
            .map(|i| (i.tensor, i.part.offset, i.part.bytes, i.at))
            .collect())
    }

    /// Assembles chunk `k` into the buffer at `addr` of `n` bytes, its parts in
    /// parallel, without the GIL. Private to `ckpt`: `addr` is a live buffer the caller
    /// holds for the call.
    fn fill(&self, py: Python<'_>, k: usize, addr: usize, n: usize) -> PyResult<()> {
        let chunk = self
            .chunks
            .get(k)
            .ok_or_else(|| usage(py, format!("no chunk {k}")))?;
        let need = chunk.last().map_or(0, |i| i.at + i.part.bytes);
        if (n as u64) < need {
            return Err(usage(
                py,
                format!("chunk {k} needs {need} bytes, {n} given"),
            ));
        }
        let (source, tensors) = (&self.source, &self.tensors);
        py.detach(|| {
            chunk.par_iter().try_for_each(|item| {
                // SAFETY: `addr..addr+n` is a live buffer the caller holds for this
                // call (see above); the items' byte ranges lie inside it (checked
                // above: they end by `need`) and do not overlap (laid end to end).
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        (addr + item.at as usize) as *mut u8,
                        item.part.bytes as usize,
                    )
                };
                assemble_part_into(&tensors[item.tensor], source, &item.part.region, dst)
            })
        })
        .py_err(py)
    }
}
