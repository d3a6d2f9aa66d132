//! References to bytes in data files, `(data file id, offset, length)`, and the
//! statistics that go with references to B+tree nodes
//! (`format/indirect_data_reference_codec.h`, `btree_codec.h`). Both are stored as
//! columns: all ids, then all offsets, then all lengths.

use crate::codec::{put_varint, Cursor};
use crate::error::Problem;

/// `offset` and `length` both `u64::MAX`: no node (the root of an empty tree).
pub(crate) const MISSING: u64 = u64::MAX;

/// Bytes `[offset, offset + length)` of data file `file` (an index into the table of
/// the object holding the reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ref {
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) length: u64,
}

impl Ref {
    pub(crate) fn is_missing(&self) -> bool {
        self.offset == MISSING && self.length == MISSING
    }
}

/// Statistics of a B+tree subtree. Stored, not validated by tensorstore's reader (a
/// TODO in `btree.h`): this crate writes them and does not check them either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Stats {
    pub(crate) num_keys: u64,
    pub(crate) num_tree_bytes: u64,
    pub(crate) num_indirect_value_bytes: u64,
}

/// The end of a reference must fit in an `i64` (`IndirectDataReference::Validate`).
pub(crate) fn check_end(offset: u64, length: u64) -> Result<(), Problem> {
    match offset.checked_add(length) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(Problem::BadReference { offset, length }),
    }
}

/// A data file id column entry, checked against the table.
pub(crate) fn read_file_id(c: &mut Cursor<'_>, files: usize) -> Result<usize, Problem> {
    let id = c.varint64("data_file_id")?;
    if id >= files as u64 {
        return Err(Problem::DataFileId {
            id,
            files: files as u64,
        });
    }
    Ok(id as usize)
}

/// `n` references as three columns; `allow_missing` lets the "missing" marker through
/// (versions' roots only).
pub(crate) fn read_refs(
    c: &mut Cursor<'_>,
    n: usize,
    files: usize,
    allow_missing: bool,
) -> Result<Vec<Ref>, Problem> {
    let mut refs = Vec::with_capacity(n);
    for _ in 0..n {
        refs.push(Ref {
            file: read_file_id(c, files)?,
            offset: 0,
            length: 0,
        });
    }
    for r in refs.iter_mut() {
        r.offset = c.varint64("data_file_offset")?;
    }
    for r in refs.iter_mut() {
        r.length = c.varint64("data_file_length")?;
    }
    for r in &refs {
        if !(allow_missing && r.is_missing()) {
            check_end(r.offset, r.length)?;
        }
    }
    Ok(refs)
}

pub(crate) fn write_refs(out: &mut Vec<u8>, refs: &[Ref]) {
    for r in refs {
        put_varint(out, r.file as u64);
    }
    for r in refs {
        put_varint(out, r.offset);
    }
    for r in refs {
        put_varint(out, r.length);
    }
}

pub(crate) fn read_stats(c: &mut Cursor<'_>, n: usize) -> Result<Vec<Stats>, Problem> {
    let mut stats = vec![Stats::default(); n];
    for s in stats.iter_mut() {
        s.num_keys = c.varint64("num_keys")?;
    }
    for s in stats.iter_mut() {
        s.num_tree_bytes = c.varint64("num_tree_bytes")?;
    }
    for s in stats.iter_mut() {
        s.num_indirect_value_bytes = c.varint64("num_indirect_value_bytes")?;
    }
    Ok(stats)
}

pub(crate) fn write_stats(out: &mut Vec<u8>, stats: &[Stats]) {
    for s in stats {
        put_varint(out, s.num_keys);
    }
    for s in stats {
        put_varint(out, s.num_tree_bytes);
    }
    for s in stats {
        put_varint(out, s.num_indirect_value_bytes);
    }
}
