//! BatchNorm over `[b, c, h, w]` as one fused candle op (forward and backward in single
//! passes over the data), optionally synchronized over a group.
//!
//! Training forward: per channel, `mean = Σx / n` and `var = Σx² / n - mean²` over the
//! batch (over every rank of the group when synchronized: the sums are all-reduced, `n`
//! is the global count), `y = (x - mean) / sqrt(var + eps) * γ + β`.
//!
//! Backward, with `x̂ = (x - mean) / σ` and sums over the batch (all-reduced when
//! synchronized, as PyTorch's SyncBatchNorm does, since the objective is the sum of the
//! ranks' losses): `dx = γ / σ * (dy - Σdy / n - x̂ Σ(dy x̂) / n)`, and the local
//! `dγ = Σ(dy x̂)`, `dβ = Σdy` (averaged over `dp` by the optimizer like any gradient).

use crate::comm::{Comm, ReduceOp};
use crate::cpu_data::{f32_slice, with_f32, Sums2};
use crate::parallel::all_reduce_sum_both;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// Batch statistics of the last forward: per-channel mean, biased variance, and the
/// element count they cover (global when synchronized).
#[derive(Clone, Debug, Default)]
pub(crate) struct BatchStats {
    pub(crate) mean: Vec<f32>,
    pub(crate) var: Vec<f32>,
    pub(crate) count: f64,
}

struct BatchNormOp {
    eps: f64,
    /// ReLU applied to the output in the same pass (and its mask to the gradient).
    relu: bool,
    sync: Option<Arc<dyn Comm>>,
    stats: Arc<Mutex<BatchStats>>,
}

fn dims(shape: &Shape) -> candle_core::Result<(usize, usize, usize)> {
    let (b, c, h, w) = shape.dims4()?;
    Ok((b, c, h * w))
}

impl BatchNormOp {
    fn all_reduce(&self, v: &mut [f32]) -> candle_core::Result<()> {
        if let Some(g) = &self.sync {
            g.all_reduce(v, ReduceOp::Sum)
                .map_err(candle_core::Error::wrap)?;
        }
        Ok(())
    }

    fn count(&self, local: usize) -> f64 {
        local as f64 * self.sync.as_ref().map_or(1, |g| g.size()) as f64
    }
}

/// Per channel of `[b, c, hw]` data, two f64 sums that `add(channel, range of one
/// image's channel, sums)` accumulates, image after image; channels in parallel.
fn channel_sums(
    b: usize,
    c: usize,
    hw: usize,
    add: impl Fn(usize, std::ops::Range<usize>, &mut Sums2) + Sync,
) -> Vec<(f64, f64)> {
    (0..c)
        .into_par_iter()
        .map(|ch| {
            let mut acc = Sums2::default();
            for bi in 0..b {
                add(ch, (bi * c + ch) * hw..(bi * c + ch + 1) * hw, &mut acc);
            }
            acc.total()
        })
        .collect()
}

