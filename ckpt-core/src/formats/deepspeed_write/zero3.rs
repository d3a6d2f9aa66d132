//! Writing a DeepSpeed ZeRO-3 checkpoint for another data-parallel size (the ZeRO-3
//! half of `ckpt reshard ckpt/ --to N --format deepspeed`; ZeRO-1/2 are in
//! [`super`]). Layout in docs/formats.md, "DeepSpeed: writing for
//! another data-parallel size".
//!
//! Read from deepspeed/runtime/zero/stage3.py, partition_parameters.py and
//! runtime/engine.py (0.19.8):
//! - every trainable parameter of `numel` elements is cut alone into `dp` parts of
//!   `ceil(numel / dp)` elements (`_aligned_size`, `_partition_param`); the last part's
//!   tail past `numel` is padding (`torch.empty`: whatever memory held, so not checked);
//! - each optimizer parameter group is split into sub-groups (`_create_fp16_sub_groups`:
//!   parameters in order, a sub-group closed once its parts' sizes reach
//!   `zero_optimization.sub_group_size`, default 1e9, or at the group's last parameter);
//!   a rank's `fp32_flat_groups[s]` is its parts of sub-group `s`'s parameters end to
//!   end, and `param_shapes[s]` names them. The split depends on the parts' sizes, hence
//!   on dp: a source whose split for the new dp differs from its own is refused by name
//!   (the torch optimizer's state would have to be regrouped);
//! - `optimizer_state_dict` (torch's `state_dict()` with one flat parameter per
//!   sub-group, numbered as the sub-groups) holds tensors laid out as the flat groups
//!   (Adam's `exp_avg`, `exp_avg_sq`) and others the same on every rank (`step`);
//! - `_rigid_load_state_dict` loads rank r's optimizer file alone, the flat groups
//!   copied into tensors of the loading run's sizes; `engine._load_checkpoint` reads
//!   rank r's `zero_pp_rank_r_mp_rank_00_model_states.pt`, refuses a `dp_world_size`
//!   other than its own, and copies `frozen_param_fragments[name]` (rank r's part of
//!   each frozen parameter, cut like trainable ones) into the parameter's partition.
//!
//! So rank r of the new size gets: rank 0's optimizer file with the flat groups and
//! the flat-group-shaped state re-cut parameter by parameter and `partition_count` set
//! to dp; rank 0's model-states file (module with its buffers, shapes, config, steps)
//! with `dp_world_size` set to dp and its frozen fragments re-cut. Padding is written
//! as zeros.

use super::zero12::{
    copy_of, dict, emit, err, get_mut, int, ints, key_name, param_shapes, size, unsupported,
    write_pt, DeepSpeedWriteStats, Found, NewTensor, Segments, Source,
};
use crate::error::{overflow, Error, Result};
use crate::formats::output::{write_file_atomic, StagedDir};
use crate::formats::pickle::{Emitter, Value};
use crate::formats::writer::TensorSpec;
use crate::formats::{torch_save, TensorEntry};
use crate::layout::flat::{numel, FlatRange};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// DeepSpeed's default `zero_optimization.sub_group_size` (runtime/zero/config.py).
const DEFAULT_SUB_GROUP_SIZE: u64 = 1_000_000_000;

const FLAT: &str = "optimizer_state_dict.fp32_flat_groups.";
const STATE: &str = "optimizer_state_dict.optimizer_state_dict.state.";
const FROZEN: &str = "frozen_param_fragments.";

/// How `_create_fp16_sub_groups` splits one parameter group of parameters of these
/// element counts on `dp` ranks: the number of parameters in each sub-group.
fn sub_groups(numels: &[u64], dp: u64, sub_group_size: u64) -> Vec<usize> {
    let parts: Vec<u64> = numels.iter().map(|n| n.div_ceil(dp)).collect();
    let total = parts.iter().fold(0u64, |a, p| a.saturating_add(*p));
    if sub_group_size >= total {
        return vec![numels.len()];
    }
    let mut out = Vec::new();
    let (mut count, mut acc) = (0usize, 0u64);
    for (i, p) in parts.iter().enumerate() {
        count += 1;
        acc = acc.saturating_add(*p);
        if acc >= sub_group_size || i + 1 == parts.len() {
            out.push(count);
            count = 0;
            acc = 0;
        }
    }
    out
}

