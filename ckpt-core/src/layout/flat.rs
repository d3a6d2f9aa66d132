//! Flat ranges: a piece of a tensor that is a run `start..start+len` of its row-major
//! elements rather than a box. DeepSpeed ZeRO-1/2 concatenate a group's parameters and
//! cut the result into equal parts, so a rank's part begins and ends inside tensors;
//! ZeRO-3 cuts every parameter alone into `ceil(numel / dp)` elements; Megatron's
//! distributed optimizer does the same per bucket (`flattened_range`).
//!
//! A flat range of a tensor is exactly a short list of boxes that follow one another in
//! C order ([`FlatRange::boxes`]: a partial innermost row, whole rows, ..., at most
//! `2 * ndim - 1` of them), each of which is one contiguous run of the range's bytes. So
//! the planner and the copy engine, which move boxes, move flat pieces unchanged; this
//! module gives the exact correspondence both ways ([`flat_to_box`], [`box_to_flat`])
//! and the coverage check of a tensor cut into flat ranges ([`check_flat_cover`]),
//! which, unlike boxes, can be done in one dimension by sorting.
//!
//! Padding (ZeRO pads each group, or each parameter, to a multiple of the
//! data-parallel size) is not part of any tensor: [`FlatLayout`] places tensors one
//! after the other in a flat buffer with the padding named, so a reader can check that
//! the padding is where the format puts it and nowhere else.

use crate::error::{overflow, Result};
use crate::layout::region::{Region, Run, Runs};
use std::fmt;

/// Elements `start..start + len` of a tensor in row-major order.
///
/// ```
/// use ckpt_core::layout::flat::FlatRange;
/// use ckpt_core::layout::region::Region;
/// // Elements 2..9 of a 3x4 tensor: the end of row 0, all of row 1, the start of row 2.
/// let boxes = FlatRange::new(2, 7).boxes(&[3, 4]).unwrap();
/// let regions: Vec<Region> = boxes.iter().map(|b| b.region.clone()).collect();
/// assert_eq!(
///     regions,
///     vec![
///         Region::from_ranges(&[0..1, 2..4]),
///         Region::from_ranges(&[1..2, 0..4]),
///         Region::from_ranges(&[2..3, 0..1]),
///     ]
/// );
/// assert_eq!(boxes.iter().map(|b| b.offset).collect::<Vec<_>>(), vec![0, 2, 6]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FlatRange {
    /// First element (row-major index into the tensor).
    pub start: u64,
    /// Number of elements.
    pub len: u64,
}

/// One box of a flat range: where it lies in the tensor, and where its (contiguous)
/// elements begin within the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatBox {
    /// The box in the tensor's index space.
    pub region: Region,
    /// Element offset of the box's first element from the range's first element; the
    /// box's elements are `offset..offset + region.numel()` of the range.
    pub offset: u64,
}

impl FlatRange {
    /// The range of `len` elements from `start`.
    #[must_use]
    pub fn new(start: u64, len: u64) -> FlatRange {
        FlatRange { start, len }
    }

    /// One past the last element.
    ///
    /// # Errors
    /// [`Error::Overflow`](crate::Error::Overflow) when `start + len` wraps.
    pub fn end(&self) -> Result<u64> {
        self.start
            .checked_add(self.len)
            .ok_or_else(|| overflow(format!("flat range {}+{}", self.start, self.len)))
    }

    /// The elements both ranges hold.
    #[must_use]
    pub fn overlap(&self, other: &FlatRange) -> Option<FlatRange> {
        let lo = self.start.max(other.start);
        let hi = self
            .start
            .saturating_add(self.len)
            .min(other.start.saturating_add(other.len));
        (hi > lo).then(|| FlatRange::new(lo, hi - lo))
    }

