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
    pub fn for_data(
        kind: ModelKind,
        channels: usize,
        height: usize,
        width: usize,
        classes: usize,
        depth: Option<usize>,
    ) -> ModelConfig {
        match kind {
            ModelKind::Mlp => {
                ModelConfig::Mlp(mlp::Config::for_data(channels * height * width, classes))
            }
            ModelKind::Vit => ModelConfig::Vit(vit::Config::for_data(height, channels, classes)),
            ModelKind::Resnet => ModelConfig::Resnet(resnet::Config {
                depth: depth.unwrap_or(20),
                channels,
                classes,
            }),
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
        let specs = log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Init;
    use ckpt_core::layout::Placement;

    fn count(cfg: &ModelConfig, tp: usize, trainable: bool) -> u64 {
        cfg.specs(tp)
            .unwrap()
            .iter()
            .filter(|s| s.hint.trainable == trainable)
            .map(|s| s.shape.iter().product::<u64>())
            .sum()
    }

    #[test]
    fn resnet_sizes_match_the_papers() {
        let r = |depth| {
            ModelConfig::Resnet(resnet::Config {
                depth,
                channels: 3,
                classes: 10,
            })
        };
        // He et al.: ResNet-20 0.27M parameters, ResNet-56 0.85M (here with 1x1
        // projection shortcuts at the two stage changes).
        let (n20, n56) = (count(&r(20), 1, true), count(&r(56), 1, true));
        assert_eq!(n20, 272_474);
        assert!((850_000..870_000).contains(&n56), "{n56}");
        // torchvision's resnet50 minus its 7x7 stem and 1000-class head.
        let n50 = count(&r(50), 1, true);
        assert!((23_400_000..23_600_000).contains(&n50), "{n50}");
        let specs = r(20).specs(1).unwrap();
        assert!(specs
            .iter()
            .any(|s| s.name == "layer2.0.downsample.0.weight" && s.shape == [32, 16, 1, 1]));
        assert!(specs.iter().any(|s| s.name == "layer3.2.bn2.running_var"
            && !s.hint.trainable
            && s.hint.init == Init::Ones));
        assert!(r(21).specs(1).unwrap_err().to_string().contains("6n+2"));
        assert!(r(20)
            .specs(2)
            .unwrap_err()
            .to_string()
            .contains("data parallel only"));
    }

    #[test]
    fn vit_fused_qkv_is_a_blocked_shard() {
        let cfg = ModelConfig::for_data(ModelKind::Vit, 1, 8, 8, 10, None);
        let specs = cfg.specs(2).unwrap();
        let get = |n: &str| {
            specs
                .iter()
                .find(|s| s.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        assert_eq!(
            get("blocks.0.attn.qkv.weight").hint.tp,
            Placement::blocked(0, 3)
        );
        assert_eq!(get("blocks.0.attn.qkv.weight").shape, [192, 64]);
        assert_eq!(
            get("blocks.1.attn.proj.weight").hint.tp,
            Placement::shard(1)
        );
        assert_eq!(get("blocks.1.mlp.fc1.bias").hint.tp, Placement::shard(0));
        assert_eq!(get("head.weight").hint.tp, Placement::shard(0));
        assert_eq!(get("pos_embed").shape, [1, 5, 64]);
        let bad = ModelConfig::Vit(vit::Config {
            heads: 3,
            dim: 63,
            ..vit::Config::for_data(8, 1, 10)
        });
        assert!(bad
            .specs(2)
            .unwrap_err()
            .to_string()
            .contains("divisible by tp"));
    }

    #[test]
    fn config_json_round_trips() {
        let cfg = ModelConfig::for_data(ModelKind::Mlp, 1, 8, 8, 10, None);
        let text = cfg.to_json();
        assert!(text.contains("\"model\": \"mlp\""), "{text}");
        assert_eq!(serde_json::from_str::<ModelConfig>(&text).unwrap(), cfg);
        assert!(serde_json::from_str::<ModelConfig>(
            r#"{"model":"mlp","config":{"in_features":1}}"#
        )
        .is_err());
    }

    #[test]
    fn mlp_keys_and_shapes_per_rank() {
        let cfg = ModelConfig::Mlp(mlp::Config {
            in_features: 4,
            hidden: 6,
            width: 3,
            blocks: 2,
            classes: 5,
        });
        let names: Vec<String> = cfg.specs(4).unwrap().into_iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "blocks.0.fc1.weight",
                "blocks.0.fc1.bias",
                "blocks.0.fc2.weight",
                "blocks.0.fc2.bias",
                "blocks.1.fc1.weight",
                "blocks.1.fc1.bias",
                "blocks.1.fc2.weight",
                "blocks.1.fc2.bias",
                "head.weight",
                "head.bias"
            ]
        );
    }
}
