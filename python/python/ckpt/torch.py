"""PyTorch: fill a live state dict from any checkpoint ckpt reads, and save a sliced
checkpoint with its strategy from every rank.

``load_state_dict`` works on plain tensors and DTensors (``Shard(d)``, ``Replicate``,
nested shards on a 2-D mesh, uneven ``torch.chunk`` pieces, empty pieces, FSDP2's
``_StridedShard`` over tensor parallelism), on CPU or GPU: each rank reads only the
bytes of its own pieces, with no collective. Everything (names, shapes, dtypes,
coverage) is checked before the first byte is copied, so a refused load leaves the
state dict as it was.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ckpt import Checkpoint, Paths, _ckpt
from ckpt._arrays import dtype_name_of_torch, materialize
from ckpt.errors import OutputExists, Unsupported, UsageError

__all__ = ["load", "load_state_dict", "save_state_dict", "SaveHandle"]


def load(path, **kwargs: Any) -> Dict[str, torch.Tensor]:
    """``ckpt.load(path, ..., framework="torch")``."""
    import ckpt

    return ckpt.load(path, framework="torch", **kwargs)


def _flatten(sd: Mapping[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    """``(dotted name, tensor)`` of every tensor in a (nested) state dict, as
    ``torch.distributed.checkpoint`` names them (``optim.state.<fqn>.exp_avg``)."""
    out: List[Tuple[str, Any]] = []
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out.append((name, v))
        elif isinstance(v, Mapping):
            out.extend(_flatten(v, name + "."))
        elif isinstance(v, (list, tuple)):
            out.extend(_flatten({str(i): x for i, x in enumerate(v)}, name + "."))
    return out


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        return None
    return DTensor


def _strided_shard_class():
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch without it
        return None
    return _StridedShard


def _placements(t, name: str) -> List[Tuple[Optional[int], int]]:
    """A DTensor's placements as ckpt's: per mesh axis ``(dim, order)`` for a shard
    (axes split a dimension in increasing ``order``, ties outer axis first) or
    ``(None, 0)`` for ``Replicate``.

    ``_StridedShard(d, split_factor=k)`` is what FSDP2 puts on its data-parallel axis
    when a tensor-parallel axis to its right already splits dim ``d`` (``fully_shard``
    over a 2-D mesh): the TP axes cut ``d`` first, then the DP axis cuts each TP piece,
    which is ckpt's ``Shard(d, order=1)`` beside the TP axes' ``Shard(d)``, provided the
    plain ``Shard(d)`` axes to its right have ``k`` ranks in all and no other axis
    splits ``d``. Other strided layouts, and ``Partial``, are refused by name."""
    from torch.distributed.tensor import Replicate, Shard

    strided = _strided_shard_class()
    ps = list(t.placements)
    sizes = list(t.device_mesh.mesh.shape)
    out: List[Tuple[Optional[int], int]] = []
    for i, p in enumerate(ps):
        if strided is not None and isinstance(p, strided):
            splits_d = [
                j
                for j, q in enumerate(ps)
                if j != i and (isinstance(q, Shard) or isinstance(q, strided)) and q.dim == p.dim
            ]
            k = 1
            for j in splits_d:
                k *= sizes[j]
            if any(j < i or type(ps[j]) is not Shard for j in splits_d) or k != p.split_factor:
                raise Unsupported(
                    f"tensor `{name}`: placements {tuple(ps)} on mesh {tuple(sizes)}: ckpt maps "
                    f"_StridedShard(d, split_factor=k) when the only other axes splitting dim d "
                    f"come after it as Shard(d) with k ranks in all (FSDP2 over tensor "
                    f"parallelism); redistribute this tensor to Shard/Replicate placements first"
                )
            out.append((p.dim, 1))
        elif type(p) is Shard:
            out.append((p.dim, 0))
        elif isinstance(p, Replicate):
            out.append((None, 0))
        else:
            raise Unsupported(
                f"tensor `{name}`: placement {p!r}: ckpt reads and writes Shard(d), "
                f"Replicate and FSDP2's _StridedShard placements"
            )
    return out


def _placement_texts(t, name: str) -> List[str]:
    return [
        "Replicate" if d is None else f"Shard({d})" if o == 0 else f"Shard({d},order={o})"
        for d, o in _placements(t, name)
    ]


def _chunk(n: int, k: int, i: int) -> Tuple[int, int]:
    """``torch.chunk`` of ``n`` into ``k``: piece ``i`` as ``(start, length)``."""
    size = -(-n // k)
    start = min(i * size, n)
    return start, min(start + size, n) - start


def _box_of(t, name: str) -> Tuple[List[int], List[int]]:
    """(global start, local shape) of this rank's piece of a DTensor, as ckpt cuts it:
    the sharding axes in increasing order, each taking its ``torch.chunk`` of what the
    axes before it left (exactly what FSDP2 stores for ``_StridedShard``, whose local
    data is its DP chunk of the TP chunk)."""
    places = _placements(t, name)
    coords = t.device_mesh.get_coordinate()
    if coords is None:
        raise Unsupported(f"tensor `{name}`: this rank is not in the DTensor's device mesh")
    sizes = list(t.device_mesh.mesh.shape)
    start, length = [0] * t.dim(), list(t.shape)
    for _, a in sorted((o, a) for a, (d, o) in enumerate(places) if d is not None):
        d = places[a][0]
        s, n = _chunk(length[d], sizes[a], coords[a])
        start[d] += s
        length[d] = n
    return start, length


def _local_box(t, name: str) -> Tuple[torch.Tensor, List[int], List[int], List[int]]:
    """(local tensor, global shape, global start, local shape) of a tensor or DTensor."""
    DTensor = _dtensor_class()
    if DTensor is not None and isinstance(t, DTensor):
        local = t._local_tensor
        offset, shape = _box_of(t, name)
        if tuple(local.shape) != tuple(shape):
            raise Unsupported(
                f"tensor `{name}`: DTensor of local shape {tuple(local.shape)}, its "
                f"placements {tuple(t.placements)} give {tuple(shape)}"
            )
        return local, list(t.shape), offset, shape
    return t, list(t.shape), [0] * t.dim(), list(t.shape)


def load_state_dict(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    source_strategy: Optional[Paths] = None,
    strip_prefix: Optional[str] = None,
    checksums: bool = True,
) -> Dict[str, Any]:
    """Fills ``state_dict`` in place from the checkpoint at ``path`` (any format ckpt
    reads, or an opened :class:`ckpt.Checkpoint`).

    ``state_dict``: a model's ``state_dict()``, or ``get_state_dict(model, optim)``'s
    (nested dicts are flattened with dots, as DCP names them). Plain tensors receive the
    whole tensor; DTensors receive the pieces their ``device_mesh`` and ``placements``
    give this rank, whatever layout the checkpoint was saved with (load-time
    resharding). Floating-point tensors may differ in dtype (the values are converted).

    Everything is checked before the first byte is copied: a name the checkpoint lacks
    (:class:`ckpt.CheckpointError`, ``InvalidInput``), another global shape
    (:class:`ckpt.Mismatch`, naming both shapes), missing ranks (:class:`ckpt.MissingData`),
    a recorded checksum that does not match (:class:`ckpt.ChecksumMismatch`); then the
    state dict is left untouched. Returns ``state_dict``.
    """
    ck = path if isinstance(path, Checkpoint) else Checkpoint(
        path, source_strategy=source_strategy, strip_prefix=strip_prefix
    )
    items = _flatten(state_dict)
    requests = []
    locals_: List[torch.Tensor] = []
    for name, t in items:
        local, global_shape, start, local_shape = _local_box(t, name)
        requests.append((name, global_shape, dtype_name_of_torch(local.dtype), start, local_shape))
        locals_.append(local)
    plan = ck._native.plan_boxes(requests)
    if checksums:
        plan.check_checksums()
    # Straight into the tensors' memory where it is contiguous on the CPU; through a
    # (pinned, for GPUs) buffer otherwise.
    fills = []
    staged = []
    for i, local in enumerate(locals_):
        nbytes = local.numel() * local.element_size()
        if local.device.type == "cpu" and local.is_contiguous():
            fills.append((i, local.data_ptr(), nbytes))
        else:
            buf = torch.empty(
                local.shape, dtype=local.dtype, pin_memory=local.device.type == "cuda"
            )
            fills.append((i, buf.data_ptr(), nbytes))
            staged.append((local, buf))
    with torch.no_grad():
        plan.fill(fills)
        for local, buf in staged:
            local.copy_(buf, non_blocking=True)
    if any(local.device.type == "cuda" for local, _ in staged):
        torch.cuda.synchronize()
    return state_dict


def _world() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mesh_of(items, world: int) -> Tuple[List[Tuple[str, int]], Any]:
    """The device mesh of the state dict's DTensors, as ckpt axes: the one with the
    most dimensions, spanning the world in rank order (ckpt's ranks are the mesh's
    row-major coordinates). DTensors on a slice of it (FSDP2 over TP puts the layers TP
    leaves alone on the ``dp`` slice of the 2-D mesh) are replicated on its other axes;
    any other mesh is refused."""
    DTensor = _dtensor_class()
    meshes = []
    for _, t in items:
        if DTensor is not None and isinstance(t, DTensor) and all(
            t.device_mesh is not m for m in meshes
        ):
            meshes.append(t.device_mesh)
    if not meshes:
        return [("dp", world)], None
    m = max(meshes, key=lambda x: x.ndim)
    ranks = m.mesh.flatten().tolist()
    for other in meshes:
        if other is not m and _slice_axes(other, m) is None:
            raise Unsupported(
                f"the state dict's DTensors are on device meshes {m} and {other}, neither a "
                f"slice of the other: ckpt saves one mesh per checkpoint"
            )
    if ranks != list(range(world)):
        raise Unsupported(
            f"the device mesh holds ranks {ranks}: ckpt saves meshes that span ranks 0..{world - 1} in order"
        )
    return [(str(n), int(s)) for n, s in zip(_axis_names(m), m.mesh.shape)], m


def _axis_names(mesh) -> Tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim)))


def _slice_axes(sub, mesh) -> Optional[List[int]]:
    """The axes of ``mesh`` that ``sub`` is the slice of through this rank (``mesh[
    "dp"]``: same names, in order, and the ranks of ``mesh`` that share this rank's
    coordinates on the other axes), or None."""
    if sub is mesh or (
        sub.mesh_dim_names == mesh.mesh_dim_names and sub.mesh.shape == mesh.mesh.shape
        and torch.equal(sub.mesh, mesh.mesh)
    ):
        return list(range(mesh.ndim))
    if sub.mesh_dim_names is None or mesh.mesh_dim_names is None:
        return None
    names = list(mesh.mesh_dim_names)
    if not all(n in names for n in sub.mesh_dim_names):
        return None
    axes = [names.index(n) for n in sub.mesh_dim_names]
    coord = mesh.get_coordinate()
    if axes != sorted(axes) or coord is None:
        return None
    index = tuple(slice(None) if i in axes else c for i, c in enumerate(coord))
    return axes if torch.equal(mesh.mesh[index], sub.mesh) else None


class SaveHandle:
    """A save running in the background (``save_state_dict(..., background=True)``)."""

    def __init__(self, run) -> None:
        self._error: Optional[BaseException] = None
        self._result: Optional[str] = None

        def target():
            try:
                self._result = run()
            except BaseException as e:  # re-raised by wait()
                self._error = e

        self._thread = threading.Thread(target=target, name="ckpt-save", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        """Whether the write has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Finishes the write: returns the checkpoint's path once this rank's part is
        written (and the whole checkpoint committed, if this rank was the last), or
        raises the error the write met."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        return self._result


