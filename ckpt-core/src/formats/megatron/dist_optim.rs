//! Megatron dist_ckpt's distributed optimizer state saved `dp_reshardable` (Megatron-LM's
//! default with `--use-distributed-optimizer --ckpt-format torch_dist`), mapped from its
//! per-bucket flat tensors to the parameters, so that it reads as the
//! `fully_reshardable` state does: `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`,
//! shaped and placed like the model tensor `<key>`.
//!
//! The layout, from megatron-core 0.16.1
//! (`DistributedOptimizer.sharded_param_state_dp_reshardable`; docs/formats.md,
//! "dp_reshardable"): per (tp, pp) domain `i` (`data_parallel_group_idx`, the rank in
//! the tp-pp group: `tp_rank + pp_rank × tp`), per grad buffer `g`, its dtype pair `d`
//! and bucket `b`, one 1-D tensor per state,
//! `optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<d>.bucket_idx_<b>.<state>`,
//! of the bucket's `numel_unpadded` elements: the bucket's buffer positions as
//! they are (parameters in reverse order, each start padded to 64 elements), every dp
//! rank's slices of parameters and of padding saved as chunks at their offsets, the
//! padding `torch.empty` (not zero). Beside them the ShardedObjects
//! `...dp_group_idx_<i>.per_bucket_numel` and `per_bucket_numel_unpadded`: per buffer
//! `{(param_dtype, grad_dtype): [numel per bucket]}`, pickled in the .distcp.
//!
//! Which element is which parameter's is not in the files: it is the buffer layout
//! [`buffer_layout`] computes (as for `distrib_optim.pt`) from the domain's parameters
//! in module order — the model tensors of the dist_ckpt in the order its metadata lists
//! them, layer by layer for the stage's layers, the tensors before the layers on the
//! first stage and those after on the last (GPTModel's) — and the args in `common.pt`.
//! The layout is checked against the file: the buckets' sizes against
//! `per_bucket_numel_unpadded` and the tensors' lengths, every chunk inside one
//! parameter or inside padding. Each chunk of a parameter becomes chunks of the
//! parameter's state tensor (its boxes, [`FlatRange::boxes`]), the padding chunks are
//! dropped. A parameter replicated over tensor-parallel ranks (one model chunk for all)
//! is read from tensor-parallel rank 0's domain, as the model tensor is.

use super::optim::{buffer_layout, err, Ddp, Param, STATES};
use super::{common_object, pickled, Args, COMMON_FILE};
use crate::error::{overflow, Error, Result};
use crate::formats::distcp::{ChunkPart, DcpChunk, DcpMetadata, DcpTensor};
use crate::formats::map_file;
use crate::formats::pickle::Value;
use crate::layout::flat::FlatRange;
use std::collections::BTreeMap;
use std::path::Path;

/// The prefix of every key the distributed optimizer's dist_ckpt state has.
const PREFIX: &str = "optimizer.distributed.dp_group_idx_";

/// A bucket tensor's key, parsed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct BucketKey {
    domain: u64,
    gbuf: usize,
    /// As megatron formats the dtype pair: `(torch.float32, torch.float32)`.
    dtype: String,
    bucket: usize,
    state: String,
}

/// `optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<d>.bucket_idx_<b>.<state>`,
/// or `None` for another key.
fn bucket_key(key: &str) -> Option<BucketKey> {
    let rest = key.strip_prefix(PREFIX)?;
    let (domain, rest) = rest.split_once(".gbuf_idx_")?;
    let (gbuf, rest) = rest.split_once(".dtype_")?;
    let (dtype, rest) = rest.rsplit_once(".bucket_idx_")?;
    let (bucket, state) = rest.split_once('.')?;
    Some(BucketKey {
        domain: domain.parse().ok()?,
        gbuf: gbuf.parse().ok()?,
        dtype: dtype.to_string(),
        bucket: bucket.parse().ok()?,
        state: state.to_string(),
    })
}

/// A `per_bucket_numel[_unpadded]` object: per grad buffer, its dtype pair (formatted
/// as megatron formats it in the bucket keys) and the numel of each bucket.
pub(crate) type PerBucketNumel = Vec<(String, Vec<u64>)>;

