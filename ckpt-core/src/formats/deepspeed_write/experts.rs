//! The expert group of a DeepSpeed ZeRO-1/2 mixture of experts for another world size
//! and expert-parallel (EP) size: which source bytes make each new rank's partition.
//!
//! From docs/moe.md ("The expert groups in the ZeRO-1/2 files"): the expert group
//! (`moe: True`, named `ep_size_<EP>`) is one flat buffer per EP rank, its local
//! experts' parameters in module order (MoE layer, local expert, parameter), cut over
//! that EP rank's expert-data-parallel (EDP) ranks; which EP and EDP rank a file
//! belongs to follows DeepSpeed's group rule. The expert files
//! (`layer_<l>_expert_<g>_...`) name experts globally and do not change with EP.
//!
//! So a new EP rank's buffer is, parameter by parameter, runs of the old EP ranks'
//! buffers (global expert `e' * E_l' + i'` is old EP rank `g / E_l`'s local expert
//! `g % E_l`), and each run is runs of the old files' stored partitions. Nothing is
//! computed from the values: the new files are copies of flat ranges.

use super::group_plan::{GroupPlan, Run};
use crate::error::{overflow, Error, Result};
use crate::formats::deepspeed::{local_expert, ExpertGrid};
use crate::layout::flat::FlatRange;
use std::collections::HashMap;

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

/// `name` with its local expert id 0 (whose shapes every local expert has).
pub(super) fn as_local_expert_zero(name: &str) -> String {
    match local_expert(name) {
        Some((head, _, rest)) => format!("{head}0.{rest}"),
        None => name.to_string(),
    }
}

/// The elements `range` of a stream made of `runs` back to back.
fn runs_in(runs: &[Run], range: FlatRange) -> Vec<Run> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for &(src, r) in runs {
        if let Some(o) = FlatRange::new(at, r.len).overlap(&range) {
            out.push((src, FlatRange::new(r.start + o.start - at, o.len)));
        }
        at += r.len;
    }
    out
}

