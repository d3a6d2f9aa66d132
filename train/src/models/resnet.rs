//! ResNets for CIFAR: the 6n+2 family of He et al. (depth 8, 20, 32, 56: three stages of
//! 16, 32, 64 channels) and ResNet-50 (bottleneck blocks 3-4-6-3, widths 64..512, a 3x3
//! stem for 32x32 images). Data parallel only; BatchNorm optionally synchronized.
//!
//! Keys follow torchvision: `conv1.weight`, `bn1.*`, `layer{s}.{i}.conv{1,2,3}.weight`,
//! `layer{s}.{i}.bn{1,2,3}.{weight,bias,running_mean,running_var}`,
//! `layer{s}.{i}.downsample.{0.weight,1.*}`, `fc.{weight,bias}`.

use crate::activation::add_relu;
use crate::kernels::Kernels;
use crate::layers::{BatchNorm2d, Conv2d, Linear, ModelCtx};
use crate::params::ShardedVarBuilder;
use candle_core::{Module, Result, Tensor};
use serde::{Deserialize, Serialize};

/// ResNet hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// 8, 20, 32, 56 (6n+2, basic blocks) or 50 (bottleneck).
    pub depth: usize,
    /// Channels per input image.
    pub channels: usize,
    /// Number of classes.
    pub classes: usize,
}

struct Downsample {
    conv: Conv2d,
    bn: BatchNorm2d,
}

impl Downsample {
    fn new(
        vb: &ShardedVarBuilder,
        ctx: &ModelCtx,
        c_in: usize,
        c_out: usize,
        stride: usize,
    ) -> Result<Option<Downsample>> {
        if stride == 1 && c_in == c_out {
            return Ok(None);
        }
        Ok(Some(Downsample {
            conv: Conv2d::new(&vb.pp("0"), ctx, c_in, c_out, 1, stride, 0)?,
            bn: BatchNorm2d::new(&vb.pp("1"), ctx, c_out)?,
        }))
    }

    fn forward(this: Option<&Downsample>, x: &Tensor, train: bool) -> Result<Tensor> {
        match this {
            Some(d) => d.bn.forward_t(&d.conv.forward(x)?, train),
            None => Ok(x.clone()),
        }
    }
}

struct Block {
    kind: BlockKind,
    kernels: Kernels,
}

enum BlockKind {
    Basic {
        conv1: Conv2d,
        bn1: BatchNorm2d,
        conv2: Conv2d,
        bn2: BatchNorm2d,
        down: Option<Downsample>,
    },
    Bottleneck {
        convs: [Conv2d; 3],
        bns: [BatchNorm2d; 3],
        down: Option<Downsample>,
    },
}

impl Block {
    fn basic(
        vb: &ShardedVarBuilder,
        ctx: &ModelCtx,
        c_in: usize,
        c_out: usize,
        stride: usize,
    ) -> Result<Block> {
        Ok(Block {
            kind: BlockKind::Basic {
                conv1: Conv2d::new(&vb.pp("conv1"), ctx, c_in, c_out, 3, stride, 1)?,
                bn1: BatchNorm2d::new(&vb.pp("bn1"), ctx, c_out)?,
                conv2: Conv2d::new(&vb.pp("conv2"), ctx, c_out, c_out, 3, 1, 1)?,
                bn2: BatchNorm2d::new(&vb.pp("bn2"), ctx, c_out)?,
                down: Downsample::new(&vb.pp("downsample"), ctx, c_in, c_out, stride)?,
            },
            kernels: ctx.kernels,
        })
    }

