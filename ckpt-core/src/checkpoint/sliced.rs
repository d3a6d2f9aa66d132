//! Checkpoints whose pieces a strategy places: ckpt's rank directories (`strategy.json`)
//! and Megatron's legacy rank files (a strategy built from megatron-core's rules).

use super::{unplaced, Checkpoint, Kind, MAX_LISTED};
use crate::error::{Error, Result};
use crate::formats::detect::discover::{rank_dir_number, unknown, MODEL_FILE};
use crate::layout::mesh::Mesh;
use crate::layout::region::Region;
use crate::layout::select::Views;
use crate::layout::source::SourcePiece;
use crate::layout::split_rules::SplitRules;
use crate::layout::strategy::{dtype_name, Strategy};
use crate::layout::TensorLayout;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

impl Checkpoint {
    /// A Megatron legacy checkpoint: each rank's file placed by the layout its reader
    /// built from megatron-core's rules (a strategy on a `pp`/`tp` mesh, so `--to` and
    /// `--mesh` reshard it as a sliced checkpoint).
    pub(super) fn read_megatron(
        dir: &Path,
        carried: BTreeMap<String, PathBuf>,
        mut notes: Vec<String>,
        views: Views,
        rules: &SplitRules,
    ) -> Result<(Checkpoint, Vec<Error>)> {
        let legacy = crate::formats::megatron::open(dir, rules)?;
        let args = legacy.args;
        notes.extend(legacy.notes);
        let strategy = legacy.strategy;
        let mut ck = Checkpoint {
            kind: Kind::Sliced,
            files: Vec::with_capacity(legacy.files.len()),
            ranks: Vec::with_capacity(legacy.files.len()),
            strategy: None,
            tensors: BTreeMap::new(),
            carried,
            notes,
            imported: None,
            recorded_args: None,
            lora_meta: None,
            scratch: Vec::new(),
            mirrors: Vec::new(),
        };
        let mut raw: BTreeMap<String, Vec<SourcePiece>> = BTreeMap::new();
        for (fi, (rank, f)) in legacy.files.into_iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                let layout = &strategy.tensors[&t.name];
                let entry = raw.entry(t.name.clone()).or_default();
                if let Some(start) = &t.offsets {
                    // A piece the reader placed itself (GroupedMLP's weights).
                    entry.push(SourcePiece {
                        file: fi,
                        tensor: ti,
                        global: Region::new(start.clone(), t.shape.clone()),
                        local: Region::full(&t.shape),
                        view: None,
                        compute: None,
                    });
                    continue;
                }
                // A dense tensor read from an expert-parallel rank above 0 takes the
                // place of EP rank 0's.
                let at = if layout.holds(&strategy.mesh, rank) {
                    rank
                } else {
                    args.dense_rank(rank)
                };
                place(entry, layout, &strategy.mesh, at, (fi, ti));
            }
            ck.files.push(f);
            ck.ranks.push(Some(rank));
        }
        for (name, l) in &strategy.tensors {
            ck.tensors
                .insert(name.clone(), unplaced(l.dtype, l.shape.clone()));
        }
        ck.strategy = Some(strategy);
        let mut problems = Vec::new();
        ck.assemble(raw, &mut problems);
        if problems.is_empty() {
            ck.megatron_views(&args, views)?;
        }
        Ok((ck, problems))
    }

    pub(super) fn read_sliced(
        &mut self,
        strategies: &[Option<PathBuf>],
        raw: &mut BTreeMap<String, Vec<SourcePiece>>,
        problems: &mut Vec<Error>,
    ) -> Result<()> {
        // Every rank directory keeps its copy of one strategy: each distinct text is
        // parsed once (a strategy of 100,000 tensors takes longer to parse than the
        // files' headers) and each path refers to its parse.
        let mut distinct: Vec<std::result::Result<Strategy, String>> = Vec::new();
        let mut by_text: std::collections::HashMap<String, usize> =
            std::collections::HashMap::new();
        let mut parsed: BTreeMap<PathBuf, usize> = BTreeMap::new();
        for s in strategies.iter().flatten() {
            if parsed.contains_key(s) {
                continue;
            }
            let at = match Strategy::read_text(s) {
                Err(e) => {
                    distinct.push(Err(e.to_string()));
                    distinct.len() - 1
                }
                Ok(text) => *by_text.entry(text).or_insert_with_key(|text| {
                    distinct
                        .push(Strategy::from_json(text).map_err(|e| e.with_path(s).to_string()));
                    distinct.len() - 1
                }),
            };
            parsed.insert(s.clone(), at);
        }
        // The reference strategy: the first that parses.
        let Some((ref_path, ref_at)) = parsed
            .iter()
            .find(|(_, &at)| distinct[at].is_ok())
            .map(|(p, &at)| (p.clone(), at))
        else {
            let first = distinct
                .iter()
                .find_map(|s| s.as_ref().err().cloned())
                .unwrap_or_default();
            return Err(unknown(first));
        };
        for (p, &at) in &parsed {
            match &distinct[at] {
                Err(e) => problems.push(unknown(e.clone())),
                Ok(s) if at != ref_at && Ok(s) != distinct[ref_at].as_ref() => {
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: strategy differs from {}",
                            p.display(),
                            ref_path.display()
                        ),
                    });
                }
                Ok(_) => {}
            }
        }
        let strategy = distinct.swap_remove(ref_at).map_err(unknown)?;
        let hash = strategy.hash();
        let world = strategy.mesh.world_size();
        // Each stored tensor finds its layout by one hash lookup, and its pieces collect
        // by the strategy's position: ordered maps keyed by names that share long
        // prefixes (`layers.1234.`) spent most of this in comparing them.
        let layouts: Vec<(&String, &TensorLayout)> = strategy.tensors.iter().collect();
        // A rank file written by ckpt lists its tensors in name order, the strategy's
        // order: each is first looked for just after the previous one's layout (one
        // comparison), and the map by name is built only for a file in another order.
        let position: std::cell::OnceCell<std::collections::HashMap<&str, usize>> =
            std::cell::OnceCell::new();
        let find = |name: &str, next: usize| -> Option<usize> {
            if layouts.get(next).is_some_and(|(n, _)| n.as_str() == name) {
                return Some(next);
            }
            position
                .get_or_init(|| {
                    layouts
                        .iter()
                        .enumerate()
                        .map(|(i, (name, _))| (name.as_str(), i))
                        .collect()
                })
                .get(name)
                .copied()
        };
        let mut placed: Vec<Vec<SourcePiece>> = vec![Vec::new(); layouts.len()];
        let mut seen: BTreeMap<u64, PathBuf> = BTreeMap::new();
        for (fi, f) in self.files.iter().enumerate() {
            let path = f.path().to_path_buf();
            let meta = f.metadata();
            let rank = meta
                .get("rank")
                .and_then(|r| r.parse::<u64>().ok())
                .or_else(|| path.parent().and_then(rank_dir_number));
            let Some(rank) = rank else {
                problems.push(Error::Mismatch {
                    what: format!("{}: no `rank` in __metadata__", path.display()),
                });
                continue;
            };
            if let Some(w) = meta.get("world_size") {
                if w != &world.to_string() {
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: world_size {w} but the strategy's mesh has {world} ranks",
                            path.display()
                        ),
                    });
                }
            }
            if let Some(h) = meta.get("strategy_hash") {
                if h != &hash {
                    problems.push(Error::Mismatch {
                        what: format!(
                            "{}: strategy_hash {h} does not match strategy.json ({hash})",
                            path.display()
                        ),
                    });
                }
            }
            if rank >= world {
                problems.push(Error::Mismatch {
                    what: format!(
                        "{}: rank {rank} but the world size is {world}",
                        path.display()
                    ),
                });
                continue;
            }
            if let Some(other) = seen.insert(rank, path.clone()) {
                problems.push(Error::Mismatch {
                    what: format!(
                        "{}: rank {rank} appears twice (also {})",
                        path.display(),
                        other.display()
                    ),
                });
                continue;
            }
            self.ranks[fi] = Some(rank);
            let mut next = 0;
            for (ti, t) in f.tensors().iter().enumerate() {
                let Some(at) = find(&t.name, next) else {
                    problems.push(Error::InvalidTensor {
                        tensor: t.name.clone(),
                        problem: format!("in {} but not in the strategy", path.display()),
                    });
                    continue;
                };
                next = at + 1;
                let layout = layouts[at].1;
                if !layout.local_shape_is(&strategy.mesh, rank, &t.shape) || t.dtype != layout.dtype
                {
                    let want = layout.local_shape(&strategy.mesh, rank);
                    problems.push(Error::InvalidTensor {
                        tensor: t.name.clone(),
                        problem: format!(
                            "{} holds {} {:?} but the strategy gives rank {rank} {} {}",
                            path.display(),
                            dtype_name(t.dtype),
                            t.shape,
                            dtype_name(layout.dtype),
                            want.map_or("nothing (other pipeline stage)".into(), |w| format!(
                                "{w:?}"
                            ))
                        ),
                    });
                    continue;
                }
                // Room for every rank's piece at once: grown one by one, each tensor's
                // list was copied three or four times over.
                if placed[at].capacity() == 0 {
                    placed[at].reserve_exact(world.min(64) as usize);
                }
                place(&mut placed[at], layout, &strategy.mesh, rank, (fi, ti));
            }
        }
        problems.extend(missing_ranks(world, &seen, |r| {
            format!("no ckpt_{r}/{MODEL_FILE} among the inputs")
        }));
        // Every tensor of the strategy, in its (sorted) order: the maps (empty until
        // now: this is where a sliced checkpoint's tensors come from) are built from
        // sorted runs. Those that no file holds are reported by the coverage check.
        debug_assert!(raw.is_empty() && self.tensors.is_empty());
        *raw = layouts
            .iter()
            .zip(placed)
            .map(|((name, _), p)| ((*name).clone(), p))
            .collect();
        self.tensors = layouts
            .iter()
            .map(|(name, l)| ((*name).clone(), unplaced(l.dtype, l.shape.clone())))
            .collect();
        self.strategy = Some(strategy);
        Ok(())
    }
}