impl CustomOp3 for BatchNormOp {
    fn name(&self) -> &'static str {
        "batch-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "batch-norm: input")?;
        let gamma = f32_slice(s2, l2, "batch-norm: weight")?;
        let beta = f32_slice(s3, l3, "batch-norm: bias")?;
        let (b, c, hw) = dims(l1.shape())?;
        let per = channel_sums(b, c, hw, |_, r, acc| {
            acc.add(&x[r.clone()], &x[r], |v, _| {
                (f64::from(v), f64::from(v) * f64::from(v))
            });
        });
        let mut sums: Vec<f32> = per
            .iter()
            .map(|p| p.0 as f32)
            .chain(per.iter().map(|p| p.1 as f32))
            .collect();
        self.all_reduce(&mut sums)?;
        let n = self.count(b * hw);
        let mut mean = vec![0f32; c];
        let mut var = vec![0f32; c];
        let mut scale = vec![0f32; c];
        for ch in 0..c {
            let m = f64::from(sums[ch]) / n;
            let v = (f64::from(sums[c + ch]) / n - m * m).max(0.0);
            mean[ch] = m as f32;
            var[ch] = v as f32;
            scale[ch] = gamma[ch] * (1.0 / (v + self.eps).sqrt()) as f32;
        }
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(hw.max(1))
            .zip(x.par_chunks(hw.max(1)))
            .enumerate()
            .for_each(|(i, (o, xs))| {
                let ch = i % c;
                let (m, k, bb) = (mean[ch], scale[ch], beta[ch]);
                for (o, &v) in o.iter_mut().zip(xs) {
                    *o = (v - m) * k + bb;
                }
                if self.relu {
                    crate::activation::relu_in_place(o);
                }
            });
        *self
            .stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = BatchStats {
            mean,
            var,
            count: n,
        };
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _beta: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let stats = self
            .stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let (b, c, hw) = dims(x.shape())?;
        let g = gamma.to_vec1::<f32>()?;
        let inv: Vec<f32> = stats
            .var
            .iter()
            .map(|&v| (1.0 / (f64::from(v) + self.eps).sqrt()) as f32)
            .collect();
        // With the fused ReLU, the gradient reaching the normalisation is the output's
        // where the output is positive.
        let grad = if self.relu {
            crate::activation::relu_grad(res, grad)?
        } else {
            grad.clone()
        };
        let (dx, local) = with_f32(x, "batch-norm: input", |xv| {
            with_f32(&grad, "batch-norm: gradient", |dy| {
                let per = channel_sums(b, c, hw, |ch, r, acc| {
                    let (m, iv) = (stats.mean[ch], inv[ch]);
                    acc.add(&dy[r.clone()], &xv[r], |d, v| {
                        (f64::from(d), f64::from(d) * f64::from((v - m) * iv))
                    });
                });
                let mut sums: Vec<f32> = per
                    .iter()
                    .map(|p| p.0 as f32)
                    .chain(per.iter().map(|p| p.1 as f32))
                    .collect();
                let local = sums.clone();
                self.all_reduce(&mut sums)?;
                let n = stats.count;
                let mut dx = vec![0f32; xv.len()];
                dx.par_chunks_mut(hw.max(1))
                    .zip(dy.par_chunks(hw.max(1)).zip(xv.par_chunks(hw.max(1))))
                    .enumerate()
                    .for_each(|(i, (o, (dy, xv)))| {
                        let ch = i % c;
                        let (m, iv) = (stats.mean[ch], inv[ch]);
                        let k = g[ch] * iv;
                        let (mdy, mdyx) = (
                            (f64::from(sums[ch]) / n) as f32,
                            (f64::from(sums[c + ch]) / n) as f32,
                        );
                        for ((o, &d), &v) in o.iter_mut().zip(dy).zip(xv) {
                            *o = k * (d - mdy - (v - m) * iv * mdyx);
                        }
                    });
                Ok::<_, candle_core::Error>((dx, local))
            })
        })???;
        let dev = x.device();
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), dev)?),
            Some(Tensor::from_vec(local[c..].to_vec(), c, dev)?),
            Some(Tensor::from_vec(local[..c].to_vec(), c, dev)?),
        ))
    }
}

/// Training-mode BatchNorm of `x` `[b, c, h, w]` with weight and bias `[c]`, statistics
/// synchronized over `sync` when given, followed by a ReLU when `relu`. Returns the
/// output and the batch statistics. CPU tensors ([`batch_norm_portable`] runs on every
/// device).
pub(crate) fn batch_norm_train(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    sync: Option<Arc<dyn Comm>>,
    relu: bool,
) -> candle_core::Result<(Tensor, BatchStats)> {
    let stats = Arc::new(Mutex::new(BatchStats::default()));
    let op = BatchNormOp {
        eps,
        relu,
        sync,
        stats: stats.clone(),
    };
    let y = x
        .contiguous()?
        .apply_op3(&gamma.contiguous()?, &beta.contiguous()?, op)?;
    let s = stats
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    Ok((y, s))
}

