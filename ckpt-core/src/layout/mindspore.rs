//! MindSpore's layout description converted into ours.
//!
//! MindSpore describes a tensor by a device matrix (`dev_matrix`, outermost first), a
//! `tensor_map` with one entry per tensor dimension that indexes the device matrix *from
//! the right* (`-1`: not split; a list: split by several device axes, outer first), and
//! optimizer parallelism: the replica group of each slice (ranks `base + j * step`,
//! `j < opt_shard_size`) splits dimension 0 of the slice once more.
//!
//! Mesh axes are named `d<k>` after the device-matrix index `k` used in tensor maps; an
//! axis cut in two for optimizer sharding keeps `d<k>` outside and gets `d<k>_opt` inside.

use crate::error::{Error, Result};
use crate::layout::mesh::Mesh;
use crate::layout::strategy::Strategy;
use crate::layout::{Dtype, Placement, TensorLayout};
use std::collections::BTreeMap;

/// One `tensor_map` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapEntry {
    /// Split by one device axis (`-1`: not split).
    One(i64),
    /// Split by several device axes, outer first.
    Many(Vec<i64>),
}

/// A MindSpore tensor layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MindSporeLayout {
    /// Device matrix, outermost first.
    pub dev_matrix: Vec<u64>,
    /// One entry per tensor dimension.
    pub tensor_map: Vec<MapEntry>,
    /// Optimizer-shard group stride in ranks (0 or 1 when consecutive).
    pub opt_shard_step: u64,
    /// Optimizer-shard group size (0 or 1: no optimizer sharding).
    pub opt_shard_size: u64,
}

/// Converts a MindSpore layout of a tensor of `shape` into a mesh and our layout.
///
/// ```
/// use ckpt_core::layout::Dtype;
/// use ckpt_core::layout::mindspore::{from_mindspore, MapEntry, MindSporeLayout};
/// use ckpt_core::layout::region::Region;
/// // A 32x32 weight, dev_matrix [2, 4], tensor_map [1, -1]: ranks 0-3 hold rows 0-15,
/// // ranks 4-7 rows 16-31.
/// let ms = MindSporeLayout {
///     dev_matrix: vec![2, 4],
///     tensor_map: vec![MapEntry::One(1), MapEntry::One(-1)],
///     opt_shard_step: 0,
///     opt_shard_size: 0,
/// };
/// let (mesh, l) = from_mindspore("w", &ms, vec![32, 32], Dtype::F32).unwrap();
/// assert_eq!(l.pieces(&mesh, 3)[0].global, Region::from_ranges(&[0..16, 0..32]));
/// assert_eq!(l.pieces(&mesh, 4)[0].global, Region::from_ranges(&[16..32, 0..32]));
/// ```
///
/// # Errors
/// Map entries out of range, an axis used twice, optimizer groups that do not fall on
/// device-axis boundaries or overlap split axes, or an invalid resulting layout.
pub fn from_mindspore(
    tensor: &str,
    ms: &MindSporeLayout,
    shape: Vec<u64>,
    dtype: Dtype,
) -> Result<(Mesh, TensorLayout)> {
    let bad = |problem: String| Error::InvalidLayout {
        tensor: tensor.to_string(),
        problem,
    };
    let n = ms.dev_matrix.len();
    if ms.tensor_map.len() != shape.len() {
        return Err(bad(format!(
            "tensor_map has {} entries for {} dims",
            ms.tensor_map.len(),
            shape.len()
        )));
    }
    // Axes as (name, size, device index k, part): part 0 whole/outer, 1 inner.
    let mut axes: Vec<(String, u64, usize)> = ms
        .dev_matrix
        .iter()
        .enumerate()
        .map(|(i, &s)| (format!("d{}", n - 1 - i), s, n - 1 - i))
        .collect();
    // Optimizer groups: ranks base + j*step, so the group coordinate is
    // (rank / step) % size: the mesh must have axis boundaries at step and step*size.
    let opt = ms.opt_shard_size > 1;
    let step = ms.opt_shard_step.max(1);
    let mut opt_axes: Vec<String> = vec![];
    if opt {
        for boundary in [step, step * ms.opt_shard_size] {
            cut_at(&mut axes, boundary).map_err(&bad)?;
        }
        let mut suffix = 1u64;
        for a in axes.iter().rev() {
            if suffix >= step && suffix < step * ms.opt_shard_size {
                opt_axes.push(a.0.clone());
            }
            suffix *= a.1;
        }
    }
    let mesh = Mesh::new(axes.iter().map(|a| (a.0.clone(), a.1)).collect())?;
    let mut placements = vec![Placement::Replicate; axes.len()];
    for (dim, entry) in ms.tensor_map.iter().enumerate() {
        let ks: Vec<i64> = match entry {
            MapEntry::One(k) => vec![*k],
            MapEntry::Many(v) => v.clone(),
        };
        for (order, k) in ks.into_iter().enumerate() {
            if k == -1 {
                continue;
            }
            if k < -1 || k as usize >= n {
                return Err(bad(format!(
                    "tensor_map value {k} is outside a device matrix of {n} axes"
                )));
            }
            // Every (possibly cut) axis of device index k splits this dim.
            for (i, a) in axes.iter().enumerate() {
                if a.2 == k as usize {
                    if placements[i] != Placement::Replicate {
                        return Err(bad(format!(
                            "device axis {k} is used twice in the tensor_map"
                        )));
                    }
                    if opt_axes.contains(&a.0) {
                        return Err(bad(format!("optimizer-shard group overlaps device axis {k}, which splits the tensor")));
                    }
                    placements[i] = Placement::Shard {
                        dim,
                        blocks: 1,
                        order: order as u32,
                    };
                }
            }
        }
    }
    if opt {
        if shape.is_empty() {
            return Err(bad("optimizer sharding of a scalar".into()));
        }
        for (i, a) in axes.iter().enumerate() {
            if opt_axes.contains(&a.0) {
                // After every tensor_map split of dim 0: the slice is split again.
                placements[i] = Placement::Shard {
                    dim: 0,
                    blocks: 1,
                    order: 1000,
                };
            }
        }
    }
    let layout = TensorLayout::new(shape, dtype, placements);
    layout.validate(tensor, &mesh)?;
    Ok((mesh, layout))
}

