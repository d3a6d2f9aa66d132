//! MindSpore per-rank files placed by a MindSpore strategy.

use super::sliced::missing_ranks;
use super::{unplaced, Checkpoint};
use crate::error::{Error, Result};
use crate::formats::detect::discover::rank_dir_number;
use crate::layout::mesh::Mesh;
use crate::layout::region::Region;
use crate::layout::source::SourcePiece;
use crate::layout::strategy::dtype_name;
use crate::layout::{Dtype, TensorLayout};
use std::collections::BTreeMap;

/// The parts of a file's tensor `read_mindspore` looks at (a split slice's records
/// together).
struct TensorEntryView<'a> {
    name: &'a String,
    dtype: Dtype,
    shape: &'a [u64],
}

impl Checkpoint {
    /// MindSpore per-rank files laid out by a MindSpore strategy: each tensor's global
    /// shape follows from its stored slice and its layout, each rank's pieces from the
    /// layout converted to ours ([`from_mindspore`](crate::from_mindspore)). When every
    /// split tensor has the same device matrix (and there is no pipeline), the layouts
    /// also form one ckpt [`Strategy`], so `--to` and `--mesh` apply as to ckpt's own.
    pub(super) fn read_mindspore(
        &mut self,
        params: &BTreeMap<String, crate::formats::mindspore_strategy::MindSporeParam>,
        raw: &mut BTreeMap<String, Vec<SourcePiece>>,
        problems: &mut Vec<Error>,
    ) -> Result<()> {
        let mismatch = |what: String| Error::Mismatch { what };
        // Devices per stage: every parameter's device matrix covers one stage.
        let mut per_stage: Option<u64> = None;
        let mut stages = 1u64;
        for (name, p) in params {
            let n = p
                .layout
                .dev_matrix
                .iter()
                .try_fold(1u64, |a, &b| a.checked_mul(b))
                .ok_or_else(|| crate::error::overflow(format!("device matrix of `{name}`")))?;
            match per_stage {
                None => per_stage = Some(n),
                Some(m) if m != n => {
                    return Err(Error::InvalidStrategy {
                        problem: format!(
                            "parameter `{name}` has a device matrix of {n} devices, others of {m}"
                        ),
                    })
                }
                Some(_) => {}
            }
            stages = stages.max(p.stage + 1);
        }
        let per_stage = per_stage.ok_or_else(|| Error::InvalidStrategy {
            problem: "the MindSpore strategy describes no parameter".into(),
        })?;
        let world = per_stage
            .checked_mul(stages)
            .ok_or_else(|| crate::error::overflow("world size".to_string()))?;
        let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
        let mut known: BTreeMap<String, (Mesh, TensorLayout)> = BTreeMap::new();
        for (fi, f) in self.files.iter().enumerate() {
            let path = f.path().display().to_string();
            let rank = f
                .path()
                .parent()
                .and_then(rank_dir_number)
                .or_else(|| f.metadata().get("rank").and_then(|r| r.parse().ok()));
            let Some(rank) = rank else {
                problems.push(mismatch(format!(
                    "{path}: no rank (expected it in a rank_<r>/ or ckpt_<r>/ directory)"
                )));
                continue;
            };
            if rank >= world {
                problems.push(mismatch(format!(
                    "{path}: rank {rank} but the MindSpore strategy has {world} ranks"
                )));
                continue;
            }
            if let Some(other) = seen.insert(rank, fi) {
                problems.push(mismatch(format!(
                    "{path}: rank {rank} appears twice (also {})",
                    self.files[other].path().display()
                )));
                continue;
            }
            self.ranks[fi] = Some(rank);
            let (stage, local) = (rank / per_stage, rank % per_stage);
            // A slice MindSpore split into several records is one tensor of the file,
            // held as boxes (`offsets` within the slice): `records` lists them.
            let mut by_name: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
            for (ti, t) in f.tensors().iter().enumerate() {
                by_name.entry(&t.name).or_default().push(ti);
            }
            for (ti, t) in f.tensors().iter().enumerate() {
                let records = &by_name[t.name.as_str()];
                if records[0] != ti {
                    continue;
                }
                // The slice's shape: a whole record's, or the extent of the boxes.
                let slice_shape: Vec<u64> = match &t.offsets {
                    None => t.shape.clone(),
                    Some(_) => (0..t.shape.len())
                        .map(|d| {
                            records
                                .iter()
                                .map(|&i| {
                                    let e = &f.tensors()[i];
                                    e.offsets.as_ref().map_or(0, |o| o[d]) + e.shape[d]
                                })
                                .max()
                                .unwrap_or(0)
                        })
                        .collect(),
                };
                let t = &TensorEntryView {
                    name: &t.name,
                    dtype: t.dtype,
                    shape: &slice_shape,
                };
                let bad = |problem: String| Error::InvalidTensor {
                    tensor: t.name.clone(),
                    problem,
                };
                let Some(p) = params.get(t.name) else {
                    problems.push(bad(format!("in {path} but not in the MindSpore strategy")));
                    continue;
                };
                if p.stage != stage {
                    problems.push(bad(format!(
                        "{path} (rank {rank}, stage {stage}) holds it, but the strategy puts it in stage {}",
                        p.stage
                    )));
                    continue;
                }
                let global = match ms_global_shape(&p.layout, t.shape) {
                    Ok(g) => g,
                    Err(e) => {
                        problems.push(bad(format!("{path}: {e}")));
                        continue;
                    }
                };
                let (mesh, layout) = match crate::layout::mindspore::from_mindspore(
                    t.name, &p.layout, global, t.dtype,
                ) {
                    Ok(x) => x,
                    Err(e) => {
                        problems.push(e);
                        continue;
                    }
                };
                if let Some((m0, l0)) = known.get(t.name) {
                    if (m0, &l0.shape, l0.dtype) != (&mesh, &layout.shape, layout.dtype) {
                        problems.push(bad(format!(
                            "{path} holds {} {:?}, a slice of {:?}, but other ranks hold slices of {} {:?}",
                            dtype_name(t.dtype),
                            t.shape,
                            layout.shape,
                            dtype_name(l0.dtype),
                            l0.shape
                        )));
                        continue;
                    }
                }
                let want = layout.local_shape(&mesh, local);
                if want.as_deref() != Some(t.shape) {
                    problems.push(bad(format!(
                        "{path} holds {:?} but the strategy gives rank {rank} {want:?}",
                        t.shape
                    )));
                    continue;
                }
                let entry = raw.entry(t.name.clone()).or_default();
                for piece in layout.pieces(&mesh, local) {
                    for &ri in records {
                        // Each record box holds part of the slice: the piece's part in
                        // it, in the record's own coordinates.
                        let e = &f.tensors()[ri];
                        let origin = e.offsets.clone().unwrap_or_else(|| vec![0; e.shape.len()]);
                        let rec = Region::new(origin.clone(), e.shape.clone());
                        let Some(part) = piece.local.overlap(&rec) else {
                            continue;
                        };
                        let shift = part.relative_to(&piece.local.start);
                        entry.push(SourcePiece {
                            file: fi,
                            tensor: ri,
                            global: shift.offset(&piece.global.start),
                            local: part.relative_to(&origin),
                            view: None,
                            compute: None,
                        });
                    }
                }
                known.entry(t.name.clone()).or_insert((mesh, layout));
            }
        }
        problems.extend(missing_ranks(world, &seen, |r| {
            format!("no rank_{r}/ checkpoint among the inputs")
        }));
        for name in params.keys().filter(|n| !known.contains_key(*n)) {
            problems.push(Error::CoverageGap {
                tensor: name.clone(),
                region: "all".into(),
            });
        }
        for (name, (_, l)) in &known {
            self.tensors
                .insert(name.clone(), unplaced(l.dtype, l.shape.clone()));
        }
        if stages == 1 {
            self.strategy = crate::layout::mindspore::common_strategy(&known);
        }
        Ok(())
    }
}

