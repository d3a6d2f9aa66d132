//! Writing a reshard's output as a Megatron legacy checkpoint (`reshard --format
//! megatron`): the plan's files become `iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`,
//! each a torch.save dict with the rank's stage-local state dict under `model` beside
//! `args` (new sizes), `checkpoint_version` and `iteration`, as Megatron's legacy
//! loader reads it; `latest_checkpointed_iteration.txt` names the iteration.
//!
//! [`MegatronLegacy`] is the writer: the plan of one file per rank of the target's
//! tensor x pipeline grid, rewritten for the format (renamed, split by expert-parallel
//! rank, cut to rows), which the engine (format-blind) then executes; the torch writer
//! nests the tensors as the plan's metadata asks.

use super::ranks::{finish_dir, rank_plan, RankFiles, RankOptions, Ranks};
use super::{TargetLayout, Writer};
use crate::checkpoint::{Checkpoint, HfTarget};
use crate::error::{Error, Result};
use crate::formats::megatron::{self, RankRng, TRACKER_FILE};
use crate::formats::output::write_file_atomic;
use crate::formats::torch_write::{hex, WRAP_EXTRA, WRAP_KEY, WRAP_STORAGES};
use crate::layout::plan::{CopyPlan, TensorPlan};
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use crate::layout::Placement;
use std::path::{Path, PathBuf};

/// `reshard --format megatron`: a Megatron legacy checkpoint (from a Megatron legacy
/// source, whose args it carries, or a Hugging Face model imported by its family's
/// table): `OUT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt` and
/// `OUT/latest_checkpointed_iteration.txt`, with `strategy.json` beside.
#[derive(Clone, Debug)]
pub struct MegatronLegacy {
    /// The target's tensor x pipeline ranks, every tensor on the stage Megatron's layout
    /// gives it.
    strategy: Strategy,
    /// A mixture of experts' expert layout (`None`: the source's).
    experts: Option<ExpertLayout>,
}

/// Refuses a write of some of a Megatron output's ranks, and a compression.
pub(crate) fn every_rank_uncompressed(options: &RankOptions) -> Result<()> {
    if options.ranks != Ranks::All {
        return Err(Error::Unsupported {
            problem: "--format megatron and megatron-dist write every rank at once (no --rank)"
                .into(),
        });
    }
    options.uncompressed()
}

/// The target of a Megatron output: `source` seen in Megatron's names (a Hugging Face
/// model imported by its family's table), then the strategy `target` derives; for a
/// mixture of experts, of the tensor x pipeline ranks megatron-core's rules give the
/// grid asked, with the expert layout its files are split by when written.
///
/// # Errors
/// A source Megatron's names do not fit; what [`megatron_moe_strategy`] and `target`
/// refuse.
pub(crate) fn megatron_target(
    source: &mut Checkpoint,
    target: &dyn TargetLayout,
) -> Result<(Strategy, Option<ExpertLayout>)> {
    if !source.is_megatron() {
        // A Hugging Face model: Megatron's tensors by its family's table.
        source.megatron_import(&HfTarget::default())?;
    }
    let moe = match target.grid() {
        Some(grid) => megatron_moe_strategy(source, &grid)?,
        None => None,
    };
    Ok(match moe {
        Some((s, experts)) => (target.strategy(source, Some(s))?, Some(experts)),
        None => (target.strategy(source, None)?, None),
    })
}

impl MegatronLegacy {
    /// The writer of the Megatron legacy checkpoint `target` asks for `source`.
    ///
    /// # Errors
    /// Some ranks or a compression asked for; a source Megatron's names do not fit; a
    /// grid or target strategy Megatron's layout cannot take (see [`TargetLayout`]).
    pub fn new(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
    ) -> Result<MegatronLegacy> {
        every_rank_uncompressed(&options)?;
        let (mut strategy, experts) = megatron_target(source, target)?;
        megatron_restage(source, &mut strategy)?;
        Ok(MegatronLegacy { strategy, experts })
    }
}

