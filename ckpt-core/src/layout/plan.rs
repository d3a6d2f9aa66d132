//! `CopyPlan`: from metadata alone, which source bytes go where in which output.
//!
//! Every target piece is intersected with the source pieces that tile its tensor; each
//! intersection is one [`CopyOp`], a box with its place in the source and in the
//! destination tensor. The plan is plain data: it can be printed, summed and tested
//! without touching a byte of tensor data.

use crate::error::{Error, Result};
use crate::layout::region::{Dims, Region};
use crate::layout::source::{Compute, PieceSource, SourceTensor};
use crate::layout::strategy::{dtype_name, Strategy};
use crate::layout::{Dtype, Piece, TensorLayout};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Metadata key of PyTorch DCP's per-tensor offsets (the global start of each tensor's
/// box, as its sharded safetensors record them).
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// A tensor to produce: its output dtype, local shape and the global pieces it holds.
#[derive(Clone, Debug)]
pub struct TargetTensor {
    /// Tensor name.
    pub name: String,
    /// Output dtype (the source's unless casting).
    pub dtype: Dtype,
    /// Local shape in the output file.
    pub shape: Vec<u64>,
    /// Global boxes and where they land locally.
    pub pieces: Vec<Piece>,
}

/// An output file to produce.
#[derive(Clone, Debug)]
pub struct TargetFile {
    /// Path relative to the output directory.
    pub path: PathBuf,
    /// The tensors, in file order.
    pub tensors: Vec<TargetTensor>,
    /// `__metadata__` of the file.
    pub metadata: BTreeMap<String, String>,
}

/// Copy one box from a source tensor into a destination tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyOp {
    /// Source file (index into [`Checkpoint::files`](crate::Checkpoint::files)).
    pub file: usize,
    /// Tensor within that file.
    pub tensor: usize,
    /// Shape of the source tensor as stored, or as a [`StoredView`](crate::layout::source::StoredView) reshapes it: the
    /// row-major shape whose element offsets locate the box's bytes.
    pub src_shape: Dims,
    /// The box, in source-local coordinates: `src_shape`'s, with its axes permuted by
    /// `axes` when given.
    pub src: Region,
    /// Where the box starts in the destination tensor.
    pub dst_start: Dims,
    /// A [`StoredView`](crate::layout::source::StoredView)'s permutation: the box's dimension `d` (the destination's) is
    /// `src_shape`'s dimension `axes[d]`. `None`: the same order.
    pub axes: Option<Vec<usize>>,
    /// The box is computed from other tensors' boxes rather than read (`src` is then
    /// in the computed tensor's global coordinates, and `file`/`tensor` its first
    /// input's stored tensor).
    pub compute: Option<Compute>,
}

impl CopyOp {
    /// The box the op writes, in the target tensor's coordinates.
    #[must_use]
    pub fn dst_box(&self) -> Region {
        Region::new(self.dst_start.clone(), self.src.shape.clone())
    }

    /// Where `part` (a box of the destination inside this copy's) starts in the source
    /// tensor.
    #[must_use]
    pub fn src_start_of(&self, part: &Region) -> Vec<u64> {
        part.start
            .iter()
            .zip(&self.dst_start)
            .zip(&self.src.start)
            .map(|((p, d), s)| p - d + s)
            .collect()
    }

    /// `region` (a box in [`CopyOp::src`]'s coordinates) in `src_shape`'s order of
    /// dimensions, where its elements' offsets are.
    #[must_use]
    pub fn stored_box(&self, region: &Region) -> Region {
        match &self.axes {
            None => region.clone(),
            Some(axes) => {
                let mut out = region.clone();
                for (d, &a) in axes.iter().enumerate() {
                    out.start[a] = region.start[d];
                    out.shape[a] = region.shape[d];
                }
                out
            }
        }
    }
}

/// Which stored tensors, `(file, tensor)`, a plan's ops read ([`tensors_read`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorsRead {
    /// Every tensor some op reads.
    pub read: BTreeSet<(usize, usize)>,
    /// Those the ops read whole: the distinct boxes read from it tile it (blocked shards
    /// are read box by box).
    pub whole: BTreeSet<(usize, usize)>,
}

