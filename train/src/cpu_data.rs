//! Borrowing the f32 data of CPU tensors inside custom ops (convolution, BatchNorm, the
//! collective ops) without the copies `to_vec1` makes, and the f64 sums BatchNorm takes
//! over it.

use candle_core::{CpuStorage, Layout, Storage, Tensor};

/// The f32 data a contiguous `layout` covers in `storage`; `what` names the operand in
/// errors (`"conv2d: input"`).
pub(crate) fn f32_slice<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = storage else {
        candle_core::bail!("{what} must be f32")
    };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

/// Runs `f` on the f32 data of the CPU tensor `t` (made contiguous first if it is not).
pub(crate) fn with_f32<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("{what} must be a CPU tensor")
    };
    Ok(f(f32_slice(cpu, layout, what)?))
}

/// Interleaved partial sums of [`Sums2`]: enough independent additions in flight for
/// the loop to vectorize and not wait on each addition's latency.
const LANES: usize = 8;

/// Two running f64 sums over f32 data, kept in [`LANES`] interleaved partial sums that
/// are added in a fixed order at the end: the same bits whatever the threads.
#[derive(Clone, Copy, Default)]
pub(crate) struct Sums2 {
    a: [f64; LANES],
    b: [f64; LANES],
}

impl Sums2 {
    /// Adds `term(x[i], y[i])` for every `i` (`x` and `y` of equal length).
    #[inline]
    pub(crate) fn add(&mut self, x: &[f32], y: &[f32], term: impl Fn(f32, f32) -> (f64, f64)) {
        let (xs, ys) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
        let (xr, yr) = (xs.remainder(), ys.remainder());
        for (xc, yc) in xs.zip(ys) {
            for l in 0..LANES {
                let (p, q) = term(xc[l], yc[l]);
                self.a[l] += p;
                self.b[l] += q;
            }
        }
        for (l, (&u, &v)) in xr.iter().zip(yr).enumerate() {
            let (p, q) = term(u, v);
            self.a[l] += p;
            self.b[l] += q;
        }
    }

    /// The two sums.
    pub(crate) fn total(&self) -> (f64, f64) {
        (self.a.iter().sum(), self.b.iter().sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_match_plain_sums_for_every_remainder() {
        for n in [0, 1, 7, 8, 9, 23, 64] {
            let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let y: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
            let mut s = Sums2::default();
            s.add(&x, &y, |u, v| (f64::from(u), f64::from(u) * f64::from(v)));
            s.add(&x[..n / 2], &y[..n / 2], |u, _| (f64::from(u), 0.0));
            let a: f64 = x.iter().map(|&u| f64::from(u)).sum::<f64>()
                + x[..n / 2].iter().map(|&u| f64::from(u)).sum::<f64>();
            let b: f64 = x
                .iter()
                .zip(&y)
                .map(|(&u, &v)| f64::from(u) * f64::from(v))
                .sum();
            let (ta, tb) = s.total();
            assert!(
                (ta - a).abs() < 1e-9 && (tb - b).abs() < 1e-9,
                "n {n}: {ta} {tb} vs {a} {b}"
            );
        }
    }
}
