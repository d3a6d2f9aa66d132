//! Building a trained model for one rank from any checkpoint: what `ckpt infer` uses.

use crate::checkpoint::{f32_from_bytes, find_meta_file, resolve_checkpoint, CONFIG_FILE};
use crate::comm::Dist;
use crate::error::{Error, IoContext, Result};
use crate::kernels::Kernels;
use crate::layers::ModelCtx;
use crate::models::{build_model, Model, ModelConfig};
use crate::params::ShardedVars;
use candle_core::{Device, Tensor};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

/// The model's tensors (no optimizer state) laid out on `mesh`: what rank `r` must
/// load to run its tensor-parallel slice.
///
/// # Errors
/// A configuration that does not fit the mesh's `tp`.
pub fn model_strategy(cfg: &ModelConfig, mesh: &Mesh) -> Result<Strategy> {
    let tp = mesh
        .axis_index("tp")
        .map_or(1, |a| mesh.axes()[a].size as usize);
    let mut s = Strategy::new(mesh.clone());
    for spec in cfg.specs(tp)? {
        s.insert(spec.name.clone(), spec.layout(mesh))?;
    }
    Ok(s)
}

/// Reads a checkpoint's `config.json` (in its root or first rank directory; an `--out`
/// directory designates its `latest`).
///
/// # Errors
/// No or malformed `config.json`.
pub fn read_model_config(dir: &Path) -> Result<ModelConfig> {
    let dir = resolve_checkpoint(dir)?;
    let path = find_meta_file(&dir, CONFIG_FILE).ok_or_else(|| Error::BadCheckpoint {
        path: dir.clone(),
        problem: format!("no {CONFIG_FILE}"),
    })?;
    let text = std::fs::read_to_string(&path).at(&path)?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path, source })
}

/// Loads `dist`'s rank slice of the model saved in `dir` (integrated, sliced with any
/// mesh, or DCP; resharded on load, reading only this rank's bytes) and builds it for
/// forward passes on `device` with `dist`'s `tp` group. Call on every rank of the
/// mesh: forward passes use `tp` collectives.
///
/// # Errors
/// An unreadable checkpoint, missing tensors, a config that does not fit the mesh.
pub fn load_model(dir: &Path, dist: &Dist, device: &Device) -> Result<(ModelConfig, Model)> {
    let cfg = read_model_config(dir)?;
    let dir = resolve_checkpoint(dir)?;
    let strategy = model_strategy(&cfg, &dist.mesh)?;
    let mut tensors = BTreeMap::new();
    for (name, t) in ckpt_core::engine::save::load_rank(&dir, &strategy, dist.rank as u64)? {
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        let data = match t.dtype {
            Dtype::F32 => f32_from_bytes(&t.data),
            other => {
                return Err(Error::BadCheckpoint {
                    path: dir.clone(),
                    problem: format!("tensor `{name}` is {other:?}; only F32 is supported"),
                })
            }
        };
        tensors.insert(name, Tensor::from_vec(data, shape, device)?);
    }
    let vb = ShardedVars::serve(tensors, dist.tp_size(), dist.tp_rank()).into_var_builder();
    let ctx = ModelCtx {
        tp: dist.tp.clone(),
        dp: dist.dp.clone(),
        sync_bn: false,
        kernels: Kernels::for_device(device),
    };
    let model = build_model(&cfg, &vb, &ctx)?;
    Ok((cfg, model))
}
