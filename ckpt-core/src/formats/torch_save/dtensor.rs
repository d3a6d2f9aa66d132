//! DTensors in a `torch.save` pickle (FSDP1's `SHARDED_STATE_DICT`, verl's
//! `model_world_size_N_rank_R.pt`): read from what the pickle records, never made.
//!
//! torch 2.15 (`torch/_tensor.py` `Tensor.__reduce_ex__`, `torch/_utils.py`
//! `_rebuild_wrapper_subclass`) pickles a DTensor as
//! `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size,
//! stride, storage_offset, layout, device, requires_grad), state)`, where `state` (or
//! its second item, the slots) is the instance's dict: `_local_tensor`, this rank's
//! tensor (a plain `_rebuild_tensor_v2` view of a storage), and `_spec`, a
//! `DTensorSpec` built with `{mesh, placements, tensor_meta, shard_order, ...}`
//! (`torch/distributed/tensor/_dtensor_spec.py`). The mesh is a `DeviceMesh` built with
//! its `__getstate__` (`torch/distributed/device_mesh.py`): `_rank` (this process's
//! global rank), `_coordinate_on_dim` (its coordinate in the mesh), `_layout` (a
//! `_MeshLayout` of one `_FlatLayout` per mesh dim, whose `shape` gives the dim's size)
//! and `_flatten_rank_map` (every rank of the root mesh); torch before 2.9 records a
//! `mesh` tensor instead of the layout, whose size is read from its pickle.
//! `tensor_meta` is `TensorMeta(torch.Size(global shape), stride, dtype)`.
//!
//! The box this rank holds follows `torch/distributed/tensor/_utils.py`
//! `_compute_local_shape_and_global_offset`: mesh dims left to right, `Shard(d)` cuts
//! the current extent of tensor dim `d` as `torch.chunk` does (chunks of
//! `ceil(n / k)`, the last ones shorter or empty), `Replicate` keeps it. `Partial`
//! (pending sums) and `_StridedShard` (interleaved rows) are not boxes and are refused
//! by name, as is a recorded shard order other than left to right.

use crate::error::{overflow, Error, Result};
use crate::formats::pickle::Value;

/// Where a DTensor's local tensor sits in the DTensor's global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placed {
    /// The DTensor's global shape.
    pub(crate) global: Vec<u64>,
    /// Where this rank's box starts in the global tensor.
    pub(crate) offsets: Vec<u64>,
    /// The box's shape: what the local tensor must hold.
    pub(crate) shape: Vec<u64>,
    /// The process's global rank, where the mesh records it.
    pub(crate) rank: Option<u64>,
    /// The number of ranks of the root mesh, where the mesh records it.
    pub(crate) world: Option<u64>,
}

fn bad(path: &str, problem: impl std::fmt::Display) -> Error {
    Error::InvalidTensor {
        tensor: path.to_string(),
        problem: format!("a DTensor: {problem}"),
    }
}

/// Whether the arguments of a `_rebuild_from_type_v2` call rebuild a DTensor.
pub(crate) fn is_dtensor(from_type_args: &Value) -> bool {
    from_type_args
        .items()
        .and_then(|a| a.get(1))
        .and_then(Value::global)
        .is_some_and(|(m, n)| n == "DTensor" && m.starts_with("torch.distributed"))
}

/// The class a record was made of (`NEWOBJ`/`REDUCE` of a global, built or not).
fn class(v: &Value) -> Option<&str> {
    match v {
        Value::Call { callable, .. } => callable.global().map(|(_, n)| n),
        Value::Build { object, .. } => class(object),
        _ => None,
    }
}

/// A field of an object built with a state dict (or a `(dict, slots)` state), or of a
/// dict.
fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Build { state, .. } => field(state, key),
        Value::Tuple(parts) => parts.iter().find_map(|p| field(p, key)),
        Value::Dict(kv) => kv
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn uint(path: &str, v: &Value, what: &str) -> Result<u64> {
    match v {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        _ => Err(bad(path, format!("{what} is not a non-negative integer"))),
    }
}