/// New rank `r` of `b`'s part of parameters of these element counts, laid end to end,
/// from the `a` old ranks' (`src(k)`: old rank k's tensor): the new length and where
/// each element comes from. Elements past a parameter's end are left out (zero).
fn recut(
    numels: &[u64],
    a: u64,
    b: u64,
    r: u64,
    src: &dyn Fn(usize) -> Result<TensorEntry>,
) -> Result<(u64, Segments)> {
    let mut entries: Vec<Option<TensorEntry>> = vec![None; a as usize];
    let mut segs = Vec::new();
    let (mut old_at, mut new_at) = (0u64, 0u64);
    for &n in numels {
        let (po, pn) = (n.div_ceil(a), n.div_ceil(b));
        let first = r.saturating_mul(pn);
        let mine = FlatRange::new(first, pn.min(n.saturating_sub(first)));
        for k in 0..a {
            let theirs = FlatRange::new(k * po, po.min(n.saturating_sub(k * po)));
            let Some(o) = mine.overlap(&theirs) else {
                continue;
            };
            let e = match &entries[k as usize] {
                Some(e) => e.clone(),
                None => {
                    let e = src(k as usize)?;
                    entries[k as usize] = Some(e.clone());
                    e
                }
            };
            segs.push((
                k as usize,
                e,
                FlatRange::new(old_at + (o.start - theirs.start), o.len),
                new_at + (o.start - first),
            ));
        }
        old_at = old_at
            .checked_add(po)
            .ok_or_else(|| overflow("flat group"))?;
        new_at = new_at
            .checked_add(pn)
            .ok_or_else(|| overflow("flat group"))?;
    }
    Ok((new_at, segs))
}

/// `f` re-cut for new rank `r` of `b`: parameters of `numels`, old rank k's tensor
/// the same path in `sources[k]`.
fn recut_of(f: &Found, numels: &[u64], sources: &[Source], b: u64, r: u64) -> Result<NewTensor> {
    let a = sources.len() as u64;
    let old_len = numels
        .iter()
        .try_fold(0u64, |s, n| s.checked_add(n.div_ceil(a)))
        .ok_or_else(|| overflow(f.what.as_str()))?;
    let (len, segments) = recut(numels, a, b, r, &|k| {
        sources[k].part(&f.what, &f.entry, old_len)
    })?;
    Ok(NewTensor {
        spec: TensorSpec {
            name: f.what.clone(),
            dtype: f.entry.dtype,
            shape: vec![len],
        },
        requires_grad: f.requires_grad,
        segments,
    })
}

fn set(root: &mut Value, path: &[&str], v: Value) {
    let mut at = root;
    for k in path {
        match get_mut(at, k) {
            Some(x) => at = x,
            None => return,
        }
    }
    *at = v;
}

