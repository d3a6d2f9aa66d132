//! ZeRO-1/2 for another data-parallel size, and the helpers the ZeRO-3 writer shares
//! (pickled values, the optimizer files, torch.save output).

use super::experts;
use super::group_plan::GroupPlan;
use crate::error::{overflow, Error, Result};
use crate::formats::deepspeed::{self, ExpertGrid};
use crate::formats::output::{write_file_atomic, StagedDir};
use crate::formats::pickle::{Emitter, Value};
use crate::formats::torch_save::{self, describe, locate_value, ArchiveIndex};
use crate::formats::torch_write::{storage_class, TorchWriter};
use crate::formats::writer::TensorSpec;
use crate::formats::{map_file, TensorEntry};
use crate::layout::flat::{numel, FlatRange};
use crate::layout::Dtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What [`write_deepspeed_dp`](crate::write::deepspeed::write_deepspeed_dp) wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeepSpeedWriteStats {
    /// Optimizer-states files written (one per new data-parallel rank).
    pub files: u64,
    /// Tensors written into them.
    pub tensors: u64,
    /// Bytes of tensor data copied.
    pub bytes: u64,
}

pub(super) fn err(path: &Path, problem: impl Into<String>) -> Error {
    Error::InvalidDeepSpeed {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

pub(crate) fn unsupported(problem: impl Into<String>) -> Error {
    Error::Unsupported {
        problem: problem.into(),
    }
}

/// The tag directory of a DeepSpeed checkpoint (the directory with `latest` in it, or
/// the tag directory itself) and the tag.
pub(crate) fn tag_dir(source: &Path) -> Result<(PathBuf, String)> {
    let latest = source.join("latest");
    if latest.is_file() {
        let tag = String::from_utf8(crate::formats::read_small(&latest)?)
            .map_err(|e| err(&latest, e.to_string()))?
            .trim()
            .to_string();
        let dir = source.join(&tag);
        if tag.is_empty() || tag.contains('/') || !dir.is_dir() {
            return Err(err(
                &latest,
                format!("names `{tag}`, which is not a directory beside it"),
            ));
        }
        return Ok((dir, tag));
    }
    if deepspeed::looks_like(source) {
        let tag = source
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("global_step0")
            .to_string();
        return Ok((source.to_path_buf(), tag));
    }
    Err(err(
        source,
        "not a DeepSpeed checkpoint (no `latest`, no model and optimizer states)",
    ))
}

/// One source optimizer-states file, parsed and mapped.
struct Rank {
    path: PathBuf,
    map: Option<crate::formats::Mapped>,
    root: Value,
    /// `single_partition_of_fp32_groups`, located.
    weights: Vec<TensorEntry>,
    /// Per group: `(key, tensor)` of the torch optimizer's state.
    state: Vec<Vec<(String, TensorEntry)>>,
    /// `group_paddings`.
    paddings: Vec<u64>,
}

pub(super) fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::Call { args, .. } => args.items().and_then(|a| a.first()).and_then(int),
        _ => None,
    }
}

pub(super) fn ints(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.items()?.iter().map(int).collect()
}

pub(super) fn dict(v: &Value) -> Option<&[(Value, Value)]> {
    match v {
        Value::Dict(kv) => Some(kv),
        Value::Build { object, .. } => dict(object),
        _ => None,
    }
}

pub(super) fn dict_mut(v: &mut Value) -> Option<&mut Vec<(Value, Value)>> {
    match v {
        Value::Dict(kv) => Some(kv),
        Value::Build { object, .. } => dict_mut(object),
        _ => None,
    }
}

pub(super) fn get_mut<'a>(v: &'a mut Value, key: &str) -> Option<&'a mut Value> {
    dict_mut(v)?
        .iter_mut()
        .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
        .map(|(_, v)| v)
}

pub(super) fn is_tensor(v: &Value) -> bool {
    matches!(v.call_of(), Some(((_, name), _)) if name.starts_with("_rebuild_"))
}

/// The base optimizer's per-group state dict, in group order (`state` is keyed by
/// the group's one flat parameter, numbered as its group).
fn group_states(osd: &Value) -> Option<Vec<&[(Value, Value)]>> {
    let state = dict(osd.get("base_optimizer_state")?.get("state")?)?;
    let mut out: Vec<(i64, &[(Value, Value)])> = state
        .iter()
        .map(|(k, v)| match k {
            Value::Int(i) => Some((*i, dict(v)?)),
            _ => None,
        })
        .collect::<Option<_>>()?;
    out.sort_by_key(|x| x.0);
    Some(out.into_iter().map(|x| x.1).collect())
}

