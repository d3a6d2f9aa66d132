//! DeepSpeed checkpoints with tensor parallelism (`mp_rank_XX` > 0, the `mpu` a
//! Megatron-style model passes to `deepspeed.initialize`).
//!
//! Each tensor-parallel rank `XX` saves its own ZeRO checkpoint of its shards:
//! `mp_rank_XX_model_states.pt` (ZeRO-3: `zero_pp_rank_D_mp_rank_XX_model_states.pt`)
//! with `param_shapes` of the shards, and `[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`
//! partitioned over that rank's data-parallel group; `mp_world_size` in the model
//! states is the tensor-parallel size. Each rank is read as a checkpoint of its own
//! ([`super::deepspeed::read_mp`]); its pieces are then placed in the global tensors.
//!
//! Which dimension a shard splits is not in the files (zero_to_fp32 refuses such
//! checkpoints). It comes from, in order:
//! 1. the user's split rules ([`SplitRules`], `--source-strategy`);
//! 2. `universal_checkpoint_info` in the model states (Megatron-DeepSpeed writes it as
//!    client state), read as deepspeed/checkpoint/ds_to_universal.py's
//!    `merge_tp_slices` (0.19.8) reads it: `tp_replicated_parameter_patterns` are
//!    replicated, `parameter_with_2_sub_params_cat_dim_0` are two sub-parameters each
//!    split on dim 0, `parameter_with_row_parallelism_patterns` split on dim 1, every
//!    other parameter on dim 0; `parameter_to_average_patterns` (averaged over the
//!    ranks), `parameter_with_sub_params` and `affine_map` are refused;
//! 3. else the checkpoint is refused, naming the first parameter nothing places.

use super::deepspeed::{
    dict_items, list, read_mp, scan, shapes_of, DeepSpeed, MpFiles, PtFile, TpPlace,
};
use super::pickle::Value;
use super::torch_save::describe;
use crate::error::{overflow, Error, Result};
use crate::layout::split_rules::{Split, SplitRules, HOW_TO_ADD};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The model states key Megatron-DeepSpeed's rules are under.
const UCI: &str = "universal_checkpoint_info";

fn err(path: &Path, problem: impl Into<String>) -> Error {
    Error::InvalidDeepSpeed {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The rules `universal_checkpoint_info` gives, in ds_to_universal's order; parameters
/// it would average are returned to be refused.
fn uci_rules(m: &PtFile, v: &Value, notes: &mut Vec<String>) -> Result<(SplitRules, Vec<String>)> {
    let kv = dict_items(v)
        .ok_or_else(|| err(&m.path, format!("`{UCI}` is {}, not a dict", describe(v))))?;
    let patterns = |key: &str| -> Result<Vec<String>> {
        let Some((_, v)) = kv
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
        else {
            return Ok(vec![]);
        };
        list(m, v, &format!("{UCI}.{key}"))?
            .iter()
            .map(|p| match p {
                Value::Str(s) => Ok(s.clone()),
                other => Err(err(
                    &m.path,
                    format!("`{UCI}.{key}` holds {}, not a pattern", describe(other)),
                )),
            })
            .collect()
    };
    for key in ["parameter_with_sub_params", "affine_map"] {
        let present = kv
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if s == key));
        if let Some((_, v)) = present {
            if dict_items(v).is_some_and(|x| !x.is_empty())
                || v.items().is_some_and(|x| !x.is_empty())
            {
                return Err(Error::Unsupported {
                    problem: format!(
                        "{}: `{UCI}.{key}` (sub-parameters of uneven or affine layout) is not read yet",
                        m.path.display()
                    ),
                });
            }
        }
    }
    if !patterns("vocabulary_parameter_patterns")?.is_empty() {
        notes.push(format!(
            "{}: `{UCI}` names vocabulary parameters: ds_to_universal cuts their padded rows to `original_vocab_size`; ckpt keeps the padding",
            m.path.display()
        ));
    }
    let mut rules = SplitRules::default();
    let bad = |e: String| err(&m.path, format!("`{UCI}`: {e}"));
    for p in patterns("tp_replicated_parameter_patterns")? {
        rules.push_regex(&p, Split::Replicated).map_err(bad)?;
    }
    let average = patterns("parameter_to_average_patterns")?;
    for p in patterns("parameter_with_2_sub_params_cat_dim_0")? {
        rules
            .push_regex(&p, Split::Dim { dim: 0, blocks: 2 })
            .map_err(bad)?;
    }
    for p in patterns("parameter_with_row_parallelism_patterns")? {
        rules
            .push_regex(&p, Split::Dim { dim: 1, blocks: 1 })
            .map_err(bad)?;
    }
    // Every other parameter is concatenated on dim 0.
    rules
        .push_regex(".*", Split::Dim { dim: 0, blocks: 1 })
        .map_err(bad)?;
    Ok((rules, average))
}

