//! Megatron's distributed optimizer state in a legacy checkpoint
//! (`mp_rank_TT[_PPP]/distrib_optim.pt`, beside `model_optim_rng.pt`), read as the fp32
//! master weights and Adam moments of every parameter: `optim.<name>.fp32`,
//! `optim.<name>.exp_avg`, `optim.<name>.exp_avg_sq` under the global names the model
//! tensors get.
//!
//! The layout, from megatron-core 0.16.1 (described in docs/formats.md, "Megatron's
//! distributed optimizer"): `DistributedOptimizer.save_parameter_state` writes, on data-
//! parallel rank 0 of each (tp, pp) rank, get_parameter_state_dp_zero's dict
//! `{"buckets_coalesced": True, gbuf_idx: {(param_dtype, grad_dtype): {"param",
//! "exp_avg", "exp_avg_sq": fp32[numel_unpadded], "numel_unpadded": int}}}`: per grad
//! buffer (one per model chunk and dtype pair), the buffer's buckets back to back, each
//! without the padding at its end, every data-parallel rank's shard gathered in. Which
//! element is which parameter's is not in the file: it is the buffer's layout, which
//! `_ParamAndGradBuffer` computes from the model's parameters (in reverse order, each
//! start padded to a multiple of 64, a new bucket once `bucket_size` elements are
//! collected) and DistributedDataParallel's settings, which Megatron-LM's args hold.
//! [`buffer_layout`] repeats that computation; each parameter is then a flat range of
//! its buffer ([`crate::layout::flat`]) checked to cover the buffer with the padding,
//! and the padding (zeros, where get_parameter_state_dp_zero leaves its shards
//! unwritten) is checked to be zero.

use super::pickled::{allowed, namespace_fields};
use crate::error::{overflow, Error, Result};
use crate::formats::pickle::Value;
use crate::formats::torch_save::{self, describe, locate_value};
use crate::formats::{map_file, FileFormat, TensorEntry, TensorFile};
use crate::layout::flat::{check_flat_cover, numel, FlatRange};
use crate::layout::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A (tp, pp) rank's distributed optimizer file.
pub(crate) const FILE: &str = "distrib_optim.pt";
/// The `format` metadata of the files this module makes.
pub(crate) const FORMAT: &str = "megatron.distrib_optim";
/// The per-parameter states of the file, and the name each gets after `optim.<name>.`.
pub(crate) const STATES: [(&str, &str); 3] = [
    ("param", "fp32"),
    ("exp_avg", "exp_avg"),
    ("exp_avg_sq", "exp_avg_sq"),
];
/// `_pad_start_of_param_if_needed`: parameters start at multiples of 64 elements.
const PARAM_ALIGN: u64 = 64;