/// Reads a pickled `per_bucket_numel[_unpadded]` ShardedObject (megatron's torch_dist
/// saves `[data]`, data a list per buffer of `{(param_dtype, grad_dtype): [numel, ...]}`).
///
/// # Errors
/// Not a torch.save archive, a global outside Megatron's list, or another shape of
/// value (said).
pub(crate) fn parse_per_bucket_numel(bytes: &[u8]) -> Result<PerBucketNumel> {
    let obj = pickled::object(bytes)?;
    let shape = || Error::InvalidTorch {
        problem: format!(
            "not `[[{{(param_dtype, grad_dtype): [numel, ...]}}, ...]]` but {}",
            crate::formats::torch_save::describe(&obj)
        ),
    };
    let [buffers] = obj.items().ok_or_else(shape)? else {
        return Err(shape());
    };
    let mut out = Vec::new();
    for b in buffers.items().ok_or_else(shape)? {
        let Value::Dict(kv) = b else {
            return Err(shape());
        };
        let [(Value::Tuple(pair), Value::List(numels))] = &kv[..] else {
            return Err(shape());
        };
        let names: Option<Vec<String>> = pair
            .iter()
            .map(|d| match d.global() {
                Some(("torch", n)) => Some(format!("torch.{n}")),
                _ => None,
            })
            .collect();
        let numels: Option<Vec<u64>> = numels
            .iter()
            .map(|n| match n {
                Value::Int(i) => u64::try_from(*i).ok(),
                _ => None,
            })
            .collect();
        let (Some(names), Some(numels)) = (names, numels) else {
            return Err(shape());
        };
        out.push((format!("({})", names.join(", ")), numels));
    }
    Ok(out)
}

/// A parameter of a domain: where its model chunk lies in the model tensor.
#[derive(Clone, Debug)]
struct Placed {
    key: String,
    /// The chunk's offsets and sizes in the model tensor (a layer's chunk keeps the
    /// layer dimension, of size 1: the same elements in the same order).
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    /// Whether this domain's state of it is the one read (tp rank 0 for a parameter
    /// replicated over tensor-parallel ranks).
    read: bool,
}

/// The model parameters of domain (tp_rank, pp_rank) in module order.
fn domain_params(
    m: &DcpMetadata,
    args: &Args,
    meta: &Path,
    tp_rank: u64,
    pp_rank: u64,
) -> Result<Vec<Placed>> {
    let model: Vec<&String> = m
        .order
        .iter()
        .filter(|k| !k.starts_with("optimizer."))
        .collect();
    let is_layer = |k: &str| k.starts_with("decoder.layers.");
    let first = model.iter().position(|k| is_layer(k));
    let last = model.iter().rposition(|k| is_layer(k));
    let layers: Vec<&String> = model.iter().copied().filter(|k| is_layer(k)).collect();
    let num_layers = args.num_layers.ok_or_else(|| {
        err(meta, "common.pt's args have no num_layers: needed to know which layers each pipeline stage holds")
    })?;
    if num_layers % args.pp != 0 {
        return Err(err(
            meta,
            format!(
                "{num_layers} layers on {} pipeline stages: not uniform stages",
                args.pp
            ),
        ));
    }
    let per = num_layers / args.pp;
    // The domain's chunk of a model tensor (of one layer: `layer`), found among the
    // tensor's chunks: the one chunk when it is replicated, else tp_rank's of tp.
    let chunk_of = |key: &str, layer: Option<u64>| -> Result<Placed> {
        let mut cs: Vec<&DcpChunk> = m
            .chunks
            .iter()
            .filter(|c| c.fqn == key && layer.is_none_or(|l| c.offsets.first() == Some(&l)))
            .collect();
        cs.sort_by(|a, b| a.offsets.cmp(&b.offsets));
        let at = |c: &DcpChunk, read: bool| Placed {
            key: key.to_string(),
            offsets: c.offsets.clone(),
            sizes: c.sizes.clone(),
            read,
        };
        match cs.len() {
            1 => Ok(at(cs[0], tp_rank == 0)),
            n if n as u64 == args.tp => Ok(at(cs[tp_rank as usize], true)),
            n => Err(err(
                meta,
                format!(
                    "model tensor `{key}`{}: {n} chunks, neither one (replicated) nor one per tensor-parallel rank ({}): which part is tensor-parallel rank {tp_rank}'s parameter is not known",
                    layer.map_or(String::new(), |l| format!(" layer {l}")),
                    args.tp
                ),
            )),
        }
    };
    let mut out = Vec::new();
    if pp_rank == 0 {
        for k in &model[..first.unwrap_or(model.len())] {
            out.push(chunk_of(k, None)?);
        }
    }
    for l in pp_rank * per..(pp_rank + 1) * per {
        for k in &layers {
            let t = &m.tensors[k.as_str()];
            if t.shape.first() != Some(&num_layers) {
                return Err(err(
                    meta,
                    format!(
                        "model tensor `{k}` is {:?}, not the {num_layers} layers stacked along dimension 0",
                        t.shape
                    ),
                ));
            }
            out.push(chunk_of(k, Some(l))?);
        }
    }
    if pp_rank + 1 == args.pp {
        if let Some(last) = last {
            for k in &model[last + 1..] {
                out.push(chunk_of(k, None)?);
            }
        }
    }
    Ok(out)
}

