//! What a source checkpoint is to the algebra: global tensors made of pieces, each
//! piece a box of one stored tensor. Plain data, indexed by file and tensor position,
//! so that planning needs no file format ([`crate::Checkpoint`] is one implementation).

use crate::layout::compute::Operation;
use crate::layout::region::Region;
use crate::layout::Dtype;
use std::collections::BTreeMap;

/// One box of a tensor held by one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePiece {
    /// Index into [`Checkpoint::files`](crate::Checkpoint::files).
    pub file: usize,
    /// Index of the tensor within that file.
    pub tensor: usize,
    /// Where the box lies in the global tensor.
    pub global: Region,
    /// Where it lies in the file's tensor (in `view`'s coordinates when given).
    pub local: Region,
    /// How the stored bytes are read when not as the stored tensor: `None` for the
    /// stored tensor itself (boxed: a view is rare, and a piece without one then costs
    /// a pointer rather than two vectors, in a checkpoint of a million pieces).
    pub view: Option<Box<StoredView>>,
    /// The piece's elements computed from other tensors rather than read: then `local`
    /// is in the computation's coordinates (the global ones of the tensor it was
    /// computed as: `global` until a view cuts the tensor), `view` is `None`, and
    /// `file`/`tensor` name its first input's stored tensor, for pictures and messages.
    pub compute: Option<Compute>,
}

/// One input of a computed piece: the input tensor's pieces (cut to what the piece
/// needs) and the box of it the whole piece needs.
#[derive(Clone, Debug)]
pub struct ComputeInput {
    /// The input tensor's name, for messages.
    pub name: String,
    /// The input tensor: its global shape and dtype, and the pieces holding `region`.
    pub tensor: SourceTensor,
    /// The box of the input the whole piece needs, in its global coordinates.
    pub region: Region,
}

/// What a computed piece is computed from ([`crate::layout::compute`]).
#[derive(Clone, Debug)]
pub struct Computed {
    /// The operation.
    pub op: Operation,
    /// Its inputs, in the operation's order.
    pub inputs: Vec<ComputeInput>,
}

/// A shared [`Computed`], as pieces and copy ops carry it: equal when it is the same
/// computation.
#[derive(Clone, Debug)]
pub struct Compute(pub std::sync::Arc<Computed>);

impl PartialEq for Compute {
    fn eq(&self, other: &Compute) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Compute {}

impl std::ops::Deref for Compute {
    type Target = Computed;
    fn deref(&self) -> &Computed {
        &self.0
    }
}

/// The bytes of a stored tensor read as another tensor: the row-major tensor of
/// `shape` (the same elements, another shape: a reshape), its axes then permuted, so
/// that dimension `d` of a piece's `local` box is dimension `axes[d]` of `shape`.
/// megatron-core's GroupedMLP keeps each expert's `linear_fc1` as the transpose of a
/// run of its `weight1`: a reshape to `[rows, F1]` and the axes `[1, 0]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredView {
    /// The row-major shape the stored elements are read in.
    pub shape: Vec<u64>,
    /// `local`'s dimension `d` is `shape`'s dimension `axes[d]`.
    pub axes: Vec<usize>,
}

/// A global tensor assembled from pieces.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The pieces to read: disjoint, each element exactly once (lowest rank first).
    pub pieces: Vec<SourcePiece>,
    /// Further copies of pieces (replicated data kept by non-owners), for deep checks.
    pub copies: Vec<(usize, SourcePiece)>,
}

/// A set of global tensors and the shapes of the stored tensors their pieces lie in:
/// all the planner needs to know of a source.
pub trait PieceSource {
    /// The global tensors by name.
    fn source_tensors(&self) -> &BTreeMap<String, SourceTensor>;
    /// The shape of stored tensor `tensor` of file `file`, as stored.
    fn stored_shape(&self, file: usize, tensor: usize) -> &[u64];
}

/// One block of a [`SourceTensor::regather`]: indices `from..from + len` along the
/// dimension go to `to..to + len` of the new tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// First index in this tensor.
    pub from: u64,
    /// Number of indices.
    pub len: u64,
    /// First index in the new tensor.
    pub to: u64,
}