impl Rank {
    fn open(path: &Path) -> Result<Rank> {
        let map = map_file(path)?;
        let all: &[u8] = map.as_deref().unwrap_or(&[]);
        let (archive, root) = torch_save::open_archive(all).map_err(|e| e.with_path(path))?;
        let osd = root
            .get("optimizer_state_dict")
            .ok_or_else(|| err(path, "no `optimizer_state_dict`"))?;
        let stage = osd.get("zero_stage").and_then(int);
        if stage == Some(3) {
            return Err(err(
                path,
                "ZeRO-3 optimizer states beside a single mp_rank_00_model_states.pt (ZeRO-3 keeps one model-states file per rank)",
            ));
        }
        if stage.is_none_or(|s| !(1..=2).contains(&s)) {
            return Err(err(path, "`zero_stage` is not 1 or 2"));
        }
        let base = osd
            .get("base_optimizer_state")
            .ok_or_else(|| err(path, "no `base_optimizer_state`"))?;
        if base.items().is_some() {
            return Err(unsupported(format!(
                "{}: an elastic ZeRO checkpoint (`base_optimizer_state` per group, zero_optimization.elastic_checkpoint): DeepSpeed re-cuts those itself; ckpt writes rigid ones",
                path.display()
            )));
        }
        let weights: Vec<TensorEntry> = osd
            .get("single_partition_of_fp32_groups")
            .and_then(Value::items)
            .ok_or_else(|| err(path, "no `single_partition_of_fp32_groups` list"))?
            .iter()
            .enumerate()
            .map(|(g, t)| {
                locate_value(&archive, &format!("single_partition_of_fp32_groups.{g}"), t)
                    .map_err(|e| e.with_path(path))
            })
            .collect::<Result<_>>()?;
        for w in &weights {
            if w.dtype != Dtype::F32 || w.shape.len() != 1 {
                return Err(err(
                    path,
                    format!(
                        "`{}` is {:?} {:?}, not a flat fp32 partition",
                        w.name, w.dtype, w.shape
                    ),
                ));
            }
        }
        let states = group_states(osd).ok_or_else(|| {
            err(
                path,
                "`base_optimizer_state.state` is not a dict of group numbers",
            )
        })?;
        if states.len() != weights.len() {
            return Err(err(
                path,
                format!(
                    "{} optimizer states for {} parameter groups",
                    states.len(),
                    weights.len()
                ),
            ));
        }
        let state = states
            .iter()
            .enumerate()
            .map(|(g, kv)| {
                kv.iter()
                    .filter(|(_, v)| is_tensor(v))
                    .map(|(k, v)| {
                        let Value::Str(key) = k else {
                            return Err(err(
                                path,
                                format!("group {g}: a state key that is not a name"),
                            ));
                        };
                        let what = format!("base_optimizer_state.state.{g}.{key}");
                        let t = locate_value(&archive, &what, v).map_err(|e| e.with_path(path))?;
                        Ok((key.clone(), t))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let paddings = ints(osd.get("group_paddings"))
            .filter(|p| p.len() == weights.len())
            .ok_or_else(|| err(path, "no `group_paddings` (one per group)"))?;
        Ok(Rank {
            path: path.to_path_buf(),
            map,
            root,
            weights,
            state,
            paddings,
        })
    }
}

/// Where one new tensor's bytes come from: `(source rank, source tensor, element
/// range of it, element offset in the new tensor)`; what no segment covers is zero.
pub(super) type Segments = Vec<(usize, TensorEntry, FlatRange, u64)>;

/// A tensor of a new rank's file: its spec, whether torch rebuilds it with
/// `requires_grad`, and its contents.
pub(super) struct NewTensor {
    pub(super) spec: TensorSpec,
    pub(super) requires_grad: bool,
    pub(super) segments: Segments,
}

/// Parameter names and element counts, per group.
pub(super) type Groups = Vec<Vec<(String, u64)>>;

pub(super) fn param_shapes(models: &Path) -> Result<(Groups, Value)> {
    let map = map_file(models)?;
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let (_, root) = torch_save::open_archive(all).map_err(|e| e.with_path(models))?;
    let groups = root
        .get("param_shapes")
        .and_then(Value::items)
        .ok_or_else(|| err(models, "no `param_shapes` list"))?
        .iter()
        .map(|g| {
            dict(g)
                .ok_or_else(|| err(models, format!("`param_shapes` holds {}", describe(g))))?
                .iter()
                .map(|(k, s)| {
                    let Value::Str(name) = k else {
                        return Err(err(models, "`param_shapes`: a key that is not a name"));
                    };
                    let shape = size(s).ok_or_else(|| {
                        err(
                            models,
                            format!("tensor `{name}`: its shape is {}", describe(s)),
                        )
                    })?;
                    Ok((name.clone(), numel(&shape)?))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    Ok((groups, root))
}

pub(super) fn size(v: &Value) -> Option<Vec<u64>> {
    match v {
        Value::Tuple(x) | Value::List(x) => x.iter().map(int).collect(),
        Value::Call { args, .. } => args.items().and_then(|a| a.first()).and_then(size),
        _ => None,
    }
}

/// `fragment_address(numel, start)` as DeepSpeed pickles the dataclass (NEWOBJ, then
/// its `__dict__` BUILT into it).
fn fragment_address(numel: u64, start: u64) -> Value {
    Value::Build {
        object: Box::new(Value::Call {
            callable: Box::new(Value::Global {
                module: "deepspeed.utils.tensor_fragment".into(),
                name: "fragment_address".into(),
            }),
            args: Box::new(Value::Tuple(vec![])),
        }),
        state: Box::new(Value::Dict(vec![
            (Value::Str("numel".into()), Value::Int(numel as i64)),
            (Value::Str("start".into()), Value::Int(start as i64)),
        ])),
    }
}

/// A placeholder in a value tree for new tensor `k` (a persistent id is never a value
/// of its own in a parsed tree: it only appears inside tensor rebuild calls, which are
/// all replaced).
pub(super) fn placeholder(k: usize) -> Value {
    Value::PersistentId(Box::new(Value::Int(k as i64)))
}

/// Writes `v` as a protocol-2 pickle, with new tensors for the placeholders. Plain
/// objects (a call of a class with no arguments given a state: DeepSpeed's loss scaler,
/// `fragment_address`) are written as pickle writes them, `NEWOBJ` then `BUILD`, since
/// calling the class (`REDUCE`) may need arguments; a dict given a state (a module
/// state dict's `_metadata`) as an `OrderedDict`.
pub(super) fn emit(
    e: &mut Emitter,
    v: &Value,
    tensors: &[NewTensor],
) -> std::result::Result<(), String> {
    match v {
        Value::PersistentId(k) => {
            let key = match **k {
                Value::Int(k) => usize::try_from(k).ok(),
                _ => None,
            };
            let t = key
                .and_then(|k| tensors.get(k))
                .ok_or("a tensor ckpt does not know how to re-cut")?;
            rebuild(e, key.unwrap_or(0), &t.spec, t.requires_grad)?;
        }
        Value::Tuple(items) => {
            e.mark();
            for i in items {
                emit(e, i, tensors)?;
            }
            e.tuple();
        }
        Value::List(items) => {
            e.empty_list().mark();
            for i in items {
                emit(e, i, tensors)?;
            }
            e.appends();
        }
        Value::Dict(kv) => {
            e.empty_dict().mark();
            for (k, v) in kv {
                emit(e, k, tensors)?;
                emit(e, v, tensors)?;
            }
            e.set_items();
        }
        Value::Build { object, state } => {
            match &**object {
                Value::Call { callable, args }
                    if callable.global().is_some() && args.items().is_some_and(<[_]>::is_empty) =>
                {
                    emit(e, callable, tensors)?;
                    e.empty_tuple().new_obj();
                }
                Value::Dict(kv) => {
                    e.global("collections", "OrderedDict")
                        .empty_tuple()
                        .reduce();
                    e.mark();
                    for (k, v) in kv {
                        emit(e, k, tensors)?;
                        emit(e, v, tensors)?;
                    }
                    e.set_items();
                }
                o => emit(e, o, tensors)?,
            }
            emit(e, state, tensors)?;
            e.build();
        }
        Value::Call { callable, args } => {
            if is_tensor(v) {
                return Err("a tensor ckpt does not know how to re-cut".into());
            }
            emit(e, callable, tensors)?;
            emit(e, args, tensors)?;
            e.reduce();
        }
        leaf => {
            e.value(leaf)?;
        }
    }
    Ok(())
}

/// `torch._utils._rebuild_tensor_v2` of storage `key` (what torch.save writes for a
/// contiguous tensor).
fn rebuild(
    e: &mut Emitter,
    key: usize,
    t: &TensorSpec,
    requires_grad: bool,
) -> std::result::Result<(), String> {
    let class = storage_class(t.dtype)
        .ok_or_else(|| format!("tensor `{}`: no torch storage for its dtype", t.name))?;
    let n: u64 = t.shape.iter().product();
    crate::formats::torch_write::emit_rebuild(e, key, class, n, &t.shape, requires_grad);
    Ok(())
}

pub(super) fn requires_grad(v: &Value) -> bool {
    matches!(
        v.call_of()
            .and_then(|(_, a)| a.items())
            .and_then(|a| a.get(4)),
        Some(Value::Bool(true))
    )
}

/// A tensor found in a source file's tree: its dotted path there (`a.b.0.c`), where
/// its bytes are, and whether torch rebuilds it with `requires_grad`.
pub(super) struct Found {
    pub(super) what: String,
    pub(super) entry: TensorEntry,
    pub(super) requires_grad: bool,
}

/// A source torch.save file, mapped: its tree with every tensor replaced by a
/// placeholder numbered as `tensors`.
pub(super) struct Source {
    pub(super) path: PathBuf,
    pub(super) map: Option<crate::formats::Mapped>,
    pub(super) root: Value,
    pub(super) tensors: Vec<Found>,
    pub(super) by_what: HashMap<String, usize>,
}

impl Source {
    pub(super) fn open(path: &Path) -> Result<Source> {
        let map = map_file(path)?;
        let all: &[u8] = map.as_deref().unwrap_or(&[]);
        let (archive, mut root) = torch_save::open_archive(all).map_err(|e| e.with_path(path))?;
        let mut tensors = Vec::new();
        take_tensors(&mut root, "", &archive, &mut tensors).map_err(|e| e.with_path(path))?;
        let by_what = tensors
            .iter()
            .enumerate()
            .map(|(i, f)| (f.what.clone(), i))
            .collect();
        Ok(Source {
            path: path.to_path_buf(),
            map,
            root,
            tensors,
            by_what,
        })
    }

    pub(super) fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Tensor `what`, which must be `like` rank 0's in dtype and hold `len` elements.
    pub(super) fn part(&self, what: &str, like: &TensorEntry, len: u64) -> Result<TensorEntry> {
        let t = self
            .by_what
            .get(what)
            .map(|&i| &self.tensors[i].entry)
            .ok_or_else(|| err(&self.path, format!("no tensor `{what}` (rank 0 has one)")))?;
        if t.dtype != like.dtype || t.shape != [len] {
            return Err(err(
                &self.path,
                format!(
                    "tensor `{what}` is {:?} {:?}; {:?} [{len}] expected (rank 0's dtype, this rank's parts)",
                    t.dtype, t.shape, like.dtype
                ),
            ));
        }
        Ok(t.clone())
    }
}

pub(super) fn key_name(k: &Value) -> String {
    match k {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => "?".into(),
    }
}

/// Replaces every tensor under `v` with a placeholder, recording where its bytes are.
fn take_tensors(
    v: &mut Value,
    what: &str,
    archive: &ArchiveIndex,
    out: &mut Vec<Found>,
) -> Result<()> {
    if is_tensor(v) {
        let entry = locate_value(archive, what, v)?;
        let requires_grad = requires_grad(v);
        *v = placeholder(out.len());
        out.push(Found {
            what: what.to_string(),
            entry,
            requires_grad,
        });
        return Ok(());
    }
    let join = |k: &str| {
        if what.is_empty() {
            k.to_string()
        } else {
            format!("{what}.{k}")
        }
    };
    match v {
        Value::Tuple(items) | Value::List(items) => {
            for (i, x) in items.iter_mut().enumerate() {
                take_tensors(x, &join(&i.to_string()), archive, out)?;
            }
        }
        Value::Dict(kv) => {
            for (k, x) in kv.iter_mut() {
                let name = join(&key_name(k));
                take_tensors(x, &name, archive, out)?;
            }
        }
        Value::Build { object, state } => {
            take_tensors(object, what, archive, out)?;
            take_tensors(state, what, archive, out)?;
        }
        Value::Call { args, .. } => take_tensors(args, what, archive, out)?,
        _ => {}
    }
    Ok(())
}

/// A tensor copied whole from rank 0's file.
pub(super) fn copy_of(f: &Found) -> Result<NewTensor> {
    let n = numel(&f.entry.shape)?;
    Ok(NewTensor {
        spec: TensorSpec {
            name: f.what.clone(),
            dtype: f.entry.dtype,
            shape: f.entry.shape.clone(),
        },
        requires_grad: f.requires_grad,
        segments: if n == 0 {
            vec![]
        } else {
            vec![(0, f.entry.clone(), FlatRange::new(0, n), 0)]
        },
    })
}

/// The optimizer-states files of a tag directory in rank order (all `bf16_`-prefixed,
/// as DeepSpeed names them when bf16 is enabled, or none), the prefix, and the
/// per-rank model-states files (ZeRO-3) in rank order. DeepSpeed's BF16_Optimizer
/// files (ZeRO-1 with fp32 gradient accumulation) also carry the prefix but hold no
/// `zero_stage`: the reader refuses those before this is called.
pub(crate) fn optim_files(dir: &Path) -> Result<(String, Vec<PathBuf>, Vec<PathBuf>)> {
    let mut optim: Vec<(u64, bool, PathBuf)> = Vec::new();
    let mut models: Vec<(u64, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir)
        .map_err(|e| err(dir, e.to_string()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let (bf16, rest) = match name.strip_prefix("bf16_") {
            Some(rest) => (true, rest),
            None => (false, name.as_str()),
        };
        let Some(rank) = rest.strip_prefix("zero_pp_rank_") else {
            continue;
        };
        if let Some(r) = rank
            .strip_suffix("_mp_rank_00_optim_states.pt")
            .and_then(|r| r.parse().ok())
        {
            optim.push((r, bf16, e.path()));
        } else if let Some(r) = rank
            .strip_suffix("_mp_rank_00_model_states.pt")
            .and_then(|r| r.parse().ok())
        {
            if !bf16 {
                models.push((r, e.path()));
            }
        }
    }
    optim.sort();
    models.sort();
    let bf16 = optim.first().is_some_and(|o| o.1);
    if let Some((_, _, p)) = optim.iter().find(|o| o.1 != bf16) {
        return Err(err(
            p,
            "a tag directory with both bf16_ and plain optimizer-states files",
        ));
    }
    let prefix = if bf16 { "bf16_" } else { "" }.to_string();
    Ok((
        prefix,
        optim.into_iter().map(|o| o.2).collect(),
        models.into_iter().map(|m| m.1).collect(),
    ))
}

/// Writes one torch.save file at `dest` (staged: a temporary name, renamed by
/// `finish`): `pkl` with `tensors`, each filled from its segments, which point into
/// `maps` (a segment's source index is its map). Returns the bytes copied.
pub(super) fn write_pt(
    dest: &Path,
    tensors: &[NewTensor],
    pkl: Vec<u8>,
    maps: &[&[u8]],
) -> Result<u64> {
    let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
    let w = TorchWriter::create_with_pickle(dest, &specs, pkl)?;
    let mut bytes = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let elem = (t.spec.dtype.bitsize() / 8) as u64;
        for (src, entry, range, at) in &t.segments {
            // `locate_value` checked the entry against its file.
            let all = &maps[*src][entry.start as usize..entry.end as usize];
            let lo = (range.start * elem) as usize;
            let hi = ((range.start + range.len) * elem) as usize;
            // Bounded pieces: the copy never holds more than this beyond the maps.
            for (j, chunk) in all[lo..hi].chunks(64 << 20).enumerate() {
                w.write_at(i, at * elem + (j as u64) * (64 << 20), chunk)?;
            }
            bytes += (hi - lo) as u64;
        }
    }
    w.finish()?;
    Ok(bytes)
}

/// The sizes a ZeRO-1/2 checkpoint is written for: data-parallel ranks, and for a
/// mixture of experts the expert-parallel size (`None`: the source's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NewSizes {
    pub(crate) dp: u64,
    pub(crate) ep: Option<u64>,
}

/// Writes the ZeRO-1/2 checkpoint in `dir` (tag `tag`; its optimizer files `optim`,
/// named with `prefix`) for `dp` data-parallel ranks at `output`.
pub(crate) fn write_zero12(
    dir: &Path,
    tag: &str,
    output: &Path,
    NewSizes { dp, ep }: NewSizes,
    force: bool,
    prefix: &str,
    optim: &[PathBuf],
) -> Result<DeepSpeedWriteStats> {
    let ranks: Vec<Rank> = optim.iter().map(|p| Rank::open(p)).collect::<Result<_>>()?;
    let models = dir.join("mp_rank_00_model_states.pt");
    let (groups, model_root) = param_shapes(&models)?;
    if let Some(true) = model_root
        .get("ds_config")
        .and_then(|c| c.get("zero_optimization"))
        .and_then(|z| z.get("round_robin_gradients"))
        .map(|v| matches!(v, Value::Bool(true)))
    {
        return Err(unsupported(format!(
            "{}: round_robin_gradients reorders each group's parameters by the dp size; not written for another dp size",
            models.display()
        )));
    }
    let first = &ranks[0];
    let osd0 = first
        .root
        .get("optimizer_state_dict")
        .expect("checked in Rank::open");
    let align_pads: Vec<Vec<u64>> =
        match osd0.get("param_alignment_paddings").and_then(Value::items) {
            Some(g) => g
                .iter()
                .map(|p| ints(Some(p)).unwrap_or_default())
                .collect(),
            None => groups.iter().map(|g| vec![0; g.len()]).collect(),
        };
    if groups.len() != first.weights.len() || align_pads.len() != groups.len() {
        return Err(err(
            &models,
            format!(
                "{} parameter groups in `param_shapes`, {} flat partitions in {}",
                groups.len(),
                first.weights.len(),
                first.path.display()
            ),
        ));
    }

    // Per group: how the new ranks' partitions are made of the old ones. A dense
    // group is the old partitions end to end re-cut for `dp`; an expert group is
    // regrouped by expert first (experts.rs).
    let ngroups = groups.len();
    let world = ranks.len() as u64;
    let param_groups = osd0
        .get("base_optimizer_state")
        .and_then(|b| b.get("param_groups"))
        .and_then(Value::items)
        .unwrap_or(&[]);
    let expert_eps: Vec<Option<u64>> = (0..ngroups)
        .map(|g| param_groups.get(g).and_then(deepspeed::expert_group_ep))
        .collect();
    let old_ep = match expert_eps.iter().flatten().collect::<Vec<_>>()[..] {
        [] => None,
        [&ep] => Some(ep),
        _ => {
            return Err(unsupported(format!(
                "{}: several expert groups (experts split above DeepSpeed's group size, or several EP sizes): not re-cut",
                first.path.display()
            )))
        }
    };
    let new_ep = match (old_ep, ep) {
        (None, Some(_)) => {
            return Err(unsupported(format!(
                "{}: an EP size was given, but the checkpoint has no expert group (no `moe: True` group named ep_size_<EP>)",
                first.path.display()
            )))
        }
        (Some(old), None) => Some(old),
        (_, new) => new,
    };
    let data_before_expert = deepspeed::data_before_expert(model_root.get("ds_config"));
    let mut plans = Vec::with_capacity(ngroups);
    for g in 0..ngroups {
        let stored: Vec<u64> = ranks.iter().map(|r| r.weights[g].shape[0]).collect();
        if let (Some(old), Some(new)) = (expert_eps[g], new_ep) {
            if old == 0 || !world.is_multiple_of(old) {
                return Err(err(
                    &first.path,
                    format!("group {g} is ep_size_{old}, which does not divide the {world} data-parallel ranks"),
                ));
            }
            let grid = |world, ep| ExpertGrid {
                world,
                ep,
                data_before_expert,
            };
            plans.push(experts::plan(
                g,
                &groups[g],
                &align_pads[g],
                &stored,
                grid(world, old),
                grid(dp, new),
            )?);
            continue;
        }
        let used: u64 = stored.iter().sum();
        let params: u64 = groups[g]
            .iter()
            .zip(align_pads[g].iter().chain(std::iter::repeat(&0)))
            .map(|((_, n), p)| n + p)
            .sum();
        if params != used {
            return Err(err(
                &models,
                format!("group {g}: its parameters and alignment paddings make {params} elements, the ranks' partitions hold {used}"),
            ));
        }
        plans.push(GroupPlan::dense(
            &stored,
            dp,
            groups[g].clone(),
            align_pads[g].clone(),
        ));
    }

    let staged = StagedDir::new(output, force)?;
    let out_dir = staged.path().join(tag);
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::Io {
        path: out_dir.clone(),
        source: e,
    })?;
    let mut stats = DeepSpeedWriteStats::default();
    for r in 0..dp {
        let dest = out_dir.join(format!(
            "{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        ));
        let (tensors, pkl) = new_rank(&ranks, &plans, r).map_err(|e| e.with_path(&dest))?;
        let maps: Vec<&[u8]> = ranks
            .iter()
            .map(|k| k.map.as_deref().unwrap_or(&[]))
            .collect();
        stats.bytes += write_pt(&dest, &tensors, pkl, &maps)?;
        stats.files += 1;
        stats.tensors += tensors.len() as u64;
    }
    let models_out = out_dir.join("mp_rank_00_model_states.pt");
    if new_ep.is_some() {
        stats.bytes += model_states_for_experts(&models, &plans, dp, &models_out)?;
        stats.files += 1;
        // One file per global expert (the reader found and checked them): the same at
        // every EP size.
        for f in deepspeed::scan(dir)?
            .values()
            .flat_map(|m| m.experts.values())
        {
            let name = f.file_name().unwrap_or_default();
            stats.bytes += std::fs::copy(f, out_dir.join(name)).map_err(|source| Error::Io {
                path: f.clone(),
                source,
            })?;
            stats.files += 1;
        }
    } else {
        let model_bytes = patch_dp_world_size(&models, dp)?;
        write_file_atomic(&models_out, &model_bytes)?;
    }
    write_file_atomic(&staged.path().join("latest"), tag.as_bytes())?;
    staged.commit()?;
    Ok(stats)
}

/// New rank `r`'s tensors and its `data.pkl`: rank 0's file with the partitions, the
/// partition-shaped optimizer state, the paddings, the partition counts, the group
/// names and the parameter slice mappings the plans give.
fn new_rank(ranks: &[Rank], plans: &[GroupPlan], r: u64) -> Result<(Vec<NewTensor>, Vec<u8>)> {
    let first = &ranks[0];
    let mut root = first.root.clone();
    let mut tensors: Vec<NewTensor> = Vec::new();
    let osd = get_mut(&mut root, "optimizer_state_dict").expect("checked in Rank::open");
    let mut weights = Vec::new();
    let mut paddings = Vec::new();
    let mut mappings = Vec::new();
    for (g, plan) in plans.iter().enumerate() {
        let (b, part) = plan.place[r as usize];
        let l = plan.partition(b, part)?;
        // The copy: each run of the new partition from an old rank's stored partition.
        let seg = |pick: &dyn Fn(&Rank) -> Option<TensorEntry>| -> Result<Segments> {
            let mut out = Vec::new();
            for &(off, (k, range)) in &l.runs {
                let t = pick(&ranks[k]).ok_or_else(|| {
                    err(
                        &ranks[k].path,
                        format!("group {g}: optimizer state missing on this rank"),
                    )
                })?;
                out.push((k, t, range, off));
            }
            Ok(out)
        };
        paddings.push(Value::Int((l.partition - l.stored) as i64));
        weights.push(placeholder(tensors.len()));
        tensors.push(NewTensor {
            spec: TensorSpec {
                name: format!("single_partition_of_fp32_groups.{g}"),
                dtype: Dtype::F32,
                shape: vec![l.stored],
            },
            requires_grad: true,
            segments: seg(&|k: &Rank| Some(k.weights[g].clone()))?,
        });
        // Optimizer state: tensors as long as the padded partition are partition
        // state (Adam's moments), re-cut; any other tensor (`step`) is rank 0's.
        let mut state = Vec::new();
        for (key, t) in &first.state[g] {
            let whole = first.weights[g].shape[0] + first.paddings[g];
            let is_part = t.shape.len() == 1 && t.shape[0] == whole;
            let orig = osd_state(&first.root, g, key);
            let spec_name = format!("base_optimizer_state.state.{g}.{key}");
            let nt = if is_part {
                if t.dtype != Dtype::F32 {
                    return Err(err(
                        &first.path,
                        format!("tensor `{spec_name}` is not fp32"),
                    ));
                }
                NewTensor {
                    spec: TensorSpec {
                        name: spec_name,
                        dtype: t.dtype,
                        shape: vec![l.partition],
                    },
                    requires_grad: orig.is_some_and(requires_grad),
                    segments: seg(&|k: &Rank| {
                        k.state[g]
                            .iter()
                            .find(|(n, _)| n == key)
                            .map(|(_, t)| t.clone())
                    })?,
                }
            } else {
                let n = numel(&t.shape)?;
                NewTensor {
                    spec: TensorSpec {
                        name: spec_name,
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                    },
                    requires_grad: orig.is_some_and(requires_grad),
                    segments: vec![(0, t.clone(), FlatRange::new(0, n), 0)],
                }
            };
            state.push((key.clone(), placeholder(tensors.len())));
            tensors.push(nt);
        }
        if let Some(s) = get_mut(osd, "base_optimizer_state")
            .and_then(|b| get_mut(b, "state"))
            .and_then(dict_mut)
            .and_then(|kv| {
                kv.iter_mut()
                    .find(|(k, _)| matches!(k, Value::Int(i) if *i == g as i64))
            })
            .and_then(|(_, v)| dict_mut(v))
        {
            for (k, v) in s.iter_mut() {
                if let Value::Str(name) = k {
                    if let Some((_, p)) = state.iter().find(|(n, _)| n == name) {
                        *v = p.clone();
                    }
                }
            }
        }
        // An expert group is named by its EP size, which DeepSpeed looks its process
        // groups up by.
        if let Some(name) = &plan.name {
            if let Some(slot) = get_mut(osd, "base_optimizer_state")
                .and_then(|b| get_mut(b, "param_groups"))
                .and_then(Value::items_mut)
                .and_then(|pg| pg.get_mut(g))
                .and_then(|pg| get_mut(pg, "name"))
            {
                *slot = Value::Str(name.clone());
            }
        }
        // Which parameters' elements this partition holds, and where (what
        // `_create_param_mapping` records, for ds_to_universal).
        let mine = FlatRange::new(l.start, l.partition);
        let mut at = 0u64;
        let mut map = Vec::new();
        for ((name, n), p) in plan
            .params
            .iter()
            .zip(plan.pads.iter().chain(std::iter::repeat(&0)))
        {
            if let Some(o) = FlatRange::new(at, *n).overlap(&mine) {
                map.push((
                    Value::Str(name.clone()),
                    fragment_address(o.len, o.start - mine.start),
                ));
            }
            at = at
                .checked_add(n + p)
                .ok_or_else(|| overflow(name.as_str()))?;
        }
        mappings.push(Value::Dict(map));
    }
    let set = |osd: &mut Value, key: &str, v: Value| {
        if let Some(slot) = get_mut(osd, key) {
            *slot = v;
        }
    };
    set(osd, "single_partition_of_fp32_groups", Value::List(weights));
    set(osd, "group_paddings", Value::List(paddings));
    let count = match osd.get("partition_count") {
        Some(Value::List(_)) => {
            Value::List(plans.iter().map(|p| Value::Int(p.parts as i64)).collect())
        }
        _ => Value::Int(plans.first().map_or(1, |p| p.parts) as i64),
    };
    set(osd, "partition_count", count);
    set(osd, "param_slice_mappings", Value::List(mappings));
    if osd.get("param_alignment_paddings").is_some() {
        let pads = plans
            .iter()
            .map(|p| Value::List(p.pads.iter().map(|&x| Value::Int(x as i64)).collect()))
            .collect();
        set(osd, "param_alignment_paddings", Value::List(pads));
    }
    let mut e = Emitter::new();
    emit(&mut e, &root, &tensors).map_err(|p| err(&first.path, p))?;
    Ok((tensors, e.finish()))
}

/// The model-states file of a mixture of experts for `dp` ranks: `dp_world_size` and
/// each expert group's `param_shapes` (its local experts at the new EP size, which
/// readers such as ckpt's take the group's layout from) changed, every tensor copied.
/// Returns the bytes copied.
fn model_states_for_experts(
    models: &Path,
    plans: &[GroupPlan],
    dp: u64,
    dest: &Path,
) -> Result<u64> {
    let src = Source::open(models)?;
    let mut root = src.root.clone();
    if let Some(v) = get_mut(&mut root, "dp_world_size") {
        *v = Value::Int(dp as i64);
    }
    let shapes = get_mut(&mut root, "param_shapes")
        .and_then(Value::items_mut)
        .filter(|s| s.len() == plans.len())
        .ok_or_else(|| err(models, "`param_shapes` is not a list of one dict per group"))?;
    for (g, plan) in plans.iter().enumerate() {
        if plan.name.is_none() {
            continue;
        }
        let kv = dict_mut(&mut shapes[g])
            .ok_or_else(|| err(models, format!("`param_shapes[{g}]` is not a dict")))?;
        // Every local expert has local expert 0's shapes.
        let new = plan
            .params
            .iter()
            .map(|(name, _)| {
                let zero = experts::as_local_expert_zero(name);
                kv.iter()
                    .find(|(k, _)| matches!(k, Value::Str(s) if *s == zero))
                    .map(|(_, v)| (Value::Str(name.clone()), v.clone()))
                    .ok_or_else(|| err(models, format!("`param_shapes[{g}]` has no `{zero}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        *kv = new;
    }
    let tensors = src
        .tensors
        .iter()
        .map(copy_of)
        .collect::<Result<Vec<_>>>()?;
    let mut e = Emitter::new();
    emit(&mut e, &root, &tensors).map_err(|p| err(models, p))?;
    write_pt(dest, &tensors, e.finish(), &[src.bytes()])
}

fn osd_state<'a>(root: &'a Value, g: usize, key: &str) -> Option<&'a Value> {
    let osd = root.get("optimizer_state_dict")?;
    group_states(osd)?
        .get(g)?
        .iter()
        .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
        .map(|(_, v)| v)
}

/// The model-states file with `dp_world_size` set to `dp`, every other byte as
/// DeepSpeed wrote it: the integer is rewritten in place in `data.pkl` (same opcode,
/// so same length) and the entry's CRC-32 updated in the zip headers.
fn patch_dp_world_size(models: &Path, dp: u64) -> Result<Vec<u8>> {
    let mut bytes = crate::formats::read_small(models)?;
    let bad = |p: String| err(models, p);
    let (data_at, len, header_at, central_at) = {
        let mut z = zip::ZipArchive::new(std::io::Cursor::new(&bytes[..]))
            .map_err(|e| bad(format!("not a zip archive: {e}")))?;
        let name = z
            .file_names()
            .filter_map(std::result::Result::ok)
            .find(|n| n.ends_with("/data.pkl"))
            .map(std::borrow::Cow::into_owned)
            .ok_or_else(|| bad("no data.pkl".into()))?;
        let f = z.by_name(&name).map_err(|e| bad(e.to_string()))?;
        if f.compression() != zip::CompressionMethod::Stored {
            return Err(bad("data.pkl is compressed".into()));
        }
        let at = f
            .data_start()
            .ok_or_else(|| bad("data.pkl has no data offset".into()))?;
        (
            at as usize,
            f.size() as usize,
            f.header_start() as usize,
            f.central_header_start() as usize,
        )
    };
    let pkl = &mut bytes[data_at..data_at + len];
    let key = b"X\x0d\x00\x00\x00dp_world_size";
    let at = pkl
        .windows(key.len())
        .position(|w| w == key)
        .ok_or_else(|| bad("no `dp_world_size` in data.pkl".into()))?;
    let mut i = at + key.len();
    // A memo store may follow the key (BINPUT n, LONG_BINPUT n).
    match pkl.get(i) {
        Some(b'q') => i += 2,
        Some(b'r') => i += 5,
        _ => {}
    }
    let width = match pkl.get(i) {
        Some(b'K') => 1,
        Some(b'M') => 2,
        Some(b'J') => 4,
        _ => return Err(bad("`dp_world_size` is not a small integer".into())),
    };
    if width < 4 && dp >= 1 << (8 * width) {
        return Err(unsupported(format!(
            "{}: dp_world_size {dp} does not fit where the source's is stored ({width} byte(s))",
            models.display()
        )));
    }
    let v = u32::try_from(dp).map_err(|_| overflow("dp_world_size"))?;
    pkl.get_mut(i + 1..i + 1 + width)
        .ok_or_else(|| bad("data.pkl truncated".into()))?
        .copy_from_slice(&v.to_le_bytes()[..width]);
    let crc = crc32fast::hash(&bytes[data_at..data_at + len]).to_le_bytes();
    // torch writes the CRC after the data (flag bit 3, a data descriptor, its
    // signature optional) and zero in the local header; others in the local header.
    let flags = u16::from_le_bytes([bytes[header_at + 6], bytes[header_at + 7]]);
    let local = if flags & 8 != 0 {
        let d = data_at + len;
        if bytes.get(d..d + 4) == Some(&b"PK\x07\x08"[..]) {
            d + 4
        } else {
            d
        }
    } else {
        header_at + 14
    };
    bytes
        .get_mut(local..local + 4)
        .ok_or_else(|| bad("the zip entry of data.pkl is truncated".into()))?
        .copy_from_slice(&crc);
    bytes[central_at + 16..central_at + 20].copy_from_slice(&crc);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::flat::{FlatLayout, FlatSlot};
    use proptest::prelude::*;

    /// DeepSpeed's own cut (stage_1_and_2.py: align to 2 * dp, dp equal parts, the
    /// padding counted on the ranks it falls on), written out for comparison.
    fn deepspeed_cut(used: u64, dp: u64) -> Vec<(u64, u64)> {
        let alignment = 2 * dp;
        let aligned = used.div_ceil(alignment) * alignment;
        let size = aligned / dp;
        (0..dp)
            .map(|r| {
                let left = r * size;
                let padding = if used <= left {
                    size
                } else {
                    (left + size).saturating_sub(used)
                };
                (size - padding, padding)
            })
            .collect()
    }

    proptest! {
        /// Re-cutting the stored partitions of dp=a for dp=b and back for dp=a gives
        /// every partition back element for element, and the paddings agree with
        /// DeepSpeed's rule at every step.
        #[test]
        fn recut_there_and_back_is_the_identity(used in 0u64..300, a in 1u64..7, b in 1u64..7) {
            let old: Vec<(u64, u64)> = deepspeed_cut(used, a);
            // Element i of the group's stream is i.
            let stream_of = |parts: &[Vec<u64>]| parts.concat();
            let mut at = 0;
            let src: Vec<Vec<u64>> = old.iter().map(|&(n, _)| { let v = (at..at + n).collect(); at += n; v }).collect();
            let recut = |parts: &[Vec<u64>], dp: u64| -> Vec<Vec<u64>> {
                let stored: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
                let l = FlatLayout::aligned(&stored, dp, 2 * dp).unwrap();
                (0..dp).map(|r| {
                    let n = l.partition.min(l.used.saturating_sub(r * l.partition));
                    let mut out = vec![u64::MAX; n as usize];
                    for (off, s) in l.partition_slots(r) {
                        if let FlatSlot::Tensor { tensor, range } = s {
                            for k in 0..range.len {
                                out[(off + k) as usize] = parts[tensor][(range.start + k) as usize];
                            }
                        }
                    }
                    out
                }).collect()
            };
            let mid = recut(&src, b);
            let want: Vec<u64> = deepspeed_cut(used, b).iter().map(|x| x.0).collect();
            prop_assert_eq!(mid.iter().map(|p| p.len() as u64).collect::<Vec<_>>(), want);
            prop_assert_eq!(stream_of(&mid), (0..used).collect::<Vec<_>>());
            prop_assert_eq!(recut(&mid, a), src);
        }
    }

    #[test]
    fn deepspeed_cut_worked_example() {
        // 127 elements on 3 ranks: aligned to 6 -> 132, 44 each; the last holds 39.
        assert_eq!(deepspeed_cut(127, 3), vec![(44, 0), (44, 0), (39, 5)]);
        let l = FlatLayout::aligned(&[78, 49], 3, 6).unwrap();
        assert_eq!(
            l.partition_slots(1),
            vec![
                (
                    0,
                    FlatSlot::Tensor {
                        tensor: 0,
                        range: FlatRange::new(44, 34)
                    }
                ),
                (
                    34,
                    FlatSlot::Tensor {
                        tensor: 1,
                        range: FlatRange::new(0, 10)
                    }
                ),
            ]
        );
    }
}
