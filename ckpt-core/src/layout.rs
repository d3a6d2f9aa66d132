//! `TensorLayout`: how one tensor is laid out over a device mesh.

pub mod compute;
pub mod coverage;
pub mod flat;
pub mod mesh;
pub mod mindspore;
pub mod plan;
pub mod region;
pub mod select;
pub mod source;
pub mod split_rules;
pub mod strategy;

use crate::error::{Error, Result};
use crate::layout::mesh::Mesh;
use crate::layout::region::{Dims, Region};
/// The element types (safetensors' names, which every format maps to and from).
pub use ::safetensors::Dtype;
use smallvec::SmallVec;
use std::fmt;

/// How a tensor is placed along one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Every coordinate on the axis holds the same data.
    Replicate,
    /// The tensor is split along `dim` over the axis, as `torch.chunk` splits:
    /// pieces of `ceil(n / k)`, trailing pieces shorter or empty.
    Shard {
        /// The tensor dimension that is split.
        dim: usize,
        /// The dimension is viewed as `blocks` equal blocks (fused QKV: 3) and each
        /// block is split; a rank's piece is its part of every block, in block order.
        blocks: u64,
        /// When several axes split one dimension they split it in increasing `order`,
        /// ties in mesh order (outer axis first). 0 unless a format needs otherwise.
        order: u32,
    },
}

impl Placement {
    /// `Shard(dim)` with one block.
    #[must_use]
    pub fn shard(dim: usize) -> Placement {
        Placement::Shard {
            dim,
            blocks: 1,
            order: 0,
        }
    }

    /// `Shard(dim, blocks=k)`.
    #[must_use]
    pub fn blocked(dim: usize, blocks: u64) -> Placement {
        Placement::Shard {
            dim,
            blocks,
            order: 0,
        }
    }