# Saves started per checkpoint path by this process: every rank calls save_state_dict
# in the same order, so (path, count) names the same save on every rank.
_STARTED: Dict[str, int] = {}


def _token(out: str, rank: int, world: int):
    """A name shared by every rank of this save, so that a stale staging directory of a
    crashed run is never taken for this one's. Returns a function giving it, to call on
    the save's thread: rank 0 publishes a fresh one in the process group's key-value
    store under (path, count), the others wait for it there. A store lookup is not a
    collective, so it can run in the background without racing the training loop's
    collectives, and the training loop never waits for the other ranks. Without a store
    (a process group not made by init_process_group), one broadcast now."""
    n = _STARTED[out] = _STARTED.get(out, 0) + 1
    mine = uuid.uuid4().hex
    if world == 1:
        return lambda: mine
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        store = None
    if store is None:
        tok = [mine if rank == 0 else None]
        dist.broadcast_object_list(tok, src=0)
        return lambda: str(tok[0])
    key = f"ckpt.save_state_dict/{out}/{n}"
    if rank == 0:
        return lambda: (store.set(key, mine), mine)[1]
    return lambda: store.get(key).decode()


def _commit(staging: str, out: str, world: int, strategy: str) -> None:
    """Moves ``staging`` to ``out`` once every rank's ``ckpt_<r>/`` is in it. Each rank
    checks after its own directory appeared (atomically, by rename), so the last one to
    finish sees them all and commits; two that finish together race on one rename,
    which only one can win."""
    if not all(os.path.isdir(os.path.join(staging, f"ckpt_{r}")) for r in range(world)):
        return
    top = os.path.join(staging, "strategy.json")
    tmp = f"{top}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(strategy)
        os.replace(tmp, top)
        os.rename(staging, out)
    except OSError:
        # Another finisher committed it first: the staging directory is gone, and the
        # checkpoint is in place.
        if not (os.path.isdir(out) and not os.path.isdir(staging)):
            raise


