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
/// use ckpt_core::layout::coverage::{check_tiling, Defect};
/// use ckpt_core::layout::region::Region;
/// let halves = [Region::from_ranges(&[0..2, 0..4]), Region::from_ranges(&[2..4, 0..4])];
/// assert_eq!(check_tiling(&[4, 4], &halves), Ok(()));
/// let hole = [Region::from_ranges(&[0..2, 0..4]), Region::from_ranges(&[2..4, 0..3])];
/// assert_eq!(check_tiling(&[4, 4], &hole), Err(Defect::Gap { region: Region::from_ranges(&[2..4, 3..4]) }));
/// ```
///
/// # Errors
/// The first [`Defect`].
pub fn check_tiling(shape: &[u64], boxes: &[Region]) -> Result<(), Defect> {
    if slices_in_order(shape, boxes) {
        return Ok(());
    }
    let ids: Vec<usize> = (0..boxes.len()).filter(|&i| !boxes[i].is_empty()).collect();
    if shape.contains(&0) {
        return Ok(());
    }
    let mut prefix = Region::new(vec![], vec![]);
    sweep(shape, boxes, ids, 0, &mut prefix)
}

/// Whether `boxes` (the empty ones aside) are slices of the whole tensor along one
/// dimension, in order and edge to edge: the shape of nearly every tensor's pieces
/// (one, or a tensor-parallel cut), recognised in one pass so that the sweep, and its
/// allocations, run only for the other tilings and for defects, which it names.
fn slices_in_order(shape: &[u64], boxes: &[Region]) -> bool {
    if shape.is_empty() || shape.contains(&0) {
        return false;
    }
    let mut nonempty = boxes.iter().filter(|b| !b.is_empty());
    let Some(first) = nonempty.next() else {
        return false;
    };
    if first.start.len() != shape.len() {
        return false;
    }
    let full = |b: &Region, d: usize| b.start[d] == 0 && b.shape[d] == shape[d];
    // The dimension the slices cut: the first one the first box does not span.
    let d = (0..shape.len()).find(|&d| !full(first, d)).unwrap_or(0);
    let mut reached = 0u64;
    for b in std::iter::once(first).chain(nonempty) {
        if b.start.len() != shape.len()
            || b.start[d] != reached
            || (0..shape.len()).any(|k| k != d && !full(b, k))
        {
            return false;
        }
        reached = match reached.checked_add(b.shape[d]) {
            Some(r) => r,
            None => return false,
        };
    }
    reached == shape[d]
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

    /// The one-pass check of slices in order agrees with the sweep on every case.
    #[test]
    fn slices_in_order_agree_with_the_sweep() {
        let r = |x: &[std::ops::Range<u64>]| Region::from_ranges(x);
        let cases: Vec<(Vec<u64>, Vec<Region>, bool)> = vec![
            (vec![4, 4], vec![r(&[0..4, 0..4])], true),
            (vec![4, 4], vec![r(&[0..2, 0..4]), r(&[2..4, 0..4])], true),
            (vec![4, 4], vec![r(&[0..4, 0..1]), r(&[0..4, 1..4])], true),
            (vec![4, 4], vec![r(&[0..4, 0..0]), r(&[0..4, 0..4])], true),
            // Out of order, a gap, an overlap, a box not spanning the other dimension,
            // cuts on two dimensions: left to the sweep.
            (vec![4, 4], vec![r(&[2..4, 0..4]), r(&[0..2, 0..4])], false),
            (vec![4, 4], vec![r(&[0..2, 0..4]), r(&[3..4, 0..4])], false),
            (vec![4, 4], vec![r(&[0..3, 0..4]), r(&[2..4, 0..4])], false),
            (vec![4, 4], vec![r(&[0..2, 0..4]), r(&[2..4, 0..3])], false),
            (
                vec![4, 4],
                vec![
                    r(&[0..2, 0..2]),
                    r(&[0..2, 2..4]),
                    r(&[2..4, 0..2]),
                    r(&[2..4, 2..4]),
                ],
                false,
            ),
            (vec![4, 4], vec![r(&[0..2, 0..4])], false),
            (vec![4], vec![r(&[0..2]), r(&[2..5])], false),
        ];
        for (shape, boxes, fast) in cases {
            assert_eq!(slices_in_order(&shape, &boxes), fast, "{boxes:?}");
            let ids = (0..boxes.len()).filter(|&i| !boxes[i].is_empty()).collect();
            let swept = sweep(&shape, &boxes, ids, 0, &mut Region::new(vec![], vec![]));
            if fast {
                assert_eq!(swept, Ok(()), "{boxes:?}");
            }
            assert_eq!(check_tiling(&shape, &boxes), swept, "{boxes:?}");
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