pub(super) fn err(path: &Path, problem: impl Into<String>) -> Error {
    Error::InvalidMegatronOptim {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The name of a state of parameter `name`.
pub(crate) fn state_name(name: &str, state: &str) -> String {
    format!("optim.{name}.{state}")
}

/// DistributedDataParallel's settings that fix the buffers' layout, from the run's args
/// (Megatron-LM's `ddp_bucket_size`, `overlap_grad_reduce`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ddp {
    /// `args.ddp_bucket_size` (None: DistributedDataParallel's default).
    pub(crate) bucket_size: Option<u64>,
    /// `args.data_parallel_size` (the default bucket size follows it).
    pub(crate) dp: u64,
    /// The data-parallel size of the buffer's group, whose multiple of 128 pads bucket
    /// ends: `dp` for the dense parameters, the expert-DP size for the experts'.
    pub(crate) buffer_dp: u64,
    /// `args.overlap_grad_reduce`: without it there is one bucket per buffer.
    pub(crate) overlap_grad_reduce: bool,
    /// `args.overlap_param_gather_with_optimizer_step`: disables bucketing too.
    pub(crate) gather_with_step: bool,
    /// Embedding and output layer tied (not `args.untie_embeddings_and_output_weights`).
    pub(crate) tied: bool,
}

impl Ddp {
    /// Reads the settings from the pickled `args`; `path` is for messages.
    ///
    /// # Errors
    /// `args` is not a Namespace; a setting of the wrong type; a run that did not use the
    /// distributed optimizer.
    pub(crate) fn from_args(args: &Value, path: &Path) -> Result<Ddp> {
        let fields = namespace_fields(args)
            .ok_or_else(|| err(path, "`args` is not an argparse.Namespace"))?;
        let get = |key: &str| {
            fields
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v)
        };
        let int = |key: &str| -> Result<Option<u64>> {
            match get(key) {
                None | Some(Value::None) => Ok(None),
                Some(Value::Int(i)) if *i > 0 => Ok(Some(*i as u64)),
                Some(other) => Err(err(
                    path,
                    format!("args.{key} is {}, not a positive integer", describe(other)),
                )),
            }
        };
        let flag = |key: &str| matches!(get(key), Some(Value::Bool(true)));
        if matches!(get("use_distributed_optimizer"), Some(Value::Bool(false))) {
            return Err(err(
                path,
                "args.use_distributed_optimizer is False, yet the rank directory holds distrib_optim.pt",
            ));
        }
        // (`ddp_pad_buckets_for_high_nccl_busbw` changes only the padding at bucket
        // ends, which the file leaves out.)
        if flag("use_megatron_fsdp") || flag("use_custom_fsdp") {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: args say Megatron FSDP, whose optimizer state is not this layout",
                    path.display()
                ),
            });
        }
        let dp = int("data_parallel_size")?.unwrap_or(1);
        Ok(Ddp {
            bucket_size: int("ddp_bucket_size")?,
            dp,
            buffer_dp: dp,
            overlap_grad_reduce: flag("overlap_grad_reduce"),
            gather_with_step: flag("overlap_param_gather_with_optimizer_step"),
            tied: !flag("untie_embeddings_and_output_weights"),
        })
    }

    /// The bucket size of a model chunk's buffers on pipeline stage `pp_rank`:
    /// DistributedDataParallel's default `max(40000000, 1000000 * dp)`, none without
    /// overlap_grad_reduce, on stages after the first, and (Megatron-LM's
    /// `disable_bucketing`) on chunks after the first or with the param gather
    /// overlapped with the optimizer step.
    fn bucket_size(&self, pp_rank: u64, chunk: u64) -> Option<u64> {
        if !self.overlap_grad_reduce || pp_rank > 0 || chunk > 0 || self.gather_with_step {
            return None;
        }
        Some(
            self.bucket_size
                .unwrap_or_else(|| self.dp.saturating_mul(1_000_000).max(40_000_000)),
        )
    }
}

/// A model parameter of a rank, in the order of the module's parameters.
#[derive(Clone, Debug)]
pub(crate) struct Param {
    /// The global name (model tensors' names).
    pub(crate) name: String,
    /// The name in the rank's state dict (`embedding.word_embeddings.weight`, ...).
    pub(crate) local: String,
    /// The shape this rank holds.
    pub(crate) shape: Vec<u64>,
    /// The model's dtype of it (buffers group parameters by dtype).
    pub(crate) dtype: Dtype,
    /// Model chunk (virtual pipeline stage).
    pub(crate) chunk: u64,
}

/// Where every parameter lies in the coalesced buffers of a rank's file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BufferLayout {
    /// `(param index, gbuf index, range in that buffer's world tensors)`, per parameter.
    pub(crate) params: Vec<(usize, usize, FlatRange)>,
    /// Per entry of `params`: the bucket of its buffer it is in, and its range in that
    /// bucket (what dist_ckpt's dp_reshardable tensors, one per bucket, hold).
    pub(crate) in_bucket: Vec<(usize, FlatRange)>,
    /// `numel_unpadded` of each buffer: its buckets' unpadded sizes summed.
    pub(crate) numel_unpadded: Vec<u64>,
    /// Per buffer, the elements no parameter holds (each parameter's start padding).
    pub(crate) padding: Vec<Vec<FlatRange>>,
    /// Per buffer, its buckets' unpadded sizes.
    pub(crate) buckets: Vec<Vec<u64>>,
}

