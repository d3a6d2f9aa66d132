//! `Region`: an N-dimensional box of a tensor, and the contiguous runs that copy one.

use std::fmt;

/// A box `start..start+shape` in an N-dimensional index space.
///
/// ```
/// use ckpt_core::layout::region::Region;
/// let a = Region::from_ranges(&[1..5, 2..6]);
/// let b = Region::from_ranges(&[3..6, 4..7]);
/// assert_eq!(a.overlap(&b), Some(Region::from_ranges(&[3..5, 4..6])));
/// assert_eq!(a.to_string(), "[1..5, 2..6]");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Region {
    /// First index on every dimension.
    pub start: Dims,
    /// Extent on every dimension.
    pub shape: Dims,
}

/// One index or extent per dimension, inline up to four dimensions (every tensor of a
/// checkpoint but a few): a box then costs no allocation, which counts when a
/// checkpoint of experts holds a million pieces, each two boxes.
pub type Dims = smallvec::SmallVec<[u64; 4]>;

impl Region {
    /// A region from its start and shape (same length).
    #[must_use]
    pub fn new(start: impl Into<Dims>, shape: impl Into<Dims>) -> Region {
        let (start, shape) = (start.into(), shape.into());
        assert_eq!(
            start.len(),
            shape.len(),
            "start and shape of a region differ in rank"
        );
        Region { start, shape }
    }

    /// The whole of a tensor of this shape.
    #[must_use]
    pub fn full(shape: &[u64]) -> Region {
        Region {
            start: smallvec::smallvec![0; shape.len()],
            shape: shape.into(),
        }
    }

    /// A region from one range per dimension.
    #[must_use]
    pub fn from_ranges(ranges: &[std::ops::Range<u64>]) -> Region {
        Region {
            start: ranges.iter().map(|r| r.start).collect(),
            shape: ranges
                .iter()
                .map(|r| r.end.saturating_sub(r.start))
                .collect(),
        }
    }

    /// Number of dimensions.
    #[must_use]
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// One past the last index on dimension `d`.
    #[must_use]
    pub fn end(&self, d: usize) -> u64 {
        self.start[d] + self.shape[d]
    }

    /// Number of elements (saturating; shapes are validated elsewhere).
    #[must_use]
    pub fn numel(&self) -> u64 {
        self.shape.iter().fold(1u64, |a, &b| a.saturating_mul(b))
    }

    /// The row-major offsets, in a tensor of `shape`, of the box's first element and of
    /// one past its last: a box is one run there exactly when this span is as long as
    /// the box. `None` for an empty box, or offsets that overflow.
    ///
    /// ```
    /// use ckpt_core::layout::region::Region;
    /// // Rows 1..3 of a 4x3 tensor: elements 3..9, one run; column 1: 1..11, not one.
    /// assert_eq!(Region::from_ranges(&[1..3, 0..3]).element_span(&[4, 3]), Some(3..9));
    /// assert_eq!(Region::from_ranges(&[0..4, 1..2]).element_span(&[4, 3]), Some(1..11));
    /// ```
    #[must_use]
    pub fn element_span(&self, shape: &[u64]) -> Option<std::ops::Range<u64>> {
        if self.is_empty() {
            return None;
        }
        let (mut first, mut last, mut stride) = (0u64, 0u64, 1u64);
        for d in (0..shape.len()).rev() {
            first = first.checked_add(self.start[d].checked_mul(stride)?)?;
            last = last.checked_add(self.end(d).checked_sub(1)?.checked_mul(stride)?)?;
            stride = stride.checked_mul(shape[d])?;
        }
        Some(first..last.checked_add(1)?)
    }

    /// True when the region holds no element.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }

    /// The common part of two regions, computed per axis as `max(start)..min(end)`.
    #[must_use]
    pub fn overlap(&self, other: &Region) -> Option<Region> {
        debug_assert_eq!(self.ndim(), other.ndim());
        let mut start = Dims::with_capacity(self.ndim());
        let mut shape = Dims::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let s = self.start[d].max(other.start[d]);
            let e = self.end(d).min(other.end(d));
            if e <= s {
                return None;
            }
            start.push(s);
            shape.push(e - s);
        }
        Some(Region { start, shape })
    }

    /// True when `other` lies inside `self`.
    #[must_use]
    pub fn contains(&self, other: &Region) -> bool {
        (0..self.ndim()).all(|d| other.start[d] >= self.start[d] && other.end(d) <= self.end(d))
    }

    /// This region expressed relative to `origin` (inverse of [`Region::offset`]).
    #[must_use]
    pub fn relative_to(&self, origin: &[u64]) -> Region {
        Region {
            start: self.start.iter().zip(origin).map(|(s, o)| s - o).collect(),
            shape: self.shape.clone(),
        }
    }

    /// Elements `a..b` of a tensor of `shape` in C order (a contiguous run of its bytes)
    /// as boxes, in order: at most `2 * ndim - 1` of them (a partial first row, whole
    /// rows, a partial last row, recursively). Empty for an empty run.
    #[must_use]
    pub fn flat_range(shape: &[u64], a: u64, b: u64) -> Vec<Region> {
        let mut out = Vec::new();
        flat_range_into(shape, a, b, &mut Vec::new(), &mut out);
        out
    }

    /// This region moved by `origin` (inverse of [`Region::relative_to`]).
    #[must_use]
    pub fn offset(&self, origin: &[u64]) -> Region {
        Region {
            start: self.start.iter().zip(origin).map(|(s, o)| s + o).collect(),
            shape: self.shape.clone(),
        }
    }
}

