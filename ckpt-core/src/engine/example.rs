//! A synthetic tensor-parallel transformer checkpoint, for examples, tests and
//! benchmarks: column- and row-sharded matrices, a fused QKV weight stored as a blocked
//! shard, replicated norms, and a vocabulary that does not divide evenly.
//!
//! Every element's value is a hash of the tensor name and its global index, so any
//! rank's slice can be produced alone and any output checked without the original.

use crate::engine::save::write_rank;
use crate::error::Result;
use crate::layout::mesh::Mesh;
use crate::layout::strategy::Strategy;
use crate::layout::{Dtype, Placement, TensorLayout};
use std::path::Path;

/// Size of the synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct ExampleModel {
    /// Hidden size.
    pub hidden: u64,
    /// Number of layers.
    pub layers: u64,
    /// Vocabulary (rows of the embedding); odd sizes give uneven shards.
    pub vocab: u64,
    /// Element type of the matrices (norms too).
    pub dtype: Dtype,
    /// Add AdamW moments (`optim.<name>.exp_avg`, F32) of every matrix, sharded ZeRO-1
    /// style: the tensor-parallel slice split again over the other axes.
    pub optimizer: bool,
}

impl Default for ExampleModel {
    fn default() -> Self {
        ExampleModel {
            hidden: 64,
            layers: 2,
            vocab: 1000,
            dtype: Dtype::BF16,
            optimizer: false,
        }
    }
}

/// The strategy of the example model on `mesh`; the innermost axis is tensor parallel,
/// an axis called `pp` is the pipeline (layers spread evenly over its stages) and any
/// other axis replicates (data parallel).
///
/// # Errors
/// An invalid layout (e.g. a hidden size of 0).
pub fn example_strategy(model: &ExampleModel, mesh: &Mesh) -> Result<Strategy> {
    let n = mesh.axes().len();
    let on_tp = |p: Placement| -> Vec<Placement> {
        let mut v = vec![Placement::Replicate; n];
        if let Some(last) = v.last_mut() {
            *last = p;
        }
        v
    };
    let h = model.hidden;
    let pp = mesh.axis_index("pp");
    let mesh = match pp {
        Some(_) if n > 1 => mesh.clone().with_pipeline("pp")?,
        _ => mesh.clone(),
    };
    let stages = pp.filter(|_| n > 1).map_or(1, |p| mesh.axes()[p].size);
    let mut s = Strategy::new(mesh.clone());
    let add = |s: &mut Strategy, name: String, layout: TensorLayout, stage: u64| -> Result<()> {
        let layout = if stages > 1 {
            layout.with_stage(stage)
        } else {
            layout
        };
        if model.optimizer && layout.shape.len() == 2 {
            // ZeRO-1: the moment's tensor-parallel slice is split again on dim 0 by every
            // data-parallel axis (after the tensor-parallel split: order 1).
            let mut m = layout.clone();
            m.dtype = Dtype::F32;
            for (i, p) in m.placements.iter_mut().enumerate() {
                if *p == Placement::Replicate && Some(i) != mesh.pipeline() && i + 1 < n {
                    *p = Placement::Shard {
                        dim: 0,
                        blocks: 1,
                        order: 1,
                    };
                }
            }
            if let Some(Placement::Shard { blocks, dim: 0, .. }) = layout.placements.last() {
                // A blocked dim 0 keeps its blocks on every axis that splits it.
                for p in &mut m.placements {
                    if let Placement::Shard {
                        dim: 0, blocks: b, ..
                    } = p
                    {
                        *b = *blocks;
                    }
                }
            }
            s.insert(format!("optim.{name}.exp_avg"), m)?;
        }
        s.insert(name, layout)
    };
    add(
        &mut s,
        "embed.weight".into(),
        TensorLayout::new(
            vec![model.vocab, h],
            model.dtype,
            on_tp(Placement::shard(0)),
        ),
        0,
    )?;
    for l in 0..model.layers {
        let p = format!("layers.{l}");
        let st = l * stages / model.layers.max(1);
        add(
            &mut s,
            format!("{p}.attn.qkv.weight"),
            TensorLayout::new(vec![3 * h, h], model.dtype, on_tp(Placement::blocked(0, 3))),
            st,
        )?;
        add(
            &mut s,
            format!("{p}.attn.proj.weight"),
            TensorLayout::new(vec![h, h], model.dtype, on_tp(Placement::shard(1))),
            st,
        )?;
        add(
            &mut s,
            format!("{p}.mlp.up.weight"),
            TensorLayout::new(vec![4 * h, h], model.dtype, on_tp(Placement::shard(0))),
            st,
        )?;
        add(
            &mut s,
            format!("{p}.mlp.down.weight"),
            TensorLayout::new(vec![h, 4 * h], model.dtype, on_tp(Placement::shard(1))),
            st,
        )?;
        add(
            &mut s,
            format!("{p}.norm.weight"),
            TensorLayout::new(vec![h], model.dtype, vec![Placement::Replicate; n]),
            st,
        )?;
    }
    s.insert(
        "step",
        TensorLayout::new(vec![], Dtype::I64, vec![Placement::Replicate; n]),
    )?;
    Ok(s)
}

/// The byte at global byte `i` of tensor `name`: a cheap, well-mixed hash.
#[must_use]
pub fn example_byte(name: &str, i: u64) -> u8 {
    let mut h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    h ^= i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h = (h ^ (h >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (h ^ (h >> 29)) as u8
}

/// The whole of tensor `name` of `layout`, as bytes.
#[must_use]
pub fn example_tensor(name: &str, layout: &TensorLayout) -> Vec<u8> {
    let n = crate::layout::plan::bytes_of(layout.dtype, layout.shape.iter().product());
    (0..n).map(|i| example_byte(name, i)).collect()
}

/// Writes a sliced example checkpoint (`dir/ckpt_<r>/`) on `mesh`; returns its strategy.
///
/// # Errors
/// I/O errors.
pub fn write_example(dir: &Path, model: &ExampleModel, mesh: &Mesh) -> Result<Strategy> {
    let strategy = example_strategy(model, mesh)?;
    let mesh = &strategy.mesh;
    for rank in 0..mesh.world_size() {
        let mut locals: Vec<(String, Vec<u8>)> = Vec::new();
        for (name, l) in &strategy.tensors {
            let Some(shape) = l.local_shape(mesh, rank) else {
                continue;
            };
            if !l.is_owner(mesh, rank) {
                continue;
            }
            let el = crate::layout::plan::bytes_of(l.dtype, 1);
            let mut buf = vec![
                0u8;
                (crate::layout::plan::bytes_of(l.dtype, shape.iter().product()))
                    as usize
            ];
            for p in l.pieces(mesh, rank) {
                for run in crate::layout::region::Runs::new(
                    &p.global.shape,
                    &l.shape,
                    &p.global.start,
                    &shape,
                    &p.local.start,
                ) {
                    let (g, d, len) = (run.src * el, run.dst * el, run.len * el);
                    for k in 0..len {
                        buf[(d + k) as usize] = example_byte(name, g + k);
                    }
                }
            }
            locals.push((name.clone(), buf));
        }
        let refs: Vec<(&str, &[u8])> = locals
            .iter()
            .map(|(n, b)| (n.as_str(), b.as_slice()))
            .collect();
        write_rank(dir, &strategy, rank, &refs, false)?;
    }
    crate::formats::output::write_file_atomic(
        &dir.join(crate::checkpoint::STRATEGY_FILE),
        strategy.to_json().as_bytes(),
    )?;
    Ok(strategy)
}