/// The `per_bucket_numel_unpadded` object of domain `i`, read from where the metadata
/// says it is stored.
fn read_per_bucket_numel(dir: &Path, m: &DcpMetadata, domain: u64) -> Result<PerBucketNumel> {
    let name = format!("{PREFIX}{domain}.per_bucket_numel_unpadded");
    let meta = dir.join(crate::formats::distcp::METADATA_FILE);
    let found: Vec<(&String, _)> = m
        .bytes_at
        .iter()
        .filter(|(k, _)| k.split_once('/').is_some_and(|(k, _)| k == name))
        .collect();
    let [(_, at)] = found[..] else {
        return Err(err(
            &meta,
            format!(
                "{} `{name}` object(s): needed (one) to check the bucket sizes of the optimizer state",
                found.len()
            ),
        ));
    };
    let path = dir.join(&at.file);
    let map = map_file(&path)?;
    let all: &[u8] = map.as_deref().unwrap_or(&[]);
    let bytes = usize::try_from(at.start)
        .ok()
        .zip(
            at.start
                .checked_add(at.len)
                .and_then(|e| usize::try_from(e).ok()),
        )
        .and_then(|(s, e)| all.get(s..e))
        .ok_or_else(|| {
            err(
                &path,
                format!(
                    "`{name}` lies at bytes {}+{}, past the end of the file ({} bytes): truncated?",
                    at.start,
                    at.len,
                    all.len()
                ),
            )
        })?;
    parse_per_bucket_numel(bytes).map_err(|e| err(&path, format!("`{name}`: {e}")))
}

/// What megatron-core calls the states of `optimizer.state.<state>.<key>`, and the
/// name each gets after `optim.<key>.`: the fp32 master weight is `param` in
/// `fully_reshardable` and `dp_reshardable`, `fp32_param` in
/// `fully_sharded_model_space`.
const DIST_STATES: [(&str, &str); 4] = [
    ("param", "fp32"),
    ("fp32_param", "fp32"),
    ("exp_avg", "exp_avg"),
    ("exp_avg_sq", "exp_avg_sq"),
];

/// Renames the distributed optimizer's states of a dist_ckpt, whichever sharding type
/// saved them (`optimizer.state.<state>.<key>`; for `dp_reshardable`, after
/// [`map_buckets`]), as ckpt names every optimizer state it reads:
/// `optim.<key>.{fp32,exp_avg,exp_avg_sq}`, the names `distrib_optim.pt` and DeepSpeed's
/// states get. So a merge puts them in optimizer.safetensors and model.safetensors
/// holds the weights only. Other keys are left as they are.
///
/// # Errors
/// Two tensors that would get one name (a master weight saved as both `param` and
/// `fp32_param`).
pub(crate) fn name_states(dir: &Path, m: &mut DcpMetadata) -> Result<()> {
    let renamed: BTreeMap<String, String> = m
        .tensors
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix("optimizer.state.")?;
            DIST_STATES.iter().find_map(|(state, to)| {
                let key = rest.strip_prefix(state)?.strip_prefix('.')?;
                Some((k.clone(), super::optim::state_name(key, to)))
            })
        })
        .collect();
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (from, to) in &renamed {
        if let Some(other) = seen.insert(to, from) {
            return Err(err(
                &dir.join(crate::formats::distcp::METADATA_FILE),
                format!("`{other}` and `{from}` are both the state `{to}`: which one is the master weight is not ckpt's to guess"),
            ));
        }
        if m.tensors.contains_key(to) {
            return Err(err(
                &dir.join(crate::formats::distcp::METADATA_FILE),
                format!("`{from}` is the state `{to}`, a name the checkpoint already holds"),
            ));
        }
    }
    let rename = |k: &mut String| {
        if let Some(to) = renamed.get(k.as_str()) {
            *k = to.clone();
        }
    };
    m.tensors = std::mem::take(&mut m.tensors)
        .into_iter()
        .map(|(mut k, t)| {
            rename(&mut k);
            (k, t)
        })
        .collect();
    m.order.iter_mut().for_each(rename);
    m.chunks.iter_mut().for_each(|c| rename(&mut c.fqn));
    Ok(())
}

