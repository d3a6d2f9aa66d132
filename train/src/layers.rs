//! Building blocks shared by the models: replicated, column- and row-parallel linear
//! layers, LayerNorm, BatchNorm (optionally synchronized over `dp`) and convolutions.
//! Weights are PyTorch-shaped (`[out, in]`, `[out, in, k, k]`).

use crate::batch_norm::{batch_norm_portable, batch_norm_train};
use crate::comm::Comm;
use crate::kernels::Kernels;
use crate::parallel::{copy_to_group, reduce_from_group};
use crate::params::{Init, ParamHint, ShardedVarBuilder};
use candle_core::{Module, Result, Tensor, Var, D};
use std::sync::Arc;

/// How a model runs on a rank: its `tp` and `dp` groups, whether BatchNorm statistics
/// are synchronized over `dp`, and the kernels its device needs.
#[derive(Clone)]
pub struct ModelCtx {
    /// Tensor-parallel group.
    pub tp: Arc<dyn Comm>,
    /// Data-parallel group (used by synchronized BatchNorm).
    pub dp: Arc<dyn Comm>,
    /// Synchronize BatchNorm statistics over `dp`.
    pub sync_bn: bool,
    /// Convolution and BatchNorm kernels ([`Kernels::for_device`] of the rank's device).
    pub kernels: Kernels,
}

impl std::fmt::Debug for ModelCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ModelCtx(tp {}/{}, dp {}/{}, sync_bn {}, {:?} kernels)",
            self.tp.rank(),
            self.tp.size(),
            self.dp.rank(),
            self.dp.size(),
            self.sync_bn,
            self.kernels
        )
    }
}

impl ModelCtx {
    /// A context for one rank alone.
    #[must_use]
    pub fn single() -> ModelCtx {
        let d = crate::comm::Dist::single();
        ModelCtx {
            tp: d.tp,
            dp: d.dp,
            sync_bn: false,
            kernels: Kernels::Cpu,
        }
    }

    /// A context that only knows the `tp` size and rank (to build shapes; cannot run).
    #[must_use]
    pub fn shape_only(tp_size: usize, tp_rank: usize) -> ModelCtx {
        let tp: Arc<dyn Comm> = Arc::new(crate::comm::ShapeOnlyComm {
            rank: tp_rank,
            members: (0..tp_size).collect(),
        });
        ModelCtx {
            tp,
            dp: crate::comm::Dist::single().dp,
            sync_bn: false,
            kernels: Kernels::Cpu,
        }
    }
}

/// `x @ w.T + b` for `x` of any rank (leading dims flattened).
///
/// # Errors
/// Shape mismatches.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inner = *dims.last().unwrap_or(&1);
    let x2 = x.reshape(((), inner))?;
    let mut y = x2.matmul(&w.t()?)?;
    if let Some(b) = b {
        y = y.broadcast_add(b)?;
    }
    let mut out = dims;
    if let Some(l) = out.last_mut() {
        *l = w.dim(0)?;
    }
    y.reshape(out)
}

fn uniform_for(fan_in: usize) -> Init {
    Init::Uniform {
        bound: 1.0 / (fan_in.max(1) as f32).sqrt(),
    }
}

/// A replicated linear layer.
#[derive(Clone, Debug)]
pub struct Linear {
    w: Tensor,
    b: Option<Tensor>,
}

impl Linear {
    /// `weight [out, in]` and `bias [out]`, replicated.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(vb: &ShardedVarBuilder, d_in: usize, d_out: usize, bias: bool) -> Result<Linear> {
        let init = uniform_for(d_in);
        let w = vb.get_with_hints((d_out, d_in), "weight", ParamHint::replicated(init))?;
        let b = if bias {
            Some(vb.get_with_hints(d_out, "bias", ParamHint::replicated(init))?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.w, self.b.as_ref())
    }
}

/// Column-parallel linear: weight `[out, in]` split by output rows over `tp` (in
/// `blocks` fused blocks for QKV), input replicated, output split.
#[derive(Clone)]
pub struct ColumnLinear {
    w: Tensor,
    b: Option<Tensor>,
    tp: Arc<dyn Comm>,
}

impl ColumnLinear {
    /// `weight [out, in]` `Shard(0, blocks)` and `bias [out]` likewise.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(
        vb: &ShardedVarBuilder,
        ctx: &ModelCtx,
        d_in: usize,
        d_out: usize,
        blocks: u64,
        bias: bool,
    ) -> Result<ColumnLinear> {
        let init = uniform_for(d_in);
        let w = vb.get_with_hints((d_out, d_in), "weight", ParamHint::blocked(0, blocks, init))?;
        let b = if bias {
            Some(vb.get_with_hints(d_out, "bias", ParamHint::blocked(0, blocks, init))?)
        } else {
            None
        };
        Ok(ColumnLinear {
            w,
            b,
            tp: ctx.tp.clone(),
        })
    }

    /// Local output features.
    #[must_use]
    pub fn local_out(&self) -> usize {
        self.w.dims()[0]
    }
}

impl Module for ColumnLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = copy_to_group(x, &self.tp)?;
        linear(&x, &self.w, self.b.as_ref())
    }
}

/// Row-parallel linear: weight `[out, in]` split by input columns over `tp`, input
/// split, partial outputs all-reduced, bias (replicated) added after.
#[derive(Clone)]
pub struct RowLinear {
    w: Tensor,
    b: Option<Tensor>,
    tp: Arc<dyn Comm>,
}