/// [`Region::flat_range`] below the leading indices `prefix` (each of extent 1).
fn flat_range_into(shape: &[u64], a: u64, b: u64, prefix: &mut Vec<u64>, out: &mut Vec<Region>) {
    if a >= b {
        return;
    }
    let Some((&rows, inner_shape)) = shape.split_first() else {
        out.push(Region::new(prefix.clone(), vec![1; prefix.len()]));
        return;
    };
    let inner: u64 = inner_shape.iter().product();
    if inner == 0 || rows == 0 {
        return;
    }
    // Part of row `r`, elements lo..hi of it.
    let row = |r: u64, lo: u64, hi: u64, prefix: &mut Vec<u64>, out: &mut Vec<Region>| {
        prefix.push(r);
        flat_range_into(inner_shape, lo, hi, prefix, out);
        prefix.pop();
    };
    let (r0, r1) = (a / inner, b / inner);
    if r0 == r1 {
        return row(r0, a % inner, b % inner, prefix, out);
    }
    let mut full_from = r0;
    if !a.is_multiple_of(inner) {
        row(r0, a % inner, inner, prefix, out);
        full_from += 1;
    }
    if r1 > full_from {
        let mut start = prefix.clone();
        start.push(full_from);
        start.extend(std::iter::repeat_n(0, inner_shape.len()));
        let mut extent = vec![1; prefix.len()];
        extent.push(r1 - full_from);
        extent.extend_from_slice(inner_shape);
        out.push(Region::new(start, extent));
    }
    row(r1, 0, b % inner, prefix, out);
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}..{}", self.start[d], self.end(d))?;
        }
        f.write_str("]")
    }
}

/// One contiguous run of a copy: `len` elements from element `src` of the source
/// tensor to element `dst` of the destination tensor (both row-major offsets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Element offset in the source tensor.
    pub src: u64,
    /// Element offset in the destination tensor.
    pub dst: u64,
    /// Number of elements.
    pub len: u64,
}

/// The runs that copy a box between two row-major tensors.
///
/// `shape` is the box's extent; it starts at `src_start` in a source tensor of shape
/// `src_full` and at `dst_start` in a destination of shape `dst_full`. Inner dimensions
/// that the box spans fully in both tensors merge into one run, so a `Shard(0)` piece
/// is a single run and a `Shard(1)` piece is one run per row.
///
/// Worked example: a 4x3 tensor, box rows 1..3, columns 0..3 (full rows), copied into a
/// 2x3 tensor at the origin: dimension 1 is fully spanned in both, so this is one run of
/// 6 elements from offset 3 to offset 0.
/// ```
/// use ckpt_core::layout::region::{Run, Runs};
/// let runs: Vec<Run> = Runs::new(&[2, 3], &[4, 3], &[1, 0], &[2, 3], &[0, 0]).collect();
/// assert_eq!(runs, vec![Run { src: 3, dst: 0, len: 6 }]);
/// let cols: Vec<Run> = Runs::new(&[2, 2], &[2, 4], &[0, 2], &[2, 2], &[0, 0]).collect();
/// assert_eq!(cols, vec![Run { src: 2, dst: 0, len: 2 }, Run { src: 6, dst: 2, len: 2 }]);
/// ```
#[derive(Clone, Debug)]
pub struct Runs {
    /// Extents of the outer (iterated) dimensions.
    outer: Vec<u64>,
    /// Current index over the outer dimensions; `None` when done.
    index: Option<Vec<u64>>,
    src_strides: Vec<u64>,
    dst_strides: Vec<u64>,
    src_base: u64,
    dst_base: u64,
    len: u64,
}

/// Row-major element strides of a tensor of `shape`.
pub(crate) fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

