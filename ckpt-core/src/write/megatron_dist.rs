//! Writing a reshard's output as a megatron-core dist_ckpt (`reshard --format
//! megatron-dist`): what `megatron.core.dist_checkpointing.load` reads with the
//! `torch_dist` backend and Megatron-LM's `--ckpt-format torch_dist` starts from.
//!
//! `OUT/latest_checkpointed_iteration.txt` names `OUT/<release|iter_NNNNNNN>/`, which
//! holds what megatron-core's `dist_checkpointing.save` writes (docs/formats.md):
//! - `__<r>_0.distcp`: DCP files, one per rank of the target's TP x PP grid, each
//!   chunk a `torch.save` archive. Layer parameters are stacked over the layers as
//!   megatron-core's `TransformerBlock.sharded_state_dict` stacks them
//!   (`decoder.layers.<param>`, `[num_layers, ...]`, the global layer number the offset
//!   on the first axis), the norms under the fused names its layer specs map them to
//!   (`input_layernorm.` → `self_attention.linear_qkv.layer_norm_`, `pre_mlp_layernorm.`
//!   → `mlp.linear_fc1.layer_norm_`); each rank stores its layers' TP slices once;
//!   Experts (SequentialMLP's `local_experts.<e>`, global ids) are stacked over layers
//!   and experts (`decoder.layers.mlp.experts.experts.<param>`, `[layers, experts,
//!   ...]`), as `SequentialMLP.sharded_state_dict` stacks them;
//! - `__0_1.distcp`: the `_extra_state` of every parallel linear layer, a
//!   `ShardedObject` per layer (`decoder.layers.<module>._extra_state/shard_<l>_<L>`;
//!   an expert's per layer and expert, `shard_<l>.<e>_<L>.<E>`), as megatron-core's
//!   local layers save it (`torch.save([None])`: no FP8 state);
//! - `.metadata`: DCP's metadata of all of them; `common.pt`: `args` (the new sizes,
//!   `ckpt_format` `torch_dist`), `checkpoint_version` 3.0 and `iteration`;
//!   `metadata.json`: the backends.
//!
//! [`MegatronDist`] is the writer. As the legacy one ([`super::megatron`]): the plan is
//! the engine's (per-layer tensors, streamed and staged like any other output); this
//! module renames its chunks into the stacked tensors and writes the small files beside
//! them.

use super::dcp::DISTCP_FILES;
use super::megatron::{every_rank_uncompressed, megatron_grid, megatron_target};
use super::ranks::{finish_dir, rank_plan, RankOptions, Ranks};
use super::{TargetLayout, Writer};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::distcp::{metadata_bytes, DistcpChunk, DistcpObject};
use crate::formats::megatron::{self, SourceState, TRACKER_FILE};
use crate::formats::output::write_file_atomic;
use crate::formats::pickle::Emitter;
use crate::formats::torch_write::{TorchWriter, STORED_SHAPES};
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use crate::layout::{Dtype, Placement};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `reshard --format megatron-dist`: a megatron-core dist_ckpt (`torch_dist`, from a
/// Megatron legacy source or a Hugging Face model): `OUT/<iter_NNNNNNN|release>/` with
/// `__<r>_0.distcp`, `.metadata`, `common.pt` and `metadata.json`, and
/// `OUT/latest_checkpointed_iteration.txt`, with `strategy.json` beside, loadable by
/// megatron-core's `dist_checkpointing.load`.
#[derive(Clone, Debug)]
pub struct MegatronDist {
    /// The target's tensor x pipeline ranks, as [`megatron_dist_strategy`] prepares it.
    strategy: Strategy,
    /// Whose save the dist_ckpt is: what its iteration directory is called and what
    /// its `common.pt` holds.
    saver: Saver,
}

/// Who writes the dist_ckpt: the same tensors under the same keys, saved by another
/// program's code around megatron-core's `dist_checkpointing.save`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Saver {
    /// Megatron-LM's `save_checkpoint`: `common.pt` holds `args`.
    MegatronLm,
    /// Megatron-Bridge's `save_megatron_model` (`AutoBridge.import_ckpt`): `iter_0000000/`,
    /// `common.pt` without args ([`super::megatron_bridge`]).
    Bridge,
    /// NeMo 2's `MegatronCheckpointIO` (`llm.import_ckpt`): `weights/`, every key under
    /// NeMo's `module.` prefix, Lightning's `common.pt` ([`super::nemo2`]).
    Nemo2,
}

