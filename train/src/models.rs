//! The models: `mlp`, `vit` and `resnet`, each with a serde `Config`, built for one
//! rank's tensor-parallel slice from a [`ShardedVarBuilder`].

pub mod mlp;
pub mod resnet;
pub mod vit;

use crate::error::{Error, Result};
use crate::layers::ModelCtx;
use crate::params::{ParamSpec, ShardedVarBuilder, ShardedVars};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A model name with its configuration; saved as the checkpoint's `config.json`
/// (`{"model": "mlp", "config": {..}}`) so that resume and inference need no flags.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "model", content = "config", rename_all = "lowercase")]
pub enum ModelConfig {
    /// Tensor-parallel MLP.
    Mlp(mlp::Config),
    /// Vision transformer.
    Vit(vit::Config),
    /// CIFAR ResNet.
    Resnet(resnet::Config),
}

/// The model families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Tensor-parallel MLP.
    Mlp,
    /// Vision transformer.
    Vit,
    /// CIFAR ResNet.
    Resnet,
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Vit => "vit",
            ModelKind::Resnet => "resnet",
        })
    }
}

impl ModelConfig {
    /// The default configuration of `kind` for images `[channels, height, width]` of
    /// `classes` classes (`depth` for resnet; 20 when `None`).
    #[must_use]
    pub fn for_data(kind: ModelKind, channels: usize, height: usize, width: usize, classes: usize, depth: Option<usize>) -> ModelConfig {
        match kind {
            ModelKind::Mlp => ModelConfig::Mlp(mlp::Config::for_data(channels * height * width, classes)),
            ModelKind::Vit => ModelConfig::Vit(vit::Config::for_data(height, channels, classes)),
            ModelKind::Resnet => ModelConfig::Resnet(resnet::Config { depth: depth.unwrap_or(20), channels, classes }),
        }
    }

    /// The family.
    #[must_use]
    pub fn kind(&self) -> ModelKind {
        match self {
            ModelConfig::Mlp(_) => ModelKind::Mlp,
            ModelConfig::Vit(_) => ModelKind::Vit,
            ModelConfig::Resnet(_) => ModelKind::Resnet,
        }
    }

    /// Number of classes.
    #[must_use]
    pub fn classes(&self) -> usize {
        match self {
            ModelConfig::Mlp(c) => c.classes,
            ModelConfig::Vit(c) => c.classes,
            ModelConfig::Resnet(c) => c.classes,
        }
    }

    /// Every tensor of the model (global shapes, `tp` placements), in declaration
    /// order, for `tp_size` tensor-parallel ranks.
    ///
    /// # Errors
    /// A configuration that does not fit `tp_size`.
    pub fn specs(&self, tp_size: usize) -> Result<Vec<ParamSpec>> {
        let backend = ShardedVars::record(tp_size, 0);
        let log = backend.spec_log();
        let vb: ShardedVarBuilder = backend.into_var_builder();
        build_model(self, &vb, &ModelCtx::shape_only(tp_size, 0))?;
        let specs = log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        Ok(specs)
    }

    /// The configuration as `config.json` text.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("model configs serialize")
    }
}

/// A model on one rank.
pub enum Model {
    /// Tensor-parallel MLP.
    Mlp(mlp::Mlp),
    /// Vision transformer.
    Vit(vit::Vit),
    /// CIFAR ResNet.
    Resnet(resnet::ResNet),
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Model::Mlp(_) => "Model::Mlp",
            Model::Vit(_) => "Model::Vit",
            Model::Resnet(_) => "Model::Resnet",
        })
    }
}

/// Builds this rank's slice of the model described by `cfg` from `vb` (whose backend
/// knows the rank's `tp` coordinate) and the rank's groups in `ctx`.
///
/// # Errors
/// [`Error::InvalidModel`] for configurations that do not fit; missing or misshapen
/// tensors.
pub fn build_model(cfg: &ModelConfig, vb: &ShardedVarBuilder, ctx: &ModelCtx) -> Result<Model> {
    let name = cfg.kind().to_string();
    let wrap = |e: candle_core::Error| Error::model(&name, e.to_string());
    Ok(match cfg {
        ModelConfig::Mlp(c) => Model::Mlp(mlp::Mlp::new(c, vb, ctx).map_err(wrap)?),
        ModelConfig::Vit(c) => Model::Vit(vit::Vit::new(c, vb, ctx).map_err(wrap)?),
        ModelConfig::Resnet(c) => Model::Resnet(resnet::ResNet::new(c, vb, ctx).map_err(wrap)?),
    })
}

impl Model {
    /// Logits `[b, classes]`, identical on every `tp` rank, of images `[b, c, h, w]`.
    /// `train` selects batch statistics in BatchNorm.
    ///
    /// # Errors
    /// Shape or collective errors.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        Ok(match self {
            Model::Mlp(m) => m.forward(x)?,
            Model::Vit(m) => m.forward(x)?,
            Model::Resnet(m) => m.forward(x, train)?,
        })
    }
}
