//! DeepSpeed ZeRO-1/2/3 checkpoints (`engine.save_checkpoint`): a tag directory
//! (`global_step<N>/`, named by `latest` beside it) of `torch.save` files, read as the
//! fp32 master weights `zero_to_fp32.py` rebuilds, and their Adam moments, without
//! loading any of them: every parameter is a set of flat ranges inside the ranks'
//! flat fp32 partitions ([`crate::layout::flat`]), each of which is a few boxes of contiguous
//! bytes in a mapped file. The layout is described in docs/formats.md ("DeepSpeed").
//!
//! What is read, following deepspeed/utils/zero_to_fp32.py (0.19.8):
//! - weights: ZeRO-1/2 concatenate each group's parameters (in `param_shapes` order,
//!   with `param_alignment_paddings` after each), cut the result into one partition per
//!   data-parallel rank and store each rank's part in `single_partition_of_fp32_groups`
//!   without its padding; ZeRO-3 cuts each parameter alone into `ceil(numel / dp)`
//!   elements (the last rank's part padded) and stores a rank's parts one after the
//!   other in `fp32_flat_groups`;
//! - frozen parameters (`frozen_param_shapes`): ZeRO-2 keeps them whole in
//!   `frozen_param_fragments`, ZeRO-3 partitioned like trainable ones, in each rank's
//!   model-states file, in the model's dtype (which `zero_to_fp32` keeps);
//! - buffers (`buffer_names`, from `module`), and tied parameters (`shared_params`: the
//!   same tensor under a second name);
//! - the moments `optim.<param>.exp_avg` / `optim.<param>.exp_avg_sq`, laid out as the
//!   weights (ZeRO-1/2: `base_optimizer_state`; ZeRO-3: `optimizer_state_dict`).

use super::pickle::Value;
use super::torch_save::{self, describe, locate_value, ArchiveIndex};
use super::{map_file, FileFormat, TensorEntry, TensorFile};
use crate::error::{overflow, Error, Result};
use crate::layout::flat::{numel, FlatRange};
use crate::layout::region::Region;
use crate::layout::split_rules::Split;
use crate::layout::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A DeepSpeed tag directory, read: the files with their pieces, and what the pieces
/// make.
#[derive(Debug)]
pub(crate) struct DeepSpeed {
    /// One file per optimizer/model-states file that holds a piece.
    pub(crate) files: Vec<TensorFile>,
    /// Every tensor's dtype and global shape.
    pub(crate) shapes: BTreeMap<String, (Dtype, Vec<u64>)>,
    /// `(name, same_as)`: tied parameters, the same tensor under a second name.
    pub(crate) aliases: Vec<(String, String)>,
    /// What the reader could not carry or check, said aloud.
    pub(crate) notes: Vec<String>,
}

/// Metadata key of a file's data-parallel rank (the checkpoint's rank of the file).
pub(crate) const DP_RANK: &str = "deepspeed.dp_rank";

/// Metadata key of a tensor-parallel checkpoint's tensor-parallel size (absent when 1).
pub(crate) const TP_SIZE: &str = "deepspeed.mp_world_size";

/// Which kind of file a tag directory's entry is, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// `[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`
    Optim { dp: u64, mp: u64 },
    /// `zero_pp_rank_D_mp_rank_XX_model_states.pt` (ZeRO-3)
    RankModel { dp: u64, mp: u64 },
    /// `mp_rank_XX_model_states.pt` (ZeRO-1/2)
    Model { mp: u64 },
    /// `layer_<l>_expert_<g>_mp_rank_XX_model_states.pt`: one expert's weights, global
    /// id (docs/moe.md).
    ExpertWeights { layer: u64, expert: u64 },
    /// `expp_rank_<e>_mp_rank_XX_optim_states.pt`: ZeRO-0's optimizer of an
    /// expert-parallel rank.
    ExpertOptim,
    /// `expert_<g>_mp_rank_XX_...`: experts in DeepSpeed's older naming (no layer).
    OldExpert,
}

fn role(name: &str) -> Option<Role> {
    if name.contains("expp_rank_") {
        return name.ends_with(".pt").then_some(Role::ExpertOptim);
    }
    if let Some(rest) = name
        .strip_prefix("layer_")
        .filter(|n| n.ends_with("_model_states.pt"))
    {
        let (layer, rest) = rest.split_once("_expert_")?;
        let (expert, _) = rest.split_once('_')?;
        return Some(Role::ExpertWeights {
            layer: layer.parse().ok()?,
            expert: expert.parse().ok()?,
        });
    }
    if name.contains("expert_") {
        // The older naming without the layer (`expert_<g>_mp_rank_XX_...`).
        return name.ends_with(".pt").then_some(Role::OldExpert);
    }
    let num = |s: &str| s.parse::<u64>().ok();
    if let Some(rest) = name.strip_suffix("_optim_states.pt") {
        let rest = rest.strip_prefix("bf16_").unwrap_or(rest);
        let (dp, mp) = rest
            .strip_prefix("zero_pp_rank_")?
            .split_once("_mp_rank_")?;
        return Some(Role::Optim {
            dp: num(dp)?,
            mp: num(mp)?,
        });
    }
    let rest = name.strip_suffix("_model_states.pt")?;
    if let Some(r) = rest.strip_prefix("zero_pp_rank_") {
        let (dp, mp) = r.split_once("_mp_rank_")?;
        return Some(Role::RankModel {
            dp: num(dp)?,
            mp: num(mp)?,
        });
    }
    Some(Role::Model {
        mp: num(rest.strip_prefix("mp_rank_")?)?,
    })
}

/// Whether `dir` is a DeepSpeed tag directory: model states and optimizer states
/// named as `engine.save_checkpoint` names them.
pub(crate) fn looks_like(dir: &Path) -> bool {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    let (mut model, mut optim) = (false, false);
    for e in rd.flatten() {
        match e.file_name().to_str().and_then(role) {
            Some(Role::Optim { .. } | Role::ExpertOptim) => optim = true,
            Some(Role::Model { .. } | Role::RankModel { .. }) => model = true,
            _ => {}
        }
    }
    model && optim
}