    /// Parses `Replicate`, `Shard(1)`, `Shard(0,blocks=3)`, `Shard(0,order=1)`.
    ///
    /// # Errors
    /// Anything else.
    pub fn parse(text: &str) -> std::result::Result<Placement, String> {
        let t: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        if t == "Replicate" || t == "R" {
            return Ok(Placement::Replicate);
        }
        let inner = t
            .strip_prefix("Shard(")
            .and_then(|s| s.strip_suffix(')'))
            .ok_or_else(|| format!("placement `{text}` is neither `Replicate` nor `Shard(dim)`"))?;
        let mut parts = inner.split(',');
        let dim = parts
            .next()
            .and_then(|d| d.parse::<usize>().ok())
            .ok_or_else(|| format!("placement `{text}`: shard dim must be a whole number"))?;
        let (mut blocks, mut order) = (1u64, 0u32);
        for p in parts {
            match p.split_once('=') {
                Some(("blocks", v)) => {
                    blocks = v.parse().ok().filter(|&b| b > 0).ok_or_else(|| {
                        format!("placement `{text}`: blocks must be a positive whole number")
                    })?;
                }
                Some(("order", v)) => {
                    order = v
                        .parse()
                        .map_err(|_| format!("placement `{text}`: bad order"))?;
                }
                _ => return Err(format!("placement `{text}`: unknown argument `{p}`")),
            }
        }
        Ok(Placement::Shard { dim, blocks, order })
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Shard { dim, blocks, order } => {
                write!(f, "Shard({dim}")?;
                if blocks != 1 {
                    write!(f, ",blocks={blocks}")?;
                }
                if order != 0 {
                    write!(f, ",order={order}")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// One box of a rank's local tensor and where it sits in the global tensor.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Piece {
    /// Where the piece lies in the global tensor.
    pub global: Region,
    /// Where the piece lies in the rank's local tensor.
    pub local: Region,
}

/// A tensor's global shape, dtype and placement on every mesh axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    /// Global shape.
    pub shape: Vec<u64>,
    /// Element type, carried byte for byte.
    pub dtype: Dtype,
    /// One placement per mesh axis.
    pub placements: Vec<Placement>,
    /// Pipeline stage; `None` means present on every stage.
    pub stage: Option<u64>,
}

/// The interval a rank holds on one tensor dimension, per block.
#[derive(Clone, Copy, Debug)]
struct DimSplit {
    /// Start within each block.
    start: u64,
    /// Length within each block.
    len: u64,
    /// Block length.
    block: u64,
    /// Number of blocks.
    blocks: u64,
}

/// `torch.chunk` of `n` into `k`: the `i`-th piece as `(start, len)`.
fn chunk(n: u64, k: u64, i: u64) -> (u64, u64) {
    let size = n.div_ceil(k);
    let start = (i * size).min(n);
    let end = ((i + 1) * size).min(n);
    (start, end - start)
}

impl TensorLayout {
    /// A layout on a mesh, one placement per axis.
    #[must_use]
    pub fn new(shape: Vec<u64>, dtype: Dtype, placements: Vec<Placement>) -> TensorLayout {
        TensorLayout {
            shape,
            dtype,
            placements,
            stage: None,
        }
    }

    /// A whole tensor on one rank: every axis replicated.
    #[must_use]
    pub fn replicated(shape: Vec<u64>, dtype: Dtype, mesh: &Mesh) -> TensorLayout {
        TensorLayout::new(shape, dtype, vec![Placement::Replicate; mesh.axes().len()])
    }

    /// The same layout on pipeline stage `stage`.
    #[must_use]
    pub fn with_stage(mut self, stage: u64) -> TensorLayout {
        self.stage = Some(stage);
        self
    }

    /// Checks the layout against a mesh; errors name `tensor` and the problem.
    ///
    /// # Errors
    /// Wrong number of placements, shard dim out of range, blocks not dividing the
    /// dimension, sharding over the pipeline axis, stage out of range, byte overflow.
    pub fn validate(&self, tensor: &str, mesh: &Mesh) -> Result<()> {
        let bad = |problem: String| Error::InvalidLayout {
            tensor: tensor.to_string(),
            problem,
        };
        if self.placements.len() != mesh.axes().len() {
            return Err(bad(format!(
                "{} placements for a mesh of {} axes ({mesh})",
                self.placements.len(),
                mesh.axes().len()
            )));
        }
        for (axis, p) in mesh.axes().iter().zip(&self.placements) {
            if let Placement::Shard { dim, blocks, .. } = *p {
                if dim >= self.shape.len() {
                    return Err(bad(format!(
                        "shard dim {dim} on axis `{}` is out of range for a tensor of {} dims",
                        axis.name,
                        self.shape.len()
                    )));
                }
                if blocks == 0 || !self.shape[dim].is_multiple_of(blocks) {
                    return Err(bad(format!(
                        "blocks={blocks} on axis `{}` do not divide dim {dim} of size {}",
                        axis.name, self.shape[dim]
                    )));
                }
                for (other, q) in mesh.axes().iter().zip(&self.placements) {
                    if let Placement::Shard {
                        dim: d2,
                        blocks: b2,
                        ..
                    } = *q
                    {
                        if d2 == dim && b2 != blocks {
                            return Err(bad(format!(
                                "axes `{}` and `{}` split dim {dim} with different blocks",
                                axis.name, other.name
                            )));
                        }
                    }
                }
            }
        }
        if let Some(p) = mesh.pipeline() {
            if self.placements[p] != Placement::Replicate {
                return Err(bad(format!(
                    "pipeline axis `{}` cannot shard a tensor",
                    mesh.axes()[p].name
                )));
            }
            if let Some(s) = self.stage {
                if s >= mesh.axes()[p].size {
                    return Err(bad(format!(
                        "stage {s} but the pipeline axis has {} stages",
                        mesh.axes()[p].size
                    )));
                }
            }
        } else if let Some(s) = self.stage {
            if s != 0 {
                return Err(bad(format!("stage {s} but the mesh has no pipeline axis")));
            }
        }
        let numel = self
            .shape
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .ok_or_else(|| bad("element count overflows".into()))?;
        let bits = numel
            .checked_mul(self.dtype.bitsize() as u64)
            .ok_or_else(|| bad("byte size overflows".into()))?;
        if bits % 8 != 0 {
            return Err(bad(format!(
                "{numel} elements of {:?} do not fill whole bytes",
                self.dtype
            )));
        }
        Ok(())
    }

    /// Whether `rank` holds this tensor at all (pipeline stage).
    #[must_use]
    pub fn holds(&self, mesh: &Mesh, rank: u64) -> bool {
        match (mesh.pipeline(), self.stage) {
            (Some(p), Some(s)) => mesh.coords_iter(rank).nth(p) == Some(s),
            _ => true,
        }
    }

    /// Whether `rank` is the canonical owner of the data it holds: the lowest rank
    /// among those holding the same piece (coordinate 0 on every replicated axis).
    #[must_use]
    pub fn is_owner(&self, mesh: &Mesh, rank: u64) -> bool {
        if !self.holds(mesh, rank) {
            return false;
        }
        let c = mesh.coords(rank);
        self.placements.iter().enumerate().all(|(d, p)| {
            *p != Placement::Replicate
                || c[d] == 0
                || (mesh.pipeline() == Some(d) && self.stage.is_some())
        })
    }

    fn dim_splits(&self, mesh: &Mesh, rank: u64) -> SmallVec<[DimSplit; 4]> {
        // Inline vectors: this runs twice for every stored tensor a rank file holds
        // (its shape checked, then its pieces), a million times at MoE scale, where
        // the heap vectors it built were most of its cost.
        let c: SmallVec<[u64; 4]> = mesh.coords_iter(rank).collect();
        let mut splits: SmallVec<[DimSplit; 4]> = self
            .shape
            .iter()
            .map(|&n| DimSplit {
                start: 0,
                len: n,
                block: n,
                blocks: 1,
            })
            .collect();
        let mut axes: SmallVec<[(u32, usize); 4]> = self
            .placements
            .iter()
            .enumerate()
            .filter_map(|(a, p)| match p {
                Placement::Shard { order, .. } => Some((*order, a)),
                Placement::Replicate => None,
            })
            .collect();
        axes.sort_unstable();
        for &(_, a) in &axes {
            if let Placement::Shard { dim, blocks, .. } = self.placements[a] {
                let s = &mut splits[dim];
                if s.blocks != blocks {
                    s.blocks = blocks;
                    s.block = self.shape[dim] / blocks;
                    s.len = s.block;
                }
                let (start, len) = chunk(s.len, mesh.axes()[a].size, c[a]);
                s.start += start;
                s.len = len;
            }
        }
        splits
    }

    /// Shape of `rank`'s local tensor (`None` when the rank does not hold it).
    ///
    /// ```
    /// use ckpt_core::layout::{Dtype, Placement, TensorLayout};
    /// use ckpt_core::layout::mesh::Mesh;
    /// let mesh = Mesh::parse("tp=4").unwrap();
    /// let l = TensorLayout::new(vec![10, 3], Dtype::F32, vec![Placement::shard(0)]);
    /// // torch.chunk(10, 4): 3, 3, 3, 1
    /// assert_eq!(l.local_shape(&mesh, 3), Some(vec![1, 3]));
    /// ```
    #[must_use]
    pub fn local_shape(&self, mesh: &Mesh, rank: u64) -> Option<Vec<u64>> {
        if !self.holds(mesh, rank) {
            return None;
        }
        Some(
            self.dim_splits(mesh, rank)
                .iter()
                .map(|s| s.len * s.blocks)
                .collect(),
        )
    }

    /// The pieces of `rank`'s local tensor: one per combination of blocks, empty
    /// pieces left out.
    ///
    /// ```
    /// use ckpt_core::layout::{Dtype, Placement, TensorLayout};
    /// use ckpt_core::layout::mesh::Mesh;
    /// use ckpt_core::layout::region::Region;
    /// // Fused QKV of 6 rows, 3 blocks, split over 2 ranks: rank 1 holds rows 1, 3, 5.
    /// let mesh = Mesh::parse("tp=2").unwrap();
    /// let l = TensorLayout::new(vec![6, 2], Dtype::BF16, vec![Placement::blocked(0, 3)]);
    /// let p = l.pieces(&mesh, 1);
    /// assert_eq!(p.len(), 3);
    /// assert_eq!(p[2].global, Region::from_ranges(&[5..6, 0..2]));
    /// assert_eq!(p[2].local, Region::from_ranges(&[2..3, 0..2]));
    /// ```
    #[must_use]
    pub fn pieces(&self, mesh: &Mesh, rank: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        self.each_piece(mesh, rank, |p| out.push(p));
        out
    }

    /// Whether `rank` holds this tensor with the local shape `shape` ([`local_shape`]'s
    /// answer, without building it: checked for every stored tensor of every rank).
    ///
    /// [`local_shape`]: TensorLayout::local_shape
    pub(crate) fn local_shape_is(&self, mesh: &Mesh, rank: u64, shape: &[u64]) -> bool {
        self.holds(mesh, rank) && {
            let splits = self.dim_splits(mesh, rank);
            splits.len() == shape.len()
                && splits
                    .iter()
                    .zip(shape)
                    .all(|(s, &n)| s.len * s.blocks == n)
        }
    }

    /// Calls `f` with each of [`pieces`](TensorLayout::pieces), in the same order,
    /// without collecting them.
    pub(crate) fn each_piece(&self, mesh: &Mesh, rank: u64, mut f: impl FnMut(Piece)) {
        if !self.holds(mesh, rank) {
            return;
        }
        let splits = self.dim_splits(mesh, rank);
        if splits.iter().any(|s| s.len == 0) {
            return;
        }
        let total: u64 = splits.iter().map(|s| s.blocks).product();
        let mut idx: SmallVec<[u64; 4]> = smallvec::smallvec![0u64; splits.len()];
        for _ in 0..total {
            let global = Region::new(
                splits
                    .iter()
                    .zip(&idx)
                    .map(|(s, &b)| b * s.block + s.start)
                    .collect::<Dims>(),
                splits.iter().map(|s| s.len).collect::<Dims>(),
            );
            let local = Region::new(
                splits
                    .iter()
                    .zip(&idx)
                    .map(|(s, &b)| b * s.len)
                    .collect::<Dims>(),
                splits.iter().map(|s| s.len).collect::<Dims>(),
            );
            f(Piece { global, local });
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < splits[d].blocks {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-dimensional regions
mod tests {
    use super::*;

    fn layout(shape: &[u64], p: &[Placement]) -> TensorLayout {
        TensorLayout::new(shape.to_vec(), Dtype::F32, p.to_vec())
    }

    #[test]
    fn uneven_and_empty_pieces_follow_torch_chunk() {
        let mesh = Mesh::parse("tp=4").unwrap();
        let l = layout(&[5], &[Placement::shard(0)]);
        // torch.chunk(5, 4) -> sizes 2, 2, 1 and an empty fourth piece.
        let sizes: Vec<u64> = (0..4)
            .map(|r| l.local_shape(&mesh, r).unwrap()[0])
            .collect();
        assert_eq!(sizes, vec![2, 2, 1, 0]);
        assert!(l.pieces(&mesh, 3).is_empty());
    }

    #[test]
    fn nested_shards_outer_axis_first() {
        let mesh = Mesh::parse("a=2,b=2").unwrap();
        let l = layout(&[5], &[Placement::shard(0), Placement::shard(0)]);
        // chunk(5,2) = 3,2; then chunk(3,2) = 2,1 and chunk(2,2) = 1,1.
        let g: Vec<Region> = (0..4)
            .map(|r| l.pieces(&mesh, r)[0].global.clone())
            .collect();
        assert_eq!(
            g,
            vec![
                Region::from_ranges(&[0..2]),
                Region::from_ranges(&[2..3]),
                Region::from_ranges(&[3..4]),
                Region::from_ranges(&[4..5])
            ]
        );
        // With order, the inner axis splits first.
        let l2 = layout(
            &[8],
            &[
                Placement::Shard {
                    dim: 0,
                    blocks: 1,
                    order: 1,
                },
                Placement::shard(0),
            ],
        );
        assert_eq!(l2.pieces(&mesh, 1)[0].global, Region::from_ranges(&[4..6]));
    }

    #[test]
    fn owners_and_stages() {
        let mesh = Mesh::parse("pp=2,dp=2")
            .unwrap()
            .with_pipeline("pp")
            .unwrap();
        let l = layout(&[4], &[Placement::Replicate, Placement::Replicate]).with_stage(1);
        let owners: Vec<u64> = (0..4).filter(|&r| l.is_owner(&mesh, r)).collect();
        assert_eq!(owners, vec![2]);
        assert!(l.pieces(&mesh, 0).is_empty());
        assert_eq!(l.local_shape(&mesh, 3), Some(vec![4]));
    }

    #[test]
    fn validation_names_the_problem() {
        let mesh = Mesh::parse("tp=2").unwrap();
        let e = layout(&[4], &[Placement::shard(1)])
            .validate("w", &mesh)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `w`: shard dim 1 on axis `tp` is out of range for a tensor of 1 dims"
        );
        let e = layout(&[4], &[Placement::blocked(0, 3)])
            .validate("qkv", &mesh)
            .unwrap_err();
        assert!(e
            .to_string()
            .contains("blocks=3 on axis `tp` do not divide dim 0 of size 4"));
    }

    #[test]
    fn placement_text_round_trips() {
        for t in [
            "Replicate",
            "Shard(1)",
            "Shard(0,blocks=3)",
            "Shard(0,order=2)",
        ] {
            assert_eq!(Placement::parse(t).unwrap().to_string(), t);
        }
        assert!(Placement::parse("Shard(x)").is_err());
    }
}