impl SourcePiece {
    /// The part of this piece within indices `lo..hi` of `dim` (global), moved so that
    /// `lo` lands on `to`; its stored box is cut the same way. `None` where the piece
    /// has nothing there.
    fn cut(&self, dim: usize, lo: u64, hi: u64, to: u64) -> Option<SourcePiece> {
        let (start, end) = (self.global.start[dim], self.global.end(dim));
        let (a, b) = (start.max(lo), end.min(hi));
        if a >= b {
            return None;
        }
        let mut global = self.global.clone();
        global.start[dim] = to + (a - lo);
        global.shape[dim] = b - a;
        let mut local = self.local.clone();
        local.start[dim] += a - start;
        local.shape[dim] = b - a;
        Some(SourcePiece {
            file: self.file,
            tensor: self.tensor,
            global,
            local,
            view: self.view.clone(),
            // A computed piece's local box is in its computation's coordinates (the
            // global ones of the tensor it was computed as), which the cut keeps.
            compute: self.compute.clone(),
        })
    }
}

impl SourceTensor {
    /// A tensor made of blocks of this one along `dim` (a fused projection's query
    /// rows, a vocabulary without its padding rows), `extent` long on `dim`. Its pieces
    /// are this one's cut at the blocks' edges, stored boxes with them, so it reads the
    /// same stored bytes; blocks that cover `0..extent` once keep every element held
    /// once.
    ///
    /// # Panics
    /// `dim` is not a dimension of the tensor.
    #[must_use]
    pub fn regather(&self, dim: usize, blocks: &[Block], extent: u64) -> SourceTensor {
        assert!(
            dim < self.shape.len(),
            "dim {dim} of a {}-d tensor",
            self.shape.len()
        );
        let cut = |p: &SourcePiece| {
            blocks
                .iter()
                .filter_map(|b| p.cut(dim, b.from, b.from + b.len, b.to))
                .collect::<Vec<_>>()
        };
        let mut shape = self.shape.clone();
        shape[dim] = extent;
        SourceTensor {
            dtype: self.dtype,
            shape,
            pieces: self.pieces.iter().flat_map(cut).collect(),
            copies: self
                .copies
                .iter()
                .flat_map(|(owner, p)| cut(p).into_iter().map(|c| (*owner, c)))
                .collect(),
        }
    }
}