    /// The boxes of a tensor of `shape` this range covers, in C order, with their
    /// offsets in the range: the fewest boxes whose union is the range and each of which
    /// is contiguous (at most `2 * ndim - 1`; one when the range is whole rows). Empty
    /// for an empty range.
    ///
    /// # Errors
    /// The range reaches past the tensor's last element, or the element count
    /// overflows.
    pub fn boxes(&self, shape: &[u64]) -> Result<Vec<FlatBox>> {
        let numel = numel(shape)?;
        let end = self.end()?;
        if end > numel {
            return Err(overflow(format!(
                "flat range {}..{end} of a tensor of shape {shape:?} ({numel} elements)",
                self.start
            )));
        }
        let mut offset = 0;
        Ok(Region::flat_range(shape, self.start, end)
            .into_iter()
            .map(|region| {
                let b = FlatBox {
                    offset,
                    region: region.clone(),
                };
                // Cannot wrap: the boxes' sizes add up to `len`.
                offset += region.numel();
                b
            })
            .collect())
    }
}

impl fmt::Display for FlatRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "flat {}..{}",
            self.start,
            self.start.saturating_add(self.len)
        )
    }
}

/// The number of elements of a tensor of `shape`, checked.
///
/// # Errors
/// [`Error::Overflow`](crate::Error::Overflow).
pub fn numel(shape: &[u64]) -> Result<u64> {
    shape
        .iter()
        .try_fold(1u64, |a, &b| a.checked_mul(b))
        .ok_or_else(|| overflow(format!("element count of shape {shape:?}")))
}

/// The flat range a box of a tensor of `shape` is, when it is one contiguous run of the
/// tensor's elements: extent 1 on its leading axes, then any extent on one axis, then
/// whole axes. `None` otherwise (and for an empty box).
///
/// ```
/// use ckpt_core::layout::flat::{flat_of_box, FlatRange};
/// use ckpt_core::layout::region::Region;
/// // Rows 2..4 of layer 1 of a [3, 4, 5] tensor: elements 30..40.
/// let rows = Region::from_ranges(&[1..2, 2..4, 0..5]);
/// assert_eq!(flat_of_box(&rows, &[3, 4, 5]), Some(FlatRange::new(30, 10)));
/// // Columns 0..2 of it are not one run.
/// assert_eq!(flat_of_box(&Region::from_ranges(&[1..2, 2..4, 0..2]), &[3, 4, 5]), None);
/// ```
#[must_use]
pub fn flat_of_box(region: &Region, shape: &[u64]) -> Option<FlatRange> {
    if region.ndim() != shape.len() || region.is_empty() {
        return None;
    }
    // The first axis of extent > 1; every later one must be whole.
    let k = (0..shape.len())
        .find(|&d| region.shape[d] != 1)
        .unwrap_or(shape.len());
    if (k + 1..shape.len()).any(|d| region.start[d] != 0 || region.shape[d] != shape[d]) {
        return None;
    }
    let mut start = 0u64;
    for (d, &n) in shape.iter().enumerate() {
        start = start.checked_mul(n)?.checked_add(region.start[d])?;
    }
    Some(FlatRange::new(start, region.numel()))
}

/// The runs that copy the part of `dst` (a box of a tensor of `shape`) that a flat
/// range holds, from a buffer holding the range's elements (`src` counts from the
/// range's first element) into a buffer holding the box in row-major order (`dst`
/// counts from the box's first element). Multiply by the element size for bytes.
///
/// ```
/// use ckpt_core::layout::flat::{flat_to_box, FlatRange};
/// use ckpt_core::layout::region::{Region, Run};
/// // Elements 2..9 of a 3x4 tensor, into the box of column 1 (rows 0..3).
/// let runs = flat_to_box(FlatRange::new(2, 7), &[3, 4], &Region::from_ranges(&[0..3, 1..2])).unwrap();
/// // Row 1's element (index 5, 3rd of the range) lands in the box's row 1.
/// assert_eq!(runs, vec![Run { src: 3, dst: 1, len: 1 }]);
/// ```
///
/// # Errors
/// As [`FlatRange::boxes`].
pub fn flat_to_box(range: FlatRange, shape: &[u64], dst: &Region) -> Result<Vec<Run>> {
    let mut out = Vec::new();
    for b in range.boxes(shape)? {
        let Some(o) = b.region.overlap(dst) else {
            continue;
        };
        let within_box = o.relative_to(&b.region.start);
        let within_dst = o.relative_to(&dst.start);
        for r in Runs::new(
            &o.shape,
            &b.region.shape,
            &within_box.start,
            &dst.shape,
            &within_dst.start,
        ) {
            out.push(Run {
                src: r.src + b.offset,
                dst: r.dst,
                len: r.len,
            });
        }
    }
    Ok(out)
}