fn err(path: &Path, problem: impl Into<String>) -> Error {
    Error::InvalidDeepSpeed {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// One parsed `torch.save` file, still mapped.
pub(crate) struct PtFile {
    pub(crate) path: PathBuf,
    pub(crate) map: Option<crate::formats::Mapped>,
    pub(crate) archive: ArchiveIndex,
    pub(crate) root: Value,
    entries: Vec<TensorEntry>,
    /// The flat range (`start`, `len`) each entry was cut from, unless the range is
    /// the whole tensor (a box like any other then: buffers, frozen and small
    /// parameters that one partition holds whole).
    origins: Vec<Option<(u64, u64)>>,
    /// With tensor parallelism: where this rank's shards lie in the global tensors.
    tp: Option<Arc<TpPlace>>,
}

impl PtFile {
    pub(crate) fn open(path: &Path) -> Result<PtFile> {
        let map = map_file(path)?;
        let all: &[u8] = map.as_deref().unwrap_or(&[]);
        let (archive, root) = torch_save::open_archive(all).map_err(|e| e.with_path(path))?;
        Ok(PtFile {
            path: path.to_path_buf(),
            map,
            archive,
            root,
            entries: Vec::new(),
            origins: Vec::new(),
            tp: None,
        })
    }

    /// The value at a path of string keys from the root, or an error naming the path
    /// and what was found instead.
    pub(crate) fn at(&self, keys: &[&str]) -> Result<&Value> {
        let mut v = &self.root;
        for (i, k) in keys.iter().enumerate() {
            v = v.get(k).ok_or_else(|| {
                let parent = keys[..i].join(".");
                err(
                    &self.path,
                    if dict_items(v).is_some() {
                        format!("no `{k}` in `{parent}`")
                    } else {
                        format!("`{parent}` is {}, not a dict", describe(v))
                    },
                )
            })?;
        }
        Ok(v)
    }

    pub(crate) fn opt_at(&self, keys: &[&str]) -> Option<&Value> {
        keys.iter().try_fold(&self.root, |v, k| v.get(k))
    }

    /// Locates the tensor `v` (found under `what`); `name` is the tensor it is a
    /// piece of, for messages.
    pub(crate) fn tensor(&self, v: &Value, what: &str) -> Result<TensorEntry> {
        locate_value(&self.archive, what, v).map_err(|e| e.with_path(&self.path))
    }

    /// Adds the piece `range` of tensor `name` (global `shape`), whose elements are
    /// contiguous in this file from element `at` of `src` on.
    fn piece(
        &mut self,
        name: &str,
        shape: &[u64],
        range: FlatRange,
        src: &TensorEntry,
        at: u64,
    ) -> Result<()> {
        let elem = (src.dtype.bitsize() / 8) as u64;
        let src_numel = numel(&src.shape)?;
        let end = at.checked_add(range.len).ok_or_else(|| overflow(name))?;
        if end > src_numel {
            return Err(err(
                &self.path,
                format!(
                    "tensor `{name}`: its elements {range} would lie at {at}..{end} of `{}`, which holds {src_numel}: the partition is short (padding or data missing)",
                    src.name
                ),
            ));
        }
        // A range of the whole tensor is a box like any other.
        let whole = range.start == 0 && range.len == numel(shape)?;
        for b in range.boxes(shape).map_err(|e| e.with_path(&self.path))? {
            // A tensor-parallel shard's box lies elsewhere in the global tensor (in
            // several boxes when it crosses sub-parameter blocks), and is no longer a
            // flat range of it.
            let (placed, origin) = match &self.tp {
                None => (
                    vec![(b.region, 0)],
                    (!whole).then_some((range.start, range.len)),
                ),
                Some(tp) => match tp.place(name, shape, &b.region) {
                    Ok(Some(v)) => (v, None),
                    Ok(None) => continue,
                    Err(problem) => return Err(err(&self.path, problem)),
                },
            };
            for (region, within) in placed {
                let first = at
                    .checked_add(b.offset)
                    .and_then(|x| x.checked_add(within))
                    .and_then(|x| x.checked_mul(elem))
                    .and_then(|x| x.checked_add(src.start))
                    .ok_or_else(|| overflow(name))?;
                let len = region.numel() * elem;
                self.entries.push(TensorEntry {
                    name: name.to_string(),
                    dtype: src.dtype,
                    shape: region.shape.into_vec(),
                    start: first,
                    end: first + len,
                    offsets: Some(region.start.into_vec()),
                });
                self.origins.push(origin);
            }
        }
        Ok(())
    }

    fn finish(self, stage: u64) -> Result<Option<TensorFile>> {
        if self.entries.is_empty() {
            return Ok(None);
        }
        let mut metadata = BTreeMap::from([
            ("format".to_string(), "deepspeed".to_string()),
            ("deepspeed.zero_stage".to_string(), stage.to_string()),
        ]);
        // The data-parallel rank whose partition the file holds (pictures label the
        // file by it); ZeRO-1/2's model states belong to no one rank. With tensor
        // parallelism, the process rank of Megatron's order (tensor-parallel fastest),
        // so that the ranks' files are told apart.
        if let Some(tp) = &self.tp {
            metadata.insert(TP_SIZE.to_string(), tp.size().to_string());
        }
        if let Some(Role::Optim { dp, mp } | Role::RankModel { dp, mp }) = self
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(role)
        {
            let rank = match &self.tp {
                Some(tp) => dp.checked_mul(tp.size()).and_then(|r| r.checked_add(mp)),
                None => Some(dp),
            };
            if let Some(rank) = rank {
                metadata.insert(DP_RANK.to_string(), rank.to_string());
            }
        }
        let mut f = TensorFile::from_parts(
            &self.path,
            self.map,
            FileFormat::DeepSpeed,
            self.entries,
            metadata,
        )?;
        // Each entry is a box of a flat range: the range is what the rank holds.
        for (i, origin) in self.origins.into_iter().enumerate() {
            if let Some((start, len)) = origin {
                f.set_flat(i, start, len);
            }
        }
        Ok(Some(f))
    }
}

/// A mixture of experts trained without ZeRO (stage 0): the weights are whole in the
/// model states' `module` (the dense parameters and buffers) and in the
/// `layer_<l>_expert_<g>` files (each expert's, under its global id); every expert
/// `num_experts` names must have its file. The optimizer state (`expp_rank_*` files,
/// and the model states' own `optimizer`) is torch's plain `state_dict`, which names
/// parameters by position only: not carried, and said.
///
/// # Errors
/// Tensor parallelism; an expert file missing or an expert's tensor also in `module`;
/// damaged files.
fn read_zero0(
    model: &Path,
    experts: &BTreeMap<(u64, u64), PathBuf>,
    expert_optim: &[PathBuf],
    tensor_parallel: bool,
) -> Result<DeepSpeed> {
    if tensor_parallel {
        return Err(err(
            model,
            "a mixture of experts without ZeRO (stage 0) with tensor parallelism is not read",
        ));
    }
    let mut shapes: BTreeMap<String, (Dtype, Vec<u64>)> = BTreeMap::new();
    let mut whole = |f: &mut PtFile, name: &str, v: &Value| -> Result<()> {
        let entry = f.tensor(v, name)?;
        let len = numel(&entry.shape)?;
        if shapes
            .insert(name.to_string(), (entry.dtype, entry.shape.clone()))
            .is_some()
        {
            return Err(err(
                &f.path,
                format!("tensor `{name}` is also in another file"),
            ));
        }
        f.piece(name, &entry.shape, FlatRange { start: 0, len }, &entry, 0)
    };
    // A dict's entries under string keys (a state dict's tensors by name).
    let named = |v: &Value| -> Vec<(String, Value)> {
        dict_items(v)
            .unwrap_or(&[])
            .iter()
            .filter_map(|(k, v)| match k {
                Value::Str(k) => Some((k.clone(), v.clone())),
                _ => None,
            })
            .collect()
    };
    let mut m = PtFile::open(model)?;
    for (name, v) in &named(m.at(&["module"])?) {
        whole(&mut m, name, v)?;
    }
    let num_experts: Vec<u64> = m
        .opt_at(&["num_experts"])
        .and_then(Value::items)
        .map(|l| l.iter().filter_map(int).collect())
        .unwrap_or_default();
    for (l, &n) in num_experts.iter().enumerate() {
        for g in 0..n {
            if !experts.contains_key(&(l as u64, g)) {
                return Err(err(
                    &model
                        .with_file_name(format!("layer_{l}_expert_{g}_mp_rank_00_model_states.pt")),
                    format!("missing: MoE layer {l}'s expert {g} of {n} (num_experts)"),
                ));
            }
        }
    }
    let mut files = vec![];
    for p in experts.values() {
        let mut f = PtFile::open(p)?;
        for (name, v) in &named(&f.root) {
            whole(&mut f, name, v)?;
        }
        files.extend(f.finish(0)?);
    }
    let dtypes: std::collections::BTreeSet<String> = shapes
        .values()
        .map(|(d, _)| crate::layout::strategy::dtype_name(*d))
        .collect();
    files.insert(
        0,
        m.finish(0)?
            .ok_or_else(|| err(model, "`module` holds no tensor"))?,
    );
    let notes = vec![format!(
        "{}: trained without ZeRO (stage 0): the weights are read whole from `module` and the {} expert files, in the model's dtype ({}); the optimizer state ({} expp_rank_* file(s) and the model states' `optimizer`) names parameters by position only and is not carried",
        model.display(),
        experts.len(),
        dtypes.into_iter().collect::<Vec<_>>().join(", "),
        expert_optim.len()
    )];
    Ok(DeepSpeed {
        files,
        shapes,
        aliases: vec![],
        notes,
    })
}

pub(crate) fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        // `ZeroStageEnum(2)`: an inert record of the enum and its value.
        Value::Call { args, .. } => args.items().and_then(|a| a.first()).and_then(int),
        _ => None,
    }
}