/// One problem per rank below `world` that is not in `seen`, the first [`MAX_LISTED`]
/// by name and the rest counted. The work is bounded by the ranks present, not by the
/// world size a file claims (a mesh of 10^12 ranks costs no more than one of 4).
/// Adds the pieces that rank `rank`'s stored tensor `(file, tensor)` holds under
/// `layout` on `mesh`.
fn place(
    entry: &mut Vec<SourcePiece>,
    layout: &TensorLayout,
    mesh: &Mesh,
    rank: u64,
    (file, tensor): (usize, usize),
) {
    layout.each_piece(mesh, rank, |p| {
        entry.push(SourcePiece {
            file,
            tensor,
            global: p.global,
            local: p.local,
            view: None,
            compute: None,
        });
    });
}

pub(super) fn missing_ranks<V>(
    world: u64,
    seen: &BTreeMap<u64, V>,
    why: impl Fn(u64) -> String,
) -> Vec<Error> {
    let present = seen.range(..world).count() as u64;
    let total = world - present;
    let mut out = Vec::new();
    let mut r = 0;
    while (out.len() as u64) < total.min(MAX_LISTED as u64) {
        if !seen.contains_key(&r) {
            out.push(Error::Mismatch {
                what: format!("rank {r} of {world} is missing ({})", why(r)),
            });
        }
        r += 1;
    }
    if total > out.len() as u64 {
        out.push(Error::Mismatch {
            what: format!("... and {} more missing ranks", total - out.len() as u64),
        });
    }
    out
}