/// The inverse of [`flat_to_box`]: runs from a buffer holding the box `src` of a tensor
/// of `shape` into a buffer holding the flat range (writing ZeRO layouts).
///
/// # Errors
/// As [`FlatRange::boxes`].
pub fn box_to_flat(src: &Region, shape: &[u64], range: FlatRange) -> Result<Vec<Run>> {
    Ok(flat_to_box(range, shape, src)?
        .into_iter()
        .map(|r| Run {
            src: r.dst,
            dst: r.src,
            len: r.len,
        })
        .collect())
}

/// Why a set of flat ranges does not cover a tensor exactly once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlatDefect {
    /// No range holds these elements.
    Gap {
        /// The elements missing.
        range: FlatRange,
    },
    /// Ranges `a` and `b` (indices into the input) both hold these elements.
    Overlap {
        /// Index of one range.
        a: usize,
        /// Index of the other.
        b: usize,
        /// What they share.
        range: FlatRange,
    },
    /// Range `index` reaches past the last element.
    OutOfBounds {
        /// Index of the range.
        index: usize,
        /// The range.
        range: FlatRange,
        /// Elements the tensor has.
        numel: u64,
    },
}

impl fmt::Display for FlatDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlatDefect::Gap { range } => write!(f, "elements {range} are held by no piece"),
            FlatDefect::Overlap { a, b, range } => {
                write!(f, "pieces {a} and {b} both hold elements {range}")
            }
            FlatDefect::OutOfBounds {
                index,
                range,
                numel,
            } => write!(
                f,
                "piece {index} ({range}) reaches past the tensor's {numel} elements"
            ),
        }
    }
}

/// Checks that `ranges` hold every element of a tensor of `numel` elements exactly
/// once (empty ranges are ignored). Sorting, O(n log n). Returns the first defect.
///
/// ```
/// use ckpt_core::layout::flat::{check_flat_cover, FlatDefect, FlatRange};
/// assert_eq!(check_flat_cover(10, &[FlatRange::new(4, 6), FlatRange::new(0, 4)]), Ok(()));
/// assert_eq!(
///     check_flat_cover(10, &[FlatRange::new(0, 4), FlatRange::new(5, 5)]),
///     Err(FlatDefect::Gap { range: FlatRange::new(4, 1) })
/// );
/// ```
///
/// # Errors
/// The first [`FlatDefect`].
pub fn check_flat_cover(numel: u64, ranges: &[FlatRange]) -> std::result::Result<(), FlatDefect> {
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].len > 0).collect();
    for &i in &order {
        let r = ranges[i];
        if r.start.checked_add(r.len).is_none_or(|e| e > numel) {
            return Err(FlatDefect::OutOfBounds {
                index: i,
                range: r,
                numel,
            });
        }
    }
    order.sort_by_key(|&i| (ranges[i].start, i));
    let mut at = 0u64;
    let mut last: Option<usize> = None;
    for i in order {
        let r = ranges[i];
        if r.start > at {
            return Err(FlatDefect::Gap {
                range: FlatRange::new(at, r.start - at),
            });
        }
        if r.start < at {
            let a = last.expect("`at` > 0 only after a range");
            let shared = ranges[a]
                .overlap(&r)
                .expect("sorted by start and r.start < end of a");
            return Err(FlatDefect::Overlap {
                a,
                b: i,
                range: shared,
            });
        }
        at = r.start + r.len;
        last = Some(i);
    }
    if at < numel {
        return Err(FlatDefect::Gap {
            range: FlatRange::new(at, numel - at),
        });
    }
    Ok(())
}

