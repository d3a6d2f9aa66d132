//! Checks that a set of boxes tiles a tensor exactly: no hole, no overlap.
//!
//! A sweep, never all pairs: along dimension 0 the box edges cut the tensor into
//! slabs; within a slab the boxes active there must tile the remaining dimensions,
//! checked the same way. Boxes aligned on a grid (every layout ckpt derives) take part
//! in exactly one slab per dimension, so the check costs O(n log n).

use crate::layout::region::Region;

/// Why a set of boxes does not tile a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Defect {
    /// Elements of `region` are covered by no box.
    Gap {
        /// The uncovered part.
        region: Region,
    },
    /// Boxes `a` and `b` (indices into the input) share `region`.
    Overlap {
        /// Index of one box.
        a: usize,
        /// Index of the other box.
        b: usize,
        /// Part of what they share.
        region: Region,
    },
}

/// Checks that `boxes` cover every element of a tensor of `shape` exactly once.
/// Empty boxes are ignored. Returns the first defect found.
///
/// ```
/// use ckpt_core::{check_tiling, Defect, Region};
/// let halves = [Region::from_ranges(&[0..2, 0..4]), Region::from_ranges(&[2..4, 0..4])];
/// assert_eq!(check_tiling(&[4, 4], &halves), Ok(()));
/// let hole = [Region::from_ranges(&[0..2, 0..4]), Region::from_ranges(&[2..4, 0..3])];
/// assert_eq!(check_tiling(&[4, 4], &hole), Err(Defect::Gap { region: Region::from_ranges(&[2..4, 3..4]) }));
/// ```
///
/// # Errors
/// The first [`Defect`].
pub fn check_tiling(shape: &[u64], boxes: &[Region]) -> Result<(), Defect> {
    let ids: Vec<usize> = (0..boxes.len()).filter(|&i| !boxes[i].is_empty()).collect();
    if shape.contains(&0) {
        return Ok(());
    }
    let mut prefix = Region::new(vec![], vec![]);
    sweep(shape, boxes, ids, 0, &mut prefix)
}

fn gap(shape: &[u64], prefix: &Region, d: usize, lo: u64, hi: u64) -> Defect {
    let mut start = prefix.start.clone();
    let mut extent = prefix.shape.clone();
    start.push(lo);
    extent.push(hi - lo);
    for &s in &shape[d + 1..] {
        start.push(0);
        extent.push(s);
    }
    Defect::Gap {
        region: Region::new(start, extent),
    }
}

fn sweep(
    shape: &[u64],
    boxes: &[Region],
    ids: Vec<usize>,
    d: usize,
    prefix: &mut Region,
) -> Result<(), Defect> {
    if d == shape.len() {
        // A single element (or scalar): exactly one box must hold it.
        return match ids.len() {
            0 => Err(Defect::Gap {
                region: prefix.clone(),
            }),
            1 => Ok(()),
            _ => Err(Defect::Overlap {
                a: ids[0],
                b: ids[1],
                region: prefix.clone(),
            }),
        };
    }
    // Events along dimension d: (position, is_start, box).
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(ids.len() * 2);
    for &i in &ids {
        events.push((boxes[i].start[d], true, i));
        events.push((boxes[i].end(d), false, i));
    }
    // Ends sort before starts at the same position.
    events.sort_unstable_by_key(|&(p, s, i)| (p, s, i));
    let mut active: std::collections::BTreeSet<usize> = std::collections::BTreeSet::new();
    let mut pos = 0u64;
    let mut e = 0;
    while pos < shape[d] {
        while e < events.len() && events[e].0 <= pos {
            let (_, is_start, i) = events[e];
            if is_start {
                active.insert(i);
            } else {
                active.remove(&i);
            }
            e += 1;
        }
        let next = events.get(e).map_or(shape[d], |ev| ev.0.min(shape[d]));
        if active.is_empty() {
            return Err(gap(shape, prefix, d, pos, next));
        }
        prefix.start.push(pos);
        prefix.shape.push(next - pos);
        let r = if d + 1 == shape.len() {
            // Innermost dimension: the slab is covered once or overlapped.
            let mut it = active.iter();
            match (it.next(), it.next()) {
                (Some(&a), Some(&b)) => Err(Defect::Overlap {
                    a,
                    b,
                    region: prefix.clone(),
                }),
                _ => Ok(()),
            }
        } else {
            sweep(
                shape,
                boxes,
                active.iter().copied().collect(),
                d + 1,
                prefix,
            )
        };
        prefix.start.pop();
        prefix.shape.pop();
        r?;
        pos = next;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-dimensional regions
mod tests {
    use super::*;

    #[test]
    fn finds_overlap_with_both_boxes() {
        let b = [
            Region::from_ranges(&[0..3, 0..4]),
            Region::from_ranges(&[2..4, 0..4]),
        ];
        match check_tiling(&[4, 4], &b) {
            Err(Defect::Overlap { a, b, region }) => {
                assert_eq!((a, b), (0, 1));
                assert_eq!(region.start[0], 2);
            }
            other => panic!("expected an overlap, got {other:?}"),
        }
    }

    #[test]
    fn scalars_and_empty_boxes() {
        assert_eq!(check_tiling(&[], &[Region::full(&[])]), Ok(()));
        assert!(check_tiling(&[], &[]).is_err());
        assert_eq!(check_tiling(&[0, 5], &[]), Ok(()));
        let b = [Region::from_ranges(&[0..4]), Region::from_ranges(&[4..4])];
        assert_eq!(check_tiling(&[4], &b), Ok(()));
    }

    #[test]
    fn box_past_the_end_is_not_a_tiling() {
        let b = [Region::from_ranges(&[0..5])];
        // The caller checks bounds; the sweep only sees the tensor's extent.
        assert_eq!(check_tiling(&[4], &b), Ok(()));
        let b = [Region::from_ranges(&[1..4])];
        assert_eq!(
            check_tiling(&[4], &b),
            Err(Defect::Gap {
                region: Region::from_ranges(&[0..1])
            })
        );
    }
}
