//! A small vision transformer: patch embedding, pre-norm blocks of attention with a
//! fused QKV projection and an MLP, a class token and a classifier head.
//!
//! Tensor parallel as Megatron: `attn.qkv` is column-parallel over heads and stored as
//! a blocked shard `Shard(0, blocks=3)` (each of q, k, v split, local `[q_r; k_r; v_r]`),
//! `attn.proj` and `mlp.fc2` are row-parallel, `mlp.fc1` column-parallel, the head is
//! split by class. Embeddings and norms are replicated.
//!
//! Keys: `patch_embed.{weight,bias}`, `cls_token`, `pos_embed`,
//! `blocks.{i}.{norm1,norm2}.{weight,bias}`, `blocks.{i}.attn.{qkv,proj}.{weight,bias}`,
//! `blocks.{i}.mlp.{fc1,fc2}.{weight,bias}`, `norm.{weight,bias}`, `head.{weight,bias}`.

use crate::layers::{ColumnLinear, LayerNorm, Linear, ModelCtx, RowLinear};
use crate::parallel::gather_from_group;
use crate::params::{Init, ParamHint, ShardedVarBuilder};
use candle_core::{Module, Result, Tensor, D};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// ViT hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Image side (square images).
    pub image_size: usize,
    /// Channels per image.
    pub channels: usize,
    /// Patch side; must divide `image_size`.
    pub patch: usize,
    /// Embedding width.
    pub dim: usize,
    /// Number of blocks.
    pub depth: usize,
    /// Attention heads; `tp` must divide it.
    pub heads: usize,
    /// Hidden units of each block's MLP.
    pub mlp_hidden: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Config {
    /// The default for images of the given size.
    #[must_use]
    pub fn for_data(image_size: usize, channels: usize, classes: usize) -> Config {
        let patch = if image_size.is_multiple_of(4) { 4 } else { 2 };
        Config {
            image_size,
            channels,
            patch,
            dim: 64,
            depth: 2,
            heads: 4,
            mlp_hidden: 128,
            classes,
        }
    }

    fn patches(&self) -> usize {
        (self.image_size / self.patch).pow(2)
    }
}

struct Attention {
    qkv: ColumnLinear,
    proj: RowLinear,
    local_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(cfg: &Config, vb: &ShardedVarBuilder, ctx: &ModelCtx) -> Result<Attention> {
        let qkv = ColumnLinear::new(&vb.pp("qkv"), ctx, cfg.dim, 3 * cfg.dim, 3, true)?;
        let proj = RowLinear::new(&vb.pp("proj"), ctx, cfg.dim, cfg.dim, true)?;
        Ok(Attention {
            qkv,
            proj,
            local_heads: cfg.heads / ctx.tp.size(),
            head_dim: cfg.dim / cfg.heads,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let dl = self.local_heads * self.head_dim;
        let qkv = self.qkv.forward(x)?;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * dl, dl)?
                .reshape((b, t, self.local_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let att = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, dl))?;
        self.proj.forward(&y)
    }
}

struct Block {
    norm1: LayerNorm,
    attn: Attention,
    norm2: LayerNorm,
    fc1: ColumnLinear,
    fc2: RowLinear,
}

impl Block {
    fn new(cfg: &Config, vb: &ShardedVarBuilder, ctx: &ModelCtx) -> Result<Block> {
        Ok(Block {
            norm1: LayerNorm::new(&vb.pp("norm1"), cfg.dim)?,
            attn: Attention::new(cfg, &vb.pp("attn"), ctx)?,
            norm2: LayerNorm::new(&vb.pp("norm2"), cfg.dim)?,
            fc1: ColumnLinear::new(
                &vb.pp("mlp").pp("fc1"),
                ctx,
                cfg.dim,
                cfg.mlp_hidden,
                1,
                true,
            )?,
            fc2: RowLinear::new(&vb.pp("mlp").pp("fc2"), ctx, cfg.mlp_hidden, cfg.dim, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.norm1.forward(x)?)?)?;
        let h = self
            .fc2
            .forward(&self.fc1.forward(&self.norm2.forward(&x)?)?.gelu()?)?;
        x + h
    }
}

/// The ViT on one rank.
pub struct Vit {
    cfg: Config,
    patch_embed: Linear,
    cls_token: Tensor,
    pos_embed: Tensor,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: ColumnLinear,
    tp: Arc<dyn crate::comm::Comm>,
}

impl Vit {
    /// Builds this rank's slice of the model.
    ///
    /// # Errors
    /// A configuration that does not fit (patch not dividing the image, heads not
    /// dividing the width or not divisible by `tp`); missing or misshapen tensors.
    pub fn new(cfg: &Config, vb: &ShardedVarBuilder, ctx: &ModelCtx) -> Result<Vit> {
        if cfg.patch == 0 || !cfg.image_size.is_multiple_of(cfg.patch) {
            candle_core::bail!(
                "vit: patch {} must divide image size {}",
                cfg.patch,
                cfg.image_size
            )
        }
        if cfg.heads == 0
            || !cfg.dim.is_multiple_of(cfg.heads)
            || !cfg.heads.is_multiple_of(ctx.tp.size())
        {
            candle_core::bail!(
                "vit: heads {} must divide dim {} and be divisible by tp {}",
                cfg.heads,
                cfg.dim,
                ctx.tp.size()
            )
        }
        if !cfg.mlp_hidden.is_multiple_of(ctx.tp.size()) {
            candle_core::bail!(
                "vit: mlp_hidden {} must be divisible by tp {}",
                cfg.mlp_hidden,
                ctx.tp.size()
            )
        }
        let pd = cfg.channels * cfg.patch * cfg.patch;
        let emb = ParamHint::replicated(Init::Normal { std: 0.02 });
        Ok(Vit {
            patch_embed: Linear::new(&vb.pp("patch_embed"), pd, cfg.dim, true)?,
            cls_token: vb.get_with_hints((1, 1, cfg.dim), "cls_token", emb)?,
            pos_embed: vb.get_with_hints((1, cfg.patches() + 1, cfg.dim), "pos_embed", emb)?,
            blocks: (0..cfg.depth)
                .map(|i| Block::new(cfg, &vb.pp("blocks").pp(i), ctx))
                .collect::<Result<_>>()?,
            norm: LayerNorm::new(&vb.pp("norm"), cfg.dim)?,
            head: ColumnLinear::new(&vb.pp("head"), ctx, cfg.dim, cfg.classes, 1, true)?,
            tp: ctx.tp.clone(),
            cfg: cfg.clone(),
        })
    }

    /// Logits `[b, classes]` (gathered over `tp`) of images `[b, c, h, w]`.
    ///
    /// # Errors
    /// Shape or collective errors.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let p = self.cfg.patch;
        let patches = x
            .reshape((b, c, h / p, p, w / p, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((b, (h / p) * (w / p), c * p * p))?;
        let tokens = self.patch_embed.forward(&patches)?;
        let cls = self.cls_token.broadcast_as((b, 1, self.cfg.dim))?;
        let mut x = Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.pos_embed)?;
        for blk in &self.blocks {
            x = blk.forward(&x)?;
        }
        let x = self.norm.forward(&x)?;
        let cls = x.narrow(1, 0, 1)?.squeeze(1)?;
        gather_from_group(&self.head.forward(&cls)?, &self.tp, self.cfg.classes)
    }
}