/// What occupies one stretch of a flat buffer laid out by [`FlatLayout`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlatSlot {
    /// Elements `range` of tensor number `tensor` (in the order given).
    Tensor {
        /// Index of the tensor.
        tensor: usize,
        /// Which of its elements.
        range: FlatRange,
    },
    /// Padding the format requires (elements that belong to no tensor).
    Padding,
}

/// Tensors placed one after the other in a flat buffer, then padded to a multiple of
/// `parts` and cut into `parts` equal partitions (ZeRO-1/2's flat groups; ZeRO-3 is
/// the same with one tensor per buffer).
///
/// ```
/// use ckpt_core::layout::flat::{FlatLayout, FlatRange, FlatSlot};
/// // Two tensors of 5 and 6 elements over 4 ranks: 11 elements padded to 12, 3 each.
/// let l = FlatLayout::new(&[5, 6], 4).unwrap();
/// assert_eq!((l.padded, l.partition), (12, 3));
/// // Rank 1 holds elements 3..5 of the first tensor and 0..1 of the second.
/// assert_eq!(
///     l.partition_slots(1),
///     vec![
///         (0, FlatSlot::Tensor { tensor: 0, range: FlatRange::new(3, 2) }),
///         (2, FlatSlot::Tensor { tensor: 1, range: FlatRange::new(0, 1) }),
///     ]
/// );
/// assert_eq!(l.partition_slots(3).last(), Some(&(2, FlatSlot::Padding)));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    /// Where each tensor starts in the buffer, and its element count.
    pub tensors: Vec<FlatRange>,
    /// Elements of all tensors together.
    pub used: u64,
    /// The buffer's length with padding (a multiple of the number of partitions).
    pub padded: u64,
    /// Elements per partition.
    pub partition: u64,
}

impl FlatLayout {
    /// Lays out tensors of the given element counts in order and pads to a multiple of
    /// `parts` (at least 1).
    ///
    /// # Errors
    /// [`Error::Overflow`](crate::Error::Overflow); `parts == 0`.
    pub fn new(numels: &[u64], parts: u64) -> Result<FlatLayout> {
        if parts == 0 {
            return Err(overflow("a flat buffer cut into 0 partitions"));
        }
        let mut tensors = Vec::with_capacity(numels.len());
        let mut at = 0u64;
        for &n in numels {
            tensors.push(FlatRange::new(at, n));
            at = at
                .checked_add(n)
                .ok_or_else(|| overflow("flat buffer length"))?;
        }
        let partition = at.div_ceil(parts);
        let padded = partition
            .checked_mul(parts)
            .ok_or_else(|| overflow("padded flat buffer length"))?;
        Ok(FlatLayout {
            tensors,
            used: at,
            padded,
            partition,
        })
    }