impl Writer for MegatronLegacy {
    fn name(&self) -> &'static str {
        "megatron"
    }

    fn plan(&self, source: &Checkpoint, _: &Selection) -> Result<CopyPlan> {
        // Every Megatron rank file holds its whole state dict, replicas included; named
        // by tensor and pipeline rank by the rewrite.
        let files = RankFiles {
            path: |r| PathBuf::from(format!("rank_{r}.pt")),
            one_box: false,
            once: false,
        };
        let mut plan = rank_plan(source, &self.strategy, Ranks::All, true, files)?;
        let ranks = Ranks::All.list(self.strategy.mesh.world_size())?;
        megatron_legacy_plan(source, &self.strategy, &ranks, &mut plan, self.experts)?;
        Ok(plan)
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn strategy(&self) -> Option<&Strategy> {
        Some(&self.strategy)
    }

    fn finish(&self, source: &Checkpoint, _: &Selection, _: &CopyPlan, dir: &Path) -> Result<()> {
        finish_dir(dir, &self.strategy.to_json(), source)?;
        let (path, text) = megatron_tracker(source)?;
        write_file_atomic(&dir.join(path), &text)
    }
}

/// The tensor-parallel axis and the TP and PP sizes of a Megatron target (`--format
/// {format}`): a mesh of one tensor-parallel axis and an optional pipeline axis, checked
/// against megatron-core's rules for the model `state`'s args describe.
///
/// # Errors
/// Another mesh; heads or query groups that do not fit the TP size; a split into
/// unequal parts.
pub(crate) fn megatron_grid(
    state: &megatron::SourceState,
    strategy: &Strategy,
    format: &str,
) -> Result<(usize, u64, u64)> {
    let unsupported = |problem: String| Error::Unsupported { problem };
    let mesh = &strategy.mesh;
    let pipe = mesh.pipeline();
    let tp_axes: Vec<usize> = (0..mesh.axes().len())
        .filter(|&i| Some(i) != pipe)
        .collect();
    let [tp_axis] = tp_axes[..] else {
        return Err(unsupported(format!(
            "--format {format} needs a mesh of one tensor-parallel axis and an optional pipeline axis, not {mesh}"
        )));
    };
    let tp = mesh.axes()[tp_axis].size;
    let pp = pipe.map_or(1, |p| mesh.axes()[p].size);
    // megatron-core's TransformerConfig: the attention heads divide by the TP size, and
    // the query groups are a multiple or a divisor of it (with fewer groups than ranks,
    // each rank's part of the fused QKV is all-gathered back into whole groups).
    if let Some(h) = state.args.heads.filter(|h| !h.is_multiple_of(tp)) {
        return Err(unsupported(format!(
            "num_attention_heads {h} does not divide by tensor parallel {tp} (megatron-core needs whole heads on each rank)"
        )));
    }
    if let Some(g) = state
        .args
        .query_groups
        .filter(|g| *g > 0 && !g.is_multiple_of(tp) && !tp.is_multiple_of(*g))
    {
        return Err(unsupported(format!(
            "num_query_groups {g} is neither a multiple nor a divisor of tensor parallel {tp} (megatron-core needs one or the other)"
        )));
    }
    // Megatron splits into equal parts; torch.chunk's uneven ones would not load.
    for (name, l) in &strategy.tensors {
        if let Placement::Shard { dim, blocks, .. } = l.placements[tp_axis] {
            let parts = tp.saturating_mul(blocks);
            if l.shape.get(dim).is_some_and(|&n| n % parts != 0) {
                return Err(unsupported(format!(
                    "tensor `{name}`: dim {dim} of {:?} does not split into {parts} equal parts for tensor parallel {tp} (Megatron needs equal parts: padded_vocab_size, num_query_groups, ffn_hidden_size divisible by it)",
                    l.shape
                )));
            }
        }
    }
    Ok((tp_axis, tp, pp))
}

/// The expert layout of a Megatron mixture-of-experts output: its expert-parallel size,
/// and whether every expert is whole on each tensor-parallel rank (expert TP 1) rather
/// than split like the dense layers (expert TP = TP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExpertLayout {
    /// `expert_model_parallel_size`.
    pub(crate) ep: u64,
    /// `expert_tensor_parallel_size` 1 (else unset: the tensor-parallel size).
    pub(crate) whole: bool,
}