/// Writes the ZeRO-3 checkpoint in tag directory `dir` (optimizer files `optim`, in
/// rank order, named with `prefix`) for `dp` ranks at `output`, all of it or nothing.
pub(crate) fn write_zero3(
    dir: &Path,
    tag: &str,
    output: &Path,
    dp: u64,
    force: bool,
    prefix: &str,
    optim: &[PathBuf],
) -> Result<DeepSpeedWriteStats> {
    let a = optim.len() as u64;
    let opts: Vec<Source> = optim
        .iter()
        .map(|p| Source::open(p))
        .collect::<Result<_>>()?;
    let model_paths: Vec<PathBuf> = (0..a)
        .map(|r| dir.join(format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt")))
        .collect();
    let models: Vec<Source> = model_paths
        .iter()
        .map(|p| Source::open(p))
        .collect::<Result<_>>()?;
    let (o0, m0) = (&opts[0], &models[0]);
    let osd = o0
        .root
        .get("optimizer_state_dict")
        .ok_or_else(|| err(&o0.path, "no `optimizer_state_dict`"))?;
    if osd.get("zero_stage").and_then(int) != Some(3) {
        return Err(err(
            &o0.path,
            "`zero_stage` is not 3 beside per-rank model states",
        ));
    }
    if osd.get("ds_zero_partition_groups").is_some() {
        return Err(unsupported(format!(
            "{}: an AutoEP ZeRO-3 checkpoint (`ds_zero_partition_groups`): DeepSpeed loads those only with the same placement",
            o0.path.display()
        )));
    }
    if osd.get("partition_count").and_then(int) != Some(a) {
        return Err(err(
            &o0.path,
            format!("`partition_count` is not {a}, the number of optimizer files"),
        ));
    }
    let (shapes, _) = param_shapes(&model_paths[0])?;
    let nsub = osd
        .get("fp32_flat_groups")
        .and_then(Value::items)
        .map_or(0, <[Value]>::len);
    if nsub != shapes.len() {
        return Err(err(
            &o0.path,
            format!(
                "{nsub} flat groups, {} sub-groups in `param_shapes` of {}",
                shapes.len(),
                model_paths[0].display()
            ),
        ));
    }
    let numels: Vec<Vec<u64>> = shapes
        .iter()
        .map(|g| g.iter().map(|(_, n)| *n).collect())
        .collect();

    // The sub-groups of each optimizer parameter group (numbered in order), and the
    // split DeepSpeed makes of them on the old and the new dp size.
    let groups: Vec<Vec<u64>> = osd
        .get("optimizer_state_dict")
        .and_then(|o| o.get("param_groups"))
        .and_then(Value::items)
        .ok_or_else(|| err(&o0.path, "no `optimizer_state_dict.param_groups`"))?
        .iter()
        .map(|g| ints(g.get("params")))
        .collect::<Option<_>>()
        .ok_or_else(|| err(&o0.path, "a param group without a `params` list"))?;
    if !groups.iter().flatten().copied().eq(0..nsub as u64) {
        return Err(err(
            &o0.path,
            format!(
                "the optimizer's param groups hold sub-groups {groups:?}, not 0..{nsub} in order"
            ),
        ));
    }
    let zero = m0
        .root
        .get("ds_config")
        .and_then(|c| c.get("zero_optimization"));
    let sub_group_size = match zero.and_then(|z| z.get("sub_group_size")) {
        None | Some(Value::None) => DEFAULT_SUB_GROUP_SIZE,
        Some(Value::Int(i)) if *i >= 0 => *i as u64,
        Some(Value::Float(f)) if *f >= 0.0 && f.fract() == 0.0 && *f < 1.8e19 => *f as u64,
        Some(v) => {
            return Err(err(
                &model_paths[0],
                format!(
                    "`ds_config.zero_optimization.sub_group_size` is {}",
                    torch_save::describe(v)
                ),
            ))
        }
    };
    for (g, subs) in groups.iter().enumerate() {
        let params: Vec<u64> = subs
            .iter()
            .flat_map(|&s| numels[s as usize].iter().copied())
            .collect();
        let stored: Vec<usize> = subs.iter().map(|&s| numels[s as usize].len()).collect();
        if sub_groups(&params, a, sub_group_size) != stored {
            return Err(unsupported(format!(
                "{}: param group {g}'s sub-groups ({stored:?} parameters) are not what sub_group_size {sub_group_size} gives on {a} ranks (another DeepSpeed version or config?): not written for another dp size",
                model_paths[0].display()
            )));
        }
        let new = sub_groups(&params, dp, sub_group_size);
        if new != stored {
            return Err(unsupported(format!(
                "{}: on {dp} ranks, sub_group_size {sub_group_size} splits param group {g} into sub-groups of {new:?} parameters, on {a} ranks of {stored:?}: DeepSpeed's optimizer state would have to be regrouped, which ckpt does not write",
                model_paths[0].display()
            )));
        }
    }
    // Frozen parameters' element counts, by name.
    let frozen: HashMap<String, u64> = match m0.root.get("frozen_param_shapes") {
        None | Some(Value::None) => HashMap::new(),
        Some(v) => dict(v)
            .ok_or_else(|| err(&model_paths[0], "`frozen_param_shapes` is not a dict"))?
            .iter()
            .map(|(k, s)| {
                let name = key_name(k);
                let shape = size(s).ok_or_else(|| {
                    err(
                        &model_paths[0],
                        format!("frozen tensor `{name}`: its shape is not a size"),
                    )
                })?;
                Ok((name, numel(&shape)?))
            })
            .collect::<Result<_>>()?,
    };

    let staged = StagedDir::new(output, force)?;
    let out_dir = staged.path().join(tag);
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::Io {
        path: out_dir.clone(),
        source: e,
    })?;
    let omaps: Vec<&[u8]> = opts.iter().map(Source::bytes).collect();
    let mmaps: Vec<&[u8]> = models.iter().map(Source::bytes).collect();
    let mut stats = DeepSpeedWriteStats::default();
    for r in 0..dp {
        let dest = out_dir.join(format!(
            "{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        ));
        let tensors = o0
            .tensors
            .iter()
            .map(|f| {
                if let Some(s) = f
                    .what
                    .strip_prefix(FLAT)
                    .and_then(|s| s.parse::<usize>().ok())
                {
                    return recut_of(f, &numels[s], &opts, dp, r);
                }
                if let Some(s) = f
                    .what
                    .strip_prefix(STATE)
                    .and_then(|x| x.split_once('.'))
                    .and_then(|(s, _)| s.parse::<usize>().ok())
                    .filter(|&s| s < nsub)
                {
                    let old: u64 = numels[s].iter().map(|n| n.div_ceil(a)).sum();
                    if f.entry.shape == [old] {
                        return recut_of(f, &numels[s], &opts, dp, r);
                    }
                }
                copy_of(f)
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.with_path(&dest))?;
        let mut root = o0.root.clone();
        set(
            &mut root,
            &["optimizer_state_dict", "partition_count"],
            Value::Int(dp as i64),
        );
        let mut e = Emitter::new();
        emit(&mut e, &root, &tensors).map_err(|p| err(&o0.path, p))?;
        stats.bytes += write_pt(&dest, &tensors, e.finish(), &omaps)?;
        stats.files += 1;
        stats.tensors += tensors.len() as u64;

        let dest = out_dir.join(format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt"));
        let tensors = m0
            .tensors
            .iter()
            .map(|f| match f.what.strip_prefix(FROZEN) {
                Some(name) => {
                    let n = frozen.get(name).ok_or_else(|| {
                        err(
                            &m0.path,
                            format!(
                                "tensor `{name}`: a frozen fragment not in `frozen_param_shapes`"
                            ),
                        )
                    })?;
                    recut_of(f, &[*n], &models, dp, r)
                }
                None => copy_of(f),
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.with_path(&dest))?;
        let mut root = m0.root.clone();
        set(&mut root, &["dp_world_size"], Value::Int(dp as i64));
        let mut e = Emitter::new();
        emit(&mut e, &root, &tensors).map_err(|p| err(&m0.path, p))?;
        stats.bytes += write_pt(&dest, &tensors, e.finish(), &mmaps)?;
    }
    write_file_atomic(&staged.path().join("latest"), tag.as_bytes())?;
    staged.commit()?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_groups_as_deepspeed_splits_them() {
        // Parts of 33, 21, 4, 18, 3 on 2 ranks (the fixtures' model).
        let n = [66, 42, 7, 35, 5];
        assert_eq!(sub_groups(&n, 2, 1_000_000_000), vec![5]);
        assert_eq!(sub_groups(&n, 2, 79), vec![5]);
        // 33 >= 30 closes the first; 21 + 4 + 18 = 43 the second; 3 is the last.
        assert_eq!(sub_groups(&n, 2, 30), vec![1, 3, 1]);
        // On 3 ranks the parts are 22, 14, 3, 12, 2: 22 + 14 >= 30, 3 + 12 + 2 left.
        assert_eq!(sub_groups(&n, 3, 30), vec![2, 3]);
        assert_eq!(sub_groups(&n, 1, 0), vec![1; 5]);
    }

    #[test]
    fn recut_moves_each_parameter_part_to_its_new_rank() {
        // Two parameters of 5 and 2 elements; old dp 2: parts 3 and 1, a rank's flat
        // group 4 long; new dp 3: parts 2 and 1.
        let e = |k: usize| {
            Ok(TensorEntry {
                name: format!("r{k}"),
                dtype: crate::layout::Dtype::F32,
                shape: vec![4],
                start: 0,
                end: 16,
                offsets: None,
            })
        };
        let pieces = |r| {
            let (len, segs) = recut(&[5, 2], 2, 3, r, &e).unwrap();
            (
                len,
                segs.into_iter()
                    .map(|(k, _, f, at)| (k, f.start, f.len, at))
                    .collect::<Vec<_>>(),
            )
        };
        // New rank 0: elements 0..2 of the first (old rank 0 at 0), 0 of the second
        // (old rank 0 at 3).
        assert_eq!(pieces(0), (3, vec![(0, 0, 2, 0), (0, 3, 1, 2)]));
        // New rank 1: elements 2..4 of the first (old rank 0 at 2, old rank 1 at 0), 1
        // of the second (old rank 1 at 3).
        assert_eq!(
            pieces(1),
            (3, vec![(0, 2, 1, 0), (1, 0, 1, 1), (1, 3, 1, 2)])
        );
        // New rank 2: element 4 of the first (old rank 1 at 1), then padding.
        assert_eq!(pieces(2), (3, vec![(1, 1, 1, 0)]));
    }
}
