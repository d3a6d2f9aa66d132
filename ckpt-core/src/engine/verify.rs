//! Whole-checkpoint verification: every problem, one line each.

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::{ReadCache, TensorFile};
use crate::layout::region::{Region, Runs};
use crate::layout::select::Selection;
use rayon::prelude::*;
use std::path::PathBuf;

/// How much [`verify`] reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerifyDepth {
    /// Hash every tensor that has a recorded checksum and compare, and decode every
    /// tensor stored encoded that has none (reads all data).
    pub checksums: bool,
    /// Compare every kept copy of replicated data with its owner's, byte for byte.
    pub deep: bool,
}

/// Checks a checkpoint: headers sane, rank files present and agreeing on the strategy,
/// shapes as the strategy says, every element owned exactly once, recorded checksums
/// of replicated copies equal to their owners'. With `depth.checksums`, also hashes
/// every tensor that has a checksum and decodes every tensor stored encoded that has
/// none ([`TensorFile::check_decodes`]: an Orbax chunk's zstd frame and CRC-32C);
/// with `depth.deep`, compares every kept copy of
/// replicated data with its owner's, byte for byte.
/// Returns the problems found (empty when clean).
///
/// # Errors
/// Only when the inputs cannot be read as a checkpoint at all.
pub fn verify(paths: &[PathBuf], depth: VerifyDepth) -> Result<(Checkpoint, Vec<Error>)> {
    verify_selected(paths, &Selection::default(), depth)
}

/// [`verify`] of the step and under the names `selection` asks for (its tensor filters
/// do not apply: verification covers everything).
///
/// # Errors
/// As [`verify`]; a step the inputs do not hold, renames that collide.
pub fn verify_selected(
    paths: &[PathBuf],
    selection: &Selection,
    depth: VerifyDepth,
) -> Result<(Checkpoint, Vec<Error>)> {
    let (mut ck, mut problems) = Checkpoint::scan_with(
        paths,
        selection.step(),
        crate::layout::select::Views::default(),
        selection.rules(),
    )?;
    // Entries of objects in a store located only when read (a DCP chunk's header):
    // located now, every one.
    let mut unlocated: Vec<Error> = ck.files.par_iter().flat_map(|f| f.locate_all()).collect();
    problems.append(&mut unlocated);
    if depth.checksums && crate::formats::checksum::checksums_enabled() {
        let all: Vec<(usize, usize)> = ck
            .files
            .iter()
            .enumerate()
            .flat_map(|(fi, f)| (0..f.tensors().len()).map(move |ti| (fi, ti)))
            .collect();
        // A tensor with no recorded checksum but stored encoded is decoded whole: the
        // checks its encoding carries are all there is to read.
        let mut bad: Vec<Error> = all
            .par_iter()
            .filter_map(|&(fi, ti)| {
                let f = &ck.files[fi];
                match f.check_checksum(ti) {
                    Ok(false) => f.check_decodes(ti).err(),
                    r => r.err(),
                }
            })
            .collect();
        problems.append(&mut bad);
        let mut bad: Vec<Error> = ck
            .files
            .par_iter()
            .filter_map(|f| f.check_file_checksum().err())
            .collect();
        problems.append(&mut bad);
    }
    for (name, t) in &ck.tensors {
        let bits = t.dtype.bitsize() as u64;
        for (owner, copy) in &t.copies {
            let o = &t.pieces[*owner];
            let (fa, fb) = (&ck.files[o.file], &ck.files[copy.file]);
            let sa = &fa.tensors()[o.tensor].shape;
            let sb = &fb.tensors()[copy.tensor].shape;
            // Whole stored tensors on both sides: their recorded checksums must agree
            // (no data read).
            let whole = o.local == Region::full(sa) && copy.local == Region::full(sb);
            let sums = (fa.checksum(o.tensor), fb.checksum(copy.tensor));
            let differs = if let (true, (Some(x), Some(y))) = (whole, sums) {
                x != y
            } else if depth.deep {
                match copies_differ(fa, o.tensor, &o.local, fb, copy.tensor, &copy.local, bits) {
                    Ok(d) => d,
                    Err(e) => {
                        problems.push(e);
                        false
                    }
                }
            } else {
                false
            };
            if differs {
                problems.push(Error::Mismatch {
                    what: format!(
                        "tensor `{name}`: the copy of {} in {} differs from the owner's in {}",
                        o.global,
                        ck.label(copy.file),
                        ck.label(o.file)
                    ),
                });
            }
        }
    }
    // An input of no tensors is never fine (a DCP save's other files read without
    // its data, a save of other state only).
    problems.extend(ck.no_tensors());
    ck.apply_renames(selection, &mut problems)?;
    Ok((ck, problems))
}

/// Whether box `ra` of tensor `ta` in `fa` and box `rb` of tensor `tb` in `fb` (same
/// shape) hold different bytes, compared run by run through each file's reader.
fn copies_differ(
    fa: &TensorFile,
    ta: usize,
    ra: &Region,
    fb: &TensorFile,
    tb: usize,
    rb: &Region,
    bits: u64,
) -> Result<bool> {
    let sa = &fa.tensors()[ta].shape;
    let sb = &fb.tensors()[tb].shape;
    let (mut ca, mut cb) = (ReadCache::new(), ReadCache::new());
    for r in Runs::new(&ra.shape, sa, &ra.start, sb, &rb.start) {
        let (x, y, n) = (r.src * bits / 8, r.dst * bits / 8, r.len * bits / 8);
        if fa.read(ta, x..x + n, &mut ca)? != fb.read(tb, y..y + n, &mut cb)? {
            return Ok(true);
        }
    }
    Ok(false)
}