impl ExpertLayout {
    /// The source's: its EP size, and whole experts where its args say an expert TP
    /// below TP (only 1 and TP are written) or its experts are GroupedMLP's (written
    /// whole only). A source whose
    /// expert TP is its TP (Megatron-LM's default, recorded so) keeps experts split like
    /// the dense layers at the new TP, as Megatron-LM defaults it there.
    fn of(args: &megatron::Args) -> ExpertLayout {
        ExpertLayout {
            ep: args.moe.ep,
            whole: args.moe.grouped_gemm || args.expert_tp() != args.tp,
        }
    }
}

/// Rewrites `plan` (one file per rank of `ranks`, in order, on `strategy`'s mesh) into
/// Megatron's legacy layout ([`megatron_tracker`] gives the file to write beside it),
/// with the experts laid out by `experts` (`None`: the source's layout): each `(tp, pp)`
/// file of the plan becomes one file per expert-parallel rank (`mp_rank_TT[_PPP]_EEE`,
/// those a save of that layout writes), each with the dense tensors (Megatron's every
/// rank loads them) and its own experts, named by their local index.
///
/// # Errors
/// A source that is not a Megatron legacy checkpoint (its args are needed); a target mesh
/// that is not a pipeline axis and one tensor-parallel axis; a split Megatron's loader
/// cannot take (uneven pieces); a tensor on another stage than Megatron's layout puts it;
/// experts that do not divide by `ep`; `ep` for a model without experts.
pub(crate) fn megatron_legacy_plan(
    source: &Checkpoint,
    strategy: &Strategy,
    ranks: &[u64],
    plan: &mut CopyPlan,
    experts: Option<ExpertLayout>,
) -> Result<()> {
    let unsupported = |problem: String| Error::Unsupported { problem };
    let state = source.megatron_state()?;
    let mesh = &strategy.mesh;
    let pipe = mesh.pipeline();
    let (tp_axis, tp, pp) = megatron_grid(&state, strategy, "megatron")?;
    // Each rank's RNG state goes to the same rank of the same grid; Megatron ignores it
    // on another grid, so there none is written (and args say so).
    let layout = experts.unwrap_or_else(|| ExpertLayout::of(&state.args));
    let ep = layout.ep;
    let out_etp = if layout.whole { 1 } else { tp };
    let per = match state.args.moe.experts {
        None if ep > 1 => {
            return Err(unsupported(format!(
                "expert parallel {ep}: the model has no experts (args.num_experts)"
            )))
        }
        None => 1,
        Some(e) if ep == 0 || e % ep != 0 => {
            return Err(unsupported(format!(
                "{e} experts do not divide into {ep} expert-parallel ranks"
            )))
        }
        Some(e) => e / ep,
    };
    let moe = &state.args.moe;
    let same_etp = moe.experts.is_none() || state.args.expert_tp() == out_etp;
    let same_grid = (state.args.tp, state.args.pp, state.args.moe.ep) == (tp, pp, ep)
        && same_etp
        && source.imported.is_none();
    // Each file's (tp, pp) coordinates; named and cut to its stage.
    let mut at = Vec::with_capacity(ranks.len());
    for (f, &r) in plan.files.iter_mut().zip(ranks) {
        let c = mesh.coords(r);
        let (t, s) = (c[tp_axis], pipe.map_or(0, |p| c[p]));
        at.push((t, s));
        f.path = state.rank_path(t, s, pp);
        // Tied embeddings on one stage: megatron-core's GPTModel has no output layer
        // weight then (the last stage of several keeps a copy of the embedding).
        if pp == 1 && state.args.model.untied == Some(false) {
            f.tensors.retain(|t| t.target.name != "output_layer.weight");
        }
        for tp_plan in &mut f.tensors {
            let name = &mut tp_plan.target.name;
            let (stage, local) =
                megatron::stage_name(name, &state.args, pp).map_err(|p| Error::InvalidTensor {
                    tensor: name.clone(),
                    problem: p,
                })?;
            if stage != s {
                return Err(Error::InvalidTensor {
                    tensor: name.clone(),
                    problem: format!(
                        "the target strategy puts it on pipeline stage {s}, Megatron's layout of {pp} stages on stage {stage}"
                    ),
                });
            }
            *name = local;
        }
    }
    // One file per expert-parallel rank: the dense tensors in each, the experts where
    // they live. Megatron's save writes the directories of its rank rule: with whole
    // experts (expert TP 1) under TP > 1, not every (tp, ep) pair.
    let dirs = megatron::RankDirs {
        tp,
        ep,
        etp: out_etp,
    };
    let files = std::mem::take(&mut plan.files);
    for (f, (t, s)) in files.into_iter().zip(at) {
        for e in (0..ep).filter(|&e| dirs.written(t, e)) {
            let mut g = f.clone();
            if ep > 1 {
                g.path = megatron::expert_rank_path(&f.path, e);
                g.tensors.retain_mut(|t| {
                    match megatron::local_expert_name(&t.target.name, e, per) {
                        Some(local) => {
                            t.target.name = local;
                            true
                        }
                        None => false,
                    }
                });
                for t in &mut g.tensors {
                    let split = megatron::grouped_split(&t.target.name, &state.args, ep, e)
                        .map_err(|problem| Error::InvalidTensor {
                            tensor: t.target.name.clone(),
                            problem,
                        })?;
                    if let Some(split) = split {
                        let rows = t.rows(split.rows.clone());
                        *t = TensorPlan {
                            stored_shape: (split.stored != rows.target.shape)
                                .then_some(split.stored),
                            ..rows
                        };
                    }
                }
            }
            // The RNG state of the same rank of the same grid (the reader numbers
            // Megatron's ranks (pp x EP + ep) x TP + tp).
            let rng = if same_grid {
                source_rank_rng(source, (s * ep + e) * tp + t)?
            } else {
                None
            };
            let extra = megatron::extra_entries(
                &state,
                (tp, pp, ep),
                layout.whole.then_some(1),
                rng.as_ref().map(|r| (r, g.tensors.len())),
                megatron::LEGACY_FORMAT,
            )?;
            g.metadata = [
                (WRAP_KEY.to_string(), "model".to_string()),
                (WRAP_EXTRA.to_string(), hex(&extra)),
            ]
            .into();
            if let Some(r) = rng.as_ref().filter(|r| !r.storages().is_empty()) {
                let list: Vec<String> = r.storages().iter().map(|b| hex(b)).collect();
                g.metadata.insert(WRAP_STORAGES.to_string(), list.join(","));
            }
            plan.files.push(g);
        }
    }
    Ok(())
}

