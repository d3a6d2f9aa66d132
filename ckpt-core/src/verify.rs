//! Whole-checkpoint verification: every problem, one line each.

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::region::Runs;
use std::path::PathBuf;

/// Checks a checkpoint: headers sane, rank files present and agreeing on the strategy,
/// shapes as the strategy says, every element owned exactly once. With `deep`, also
/// compares every kept copy of replicated data with its owner's, byte for byte.
/// Returns the problems found (empty when clean).
///
/// # Errors
/// Only when the inputs cannot be read as a checkpoint at all.
pub fn verify(paths: &[PathBuf], deep: bool) -> Result<(Checkpoint, Vec<Error>)> {
    let (ck, mut problems) = Checkpoint::scan(paths)?;
    if deep {
        for (name, t) in &ck.tensors {
            let bits = t.dtype.bitsize() as u64;
            for (owner, copy) in &t.copies {
                let o = &t.pieces[*owner];
                let a = ck.files[o.file].data(o.tensor);
                let b = ck.files[copy.file].data(copy.tensor);
                let sa = &ck.files[o.file].tensors()[o.tensor].shape;
                let sb = &ck.files[copy.file].tensors()[copy.tensor].shape;
                let differs = Runs::new(&o.local.shape, sa, &o.local.start, sb, &copy.local.start)
                    .any(|r| {
                        let (x, y, n) = (
                            (r.src * bits / 8) as usize,
                            (r.dst * bits / 8) as usize,
                            (r.len * bits / 8) as usize,
                        );
                        a[x..x + n] != b[y..y + n]
                    });
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
    }
    Ok((ck, problems))
}