impl Saver {
    /// The prefix of every key of the saver's dist_ckpt.
    fn prefix(self) -> &'static str {
        match self {
            Saver::MegatronLm | Saver::Bridge => "",
            // MegatronParallel's chunk is DDP(GPTModel): MegatronModule's default
            // sharded_state_dict recurses into its child `module`.
            Saver::Nemo2 => "module.",
        }
    }
}

impl MegatronDist {
    /// The writer of the dist_ckpt `target` asks for `source` (GroupedMLP's experts seen
    /// one by one, as SequentialMLP's: a dist_ckpt holds them so).
    ///
    /// # Errors
    /// Some ranks or a compression asked for; a source Megatron's names do not fit; a
    /// grid or target strategy megatron-core cannot run the model on (see
    /// [`TargetLayout`]).
    pub fn new(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
    ) -> Result<MegatronDist> {
        every_rank_uncompressed(&options)?;
        source.grouped_experts_as_sequential()?;
        let (mut strategy, _) = megatron_target(source, target)?;
        megatron_dist_strategy(source, &mut strategy)?;
        Ok(MegatronDist {
            strategy,
            saver: Saver::MegatronLm,
        })
    }

    /// [`MegatronDist::new`], saved as `saver` saves it.
    ///
    /// # Errors
    /// As [`MegatronDist::new`].
    pub(crate) fn saved_by(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
        saver: Saver,
    ) -> Result<MegatronDist> {
        let mut w = MegatronDist::new(source, target, options)?;
        w.saver = saver;
        Ok(w)
    }

    /// The target's tensor and pipeline sizes.
    ///
    /// # Errors
    /// A mesh megatron-core cannot run the model on ([`megatron_grid`]).
    pub(crate) fn sizes(&self, source: &Checkpoint) -> Result<(u64, u64)> {
        let state = source.megatron_state()?;
        let (_, tp, pp) = megatron_grid(&state, &self.strategy, "megatron-dist")?;
        Ok((tp, pp))
    }
}

impl Writer for MegatronDist {
    fn name(&self) -> &'static str {
        "megatron-dist"
    }

    fn plan(&self, source: &Checkpoint, _: &Selection) -> Result<CopyPlan> {
        let mut plan = rank_plan(source, &self.strategy, Ranks::All, false, DISTCP_FILES)?;
        let (_, rewrites) = stacked(source, &self.strategy, &plan, self.saver)?;
        for (f, (path, shapes)) in plan.files.iter_mut().zip(rewrites) {
            f.path = path;
            if let Some(json) = shapes {
                f.metadata.insert(STORED_SHAPES.to_string(), json);
            }
        }
        Ok(plan)
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn strategy(&self) -> Option<&Strategy> {
        Some(&self.strategy)
    }

    fn finish(&self, src: &Checkpoint, _: &Selection, plan: &CopyPlan, dir: &Path) -> Result<()> {
        finish_dir(dir, &self.strategy.to_json(), src)?;
        // The same layout as the plan's (the rewrite renamed files, not tensors).
        let (dist, _) = stacked(src, &self.strategy, plan, self.saver)?;
        megatron_dist_finish(&dist, dir, self.saver)
    }
}

/// The prefix of the layers' tensors, per layer and stacked.
const LAYERS: &str = "decoder.layers.";
/// megatron-core's local layer spec's `sharded_state_dict_keys_map` (the
/// TransformerEngine spec has these names itself).
const FUSED_NORMS: [(&str, &str); 2] = [
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
];
/// The file of the non-tensor values (rank 0's second file, as DCP names them).
const OBJECTS_FILE: &str = "__0_1.distcp";
const COMMON_FILE: &str = "common.pt";
const CONFIG_FILE: &str = "metadata.json";
/// `metadata.json` of a `torch_dist` save (megatron-core's `CheckpointingConfig`).
const CONFIG: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

/// The experts of a layer, per expert (global ids) and stacked
/// (`SequentialMLP.sharded_state_dict`'s `experts.experts.` prefix).
const LOCAL_EXPERTS: &str = "mlp.experts.local_experts.";
const STACKED_EXPERTS: &str = "mlp.experts.experts.";