/// `torch.Size((11, 6))` (a record), or a plain tuple/list of integers.
fn size(v: &Value) -> Option<Vec<u64>> {
    match v {
        Value::Tuple(x) | Value::List(x) => x.iter().map(int).collect(),
        Value::Call { args, .. } => args.items().and_then(|a| a.first()).and_then(size),
        _ => None,
    }
}

pub(crate) fn dict_items(v: &Value) -> Option<&[(Value, Value)]> {
    match v {
        Value::Dict(kv) => Some(kv),
        Value::Build { object, .. } => dict_items(object),
        _ => None,
    }
}

/// `(name, shape)` pairs of a dict of sizes, in order.
pub(crate) fn shapes_of(f: &PtFile, v: &Value, what: &str) -> Result<Vec<(String, Vec<u64>)>> {
    let kv = dict_items(v)
        .ok_or_else(|| err(&f.path, format!("`{what}` is {}, not a dict", describe(v))))?;
    kv.iter()
        .map(|(k, s)| {
            let Value::Str(name) = k else {
                return Err(err(&f.path, format!("`{what}`: a key that is not a name")));
            };
            let shape = size(s).ok_or_else(|| {
                err(
                    &f.path,
                    format!(
                        "tensor `{name}`: its shape in `{what}` is {}, not a torch.Size",
                        describe(s)
                    ),
                )
            })?;
            Ok((name.clone(), shape))
        })
        .collect()
}

pub(crate) fn list<'a>(f: &PtFile, v: &'a Value, what: &str) -> Result<&'a [Value]> {
    v.items()
        .ok_or_else(|| err(&f.path, format!("`{what}` is {}, not a list", describe(v))))
}

/// Reads a DeepSpeed tag directory.
///
/// # Errors
/// [`Error::InvalidDeepSpeed`] naming the file (and tensor): a missing data-parallel
/// rank, partitions that do not add up to the parameters, a partition shorter than
/// its padding says, a truncated or damaged `.pt`, experts (not read yet), a
/// tensor-parallel checkpoint whose `universal_checkpoint_info` does not place every
/// parameter.
pub(crate) fn read(dir: &Path) -> Result<DeepSpeed> {
    // The writers' entry: they rewrite one tensor-parallel rank's files, so a
    // tensor-parallel checkpoint is refused here (read_with_rules reads it).
    let by_mp = scan(dir)?;
    if let Some((mp, f)) = by_mp.iter().find(|(&mp, _)| mp > 0) {
        let p = f
            .optim
            .values()
            .chain(f.model_states())
            .next()
            .cloned()
            .unwrap_or_else(|| dir.to_path_buf());
        return Err(err(
            &p,
            format!("mp_rank_{mp:02}: tensor-parallel DeepSpeed checkpoints (model parallel size > 1) are read (merge, reshard) but not written back as DeepSpeed or UCP checkpoints yet"),
        ));
    }
    let files = by_mp
        .get(&0)
        .ok_or_else(|| err(dir, "no `*_optim_states.pt` file"))?;
    read_mp(dir, 0, files, None)
}

/// The files of one model-parallel (tensor-parallel) rank `mp_rank_XX`.
#[derive(Debug, Default)]
pub(crate) struct MpFiles {
    /// Optimizer states by data-parallel rank.
    pub(crate) optim: BTreeMap<u64, PathBuf>,
    /// ZeRO-3's per-rank model states by data-parallel rank.
    pub(crate) rank_models: BTreeMap<u64, PathBuf>,
    /// ZeRO-1/2's `mp_rank_XX_model_states.pt`.
    pub(crate) model: Option<PathBuf>,
    /// Mixture-of-experts weights by (MoE layer, global expert id).
    pub(crate) experts: BTreeMap<(u64, u64), PathBuf>,
    /// ZeRO-0's optimizer files of the expert-parallel ranks (`expp_rank_*`).
    pub(crate) expert_optim: Vec<PathBuf>,
}

impl MpFiles {
    /// The model states that hold `param_shapes` (ZeRO-3: data-parallel rank 0's).
    pub(crate) fn model_states(&self) -> Option<&PathBuf> {
        self.model.as_ref().or_else(|| self.rank_models.get(&0))
    }
}

/// A tag directory's files by model-parallel rank.
pub(crate) fn scan(dir: &Path) -> Result<BTreeMap<u64, MpFiles>> {
    let mut by_mp: BTreeMap<u64, MpFiles> = BTreeMap::new();
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| err(dir, e.to_string()))?
        .flatten()
        .map(|e| e.path())
        .collect();
    names.sort();
    for p in names {
        let Some(r) = p.file_name().and_then(|n| n.to_str()).and_then(role) else {
            continue;
        };
        match r {
            Role::OldExpert => {
                return Err(err(
                    &p,
                    "experts in DeepSpeed's older naming (expert_<g>_..., without the layer) are not read; layer_<l>_expert_<g>_... files are",
                ))
            }
            Role::ExpertOptim => by_mp.entry(0).or_default().expert_optim.push(p),
            Role::ExpertWeights { layer, expert } => {
                by_mp.entry(0).or_default().experts.insert((layer, expert), p);
            }
            Role::Optim { dp, mp } => {
                if let Some(other) = by_mp.entry(mp).or_default().optim.insert(dp, p.clone()) {
                    return Err(err(
                        &p,
                        format!(
                            "data-parallel rank {dp} also has {} (a bf16_ and a plain file?)",
                            other.display()
                        ),
                    ));
                }
            }
            Role::RankModel { dp, mp } => {
                by_mp.entry(mp).or_default().rank_models.insert(dp, p);
            }
            Role::Model { mp } => by_mp.entry(mp).or_default().model = Some(p),
        }
    }
    Ok(by_mp)
}

