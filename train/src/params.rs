//! Parameters of a tensor-parallel model: a candle `VarBuilder` backend that hands each
//! rank its local slice, the specs it records, deterministic initialisation of the
//! global tensors, and the region copies between global and local tensors.
//!
//! Models ask for a tensor by its **global** shape with a [`ParamHint`] saying how the
//! `tp` axis splits it; the backend answers with this rank's local piece, as the
//! ckpt-core [`TensorLayout`] of that placement defines it (`torch.chunk`, blocked for
//! fused QKV). The names built with `vb.pp(..)` are the checkpoint keys.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::{Backend, VarBuilderArgs};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::region::Region;
use ckpt_core::layout::{Dtype, Placement, TensorLayout};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// How a parameter is initialised (on its global shape, so any `tp` gives the same
/// global tensor).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Uniform in `[-bound, bound]`.
    Uniform {
        /// Half-width.
        bound: f32,
    },
    /// Normal with mean 0.
    Normal {
        /// Standard deviation.
        std: f32,
    },
}

/// What a model says about a tensor besides its name and global shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamHint {
    /// Placement on the `tp` axis.
    pub tp: Placement,
    /// Initialisation.
    pub init: Init,
    /// Trained by the optimizer (`false` for buffers such as BatchNorm running stats).
    pub trainable: bool,
}

impl Default for ParamHint {
    fn default() -> ParamHint {
        ParamHint {
            tp: Placement::Replicate,
            init: Init::Zeros,
            trainable: true,
        }
    }
}

impl ParamHint {
    /// A replicated trainable tensor.
    #[must_use]
    pub fn replicated(init: Init) -> ParamHint {
        ParamHint {
            tp: Placement::Replicate,
            init,
            trainable: true,
        }
    }

    /// A trainable tensor split along `dim` over `tp`.
    #[must_use]
    pub fn shard(dim: usize, init: Init) -> ParamHint {
        ParamHint {
            tp: Placement::shard(dim),
            init,
            trainable: true,
        }
    }

    /// A trainable tensor whose `dim` is `blocks` fused blocks, each split over `tp`.
    #[must_use]
    pub fn blocked(dim: usize, blocks: u64, init: Init) -> ParamHint {
        ParamHint {
            tp: Placement::blocked(dim, blocks),
            init,
            trainable: true,
        }
    }

    /// A replicated buffer (not trained).
    #[must_use]
    pub fn buffer(init: Init) -> ParamHint {
        ParamHint {
            tp: Placement::Replicate,
            init,
            trainable: false,
        }
    }
}

/// A tensor a model declared: name, global shape and hint.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Checkpoint key, e.g. `blocks.0.fc1.weight`.
    pub name: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Placement, initialisation, trainable.
    pub hint: ParamHint,
}

impl ParamSpec {
    /// The tensor's layout on `mesh`: the hint's placement on `tp`, replicated on
    /// every other axis.
    #[must_use]
    pub fn layout(&self, mesh: &Mesh) -> TensorLayout {
        let placements = mesh
            .axes()
            .iter()
            .map(|a| {
                if a.name == "tp" {
                    self.hint.tp
                } else {
                    Placement::Replicate
                }
            })
            .collect();
        TensorLayout::new(self.shape.clone(), Dtype::F32, placements)
    }

    /// Number of elements of the global tensor.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }
}

enum Mode {
    Record,
    Serve(BTreeMap<String, Tensor>),
}

/// The `VarBuilder` backend of tensor-parallel models.
///
/// In *record* mode it returns zeros of the local shape and remembers every
/// [`ParamSpec`]; in *serve* mode it returns the tensors it was given (candle `Var`s
/// when training, plain tensors for inference), checking their local shapes.
pub struct ShardedVars {
    mode: Mode,
    tp_mesh: Mesh,
    tp_rank: u64,
    specs: Arc<Mutex<Vec<ParamSpec>>>,
}

/// A `VarBuilder` over [`ShardedVars`].
pub type ShardedVarBuilder<'a> = VarBuilderArgs<'a, ShardedVars>;

impl ShardedVars {
    fn tp_mesh(tp_size: usize) -> Mesh {
        Mesh::new(vec![("tp".into(), tp_size as u64)]).expect("tp size >= 1")
    }

    /// A recording backend for `tp_size` ranks (as seen from tp rank `tp_rank`).
    #[must_use]
    pub fn record(tp_size: usize, tp_rank: usize) -> ShardedVars {
        ShardedVars {
            mode: Mode::Record,
            tp_mesh: Self::tp_mesh(tp_size),
            tp_rank: tp_rank as u64,
            specs: Arc::default(),
        }
    }

    /// A backend serving the given local tensors of tp rank `tp_rank`.
    #[must_use]
    pub fn serve(tensors: BTreeMap<String, Tensor>, tp_size: usize, tp_rank: usize) -> ShardedVars {
        ShardedVars {
            mode: Mode::Serve(tensors),
            tp_mesh: Self::tp_mesh(tp_size),
            tp_rank: tp_rank as u64,
            specs: Arc::default(),
        }
    }