/// The stored tensors `ops` read, and those they read whole (whose recorded checksums
/// can be checked). A tensor read through views of two shapes is not known to be read
/// whole.
#[must_use]
pub fn tensors_read<'a>(ops: impl IntoIterator<Item = &'a CopyOp>) -> TensorsRead {
    // The ops sorted by the tensor they read, then taken a run per tensor: a map of
    // tensors to lists of ops cost an insertion into a tree for each of a million ops.
    // The sort is stable, so each run keeps the ops' order.
    let ops: Vec<&CopyOp> = ops.into_iter().collect();
    let ops = by_stored_tensor(ops);
    let mut read = Vec::new();
    let mut whole = Vec::new();
    for run in ops.chunk_by(|a, b| (a.file, a.tensor) == (b.file, b.tensor)) {
        let key = (run[0].file, run[0].tensor);
        read.push(key);
        let shape = &run[0].src_shape[..];
        // A computed box reads its stored tensor through other coordinates: never
        // counted as read whole.
        let reshaped = run
            .iter()
            .any(|op| op.src_shape[..] != *shape || op.compute.is_some());
        if !reshaped && tiled(shape, run) {
            whole.push(key);
        }
    }
    // Sorted already: the sets are built in one pass.
    TensorsRead {
        read: read.into_iter().collect(),
        whole: whole.into_iter().collect(),
    }
}

/// `ops` in a stable order by `(file, tensor)`: placed file by file (a counting sort),
/// then each file's run sorted by tensor unless it is already (the ops of a merge
/// follow the output's name order, which is each rank file's order too: no comparison
/// sort of a million ops then).
fn by_stored_tensor(ops: Vec<&CopyOp>) -> Vec<&CopyOp> {
    let files = ops.iter().map(|op| op.file + 1).max().unwrap_or(0);
    if files > ops.len() {
        // Few ops of far-apart files: the comparison sort costs less than the counts.
        let mut ops = ops;
        ops.sort_by_key(|op| (op.file, op.tensor));
        return ops;
    }
    let mut start = vec![0usize; files + 1];
    for op in &ops {
        start[op.file + 1] += 1;
    }
    for f in 0..files {
        start[f + 1] += start[f];
    }
    let Some(&first) = ops.first() else {
        return ops;
    };
    let mut at = start.clone();
    let mut out: Vec<&CopyOp> = vec![first; ops.len()];
    for op in ops {
        out[at[op.file]] = op;
        at[op.file] += 1;
    }
    for f in 0..files {
        let run = &mut out[start[f]..start[f + 1]];
        if !run.is_sorted_by_key(|op| op.tensor) {
            run.sort_by_key(|op| op.tensor);
        }
    }
    out
}

/// Whether the distinct boxes `ops` read tile a stored tensor of `shape`.
fn tiled(shape: &[u64], ops: &[&CopyOp]) -> bool {
    if let [only] = ops {
        let only = only.stored_box(&only.src);
        let at_origin = only.start.iter().all(|&s| s == 0);
        return shape.contains(&0) || (only.shape[..] == *shape && at_origin);
    }
    let mut distinct: Vec<Region> = ops.iter().map(|op| op.stored_box(&op.src)).collect();
    distinct.sort();
    distinct.dedup();
    crate::layout::coverage::check_tiling(shape, &distinct).is_ok()
}

/// How one output tensor is assembled.
#[derive(Clone, Debug)]
pub struct TensorPlan {
    /// What to produce.
    pub target: TargetTensor,
    /// Source dtype.
    pub src_dtype: Dtype,
    /// The copies; their destination boxes tile the tensor.
    pub ops: Vec<CopyOp>,
    /// The shape the output file records when it is another view of the same
    /// row-major bytes than `target.shape` (same element count): megatron-core's
    /// GroupedMLP `weight1` `[H, E_l*F1]` is rows of the grouped `[H, E*F1]`, planned as
    /// `[H/EP, E*F1]`. `None`: `target.shape`.
    pub stored_shape: Option<Vec<u64>>,
}