/// Reads the files of model-parallel rank `mp`; with `tp`, each piece is placed in the
/// global tensor its tensor-parallel shard belongs to (`tp` says how).
pub(crate) fn read_mp(
    dir: &Path,
    mp: u64,
    files: &MpFiles,
    tp: Option<&Arc<TpPlace>>,
) -> Result<DeepSpeed> {
    let MpFiles {
        optim,
        rank_models,
        model,
        experts,
        expert_optim,
    } = files;
    match (optim.is_empty(), model, expert_optim.first()) {
        (true, Some(model), Some(_)) => {
            return read_zero0(model, experts, expert_optim, tp.is_some())
        }
        (false, _, Some(p)) => {
            return Err(err(
                p,
                "a mixture-of-experts optimizer file without ZeRO (ZeRO-0's expp_rank_*) beside ZeRO optimizer files (zero_pp_rank_*): not one checkpoint",
            ))
        }
        _ => {}
    }
    let Some((_, first)) = optim.iter().next() else {
        return Err(err(dir, "no `*_optim_states.pt` file"));
    };
    let first = PtFile::open(first)?;
    let osd = first.at(&["optimizer_state_dict"])?;
    let stage_v = osd.get("zero_stage").ok_or_else(|| {
        err(
            &first.path,
            "no `optimizer_state_dict.zero_stage`: not a ZeRO checkpoint",
        )
    })?;
    let stage = int(stage_v)
        .filter(|s| (1..=3).contains(s))
        .ok_or_else(|| {
            err(
                &first.path,
                format!(
                    "`zero_stage` is {}, not a ZeRO stage 1..3",
                    describe(stage_v)
                ),
            )
        })?;
    let world = match osd.get("partition_count") {
        Some(v @ (Value::List(_) | Value::Tuple(_))) => {
            v.items().unwrap_or(&[]).iter().filter_map(int).max()
        }
        Some(v) => int(v),
        None => None,
    }
    .filter(|&w| w > 0)
    .ok_or_else(|| {
        err(
            &first.path,
            "no usable `partition_count` (the data-parallel size)",
        )
    })?;
    drop(first);
    for dp in 0..world {
        if !optim.contains_key(&dp) {
            let like = optim
                .values()
                .next()
                .and_then(|p| p.file_name()?.to_str().map(String::from))
                .unwrap_or_default();
            let prefix = if like.starts_with("bf16_") {
                "bf16_"
            } else {
                ""
            };
            return Err(err(
                &dir.join(format!("{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02}_optim_states.pt")),
                format!("data-parallel rank {dp} of {world} is missing (its optimizer states hold that rank's part of every parameter)"),
            ));
        }
    }
    if let Some((&dp, p)) = optim.iter().find(|(&d, _)| d >= world) {
        return Err(err(
            p,
            format!("data-parallel rank {dp}, but `partition_count` says {world} ranks"),
        ));
    }
    // Abreast: from a store, each open waits on the network. (Each file's few local
    // headers are read at open: locating them on first read instead, as Megatron's
    // are, fetched more blocks here, 700 against 569 for 386 MiB of objects, since a
    // ZeRO rank's partitions are read piece by piece across its storages.)
    let paths: Vec<&PathBuf> = optim.values().collect();
    let mut ranks: Vec<PtFile> = crate::formats::open_abreast(&paths, |p| PtFile::open(p))
        .into_iter()
        .collect::<Result<_>>()?;
    let model_path = if stage == 3 {
        rank_models.get(&0).cloned()
    } else {
        model.clone()
    }
    .ok_or_else(|| {
        let want = if stage == 3 {
            format!("zero_pp_rank_0_mp_rank_{mp:02}_model_states.pt")
        } else {
            format!("mp_rank_{mp:02}_model_states.pt")
        };
        err(
            &dir.join(want),
            "missing (the model states: parameter shapes, buffers)",
        )
    })?;
    let mut models: Vec<PtFile> = vec![PtFile::open(&model_path)?];
    if stage == 3 {
        for dp in 1..world {
            let p = rank_models.get(&dp).ok_or_else(|| {
                err(
                    &dir.join(format!("zero_pp_rank_{dp}_mp_rank_{mp:02}_model_states.pt")),
                    format!("data-parallel rank {dp} of {world}: model states missing"),
                )
            })?;
            models.push(PtFile::open(p)?);
        }
    }
    for f in ranks.iter_mut().chain(models.iter_mut()) {
        f.tp = tp.cloned();
    }
    // Tensor-parallel ranks > 0 all gone: rank 0's shards alone are not the model.
    if let (None, Some(&Value::Int(n))) = (tp, models[0].opt_at(&["mp_world_size"])) {
        if n > 1 {
            return Err(err(
                &dir.join("mp_rank_01_model_states.pt"),
                format!("tensor-parallel rank 1 of {n} (`mp_world_size` in {}) is missing: its model states and optimizer states hold that rank's shard of every parameter", models[0].path.display()),
            ));
        }
    }
    let mut out = DeepSpeed {
        files: vec![],
        shapes: BTreeMap::new(),
        aliases: vec![],
        notes: vec![],
    };
    let groups: Vec<Vec<(String, Vec<u64>)>> = {
        let m = &models[0];
        let v = m.at(&["param_shapes"])?;
        list(m, v, "param_shapes")?
            .iter()
            .map(|g| shapes_of(m, g, "param_shapes"))
            .collect::<Result<_>>()?
    };
    // Mixture of experts: which groups are the experts', over which ranks (each
    // group's parameters under their global names).
    let layouts = group_layouts(&ranks, &models[0], &groups, world, experts, tp.is_some())?;
    let groups: Vec<Vec<(String, Vec<u64>)>> = layouts
        .iter()
        .map(|parts| parts.iter().flat_map(|(_, p)| p.iter().cloned()).collect())
        .collect();
    for (name, shape) in groups.iter().flatten() {
        out.shapes.insert(name.clone(), (Dtype::F32, shape.clone()));
    }
    read_buffers(&mut models[0], &mut out)?;
    if layouts.iter().any(|l| l.len() > 1) {
        out.notes.push(format!(
            "{}: the experts' weights are read from the fp32 partitions, as zero_to_fp32 reads every weight (the layer_<l>_expert_<g> files hold them in the model's dtype: not read)",
            dir.display()
        ));
    }
    if stage <= 2 {
        read_zero12(&mut ranks, &layouts, &groups, &mut out)?;
    } else {
        read_zero3(&mut ranks, &groups, world, &mut out)?;
    }
    read_frozen(&mut models, stage, world, &mut out)?;
    // Tied parameters: `shared_params[a] = b` means a is b (zero_to_fp32 sets
    // state_dict[a] = state_dict[b] when b is there).
    if let Some(v) = models[0].opt_at(&["shared_params"]) {
        for (k, t) in dict_items(v).unwrap_or(&[]) {
            if let (Value::Str(a), Value::Str(b)) = (k, t) {
                if let Some(s) = out.shapes.get(b).cloned() {
                    out.shapes.insert(a.clone(), s);
                    out.aliases.push((a.clone(), b.clone()));
                }
            }
        }
    }
    for f in ranks.into_iter().chain(models) {
        if let Some(t) = f.finish(stage)? {
            out.files.push(t);
        }
    }
    Ok(out)
}

