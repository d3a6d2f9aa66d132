//! The writer side of every format: what a tensor to write is ([`TensorSpec`]) and the
//! one trait every output format implements ([`TensorWriter`]). The engine writes
//! through `Box<dyn TensorWriter>` and never learns which format it feeds; the
//! detection table ([`super::detect`]) picks the writer from the output's name.
//!
//! The commit is the same for every writer: each writes into a
//! [`StagedFile`](super::output::StagedFile) (a temporary name in the destination's
//! directory, registered so a killed run's leftovers are removed) and `finish` is its
//! commit (fsync, rename, fsync of the directory). A writer dropped without `finish`
//! leaves nothing behind.

use crate::error::Result;
use crate::layout::Dtype;
use std::fs::File;

/// One run of bytes handed to [`TensorWriter::write_parts_at`]: the bytes (which the
/// writer hashes), and, when they are a mapped input's, the file and byte offset they
/// lie at, so that a long run can be copied file to file by the kernel instead of from
/// the mapping.
#[derive(Clone, Copy, Debug)]
pub struct WritePart<'a> {
    /// The bytes to write.
    pub bytes: &'a [u8],
    /// The input file holding `bytes`, and where in it they start.
    pub from: Option<(&'a File, u64)>,
}

impl<'a> From<&'a [u8]> for WritePart<'a> {
    fn from(bytes: &'a [u8]) -> WritePart<'a> {
        WritePart { bytes, from: None }
    }
}

/// A header entry to write: name, dtype and shape; offsets follow from the order.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
}

/// An output file being written: its header is laid out at creation from the
/// [`TensorSpec`]s, then tensor bytes arrive by positional writes from any thread.
pub trait TensorWriter: Send + Sync + std::fmt::Debug {
    /// Writes `bytes` at byte `offset` of tensor `index`'s data (row-major, the
    /// tensor's own dtype).
    ///
    /// # Errors
    /// I/O errors, with the path; a range outside the tensor.
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()>;

    /// Writes `parts`, one after the other, from byte `offset` of tensor `index`'s data,
    /// as one [`TensorWriter::write_at`] of their concatenation would, but without the
    /// caller gathering them into a buffer first (the copy engine passes runs still in
    /// the inputs' mappings, with their files). `Ok(false)`, having written nothing,
    /// when the writer has no such path; the caller then gathers and calls `write_at`.
    ///
    /// # Errors
    /// As [`TensorWriter::write_at`].
    fn write_parts_at(&self, index: usize, offset: u64, parts: &[WritePart<'_>]) -> Result<bool> {
        let _ = (index, offset, parts);
        Ok(false)
    }

    /// Completes the file and commits it under its name (fsync, rename).
    ///
    /// # Errors
    /// I/O errors, with the path; tensors not completely written, where the format
    /// can tell.
    fn finish(self: Box<Self>) -> Result<()>;
}