/// The dist_ckpt key of a Megatron tensor's global name, and where it sits on the
/// stacked axes (the layer; then the expert, for an expert's tensor):
/// `decoder.layers.3.input_layernorm.weight` is `[3]` of
/// `decoder.layers.self_attention.linear_qkv.layer_norm_weight`,
/// `decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight` is `[1, 5]` of
/// `decoder.layers.mlp.experts.experts.linear_fc2.weight`.
#[cfg(test)]
fn dist_key(name: &str) -> (String, Vec<u64>) {
    dist_key_with(name, &FUSED_NORMS)
}

/// The dist_ckpt key and stacked position of `name` (as `dist_key`), the norms `fused`
/// under the names given (the local spec's
/// [`FUSED_NORMS`], or Transformer Engine's MoE spec's: `input_layernorm` alone).
fn dist_key_with(name: &str, fused: &[(&str, &str)]) -> (String, Vec<u64>) {
    let as_is = || (name.to_string(), Vec::new());
    let Some(rest) = name.strip_prefix(LAYERS) else {
        return as_is();
    };
    let Some((layer, param)) = rest.split_once('.') else {
        return as_is();
    };
    let Ok(layer) = layer.parse::<u64>() else {
        return as_is();
    };
    if let Some((expert, param)) = param
        .strip_prefix(LOCAL_EXPERTS)
        .and_then(|p| p.split_once('.'))
    {
        if let Ok(expert) = expert.parse::<u64>() {
            return (
                format!("{LAYERS}{STACKED_EXPERTS}{param}"),
                vec![layer, expert],
            );
        }
    }
    let param = fused
        .iter()
        .find_map(|(from, to)| param.strip_prefix(from).map(|p| format!("{to}{p}")))
        .unwrap_or_else(|| param.to_string());
    (format!("{LAYERS}{param}"), vec![layer])
}

/// `prefix` then `v`.
fn lead(prefix: &[u64], v: &[u64]) -> Vec<u64> {
    prefix.iter().chain(v).copied().collect()
}

/// The parallel linear module of a stacked parameter (`decoder.layers.mlp.linear_fc1`
/// of `decoder.layers.mlp.linear_fc1.weight`): megatron-core's `ColumnParallelLinear`
/// and `RowParallelLinear` (and TransformerEngine's) save an `_extra_state`.
fn linear_module(key: &str) -> Option<&str> {
    let module = key.strip_suffix(".weight")?;
    let last = module.rsplit('.').next()?;
    (module.starts_with(LAYERS) && last.starts_with("linear_")).then_some(module)
}

/// A dist_ckpt output being written: what [`megatron_dist_finish`] writes beside the
/// engine's files.
#[derive(Debug)]
struct Stacked {
    state: SourceState,
    /// The iteration directory, relative to the output.
    dir: PathBuf,
    sizes: (u64, u64),
    tensors: BTreeMap<String, (Dtype, Vec<u64>)>,
    files: Vec<(String, Vec<DistcpChunk>)>,
    /// The `_extra_state` modules (stacked names) and the extents of their stacked
    /// axes (`[layers]`, or `[layers, experts]`).
    modules: BTreeMap<String, Vec<u64>>,
}

/// Prepares a target strategy (one tensor-parallel axis, an optional pipeline axis)
/// for a dist_ckpt: every tensor on the stage Megatron's layout puts it
/// ([`super::megatron::megatron_restage`]), split along its TP dimension in one block
/// (DCP stores one box per rank; megatron-core's loader reads any chunks, so a SwiGLU
/// `linear_fc1` need not be stored as each rank's gate and up rows), and no output layer
/// where the embeddings are tied (megatron-core's `GPTModel` saves the word embedding
/// once).
///
/// # Errors
/// What [`super::megatron::megatron_restage`] and [`megatron_grid`] refuse.
pub(crate) fn megatron_dist_strategy(source: &Checkpoint, strategy: &mut Strategy) -> Result<()> {
    let state = source.megatron_state()?;
    if let Some(name) = source
        .tensors
        .keys()
        .find(|n| crate::formats::megatron::is_grouped_weight(n))
    {
        // A dist_ckpt keeps each expert's fc1/fc2 as SequentialMLP's, the transposes of
        // GroupedMLP's runs.
        return Err(unsupported(format!(
            "--format megatron-dist: `{name}` is a GroupedMLP weight, which a dist_ckpt holds per expert: read it with Checkpoint::grouped_experts_as_sequential first"
        )));
    }
    super::megatron::megatron_restage(source, strategy)?;
    // Checked with the split Megatron makes (SwiGLU's gate and up rows each in TP
    // parts), before it is stored in one block.
    megatron_grid(&state, strategy, "megatron-dist")?;
    if state.args.model.untied == Some(false) {
        strategy.tensors.remove("output_layer.weight");
    }
    for l in strategy.tensors.values_mut() {
        for p in &mut l.placements {
            if let Placement::Shard { blocks, .. } = p {
                *blocks = 1;
            }
        }
    }
    Ok(())
}