    fn bottleneck(
        vb: &ShardedVarBuilder,
        ctx: &ModelCtx,
        c_in: usize,
        width: usize,
        stride: usize,
    ) -> Result<Block> {
        let c_out = width * 4;
        Ok(Block {
            kind: BlockKind::Bottleneck {
                convs: [
                    Conv2d::new(&vb.pp("conv1"), ctx, c_in, width, 1, 1, 0)?,
                    Conv2d::new(&vb.pp("conv2"), ctx, width, width, 3, stride, 1)?,
                    Conv2d::new(&vb.pp("conv3"), ctx, width, c_out, 1, 1, 0)?,
                ],
                bns: [
                    BatchNorm2d::new(&vb.pp("bn1"), ctx, width)?,
                    BatchNorm2d::new(&vb.pp("bn2"), ctx, width)?,
                    BatchNorm2d::new(&vb.pp("bn3"), ctx, c_out)?,
                ],
                down: Downsample::new(&vb.pp("downsample"), ctx, c_in, c_out, stride)?,
            },
            kernels: ctx.kernels,
        })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (h, down) = match &self.kind {
            BlockKind::Basic {
                conv1,
                bn1,
                conv2,
                bn2,
                down,
            } => {
                let h = bn1.forward_relu_t(&conv1.forward(x)?, train)?;
                (bn2.forward_t(&conv2.forward(&h)?, train)?, down)
            }
            BlockKind::Bottleneck { convs, bns, down } => {
                let mut h = x.clone();
                for (i, (c, b)) in convs.iter().zip(bns).enumerate() {
                    h = if i < 2 {
                        b.forward_relu_t(&c.forward(&h)?, train)?
                    } else {
                        b.forward_t(&c.forward(&h)?, train)?
                    };
                }
                (h, down)
            }
        };
        add_relu(
            self.kernels,
            &h,
            &Downsample::forward(down.as_ref(), x, train)?,
        )
    }
}

/// The ResNet on one rank.
pub struct ResNet {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    layers: Vec<Block>,
    fc: Linear,
}

impl ResNet {
    /// Builds the model.
    ///
    /// # Errors
    /// An unsupported depth, `tp` above 1; missing or misshapen tensors.
    pub fn new(cfg: &Config, vb: &ShardedVarBuilder, ctx: &ModelCtx) -> Result<ResNet> {
        if ctx.tp.size() != 1 {
            candle_core::bail!(
                "resnet is data parallel only: use a mesh without tp (got tp={})",
                ctx.tp.size()
            )
        }
        let mut layers = Vec::new();
        if cfg.depth == 50 {
            let conv1 = Conv2d::new(&vb.pp("conv1"), ctx, cfg.channels, 64, 3, 1, 1)?;
            let bn1 = BatchNorm2d::new(&vb.pp("bn1"), ctx, 64)?;
            let mut c_in = 64;
            for (s, (&n, &width)) in [3usize, 4, 6, 3]
                .iter()
                .zip(&[64usize, 128, 256, 512])
                .enumerate()
            {
                for i in 0..n {
                    let stride = if i == 0 && s > 0 { 2 } else { 1 };
                    layers.push(Block::bottleneck(
                        &vb.pp(format!("layer{}", s + 1)).pp(i),
                        ctx,
                        c_in,
                        width,
                        stride,
                    )?);
                    c_in = width * 4;
                }
            }
            let fc = Linear::new(&vb.pp("fc"), c_in, cfg.classes, true)?;
            return Ok(ResNet {
                conv1,
                bn1,
                layers,
                fc,
            });
        }
        if cfg.depth < 8 || !(cfg.depth - 2).is_multiple_of(6) {
            candle_core::bail!(
                "resnet depth {} is not 6n+2 (8, 20, 32, 56, ...) nor 50",
                cfg.depth
            )
        }
        let n = (cfg.depth - 2) / 6;
        let conv1 = Conv2d::new(&vb.pp("conv1"), ctx, cfg.channels, 16, 3, 1, 1)?;
        let bn1 = BatchNorm2d::new(&vb.pp("bn1"), ctx, 16)?;
        let mut c_in = 16;
        for (s, &c) in [16usize, 32, 64].iter().enumerate() {
            for i in 0..n {
                let stride = if i == 0 && s > 0 { 2 } else { 1 };
                layers.push(Block::basic(
                    &vb.pp(format!("layer{}", s + 1)).pp(i),
                    ctx,
                    c_in,
                    c,
                    stride,
                )?);
                c_in = c;
            }
        }
        let fc = Linear::new(&vb.pp("fc"), c_in, cfg.classes, true)?;
        Ok(ResNet {
            conv1,
            bn1,
            layers,
            fc,
        })
    }

    /// Logits `[b, classes]` of images `[b, c, h, w]`.
    ///
    /// # Errors
    /// Shape or collective errors.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = self.bn1.forward_relu_t(&self.conv1.forward(x)?, train)?;
        for b in &self.layers {
            h = b.forward(&h, train)?;
        }
        let pooled = h.mean((2, 3))?;
        self.fc.forward(&pooled)
    }
}
