//! An Orbax step directory (`--format orbax`), as a `CheckpointManager` writes
//! `save(step, args=StandardSave(tree))` with `use_zarr3=True` and no compression:
//! `_CHECKPOINT_METADATA`, `commit_success.txt` and one item directory (`default/`
//! unless told) holding `_METADATA` (the tree: ckpt's dotted names as nested dict
//! keys), `commit_success.txt` and the arrays in a new OCDBT database, written by the
//! copy engine through the Orbax file codec (`formats/orbax/encode.rs`; docs/orbax.md,
//! "What ckpt writes").
//!
//! `merge`'s ([`OrbaxStep::checked`]): every leaf a numpy array, whole. `reshard`'s
//! ([`OrbaxStep::sharded`]): every leaf a `jax.Array` laid out on the target mesh as a
//! `NamedSharding` (the mesh's axes, each array dimension split over the axes that
//! shard it), each device's box one zarr chunk (replicated boxes once), the shardings
//! in `_sharding` and the boxes in `array_metadatas/process_0`. A layout JAX cannot
//! express as a `NamedSharding` (a split that does not divide its dimension, blocked
//! shards, arrays on some pipeline stages only) is refused by name before anything is
//! written. orbax-checkpoint 0.12.8 restores either without a target and onto any
//! mesh with one.

use super::ranks::{RankOptions, Ranks};
use super::safetensors::whole_tensors;
use super::Writer;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::orbax::encode::{check, grid_chunk_key, Grid, GRID_KEY, MANIFEST_FILE};
use crate::formats::orbax::sharding::{named_sharding, sharding_file, SHARDING_FILE};
use crate::formats::orbax::steps::{step_metadata_json, CHECKPOINT_METADATA, COMMIT_FILE};
use crate::formats::orbax::tree::{metadata_json, METADATA_FILE};
use crate::formats::output::write_file_atomic;
use crate::formats::writer::TensorSpec;
use crate::layout::plan::{CopyPlan, TargetFile, TargetTensor};
use crate::layout::region::Region;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use crate::layout::{Piece, Placement, TensorLayout};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// The item name orbax gives a step's one item when `save` is given no `Composite`.
pub const ORBAX_DEFAULT_ITEM: &str = "default";

/// `merge --format orbax` and `reshard --format orbax`: one step directory with one
/// item.
#[derive(Clone, Debug)]
pub struct OrbaxStep {
    /// The item directory's name.
    item: String,
    /// When the save began (`init_timestamp_nsecs`).
    started_ns: u128,
    /// `reshard`'s: the target strategy whose mesh the arrays are sharded on; `None`
    /// for whole numpy arrays.
    strategy: Option<Strategy>,
}

/// How one array lies on the mesh as JAX sees it: the mesh axes each dimension is split
/// over (split order, major first: a `PartitionSpec`'s entries) and the box each device
/// holds (the zarr chunk).
#[derive(Clone, Debug, PartialEq, Eq)]
struct JaxSharding {
    spec: Vec<Vec<String>>,
    grid: Grid,
}