def save_state_dict(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    background: bool = False,
    keep_all: bool = False,
):
    """Called on every rank: writes this rank's local shards as a ckpt sliced checkpoint,
    ``path/ckpt_<rank>/model.safetensors`` plus ``strategy.json`` derived from the
    DTensors' placements on their device mesh (plain tensors are replicated; their
    owner, rank 0 of each replica group, stores them unless ``keep_all``).

    The checkpoint is committed atomically once every rank has written: until then it
    lives in a hidden sibling directory, and ``path`` never exists half-written. Rank 0
    names that directory through the process group's store; no collective is needed.
    Every rank must call it for the same paths in the same order (as with any
    distributed save).
    ``ckpt merge``, ``ckpt reshard --to N`` and :func:`load_state_dict` (on any mesh)
    read the result.

    ``background=True`` copies the local shards into memory (the training stall: nothing
    else, no waiting for other ranks) and writes them on a thread: it returns a :class:`SaveHandle` whose ``wait()`` finishes
    the write. Otherwise it returns ``path`` once this rank's part is written.
    """
    out = os.path.abspath(os.fspath(path))
    rank, world = _world()
    if os.path.exists(out):
        raise OutputExists(f"{out} already exists")
    items = _flatten(state_dict)
    axes, mesh = _mesh_of(items, world)
    tensors = []
    local_data = []
    DTensor = _dtensor_class()
    for name, t in items:
        if DTensor is not None and isinstance(t, DTensor):
            placements = ["Replicate"] * len(axes)
            for axis, text in zip(_slice_axes(t.device_mesh, mesh), _placement_texts(t, name)):
                placements[axis] = text
            local = t._local_tensor
        else:
            placements = ["Replicate"] * len(axes)
            local = t
        tensors.append((name, dtype_name_of_torch(local.dtype), list(t.shape), placements))
        local = local.detach()
        if background:
            # The one copy the training loop waits for.
            local = local.to("cpu", copy=True).contiguous()
        else:
            local = local.cpu().contiguous()
        local_data.append((name, local))
    strategy = _ckpt.strategy_json(axes, tensors)
    token = _token(out, rank, world)
    parent, base = os.path.split(out)

    def run() -> str:
        staging = os.path.join(parent, f".{base}.partial-{token()}")
        os.makedirs(staging, exist_ok=True)
        # This rank's directory appears whole: written under a private name, renamed.
        private = os.path.join(staging, f".rank-{rank}")
        if os.path.exists(private):
            shutil.rmtree(private)
        ptrs = [(n, t.data_ptr(), t.numel() * t.element_size()) for n, t in local_data]
        _ckpt.write_rank(private, strategy, rank, ptrs, keep_all)
        os.rename(os.path.join(private, f"ckpt_{rank}"), os.path.join(staging, f"ckpt_{rank}"))
        os.rmdir(private)
        _commit(staging, out, world, strategy)
        return out

    if background:
        return SaveHandle(run)
    return run()