/// The global shape of a MindSpore tensor whose slice is `local`: each dimension times
/// the device axes that split it (and dimension 0 times the optimizer shard).
fn ms_global_shape(
    l: &crate::layout::mindspore::MindSporeLayout,
    local: &[u64],
) -> std::result::Result<Vec<u64>, String> {
    use crate::layout::mindspore::MapEntry;
    if l.tensor_map.len() != local.len() {
        return Err(format!(
            "a slice of {} dims but a tensor_map of {} entries",
            local.len(),
            l.tensor_map.len()
        ));
    }
    let n = l.dev_matrix.len();
    let mut out = Vec::with_capacity(local.len());
    for (d, (entry, &len)) in l.tensor_map.iter().zip(local).enumerate() {
        let ks: Vec<i64> = match entry {
            MapEntry::One(k) => vec![*k],
            MapEntry::Many(v) => v.clone(),
        };
        let mut splits = 1u64;
        for k in ks.into_iter().filter(|&k| k != -1) {
            let size = usize::try_from(k)
                .ok()
                .filter(|&k| k < n)
                .map(|k| l.dev_matrix[n - 1 - k])
                .ok_or_else(|| {
                    format!("tensor_map value {k} is outside a device matrix of {n} axes")
                })?;
            splits = splits.checked_mul(size).ok_or("split count overflows")?;
        }
        if d == 0 && l.opt_shard_size > 1 {
            splits = splits
                .checked_mul(l.opt_shard_size)
                .ok_or("split count overflows")?;
        }
        out.push(len.checked_mul(splits).ok_or("global shape overflows")?);
    }
    Ok(out)
}