/// `layout` of tensor `name` on `strategy`'s mesh as a JAX `NamedSharding` whose device
/// boxes are a regular grid: refused by name where JAX has no such sharding. ckpt splits
/// a dimension over several axes in `order` then mesh order, each taking `torch.chunk`
/// of what the one before left, which is JAX's split of the dimension over the axes'
/// product (the first axis major) exactly when the product divides it; then every box
/// is the dimension over that product, a regular grid (checked against the layout's own
/// boxes by [`chunk_boxes`]).
fn jax_sharding(name: &str, layout: &TensorLayout, strategy: &Strategy) -> Result<JaxSharding> {
    let mesh = &strategy.mesh;
    let refuse = |problem: String| Error::InvalidLayout {
        tensor: name.to_string(),
        problem: format!("--format orbax: {problem}"),
    };
    if let (Some(p), Some(stage)) = (mesh.pipeline(), layout.stage) {
        if mesh.axes()[p].size > 1 {
            return Err(refuse(format!(
                "the tensor lives on pipeline stage {stage} of {} only, and a JAX array lies on the whole mesh: reshard to --mesh {}=1 (or a strategy without stages)",
                mesh.axes()[p].size,
                mesh.axes()[p].name
            )));
        }
    }
    let mut by_dim: Vec<Vec<(u32, usize)>> = vec![Vec::new(); layout.shape.len()];
    for (a, p) in layout.placements.iter().enumerate() {
        if let Placement::Shard { dim, blocks, order } = *p {
            if blocks != 1 {
                return Err(refuse(format!(
                    "dim {dim} is split in {blocks} blocks over axis `{}` (each device holds a part of every block), which no JAX NamedSharding expresses: use blocks=1 in the target strategy or --exclude it",
                    mesh.axes()[a].name
                )));
            }
            by_dim[dim].push((order, a));
        }
    }
    let mut spec = Vec::with_capacity(by_dim.len());
    let mut chunk = layout.shape.clone();
    for (dim, axes) in by_dim.iter_mut().enumerate() {
        axes.sort_unstable();
        let ways: u64 = axes.iter().map(|&(_, a)| mesh.axes()[a].size).product();
        let names: Vec<String> = axes
            .iter()
            .map(|&(_, a)| mesh.axes()[a].name.clone())
            .collect();
        if ways > 1 && !layout.shape[dim].is_multiple_of(ways) {
            return Err(refuse(format!(
                "dim {dim} of size {} is split {ways} ways over axis {} and {ways} does not divide it: JAX shards evenly only (a NamedSharding's split dimensions must be multiples of their axes' sizes, and zarr's chunks are a regular grid); choose a mesh whose sizes divide the dimension, or --exclude it",
                layout.shape[dim],
                names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" x ")
            )));
        }
        chunk[dim] = layout.shape[dim] / ways;
        spec.push(names);
    }
    // Trailing unsplit dimensions left out, as `PartitionSpec('tp')` is written.
    while spec.last().is_some_and(Vec::is_empty) {
        spec.pop();
    }
    Ok(JaxSharding {
        spec,
        grid: Grid {
            shape: layout.shape.clone(),
            chunk,
        },
    })
}

/// The distinct boxes `layout` puts on `strategy`'s devices (each once, from the device
/// that owns it), in the grid's C order: each must be one chunk of `grid`, and every
/// chunk must be some device's box.
fn chunk_boxes(
    name: &str,
    layout: &TensorLayout,
    strategy: &Strategy,
    grid: &Grid,
) -> Result<Vec<(Vec<u64>, Region)>> {
    let mesh = &strategy.mesh;
    let wrong = |problem: String| Error::InvalidLayout {
        tensor: name.to_string(),
        problem: format!("--format orbax: {problem}"),
    };
    let mut boxes: BTreeMap<Vec<u64>, Region> = BTreeMap::new();
    for r in 0..mesh.world_size() {
        if !layout.is_owner(mesh, r) {
            continue;
        }
        let pieces = layout.pieces(mesh, r);
        let [Piece { global, .. }] = &pieces[..] else {
            return Err(wrong(format!(
                "device {r} holds {} boxes, not one",
                pieces.len()
            )));
        };
        let whole_chunk = global.shape.iter().eq(grid.chunk.iter())
            && global
                .start
                .iter()
                .zip(&grid.chunk)
                .all(|(&s, &c)| s.is_multiple_of(c));
        if !whole_chunk {
            return Err(wrong(format!(
                "device {r}'s box {global} is no chunk of the grid {:?}",
                grid.chunk
            )));
        }
        let idx: Vec<u64> = global
            .start
            .iter()
            .zip(&grid.chunk)
            .map(|(&s, &c)| s / c)
            .collect();
        boxes.insert(idx, global.clone());
    }
    let total: u64 = grid.counts().iter().product();
    if boxes.len() as u64 != total {
        return Err(wrong(format!(
            "the devices hold {} of the grid's {total} chunks",
            boxes.len()
        )));
    }
    Ok(boxes.into_iter().collect())
}