/// The plan of expert group `g` (source parameters `params` under local ids, with
/// their alignment paddings `pads`; `stored[k]` the elements source file `k` holds)
/// from the source grid `old` to the grid `new`.
///
/// # Errors
/// `Unsupported` naming the group for what is not re-cut: alignment paddings
/// (`zero_optimization.parameter_alignment`), parameters out of module order, an
/// expert count the new EP size does not divide; buffers that do not add up.
pub(super) fn plan(
    g: usize,
    params: &[(String, u64)],
    pads: &[u64],
    stored: &[u64],
    old: ExpertGrid,
    new: ExpertGrid,
) -> Result<GroupPlan> {
    let refuse = |p: String| unsupported(format!("expert group {g} (ep_size_{}): {p}", old.ep));
    if pads.iter().any(|&p| p != 0) {
        return Err(refuse(
            "parameters padded for alignment (zero_optimization.parameter_alignment): not re-cut for another EP size".into(),
        ));
    }
    // The MoE layers in order, each with one expert's parameters (local expert 0's).
    let mut layers: Vec<(&str, Vec<(&str, u64)>)> = Vec::new();
    let mut per = 0u64;
    for (name, n) in params {
        let (head, i, rest) =
            local_expert(name).ok_or_else(|| refuse(format!("`{name}` is not an expert's")))?;
        per = per.max(i + 1);
        if i == 0 {
            match layers.last_mut() {
                Some((h, ps)) if *h == head => ps.push((rest, *n)),
                _ => layers.push((head, vec![(rest, *n)])),
            }
        }
    }
    // The source must be exactly layer by layer, local expert by local expert.
    let expected = layers.iter().flat_map(|(head, ps)| {
        (0..per).flat_map(move |i| {
            ps.iter()
                .map(move |(rest, n)| (format!("{head}{i}.{rest}"), *n))
        })
    });
    if !expected.eq(params.iter().cloned()) {
        return Err(refuse(
            "its parameters are not in module order (MoE layer, local expert, parameter): not re-cut".into(),
        ));
    }
    let experts = per
        .checked_mul(old.ep)
        .ok_or_else(|| overflow("expert count"))?;
    if new.ep == 0 || !experts.is_multiple_of(new.ep) || !new.world.is_multiple_of(new.ep) {
        return Err(refuse(format!(
            "{experts} experts on {} ranks at EP {}: the EP size must divide both",
            new.world, new.ep
        )));
    }
    let new_per = experts / new.ep;

    // Where each parameter of a local expert starts in an old EP rank's buffer.
    let mut offset: HashMap<(usize, u64, usize), u64> = HashMap::new();
    let mut at = 0u64;
    for (l, (_, ps)) in layers.iter().enumerate() {
        for i in 0..per {
            for (k, (_, n)) in ps.iter().enumerate() {
                offset.insert((l, i, k), at);
                at = at
                    .checked_add(*n)
                    .ok_or_else(|| overflow("expert buffer"))?;
            }
        }
    }
    // Each old EP rank's buffer: its EDP ranks' stored partitions, by EDP rank.
    let old_buffers: Vec<Vec<Run>> = (0..old.ep)
        .map(|e| {
            let runs: Vec<Run> = old
                .members(e)
                .into_iter()
                .map(|r| (r as usize, FlatRange::new(0, stored[r as usize])))
                .collect();
            let len: u64 = runs.iter().map(|(_, r)| r.len).sum();
            if len != at {
                return Err(refuse(format!(
                    "EP rank {e}'s files hold {len} elements, its experts' parameters {at}"
                )));
            }
            Ok(runs)
        })
        .collect::<Result<_>>()?;
    let mut buffers = Vec::with_capacity(new.ep as usize);
    for e in 0..new.ep {
        let mut runs = Vec::new();
        for (l, (_, ps)) in layers.iter().enumerate() {
            for i in 0..new_per {
                let global = e * new_per + i;
                let (src, j) = (global / per, global % per);
                for (k, (_, n)) in ps.iter().enumerate() {
                    let start = offset[&(l, j, k)];
                    runs.extend(runs_in(
                        &old_buffers[src as usize],
                        FlatRange::new(start, *n),
                    ));
                }
            }
        }
        buffers.push(runs);
    }
    let new_params = layers
        .iter()
        .flat_map(|(head, ps)| {
            (0..new_per).flat_map(move |i| {
                ps.iter()
                    .map(move |(rest, n)| (format!("{head}{i}.{rest}"), *n))
            })
        })
        .collect::<Vec<_>>();
    Ok(GroupPlan {
        buffers,
        place: (0..new.world)
            .map(|r| {
                let (e, edp) = new.place(r);
                (e as usize, edp)
            })
            .collect(),
        parts: new.world / new.ep,
        pads: vec![0; new_params.len()],
        params: new_params,
        name: Some(format!("ep_size_{}", new.ep)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(world: u64, ep: u64, dbe: bool) -> ExpertGrid {
        ExpertGrid {
            world,
            ep,
            data_before_expert: dbe,
        }
    }

    /// The rule docs/moe.md gives for 4 ranks at EP 2, as DeepSpeed built it for the
    /// fixtures (groups.json): E + D 0,1,0,1; D + E 0,0,1,1.
    #[test]
    fn ranks_are_placed_by_deepspeeds_group_rule() {
        let ed: Vec<_> = (0..4).map(|r| grid(4, 2, false).place(r)).collect();
        assert_eq!(ed, [(0, 0), (1, 0), (0, 1), (1, 1)]);
        let de: Vec<_> = (0..4).map(|r| grid(4, 2, true).place(r)).collect();
        assert_eq!(de, [(0, 0), (0, 1), (1, 0), (1, 1)]);
        assert_eq!(grid(4, 2, false).members(1), [1, 3]);
        assert_eq!(grid(4, 2, true).members(1), [2, 3]);
    }

    /// Element values that say where they belong: expert `global`, parameter `k`,
    /// element `x`.
    fn value(global: u64, k: usize, x: u64) -> u64 {
        global * 1000 + k as u64 * 100 + x
    }

    /// The files of a grid: each rank's stored partition, made from the values above.
    fn files(grid: ExpertGrid, experts: u64, numels: &[u64]) -> Vec<Vec<u64>> {
        let per = experts / grid.ep;
        let edp = grid.world / grid.ep;
        let buffers: Vec<Vec<u64>> = (0..grid.ep)
            .map(|e| {
                (0..per)
                    .flat_map(|i| {
                        numels
                            .iter()
                            .enumerate()
                            .flat_map(move |(k, &n)| (0..n).map(move |x| value(e * per + i, k, x)))
                    })
                    .collect()
            })
            .collect();
        (0..grid.world)
            .map(|r| {
                let (e, d) = grid.place(r);
                let b = &buffers[e as usize];
                let part = (b.len() as u64).div_ceil(2 * edp) * 2;
                let lo = (d * part).min(b.len() as u64) as usize;
                let hi = ((d + 1) * part).min(b.len() as u64) as usize;
                b[lo..hi].to_vec()
            })
            .collect()
    }

    fn params(per: u64, numels: &[u64]) -> Vec<(String, u64)> {
        (0..per)
            .flat_map(|i| {
                numels
                    .iter()
                    .enumerate()
                    .map(move |(k, &n)| (format!("m.deepspeed_experts.{i}.p{k}"), n))
            })
            .collect()
    }

    /// Every new rank's partition, made by the plan from the old files, equals the
    /// partition the new grid's files hold, for several grids both ways.
    #[test]
    fn every_new_partition_is_the_new_grids_own() {
        let numels = [6, 3, 5];
        let experts = 8;
        for (old, new) in [
            (grid(4, 2, false), grid(4, 4, false)),
            (grid(4, 4, false), grid(2, 1, false)),
            (grid(4, 2, true), grid(8, 8, false)),
            (grid(2, 1, false), grid(6, 2, true)),
        ] {
            let src = files(old, experts, &numels);
            let want = files(new, experts, &numels);
            let stored: Vec<u64> = src.iter().map(|f| f.len() as u64).collect();
            let per = experts / old.ep;
            let p = plan(0, &params(per, &numels), &[0; 24], &stored, old, new).unwrap();
            assert_eq!(p.params, params(experts / new.ep, &numels));
            assert_eq!(
                p.name.as_deref(),
                Some(format!("ep_size_{}", new.ep).as_str())
            );
            for r in 0..new.world {
                let (b, part) = p.place[r as usize];
                let got = p.partition(b, part).unwrap();
                let mut bytes = vec![0u64; got.stored as usize];
                for (off, (src_rank, range)) in &got.runs {
                    for x in 0..range.len {
                        bytes[(off + x) as usize] = src[*src_rank][(range.start + x) as usize];
                    }
                }
                assert_eq!(bytes, want[r as usize], "{old:?} -> {new:?}, rank {r}");
            }
        }
    }

    #[test]
    fn what_is_not_recut_is_refused_by_name() {
        let numels = [4, 4];
        let src = files(grid(2, 2, false), 4, &numels);
        let stored: Vec<u64> = src.iter().map(|f| f.len() as u64).collect();
        let p = params(2, &numels);
        let msg = |e: crate::Error| e.to_string();
        let e = plan(
            1,
            &p,
            &[1, 0, 0, 0],
            &stored,
            grid(2, 2, false),
            grid(2, 1, false),
        );
        assert!(msg(e.err().unwrap()).contains("parameter_alignment"));
        let e = plan(
            1,
            &p,
            &[0; 4],
            &stored,
            grid(2, 2, false),
            grid(3, 3, false),
        );
        assert!(msg(e.err().unwrap()).contains("must divide"));
        let mut swapped = p.clone();
        swapped.swap(0, 2);
        let e = plan(
            1,
            &swapped,
            &[0; 4],
            &stored,
            grid(2, 2, false),
            grid(2, 1, false),
        );
        assert!(msg(e.err().unwrap()).contains("module order"));
        let e = plan(
            1,
            &p,
            &[0; 4],
            &[stored[0], stored[1] - 1],
            grid(2, 2, false),
            grid(2, 1, false),
        );
        assert!(msg(e.err().unwrap()).contains("EP rank 1's files hold"));
    }
}
