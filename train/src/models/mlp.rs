//! A tensor-parallel MLP classifier, the tutorials' sliced-MatMul net.
//!
//! Each block is Megatron's MLP: a column-parallel `fc1` (hidden units split over `tp`),
//! ReLU, a row-parallel `fc2` whose partial sums are all-reduced, ReLU. The classifier
//! `head` is column-parallel (split by class) and its logits are gathered.
//!
//! Keys: `blocks.{i}.fc1.{weight,bias}`, `blocks.{i}.fc2.{weight,bias}`,
//! `head.{weight,bias}`.

use crate::layers::{ColumnLinear, ModelCtx, RowLinear};
use crate::parallel::gather_from_group;
use crate::params::ShardedVarBuilder;
use candle_core::{Module, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// MLP hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Input features (pixels per image).
    pub in_features: usize,
    /// Hidden units of each block's `fc1` (split over `tp`).
    pub hidden: usize,
    /// Width between blocks (output of each `fc2`).
    pub width: usize,
    /// Number of blocks.
    pub blocks: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Config {
    /// The default for images of `in_features` pixels and `classes` classes.
    #[must_use]
    pub fn for_data(in_features: usize, classes: usize) -> Config {
        Config {
            in_features,
            hidden: 512,
            width: 256,
            blocks: 1,
            classes,
        }
    }
}

struct Block {
    fc1: ColumnLinear,
    fc2: RowLinear,
}

impl Block {
    fn new(cfg: &Config, vb: &ShardedVarBuilder, ctx: &ModelCtx, d_in: usize) -> Result<Block> {
        Ok(Block {
            fc1: ColumnLinear::new(&vb.pp("fc1"), ctx, d_in, cfg.hidden, 1, true)?,
            fc2: RowLinear::new(&vb.pp("fc2"), ctx, cfg.hidden, cfg.width, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)?.relu()
    }
}

/// The MLP on one rank.
pub struct Mlp {
    blocks: Vec<Block>,
    head: ColumnLinear,
    tp: Arc<dyn crate::comm::Comm>,
    classes: usize,
}

impl Mlp {
    /// Builds this rank's slice of the model.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(cfg: &Config, vb: &ShardedVarBuilder, ctx: &ModelCtx) -> Result<Mlp> {
        let mut blocks = Vec::with_capacity(cfg.blocks);
        for i in 0..cfg.blocks {
            let d_in = if i == 0 { cfg.in_features } else { cfg.width };
            blocks.push(Block::new(cfg, &vb.pp("blocks").pp(i), ctx, d_in)?);
        }
        let d_head = if cfg.blocks == 0 {
            cfg.in_features
        } else {
            cfg.width
        };
        let head = ColumnLinear::new(&vb.pp("head"), ctx, d_head, cfg.classes, 1, true)?;
        Ok(Mlp {
            blocks,
            head,
            tp: ctx.tp.clone(),
            classes: cfg.classes,
        })
    }

    /// Logits `[b, classes]` (gathered over `tp`) of images `[b, ...]`.
    ///
    /// # Errors
    /// Shape or collective errors.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.flatten_from(1)?;
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        gather_from_group(&self.head.forward(&h)?, &self.tp, self.classes)
    }
}