/// Training-mode BatchNorm written with candle's differentiable ops, so it runs on any
/// device (the fused op has a CPU kernel only). Two passes, the mean and then the
/// centred squares, keep the variance accurate in f32; each per-channel sum is
/// all-reduced over `sync` by an op whose gradient is all-reduced too, which gives the
/// gradients of the fused op.
pub(crate) fn batch_norm_portable(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    sync: Option<Arc<dyn Comm>>,
    relu: bool,
) -> candle_core::Result<(Tensor, BatchStats)> {
    let (b, c, h, w) = x.dims4()?;
    let n = (b * h * w) as f64 * sync.as_ref().map_or(1, |g| g.size()) as f64;
    let total = |t: &Tensor| -> candle_core::Result<Tensor> {
        let s = t.sum_keepdim((0, 2, 3))?;
        match &sync {
            Some(g) => all_reduce_sum_both(&s, g),
            None => Ok(s),
        }
    };
    let mean = (total(x)? / n)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = (total(&xc.sqr()?)? / n)?;
    let y = xc
        .broadcast_div(&(&var + eps)?.sqrt()?)?
        .broadcast_mul(&gamma.reshape((1, c, 1, 1))?)?
        .broadcast_add(&beta.reshape((1, c, 1, 1))?)?;
    let y = if relu { y.relu()? } else { y };
    let stats = BatchStats {
        mean: mean.flatten_all()?.to_vec1()?,
        var: var.flatten_all()?.to_vec1()?,
        count: n,
    };
    Ok((y, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The fused op, with and without its ReLU, against the same BatchNorm written with
    /// differentiable primitives.
    #[test]
    fn fused_batch_norm_matches_autograd() {
        for relu in [false, true] {
            fused_batch_norm_matches_autograd_with(relu);
        }
    }

    fn fused_batch_norm_matches_autograd_with(relu: bool) {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(1f32, 2.0, (3, 4, 5, 2), &dev).unwrap()).unwrap();
        let g = Var::from_tensor(&Tensor::randn(1f32, 0.2, 4, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.2, 4, &dev).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 4, 5, 2), &dev).unwrap();
        let (y, stats) = batch_norm_train(
            x.as_tensor(),
            g.as_tensor(),
            b.as_tensor(),
            1e-5,
            None,
            relu,
        )
        .unwrap();
        let ga = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();

        let xs = x.as_tensor();
        let mean = xs.mean_keepdim((0, 2, 3)).unwrap();
        let xc = xs.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim((0, 2, 3)).unwrap();
        let r = xc
            .broadcast_div(&(var.clone() + 1e-5).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(&g.as_tensor().reshape((1, 4, 1, 1)).unwrap())
            .unwrap()
            .broadcast_add(&b.as_tensor().reshape((1, 4, 1, 1)).unwrap())
            .unwrap();
        let r = if relu { r.relu().unwrap() } else { r };
        let gb = (r * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let close = |a: &Tensor, b: &Tensor| {
            let d = (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-4, "relu {relu}: differ by {d}");
        };
        for v in [&x, &g, &b] {
            close(
                ga.get(v.as_tensor()).unwrap(),
                gb.get(v.as_tensor()).unwrap(),
            );
        }
        close(
            &Tensor::new(stats.var.as_slice(), &dev).unwrap(),
            &var.flatten_all().unwrap(),
        );
        assert_eq!(stats.count, 30.0);
    }

    /// Deterministic test data of shape `[b, c, h, w]`, different for each `seed`.
    fn data(shape: (usize, usize, usize, usize), seed: f32) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let v: Vec<f32> = (0..n)
            .map(|i| (i as f32 * 0.37 + seed * 1.3).sin() * 2.0 + seed)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// BatchNorm of `x` (fused or portable, synchronized over `sync`): the output, the
    /// batch statistics and the gradients of input, weight and bias for the loss
    /// `Σ y * probe`.
    fn run_bn(
        portable: bool,
        x: &Tensor,
        probe: &Tensor,
        sync: Option<Arc<dyn Comm>>,
    ) -> candle_core::Result<(Vec<Vec<f32>>, f64)> {
        let c = x.dim(1)?;
        let x = Var::from_tensor(x)?;
        let g = Var::from_tensor(&data((1, c, 1, 1), 7.0).flatten_all()?.affine(0.1, 1.0)?)?;
        let b = Var::from_tensor(&data((1, c, 1, 1), 8.0).flatten_all()?.affine(0.1, 0.0)?)?;
        let f = if portable {
            batch_norm_portable
        } else {
            batch_norm_train
        };
        let (y, stats) = f(
            x.as_tensor(),
            g.as_tensor(),
            b.as_tensor(),
            1e-5,
            sync,
            false,
        )?;
        let grads = (&y * probe)?.sum_all()?.backward()?;
        let mut out = vec![y.flatten_all()?.to_vec1::<f32>()?, stats.mean, stats.var];
        for v in [&x, &g, &b] {
            let grad = grads.get(v.as_tensor()).expect("a gradient");
            out.push(grad.flatten_all()?.to_vec1()?);
        }
        Ok((out, stats.count))
    }

    /// The portable BatchNorm (what runs on a GPU) and the fused op, synchronized over
    /// two ranks with different batches, each against one rank holding both batches:
    /// outputs, statistics, input gradients equal; weight and bias gradients are the
    /// rank's share (they sum to the whole batch's).
    #[test]
    fn synchronized_batch_norm_is_batch_norm_of_the_whole_batch() {
        use crate::comm::run_threads;
        use ckpt_core::layout::mesh::Mesh;
        let shape = (3, 4, 5, 2);
        let xs: Vec<Tensor> = (0..2).map(|r| data(shape, r as f32)).collect();
        let probes: Vec<Tensor> = (0..2).map(|r| data(shape, 10.0 + r as f32)).collect();
        let whole = |portable| {
            run_bn(
                portable,
                &Tensor::cat(&xs, 0).unwrap(),
                &Tensor::cat(&probes, 0).unwrap(),
                None,
            )
            .unwrap()
        };
        let (reference, n) = whole(false);
        let close = |what: &str, a: &[f32], p: &[f32]| {
            assert_eq!(a.len(), p.len(), "{what}");
            for (u, v) in a.iter().zip(p) {
                assert!(
                    (u - v).abs() <= 1e-4 * (1.0 + u.abs()),
                    "{what}: {u} vs {v}"
                );
            }
        };
        let (portable_whole, _) = whole(true);
        for (i, what) in ["y", "mean", "var", "dx", "dgamma", "dbeta"]
            .iter()
            .enumerate()
        {
            close(
                &format!("portable one rank {what}"),
                &reference[i],
                &portable_whole[i],
            );
        }
        let per_rank = reference[0].len() / 2;
        for portable in [false, true] {
            let ranks = run_threads(&Mesh::parse("dp=2").unwrap(), |d| {
                Ok(run_bn(
                    portable,
                    &xs[d.rank],
                    &probes[d.rank],
                    Some(d.dp.clone()),
                )?)
            })
            .unwrap();
            for (r, (out, count)) in ranks.iter().enumerate() {
                let name = |w: &str| format!("portable {portable} rank {r} {w}");
                assert_eq!(*count, n);
                let mine = r * per_rank..(r + 1) * per_rank;
                close(&name("y"), &reference[0][mine.clone()], &out[0]);
                close(&name("mean"), &reference[1], &out[1]);
                close(&name("var"), &reference[2], &out[2]);
                close(&name("dx"), &reference[3][mine], &out[3]);
            }
            for k in [4, 5] {
                let sum: Vec<f32> = (0..ranks[0].0[k].len())
                    .map(|i| ranks[0].0[k][i] + ranks[1].0[k][i])
                    .collect();
                close(
                    &format!("portable {portable} summed gradient {k}"),
                    &reference[k],
                    &sum,
                );
            }
        }
    }
}