impl Runs {
    /// Runs copying a box of extent `shape` (see the type's documentation).
    #[must_use]
    pub fn new(
        shape: &[u64],
        src_full: &[u64],
        src_start: &[u64],
        dst_full: &[u64],
        dst_start: &[u64],
    ) -> Runs {
        let n = shape.len();
        let ss = strides(src_full);
        let ds = strides(dst_full);
        let src_base: u64 = src_start.iter().zip(&ss).map(|(a, b)| a * b).sum();
        let dst_base: u64 = dst_start.iter().zip(&ds).map(|(a, b)| a * b).sum();
        if shape.contains(&0) {
            return Runs {
                outer: vec![],
                index: None,
                src_strides: ss,
                dst_strides: ds,
                src_base,
                dst_base,
                len: 0,
            };
        }
        // Dimensions j.. form one run: every dimension after j is spanned fully in both
        // tensors, dimension j possibly only partly.
        let mut j = n.saturating_sub(1);
        while j > 0 && shape[j] == src_full[j] && shape[j] == dst_full[j] {
            j -= 1;
        }
        let len: u64 = shape[j..].iter().product();
        let outer = shape[..j].to_vec();
        Runs {
            index: Some(vec![0; outer.len()]),
            outer,
            src_strides: ss,
            dst_strides: ds,
            src_base,
            dst_base,
            len,
        }
    }

    /// Elements per run.
    #[must_use]
    pub fn run_len(&self) -> u64 {
        self.len
    }
}

impl Iterator for Runs {
    type Item = Run;
    fn next(&mut self) -> Option<Run> {
        let index = self.index.as_mut()?;
        let mut src = self.src_base;
        let mut dst = self.dst_base;
        for (d, &i) in index.iter().enumerate() {
            src += i * self.src_strides[d];
            dst += i * self.dst_strides[d];
        }
        let run = Run {
            src,
            dst,
            len: self.len,
        };
        // Advance the odometer, last dimension fastest.
        let mut d = index.len();
        loop {
            if d == 0 {
                self.index = None;
                break;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < self.outer[d] {
                break;
            }
            index[d] = 0;
        }
        Some(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_and_relative() {
        let a = Region::from_ranges(&[1..5, 2..6]);
        let b = Region::from_ranges(&[5..6, 0..9]);
        assert_eq!(a.overlap(&b), None);
        let r = Region::from_ranges(&[2..4, 3..5]);
        assert_eq!(r.relative_to(&[1, 2]), Region::from_ranges(&[1..3, 1..3]));
        assert_eq!(r.relative_to(&[1, 2]).offset(&[1, 2]), r);
        assert!(a.contains(&r));
    }

    #[test]
    fn runs_of_a_column_block_of_a_3d_tensor() {
        // Box [0..2, 1..3, 0..4] of a 2x4x4 tensor into a 2x2x4 tensor: dims 2 merge only.
        let runs: Vec<Run> =
            Runs::new(&[2, 2, 4], &[2, 4, 4], &[0, 1, 0], &[2, 2, 4], &[0, 0, 0]).collect();
        assert_eq!(
            runs,
            vec![
                Run {
                    src: 4,
                    dst: 0,
                    len: 8
                },
                Run {
                    src: 20,
                    dst: 8,
                    len: 8
                }
            ]
        );
    }

    #[test]
    fn runs_of_scalar_and_empty() {
        let runs: Vec<Run> = Runs::new(&[], &[], &[], &[], &[]).collect();
        assert_eq!(
            runs,
            vec![Run {
                src: 0,
                dst: 0,
                len: 1
            }]
        );
        assert_eq!(
            Runs::new(&[0, 3], &[4, 3], &[0, 0], &[0, 3], &[0, 0]).count(),
            0
        );
    }

    #[test]
    fn flat_ranges_are_boxes_in_order() {
        let shape = [3u64, 4, 5];
        for (a, b) in [
            (0, 60),
            (7, 53),
            (0, 1),
            (5, 10),
            (22, 23),
            (13, 47),
            (20, 40),
            (59, 60),
        ] {
            let boxes = Region::flat_range(&shape, a, b);
            assert!(boxes.len() <= 5, "{a}..{b}: {boxes:?}");
            // In C order, box after box, the elements are exactly a..b.
            let mut flat = Vec::new();
            for r in &boxes {
                for i in 0..r.shape[0] {
                    for j in 0..r.shape[1] {
                        for k in 0..r.shape[2] {
                            flat.push(
                                (r.start[0] + i) * 20 + (r.start[1] + j) * 5 + r.start[2] + k,
                            );
                        }
                    }
                }
            }
            assert_eq!(flat, (a..b).collect::<Vec<_>>(), "{a}..{b}: {boxes:?}");
        }
        assert_eq!(
            Region::flat_range(&[], 0, 1),
            vec![Region::new(vec![], vec![])]
        );
        assert!(Region::flat_range(&shape, 4, 4).is_empty());
    }
}
