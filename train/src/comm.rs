//! `Comm`: the collectives ranks use to talk, and `Dist`, a rank's view of the mesh.
//!
//! Ranks never touch each other's tensors except through a [`Comm`]. The embedded
//! backend ([`run_threads`]) runs every rank as a thread of this process with in-memory
//! collectives; an MPI or NCCL backend implements the same trait.
//!
//! Reductions are computed in group order on every rank (`((x0 + x1) + x2) + ..`), so the
//! result is bit-identical on all ranks and from run to run.

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda-driver")]
mod nccl;
#[cfg(any(feature = "mpi", feature = "cuda-driver"))]
mod process;
mod thread;

#[cfg(feature = "mpi")]
pub use self::mpi::{finalize_mpi, mpi_world, run_mpi, MpiWorld};
#[cfg(feature = "cuda-driver")]
pub use self::nccl::{run_nccl, JOB_ID_VAR, RENDEZVOUS_DIR_VAR};
#[cfg(any(feature = "mpi", feature = "cuda-driver"))]
pub use self::process::{DEFAULT_TIMEOUT, TIMEOUT_VAR};
pub use self::thread::run_threads;
use crate::error::{Error, Result};
use candle_core::Tensor;
use ckpt_core::layout::mesh::Mesh;
use std::sync::Arc;

/// How [`Comm::all_reduce`] combines the ranks' buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum, in group order.
    Sum,
    /// Element-wise sum divided by the group size.
    Mean,
    /// Element-wise maximum.
    Max,
}

/// A communicator over one group of ranks (the world, or one mesh axis).
///
/// Every member must call the same collectives in the same order with matching sizes;
/// a mismatch or a stopped peer gives [`Error::Collective`], never a hang.
pub trait Comm: Send + Sync {
    /// This rank's index within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The group's world ranks, in group order (for messages).
    fn members(&self) -> &[usize];
    /// Combines `buf` over the group in place.
    ///
    /// # Errors
    /// A peer stopped, or the buffers differ in length.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;
    /// Every rank's buffer, in group order (buffers may differ in length).
    ///
    /// # Errors
    /// A peer stopped.
    fn all_gather(&self, buf: &[f32]) -> Result<Vec<Vec<f32>>>;
    /// Sums `buf` over the group and returns this rank's segment: segment `i` has
    /// `counts[i]` elements, segments back to back.
    ///
    /// # Errors
    /// A peer stopped, or `counts` does not add up to the buffer length.
    fn reduce_scatter(&self, buf: &[f32], counts: &[usize], op: ReduceOp) -> Result<Vec<f32>>;
    /// Replaces `buf` with `root`'s buffer.
    ///
    /// # Errors
    /// A peer stopped.
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()>;
    /// Every rank's buffer on `root` (in group order), `None` elsewhere.
    ///
    /// # Errors
    /// A peer stopped.
    fn gather(&self, buf: &[f32], root: usize) -> Result<Option<Vec<Vec<f32>>>>;
    /// Waits until every rank of the group is here.
    ///
    /// # Errors
    /// A peer stopped.
    fn barrier(&self) -> Result<()>;
}

/// A rank's view of the job: the mesh, its rank, and communicators for the world and
/// for the `dp` and `tp` axes (a missing axis is a group of one).
#[derive(Clone)]
pub struct Dist {
    /// The device mesh (axes `dp` and/or `tp`).
    pub mesh: Mesh,
    /// This rank in the world.
    pub rank: usize,
    /// All ranks.
    pub world: Arc<dyn Comm>,
    /// The ranks that differ from this one only on the `dp` axis.
    pub dp: Arc<dyn Comm>,
    /// The ranks that differ from this one only on the `tp` axis.
    pub tp: Arc<dyn Comm>,
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Dist(rank {} of {}, dp {}/{}, tp {}/{})",
            self.rank,
            self.mesh,
            self.dp.rank(),
            self.dp.size(),
            self.tp.rank(),
            self.tp.size()
        )
    }
}

/// Axis names a training mesh may use.
pub const MESH_AXES: [&str; 2] = ["dp", "tp"];

/// Checks that a mesh only has `dp` and `tp` axes.
///
/// # Errors
/// Any other axis, or a pipeline axis.
pub fn check_mesh(mesh: &Mesh) -> Result<()> {
    for a in mesh.axes() {
        if !MESH_AXES.contains(&a.name.as_str()) {
            return Err(Error::option(
                "--mesh",
                format!("axis `{}` is not supported (use dp and tp)", a.name),
            ));
        }
    }
    if mesh.pipeline().is_some() {
        return Err(Error::option("--mesh", "pipeline axes are not supported"));
    }
    Ok(())
}

impl Dist {
    /// A single-rank job (mesh `dp=1`), no threads needed.
    #[must_use]
    pub fn single() -> Dist {
        let mesh = Mesh::parse("dp=1").expect("valid mesh");
        let solo: Arc<dyn Comm> = Arc::new(SoloComm { members: [0] });
        Dist {
            mesh,
            rank: 0,
            world: solo.clone(),
            dp: solo.clone(),
            tp: solo,
        }
    }

    /// This rank's coordinate on the `dp` axis.
    #[must_use]
    pub fn dp_rank(&self) -> usize {
        self.dp.rank()
    }