/// Buffers are stored whole in `module`; `zero_to_fp32` widens floating ones to fp32,
/// which ckpt does not do: a buffer that is not fp32 is refused by name.
fn read_buffers(m: &mut PtFile, out: &mut DeepSpeed) -> Result<()> {
    let names: Vec<String> = match m.opt_at(&["buffer_names"]) {
        Some(v) => list(m, v, "buffer_names")?
            .iter()
            .filter_map(|n| match n {
                Value::Str(s) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        None => {
            return Err(err(
                &m.path,
                "no `buffer_names`: not DeepSpeed model states",
            ))
        }
    };
    for name in names {
        let v = m.at(&["module"])?.get(&name).ok_or_else(|| {
            err(
                &m.path,
                format!("buffer `{name}` is named in `buffer_names` but not in `module`"),
            )
        })?;
        let t = m.tensor(v, &name)?;
        if matches!(t.dtype, Dtype::F16 | Dtype::BF16 | Dtype::F64) {
            return Err(err(
                &m.path,
                format!("buffer `{name}` is stored as {:?}; zero_to_fp32 widens it to fp32, which ckpt does not do yet", t.dtype),
            ));
        }
        let n = numel(&t.shape)?;
        let shape = t.shape.clone();
        m.piece(&name, &shape, FlatRange::new(0, n), &t, 0)?;
        out.shapes.insert(name, (t.dtype, shape));
    }
    Ok(())
}

/// The fp32 flat tensor(s) of one rank, and its moments, located.
struct RankGroups {
    weights: Vec<TensorEntry>,
    /// `exp_avg`, `exp_avg_sq` per group, when the file holds them.
    moments: Vec<Option<[TensorEntry; 2]>>,
}

fn rank_groups(f: &PtFile, stage: u64) -> Result<RankGroups> {
    let key = if stage == 3 {
        "fp32_flat_groups"
    } else {
        "single_partition_of_fp32_groups"
    };
    let v = f.at(&["optimizer_state_dict", key])?;
    let weights: Vec<TensorEntry> = list(f, v, key)?
        .iter()
        .enumerate()
        .map(|(g, t)| f.tensor(t, &format!("{key}.{g}")))
        .collect::<Result<_>>()?;
    for w in &weights {
        if w.dtype != Dtype::F32 || w.shape.len() != 1 {
            return Err(err(
                &f.path,
                format!(
                    "`{}` is {:?} {:?}, not a flat fp32 partition",
                    w.name, w.dtype, w.shape
                ),
            ));
        }
    }
    // ZeRO-1/2: the torch optimizer's state of each group's one flat parameter
    // (`base_optimizer_state`: `{state: {g: {...}}}`, or with elastic checkpoints a
    // list of per-group dicts); ZeRO-3: `optimizer_state_dict.state`.
    let base = if stage == 3 {
        f.opt_at(&["optimizer_state_dict", "optimizer_state_dict"])
    } else {
        f.opt_at(&["optimizer_state_dict", "base_optimizer_state"])
    };
    let mut moments = Vec::with_capacity(weights.len());
    for g in 0..weights.len() {
        let state = match base {
            Some(b @ (Value::List(_) | Value::Tuple(_))) => b.items().and_then(|x| x.get(g)),
            Some(b) => b.get("state").and_then(|s| match s {
                Value::Dict(kv) => kv
                    .iter()
                    .find(|(k, _)| matches!(k, Value::Int(i) if *i == g as i64))
                    .map(|(_, v)| v),
                _ => None,
            }),
            None => None,
        };
        let m = match state {
            Some(s) => match (s.get("exp_avg"), s.get("exp_avg_sq")) {
                (Some(a), Some(b)) => Some([
                    f.tensor(a, &format!("state.{g}.exp_avg"))?,
                    f.tensor(b, &format!("state.{g}.exp_avg_sq"))?,
                ]),
                _ => None,
            },
            None => None,
        };
        moments.push(m);
    }
    Ok(RankGroups { weights, moments })
}

const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// The prefix of optimizer state names (the checkpoint layer's `OPTIMIZER_PREFIX`,
/// spelled here: a format does not import the layer above it; tests/deepspeed.rs
/// checks that merge puts the moments in optimizer.safetensors, i.e. that they agree).
const OPTIM_PREFIX: &str = "optim.";

fn moment_name(param: &str, k: usize) -> String {
    format!("{OPTIM_PREFIX}{param}.{}", MOMENTS[k])
}

/// ZeRO-1/2: per group, the parameters back to back (with their alignment paddings)
/// over the ranks' partitions back to back (`layouts`: over which ranks; `groups`:
/// every group's parameters by global name, for the moments).
fn read_zero12(
    ranks: &mut [PtFile],
    layouts: &[GroupLayout],
    groups: &[Vec<(String, Vec<u64>)>],
    out: &mut DeepSpeed,
) -> Result<()> {
    let located: Vec<RankGroups> = ranks
        .iter()
        .map(|f| rank_groups(f, 2))
        .collect::<Result<_>>()?;
    let paddings = ranks[0]
        .opt_at(&["optimizer_state_dict", "param_alignment_paddings"])
        .cloned();
    let mut with_moments = true;
    for (g, parts) in layouts.iter().enumerate() {
        check_group_padding(ranks, &located, g)?;
        for (members, params) in parts {
            // Where each member's partition of this group starts in its buffer.
            let mut starts = Vec::with_capacity(members.len());
            let mut avail = 0u64;
            for &r in members {
                let w = located[r].weights.get(g).ok_or_else(|| {
                    err(&ranks[r].path, format!("no flat partition for parameter group {g} (the model states list {} groups)", layouts.len()))
                })?;
                starts.push(avail);
                avail = avail
                    .checked_add(w.shape[0])
                    .ok_or_else(|| overflow("group length"))?;
            }
            let pads: Vec<u64> = match paddings
                .as_ref()
                .and_then(|p| p.items())
                .and_then(|p| p.get(g))
            {
                Some(v) => {
                    let p: Vec<u64> = v.items().unwrap_or(&[]).iter().filter_map(int).collect();
                    if p.len() != params.len() {
                        return Err(err(
                            &ranks[0].path,
                            format!(
                                "group {g}: {} parameter alignment paddings for {} parameters",
                                p.len(),
                                params.len()
                            ),
                        ));
                    }
                    p
                }
                None => vec![0; params.len()],
            };
            let last = ranks[*members.last().unwrap_or(&0)].path.clone();
            let mut offset = 0u64;
            for ((name, shape), pad) in params.iter().zip(&pads) {
                let n = numel(shape)?;
                let end = offset
                    .checked_add(n)
                    .ok_or_else(|| overflow(name.as_str()))?;
                if end > avail {
                    return Err(err(
                        &last,
                        format!("tensor `{name}`: group {g} needs elements {offset}..{end}, but the {} partitions hold {avail}: partition sizes do not add up to the parameter shapes", members.len()),
                    ));
                }
                for (i, &r) in members.iter().enumerate() {
                    let len_r = located[r].weights[g].shape[0];
                    let part = FlatRange::new(starts[i], len_r);
                    let Some(o) = part.overlap(&FlatRange::new(offset, n)) else {
                        continue;
                    };
                    let range = FlatRange::new(o.start - offset, o.len);
                    let at = o.start - starts[i];
                    let w = located[r].weights[g].clone();
                    ranks[r].piece(name, shape, range, &w, at)?;
                    match located[r].moments[g].clone() {
                        Some(m) => {
                            for (k, t) in m.iter().enumerate() {
                                ranks[r].piece(&moment_name(name, k), shape, range, t, at)?;
                            }
                        }
                        None => with_moments = false,
                    }
                }
                offset = end
                    .checked_add(*pad)
                    .ok_or_else(|| overflow(name.as_str()))?;
            }
            // zero_to_fp32's check: ZeRO-2 aligns the group to 2 * (its partition
            // count), so what the parameters use and what the partitions hold agree up
            // to that alignment.
            let count = members.len() as u64;
            let align = |x: u64| x.div_ceil(2 * count) * (2 * count);
            if align(offset) != align(avail) {
                return Err(err(
                    &last,
                    format!("group {g}: the parameters use {offset} elements, the {count} partitions hold {avail}: partition sizes do not add up to the parameter shapes"),
                ));
            }
        }
    }
    finish_moments(groups, with_moments, out);
    Ok(())
}

/// The ranks of a DeepSpeed data-parallel world as its MoE groups split them
/// (`utils/groups.py`, `_create_expert_and_data_parallel`, model parallelism 1, one
/// pipeline stage; docs/moe.md, "Which EP rank a rank is").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExpertGrid {
    /// Data-parallel ranks (the world).
    pub(crate) world: u64,
    /// Expert-parallel size.
    pub(crate) ep: u64,
    /// `use_data_before_expert_parallelism` (D + E): the EP groups stride.
    pub(crate) data_before_expert: bool,
}

impl ExpertGrid {
    /// `(EP rank, EDP rank)` of data-parallel rank `r`.
    pub(crate) fn place(&self, r: u64) -> (u64, u64) {
        let edp = self.world / self.ep;
        if self.data_before_expert {
            (r / edp, r % edp)
        } else {
            (r % self.ep, r / self.ep)
        }
    }

    /// The ranks of EP rank `e`'s expert-data-parallel group, by EDP rank.
    pub(crate) fn members(&self, e: u64) -> Vec<u64> {
        let mut m: Vec<(u64, u64)> = (0..self.world)
            .map(|r| (self.place(r), r))
            .filter(|((ep, _), _)| *ep == e)
            .map(|((_, edp), r)| (edp, r))
            .collect();
        m.sort_unstable();
        m.into_iter().map(|(_, r)| r).collect()
    }
}

/// `use_data_before_expert_parallelism` of a `ds_config` (absent: false).
pub(crate) fn data_before_expert(ds_config: Option<&Value>) -> bool {
    matches!(
        ds_config.and_then(|c| c.get("use_data_before_expert_parallelism")),
        Some(Value::Bool(true))
    )
}

/// The EP size of an optimizer parameter group that holds experts (`moe: True`, named
/// `ep_size_<EP>`); `None` for any other group.
pub(crate) fn expert_group_ep(param_group: &Value) -> Option<u64> {
    if !matches!(param_group.get("moe"), Some(Value::Bool(true))) {
        return None;
    }
    match param_group.get("name") {
        Some(Value::Str(n)) => n.strip_prefix("ep_size_")?.parse().ok(),
        _ => None,
    }
}

/// An expert's parameter name split at its local expert id
/// (`…deepspeed_experts.<i>.<rest>`): `(head, i, rest)`, the head ending with the dot.
pub(crate) fn local_expert(name: &str) -> Option<(&str, u64, &str)> {
    const AT: &str = "deepspeed_experts.";
    let at = name.find(AT)? + AT.len();
    let (i, rest) = name[at..].split_once('.')?;
    Some((&name[..at], i.parse().ok()?, rest))
}

/// How a parameter group lies over the ranks' files: `(members, parameters)` parts,
/// each part's parameters back to back over its members' partitions in order. A dense
/// group is one part over every rank; an expert group (`moe: True`, named
/// `ep_size_<EP>`) one part per expert-parallel rank over its expert-data-parallel
/// ranks, its parameters under their global expert ids.
type GroupLayout = Vec<(Vec<usize>, Vec<(String, Vec<u64>)>)>;

/// Each group's [`GroupLayout`], from the optimizer's group names, the model states'
/// `num_experts` and `ds_config`, and DeepSpeed's group rule (docs/moe.md: with
/// `use_data_before_expert_parallelism` the expert-parallel groups stride, else the
/// expert-data-parallel ones do).
fn group_layouts(
    ranks: &[PtFile],
    model: &PtFile,
    groups: &[Vec<(String, Vec<u64>)>],
    world: u64,
    expert_files: &BTreeMap<(u64, u64), PathBuf>,
    tensor_parallel: bool,
) -> Result<Vec<GroupLayout>> {
    let all: Vec<usize> = (0..ranks.len()).collect();
    let param_groups = ranks[0]
        .opt_at(&[
            "optimizer_state_dict",
            "base_optimizer_state",
            "param_groups",
        ])
        .and_then(Value::items)
        .unwrap_or(&[]);
    let ep_of = |g: usize| param_groups.get(g).and_then(expert_group_ep);
    let any_moe = (0..groups.len()).any(|g| ep_of(g).is_some());
    if !any_moe {
        if let Some(p) = expert_files.values().next() {
            return Err(err(p, "an expert's weights, but no optimizer group holds experts (no group `moe: True`, named ep_size_<EP>)"));
        }
        return Ok(groups
            .iter()
            .map(|p| vec![(all.clone(), p.clone())])
            .collect());
    }
    if tensor_parallel {
        return Err(err(&model.path, "experts with tensor parallelism (DeepSpeed's TP-strided expert groups) are not read yet"));
    }
    let data_before_expert = data_before_expert(model.opt_at(&["ds_config"]));
    let num_experts: Vec<u64> = model
        .opt_at(&["num_experts"])
        .and_then(Value::items)
        .map(|v| v.iter().filter_map(int).collect())
        .unwrap_or_default();
    let mut out = Vec::with_capacity(groups.len());
    for (g, params) in groups.iter().enumerate() {
        let Some(ep) = ep_of(g) else {
            out.push(vec![(all.clone(), params.clone())]);
            continue;
        };
        if ep == 0 || !world.is_multiple_of(ep) {
            return Err(err(&ranks[0].path, format!("group {g} is ep_size_{ep}, which does not divide the {world} data-parallel ranks")));
        }
        let grid = ExpertGrid {
            world,
            ep,
            data_before_expert,
        };
        // The local experts the group names (`deepspeed_experts.<i>.`).
        let per = params
            .iter()
            .filter_map(|(n, _)| local_expert(n).map(|(_, i, _)| i + 1))
            .max()
            .unwrap_or(0);
        if let Some(&e) = num_experts.iter().find(|&&e| e != ep * per) {
            return Err(err(
                &model.path,
                format!("num_experts {e} in the model states, but the optimizer's group {g} holds {per} local experts on each of {ep} expert-parallel ranks (ep_size_{ep}): {}", ep * per),
            ));
        }
        // Every MoE layer's every expert has its weights file.
        for l in 0..num_experts.len() as u64 {
            for x in 0..ep * per {
                if !expert_files.contains_key(&(l, x)) {
                    let dir = model.path.parent().unwrap_or(Path::new(""));
                    return Err(err(
                        &dir.join(format!("layer_{l}_expert_{x}_mp_rank_00_model_states.pt")),
                        format!(
                            "missing: MoE layer {l}'s expert {x} of {} (num_experts)",
                            ep * per
                        ),
                    ));
                }
            }
        }
        let mut parts = Vec::with_capacity(ep as usize);
        for e in 0..ep {
            let named: Vec<(String, Vec<u64>)> = params
                .iter()
                .map(|(n, shape)| match local_expert(n) {
                    Some((head, i, rest)) => {
                        (format!("{head}{}.{rest}", e * per + i), shape.clone())
                    }
                    None => (n.clone(), shape.clone()),
                })
                .collect();
            let members = grid.members(e).into_iter().map(|r| r as usize).collect();
            parts.push((members, named));
        }
        out.push(parts);
    }
    Ok(out)
}

/// ZeRO-1/2 store each rank's partition without the padding at the group's end and
/// say how much they removed (`group_paddings`): stored plus removed must be the same
/// partition size on every rank, padding only where a partition reaches past the
/// parameters (the last ranks), and the moments (stored padded) that long.
fn check_group_padding(ranks: &[PtFile], located: &[RankGroups], g: usize) -> Result<()> {
    let mut size: Option<(u64, usize)> = None;
    for (r, f) in ranks.iter().enumerate() {
        let Some(pad) = f
            .opt_at(&["optimizer_state_dict", "group_paddings"])
            .and_then(|p| p.items())
            .and_then(|p| p.get(g))
            .and_then(int)
        else {
            // Older files do not say: nothing to check against.
            continue;
        };
        let stored = located[r].weights[g].shape[0];
        let whole = stored
            .checked_add(pad)
            .ok_or_else(|| overflow("partition"))?;
        match size {
            None => size = Some((whole, r)),
            Some((s, r0)) if s != whole => {
                return Err(err(
                    &f.path,
                    format!("group {g}: this rank's partition is {stored} elements plus {pad} of padding = {whole}, but rank {r0}'s is {s}: the padding is not where ZeRO puts it (only at the end of the group)"),
                ));
            }
            Some(_) => {}
        }
        if pad > 0 {
            if let Some(m) = &located[r].moments[g] {
                let n = m[0].shape.first().copied().unwrap_or(0);
                if n != whole && n != stored {
                    return Err(err(
                        &f.path,
                        format!("tensor `{}`: {n} elements, the partition is {stored} plus {pad} of padding", m[0].name),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// ZeRO-3: each parameter cut alone into `ceil(numel / dp)` elements per rank, a
/// rank's parts back to back over its flat groups.
fn read_zero3(
    ranks: &mut [PtFile],
    groups: &[Vec<(String, Vec<u64>)>],
    world: u64,
    out: &mut DeepSpeed,
) -> Result<()> {
    let located: Vec<RankGroups> = ranks
        .iter()
        .map(|f| rank_groups(f, 3))
        .collect::<Result<_>>()?;
    let lens: Vec<u64> = located[0].weights.iter().map(|w| w.shape[0]).collect();
    for (r, l) in located.iter().enumerate() {
        let mine: Vec<u64> = l.weights.iter().map(|w| w.shape[0]).collect();
        if mine != lens {
            return Err(err(
                &ranks[r].path,
                format!("its flat groups hold {mine:?} elements, rank 0's {lens:?}: every ZeRO-3 rank holds equal parts"),
            ));
        }
    }
    let total: u64 = lens.iter().sum();
    // Group g spans [bounds[g], bounds[g+1]) of a rank's concatenated groups.
    let mut bounds = vec![0u64];
    for l in &lens {
        bounds.push(bounds[bounds.len() - 1] + l);
    }
    let mut with_moments = true;
    let mut offset = 0u64;
    for (name, shape) in groups.iter().flatten() {
        let n = numel(shape)?;
        let part = n.div_ceil(world);
        let end = offset
            .checked_add(part)
            .ok_or_else(|| overflow(name.as_str()))?;
        if end > total {
            return Err(err(
                &ranks[0].path,
                format!("tensor `{name}`: its part ({part} elements) would end at {end}, but each rank's flat groups hold {total}: partition sizes do not add up to the parameter shapes"),
            ));
        }
        for r in 0..ranks.len() as u64 {
            // Rank r holds elements [r*part, (r+1)*part) of the padded parameter; the
            // padding (past n) is not part of it.
            let lo = r * part;
            let hi = ((r + 1) * part).min(n);
            if hi <= lo {
                continue;
            }
            // Where those lie in the rank's groups (a part may straddle two groups).
            let mine = FlatRange::new(offset, hi - lo);
            for g in 0..lens.len() {
                let Some(o) = mine.overlap(&FlatRange::new(bounds[g], lens[g])) else {
                    continue;
                };
                let range = FlatRange::new(lo + (o.start - offset), o.len);
                let at = o.start - bounds[g];
                let ri = r as usize;
                let w = located[ri].weights[g].clone();
                ranks[ri].piece(name, shape, range, &w, at)?;
                match located[ri].moments[g].clone() {
                    Some(m) => {
                        for (k, t) in m.iter().enumerate() {
                            ranks[ri].piece(&moment_name(name, k), shape, range, t, at)?;
                        }
                    }
                    None => with_moments = false,
                }
            }
        }
        offset = end;
    }
    if offset != total {
        return Err(err(
            &ranks[0].path,
            format!("the parameters' parts use {offset} elements of each rank's flat groups, which hold {total}: partition sizes do not add up to the parameter shapes"),
        ));
    }
    finish_moments(groups, with_moments, out);
    Ok(())
}

fn finish_moments(groups: &[Vec<(String, Vec<u64>)>], with_moments: bool, out: &mut DeepSpeed) {
    if with_moments {
        for (name, shape) in groups.iter().flatten() {
            for k in 0..MOMENTS.len() {
                out.shapes
                    .insert(moment_name(name, k), (Dtype::F32, shape.clone()));
            }
        }
    } else {
        out.notes.push(
            "the optimizer states hold no exp_avg/exp_avg_sq for some group (not Adam?): moments are not read".into(),
        );
    }
}

/// Frozen parameters: kept in the model states (ZeRO-2: whole, ZeRO-3: each rank's
/// part), in the dtype the model trained in, which zero_to_fp32 keeps.
fn read_frozen(models: &mut [PtFile], stage: u64, world: u64, out: &mut DeepSpeed) -> Result<()> {
    let frozen = match models[0].opt_at(&["frozen_param_shapes"]) {
        None | Some(Value::None) => {
            if stage == 1 {
                out.notes.push(
                    "ZeRO-1 checkpoints record no frozen parameters (as zero_to_fp32, none are read)".into(),
                );
            }
            return Ok(());
        }
        Some(v) => shapes_of(&models[0], &v.clone(), "frozen_param_shapes")?,
    };
    for (name, shape) in frozen {
        let n = numel(&shape)?;
        let mut dtype = None;
        let parts = if stage == 3 { world } else { 1 };
        let part = n.div_ceil(parts);
        for r in 0..models.len().min(parts as usize) {
            let m = &mut models[r];
            let v = m
                .opt_at(&["frozen_param_fragments"])
                .and_then(|f| f.get(&name))
                .cloned()
                .ok_or_else(|| {
                    err(
                        &m.path,
                        format!("tensor `{name}`: frozen, but not in `frozen_param_fragments`"),
                    )
                })?;
            let t = m.tensor(&v, &name)?;
            let have = numel(&t.shape)?;
            let lo = r as u64 * part;
            let hi = ((r as u64 + 1) * part).min(n);
            let want = if stage == 3 { part } else { n };
            if have != want {
                return Err(err(
                    &m.path,
                    format!("tensor `{name}`: its frozen fragment holds {have} elements, {want} expected for shape {shape:?} over {parts} rank(s)"),
                ));
            }
            if *dtype.get_or_insert(t.dtype) != t.dtype {
                return Err(err(
                    &m.path,
                    format!("tensor `{name}`: frozen fragments of different dtypes"),
                ));
            }
            if hi > lo {
                m.piece(&name, &shape, FlatRange::new(lo, hi - lo), &t, 0)?;
            }
        }
        out.shapes
            .insert(name, (dtype.unwrap_or(Dtype::F32), shape));
    }
    Ok(())
}

/// Where one tensor-parallel rank's shards lie in the global tensors.
#[derive(Debug)]
pub(crate) struct TpPlace {
    pub(crate) rank: u64,
    pub(crate) size: u64,
    /// Each parameter's (and buffer's) split, by name.
    pub(crate) splits: BTreeMap<String, Split>,
}

impl TpPlace {
    /// The tensor-parallel size.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// The split of a tensor, or of the parameter whose moment it is.
    fn split_of(&self, name: &str) -> Option<Split> {
        self.splits.get(name).copied().or_else(|| {
            let base = name.strip_prefix("optim.")?;
            let base = base
                .strip_suffix(".exp_avg")
                .or_else(|| base.strip_suffix(".exp_avg_sq"))?;
            self.splits.get(base).copied()
        })
    }

    /// The global boxes of the local box `region` of shard `name` (local shape
    /// `local`), each with its first element's offset among the box's elements; `None`
    /// when another rank's copy is the one read (replicated, rank > 0).
    ///
    /// A box crossing sub-parameter blocks is cut at the block bounds: where the box is
    /// more than one element wide in a dimension before the split one, it is first cut
    /// into slices one element wide there, so that each piece is contiguous.
    pub(crate) fn place(
        &self,
        name: &str,
        local: &[u64],
        region: &Region,
    ) -> std::result::Result<Option<Vec<(Region, u64)>>, String> {
        let Some(split) = self.split_of(name) else {
            return Err(format!(
                "tensor `{name}`: no split rule (internal: not placed)"
            ));
        };
        let (dim, blocks) = match split {
            Split::Replicated => {
                return Ok((self.rank == 0).then(|| vec![(region.clone(), 0)]));
            }
            Split::Dim { dim, blocks } => (dim, blocks),
        };
        let lb = local.get(dim).map_or(0, |l| l / blocks);
        if lb == 0 || region.ndim() <= dim || region.shape[dim] == 0 {
            return Err(format!(
                "tensor `{name}`: a shard of shape {local:?} split on dim {dim} in {blocks} block(s)"
            ));
        }
        // Element offsets within a box are below its numel, and global starts below the
        // global extent (local x size, checked by the caller): overflow here means a
        // shape nothing could hold.
        let too_big = || format!("tensor `{name}`: global offsets overflow");
        let inner: u64 = region.shape[dim + 1..].iter().product();
        let shift = |s: u64| -> Option<u64> {
            (s / lb)
                .checked_mul(lb)?
                .checked_mul(self.size)?
                .checked_add(self.rank.checked_mul(lb)?)?
                .checked_add(s % lb)
        };
        let cut = |r: &Region, base: u64, out: &mut Vec<(Region, u64)>| -> Option<()> {
            let (s0, n) = (r.start[dim], r.shape[dim]);
            let end = s0.checked_add(n)?;
            let mut s = s0;
            while s < end {
                let e = (s / lb + 1).checked_mul(lb)?.min(end);
                let mut g = r.clone();
                g.start[dim] = shift(s)?;
                g.shape[dim] = e - s;
                out.push((g, base.checked_add((s - s0).checked_mul(inner)?)?));
                s = e;
            }
            Some(())
        };
        let mut out = Vec::new();
        let crosses = region.start[dim] / lb != (region.start[dim] + region.shape[dim] - 1) / lb;
        if !crosses || region.shape[..dim].iter().all(|&x| x == 1) {
            cut(region, 0, &mut out).ok_or_else(too_big)?;
            return Ok(Some(out));
        }
        // One slice per index of the dimensions before `dim`, in row-major order.
        let outer: u64 = region.shape[..dim].iter().product();
        let slice_len: u64 = region.shape[dim..].iter().product();
        for p in 0..outer {
            let mut r = region.clone();
            let mut rest = p;
            for k in (0..dim).rev() {
                r.start[k] = region.start[k] + rest % region.shape[k];
                r.shape[k] = 1;
                rest /= region.shape[k];
            }
            cut(&r, p * slice_len, &mut out).ok_or_else(too_big)?;
        }
        Ok(Some(out))
    }

    pub(crate) fn global_shape(&self, name: &str, local: &[u64]) -> Option<Vec<u64>> {
        let mut g = local.to_vec();
        if let Some(Split::Dim { dim, .. }) = self.split_of(name) {
            g[dim] = g[dim].checked_mul(self.size)?;
        }
        Some(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_are_named_as_ckpt_names_optimizer_state() {
        assert_eq!(moment_name("fc1.weight", 1), "optim.fc1.weight.exp_avg_sq");
    }

    #[test]
    fn file_roles_from_names() {
        assert_eq!(
            role("bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"),
            Some(Role::Optim { dp: 3, mp: 0 })
        );
        assert_eq!(
            role("zero_pp_rank_1_mp_rank_02_model_states.pt"),
            Some(Role::RankModel { dp: 1, mp: 2 })
        );
        assert_eq!(
            role("mp_rank_00_model_states.pt"),
            Some(Role::Model { mp: 0 })
        );
        assert_eq!(
            role("expp_rank_0_mp_rank_00_optim_states.pt"),
            Some(Role::ExpertOptim)
        );
        assert_eq!(
            role("layer_1_expert_3_mp_rank_00_model_states.pt"),
            Some(Role::ExpertWeights {
                layer: 1,
                expert: 3
            })
        );
        assert_eq!(role("latest"), None);
        assert_eq!(role("zero_pp_rank_x_mp_rank_00_optim_states.pt"), None);
    }
}

#[cfg(test)]
mod tp_tests {
    use super::*;

    fn place(rank: u64, split: Split) -> TpPlace {
        TpPlace {
            rank,
            size: 2,
            splits: BTreeMap::from([("w".to_string(), split)]),
        }
    }

    #[test]
    fn column_and_row_shards_shift_by_rank() {
        let col = place(1, Split::Dim { dim: 0, blocks: 1 });
        // Local [4, 6]; rows 1..3 of rank 1 are rows 5..7 of the global [8, 6].
        let r = col
            .place("w", &[4, 6], &Region::new(vec![1, 0], vec![2, 6]))
            .unwrap()
            .unwrap();
        assert_eq!(r, vec![(Region::new(vec![5, 0], vec![2, 6]), 0)]);
        let row = place(1, Split::Dim { dim: 1, blocks: 1 });
        let r = row
            .place(
                "optim.w.exp_avg",
                &[5, 4],
                &Region::new(vec![2, 0], vec![3, 4]),
            )
            .unwrap()
            .unwrap();
        assert_eq!(r, vec![(Region::new(vec![2, 4], vec![3, 4]), 0)]);
        let rep = place(1, Split::Replicated);
        assert_eq!(
            rep.place("w", &[5], &Region::new(vec![0], vec![5]))
                .unwrap(),
            None
        );
    }

    #[test]
    fn fused_blocks_are_cut_at_their_bounds() {
        // Local [gate_r; up_r] of 3 + 3 rows; global gate 6 rows then up 6 rows.
        let p = place(1, Split::Dim { dim: 0, blocks: 2 });
        let r = p
            .place("w", &[6, 2], &Region::new(vec![2, 0], vec![2, 2]))
            .unwrap()
            .unwrap();
        assert_eq!(
            r,
            vec![
                (Region::new(vec![5, 0], vec![1, 2]), 0),
                (Region::new(vec![9, 0], vec![1, 2]), 2)
            ]
        );
        // Split on dim 1 in 2 blocks, a box two rows tall: cut row by row.
        let p = place(0, Split::Dim { dim: 1, blocks: 2 });
        let r = p
            .place("w", &[2, 4], &Region::new(vec![0, 0], vec![2, 4]))
            .unwrap()
            .unwrap();
        assert_eq!(
            r,
            vec![
                (Region::new(vec![0, 0], vec![1, 2]), 0),
                (Region::new(vec![0, 4], vec![1, 2]), 2),
                (Region::new(vec![1, 0], vec![1, 2]), 4),
                (Region::new(vec![1, 4], vec![1, 2]), 6),
            ]
        );
    }
}