/// `_ParamAndGradBuffer`'s layout of a rank's parameters, coalesced as
/// get_parameter_state_dp_zero saves it (each bucket without its end padding).
///
/// Buffers: per model chunk, one per parameter dtype in order of first appearance
/// (DistributedDataParallel's `param_and_grad_dtype_to_params`); the optimizer numbers
/// them chunk by chunk. Within a buffer the parameters go in reverse order, each start
/// padded to a multiple of 64; a bucket closes once it holds `bucket_size` elements, or
/// after a shared embedding (tied embedding and output layer on several stages), which
/// also opens a bucket of its own.
///
/// # Errors
/// Size arithmetic that overflows.
pub(crate) fn buffer_layout(
    params: &[Param],
    ddp: &Ddp,
    pp_rank: u64,
    pp: u64,
) -> Result<BufferLayout> {
    let mut groups: Vec<(u64, Dtype, Vec<usize>)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        match groups
            .iter_mut()
            .find(|(c, d, _)| *c == p.chunk && *d == p.dtype)
        {
            Some(g) => g.2.push(i),
            None => groups.push((p.chunk, p.dtype, vec![i])),
        }
    }
    // Chunks in order, dtypes in order of first appearance within each.
    groups.sort_by_key(|g| g.0);
    let shared = |p: &Param| {
        ddp.tied
            && pp > 1
            && ((pp_rank == 0 && p.local == "embedding.word_embeddings.weight")
                || (pp_rank == pp - 1 && p.local == "output_layer.weight"))
    };
    let mut out = BufferLayout {
        params: Vec::with_capacity(params.len()),
        in_bucket: Vec::with_capacity(params.len()),
        numel_unpadded: Vec::new(),
        padding: Vec::new(),
        buckets: Vec::new(),
    };
    for (g, (chunk, _, members)) in groups.iter().enumerate() {
        let bucket_size = ddp.bucket_size(pp_rank, *chunk);
        // Positions in the buffer as Megatron computes them, then moved into the
        // coalesced tensor: bucket `b` starts there at the sum of the earlier buckets'
        // unpadded sizes. Bucket starts are multiples of lcm(dp, 128), hence of 64: the
        // parameters' alignment is the same counted from either origin.
        let mut placed: Vec<(usize, u64, u64, usize)> = Vec::new();
        let mut bucket_unpadded: Vec<u64> = Vec::new();
        let mut bucket_start = 0u64;
        let mut start = 0u64;
        let mut end = 0u64;
        let mut in_bucket = 0usize;
        let close = |end: u64,
                     bucket_start: &mut u64,
                     in_bucket: &mut usize,
                     bucket_unpadded: &mut Vec<u64>|
         -> Result<u64> {
            bucket_unpadded.push(end - *bucket_start);
            // Bucket ends are padded (to a multiple of lcm(dp, 128)); only where the
            // next bucket starts in the buffer depends on it, not the coalesced tensor.
            let lcm = lcm(ddp.buffer_dp, 128);
            let padded = end
                .checked_next_multiple_of(lcm)
                .ok_or_else(|| overflow("bucket end"))?;
            *bucket_start = padded;
            *in_bucket = 0;
            Ok(padded)
        };
        for &i in members.iter().rev() {
            let p = &params[i];
            let n = numel(&p.shape)?;
            start = start
                .checked_next_multiple_of(PARAM_ALIGN)
                .ok_or_else(|| overflow("parameter start"))?;
            if shared(p) && in_bucket > 0 {
                start = close(
                    start,
                    &mut bucket_start,
                    &mut in_bucket,
                    &mut bucket_unpadded,
                )?;
            }
            end = start
                .checked_add(n)
                .ok_or_else(|| overflow(p.name.as_str()))?;
            placed.push((i, start, end, bucket_unpadded.len()));
            in_bucket += 1;
            if bucket_size.is_some_and(|b| end - bucket_start >= b) || shared(p) {
                start = close(end, &mut bucket_start, &mut in_bucket, &mut bucket_unpadded)?;
            } else {
                start = end;
            }
        }
        if in_bucket > 0 {
            close(end, &mut bucket_start, &mut in_bucket, &mut bucket_unpadded)?;
        }
        // Bucket b's origin in the buffer and in the coalesced tensor.
        let mut origins: Vec<(u64, u64)> = Vec::with_capacity(bucket_unpadded.len());
        {
            let mut coalesced = 0u64;
            let mut buf = 0u64;
            for &u in &bucket_unpadded {
                origins.push((buf, coalesced));
                coalesced += u;
                buf = (buf + u).next_multiple_of(lcm(ddp.buffer_dp, 128));
            }
        }
        let total: u64 = bucket_unpadded.iter().sum();
        let mut ranges = Vec::with_capacity(placed.len());
        for (i, s, e, b) in placed {
            let (buf, co) = origins[b];
            let r = FlatRange::new(s - buf + co, e - s);
            out.params.push((i, g, r));
            out.in_bucket.push((b, FlatRange::new(s - buf, e - s)));
            ranges.push(r);
        }
        ranges.sort();
        let mut padding = Vec::new();
        let mut at = 0u64;
        for r in &ranges {
            if r.start > at {
                padding.push(FlatRange::new(at, r.start - at));
            }
            at = r.start + r.len;
        }
        if total > at {
            padding.push(FlatRange::new(at, total - at));
        }
        out.numel_unpadded.push(total);
        out.padding.push(padding);
        out.buckets.push(bucket_unpadded);
    }
    Ok(out)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    let a = a.max(1);
    a / gcd(a, b) * b
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// Reads one rank's `distrib_optim.pt`: every parameter's three states as entries of
/// the rank's local shape, named `optim.<global>.<state>`, in F32.
///
/// # Errors
/// [`Error::InvalidMegatronOptim`] naming the file (and tensor): not a readable
/// torch.save archive (truncated), not the dp_zero layout, a buffer whose
/// `numel_unpadded` or state length differs from what the parameters and args make
/// ("bucket sizes do not add up"), padding that is not zero, a global that is not
/// allowed; [`Error::Unsupported`] for layouts not read (several chained optimizers,
/// the pre-`buckets_coalesced` per-bucket lists).
pub(crate) fn read(path: &Path, parts: &[Option<(&[Param], &BufferLayout)>]) -> Result<TensorFile> {
    let map = map_file(path)?;
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let (archive, root) = torch_save::open_archive(all).map_err(|e| err(path, e.to_string()))?;
    let mut names = Vec::new();
    root.globals(&mut names);
    if let Some((m, n)) = names.into_iter().find(|(m, n)| !allowed(m, n)) {
        return Err(err(
            path,
            format!("data.pkl names the global `{m}.{n}`, which a distributed optimizer file does not hold"),
        ));
    }
    // ChainedOptimizer.save_parameter_state: one optimizer's dict as is, several as a
    // list (`None` for those this rank is not data-parallel rank 0 of).
    let roots: Vec<&Value> = match &root {
        Value::List(v) if v.len() == 1 && parts.len() == 1 => vec![&v[0]],
        Value::List(v) if parts.len() == 1 => {
            return Err(Error::Unsupported {
                problem: format!(
                "{}: the states of {} chained optimizers (several parameter dtypes): not read yet",
                path.display(),
                v.len()
            ),
            })
        }
        Value::List(v) => v.iter().collect(),
        v => vec![v],
    };
    if roots.len() != parts.len() {
        return Err(err(
            path,
            format!(
                "{} optimizer state(s), but a model with experts has {} chained optimizers (dense, expert)",
                roots.len(),
                parts.len()
            ),
        ));
    }
    let mut entries = Vec::new();
    for (k, (root, part)) in roots.into_iter().zip(parts).enumerate() {
        let which = match parts.len() {
            1 => String::new(),
            _ if k == 0 => "dense optimizer's ".to_string(),
            _ => "expert optimizer's ".to_string(),
        };
        match (root, part) {
            (Value::None, None) => {}
            (Value::None, Some(_)) => {
                return Err(err(
                    path,
                    format!("the {which}state is None, but this rank's directory holds its parameters (as data-parallel rank 0)"),
                ))
            }
            (_, None) => {
                return Err(err(
                    path,
                    format!("holds a {which}state, but this rank's directory holds none of its parameters"),
                ))
            }
            (root, Some((params, layout))) => {
                entries.extend(read_states(path, all, &archive, root, params, layout, &which)?);
            }
        }
    }
    let metadata = BTreeMap::from([("format".to_string(), FORMAT.to_string())]);
    TensorFile::from_parts(path, map, FileFormat::TorchSave, entries, metadata)
}