/// The names and local shapes one rank's model states give: trainable parameters
/// (`param_shapes`), frozen ones and buffers.
fn local_shapes(m: &PtFile) -> Result<Vec<(String, Vec<u64>)>> {
    let mut out = Vec::new();
    let v = m.at(&["param_shapes"])?;
    for g in list(m, v, "param_shapes")? {
        out.extend(shapes_of(m, g, "param_shapes")?);
    }
    if let Some(v) = m
        .opt_at(&["frozen_param_shapes"])
        .filter(|v| **v != Value::None)
    {
        out.extend(shapes_of(m, v, "frozen_param_shapes")?);
    }
    if let Some(v) = m.opt_at(&["buffer_names"]) {
        for n in list(m, v, "buffer_names")? {
            if let Value::Str(name) = n {
                let t = m.at(&["module"])?.get(name).ok_or_else(|| {
                    err(
                        &m.path,
                        format!("buffer `{name}` is named in `buffer_names` but not in `module`"),
                    )
                })?;
                out.push((name.clone(), m.tensor(t, name)?.shape));
            }
        }
    }
    Ok(out)
}

/// Reads a tag directory of several tensor-parallel ranks (`by_mp`: the files of each).
///
/// # Errors
/// [`Error::InvalidDeepSpeed`] naming the file and tensor: a missing tensor-parallel
/// rank, ranks whose shards differ in names or shapes, a split that does not divide a
/// shard; a parameter no rule places (saying how to give one); every error of a
/// single rank's read.
pub(crate) fn read_with_rules(dir: &Path, rules: &SplitRules) -> Result<DeepSpeed> {
    let by_mp = scan(dir)?;
    if by_mp.keys().all(|&mp| mp == 0) {
        let files = by_mp
            .get(&0)
            .ok_or_else(|| err(dir, "no `*_optim_states.pt` file"))?;
        return read_mp(dir, 0, files, None);
    }
    read_tp(dir, &by_mp, rules)
}