/// Cuts the axes so that `boundary` (a product of trailing axis sizes) falls between
/// two axes, splitting one axis in two when needed.
fn cut_at(axes: &mut Vec<(String, u64, usize)>, boundary: u64) -> std::result::Result<(), String> {
    let mut suffix = 1u64;
    for i in (0..axes.len()).rev() {
        if suffix == boundary {
            return Ok(());
        }
        let next = suffix * axes[i].1;
        if next > boundary {
            let inner = boundary / suffix;
            if !boundary.is_multiple_of(suffix) || !axes[i].1.is_multiple_of(inner) {
                return Err(format!(
                    "optimizer-shard boundary {boundary} does not fall on a device-axis boundary"
                ));
            }
            let (name, size, k) = axes[i].clone();
            axes[i] = (name.clone(), size / inner, k);
            axes.insert(i + 1, (format!("{name}_opt"), inner, k));
            return Ok(());
        }
        suffix = next;
    }
    if suffix == boundary {
        Ok(())
    } else {
        Err(format!(
            "optimizer-shard group of {boundary} ranks exceeds the device matrix"
        ))
    }
}

/// One ckpt strategy for MindSpore layouts that share a mesh; fully replicated
/// tensors fit any mesh. `None` when split tensors use different device matrices.
pub(crate) fn common_strategy(known: &BTreeMap<String, (Mesh, TensorLayout)>) -> Option<Strategy> {
    let split = |l: &TensorLayout| l.placements.iter().any(|p| *p != Placement::Replicate);
    let mesh = known
        .values()
        .find(|(_, l)| split(l))
        .or_else(|| known.values().next())
        .map(|(m, _)| m.clone())?;
    let mut s = Strategy::new(mesh.clone());
    for (name, (m, l)) in known {
        let l = if m == &mesh {
            l.clone()
        } else if !split(l) {
            TensorLayout::new(
                l.shape.clone(),
                l.dtype,
                vec![Placement::Replicate; mesh.axes().len()],
            )
        } else {
            return None;
        };
        s.insert(name.clone(), l).ok()?;
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::region::Region;

    fn ms(dev: &[u64], map: &[i64], step: u64, size: u64) -> MindSporeLayout {
        MindSporeLayout {
            dev_matrix: dev.to_vec(),
            tensor_map: map.iter().map(|&k| MapEntry::One(k)).collect(),
            opt_shard_step: step,
            opt_shard_size: size,
        }
    }

    #[test]
    fn column_split_with_optimizer_shard_over_the_replica_axis() {
        // dev [2, 4], dim 1 split by d0 (4 ways); the replica group {r, r+4} splits dim 0.
        let (mesh, l) =
            from_mindspore("w", &ms(&[2, 4], &[-1, 0], 4, 2), vec![32, 32], Dtype::F32).unwrap();
        assert_eq!(
            l.pieces(&mesh, 0)[0].global,
            Region::from_ranges(&[0..16, 0..8])
        );
        assert_eq!(
            l.pieces(&mesh, 4)[0].global,
            Region::from_ranges(&[16..32, 0..8])
        );
        assert_eq!(
            l.pieces(&mesh, 5)[0].global,
            Region::from_ranges(&[16..32, 8..16])
        );
    }

    #[test]
    fn optimizer_shard_of_consecutive_ranks_cuts_an_axis() {
        // Pure data parallel on 8; optimizer groups {0,1}, {2,3}, ... split dim 0 in two.
        let (mesh, l) =
            from_mindspore("w", &ms(&[8], &[-1, -1], 1, 2), vec![32, 4], Dtype::F32).unwrap();
        assert_eq!(mesh.to_string(), "d0=4,d0_opt=2");
        assert_eq!(
            l.pieces(&mesh, 1)[0].global,
            Region::from_ranges(&[16..32, 0..4])
        );
        assert_eq!(
            l.pieces(&mesh, 2)[0].global,
            Region::from_ranges(&[0..16, 0..4])
        );
    }

    #[test]
    fn row_split_then_optimizer_shard_splits_the_slice() {
        // dev [2, 4]: dim 0 split by d0 (4 ways), then the replica group {r, r+4} splits each
        // slice of 8 rows in two: rank 1 holds rows 8..12, rank 5 rows 12..16.
        let (mesh, l) =
            from_mindspore("w", &ms(&[2, 4], &[0, -1], 4, 2), vec![32, 32], Dtype::F32).unwrap();
        assert_eq!(
            l.pieces(&mesh, 1)[0].global,
            Region::from_ranges(&[8..12, 0..32])
        );
        assert_eq!(
            l.pieces(&mesh, 5)[0].global,
            Region::from_ranges(&[12..16, 0..32])
        );
    }

    #[test]
    fn multi_axis_entry_and_errors() {
        let m = MindSporeLayout {
            dev_matrix: vec![2, 2],
            tensor_map: vec![MapEntry::Many(vec![1, 0]), MapEntry::One(-1)],
            opt_shard_step: 0,
            opt_shard_size: 0,
        };
        let (mesh, l) = from_mindspore("w", &m, vec![8, 2], Dtype::F32).unwrap();
        let starts: Vec<u64> = (0..4)
            .map(|r| l.pieces(&mesh, r)[0].global.start[0])
            .collect();
        assert_eq!(starts, vec![0, 2, 4, 6]);
        let e =
            from_mindspore("w", &ms(&[2, 4], &[2, -1], 0, 0), vec![4, 4], Dtype::F32).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `w`: tensor_map value 2 is outside a device matrix of 2 axes"
        );
        let e =
            from_mindspore("w", &ms(&[2, 4], &[0, -1], 1, 2), vec![32, 4], Dtype::F32).unwrap_err();
        assert!(e.to_string().contains("overlaps device axis 0"), "{e}");
    }
}