impl TensorPlan {
    /// The rows `rows` (on dim 0) of this tensor, as a tensor of their own: the copies
    /// and pieces that fall in them, cut to them.
    #[must_use]
    pub fn rows(&self, rows: std::ops::Range<u64>) -> TensorPlan {
        let cut = |start: u64, len: u64| -> Option<(u64, u64)> {
            let (lo, hi) = (start.max(rows.start), (start + len).min(rows.end));
            (lo < hi).then(|| (lo, hi - lo))
        };
        let mut target = self.target.clone();
        target.shape[0] = rows.end - rows.start;
        target.pieces = self
            .target
            .pieces
            .iter()
            .filter_map(|p| {
                let (lo, n) = cut(p.local.start[0], p.local.shape[0])?;
                let skip = lo - p.local.start[0];
                let mut p = p.clone();
                p.global.start[0] += skip;
                p.global.shape[0] = n;
                p.local.start[0] = lo - rows.start;
                p.local.shape[0] = n;
                Some(p)
            })
            .collect();
        let ops = self
            .ops
            .iter()
            .filter_map(|op| {
                let (lo, n) = cut(op.dst_start[0], op.src.shape[0])?;
                let mut op = op.clone();
                op.src.start[0] += lo - op.dst_start[0];
                op.src.shape[0] = n;
                op.dst_start[0] = lo - rows.start;
                Some(op)
            })
            .collect();
        TensorPlan {
            target,
            src_dtype: self.src_dtype,
            ops,
            stored_shape: None,
        }
    }
}

/// How one output file is assembled.
#[derive(Clone, Debug)]
pub struct FilePlan {
    /// Path relative to the output directory.
    pub path: PathBuf,
    /// `__metadata__` of the file.
    pub metadata: BTreeMap<String, String>,
    /// Its tensors in file order.
    pub tensors: Vec<TensorPlan>,
}

/// The whole plan.
#[derive(Clone, Debug, Default)]
pub struct CopyPlan {
    /// The output files.
    pub files: Vec<FilePlan>,
}

/// Dtypes a cast may start from or go to.
fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// Checks that converting `from` to `to` is allowed.
///
/// # Errors
/// Casts of integer, boolean or 8-bit-and-smaller float tensors are refused.
pub fn check_cast(tensor: &str, from: Dtype, to: Dtype) -> Result<()> {
    if from == to || (is_float(from) && is_float(to)) {
        return Ok(());
    }
    if matches!(from, Dtype::F8_E4M3 | Dtype::F8_E5M2) && is_float(to) {
        return Err(Error::Unsupported {
            problem: format!(
                "tensor `{tensor}`: cannot cast {} to {}: an FP8 weight dequantizes with its scales beside it (`{tensor}_scale_inv` per block or per tensor, as DeepSeek-V3, Qwen3-FP8 and transformers ship them, or `X.weight_scale` per tensor or row for a weight `X.weight`, as compressed-tensors writes them), which this checkpoint lacks (select the tensor out with --exclude)",
                dtype_name(from),
                dtype_name(to)
            ),
        });
    }
    Err(Error::Unsupported {
        problem: format!(
            "tensor `{tensor}`: cannot cast {} to {} (only F16, BF16, F32 and F64 convert; select the tensor out with --exclude)",
            dtype_name(from),
            dtype_name(to)
        ),
    })
}