/// The entries of one optimizer's `get_parameter_state_dp_zero` dict `root`: every
/// parameter's three states, as flat ranges of the buffers `layout` places them in.
fn read_states(
    path: &Path,
    all: &[u8],
    archive: &torch_save::ArchiveIndex,
    root: &Value,
    params: &[Param],
    layout: &BufferLayout,
    which: &str,
) -> Result<Vec<TensorEntry>> {
    let Value::Dict(top) = root else {
        return Err(err(
            path,
            format!("the saved object is {}, not a dict", describe(root)),
        ));
    };
    match root.get("buckets_coalesced") {
        Some(Value::Bool(true)) => {}
        _ => {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: no `buckets_coalesced: True`: the per-bucket layout of older Megatron releases is not read",
                    path.display()
                ),
            })
        }
    }
    let buffers: Vec<(u64, &Value)> = top
        .iter()
        .filter_map(|(k, v)| int(k).map(|k| (k, v)))
        .collect();
    let want = layout.numel_unpadded.len() as u64;
    if buffers.len() as u64 != want || buffers.iter().any(|(k, _)| *k >= want) {
        return Err(err(
            path,
            format!(
                "{which}{} grad buffer(s) ({:?}), but the parameters of this rank make {want} (one per model chunk and dtype)",
                buffers.len(),
                buffers.iter().map(|(k, _)| *k).collect::<Vec<_>>()
            ),
        ));
    }
    // Per buffer: the three state tensors, located.
    let mut located: Vec<[TensorEntry; 3]> = Vec::with_capacity(buffers.len());
    for g in 0..want {
        let (_, v) = buffers
            .iter()
            .find(|(k, _)| *k == g)
            .expect("checked above");
        let Value::Dict(by_dtype) = v else {
            return Err(err(
                path,
                format!("{which}buffer {g} is {}, not a dict", describe(v)),
            ));
        };
        let [(_, states)] = &by_dtype[..] else {
            return Err(err(
                path,
                format!(
                    "{which}buffer {g} has {} dtype entries; megatron-core saves one",
                    by_dtype.len()
                ),
            ));
        };
        let n = layout.numel_unpadded[g as usize];
        let file_n = states.get("numel_unpadded").and_then(int);
        if file_n != Some(n) {
            return Err(err(
                path,
                format!(
                    "{which}buffer {g}: numel_unpadded is {}, but the rank's parameters make {n} elements in buckets of {:?} (args: bucket size, overlap_grad_reduce, data-parallel size): bucket sizes do not add up to the parameters",
                    file_n.map_or_else(|| "absent".to_string(), |x| x.to_string()),
                    layout.buckets[g as usize]
                ),
            ));
        }
        let mut three = Vec::with_capacity(3);
        for (key, _) in STATES {
            let v = states
                .get(key)
                .ok_or_else(|| err(path, format!("{which}buffer {g}: no `{key}`")))?;
            let what = format!("{which}buffer {g} {key}");
            let t = locate_value(archive, &what, v).map_err(|e| err(path, e.to_string()))?;
            if t.dtype != Dtype::F32 || t.shape != [n] {
                return Err(err(
                    path,
                    format!(
                        "{what} is {:?} {:?}, not F32 [{n}]: bucket sizes do not add up to the parameters",
                        t.dtype, t.shape
                    ),
                ));
            }
            three.push(t);
        }
        located.push(three.try_into().expect("three states"));
    }
    // Every element once: the parameters and the padding between them.
    for (g, n) in layout.numel_unpadded.iter().enumerate() {
        let mut cover: Vec<FlatRange> = layout
            .params
            .iter()
            .filter(|(_, b, _)| *b == g)
            .map(|(_, _, r)| *r)
            .collect();
        cover.extend(layout.padding[g].iter().copied());
        check_flat_cover(*n, &cover).map_err(|d| {
            err(
                path,
                format!("{which}buffer {g}: the layout does not tile it: {d}"),
            )
        })?;
        // get_parameter_state_dp_zero copies only the parameters into zeroed shards.
        for t in &located[g] {
            for pad in &layout.padding[g] {
                let a = t.start + pad.start * 4;
                let b = a + pad.len * 4;
                let bytes = all.get(a as usize..b as usize).unwrap_or(&[]);
                if let Some(i) = bytes.iter().position(|&x| x != 0) {
                    return Err(err(
                        path,
                        format!(
                            "{}: element {} is padding between parameters, which megatron-core leaves zero, but it is not: the layout computed from args is not this file's",
                            t.name,
                            pad.start + i as u64 / 4
                        ),
                    ));
                }
            }
        }
    }
    let mut entries = Vec::with_capacity(layout.params.len() * 3);
    for &(i, g, r) in &layout.params {
        let p = &params[i];
        for (k, (_, state)) in STATES.iter().enumerate() {
            let src = &located[g][k];
            let start = r
                .start
                .checked_mul(4)
                .and_then(|x| x.checked_add(src.start))
                .ok_or_else(|| overflow(p.name.as_str()))?;
            let end = r
                .len
                .checked_mul(4)
                .and_then(|x| x.checked_add(start))
                .ok_or_else(|| overflow(p.name.as_str()))?;
            entries.push(TensorEntry {
                name: state_name(&p.name, state),
                dtype: Dtype::F32,
                shape: p.shape.clone(),
                start,
                end,
                offsets: None,
            });
        }
    }
    Ok(entries)
}

