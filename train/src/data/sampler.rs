//! `DistributedSampler`: PyTorch's semantics for splitting an epoch over ranks.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Splits `len` samples over `replicas` ranks, reshuffled every epoch from `seed`.
///
/// As `torch.utils.data.DistributedSampler(drop_last=False)`: the epoch's permutation
/// is padded by repeating its start to `replicas * ceil(len / replicas)`, and rank `r`
/// takes positions `r, r + replicas, ..`. So the ranks' `k`-th batches together are the
/// `k`-th global batch of a single rank, whatever `replicas` is.
///
/// ```
/// use ckpt_train::DistributedSampler;
/// let s = DistributedSampler { len: 5, replicas: 2, rank: 1, seed: 0, shuffle: false };
/// assert_eq!(s.indices(0), vec![1, 3, 0]); // padded with sample 0
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    /// Size of the data set.
    pub len: usize,
    /// Number of data-parallel ranks.
    pub replicas: usize,
    /// This rank's data-parallel coordinate.
    pub rank: usize,
    /// Seed of the shuffles.
    pub seed: u64,
    /// Whether to shuffle.
    pub shuffle: bool,
}

impl DistributedSampler {
    /// Samples per rank per epoch.
    #[must_use]
    pub fn num_samples(&self) -> usize {
        self.len.div_ceil(self.replicas)
    }

    /// The global order of `epoch` (before padding).
    #[must_use]
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(
                self.seed
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    .wrapping_add(epoch),
            );
            p.shuffle(&mut rng);
        }
        p
    }

    /// This rank's samples for `epoch`, in order.
    #[must_use]
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let p = self.permutation(epoch);
        let total = self.num_samples() * self.replicas;
        (0..total)
            .skip(self.rank)
            .step_by(self.replicas)
            .map(|i| p[i % self.len.max(1)])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_batches_make_the_single_rank_batch() {
        let one = DistributedSampler {
            len: 103,
            replicas: 1,
            rank: 0,
            seed: 7,
            shuffle: true,
        };
        let four: Vec<Vec<usize>> = (0..4)
            .map(|rank| {
                DistributedSampler {
                    replicas: 4,
                    rank,
                    ..one
                }
                .indices(3)
            })
            .collect();
        let whole = one.indices(3);
        assert!(four.iter().all(|v| v.len() == 26));
        // global batch 8 = 4 ranks x 2
        for k in 0..12 {
            let mut a: Vec<usize> = four
                .iter()
                .flat_map(|v| v[2 * k..2 * k + 2].to_vec())
                .collect();
            let mut b = whole[8 * k..8 * k + 8].to_vec();
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b);
        }
        assert_ne!(one.indices(3), one.indices(4), "reshuffled per epoch");
    }
}