/// The target of a mixture-of-experts Megatron output on `mesh` (axes `tp`, `pp`, `ep`
/// and `etp`, 1 or the TP size; those not given keep the source's sizes, and its
/// [`ExpertLayout`]): the strategy of its `tp` x `pp` ranks and the expert layout (the
/// split by experts is made by [`megatron_legacy_plan`]); `None` for a dense model,
/// whose source strategy is resized as it is.
///
/// # Errors
/// A source that is not a Megatron checkpoint; an axis other than `tp`, `pp`, `ep` and
/// `etp`; an `etp` neither 1 nor the TP size (or not 1 for GroupedMLP); a tensor no rule
/// places.
pub(crate) fn megatron_moe_strategy(
    source: &Checkpoint,
    mesh: &[(String, u64)],
) -> Result<Option<(Strategy, ExpertLayout)>> {
    let state = source.megatron_state()?;
    if state.args.moe.experts.is_none() {
        return Ok(None);
    }
    let size = |axis: &str, default: u64| -> Result<u64> {
        Ok(mesh
            .iter()
            .find(|(n, _)| n == axis)
            .map_or(default, |(_, s)| *s))
    };
    let invalid = |problem: String| Error::InvalidMesh {
        mesh: mesh
            .iter()
            .map(|(n, s)| format!("{n}={s}"))
            .collect::<Vec<_>>()
            .join(","),
        problem,
    };
    if let Some((n, _)) = mesh
        .iter()
        .find(|(n, _)| !["tp", "pp", "ep", "etp"].contains(&n.as_str()))
    {
        return Err(invalid(format!(
            "axis `{n}`: a Megatron mixture of experts takes tp, pp, ep and etp"
        )));
    }
    let (tp, pp, ep) = (
        size("tp", state.args.tp)?,
        size("pp", state.args.pp)?,
        size("ep", state.args.moe.ep)?,
    );
    let whole = match mesh.iter().find(|(n, _)| n == "etp").map(|(_, e)| *e) {
        None => ExpertLayout::of(&state.args).whole,
        Some(1) => true,
        Some(e) if e == tp && !state.args.moe.grouped_gemm => false,
        Some(e) if state.args.moe.grouped_gemm => {
            return Err(invalid(format!(
                "etp={e}: GroupedMLP's experts are written whole (etp=1)"
            )))
        }
        Some(e) => {
            return Err(invalid(format!(
                "etp={e}: the expert tensor-parallel size is written as 1 (whole experts) or the tensor-parallel size {tp}"
            )))
        }
    };
    let list: Vec<(String, crate::layout::Dtype, Vec<u64>)> = source
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.dtype, t.shape.clone()))
        .collect();
    let Some(one) = megatron::moe_strategy(&state, &list)? else {
        return Ok(None);
    };
    let mesh = if pp > 1 {
        crate::layout::mesh::Mesh::new(vec![
            (megatron::PP_AXIS.into(), pp),
            (megatron::TP_AXIS.into(), tp),
        ])?
        .with_pipeline(megatron::PP_AXIS)?
    } else {
        crate::layout::mesh::Mesh::new(vec![(megatron::TP_AXIS.into(), tp)])?
    };
    let mut s = Strategy::new(mesh);
    for (name, mut l) in one.tensors {
        if pp == 1 {
            // No pipeline axis: the tensor-parallel placement alone.
            l.placements.remove(0);
            l.stage = None;
        }
        if whole && megatron::is_expert_name(&name) {
            // Expert TP 1: every expert whole on each tensor-parallel rank.
            for p in &mut l.placements {
                *p = Placement::Replicate;
            }
        }
        s.insert(name, l)?;
    }
    Ok(Some((s, ExpertLayout { ep, whole })))
}