/// A tuple or list of non-negative integers, or a `torch.Size` of one.
fn uints(path: &str, v: &Value, what: &str) -> Result<Vec<u64>> {
    if let Some(((_, "Size"), args)) = v.call_of() {
        if let Some([inner]) = args.items() {
            return uints(path, inner, what);
        }
    }
    match v.items() {
        Some(items) => items.iter().map(|x| uint(path, x, what)).collect(),
        None => Err(bad(path, format!("{what} is not a tuple of integers"))),
    }
}

/// The product of every integer in a (possibly nested) layout shape.
fn product(path: &str, v: &Value) -> Result<u64> {
    match v {
        Value::Int(_) => uint(path, v, "a mesh size"),
        Value::Tuple(x) | Value::List(x) => x.iter().try_fold(1u64, |acc, y| {
            acc.checked_mul(product(path, y)?)
                .ok_or_else(|| overflow(format!("`{path}` mesh size")))
        }),
        _ => Err(bad(path, "a mesh layout shape that is not integers")),
    }
}

/// The size of each mesh dim: from `_layout` (torch 2.9 and later) or the `mesh`
/// tensor's size as pickled (before).
fn mesh_shape(path: &str, mesh: &Value) -> Result<Vec<u64>> {
    if let Some(layout) = field(mesh, "_layout") {
        let axes = field(layout, "axes")
            .and_then(Value::items)
            .ok_or_else(|| bad(path, "its mesh's `_layout` has no `axes`"))?;
        return axes
            .iter()
            .map(|a| match field(a, "shape") {
                Some(s) => product(path, s),
                None => Err(bad(path, "a mesh layout axis without a `shape`")),
            })
            .collect();
    }
    match field(mesh, "mesh").and_then(Value::call_of) {
        Some(((_, "_rebuild_tensor_v2"), args)) => match args.items() {
            Some(a) if a.len() > 2 => uints(path, &a[2], "the mesh tensor's size"),
            _ => Err(bad(path, "its `mesh` tensor has no size")),
        },
        _ => Err(bad(
            path,
            "its device mesh records neither `_layout` nor a `mesh` tensor",
        )),
    }
}

/// The number of ranks of the mesh's root: `_flatten_rank_map`'s length, or the mesh
/// tensor's element count when the mesh is its own root.
fn world(path: &str, mesh: &Value, shape: &[u64]) -> Result<Option<u64>> {
    if let Some(map) = field(mesh, "_flatten_rank_map").and_then(Value::items) {
        return Ok(Some(map.len() as u64));
    }
    let is_root = matches!(field(mesh, "_root_mesh"), None | Some(Value::None));
    if !is_root {
        return Ok(None);
    }
    let n = shape
        .iter()
        .try_fold(1u64, |a, &b| a.checked_mul(b))
        .ok_or_else(|| overflow(format!("`{path}` mesh size")))?;
    Ok(Some(n))
}

/// `torch.chunk`'s piece `i` of `k` of an extent `n`: its size and start.
pub(crate) fn chunk(n: u64, k: u64, i: u64) -> (u64, u64) {
    if k == 0 {
        return (n, 0);
    }
    let size = n.div_ceil(k);
    let start = size.saturating_mul(i).min(n);
    let end = start.saturating_add(size).min(n);
    (end - start, start)
}