/// Plans one target tensor from the global tensor `src` by box intersection: one copy
/// per overlap of a target piece with a source piece.
///
/// # Errors
/// A target piece outside the source's shape, an impossible cast, sub-byte elements
/// split inside a byte.
pub(crate) fn plan_tensor(
    source: &impl PieceSource,
    src: &SourceTensor,
    target: TargetTensor,
) -> Result<TensorPlan> {
    check_cast(&target.name, src.dtype, target.dtype)?;
    // A whole target tensor (a merge) meets every source piece once: room for them all
    // at once (grown op by op, each tensor's list was copied twice over).
    let mut ops = match &target.pieces[..] {
        [one] if one.global.shape[..] == src.shape[..] => Vec::with_capacity(src.pieces.len()),
        _ => Vec::new(),
    };
    for tp in &target.pieces {
        if !Region::full(&src.shape).contains(&tp.global) {
            return Err(Error::InvalidTensor {
                tensor: target.name.clone(),
                problem: format!(
                    "target piece {} lies outside the source shape {:?}",
                    tp.global, src.shape
                ),
            });
        }
        for sp in &src.pieces {
            let Some(i) = tp.global.overlap(&sp.global) else {
                continue;
            };
            let src_box = i.relative_to(&sp.global.start).offset(&sp.local.start);
            let dst_start = i
                .relative_to(&tp.global.start)
                .offset(&tp.local.start)
                .start;
            let (src_shape, axes) = match (&sp.view, &sp.compute) {
                // Computed in the global tensor's coordinates.
                (_, Some(_)) => (Dims::from_slice(&src.shape), None),
                (None, None) => (
                    Dims::from_slice(source.stored_shape(sp.file, sp.tensor)),
                    None,
                ),
                (Some(v), None) => {
                    let identity = v.axes.iter().enumerate().all(|(d, &a)| d == a);
                    (
                        Dims::from_slice(&v.shape),
                        (!identity).then(|| v.axes.clone()),
                    )
                }
            };
            ops.push(CopyOp {
                file: sp.file,
                tensor: sp.tensor,
                src_shape,
                src: src_box,
                dst_start,
                axes,
                compute: sp.compute.clone(),
            });
        }
    }
    check_sub_byte(&target, src.dtype, &ops)?;
    Ok(TensorPlan {
        target,
        src_dtype: src.dtype,
        ops,
        stored_shape: None,
    })
}

/// Plans the box `region` of the global tensor `src` (named `name`) as a tensor of its
/// own in `dtype`: how a computed piece's input is assembled.
///
/// # Errors
/// As [`plan_tensor`].
pub(crate) fn plan_region(
    source: &impl PieceSource,
    name: &str,
    src: &SourceTensor,
    region: &Region,
    dtype: Dtype,
) -> Result<TensorPlan> {
    let shape = region.shape.to_vec();
    plan_tensor(
        source,
        src,
        TargetTensor {
            name: name.to_string(),
            dtype,
            pieces: vec![Piece {
                global: region.clone(),
                local: Region::full(&shape),
            }],
            shape,
        },
    )
}

impl CopyPlan {
    /// Plans `targets` from `source` by box intersection.
    ///
    /// # Errors
    /// A target tensor the source lacks, a shape or dtype mismatch, an impossible cast,
    /// or sub-byte elements split inside a byte.
    pub fn build(source: &impl PieceSource, targets: Vec<TargetFile>) -> Result<CopyPlan> {
        let mut files = Vec::with_capacity(targets.len());
        for tf in targets {
            let mut tensors = Vec::with_capacity(tf.tensors.len());
            for target in tf.tensors {
                let src = source.source_tensors().get(&target.name).ok_or_else(|| {
                    Error::InvalidTensor {
                        tensor: target.name.clone(),
                        problem: "is not in the source checkpoint".into(),
                    }
                })?;
                tensors.push(plan_tensor(source, src, target)?);
            }
            files.push(FilePlan {
                path: tf.path,
                metadata: tf.metadata,
                tensors,
            });
        }
        Ok(CopyPlan { files })
    }

    /// Bytes the plan reads from the sources.
    #[must_use]
    pub fn bytes_read(&self) -> u64 {
        self.files.iter().map(FilePlan::bytes_read).sum()
    }

    /// Bytes of tensor data the plan writes.
    #[must_use]
    pub fn bytes_written(&self) -> u64 {
        self.files.iter().map(FilePlan::bytes_written).sum()
    }

    /// Number of output tensors.
    #[must_use]
    pub fn tensor_count(&self) -> usize {
        self.files.iter().map(|f| f.tensors.len()).sum()
    }
}

impl FilePlan {
    /// Bytes this file reads from the sources.
    #[must_use]
    pub fn bytes_read(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| {
                t.ops
                    .iter()
                    .map(|o| bytes_of(t.src_dtype, o.src.numel()))
                    .sum::<u64>()
            })
            .sum()
    }

    /// Bytes of tensor data this file holds.
    #[must_use]
    pub fn bytes_written(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| bytes_of(t.target.dtype, t.target.shape.iter().product()))
            .sum()
    }

    /// The source files this output file reads.
    #[must_use]
    pub fn source_files(&self) -> BTreeSet<usize> {
        self.tensors
            .iter()
            .flat_map(|t| t.ops.iter().map(|o| o.file))
            .collect()
    }
}

