//! How one ZeRO-1/2 parameter group's flat buffers are laid over the new ranks: which
//! runs of the source files' stored partitions make each new partition. The dense
//! groups' plan is made here ([`GroupPlan::dense`]), the expert groups' by
//! [`super::experts`]; `zero12` writes either.

use crate::error::Result;
use crate::layout::flat::{FlatLayout, FlatRange, FlatSlot};

/// Elements `range` of source file `k`'s stored partition of a group.
pub(super) type Run = (usize, FlatRange);

/// One parameter group as the new ranks hold it: flat buffers (one for a dense group,
/// one per expert-parallel rank for an expert group), each a sequence of runs of the
/// source files' stored partitions, padded as DeepSpeed pads (to `2 * parts`) and cut
/// into `parts` partitions.
pub(super) struct GroupPlan {
    /// Each new buffer's runs, in order.
    pub(super) buffers: Vec<Vec<Run>>,
    /// New rank -> (its buffer, its partition of that buffer).
    pub(super) place: Vec<(usize, u64)>,
    /// Partitions per buffer (`partition_count`).
    pub(super) parts: u64,
    /// The parameters of every buffer in order (names as the files give them: an
    /// expert group's under local ids, the same in every buffer), element counts.
    pub(super) params: Vec<(String, u64)>,
    /// The alignment padding after each parameter (`param_alignment_paddings`).
    pub(super) pads: Vec<u64>,
    /// The group's new name, where it changes (`ep_size_<EP>`).
    pub(super) name: Option<String>,
}

/// One new partition: where its elements come from.
pub(super) struct PartitionPlan {
    /// `(offset in the partition, run)`; what no run covers is padding (zeros).
    pub(super) runs: Vec<(u64, Run)>,
    /// Elements of the partition, padding included (the optimizer moments' length).
    pub(super) partition: u64,
    /// Elements stored (`single_partition_of_fp32_groups`: the group's end padding cut).
    pub(super) stored: u64,
    /// Where the partition starts in its buffer.
    pub(super) start: u64,
}

impl GroupPlan {
    /// A dense group: one buffer, the source files' partitions end to end, cut for
    /// `dp` ranks.
    pub(super) fn dense(
        stored: &[u64],
        dp: u64,
        params: Vec<(String, u64)>,
        pads: Vec<u64>,
    ) -> GroupPlan {
        GroupPlan {
            buffers: vec![stored
                .iter()
                .enumerate()
                .map(|(k, &n)| (k, FlatRange::new(0, n)))
                .collect()],
            place: (0..dp).map(|r| (0, r)).collect(),
            parts: dp,
            params,
            pads,
            name: None,
        }
    }

    /// Partition `part` of buffer `b`.
    pub(super) fn partition(&self, b: usize, part: u64) -> Result<PartitionPlan> {
        let runs = &self.buffers[b];
        let lens: Vec<u64> = runs.iter().map(|(_, r)| r.len).collect();
        let l = FlatLayout::aligned(&lens, self.parts, 2 * self.parts)?;
        let out = l
            .partition_slots(part)
            .into_iter()
            .filter_map(|(off, s)| match s {
                FlatSlot::Tensor { tensor, range } => {
                    let (k, r) = runs[tensor];
                    Some((off, (k, FlatRange::new(r.start + range.start, range.len))))
                }
                FlatSlot::Padding => None,
            })
            .collect();
        Ok(PartitionPlan {
            runs: out,
            partition: l.partition,
            stored: l.partition.min(l.used.saturating_sub(part * l.partition)),
            start: part * l.partition,
        })
    }
}