/// One placement, per mesh dim: the tensor dim it shards, or `None` (replicated).
fn placement(path: &str, mesh_dim: usize, p: &Value) -> Result<Option<usize>> {
    match class(p) {
        Some("Replicate") => Ok(None),
        Some("Shard") => {
            let dim = field(p, "dim")
                .or_else(|| p.call_of().and_then(|(_, a)| a.items()?.first()))
                .ok_or_else(|| bad(path, format!("Shard on mesh dim {mesh_dim} without a dim")))?;
            let d = uint(path, dim, "a Shard's dim")?;
            usize::try_from(d).map(Some).map_err(|_| overflow(path))
        }
        Some(other) => Err(bad(
            path,
            format!(
                "placement `{other}` on mesh dim {mesh_dim} is not read (only Shard and \
                 Replicate are boxes of the global tensor; gather it with `full_tensor()` \
                 or redistribute it to Shard/Replicate before saving)"
            ),
        )),
        None => Err(bad(path, format!("placement {mesh_dim} is not a record"))),
    }
}

/// Refuses a recorded shard order other than torch's default (for each tensor dim,
/// its mesh dims left to right), which `_compute_local_shape_and_global_offset` would
/// not give the box of.
fn check_shard_order(path: &str, order: Option<&Value>) -> Result<()> {
    let Some(entries) = order.and_then(Value::items) else {
        return Ok(());
    };
    for e in entries {
        let args = match e {
            Value::Call { args, .. } => args.items(),
            other => other.items(),
        };
        if let Some([_, mesh_dims]) = args {
            let dims = uints(path, mesh_dims, "a shard order's mesh dims")?;
            if dims.windows(2).any(|w| w[0] >= w[1]) {
                return Err(bad(
                    path,
                    format!("shard order over mesh dims {dims:?} (not left to right) is not read"),
                ));
            }
        }
    }
    Ok(())
}