/// Maps the dp_reshardable bucket tensors of a Megatron dist_ckpt's metadata to
/// per-parameter state tensors (see the module's description); a metadata without them
/// is left as it is.
///
/// # Errors
/// [`Error::InvalidMegatronOptim`] naming the file and what is wrong: no args in
/// `common.pt`, a bucket tensor missing or of another length, a `per_bucket_numel_
/// unpadded` that the model's parameters do not make, a chunk across a parameter's
/// edge; [`Error::Unsupported`] for what is not read yet (virtual or uneven pipeline
/// stages, tied embeddings on several stages, states other than Adam's).
/// Leaves the distributed optimizer's bucket entries out of `m` (a save whose model is
/// all that is wanted, and whose buckets cannot be placed); the note that says so, or
/// `None` where there were none.
pub(crate) fn drop_buckets(dir: &Path, m: &mut DcpMetadata) -> Option<String> {
    let buckets: Vec<String> = m
        .tensors
        .keys()
        .filter(|k| bucket_key(k).is_some())
        .cloned()
        .collect();
    if buckets.is_empty() {
        return None;
    }
    for k in &buckets {
        m.tensors.remove(k);
    }
    m.order.retain(|n| bucket_key(n).is_none());
    m.chunks.retain(|c| bucket_key(&c.fqn).is_none());
    Some(format!(
        "{}: the distributed optimizer's {} bucket entries are not read (their layout needs Megatron-LM's args, which this save does not record; the model's tensors do not)",
        dir.display(),
        buckets.len()
    ))
}