    /// [`FlatLayout::new`] with the buffer padded to a multiple of `alignment` (a
    /// multiple of `parts`) before it is cut: ZeRO-1/2 align each group to
    /// `2 * dp` elements (`nccl_start_alignment_factor * dp` in DeepSpeed's
    /// stage_1_and_2.py), so a partition is always an even number of elements.
    ///
    /// ```
    /// use ckpt_core::layout::flat::FlatLayout;
    /// // 78 + 42 + 7 elements over 3 ranks, aligned to 6: 127 -> 132, 44 each.
    /// let l = FlatLayout::aligned(&[78, 42, 7], 3, 6).unwrap();
    /// assert_eq!((l.used, l.padded, l.partition), (127, 132, 44));
    /// ```
    ///
    /// # Errors
    /// [`Error::Overflow`](crate::Error::Overflow); `parts == 0`; an alignment that is
    /// not a positive multiple of `parts`.
    pub fn aligned(numels: &[u64], parts: u64, alignment: u64) -> Result<FlatLayout> {
        if parts == 0 || alignment == 0 || !alignment.is_multiple_of(parts) {
            return Err(overflow(format!(
                "a flat buffer aligned to {alignment} cut into {parts} partitions"
            )));
        }
        let mut l = FlatLayout::new(numels, parts)?;
        l.padded = l
            .used
            .div_ceil(alignment)
            .checked_mul(alignment)
            .ok_or_else(|| overflow("padded flat buffer length"))?;
        l.partition = l.padded / parts;
        Ok(l)
    }