/// Reads the DTensor rebuilt by `_rebuild_from_type_v2(*from_type_args)`, named `path`:
/// its local tensor's pickle (a `_rebuild_tensor_v2` call, not checked here) and where
/// that tensor sits.
///
/// # Errors
/// A pickle that does not record a DTensor as torch does, placements other than Shard
/// and Replicate, a rank outside the mesh, a box outside the global shape.
pub(crate) fn read(path: &str, from_type_args: &Value) -> Result<(Value, Placed)> {
    let items = from_type_args
        .items()
        .ok_or_else(|| bad(path, "_rebuild_from_type_v2 without arguments"))?;
    let [_, _, wrapper, state, ..] = items else {
        return Err(bad(path, "_rebuild_from_type_v2 without a state"));
    };
    let local = field(state, "_local_tensor")
        .ok_or_else(|| bad(path, "no `_local_tensor` in its state"))?
        .clone();
    let spec = field(state, "_spec").ok_or_else(|| bad(path, "no `_spec` in its state"))?;
    let mesh = field(spec, "mesh").ok_or_else(|| bad(path, "its spec has no `mesh`"))?;
    let placements = field(spec, "placements")
        .and_then(Value::items)
        .ok_or_else(|| bad(path, "its spec has no `placements`"))?;
    // TensorMeta(shape, stride, dtype), a named tuple; else the wrapper's size.
    let meta_shape = field(spec, "tensor_meta").and_then(|m| match m {
        Value::Call { args, .. } => args.items().and_then(|a| a.first()),
        other => other.items().and_then(|a| a.first()),
    });
    let global = match meta_shape {
        Some(s) => uints(path, s, "its global shape (tensor_meta)")?,
        None => match wrapper.items() {
            Some(w) if w.len() > 2 => uints(path, &w[2], "its global size")?,
            _ => return Err(bad(path, "its spec has no `tensor_meta`")),
        },
    };
    check_shard_order(path, field(spec, "shard_order"))?;
    let sizes = mesh_shape(path, mesh)?;
    let coord = match field(mesh, "_coordinate_on_dim") {
        Some(Value::None) | None => {
            return Err(bad(
                path,
                "this rank is not in its device mesh (`_coordinate_on_dim` is None)",
            ))
        }
        Some(c) => uints(path, c, "its mesh coordinate")?,
    };
    if coord.len() != sizes.len() || placements.len() != sizes.len() {
        return Err(bad(
            path,
            format!(
                "a mesh of shape {sizes:?}, coordinate {coord:?} and {} placements",
                placements.len()
            ),
        ));
    }
    let rank = match field(mesh, "_rank") {
        Some(r) => Some(uint(path, r, "its mesh's `_rank`")?),
        None => None,
    };
    let world = world(path, mesh, &sizes)?;
    let mut offsets = vec![0u64; global.len()];
    let mut shape = global.clone();
    for (i, p) in placements.iter().enumerate() {
        let Some(d) = placement(path, i, p)? else {
            continue;
        };
        if d >= global.len() {
            return Err(bad(
                path,
                format!("Shard({d}) of a tensor of shape {global:?}"),
            ));
        }
        if coord[i] >= sizes[i] {
            return Err(bad(
                path,
                format!("coordinate {coord:?} outside the mesh {sizes:?}"),
            ));
        }
        let (size, start) = chunk(shape[d], sizes[i], coord[i]);
        offsets[d] = offsets[d]
            .checked_add(start)
            .ok_or_else(|| overflow(format!("`{path}` offset")))?;
        shape[d] = size;
    }
    Ok((
        local,
        Placed {
            global,
            offsets,
            shape,
            rank,
            world,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(module: &str, name: &str) -> Value {
        Value::Global {
            module: module.into(),
            name: name.into(),
        }
    }

    fn dict(kv: Vec<(&str, Value)>) -> Value {
        Value::Dict(
            kv.into_iter()
                .map(|(k, v)| (Value::Str(k.into()), v))
                .collect(),
        )
    }

    fn ints(v: &[u64]) -> Value {
        Value::Tuple(v.iter().map(|&i| Value::Int(i as i64)).collect())
    }

    /// A record as pickle makes one: `NEWOBJ` of the class, `BUILD` with its state.
    fn record(class: &str, state: Vec<(&str, Value)>) -> Value {
        Value::Build {
            object: Box::new(Value::Call {
                callable: Box::new(g("torch.distributed.tensor.placement_types", class)),
                args: Box::new(Value::Tuple(vec![])),
            }),
            state: Box::new(dict(state)),
        }
    }

    fn shard(d: u64) -> Value {
        record("Shard", vec![("dim", Value::Int(d as i64))])
    }

    /// `_rebuild_from_type_v2`'s arguments for a DTensor of `global` shape on a mesh of
    /// `mesh` shape at `coord`, as torch 2.15 pickles it.
    fn dtensor(global: &[u64], mesh: &[u64], coord: Value, placements: Vec<Value>) -> Value {
        let axes = mesh
            .iter()
            .map(|&n| {
                record(
                    "_FlatLayout",
                    vec![("shape", ints(&[n])), ("stride", ints(&[1]))],
                )
            })
            .collect();
        let mesh = record(
            "DeviceMesh",
            vec![
                (
                    "_layout",
                    record("_MeshLayout", vec![("axes", Value::Tuple(axes))]),
                ),
                ("_rank", Value::Int(2)),
                ("_coordinate_on_dim", coord),
                ("_flatten_rank_map", ints(&[0, 1, 2, 3])),
            ],
        );
        let size = Value::Call {
            callable: Box::new(g("torch", "Size")),
            args: Box::new(Value::Tuple(vec![ints(global)])),
        };
        let meta = Value::Call {
            callable: Box::new(g("torch.distributed.tensor._dtensor_spec", "TensorMeta")),
            args: Box::new(Value::Tuple(vec![size, ints(&[1]), g("torch", "float32")])),
        };
        let spec = record(
            "DTensorSpec",
            vec![
                ("mesh", mesh),
                ("placements", Value::Tuple(placements)),
                ("tensor_meta", meta),
            ],
        );
        let state = Value::Tuple(vec![
            Value::None,
            dict(vec![("_local_tensor", Value::None), ("_spec", spec)]),
        ]);
        Value::Tuple(vec![
            g("torch._utils", "_rebuild_wrapper_subclass"),
            g("torch.distributed.tensor", "DTensor"),
            Value::Tuple(vec![]),
            state,
        ])
    }

    #[test]
    fn a_dim_cut_by_two_mesh_dims_left_to_right() {
        // torch's head.weight of 10x2 with (Shard(0), Shard(0)) on 2x2, coordinate (1, 0):
        // rows 5..10, then their first 3.
        let args = dtensor(&[10, 2], &[2, 2], ints(&[1, 0]), vec![shard(0), shard(0)]);
        assert!(is_dtensor(&args));
        let (_, p) = read("head.weight", &args).unwrap();
        assert_eq!((p.offsets, p.shape), (vec![5, 0], vec![3, 2]));
        assert_eq!((p.global, p.rank, p.world), (vec![10, 2], Some(2), Some(4)));
        // (Replicate, Shard(1)) of 3x7 at (1, 1): columns 4..7.
        let rep = record("Replicate", vec![]);
        let args = dtensor(&[3, 7], &[2, 2], ints(&[1, 1]), vec![rep, shard(1)]);
        let (_, p) = read("b", &args).unwrap();
        assert_eq!((p.offsets, p.shape), (vec![0, 4], vec![3, 3]));
    }

    #[test]
    fn placements_that_are_not_boxes_are_refused_by_name() {
        for class in ["_StridedShard", "Partial"] {
            let p = record(class, vec![("dim", Value::Int(0))]);
            let args = dtensor(&[4, 4], &[2, 2], ints(&[0, 1]), vec![shard(0), p]);
            let e = read("w", &args).unwrap_err().to_string();
            assert!(
                e.contains("`w`") && e.contains(&format!("`{class}` on mesh dim 1")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_rank_outside_its_mesh_and_a_mismatched_mesh_are_named() {
        let args = dtensor(&[4], &[2], Value::None, vec![shard(0)]);
        let e = read("w", &args).unwrap_err().to_string();
        assert!(e.contains("not in its device mesh"), "{e}");
        let args = dtensor(&[4], &[2, 2], ints(&[0, 1]), vec![shard(0)]);
        let e = read("w", &args).unwrap_err().to_string();
        assert!(e.contains("1 placements"), "{e}");
        let args = dtensor(&[4], &[2], ints(&[0]), vec![shard(1)]);
        let e = read("w", &args).unwrap_err().to_string();
        assert!(e.contains("Shard(1) of a tensor of shape [4]"), "{e}");
    }

    #[test]
    fn a_shard_order_other_than_left_to_right_is_refused() {
        let entry = |mesh_dims: &[u64]| Value::Call {
            callable: Box::new(g(
                "torch.distributed.tensor._dtensor_spec",
                "ShardOrderEntry",
            )),
            args: Box::new(Value::Tuple(vec![Value::Int(0), ints(mesh_dims)])),
        };
        check_shard_order("w", Some(&Value::Tuple(vec![entry(&[0, 1])]))).unwrap();
        let e = check_shard_order("w", Some(&Value::Tuple(vec![entry(&[1, 0])])))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[1, 0]"), "{e}");
    }

    #[test]
    fn chunks_as_torch_chunk() {
        // torch.arange(7).chunk(2): [0..4), [4..7); 1 row in 2: [0..1), empty at 1.
        assert_eq!(chunk(7, 2, 0), (4, 0));
        assert_eq!(chunk(7, 2, 1), (3, 4));
        assert_eq!(chunk(1, 2, 1), (0, 1));
        // 5 in 4: chunks of 2: [0,2) [2,4) [4,5) and an empty one at 5.
        assert_eq!(chunk(5, 4, 2), (1, 4));
        assert_eq!(chunk(5, 4, 3), (0, 5));
        assert_eq!(chunk(8, 4, 3), (2, 6));
    }
}
