//! Checksums of the source bytes taken by the copy itself, from the runs it reads, for
//! objects in a bucket. Checking a recorded checksum in a pass of its own beside the
//! copy reads every byte twice; from a local file the second read is the page cache's,
//! but from a bucket each reader releases the bytes it has read, so the first to finish
//! a block dropped it and the other fetched it again: a merge of checkpoints that
//! record checksums (ckpt's own, its Hugging Face and DCP outputs) fetched about 1.5
//! times their bytes. Here each run the direct path writes is hashed while its pages
//! are resident, and the runs of a tensor, once the copy is done, combined in order
//! ([`Checksum::combine`]) when they tile it.

use crate::formats::checksum::Checksum;
use crate::formats::WritePart;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// One run read of a tensor: its start and length in the tensor's bytes, and their
/// CRC-32C.
type RunSum = (u64, u64, Checksum);

/// The runs read of each tensor to be checked, by `(file, tensor)`.
#[derive(Default)]
pub(crate) struct ReadSums {
    wanted: BTreeSet<(usize, usize)>,
    runs: Mutex<BTreeMap<(usize, usize), Vec<RunSum>>>,
}

impl ReadSums {
    /// Sums of the runs read of `wanted`'s tensors.
    pub(crate) fn of(wanted: impl IntoIterator<Item = (usize, usize)>) -> ReadSums {
        ReadSums {
            wanted: wanted.into_iter().collect(),
            runs: Mutex::default(),
        }
    }

    /// Whether tensor `tensor` of file `file` is summed here.
    pub(crate) fn wants(&self, file: usize, tensor: usize) -> bool {
        self.wanted.contains(&(file, tensor))
    }

    /// Records the run `part` (bytes `start..` of the tensor), read.
    pub(crate) fn add(&self, file: usize, tensor: usize, start: u64, part: &WritePart<'_>) {
        if !self.wants(file, tensor) {
            return;
        }
        let sum = Checksum(crc32c::crc32c(part.bytes));
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((file, tensor))
            .or_default()
            .push((start, part.bytes.len() as u64, sum));
    }

    /// The checksum of each wanted tensor whose runs tile its `len(file, tensor)`
    /// bytes exactly; the others (read in part by another path, or in overlapping
    /// runs) are left out, to be checked by reading them.
    pub(crate) fn whole(
        self,
        len: impl Fn(usize, usize) -> u64,
    ) -> BTreeMap<(usize, usize), Checksum> {
        let runs = self
            .runs
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        runs.into_iter()
            .filter_map(|(key, mut r)| {
                r.sort_unstable_by_key(|&(start, _, _)| start);
                let mut at = 0;
                for &(start, n, _) in &r {
                    if start != at {
                        return None;
                    }
                    at += n;
                }
                (at == len(key.0, key.1)).then(|| {
                    (
                        key,
                        Checksum::combine(r.into_iter().map(|(_, n, s)| (s, n))),
                    )
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(b: &[u8]) -> WritePart<'_> {
        WritePart::from(b)
    }

    /// Runs recorded out of order combine into the tensor's checksum; runs with a gap
    /// or an overlap give none (the tensor is then read to be checked).
    #[test]
    fn runs_that_tile_a_tensor_give_its_checksum() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let sums = ReadSums::of([(0, 0), (0, 1), (1, 0)]);
        sums.add(0, 0, 6000, &part(&bytes[6000..]));
        sums.add(0, 0, 0, &part(&bytes[..2500]));
        sums.add(0, 0, 2500, &part(&bytes[2500..6000]));
        // A gap.
        sums.add(0, 1, 0, &part(&bytes[..100]));
        sums.add(0, 1, 200, &part(&bytes[200..]));
        // An overlap.
        sums.add(1, 0, 0, &part(&bytes[..600]));
        sums.add(1, 0, 500, &part(&bytes[500..]));
        // Not wanted.
        sums.add(2, 0, 0, &part(&bytes));
        let whole = sums.whole(|_, _| bytes.len() as u64);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[&(0, 0)], Checksum(crc32c::crc32c(&bytes)));
    }
}