    /// This rank's coordinate on the `tp` axis.
    #[must_use]
    pub fn tp_rank(&self) -> usize {
        self.tp.rank()
    }

    /// Size of the `dp` axis.
    #[must_use]
    pub fn dp_size(&self) -> usize {
        self.dp.size()
    }

    /// Size of the `tp` axis.
    #[must_use]
    pub fn tp_size(&self) -> usize {
        self.tp.size()
    }
}

/// A communicator that only knows its size and rank (for building a model's shapes
/// without running it): every collective fails.
#[derive(Debug)]
pub(crate) struct ShapeOnlyComm {
    pub(crate) rank: usize,
    pub(crate) members: Vec<usize>,
}

impl ShapeOnlyComm {
    fn err<T>(&self, op: &'static str) -> Result<T> {
        Err(Error::Collective {
            op,
            group: format!("{:?}", self.members),
            problem: "shape-only communicator cannot communicate".into(),
        })
    }
}

impl Comm for ShapeOnlyComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn members(&self) -> &[usize] {
        &self.members
    }
    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<()> {
        self.err("all_reduce")
    }
    fn all_gather(&self, _buf: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.err("all_gather")
    }
    fn reduce_scatter(&self, _buf: &[f32], _counts: &[usize], _op: ReduceOp) -> Result<Vec<f32>> {
        self.err("reduce_scatter")
    }
    fn broadcast(&self, _buf: &mut Vec<f32>, _root: usize) -> Result<()> {
        self.err("broadcast")
    }
    fn gather(&self, _buf: &[f32], _root: usize) -> Result<Option<Vec<Vec<f32>>>> {
        self.err("gather")
    }
    fn barrier(&self) -> Result<()> {
        self.err("barrier")
    }
}

/// The communicator of a group of one: every collective is the identity.
#[derive(Debug)]
pub(crate) struct SoloComm {
    pub(crate) members: [usize; 1],
}

impl Comm for SoloComm {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn members(&self) -> &[usize] {
        &self.members
    }
    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, buf: &[f32]) -> Result<Vec<Vec<f32>>> {
        Ok(vec![buf.to_vec()])
    }
    fn reduce_scatter(&self, buf: &[f32], counts: &[usize], _op: ReduceOp) -> Result<Vec<f32>> {
        if counts.len() != 1 || counts[0] != buf.len() {
            return Err(Error::Collective {
                op: "reduce_scatter",
                group: "[solo]".into(),
                problem: "counts do not match the buffer".into(),
            });
        }
        Ok(buf.to_vec())
    }
    fn broadcast(&self, _buf: &mut Vec<f32>, _root: usize) -> Result<()> {
        Ok(())
    }
    fn gather(&self, buf: &[f32], _root: usize) -> Result<Option<Vec<Vec<f32>>>> {
        Ok(Some(vec![buf.to_vec()]))
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// A tensor's elements as `f32`, row-major.
///
/// # Errors
/// Tensor library errors.
pub fn tensor_to_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()?)
}

/// [`Comm::all_reduce`] on a tensor (returns a new tensor of the same shape).
///
/// # Errors
/// As [`Comm::all_reduce`].
pub fn all_reduce_tensor(comm: &dyn Comm, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(t.clone());
    }
    let mut v = tensor_to_vec(t)?;
    comm.all_reduce(&mut v, op)?;
    Ok(Tensor::from_vec(v, t.shape(), t.device())?)
}

/// [`Comm::all_gather`] of tensors concatenated along `dim` (pieces may differ in size
/// along `dim`, as `torch.chunk` pieces do).
///
/// # Errors
/// As [`Comm::all_gather`]; pieces that disagree on the other dimensions.
pub fn all_gather_tensor(comm: &dyn Comm, t: &Tensor, dim: usize) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(t.clone());
    }
    let parts = comm.all_gather(&tensor_to_vec(t)?)?;
    let dims = t.dims().to_vec();
    let inner: usize = dims[dim + 1..].iter().product();
    let outer: usize = dims[..dim].iter().product();
    let mut tensors = Vec::with_capacity(parts.len());
    for p in parts {
        let along = p.len().checked_div(outer * inner).unwrap_or(0);
        let mut shape = dims.clone();
        shape[dim] = along;
        tensors.push(Tensor::from_vec(p, shape, t.device())?);
    }
    Ok(Tensor::cat(&tensors, dim)?)
}

/// Combines equal-length pieces in group order, the one reduction of every backend, so
/// they agree bit for bit:
/// `((p0 ∘ p1) ∘ p2) ∘ ..`, then divides by `count` for a mean.
pub(crate) fn reduce_ordered<'a>(
    mut parts: impl Iterator<Item = &'a [f32]>,
    count: usize,
    op: ReduceOp,
) -> Vec<f32> {
    let mut acc = parts.next().map(<[f32]>::to_vec).unwrap_or_default();
    for p in parts {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                acc.iter_mut().zip(p.iter()).for_each(|(a, b)| *a += *b)
            }
            ReduceOp::Max => acc
                .iter_mut()
                .zip(p.iter())
                .for_each(|(a, b)| *a = a.max(*b)),
        }
    }
    if op == ReduceOp::Mean {
        let k = count as f32;
        acc.iter_mut().for_each(|a| *a /= k);
    }
    acc
}