    /// A backend serving candle `Var`s (training).
    #[must_use]
    pub fn serve_vars(vars: &BTreeMap<String, Var>, tp_size: usize, tp_rank: usize) -> ShardedVars {
        Self::serve(
            vars.iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                .collect(),
            tp_size,
            tp_rank,
        )
    }

    /// The log of specs asked for, in declaration order (shared: keep it to read the
    /// specs after the backend moved into a `VarBuilder`).
    #[must_use]
    pub fn spec_log(&self) -> Arc<Mutex<Vec<ParamSpec>>> {
        self.specs.clone()
    }

    /// Wraps the backend in a `VarBuilder` (f32, CPU).
    #[must_use]
    pub fn into_var_builder<'a>(self) -> ShardedVarBuilder<'a> {
        VarBuilderArgs::new_with_args(self, DType::F32, &Device::Cpu)
    }
}

impl Backend for ShardedVars {
    type Hints = ParamHint;

    fn get(
        &self,
        s: Shape,
        name: &str,
        h: ParamHint,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let spec = ParamSpec {
            name: name.to_string(),
            shape: s.dims().iter().map(|&d| d as u64).collect(),
            hint: h,
        };
        let local: Vec<usize> = spec
            .layout(&self.tp_mesh)
            .local_shape(&self.tp_mesh, self.tp_rank)
            .unwrap_or_default()
            .iter()
            .map(|&d| d as usize)
            .collect();
        self.specs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(spec);
        match &self.mode {
            Mode::Record => Tensor::zeros(local, dtype, dev),
            Mode::Serve(map) => {
                let t = map
                    .get(name)
                    .ok_or_else(|| candle_core::Error::CannotFindTensor {
                        path: name.to_string(),
                    })?;
                if t.dims() != local.as_slice() {
                    return Err(candle_core::Error::UnexpectedShape {
                        msg: format!(
                            "shape mismatch for {name} (local piece of global {:?})",
                            s.dims()
                        ),
                        expected: local.into(),
                        got: t.shape().clone(),
                    });
                }
                Ok(t.clone())
            }
        }
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match &self.mode {
            Mode::Serve(map) => {
                map.get(name)
                    .cloned()
                    .ok_or_else(|| candle_core::Error::CannotFindTensor {
                        path: name.to_string(),
                    })
            }
            Mode::Record => Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        match &self.mode {
            Mode::Serve(map) => map.contains_key(name),
            Mode::Record => true,
        }
    }
}

/// FNV-1a of a name, to seed its initialisation.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The global initial value of `spec` for `seed` (independent of the mesh).
#[must_use]
pub fn init_global(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let n = spec.numel();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ name_hash(&spec.name));
    match spec.hint.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Uniform { bound } => (0..n).map(|_| rng.random_range(-bound..=bound)).collect(),
        Init::Normal { std } => (0..n)
            .map(|_| {
                // Box-Muller.
                let u1: f32 = rng.random_range(f32::EPSILON..1.0);
                let u2: f32 = rng.random::<f32>();
                std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect(),
    }
}

/// Copies the box `extent` starting at `src_start` in a row-major tensor of shape
/// `src_shape` to `dst_start` in one of shape `dst_shape`, a run of the last dimension
/// at a time.
pub(crate) fn copy_box<T: Copy>(
    src: &[T],
    src_shape: &[u64],
    src_start: &[u64],
    dst: &mut [T],
    dst_shape: &[u64],
    dst_start: &[u64],
    extent: &[u64],
) {
    let nd = extent.len();
    if extent.contains(&0) {
        return;
    }
    if nd == 0 {
        dst[0] = src[0];
        return;
    }
    let strides = |shape: &[u64]| -> Vec<u64> {
        let mut s = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    let run = extent[nd - 1] as usize;
    let mut idx = vec![0u64; nd - 1];
    loop {
        let so: u64 = (0..nd)
            .map(|d| (src_start[d] + if d < nd - 1 { idx[d] } else { 0 }) * ss[d])
            .sum();
        let dof: u64 = (0..nd)
            .map(|d| (dst_start[d] + if d < nd - 1 { idx[d] } else { 0 }) * ds[d])
            .sum();
        dst[dof as usize..dof as usize + run].copy_from_slice(&src[so as usize..so as usize + run]);
        let mut d = nd - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// `rank`'s local piece of a global tensor under `layout` (empty when it holds none).
#[must_use]
pub fn slice_local(global: &[f32], layout: &TensorLayout, mesh: &Mesh, rank: u64) -> Vec<f32> {
    let Some(local_shape) = layout.local_shape(mesh, rank) else {
        return Vec::new();
    };
    let mut out = vec![0f32; local_shape.iter().product::<u64>() as usize];
    for p in layout.pieces(mesh, rank) {
        copy_box(
            global,
            &layout.shape,
            &p.global.start,
            &mut out,
            &local_shape,
            &p.local.start,
            &p.global.shape,
        );
    }
    out
}

/// Writes `rank`'s local tensor into its place in `global`.
pub fn place_local(
    local: &[f32],
    layout: &TensorLayout,
    mesh: &Mesh,
    rank: u64,
    global: &mut [f32],
) {
    let Some(local_shape) = layout.local_shape(mesh, rank) else {
        return;
    };
    for p in layout.pieces(mesh, rank) {
        copy_box(
            local,
            &local_shape,
            &p.local.start,
            global,
            &layout.shape,
            &p.global.start,
            &p.global.shape,
        );
    }
}

fn flat(coord: &[u64], shape: &[u64]) -> u64 {
    coord.iter().zip(shape).fold(0, |acc, (&c, &n)| acc * n + c)
}

/// For every element of `inner`'s local tensor on `rank` (row-major), its flat index in
/// `outer`'s local tensor on the same rank. `inner` must hold a sub-box of what `outer`
/// holds (an optimizer shard of a parameter).
///
/// # Errors
/// [`Error::InvalidModel`] when an element of `inner` is not held under `outer`.
pub fn local_positions(
    outer: &TensorLayout,
    inner: &TensorLayout,
    mesh: &Mesh,
    rank: u64,
) -> Result<Vec<u32>> {
    let Some(inner_shape) = inner.local_shape(mesh, rank) else {
        return Ok(Vec::new());
    };
    let outer_shape = outer.local_shape(mesh, rank).unwrap_or_default();
    let outer_pieces = outer.pieces(mesh, rank);
    let mut out = vec![0u32; inner_shape.iter().product::<u64>() as usize];
    for p in inner.pieces(mesh, rank) {
        let n = p.global.numel();
        let nd = p.global.ndim();
        let mut off = vec![0u64; nd];
        for _ in 0..n {
            let g: Vec<u64> = (0..nd).map(|d| p.global.start[d] + off[d]).collect();
            let cell = Region::new(g.clone(), vec![1; nd]);
            let op = outer_pieces
                .iter()
                .find(|o| o.global.contains(&cell))
                .ok_or_else(|| {
                    Error::model(
                        "optimizer",
                        format!("element {g:?} of the optimizer shard is not held by rank {rank}"),
                    )
                })?;
            let ol: Vec<u64> = (0..nd)
                .map(|d| op.local.start[d] + g[d] - op.global.start[d])
                .collect();
            let il: Vec<u64> = (0..nd).map(|d| p.local.start[d] + off[d]).collect();
            out[flat(&il, &inner_shape) as usize] = flat(&ol, &outer_shape) as u32;
            for d in (0..nd).rev() {
                off[d] += 1;
                if off[d] < p.global.shape[d] {
                    break;
                }
                off[d] = 0;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_and_place_are_inverse_for_blocked_shards() {
        let mesh = Mesh::parse("dp=2,tp=2").unwrap();
        let l = TensorLayout::new(
            vec![6, 2],
            Dtype::F32,
            vec![Placement::Replicate, Placement::blocked(0, 3)],
        );
        let g: Vec<f32> = (0..12).map(|i| i as f32).collect();
        // tp rank 1 holds rows 1, 3, 5.
        assert_eq!(
            slice_local(&g, &l, &mesh, 1),
            vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
        );
        let mut back = vec![0f32; 12];
        for r in 0..4 {
            place_local(&slice_local(&g, &l, &mesh, r), &l, &mesh, r, &mut back);
        }
        assert_eq!(back, g);
    }

    #[test]
    fn zero_shard_positions_nest_inside_the_tp_shard() {
        let mesh = Mesh::parse("dp=2,tp=2").unwrap();
        let param = TensorLayout::new(
            vec![8, 1],
            Dtype::F32,
            vec![Placement::Replicate, Placement::shard(0)],
        );
        let opt = TensorLayout::new(
            vec![8, 1],
            Dtype::F32,
            vec![
                Placement::Shard {
                    dim: 0,
                    blocks: 1,
                    order: 1,
                },
                Placement::shard(0),
            ],
        );
        // rank 2 = (dp 1, tp 0): tp holds rows 0..4, its dp shard rows 2..4.
        assert_eq!(local_positions(&param, &opt, &mesh, 2).unwrap(), vec![2, 3]);
        assert_eq!(local_positions(&param, &opt, &mesh, 1).unwrap(), vec![0, 1]);
    }

    #[test]
    fn init_is_deterministic_and_named() {
        let s = |name: &str| ParamSpec {
            name: name.into(),
            shape: vec![3, 4],
            hint: ParamHint::replicated(Init::Normal { std: 1.0 }),
        };
        assert_eq!(init_global(&s("a"), 1), init_global(&s("a"), 1));
        assert_ne!(init_global(&s("a"), 1), init_global(&s("b"), 1));
        let u = ParamSpec {
            hint: ParamHint::replicated(Init::Uniform { bound: 0.5 }),
            ..s("u")
        };
        assert!(init_global(&u, 0).iter().all(|v| v.abs() <= 0.5));
    }
}