/// Each file of a plan's path in the iteration directory, and the stored shapes its
/// metadata records.
type Rewrites = Vec<(PathBuf, Option<String>)>;

/// The dist_ckpt of `plan` (one file per rank of `strategy`'s mesh, as for DCP): the
/// per-layer tensors become chunks of the stacked ones, stored with a leading layer axis
/// of 1 (same bytes); with, for each file of the plan, its path in the iteration
/// directory and the stored shapes its metadata records.
///
/// # Errors
/// A source that is not Megatron's and was not imported; a mesh megatron-core cannot
/// run the model on ([`megatron_grid`]); a tensor of a layer outside
/// `num_layers`, or whose layers differ in shape; a tensor in several boxes on a rank.
fn stacked(
    source: &Checkpoint,
    strategy: &Strategy,
    plan: &CopyPlan,
    saver: Saver,
) -> Result<(Stacked, Rewrites)> {
    let state = source.megatron_state()?;
    let (_, tp, pp) = megatron_grid(&state, strategy, "megatron-dist")?;
    let layers = state.args.num_layers.ok_or_else(|| {
        unsupported("the source's args lack num_layers (a dist_ckpt stacks the layers)".into())
    })?;
    let dir = match saver {
        Saver::MegatronLm => state
            .rank_path(0, 0, 1)
            .components()
            .next()
            .map(|c| PathBuf::from(c.as_os_str()))
            .unwrap_or_default(),
        // `get_checkpoint_name(path, 0, release=False)`.
        Saver::Bridge => PathBuf::from(BRIDGE_ITERATION_DIR),
        // `ckpt_to_weights_subdir(path, is_saving=True)`.
        Saver::Nemo2 => PathBuf::from(NEMO_WEIGHTS_DIR),
    };
    let mut tensors: BTreeMap<String, (Dtype, Vec<u64>)> = BTreeMap::new();
    let mut files = Vec::with_capacity(plan.files.len());
    let mut rewrites = Vec::with_capacity(plan.files.len());
    let experts = state.args.moe.experts.unwrap_or(0);
    // Megatron-Bridge builds Transformer Engine's layer spec, whose MoE layers keep
    // `pre_mlp_layernorm` a module of its own (a `TENorm`: `pre_mlp_layernorm.weight`);
    // its dense layers fuse it into `linear_fc1` as the local spec names it.
    let fused = if saver == Saver::Bridge && experts > 0 {
        &FUSED_NORMS[..1]
    } else {
        &FUSED_NORMS[..]
    };
    let mut modules: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (r, f) in plan.files.iter().enumerate() {
        let name = format!("__{r}_0.distcp");
        let mut chunks = Vec::with_capacity(f.tensors.len());
        let mut stored: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for t in &f.tensors {
            let t = &t.target;
            let bad = |problem: String| Error::InvalidTensor {
                tensor: t.name.clone(),
                problem,
            };
            let [piece] = &t.pieces[..] else {
                return Err(bad(format!(
                    "rank {r} holds it as {} boxes; a dist_ckpt chunk is one",
                    t.pieces.len()
                )));
            };
            let (key, at) = dist_key_with(&t.name, fused);
            let module = linear_module(&key).map(|m| format!("{}{m}", saver.prefix()));
            let key = format!("{}{key}", saver.prefix());
            let global_shape = strategy
                .tensors
                .get(&t.name)
                .map(|l| l.shape.clone())
                .ok_or_else(|| bad("not in the target strategy".into()))?;
            let extents = [layers, experts];
            let extents = &extents[..at.len()];
            if let Some(((i, n), what)) = at
                .iter()
                .zip(extents)
                .zip(["layer", "expert"])
                .find(|((i, n), _)| i >= n)
            {
                return Err(bad(format!(
                    "{what} {i}, but the args give {n} (num_layers, num_experts)"
                )));
            }
            let (global_shape, offsets, sizes) = if at.is_empty() {
                (global_shape, piece.global.start.to_vec(), t.shape.clone())
            } else {
                if let Some(m) = module {
                    modules.insert(m, extents.to_vec());
                }
                let ones = vec![1; at.len()];
                let sizes = lead(&ones, &t.shape);
                stored.insert(&t.name, sizes.clone());
                (
                    lead(extents, &global_shape),
                    lead(&at, &piece.global.start),
                    sizes,
                )
            };
            match tensors.get(&key) {
                Some((d, s)) if (*d, s) != (t.dtype, &global_shape) => {
                    return Err(bad(format!(
                        "is {} {:?} here, {} {s:?} (stacked) in another layer or expert: a dist_ckpt stacks tensors of one shape",
                        crate::layout::strategy::dtype_name(t.dtype),
                        t.shape,
                        crate::layout::strategy::dtype_name(*d)
                    )))
                }
                Some(_) => {}
                None => {
                    tensors.insert(key.clone(), (t.dtype, global_shape));
                }
            }
            chunks.push(DistcpChunk {
                fqn: key,
                offsets,
                sizes,
            });
        }
        let shapes = if stored.is_empty() {
            None
        } else {
            Some(serde_json::to_string(&stored).map_err(|e| unsupported(e.to_string()))?)
        };
        rewrites.push((dir.join(&name), shapes));
        files.push((name, chunks));
    }
    let dist = Stacked {
        state,
        dir,
        sizes: (tp, pp),
        tensors,
        files,
        modules,
    };
    Ok((dist, rewrites))
}

