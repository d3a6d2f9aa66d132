//! What the process backends (MPI, NCCL) share: the ordered reduction that makes them
//! bit-identical to the thread backend, and the collective timeout.

pub(crate) use super::reduce_ordered;
#[cfg(test)]
use super::ReduceOp;
use crate::error::{Error, Result};
use std::time::Duration;

/// Seconds a collective may wait for its peers before it fails (NCCL) or aborts the job
/// (MPI).
pub const TIMEOUT_VAR: &str = "CKPT_COMM_TIMEOUT";

/// The default of [`TIMEOUT_VAR`]: ten minutes, longer than any checkpoint save.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The collective timeout from [`TIMEOUT_VAR`], or [`DEFAULT_TIMEOUT`].
pub(crate) fn timeout_from_env() -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => Err(Error::Launch {
                variable: TIMEOUT_VAR.into(),
                problem: format!("`{v}` is not a positive number of seconds"),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_reduction_matches_left_to_right() {
        let parts: [&[f32]; 3] = [&[0.1, 1e8, 1.0], &[0.2, 1.0, 5.0], &[0.3, -1e8, 3.0]];
        let sum = reduce_ordered(parts.iter().copied(), 3, ReduceOp::Sum);
        assert_eq!(sum, vec![(0.1f32 + 0.2) + 0.3, (1e8f32 + 1.0) - 1e8, 9.0]);
        let mean = reduce_ordered(parts.iter().copied(), 3, ReduceOp::Mean);
        assert_eq!(mean[2], 3.0);
        assert_eq!(
            reduce_ordered(parts.iter().copied(), 3, ReduceOp::Max),
            vec![0.3, 1e8, 5.0]
        );
    }
}