    /// What partition `part` holds, in order: `(offset within the partition, slot)`,
    /// one entry per tensor it cuts and one for the padding it holds, if any.
    #[must_use]
    pub fn partition_slots(&self, part: u64) -> Vec<(u64, FlatSlot)> {
        let lo = part.saturating_mul(self.partition);
        let hi = lo.saturating_add(self.partition).min(self.padded);
        let mine = FlatRange::new(lo, hi.saturating_sub(lo));
        let mut out = Vec::new();
        // The tensors are sorted by start: find the first one ending after `lo`.
        let first = self
            .tensors
            .partition_point(|t| t.start.saturating_add(t.len) <= lo);
        for (i, t) in self.tensors.iter().enumerate().skip(first) {
            if t.start >= hi {
                break;
            }
            if let Some(o) = t.overlap(&mine) {
                out.push((
                    o.start - lo,
                    FlatSlot::Tensor {
                        tensor: i,
                        range: FlatRange::new(o.start - t.start, o.len),
                    },
                ));
            }
        }
        if hi > self.used.max(lo) {
            out.push((self.used.max(lo) - lo, FlatSlot::Padding));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::coverage::check_tiling;
    use proptest::prelude::*;

    fn row_major(shape: &[u64], idx: &[u64]) -> u64 {
        idx.iter().zip(shape).fold(0, |a, (&i, &s)| a * s + i)
    }

    /// Every element of a region, as row-major indices into a tensor of `shape`, in C
    /// order of the region.
    fn elements(shape: &[u64], r: &Region) -> Vec<u64> {
        let mut out = Vec::new();
        let n = r.numel();
        for k in 0..n {
            let mut rem = k;
            let mut idx = vec![0; r.ndim()];
            for d in (0..r.ndim()).rev() {
                idx[d] = r.start[d] + rem % r.shape[d];
                rem /= r.shape[d];
            }
            out.push(row_major(shape, &idx));
        }
        out
    }

    #[test]
    fn a_range_of_whole_rows_is_one_box() {
        let b = FlatRange::new(8, 8).boxes(&[4, 4]).unwrap();
        assert_eq!(
            b,
            vec![FlatBox {
                region: Region::from_ranges(&[2..4, 0..4]),
                offset: 0
            }]
        );
    }

    #[test]
    fn past_the_end_is_an_error() {
        let e = FlatRange::new(10, 3)
            .boxes(&[3, 4])
            .unwrap_err()
            .to_string();
        assert!(e.contains("10..13") && e.contains("12 elements"), "{e}");
    }

    #[test]
    fn cover_names_overlap_and_out_of_bounds() {
        assert_eq!(
            check_flat_cover(10, &[FlatRange::new(0, 6), FlatRange::new(4, 6)]),
            Err(FlatDefect::Overlap {
                a: 0,
                b: 1,
                range: FlatRange::new(4, 2)
            })
        );
        assert_eq!(
            check_flat_cover(10, &[FlatRange::new(0, 6), FlatRange::new(6, 5)]),
            Err(FlatDefect::OutOfBounds {
                index: 1,
                range: FlatRange::new(6, 5),
                numel: 10
            })
        );
        assert_eq!(
            check_flat_cover(10, &[FlatRange::new(0, 6)]),
            Err(FlatDefect::Gap {
                range: FlatRange::new(6, 4)
            })
        );
        assert_eq!(check_flat_cover(0, &[]), Ok(()));
    }

    #[test]
    fn layout_pads_the_last_partition_only() {
        let l = FlatLayout::new(&[3, 0, 4], 3).unwrap();
        assert_eq!((l.used, l.padded, l.partition), (7, 9, 3));
        assert_eq!(
            l.partition_slots(2),
            vec![
                (
                    0,
                    FlatSlot::Tensor {
                        tensor: 2,
                        range: FlatRange::new(3, 1)
                    }
                ),
                (1, FlatSlot::Padding)
            ]
        );
        // Exactly divisible: no padding anywhere.
        let l = FlatLayout::new(&[6], 3).unwrap();
        assert!((0..3).all(|p| !l
            .partition_slots(p)
            .iter()
            .any(|(_, s)| *s == FlatSlot::Padding)));
        assert!(FlatLayout::new(&[u64::MAX, 1], 2).is_err());
    }

    fn shape_and_cuts() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
        prop::collection::vec(1u64..6, 0..4).prop_flat_map(|shape| {
            let n: u64 = shape.iter().product();
            (Just(shape), prop::collection::vec(0..=n, 0..6))
        })
    }

    proptest! {
        #[test]
        fn boxes_cover_exactly_the_range((shape, cuts) in shape_and_cuts()) {
            let n: u64 = shape.iter().product();
            let mut cuts = cuts;
            cuts.push(0);
            cuts.push(n);
            cuts.sort_unstable();
            for w in cuts.windows(2) {
                let r = FlatRange::new(w[0], w[1] - w[0]);
                let boxes = r.boxes(&shape).unwrap();
                prop_assert!(boxes.len() <= (2 * shape.len()).saturating_sub(1).max(1));
                let mut flat = Vec::new();
                for b in &boxes {
                    prop_assert_eq!(b.offset, flat.len() as u64);
                    flat.extend(elements(&shape, &b.region));
                }
                prop_assert_eq!(flat, (w[0]..w[1]).collect::<Vec<_>>());
            }
            // All the pieces' boxes together tile the tensor.
            let all: Vec<Region> = cuts
                .windows(2)
                .flat_map(|w| FlatRange::new(w[0], w[1] - w[0]).boxes(&shape).unwrap())
                .map(|b| b.region)
                .collect();
            prop_assert_eq!(check_tiling(&shape, &all), Ok(()));
            let ranges: Vec<FlatRange> =
                cuts.windows(2).map(|w| FlatRange::new(w[0], w[1] - w[0])).collect();
            prop_assert_eq!(check_flat_cover(n, &ranges), Ok(()));
        }

        #[test]
        fn every_element_comes_back(
            (shape, cuts) in shape_and_cuts(),
            split in prop::collection::vec(0u64..6, 4),
        ) {
            let n: u64 = shape.iter().product();
            let mut cuts = cuts;
            cuts.push(0);
            cuts.push(n);
            cuts.sort_unstable();
            // A tensor whose element i is i, cut into flat pieces.
            let pieces: Vec<(FlatRange, Vec<u64>)> = cuts
                .windows(2)
                .map(|w| (FlatRange::new(w[0], w[1] - w[0]), (w[0]..w[1]).collect()))
                .collect();
            // Target: boxes cutting each dimension at one point.
            let mut targets = vec![Region::full(&[])];
            for (d, &s) in shape.iter().enumerate() {
                let c = split[d % split.len()] % (s + 1);
                let mut next = Vec::new();
                for t in &targets {
                    for (lo, hi) in [(0, c), (c, s)] {
                        let mut start = t.start.clone();
                        let mut ext = t.shape.clone();
                        start.push(lo);
                        ext.push(hi - lo);
                        next.push(Region::new(start, ext));
                    }
                }
                targets = next;
            }
            // Flat -> boxes.
            let mut boxes: Vec<Vec<u64>> = Vec::new();
            for t in &targets {
                let mut buf = vec![u64::MAX; t.numel() as usize];
                for (r, data) in &pieces {
                    for run in flat_to_box(*r, &shape, t).unwrap() {
                        for k in 0..run.len {
                            buf[(run.dst + k) as usize] = data[(run.src + k) as usize];
                        }
                    }
                }
                prop_assert_eq!(&buf, &elements(&shape, t));
                boxes.push(buf);
            }
            // Boxes -> flat again.
            for (r, data) in &pieces {
                let mut back = vec![u64::MAX; r.len as usize];
                for (t, buf) in targets.iter().zip(&boxes) {
                    for run in box_to_flat(t, &shape, *r).unwrap() {
                        for k in 0..run.len {
                            back[(run.dst + k) as usize] = buf[(run.src + k) as usize];
                        }
                    }
                }
                prop_assert_eq!(&back, data);
            }
        }

        #[test]
        fn layout_partitions_hold_every_element_once(
            numels in prop::collection::vec(0u64..20, 0..6),
            parts in 1u64..5,
        ) {
            let l = FlatLayout::new(&numels, parts).unwrap();
            let mut per_tensor: Vec<Vec<FlatRange>> = vec![vec![]; numels.len()];
            let mut padding = 0;
            for p in 0..parts {
                let slots = l.partition_slots(p);
                for (k, (off, s)) in slots.iter().enumerate() {
                    let next = slots.get(k + 1).map_or(l.partition, |x| x.0);
                    match s {
                        FlatSlot::Tensor { tensor, range } => {
                            prop_assert_eq!(next - off, range.len);
                            per_tensor[*tensor].push(*range);
                        }
                        FlatSlot::Padding => padding += next - off,
                    }
                }
            }
            prop_assert_eq!(padding, l.padded - l.used);
            for (t, rs) in per_tensor.iter().enumerate() {
                prop_assert_eq!(check_flat_cover(numels[t], rs), Ok(()));
            }
        }

        /// ZeRO-1/2's cut (align to 2 * dp, then dp equal parts): every element once,
        /// the padding only at the end, less than one alignment of it.
        #[test]
        fn aligned_partitions_hold_every_element_once(
            numels in prop::collection::vec(0u64..40, 0..6),
            parts in 1u64..6,
        ) {
            let l = FlatLayout::aligned(&numels, parts, 2 * parts).unwrap();
            prop_assert_eq!(l.padded % (2 * parts), 0);
            prop_assert!(l.padded - l.used < 2 * parts);
            prop_assert_eq!(l.partition * parts, l.padded);
            let mut per_tensor: Vec<Vec<FlatRange>> = vec![vec![]; numels.len()];
            let mut data_end = 0;
            for p in 0..parts {
                let slots = l.partition_slots(p);
                for (k, (off, s)) in slots.iter().enumerate() {
                    let next = slots.get(k + 1).map_or(l.partition, |x| x.0);
                    match s {
                        FlatSlot::Tensor { tensor, range } => {
                            prop_assert_eq!(next - off, range.len);
                            prop_assert_eq!(p * l.partition + off, l.tensors[*tensor].start + range.start);
                            per_tensor[*tensor].push(*range);
                            data_end = data_end.max(p * l.partition + next);
                        }
                        FlatSlot::Padding => prop_assert!(p * l.partition + off >= l.used),
                    }
                }
            }
            prop_assert!(data_end <= l.used);
            for (t, rs) in per_tensor.iter().enumerate() {
                prop_assert_eq!(check_flat_cover(numels[t], rs), Ok(()));
            }
        }
    }
}