fn read_tp(dir: &Path, by_mp: &BTreeMap<u64, MpFiles>, rules: &SplitRules) -> Result<DeepSpeed> {
    let first_states = by_mp
        .get(&0)
        .and_then(MpFiles::model_states)
        .ok_or_else(|| {
            err(
                &dir.join("mp_rank_00_model_states.pt"),
                "missing (tensor-parallel rank 0's model states: parameter shapes)",
            )
        })?;
    let m0 = PtFile::open(first_states)?;
    let found = by_mp.keys().max().map_or(1, |m| m + 1);
    let size = match m0.opt_at(&["mp_world_size"]) {
        Some(Value::Int(n)) if *n > 0 => *n as u64,
        _ => found,
    };
    let state_name = |mp: u64| {
        let zero3 = by_mp.get(&0).is_some_and(|f| f.model.is_none());
        if zero3 {
            format!("zero_pp_rank_0_mp_rank_{mp:02}_model_states.pt")
        } else {
            format!("mp_rank_{mp:02}_model_states.pt")
        }
    };
    for mp in 0..size {
        if by_mp.get(&mp).and_then(MpFiles::model_states).is_none() {
            return Err(err(
                &dir.join(state_name(mp)),
                format!("tensor-parallel rank {mp} of {size} (`mp_world_size`) is missing: its model states and optimizer states hold that rank's shard of every parameter"),
            ));
        }
    }
    if let Some(&mp) = by_mp.keys().find(|&&mp| mp >= size) {
        return Err(err(
            &dir.join(state_name(mp)),
            format!(
                "tensor-parallel rank {mp}, but `mp_world_size` in {} says {size}",
                m0.path.display()
            ),
        ));
    }
    let mut notes = Vec::new();
    let (uci, average) = match m0.opt_at(&[UCI]) {
        Some(v) if *v != Value::None => {
            let (r, a) = uci_rules(&m0, v, &mut notes)?;
            (Some(r), a)
        }
        _ => (None, vec![]),
    };
    let shapes0 = local_shapes(&m0)?;
    let mut splits = BTreeMap::new();
    for (name, local) in &shapes0 {
        let user = rules.find(name);
        if user.is_none() && average.iter().any(|p| regex_match(p, name)) {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: tensor `{name}`: `{UCI}` says its tensor-parallel copies are averaged (parameter_to_average_patterns), which ckpt does not do; {HOW_TO_ADD}",
                    m0.path.display()
                ),
            });
        }
        let (split, by) = match (user, uci.as_ref().and_then(|u| u.find(name))) {
            (Some((s, p)), _) => (s, rules.describe(p)),
            (None, Some((s, p))) => (s, format!("`{UCI}` pattern `{p}`")),
            (None, None) => {
                return Err(err(
                    &m0.path,
                    format!(
                        "tensor `{name}`: a tensor-parallel checkpoint ({size} ranks) whose files do not say how `{name}` is split (no `{UCI}`, and no user rule matches): {HOW_TO_ADD}"
                    ),
                ))
            }
        };
        if let Split::Dim { dim, blocks } = split {
            if dim >= local.len() || local[dim] % blocks != 0 {
                return Err(err(
                    &m0.path,
                    format!("tensor `{name}`: {by} splits it on dim {dim} in {blocks} block(s), but its shard has shape {local:?}"),
                ));
            }
        }
        splits.insert(name.clone(), split);
    }
    drop(m0);
    let mut out = DeepSpeed {
        files: vec![],
        shapes: BTreeMap::new(),
        aliases: vec![],
        notes,
    };
    for mp in 0..size {
        let files = &by_mp[&mp];
        if mp > 0 {
            // Every rank holds shards of the same shapes (ckpt reads even splits).
            let p = files.model_states().cloned().unwrap_or_default();
            let mine = local_shapes(&PtFile::open(&p)?)?;
            if let Some(((n0, s0), (n, s))) = shapes0.iter().zip(&mine).find(|(a, b)| a != b) {
                return Err(err(
                    &p,
                    format!("tensor `{n}`: shard {s:?} here, but tensor-parallel rank 0 holds `{n0}` {s0:?} in its place: the ranks' shards contradict each other"),
                ));
            }
            if mine.len() != shapes0.len() {
                return Err(err(
                    &p,
                    format!(
                        "{} tensors here, {} on tensor-parallel rank 0",
                        mine.len(),
                        shapes0.len()
                    ),
                ));
            }
        }
        let place = Arc::new(TpPlace {
            rank: mp,
            size,
            splits: splits.clone(),
        });
        let mut d = read_mp(dir, mp, files, Some(&place))?;
        out.files.append(&mut d.files);
        for n in d.notes {
            if !out.notes.contains(&n) {
                out.notes.push(n);
            }
        }
        if mp == 0 {
            for (name, (dtype, local)) in d.shapes {
                let g = place
                    .global_shape(&name, &local)
                    .ok_or_else(|| overflow(format!("global shape of `{name}`")))?;
                out.shapes.insert(name, (dtype, g));
            }
            out.aliases = d.aliases;
        }
    }
    out.notes.push(format!(
        "{}: tensor parallel {size}: replicated tensors are read from tensor-parallel rank 0",
        dir.display()
    ));
    Ok(out)
}

fn regex_match(pattern: &str, name: &str) -> bool {
    let mut r = SplitRules::default();
    r.push_regex(pattern, Split::Replicated).is_ok() && r.find(name).is_some()
}