pub(crate) fn map_buckets(dir: &Path, m: &mut DcpMetadata) -> Result<()> {
    let buckets: BTreeMap<BucketKey, String> = m
        .tensors
        .keys()
        .filter_map(|k| bucket_key(k).map(|b| (b, k.clone())))
        .collect();
    if buckets.is_empty() {
        return Ok(());
    }
    let meta = dir.join(crate::formats::distcp::METADATA_FILE);
    let common = dir.join(COMMON_FILE);
    let args_value = common_object(&common)
        .map_err(|e| err(&common, format!("needed for the optimizer state's layout: {e}")))?
        .get("args")
        .cloned()
        .ok_or_else(|| {
            err(
                &common,
                "no `args`: the run's args are needed to compute the distributed optimizer's bucket layout (megatron-core's own save, as Megatron-Bridge writes it; the model alone: --format hf)",
            )
        })?;
    let args = Args::from_value(&args_value, &common)?;
    let ddp = Ddp::from_args(&args_value, &common)?;
    let unsupported = |what: String| Error::Unsupported {
        problem: format!(
            "{}: the distributed optimizer's dp_reshardable state {what}: not read yet",
            dir.display()
        ),
    };
    if args.vp.is_some_and(|v| v > 1) {
        return Err(unsupported("with virtual pipeline stages".into()));
    }
    if let Some(key) = &args.uneven {
        return Err(unsupported(format!(
            "with uneven pipeline stages (args.{key})"
        )));
    }
    if ddp.tied && args.pp > 1 {
        return Err(unsupported(
            "with the embedding and output layer tied over several pipeline stages (the last stage's copy has no model tensor of its own)".into(),
        ));
    }
    if let Some(b) = buckets
        .keys()
        .find(|b| !STATES.iter().any(|(s, _)| *s == b.state))
    {
        return Err(unsupported(format!(
            "with the state `{}` (Adam's param, exp_avg and exp_avg_sq are read)",
            b.state
        )));
    }
    let domains = args
        .tp
        .checked_mul(args.pp)
        .ok_or_else(|| overflow("tp x pp"))?;
    if let Some(b) = buckets.keys().find(|b| b.domain >= domains) {
        return Err(err(
            &meta,
            format!(
                "dp_group_idx_{}: args say tensor parallel {} x pipeline {}, {domains} domains",
                b.domain, args.tp, args.pp
            ),
        ));
    }
    let mut new_chunks = Vec::new();
    let mut new_tensors: BTreeMap<String, DcpTensor> = BTreeMap::new();
    for domain in 0..domains {
        let (tp_rank, pp_rank) = (domain % args.tp, domain / args.tp);
        let placed = domain_params(m, &args, &meta, tp_rank, pp_rank)?;
        let params: Vec<Param> = placed
            .iter()
            .map(|p| Param {
                name: p.key.clone(),
                local: p.key.clone(),
                shape: p.sizes.clone(),
                dtype: m.tensors[&p.key].dtype,
                chunk: 0,
            })
            .collect();
        let layout = buffer_layout(&params, &ddp, pp_rank, args.pp)?;
        let in_file = read_per_bucket_numel(dir, m, domain)?;
        let made: Vec<&Vec<u64>> = layout.buckets.iter().collect();
        let said: Vec<&Vec<u64>> = in_file.iter().map(|(_, n)| n).collect();
        if made != said {
            return Err(err(
                &meta,
                format!(
                    "dp_group_idx_{domain}.per_bucket_numel_unpadded says {said:?}, but the model tensors of tensor-parallel rank {tp_rank}, pipeline stage {pp_rank} make buckets of {made:?} (args: bucket size, overlap_grad_reduce, data-parallel size): bucket sizes do not add up to the parameters"
                ),
            ));
        }
        for (g, (dtype, sizes)) in in_file.iter().enumerate() {
            for (b, &n) in sizes.iter().enumerate() {
                for (state, _) in STATES {
                    let want = BucketKey {
                        domain,
                        gbuf: g,
                        dtype: dtype.clone(),
                        bucket: b,
                        state: state.to_string(),
                    };
                    let name = format!(
                        "{PREFIX}{domain}.gbuf_idx_{g}.dtype_{dtype}.bucket_idx_{b}.{state}"
                    );
                    let Some(key) = buckets.get(&want) else {
                        return Err(err(
                            &meta,
                            format!(
                                "`{name}`: missing, yet per_bucket_numel_unpadded has this bucket"
                            ),
                        ));
                    };
                    let t = &m.tensors[key];
                    if t.shape != [n] {
                        return Err(err(
                            &meta,
                            format!("`{name}` is {:?}, but the bucket holds {n} elements (per_bucket_numel_unpadded)", t.shape),
                        ));
                    }
                    for c in m.chunks.iter().filter(|c| &c.fqn == key) {
                        let r = FlatRange::new(c.offsets[0], c.sizes[0]);
                        let owner = layout
                            .params
                            .iter()
                            .zip(&layout.in_bucket)
                            .filter(|((_, pg, _), (pb, _))| *pg == g && *pb == b)
                            .find_map(|((i, _, _), (_, pr))| pr.overlap(&r).map(|_| (*i, *pr)));
                        let Some((i, pr)) = owner else {
                            continue; // padding
                        };
                        let p = &placed[i];
                        if r.start < pr.start || r.end()? > pr.end()? {
                            return Err(err(
                                &meta,
                                format!(
                                    "`{name}`: the chunk at {} reaches past parameter `{}` ({} of the bucket): the layout computed from args is not this file's",
                                    r, p.key, pr
                                ),
                            ));
                        }
                        if !p.read {
                            continue;
                        }
                        let fqn = format!("optimizer.state.{state}.{}", p.key);
                        new_tensors.insert(
                            fqn.clone(),
                            DcpTensor {
                                dtype: t.dtype,
                                shape: m.tensors[&p.key].shape.clone(),
                            },
                        );
                        let local = FlatRange::new(r.start - pr.start, r.len);
                        for bx in local.boxes(&p.sizes)? {
                            let offsets = p
                                .offsets
                                .iter()
                                .zip(&bx.region.start)
                                .map(|(a, b)| {
                                    a.checked_add(*b).ok_or_else(|| overflow(fqn.as_str()))
                                })
                                .collect::<Result<Vec<u64>>>()?;
                            let len = bx.region.numel();
                            new_chunks.push(DcpChunk {
                                fqn: fqn.clone(),
                                offsets,
                                sizes: bx.region.shape.to_vec(),
                                file: c.file.clone(),
                                start: c.start,
                                len: c.len,
                                part: Some(ChunkPart {
                                    stored: c.sizes.clone(),
                                    elements: FlatRange::new(bx.offset, len),
                                }),
                                flat: None,
                            });
                        }
                    }
                }
            }
        }
        // A bucket the file has beyond those per_bucket_numel_unpadded lists.
        if let Some(b) = buckets.keys().find(|b| {
            b.domain == domain
                && in_file
                    .get(b.gbuf)
                    .is_none_or(|(d, n)| *d != b.dtype || b.bucket >= n.len())
        }) {
            return Err(err(
                &meta,
                format!(
                    "`{}`: a bucket that dp_group_idx_{domain}.per_bucket_numel_unpadded does not list ({in_file:?})",
                    buckets[b]
                ),
            ));
        }
    }
    if let Some(k) = new_tensors.keys().find(|k| m.tensors.contains_key(*k)) {
        return Err(err(
            &meta,
            format!("`{k}` is both saved (fully_reshardable) and made from the dp_reshardable buckets: two optimizer states"),
        ));
    }
    m.chunks.retain(|c| bucket_key(&c.fqn).is_none());
    m.chunks.extend(new_chunks);
    m.chunks.sort_by(|a, b| {
        (&a.file, a.start, &a.fqn, &a.offsets).cmp(&(&b.file, b.start, &b.fqn, &b.offsets))
    });
    m.tensors.retain(|k, _| bucket_key(k).is_none());
    m.order.retain(|k| bucket_key(k).is_none());
    m.order.extend(new_tensors.keys().cloned());
    m.tensors.extend(new_tensors);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(names: &[&str]) -> DcpMetadata {
        let t = DcpTensor {
            dtype: crate::layout::Dtype::F32,
            shape: vec![4],
        };
        DcpMetadata {
            tensors: names.iter().map(|n| (n.to_string(), t.clone())).collect(),
            order: names.iter().map(|n| n.to_string()).collect(),
            bytes: Vec::new(),
            bytes_at: BTreeMap::new(),
            chunks: Vec::new(),
        }
    }

    /// Every sharding type's state names become `optim.<key>.<state>`; other keys stay;
    /// a master weight under both of megatron-core's names is refused by name.
    #[test]
    fn optimizer_states_get_ckpts_names() {
        let mut m = metadata(&[
            "decoder.w",
            "optimizer.state.fp32_param.decoder.w",
            "optimizer.state.exp_avg.decoder.w",
            "optimizer.state.exp_avg_sq.decoder.w",
            "optimizer.state.param.embedding.e",
            "optimizer.state.momentum_buffer.decoder.w",
        ]);
        name_states(Path::new("d"), &mut m).unwrap();
        let names: Vec<&str> = m.tensors.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "decoder.w",
                "optim.decoder.w.exp_avg",
                "optim.decoder.w.exp_avg_sq",
                "optim.decoder.w.fp32",
                "optim.embedding.e.fp32",
                "optimizer.state.momentum_buffer.decoder.w",
            ]
        );
        assert_eq!(m.order[1], "optim.decoder.w.fp32");
        let mut both = metadata(&[
            "optimizer.state.param.decoder.w",
            "optimizer.state.fp32_param.decoder.w",
        ]);
        let e = name_states(Path::new("d"), &mut both)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("optimizer.state.fp32_param.decoder.w")
                && e.contains("optimizer.state.param.decoder.w")
                && e.contains("d/.metadata"),
            "{e}"
        );
    }

    #[test]
    fn bucket_keys_are_parsed_with_the_dtype_pair_as_megatron_formats_it() {
        let k = "optimizer.distributed.dp_group_idx_3.gbuf_idx_0.dtype_(torch.float32, torch.bfloat16).bucket_idx_12.exp_avg_sq";
        assert_eq!(
            bucket_key(k),
            Some(BucketKey {
                domain: 3,
                gbuf: 0,
                dtype: "(torch.float32, torch.bfloat16)".into(),
                bucket: 12,
                state: "exp_avg_sq".into(),
            })
        );
        assert_eq!(
            bucket_key("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"),
            None
        );
        assert_eq!(
            bucket_key("optimizer.state.param.output_layer.weight"),
            None
        );
    }
}