/// A mixture of experts' parallel sizes, which split the distributed optimizer in two
/// (docs/moe.md, "The distributed optimizer with experts").
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertParallel {
    pub(crate) tp: u64,
    pub(crate) etp: u64,
    pub(crate) ep: u64,
}

/// Reads the `distrib_optim.pt` of every rank (`optim`: mesh rank, tp, pp and the
/// file; all ranks or none must have one) into `files`, and gives each state the
/// layout of its parameter (in F32) in `strategy`, so that the states are placed,
/// merged and resharded as the model tensors are. `args`/`first` are the pickled args
/// and the file they came from.
///
/// # Errors
/// A rank directory without the file when others have it; virtual pipeline stages (not
/// read yet); as [`read`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn attach(
    files: &mut Vec<(u64, TensorFile)>,
    strategy: &mut crate::layout::strategy::Strategy,
    optim: &[(u64, u64, Option<PathBuf>)],
    args: &Value,
    first: &Path,
    pp: u64,
    vp: Option<u64>,
    experts: Option<ExpertParallel>,
    rank_file: impl Fn(u64) -> PathBuf,
) -> Result<()> {
    let have = optim.iter().filter(|(_, _, f)| f.is_some()).count();
    if have == 0 {
        return Ok(());
    }
    let missing: Vec<Error> = optim
        .iter()
        .filter(|(_, _, f)| f.is_none())
        .map(|(rank, _, _)| {
            err(
                &rank_file(*rank).with_file_name(FILE),
                format!(
                    "missing: {have} of {} rank directories hold the distributed optimizer's state, this one does not",
                    optim.len()
                ),
            )
        })
        .collect();
    if !missing.is_empty() {
        return Err(Error::Many(crate::error::Problems(missing)));
    }
    if vp.is_some_and(|v| v > 1) {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: the distributed optimizer's state with virtual pipeline stages is not read yet (--exclude 'optim.*' is not enough: remove the distrib_optim.pt files to read the weights)",
                first.display()
            ),
        });
    }
    let ddp = Ddp::from_args(args, first)?;
    // The expert parameters' buffers are sharded over the expert-data-parallel group:
    // the processes of a stage (DP x TP) over the expert TP x EP ranks.
    let expert_ddp = match experts {
        Some(x) => {
            let per_stage = ddp
                .dp
                .checked_mul(x.tp)
                .ok_or_else(|| overflow("DP x TP"))?;
            let grid = x
                .etp
                .checked_mul(x.ep)
                .ok_or_else(|| overflow("ETP x EP"))?;
            if per_stage % grid != 0 {
                return Err(err(
                    first,
                    format!(
                        "args.data_parallel_size {} x tensor parallel {} is not a multiple of expert tensor parallel {} x expert parallel {}",
                        ddp.dp, x.tp, x.etp, x.ep
                    ),
                ));
            }
            Some(Ddp {
                buffer_dp: per_stage / grid,
                ..ddp.clone()
            })
        }
        None => None,
    };
    for (rank, pp_rank, path) in optim {
        let path = path.as_ref().expect("checked above");
        let model = files
            .iter()
            .find(|(r, _)| r == rank)
            .map(|(_, f)| f)
            .expect("every rank's model file is read first");
        let params: Vec<Param> = model
            .tensors()
            .iter()
            .filter(|t| !super::names::is_buffer_name(&t.name))
            .map(|t| Param {
                name: t.name.clone(),
                // Only non-layer names are compared (the shared embedding), and those
                // are the same globally and per stage.
                local: t.name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype,
                chunk: 0,
            })
            .collect();
        let f = match &expert_ddp {
            None => {
                let layout = buffer_layout(&params, &ddp, *pp_rank, pp)?;
                read(path, &[Some((&params, &layout))])?
            }
            Some(expert_ddp) => {
                // A ChainedOptimizer of the dense and the expert parameters
                // (DistributedDataParallel's `allreduce == False` ones), each in module
                // order; a directory holds the dense ones where it is their
                // data-parallel rank 0's (expert-parallel rank 0).
                let (expert, dense): (Vec<Param>, Vec<Param>) = params
                    .iter()
                    .cloned()
                    .partition(|p| super::names::is_expert_name(&p.name));
                let dense_layout = buffer_layout(&dense, &ddp, *pp_rank, pp)?;
                let expert_layout = buffer_layout(&expert, expert_ddp, *pp_rank, pp)?;
                let dense_part = (!dense.is_empty()).then_some((&dense[..], &dense_layout));
                let expert_part = (!expert.is_empty()).then_some((&expert[..], &expert_layout));
                read(path, &[dense_part, expert_part])?
            }
        };
        for p in &params {
            let Some(base) = strategy.tensors.get(&p.name).cloned() else {
                continue;
            };
            for (_, state) in STATES {
                let name = state_name(&p.name, state);
                if !strategy.tensors.contains_key(&name) {
                    let mut l = base.clone();
                    l.dtype = Dtype::F32;
                    strategy.insert(name, l)?;
                }
            }
        }
        files.push((*rank, f));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, shape: &[u64]) -> Param {
        Param {
            name: name.into(),
            local: name.into(),
            shape: shape.to_vec(),
            dtype: Dtype::F32,
            chunk: 0,
        }
    }

    fn ddp(bucket: Option<u64>) -> Ddp {
        Ddp {
            bucket_size: bucket,
            dp: 2,
            buffer_dp: 2,
            overlap_grad_reduce: bucket.is_some(),
            gather_with_step: false,
            tied: false,
        }
    }

    #[test]
    fn params_go_in_reverse_each_start_aligned_to_64() {
        let ps = [p("a", &[10]), p("b", &[3, 7]), p("c", &[64])];
        let l = buffer_layout(&ps, &ddp(None), 0, 1).unwrap();
        // c at 0..64, b at 64..85, a at 128..138 (85 padded to 128).
        assert_eq!(
            l.params,
            vec![
                (2, 0, FlatRange::new(0, 64)),
                (1, 0, FlatRange::new(64, 21)),
                (0, 0, FlatRange::new(128, 10)),
            ]
        );
        assert_eq!(l.numel_unpadded, vec![138]);
        assert_eq!(l.padding, vec![vec![FlatRange::new(85, 43)]]);
    }

    #[test]
    fn buckets_close_at_bucket_size_and_lose_their_end_padding() {
        // Bucket size 100: c (0..64), b (64..85) -> 85 < 100; a (128..138) -> 138 >= 100:
        // bucket 0 = 0..138, then d in a new bucket at 256 in the buffer, 138 coalesced.
        let ps = [p("d", &[5]), p("a", &[10]), p("b", &[21]), p("c", &[64])];
        let l = buffer_layout(&ps, &ddp(Some(100)), 0, 1).unwrap();
        assert_eq!(l.buckets, vec![vec![138, 5]]);
        assert_eq!(l.params[3], (0, 0, FlatRange::new(138, 5)));
        // d is the whole of bucket 1 (which starts at 256 in the buffer).
        assert_eq!(l.in_bucket[3], (1, FlatRange::new(0, 5)));
        assert_eq!(l.in_bucket[2], (0, FlatRange::new(128, 10)));
        // On later pipeline stages there is no bucketing.
        let l1 = buffer_layout(&ps, &ddp(Some(100)), 1, 2).unwrap();
        assert_eq!(l1.buckets, vec![vec![197]]);
    }
}
