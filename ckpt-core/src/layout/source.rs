//! What a source checkpoint is to the algebra: global tensors made of pieces, each
//! piece a box of one stored tensor. Plain data, indexed by file and tensor position,
//! so that planning needs no file format ([`crate::Checkpoint`] is one implementation).

use crate::layout::region::Region;
use crate::Dtype;
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
    /// Where it lies in the file's tensor.
    pub local: Region,
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