/// The RNG state of the source's rank `rank` (`pp * tp + tp_rank`, as the reader
/// numbers Megatron's ranks), when it saved one.
fn source_rank_rng(source: &Checkpoint, rank: u64) -> Result<Option<RankRng>> {
    let rank = rank.to_string();
    let file = source
        .files
        .iter()
        .find(|f| {
            let m = f.metadata();
            m.get("format").map(String::as_str) == Some("megatron") && m.get("rank") == Some(&rank)
        })
        .ok_or_else(|| Error::Unsupported {
            problem: format!("the source has no file of rank {rank}"),
        })?;
    RankRng::read(file.path())
}

/// The tracker file of a Megatron legacy output made from `source` (path relative to
/// the output, content): `latest_checkpointed_iteration.txt` holding the iteration.
///
/// # Errors
/// A source that is not a Megatron legacy checkpoint.
pub(crate) fn megatron_tracker(source: &Checkpoint) -> Result<(PathBuf, Vec<u8>)> {
    let state = source.megatron_state()?;
    Ok((
        PathBuf::from(TRACKER_FILE),
        state.tracker_text().into_bytes(),
    ))
}

/// Puts every tensor of a target strategy on the pipeline stage Megatron's layout of
/// the target's stages gives it (uniform stages: layer `g` on stage `g / (layers /
/// stages)`, embeddings first, final norm and output layer last), so that `--mesh
/// pp=4,...` on a 2-stage source regroups the layers as Megatron would.
///
/// # Errors
/// A source that is not a Megatron legacy checkpoint; a tensor no rule places; layers
/// that do not split evenly into the stages.
pub(crate) fn megatron_restage(source: &Checkpoint, strategy: &mut Strategy) -> Result<()> {
    let Some(p) = strategy.mesh.pipeline() else {
        return Ok(());
    };
    let pp = strategy.mesh.axes()[p].size;
    let state = source.megatron_state()?;
    for (name, l) in &mut strategy.tensors {
        let (stage, _) = megatron::stage_name(name, &state.args, pp).map_err(|problem| {
            Error::InvalidTensor {
                tensor: name.clone(),
                problem,
            }
        })?;
        l.stage = Some(stage);
        l.validate(name, &strategy.mesh)?;
    }
    Ok(())
}