/// The item directory's name: `item` ([`ORBAX_DEFAULT_ITEM`] when `None`), refused
/// where it is no directory name of its own in the step.
fn item_dir_name(item: Option<String>) -> Result<String> {
    let item = item.unwrap_or_else(|| ORBAX_DEFAULT_ITEM.to_string());
    if item.is_empty()
        || item == "."
        || item == ".."
        || item.contains('/')
        || item.contains('\0')
        || item == CHECKPOINT_METADATA
        || item == COMMIT_FILE
    {
        return Err(Error::Unsupported {
            problem: format!("--orbax-item `{item}` is not a name for an item directory"),
        });
    }
    Ok(item)
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

impl OrbaxStep {
    /// The writer of a step whose item is `item` ([`ORBAX_DEFAULT_ITEM`] when `None`),
    /// refusing the options that do not apply to an Orbax step.
    ///
    /// # Errors
    /// An item name that is no directory name of its own (empty, `.`, `..`, with a
    /// `/`, or one of the step's own files); a compression, a shard size or
    /// `--one-file` asked for.
    pub fn checked(
        item: Option<String>,
        compressed: bool,
        max_shard_size: Option<u64>,
        one_file: bool,
    ) -> Result<OrbaxStep> {
        let refuse = |what: &str| {
            Err(Error::Unsupported {
                problem: format!(
                    "--format orbax writes a step directory orbax restores: {what} does not apply"
                ),
            })
        };
        if compressed {
            return refuse("--compress");
        }
        if max_shard_size.is_some() {
            return refuse("--max-shard-size");
        }
        if one_file {
            return refuse("--one-file");
        }
        Ok(OrbaxStep {
            item: item_dir_name(item)?,
            started_ns: now_ns(),
            strategy: None,
        })
    }

    /// `reshard`'s writer: the arrays sharded as `strategy` lays them out on its mesh
    /// (see the module's doc), in the item `item` ([`ORBAX_DEFAULT_ITEM`] when `None`).
    ///
    /// # Errors
    /// A compression, or some target ranks only (`--rank`): the step is one database
    /// for all devices; an item name [`OrbaxStep::checked`] refuses.
    pub fn sharded(
        strategy: Strategy,
        options: RankOptions,
        item: Option<String>,
    ) -> Result<OrbaxStep> {
        let refuse = |what: &str| {
            Err(Error::Unsupported {
                problem: format!(
                    "--format orbax writes one step directory for every device of the mesh: {what} does not apply"
                ),
            })
        };
        if options.compression.is_some() {
            return refuse("--compress");
        }
        if options.ranks != Ranks::All {
            return refuse("--rank");
        }
        Ok(OrbaxStep {
            item: item_dir_name(item)?,
            started_ns: now_ns(),
            strategy: Some(strategy),
        })
    }

    /// `reshard --format maxtext`: `source` (a Hugging Face Llama, Mistral or Qwen3
    /// with its config.json) seen as MaxText's scanned parameter tree, or with
    /// `unscanned` its unscanned one ([`Checkpoint::maxtext_import`]), then written as [`OrbaxStep::sharded`] does in
    /// MaxText's item `items` (`params.params.*`: what its `load_parameters_path`,
    /// `OUT/items`, restores), the strategy from `target`.
    ///
    /// # Errors
    /// A source MaxText's names do not fit (named); what `target` and
    /// [`OrbaxStep::sharded`] refuse.
    pub fn maxtext(
        source: &mut Checkpoint,
        target: &dyn super::TargetLayout,
        options: RankOptions,
        unscanned: bool,
    ) -> Result<OrbaxStep> {
        source.maxtext_import(&crate::checkpoint::HfTarget::default(), unscanned)?;
        Ok(OrbaxStep {
            item: crate::checkpoint::MAXTEXT_ITEM.to_string(),
            ..OrbaxStep::sharded(target.strategy(source, None)?, options, None)?
        })
    }

    /// Each array of `strategy` as JAX shards it, by name.
    fn shardings(strategy: &Strategy) -> Result<BTreeMap<&str, JaxSharding>> {
        strategy
            .tensors
            .iter()
            .map(|(name, l)| Ok((name.as_str(), jax_sharding(name, l, strategy)?)))
            .collect()
    }

    /// The plan of a sharded item: one tensor per chunk (a device's box), renamed to its
    /// key once planned, and the grids in the file's metadata for the codec.
    fn sharded_plan(&self, strategy: &Strategy, source: &Checkpoint) -> Result<CopyPlan> {
        let shardings = Self::shardings(strategy)?;
        let specs: Vec<TensorSpec> = strategy
            .tensors
            .iter()
            .map(|(name, l)| TensorSpec {
                name: name.clone(),
                dtype: l.dtype,
                shape: l.shape.clone(),
            })
            .collect();
        check(&specs)?;
        let mut tensors = Vec::new();
        let mut keys = Vec::new();
        for (name, l) in &strategy.tensors {
            let grid = &shardings[name.as_str()].grid;
            for (idx, global) in chunk_boxes(name, l, strategy, grid)? {
                keys.push(grid_chunk_key(name, &idx));
                let local = Region::full(&grid.chunk);
                tensors.push(TargetTensor {
                    name: name.clone(),
                    dtype: l.dtype,
                    shape: grid.chunk.clone(),
                    pieces: vec![Piece { global, local }],
                });
            }
        }
        let grids: BTreeMap<&str, &Grid> = shardings.iter().map(|(n, s)| (*n, &s.grid)).collect();
        let grid_json = serde_json::to_string(&grids).map_err(|e| Error::Unsupported {
            problem: format!("the chunk grid: {e}"),
        })?;
        let file = TargetFile {
            path: Path::new(&self.item).join(MANIFEST_FILE),
            tensors,
            metadata: BTreeMap::from([(GRID_KEY.to_string(), grid_json)]),
        };
        let mut plan = CopyPlan::build(source, vec![file])?;
        for (t, key) in plan.files.iter_mut().flat_map(|f| &mut f.tensors).zip(keys) {
            t.target.name = key;
        }
        Ok(plan)
    }

    /// A sharded item's `_METADATA`, `_sharding` and `array_metadatas/process_0`.
    fn finish_sharded(&self, strategy: &Strategy, item: &Path) -> Result<()> {
        let shardings = Self::shardings(strategy)?;
        let leaves = shardings.iter().map(|(n, s)| (*n, Some(&s.grid.chunk[..])));
        write_file_atomic(&item.join(METADATA_FILE), metadata_json(leaves).as_bytes())?;
        let axes: Vec<(String, u64)> = strategy
            .mesh
            .axes()
            .iter()
            .map(|a| (a.name.clone(), a.size))
            .collect();
        let file = sharding_file(
            shardings
                .iter()
                .map(|(n, s)| (*n, named_sharding(&axes, &s.spec))),
        );
        write_file_atomic(&item.join(SHARDING_FILE), file.as_bytes())?;
        // As `ArrayMetadataStore` writes it: informational, each array's write and chunk
        // shape (one host).
        let metas: Vec<serde_json::Value> = shardings
            .iter()
            .map(|(n, s)| {
                serde_json::json!({"array_metadata": {"param_name": n, "write_shape": s.grid.chunk,
                    "chunk_shape": s.grid.chunk, "ext_metadata": null}})
            })
            .collect();
        let dir = item.join(ARRAY_METADATAS);
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
        let doc = serde_json::json!({ "array_metadatas": metas }).to_string();
        write_file_atomic(&dir.join("process_0"), doc.as_bytes())
    }
}

/// The directory of the per-host array metadata files in an item.
const ARRAY_METADATAS: &str = "array_metadatas";

impl Writer for OrbaxStep {
    fn name(&self) -> &'static str {
        "orbax"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        if let Some(strategy) = &self.strategy {
            return self.sharded_plan(strategy, source);
        }
        let tensors = whole_tensors(source, selection)?;
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            })
            .collect();
        check(&specs)?;
        let file = TargetFile {
            path: Path::new(&self.item).join(MANIFEST_FILE),
            tensors,
            metadata: BTreeMap::new(),
        };
        CopyPlan::build(source, vec![file])
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn strategy(&self) -> Option<&Strategy> {
        self.strategy.as_ref()
    }

    fn finish(&self, _: &Checkpoint, _: &Selection, plan: &CopyPlan, dir: &Path) -> Result<()> {
        let item = dir.join(&self.item);
        if let Some(strategy) = &self.strategy {
            self.finish_sharded(strategy, &item)?;
        } else {
            let names = plan
                .files
                .iter()
                .flat_map(|f| &f.tensors)
                .map(|t| (t.target.name.as_str(), None));
            write_file_atomic(&item.join(METADATA_FILE), metadata_json(names).as_bytes())?;
        }
        let committed = |what: &str| format!("Checkpoint commit was successful to {what}");
        write_file_atomic(&item.join(COMMIT_FILE), committed(&self.item).as_bytes())?;
        let meta = step_metadata_json(&self.item, self.started_ns, now_ns());
        write_file_atomic(&dir.join(CHECKPOINT_METADATA), meta.as_bytes())?;
        // Last: the mark of a committed step.
        write_file_atomic(&dir.join(COMMIT_FILE), committed("this step").as_bytes())
    }
}