impl SourceTensor {
    /// This tensor as a `[1, ...shape]` tensor: each stored piece reads the same bytes
    /// through a [`StoredView`] whose shape has a leading axis of 1 (a piece already
    /// viewed keeps its view under it), so that tensors of one shape can be
    /// [`SourceTensor::stack`]ed. `stored` gives the shape of a piece's stored tensor.
    ///
    /// # Errors
    /// A computed piece (its box is in its computation's coordinates, which have no
    /// such axis: compute it as the `[1, ...shape]` tensor instead).
    pub fn with_leading_axis(
        &self,
        stored: impl Fn(usize, usize) -> Vec<u64>,
    ) -> std::result::Result<SourceTensor, String> {
        let lead = |p: &SourcePiece| -> std::result::Result<SourcePiece, String> {
            if p.compute.is_some() {
                return Err(format!(
                    "a computed piece ({}) has no stored axis to add",
                    p.global
                ));
            }
            let (shape, axes) = match &p.view {
                Some(v) => (v.shape.clone(), v.axes.clone()),
                None => {
                    let s = stored(p.file, p.tensor);
                    let axes = (0..s.len()).collect();
                    (s, axes)
                }
            };
            let with_one = |r: &Region| {
                let mut start = vec![0];
                start.extend(r.start.iter().copied());
                let mut shape = vec![1];
                shape.extend(r.shape.iter().copied());
                Region::new(start, shape)
            };
            Ok(SourcePiece {
                file: p.file,
                tensor: p.tensor,
                global: with_one(&p.global),
                local: with_one(&p.local),
                view: Some(Box::new(StoredView {
                    shape: std::iter::once(1).chain(shape).collect(),
                    axes: std::iter::once(0)
                        .chain(axes.iter().map(|a| a + 1))
                        .collect(),
                })),
                compute: None,
            })
        };
        Ok(SourceTensor {
            dtype: self.dtype,
            shape: std::iter::once(1)
                .chain(self.shape.iter().copied())
                .collect(),
            pieces: self.pieces.iter().map(lead).collect::<Result<_, _>>()?,
            copies: self
                .copies
                .iter()
                .map(|(o, p)| lead(p).map(|p| (*o, p)))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The tensors `parts`, each `[1, ...shape]` of one dtype, stacked along their
    /// leading axis: part `i`'s pieces moved to index `i` of it, their stored (or
    /// computed) boxes as they are: the same bytes, nothing read until the copy
    /// (llama.cpp's `[experts, rows, cols]` tensors of a layer's per-expert weights).
    ///
    /// # Errors
    /// No parts, or parts of other shapes or dtypes than the first's, or not of a
    /// leading axis of 1.
    pub fn stack(parts: &[SourceTensor]) -> std::result::Result<SourceTensor, String> {
        let Some(first) = parts.first() else {
            return Err("nothing to stack".into());
        };
        if first.shape.first() != Some(&1) {
            return Err(format!("shape {:?} has no leading axis of 1", first.shape));
        }
        let mut shape = first.shape.clone();
        shape[0] = parts.len() as u64;
        let mut pieces = Vec::new();
        let mut copies = Vec::new();
        for (i, t) in parts.iter().enumerate() {
            if t.shape != first.shape || t.dtype != first.dtype {
                return Err(format!(
                    "part {i} is {:?} {:?}, part 0 {:?} {:?}: stacked parts are of one shape and dtype",
                    t.dtype, t.shape, first.dtype, first.shape
                ));
            }
            let moved = |p: &SourcePiece| {
                let mut p = p.clone();
                p.global.start[0] += i as u64;
                p
            };
            pieces.extend(t.pieces.iter().map(moved));
            copies.extend(t.copies.iter().map(|(o, p)| (*o, moved(p))));
        }
        Ok(SourceTensor {
            dtype: first.dtype,
            shape,
            pieces,
            copies,
        })
    }
}

/// Where a box lies in a row-major tensor of `shape` when its elements are one run
/// there: `(first element, count)`; `None` when they are not (a box of columns).
fn run_of(region: &Region, shape: &[u64]) -> Option<(u64, u64)> {
    let span = region.element_span(shape)?;
    (span.end - span.start == region.numel()).then_some((span.start, region.numel()))
}

impl SourceTensor {
    /// The `rows x cols` matrix whose row-major elements are this tensor's elements
    /// `start..start + rows * cols`, transposed: a `[cols, rows]` tensor that reads the
    /// same stored bytes through a [`StoredView`] (megatron-core's GroupedMLP keeps
    /// each expert as such a run of its grouped weights). `stored` gives the shape of
    /// a piece's stored tensor.
    ///
    /// # Errors
    /// A piece the run does not cut at rows of the matrix, one whose elements are not a
    /// run of the tensor or of its stored tensor, one already viewed, sub-byte
    /// elements, or sizes that overflow: the problem in words.
    pub fn transposed_run(
        &self,
        start: u64,
        rows: u64,
        cols: u64,
        stored: impl Fn(usize, usize) -> Vec<u64>,
    ) -> std::result::Result<SourceTensor, String> {
        self.run_as_matrix(start, rows, cols, true, stored)
    }

    /// The `rows x cols` matrix whose row-major elements are this tensor's elements
    /// `start..start + rows * cols`, as it is: one expert's rows of transformers' fused
    /// `experts.gate_up_proj` (`[experts, 2 * ffn, hidden]`: expert `e`'s gate is the
    /// run at `e * 2 * ffn * hidden`, `ffn` rows of `hidden`). The same stored bytes,
    /// through a [`StoredView`] that reads the stored tensor as rows of `cols`.
    ///
    /// # Errors
    /// As [`SourceTensor::transposed_run`].
    pub fn run_rows(
        &self,
        start: u64,
        rows: u64,
        cols: u64,
        stored: impl Fn(usize, usize) -> Vec<u64>,
    ) -> std::result::Result<SourceTensor, String> {
        self.run_as_matrix(start, rows, cols, false, stored)
    }

    /// [`SourceTensor::run_rows`], transposed or not.
    fn run_as_matrix(
        &self,
        start: u64,
        rows: u64,
        cols: u64,
        transposed: bool,
        stored: impl Fn(usize, usize) -> Vec<u64>,
    ) -> std::result::Result<SourceTensor, String> {
        if !self.dtype.bitsize().is_multiple_of(8) || cols == 0 {
            return Err(format!(
                "a transposed view of {:?} elements in rows of {cols}",
                self.dtype
            ));
        }
        let end = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_add(start))
            .ok_or("the run's size overflows")?;
        let view = |p: &SourcePiece| -> std::result::Result<Option<SourcePiece>, String> {
            let shape = stored(p.file, p.tensor);
            let unrun = || format!("a piece ({}) is not one run of its tensor", p.global);
            let (g0, len) = run_of(&p.global, &self.shape).ok_or_else(unrun)?;
            let (s0, _) = match (&p.view, &p.compute) {
                (None, None) => run_of(&p.local, &shape).ok_or_else(unrun)?,
                (Some(_), _) => return Err("a piece already read through a view".into()),
                // Its bytes are computed, not stored: no run of a file to transpose.
                (_, Some(_)) => return Err("a computed piece".into()),
            };
            let (a, b) = (g0.max(start), (g0 + len).min(end));
            if a >= b {
                return Ok(None);
            }
            let at = s0 + (a - g0);
            let numel: u64 = shape.iter().product();
            if [a - start, b - a, at, numel].iter().any(|n| n % cols != 0) {
                return Err(format!(
                    "a piece ({}) holds part of a row of {cols} elements",
                    p.global
                ));
            }
            let n = (b - a) / cols;
            let (row, local_row) = ((a - start) / cols, at / cols);
            let (global, local, axes) = if transposed {
                (
                    Region::new(vec![0, row], vec![cols, n]),
                    Region::new(vec![0, local_row], vec![cols, n]),
                    vec![1, 0],
                )
            } else {
                (
                    Region::new(vec![row, 0], vec![n, cols]),
                    Region::new(vec![local_row, 0], vec![n, cols]),
                    vec![0, 1],
                )
            };
            Ok(Some(SourcePiece {
                file: p.file,
                tensor: p.tensor,
                global,
                local,
                view: Some(Box::new(StoredView {
                    shape: vec![numel / cols, cols],
                    axes,
                })),
                compute: None,
            }))
        };
        let mut pieces = Vec::new();
        for p in &self.pieces {
            pieces.extend(view(p)?);
        }
        let mut copies = Vec::new();
        for (owner, p) in &self.copies {
            copies.extend(view(p)?.map(|c| (*owner, c)));
        }
        Ok(SourceTensor {
            dtype: self.dtype,
            shape: if transposed {
                vec![cols, rows]
            } else {
                vec![rows, cols]
            },
            pieces,
            copies,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(file: usize, rows: std::ops::Range<u64>, cols: u64) -> SourcePiece {
        SourcePiece {
            file,
            tensor: 0,
            global: Region::from_ranges(&[rows.clone(), 0..cols]),
            local: Region::from_ranges(&[0..rows.end - rows.start, 0..cols]),
            view: None,
            compute: None,
        }
    }

    /// Two ranks' halves of an 8-row tensor; the new tensor takes rows 2..4 and 6..8
    /// (say, the keys of two groups): each piece gives the block it holds, with its
    /// stored box cut to the same rows.
    #[test]
    fn regather_cuts_pieces_at_block_edges() {
        let t = SourceTensor {
            dtype: Dtype::F32,
            shape: vec![8, 3],
            pieces: vec![piece(0, 0..4, 3), piece(1, 4..8, 3)],
            copies: vec![(2, piece(2, 0..4, 3))],
        };
        let blocks = [
            Block {
                from: 2,
                len: 2,
                to: 0,
            },
            Block {
                from: 6,
                len: 2,
                to: 2,
            },
        ];
        let k = t.regather(0, &blocks, 4);
        assert_eq!(k.shape, vec![4, 3]);
        assert_eq!(
            k.pieces,
            vec![
                SourcePiece {
                    file: 0,
                    tensor: 0,
                    global: Region::from_ranges(&[0..2, 0..3]),
                    local: Region::from_ranges(&[2..4, 0..3]),
                    view: None,
                    compute: None,
                },
                SourcePiece {
                    file: 1,
                    tensor: 0,
                    global: Region::from_ranges(&[2..4, 0..3]),
                    local: Region::from_ranges(&[2..4, 0..3]),
                    view: None,
                    compute: None,
                },
            ]
        );
        assert_eq!(k.copies.len(), 1);
        assert_eq!(k.copies[0].1.local, Region::from_ranges(&[2..4, 0..3]));
        // A block past every piece gives nothing; a block across both, one cut each.
        let all = t.regather(
            0,
            &[Block {
                from: 3,
                len: 2,
                to: 0,
            }],
            2,
        );
        assert_eq!(all.pieces.len(), 2);
        assert_eq!(all.pieces[0].local, Region::from_ranges(&[3..4, 0..3]));
        assert_eq!(all.pieces[1].local, Region::from_ranges(&[0..1, 0..3]));
        assert_eq!(all.pieces[1].global, Region::from_ranges(&[1..2, 0..3]));
    }

    /// A transposed run whose rows a piece cuts, or over a piece of columns (not one
    /// run of the tensor), is refused; a run cut at rows of the matrix reads each
    /// piece's rows through a transposed view of its stored tensor.
    #[test]
    fn transposed_runs_need_pieces_of_whole_rows() {
        let t = SourceTensor {
            dtype: Dtype::F32,
            shape: vec![4, 3],
            pieces: vec![piece(0, 0..1, 3), piece(1, 1..4, 3)],
            copies: vec![],
        };
        let stored = |f: usize, _: usize| if f == 0 { vec![1, 3] } else { vec![3, 3] };
        // Elements 0..12 as [4, 3]: rows 0 and 1..4, each piece's rows.
        let v = t.transposed_run(0, 4, 3, stored).unwrap();
        assert_eq!(v.shape, vec![3, 4]);
        assert_eq!(v.pieces[1].global, Region::from_ranges(&[0..3, 1..4]));
        assert_eq!(v.pieces[1].local, Region::from_ranges(&[0..3, 0..3]));
        assert_eq!(
            v.pieces[1].view.as_deref(),
            Some(&StoredView {
                shape: vec![3, 3],
                axes: vec![1, 0]
            })
        );
        // As [6, 2]: the pieces meet inside a row of 2.
        let e = t.transposed_run(0, 6, 2, stored).unwrap_err();
        assert!(e.contains("part of a row"), "{e}");
        let cols = SourceTensor {
            pieces: vec![SourcePiece {
                file: 0,
                tensor: 0,
                global: Region::from_ranges(&[0..4, 0..2]),
                local: Region::from_ranges(&[0..4, 0..2]),
                view: None,
                compute: None,
            }],
            ..t.clone()
        };
        let e = cols.transposed_run(0, 4, 3, |_, _| vec![4, 2]).unwrap_err();
        assert!(e.contains("not one run"), "{e}");
    }

    /// Two experts' `[2, 3]` matrices stacked as `[2, 2, 3]`: expert 0 stored whole
    /// (its piece read through a `[1, 2, 3]` view of its stored tensor), expert 1 a run
    /// of rows of a fused tensor already read through a `[4, 3]` view (the view keeps
    /// its axes under the new one); each at its index of the leading axis. A computed
    /// piece is refused, and so are parts of other shapes.
    #[test]
    fn experts_stack_along_a_new_leading_axis_from_their_own_boxes() {
        let e0 = SourceTensor {
            dtype: Dtype::F32,
            shape: vec![2, 3],
            pieces: vec![piece(0, 0..2, 3)],
            copies: vec![],
        };
        let e1 = SourceTensor {
            pieces: vec![SourcePiece {
                file: 1,
                tensor: 0,
                global: Region::from_ranges(&[0..2, 0..3]),
                local: Region::from_ranges(&[2..4, 0..3]),
                view: Some(Box::new(StoredView {
                    shape: vec![4, 3],
                    axes: vec![0, 1],
                })),
                compute: None,
            }],
            ..e0.clone()
        };
        let stored = |f: usize, _: usize| if f == 0 { vec![2, 3] } else { vec![2, 2, 3] };
        let parts = [
            e0.with_leading_axis(stored).unwrap(),
            e1.with_leading_axis(stored).unwrap(),
        ];
        assert_eq!(parts[0].shape, vec![1, 2, 3]);
        let t = SourceTensor::stack(&parts).unwrap();
        assert_eq!(t.shape, vec![2, 2, 3]);
        assert_eq!(
            t.pieces,
            vec![
                SourcePiece {
                    file: 0,
                    tensor: 0,
                    global: Region::from_ranges(&[0..1, 0..2, 0..3]),
                    local: Region::from_ranges(&[0..1, 0..2, 0..3]),
                    view: Some(Box::new(StoredView {
                        shape: vec![1, 2, 3],
                        axes: vec![0, 1, 2]
                    })),
                    compute: None,
                },
                SourcePiece {
                    file: 1,
                    tensor: 0,
                    global: Region::from_ranges(&[1..2, 0..2, 0..3]),
                    local: Region::from_ranges(&[0..1, 2..4, 0..3]),
                    view: Some(Box::new(StoredView {
                        shape: vec![1, 4, 3],
                        axes: vec![0, 1, 2]
                    })),
                    compute: None,
                },
            ]
        );
        let e = SourceTensor::stack(&[parts[0].clone(), e0.clone()]).unwrap_err();
        assert!(e.contains("one shape"), "{e}");
        let computed = SourceTensor {
            pieces: vec![SourcePiece {
                compute: Some(Compute(std::sync::Arc::new(Computed {
                    op: Operation::GgmlQ8_0,
                    inputs: vec![],
                }))),
                ..e0.pieces[0].clone()
            }],
            ..e0.clone()
        };
        let e = computed.with_leading_axis(stored).unwrap_err();
        assert!(e.contains("computed"), "{e}");
    }

    /// transformers' fused experts `[2, 4, 3]` (2 experts, 2 x ffn 2 rows of 3) held as
    /// FSDP's dim-0 halves: expert 1's up rows are elements 18..24, rows 1..2 of the
    /// second piece's stored `[1, 4, 3]` read as rows of 3 (its local rows 2..4).
    #[test]
    fn run_rows_cut_one_experts_rows_from_stacked_pieces() {
        let half = |file: usize, e: u64| SourcePiece {
            file,
            tensor: 0,
            global: Region::from_ranges(&[e..e + 1, 0..4, 0..3]),
            local: Region::from_ranges(&[0..1, 0..4, 0..3]),
            view: None,
            compute: None,
        };
        let t = SourceTensor {
            dtype: Dtype::F32,
            shape: vec![2, 4, 3],
            pieces: vec![half(0, 0), half(1, 1)],
            copies: vec![],
        };
        let stored = |_: usize, _: usize| vec![1, 4, 3];
        let up = t.run_rows(12 + 6, 2, 3, stored).unwrap();
        assert_eq!(up.shape, vec![2, 3]);
        assert_eq!(up.pieces.len(), 1);
        let p = &up.pieces[0];
        assert_eq!(p.file, 1);
        assert_eq!(p.global, Region::from_ranges(&[0..2, 0..3]));
        assert_eq!(p.local, Region::from_ranges(&[2..4, 0..3]));
        assert_eq!(
            p.view.as_deref(),
            Some(&StoredView {
                shape: vec![4, 3],
                axes: vec![0, 1]
            })
        );
        // Rows of 2 do not divide the pieces' runs of 12 at every edge: refused.
        let e = t.run_rows(9, 3, 2, stored).unwrap_err();
        assert!(e.contains("part of a row"), "{e}");
    }
}