/// Bytes of `numel` elements (sub-byte types rounded up).
#[must_use]
pub fn bytes_of(dtype: Dtype, numel: u64) -> u64 {
    (numel * dtype.bitsize() as u64).div_ceil(8)
}

/// Sub-byte elements (F4, F6) can only be copied in whole bytes: every box edge on the
/// last dimension, and the last dimension itself, must fall on a byte boundary.
fn check_sub_byte(target: &TargetTensor, src_dtype: Dtype, ops: &[CopyOp]) -> Result<()> {
    let bits = src_dtype.bitsize() as u64;
    if bits.is_multiple_of(8) {
        return Ok(());
    }
    let unit = 8 / gcd(bits, 8);
    let last = |v: &[u64]| v.last().copied().unwrap_or(0);
    let aligned = ops.iter().all(|o| {
        [
            last(&o.src_shape),
            last(&o.src.start),
            last(&o.src.shape),
            last(&o.dst_start),
            last(&target.shape),
        ]
        .iter()
        .all(|x| x % unit == 0)
    });
    if aligned {
        Ok(())
    } else {
        Err(Error::Unsupported {
            problem: format!(
                "tensor `{}`: {} packs {} elements per byte group and this layout splits the last dimension inside one",
                target.name,
                dtype_name(src_dtype),
                unit
            ),
        })
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Metadata a ckpt rank file carries: rank, world size, the strategy's hash
/// ([`Strategy::hash`], taken once by the caller for all its ranks) and, for every
/// tensor whose local part is one box (or empty), its global offsets in PyTorch DCP's
/// convention.
#[must_use]
pub fn rank_metadata(
    strategy: &Strategy,
    strategy_hash: &str,
    rank: u64,
    tensors: &[TargetTensor],
) -> BTreeMap<String, String> {
    /// One tensor's record in `DCP_SHARDING_INFO`.
    #[derive(serde::Serialize)]
    struct Saved<'a> {
        saved_offsets: &'a [u64],
    }
    let zeros = vec![0u64; tensors.iter().map(|t| t.shape.len()).max().unwrap_or(0)];
    let offsets: BTreeMap<&str, Saved> = tensors
        .iter()
        .filter_map(|t| {
            let saved_offsets = match &t.pieces[..] {
                [p] => &p.global.start[..],
                // An empty local tensor: PyTorch's reader needs an entry for every key.
                [] => &zeros[..t.shape.len()],
                _ => return None,
            };
            Some((t.name.as_str(), Saved { saved_offsets }))
        })
        .collect();
    let mut m = BTreeMap::new();
    m.insert("format".into(), "pt".into());
    m.insert("rank".into(), rank.to_string());
    m.insert("world_size".into(), strategy.mesh.world_size().to_string());
    m.insert("strategy_hash".into(), strategy_hash.to_string());
    // The same text as a JSON object of objects (keys sorted, compact), without one.
    m.insert(
        DCP_SHARDING_INFO.into(),
        serde_json::to_string(&offsets).unwrap_or_default(),
    );
    m
}

/// The tensors rank `rank` stores under `strategy`: those it holds and owns (or holds at
/// all, with `keep_all`), optionally filtered by name and cast to `dtype`.
#[must_use]
pub fn rank_tensors(
    strategy: &Strategy,
    rank: u64,
    keep_all: bool,
    select: &dyn Fn(&str, &TensorLayout) -> Option<Dtype>,
) -> Vec<TargetTensor> {
    let mut out = Vec::new();
    for (name, l) in &strategy.tensors {
        let Some(shape) = l.local_shape(&strategy.mesh, rank) else {
            continue;
        };
        if !(keep_all || l.is_owner(&strategy.mesh, rank)) {
            continue;
        }
        let Some(dtype) = select(name, l) else {
            continue;
        };
        out.push(TargetTensor {
            name: name.clone(),
            dtype,
            shape,
            pieces: l.pieces(&strategy.mesh, rank),
        });
    }
    out
}