/// Writes the files of a dist_ckpt beside the engine's `.distcp` files, into `out`
/// (the staged output): the linear layers' extra state, `.metadata`, `common.pt`,
/// `metadata.json` and the tracker.
///
/// # Errors
/// I/O errors; args that cannot be written back.
fn megatron_dist_finish(dist: &Stacked, out: &Path, saver: Saver) -> Result<()> {
    let dir = out.join(&dist.dir);
    // One `torch.save([None])` that every layer's extra state points at.
    let objects_path = dir.join(OBJECTS_FILE);
    let mut e = Emitter::new();
    e.empty_list().mark().none().appends();
    TorchWriter::create_with_pickle(&objects_path, &[], e.finish())?.finish()?;
    let len = std::fs::metadata(&objects_path)
        .map_err(|source| Error::Io {
            path: objects_path.clone(),
            source,
        })?
        .len();
    // One object per index of the module's stacked axes, keyed as megatron-core's
    // `ShardedObject.unique_key`: `shard_<offsets>_<shape>`, each dot-joined.
    let mut objects = Vec::new();
    for (m, extents) in &dist.modules {
        let shape = dotted(extents);
        let mut at = vec![0u64; extents.len()];
        'all: loop {
            objects.push(DistcpObject {
                fqn: format!("{m}._extra_state/shard_{}_{shape}", dotted(&at)),
                file: OBJECTS_FILE.into(),
                offset: 0,
                len,
            });
            for d in (0..at.len()).rev() {
                at[d] += 1;
                if at[d] < extents[d] {
                    continue 'all;
                }
                at[d] = 0;
            }
            break;
        }
    }
    let meta = metadata_bytes(&dist.tensors, &dist.files, &objects)?;
    write_file_atomic(&dir.join(crate::formats::distcp::METADATA_FILE), &meta)?;
    match saver {
        Saver::Bridge => return bridge_common(&dir),
        Saver::Nemo2 => return nemo_common(&dir),
        Saver::MegatronLm => {}
    }
    let (tp, pp) = dist.sizes;
    // GroupedMLP's experts whole on every TP rank (expert TP 1), as the legacy output
    // writes them and as ckpt reads them back; else unset, the TP size.
    let expert_tp = (dist.state.args.moe.grouped_gemm && tp > 1).then_some(1);
    let entries = megatron::extra_entries(
        &dist.state,
        (tp, pp, 1),
        expert_tp,
        None,
        megatron::DIST_FORMAT,
    )?;
    let mut e = Emitter::new();
    e.empty_dict().mark().raw(&entries).set_items();
    TorchWriter::create_with_pickle(&dir.join(COMMON_FILE), &[], e.finish())?.finish()?;
    write_file_atomic(&dir.join(CONFIG_FILE), CONFIG.as_bytes())?;
    write_file_atomic(
        &out.join(TRACKER_FILE),
        dist.state.tracker_text().as_bytes(),
    )
}

/// The iteration directory of a Megatron-Bridge import (step 0).
pub(crate) const BRIDGE_ITERATION_DIR: &str = "iter_0000000";