impl RowLinear {
    /// `weight [out, in]` `Shard(1)` and `bias [out]` replicated.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(
        vb: &ShardedVarBuilder,
        ctx: &ModelCtx,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<RowLinear> {
        let init = uniform_for(d_in);
        let w = vb.get_with_hints((d_out, d_in), "weight", ParamHint::shard(1, init))?;
        let b = if bias {
            Some(vb.get_with_hints(d_out, "bias", ParamHint::replicated(init))?)
        } else {
            None
        };
        Ok(RowLinear {
            w,
            b,
            tp: ctx.tp.clone(),
        })
    }
}

impl Module for RowLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = reduce_from_group(&linear(x, &self.w, None)?, &self.tp)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// LayerNorm over the last dim, from differentiable primitives.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// `weight [d]` (ones) and `bias [d]` (zeros), replicated.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(vb: &ShardedVarBuilder, d: usize) -> Result<LayerNorm> {
        let w = vb.get_with_hints(d, "weight", ParamHint::replicated(Init::Ones))?;
        let b = vb.get_with_hints(d, "bias", ParamHint::replicated(Init::Zeros))?;
        Ok(LayerNorm { w, b, eps: 1e-5 })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let xn = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        xn.broadcast_mul(&self.w)?.broadcast_add(&self.b)
    }
}

/// A 2-D convolution without bias, replicated.
#[derive(Clone, Debug)]
pub struct Conv2d {
    w: Tensor,
    stride: usize,
    padding: usize,
    kernels: Kernels,
}

impl Conv2d {
    /// `weight [out, in, k, k]`, He-normal (fan out) initialised.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(
        vb: &ShardedVarBuilder,
        ctx: &ModelCtx,
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Conv2d> {
        let std = (2.0 / (c_out * k * k) as f32).sqrt();
        let w = vb.get_with_hints(
            (c_out, c_in, k, k),
            "weight",
            ParamHint::replicated(Init::Normal { std }),
        )?;
        Ok(Conv2d {
            w,
            stride,
            padding,
            kernels: ctx.kernels,
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Kernels::Cpu => crate::conv::conv2d(x, &self.w, self.stride, self.padding),
            Kernels::Portable => x.conv2d(&self.w, self.padding, self.stride, 1, 1),
        }
    }
}

/// BatchNorm over `[b, c, h, w]` with running statistics (buffers), synchronized over
/// `dp` when the context asks: the per-channel sums and sums of squares are all-reduced,
/// so `n` ranks with local batch `b` compute the statistics of one rank with `n * b`.
#[derive(Clone)]
pub struct BatchNorm2d {
    w: Tensor,
    b: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    sync: Option<Arc<dyn Comm>>,
    momentum: f64,
    eps: f64,
    kernels: Kernels,
}

impl BatchNorm2d {
    /// `weight`, `bias` (trained) and `running_mean`, `running_var` (buffers), all `[c]`.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(vb: &ShardedVarBuilder, ctx: &ModelCtx, c: usize) -> Result<BatchNorm2d> {
        Ok(BatchNorm2d {
            w: vb.get_with_hints(c, "weight", ParamHint::replicated(Init::Ones))?,
            b: vb.get_with_hints(c, "bias", ParamHint::replicated(Init::Zeros))?,
            running_mean: vb.get_with_hints(c, "running_mean", ParamHint::buffer(Init::Zeros))?,
            running_var: vb.get_with_hints(c, "running_var", ParamHint::buffer(Init::Ones))?,
            sync: (ctx.sync_bn && ctx.dp.size() > 1).then(|| ctx.dp.clone()),
            momentum: 0.1,
            eps: 1e-5,
            kernels: ctx.kernels,
        })
    }

    /// Normalises with batch statistics (`train`, updating the running ones) or with the
    /// running statistics.
    ///
    /// # Errors
    /// Shape or collective errors.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_then(x, train, false)
    }

    /// [`BatchNorm2d::forward_t`] followed by a ReLU (fused into one op when training
    /// on the CPU kernels).
    ///
    /// # Errors
    /// Shape or collective errors.
    pub fn forward_relu_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_then(x, train, true)
    }

    fn forward_then(&self, x: &Tensor, train: bool, relu: bool) -> Result<Tensor> {
        let c = x.dim(1)?;
        let shape = (1, c, 1, 1);
        if train {
            let bn = match self.kernels {
                Kernels::Cpu => batch_norm_train,
                Kernels::Portable => batch_norm_portable,
            };
            let (y, stats) = bn(x, &self.w, &self.b, self.eps, self.sync.clone(), relu)?;
            if self.running_mean.is_variable() {
                let (m, n) = (self.momentum, stats.count);
                let dev = x.device();
                let mean = Tensor::from_vec(stats.mean, c, dev)?;
                let unbiased = (Tensor::from_vec(stats.var, c, dev)? * (n / (n - 1.0).max(1.0)))?;
                let rm = ((self.running_mean.detach() * (1.0 - m))? + (mean * m)?)?;
                let rv = ((self.running_var.detach() * (1.0 - m))? + (unbiased * m)?)?;
                Var::from_tensor(&self.running_mean)?.set(&rm)?;
                Var::from_tensor(&self.running_var)?.set(&rv)?;
            }
            return Ok(y);
        }
        let xn = x
            .broadcast_sub(&self.running_mean.reshape(shape)?)?
            .broadcast_div(&(self.running_var.reshape(shape)? + self.eps)?.sqrt()?)?;
        let y = xn
            .broadcast_mul(&self.w.reshape(shape)?)?
            .broadcast_add(&self.b.reshape(shape)?)?;
        if relu {
            y.relu()
        } else {
            Ok(y)
        }
    }
}