/// `common.pt` and `metadata.json` of a Megatron-Bridge import: `generate_state_dict`'s
/// entries that are not sharded (`checkpoint_version` 3.0, `iteration` 0: no optimizer,
/// scheduler, RNG or rerun state, `save_optim` and `save_rng` false) and, last,
/// `content_metadata` (`_build_sharded_state_dict_metadata(False, ...)` less its
/// process group).
fn bridge_common(dir: &Path) -> Result<()> {
    let mut e = Emitter::new();
    e.empty_dict().mark();
    e.str("checkpoint_version").float(3.0);
    e.str("iteration").int(0);
    e.str("content_metadata").empty_dict().mark();
    e.str("singleton_local_shards").bool(false);
    e.str("chained_optim_avoid_prefix").bool(true);
    e.set_items();
    e.set_items();
    TorchWriter::create_with_pickle(&dir.join(COMMON_FILE), &[], e.finish())?.finish()?;
    write_file_atomic(&dir.join(CONFIG_FILE), CONFIG.as_bytes())
}

/// The dist_ckpt's directory in a NeMo 2 checkpoint.
pub(crate) const NEMO_WEIGHTS_DIR: &str = "weights";

/// `common.pt` and `metadata.json` of a NeMo 2 import: what Lightning's
/// `dump_checkpoint` gives a trainer that never ran (`epoch` 0, `global_step` 0),
/// `MegatronStrategy.save_checkpoint`'s empty `state_dict` (the weights are the
/// sharded tensors) and emptied `optimizer_states` (`ckpt_save_optimizer=False`),
/// and `content_metadata`, the strategy's `sharded_state_dict_metadata`: the model's
/// default `MegatronOptimizerModule` asks for the distributed optimizer, whose
/// parallel save (`ckpt_parallel_save_optim`, default true) is
/// `fully_sharded_model_space`. Lightning's loop and callback state are not written:
/// NeMo's restore of an import (`RestoreConfig`, `selective_restore`) reads the
/// `state_dict` and `content_metadata` alone.
fn nemo_common(dir: &Path) -> Result<()> {
    let mut e = Emitter::new();
    e.empty_dict().mark();
    e.str("epoch").int(0);
    e.str("global_step").int(0);
    e.str("state_dict").empty_dict();
    e.str("optimizer_states").empty_dict();
    e.str("content_metadata").empty_dict().mark();
    e.str("distrib_optim_sharding_type")
        .str("fully_sharded_model_space");
    e.set_items();
    e.set_items();
    TorchWriter::create_with_pickle(&dir.join(COMMON_FILE), &[], e.finish())?.finish()?;
    write_file_atomic(&dir.join(CONFIG_FILE), CONFIG.as_bytes())
}

/// `[0, 3]` as `0.3`.
fn dotted(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_become_stacked_dist_keys() {
        assert_eq!(
            dist_key("decoder.layers.3.input_layernorm.weight"),
            (
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight".into(),
                vec![3]
            )
        );
        assert_eq!(
            dist_key("decoder.layers.0.pre_mlp_layernorm.bias"),
            (
                "decoder.layers.mlp.linear_fc1.layer_norm_bias".into(),
                vec![0]
            )
        );
        assert_eq!(
            dist_key("decoder.layers.12.self_attention.linear_qkv.weight"),
            (
                "decoder.layers.self_attention.linear_qkv.weight".into(),
                vec![12]
            )
        );
        assert_eq!(
            dist_key("decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"),
            (
                "decoder.layers.mlp.experts.experts.linear_fc2.weight".into(),
                vec![1, 5]
            )
        );
        assert_eq!(
            dist_key("decoder.layers.1.mlp.router.weight"),
            ("decoder.layers.mlp.router.weight".into(), vec![1])
        );
        assert_eq!(dotted(&[0, 3]), "0.3");
        assert_eq!(
            dist_key("decoder.final_layernorm.weight"),
            ("decoder.final_layernorm.weight".into(), vec![])
        );
        assert_eq!(
            linear_module("decoder.layers.self_attention.linear_proj.weight"),
            Some("decoder.layers.self_attention.linear_proj")
        );
        assert_eq!(
            linear_module("decoder.layers.self_attention.linear_proj.bias"),
            None
        );
        assert_eq!(
            linear_module("decoder.layers.self_attention.q_layernorm.weight"),
            None
        );
        assert_eq!(linear_module("output_layer.weight"), None);
    }
}
