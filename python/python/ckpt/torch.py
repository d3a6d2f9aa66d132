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

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from ckpt import Checkpoint, Paths, _ckpt, _device, _objects, _staging
from ckpt._device import Staging
from ckpt._arrays import dtype_name_of_torch
from ckpt.errors import CheckpointError, MissingData, OutputExists, Unsupported, UsageError

__all__ = ["load", "load_state_dict", "save_state_dict", "SaveHandle"]


def load(path, **kwargs: Any) -> Dict[str, torch.Tensor]:
    """``ckpt.load(path, ..., framework="torch")``."""
    import ckpt

    return ckpt.load(path, framework="torch", **kwargs)


def _is_stateful(v: Any) -> bool:
    """DCP's ``Stateful``: an object with ``state_dict()`` and ``load_state_dict()``
    (a module, an optimizer, an LR scheduler, an application's own state)."""
    return (
        not isinstance(v, torch.Tensor)
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


def _terminal(v: Any) -> bool:
    """Whether ``v`` is stored whole as one non-tensor value, as DCP's traversal decides:
    mappings are always walked into, lists only when they hold a tensor, a ``Stateful``
    or a container walked into (optimizer ``param_groups``: a list of dicts); anything
    else is a leaf. (Tuples holding tensors are walked into too, as ckpt always did;
    DCP would pickle them whole.)"""
    if isinstance(v, (torch.Tensor, Mapping)) or _is_stateful(v):
        return False
    if isinstance(v, (list, tuple)):
        return all(_terminal(e) for e in v)
    return True


class _Walk:
    """A state dict taken apart: ``tensors`` (dotted name, tensor), ``others`` (dotted
    name, value, container, key) of every non-tensor leaf, and ``statefuls`` (object,
    the dict its ``state_dict()`` gave), innermost first."""

    def __init__(self, sd: Mapping[str, Any]) -> None:
        self.tensors: List[Tuple[str, Any]] = []
        self.others: List[Tuple[str, Any, Any, Any]] = []
        self.statefuls: List[Tuple[Any, Any]] = []
        self._visit(sd, "", None, None)

    def _visit(self, v: Any, name: str, container: Any, key: Any) -> None:
        def child(k) -> str:
            return f"{name}.{k}" if name else str(k)

        if isinstance(v, torch.Tensor):
            self.tensors.append((name, v))
        elif _is_stateful(v):
            inner = v.state_dict()
            self._visit(inner, name, container, key)
            self.statefuls.append((v, inner))
        elif isinstance(v, Mapping):
            for k, x in v.items():
                self._visit(x, child(k), v, k)
        elif not _terminal(v):
            for i, x in enumerate(v):
                self._visit(x, child(i), v, i)
        else:
            self.others.append((name, v, container, key))


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


KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]


def _renamer(key_map: Optional[KeyMap]) -> Callable[[str], Optional[str]]:
    if key_map is None:
        return lambda n: n
    if callable(key_map):
        return key_map
    if isinstance(key_map, Mapping):
        return lambda n: key_map.get(n, n)
    raise UsageError(f"key_map={key_map!r}: a mapping or a function of the state dict's name")


def _saved_objects(ck: Checkpoint) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The encoded non-tensor values of the checkpoint and the file they are in; (None,
    None) if it has none. ``non_tensor_state.json`` at the top of an input directory
    (as :func:`save_state_dict` and ``ckpt merge`` write it), else beside the
    checkpoint's files (``ckpt reshard`` carries it into each rank directory)."""
    places = [p for p in ck._paths if os.path.isdir(p)]
    places += [os.path.dirname(f) for f, _, _ in ck.files]
    for p in places:
        f = os.path.join(p, _objects.FILE)
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                return _objects.loads(fh.read(), f), f
    return None, None


def load_state_dict(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    source_strategy: Optional[Paths] = None,
    strip_prefix: Optional[str] = None,
    checksums: bool = True,
    strict: bool = True,
    key_map: Optional[KeyMap] = None,
    chunk_mb: Optional[float] = None,
    streams: Optional[int] = None,
) -> Mapping[str, Any]:
    """Fills ``state_dict`` in place from the checkpoint at ``path`` (any format ckpt
    reads, or an opened :class:`ckpt.Checkpoint`).

    ``state_dict``: a model's ``state_dict()``, or ``get_state_dict(model, optim)``'s,
    or a dict of ``Stateful`` objects (``{"model": model, "optim": optimizer, "sched":
    scheduler, "step": 0}``) as for ``torch.distributed.checkpoint.load``: names are
    dotted paths (nested dicts, and lists holding tensors or dicts, walked into, as DCP
    names them). Plain tensors receive the whole tensor; DTensors receive the pieces
    their ``device_mesh`` and ``placements`` give this rank, whatever layout the
    checkpoint was saved with (load-time resharding). Floating-point tensors may differ
    in dtype (the values are converted). Non-tensor values (ints, floats, strings,
    lists such as ``param_groups``, ...) are replaced by the checkpoint's (its
    ``non_tensor_state.json``, written by :func:`save_state_dict`); a ``Stateful``
    object gets ``load_state_dict()`` with its ``state_dict()`` so filled.

    ``key_map``: the checkpoint's name for a state-dict name: a dict (names it lacks are
    kept) or a function (returning None skips that entry). ``strict=False``: entries the
    checkpoint lacks are left as they are (a warning names them) instead of refusing the
    load; shapes and dtypes must still agree.

    Tensors on a GPU (plain or DTensors' local shards) are filled through ``streams``
    (default 2) reused pinned buffers of ``chunk_mb`` (default 64) MiB, as
    :func:`ckpt.load` with ``device=``: the host memory the load adds stays bounded.

    Everything is checked before the first byte is copied: a name the checkpoint lacks
    (:class:`ckpt.CheckpointError`, ``InvalidInput``; :class:`ckpt.MissingData` for a
    non-tensor value), another global shape (:class:`ckpt.Mismatch`, naming both
    shapes), missing ranks (:class:`ckpt.MissingData`), a recorded checksum that does not
    match (:class:`ckpt.ChecksumMismatch`); then the state dict is left untouched.
    Returns ``state_dict``.
    """
    ck = path if isinstance(path, Checkpoint) else Checkpoint(
        path, source_strategy=source_strategy, strip_prefix=strip_prefix
    )
    rename = _renamer(key_map)
    walk = _Walk(state_dict)
    requests = []
    locals_: List[torch.Tensor] = []
    missing: List[str] = []
    for name, t in walk.tensors:
        src = rename(name)
        if src is None:
            continue
        if not strict and src not in ck.tensors:
            missing.append(name)
            continue
        local, global_shape, start, local_shape = _local_box(t, name)
        requests.append((src, global_shape, dtype_name_of_torch(local.dtype), start, local_shape))
        locals_.append(local)
    plan = ck._native.plan_boxes(requests)
    saved, saved_file = _saved_objects(ck) if walk.others else (None, None)
    values = []
    absent = []
    for name, current, container, key in walk.others:
        src = rename(name)
        if src is None:
            continue
        if saved is None or src not in saved:
            absent.append(name)
            continue
        v = _objects.decode(saved[src], f"{saved_file}: `{src}`")
        if isinstance(container, tuple) and not _same(v, current):
            raise Unsupported(
                f"state dict entry `{name}` sits in a tuple, which cannot be changed in "
                f"place: the checkpoint holds {v!r}, the state dict {current!r}"
            )
        values.append((container, key, v))
    if absent and strict:
        where = (
            f"not in {saved_file}"
            if saved_file
            else f"the checkpoint has no non-tensor state (no {_objects.FILE}: "
            f"ckpt.torch.save_state_dict writes one)"
        )
        raise MissingData(
            f"{where}: {', '.join(f'`{n}`' for n in absent)} (strict=False loads the "
            f"rest and leaves these as they are)"
        )
    missing += absent
    if checksums:
        plan.check_checksums()
    staging = Staging.of(chunk_mb, streams)
    # Straight into the tensors' memory where it is contiguous on the CPU; through a
    # buffer where it is not; device tensors through a few small pinned buffers, into
    # their own memory (or a contiguous twin copied in on the device).
    fills = []
    staged = []
    on_device: Dict[Any, Dict[int, torch.Tensor]] = {}
    for i, local in enumerate(locals_):
        nbytes = local.numel() * local.element_size()
        if local.device.type == "cpu":
            if local.is_contiguous():
                fills.append((i, local.data_ptr(), nbytes))
            else:
                buf = torch.empty(local.shape, dtype=local.dtype)
                fills.append((i, buf.data_ptr(), nbytes))
                staged.append((local, buf))
        else:
            dest = local if local.is_contiguous() else torch.empty_like(
                local, memory_format=torch.contiguous_format
            )
            on_device.setdefault(local.device, {})[i] = dest
            if dest is not local:
                staged.append((local, dest))
    with torch.no_grad():
        plan.fill(fills)
        for device, dests in on_device.items():
            _device.fill_through_buffers(plan, dests, staging, _device.copier_for(device, staging))
        for local, buf in staged:
            local.copy_(buf)
    for container, key, v in values:
        if not isinstance(container, tuple):
            container[key] = v
    for obj, inner in walk.statefuls:
        obj.load_state_dict(inner)
    if missing:
        warnings.warn(
            f"ckpt.torch.load_state_dict(strict=False): not in the checkpoint, left as "
            f"they were: {', '.join(missing)}",
            stacklevel=2,
        )
    return state_dict


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 (a comparison that cannot say)
        return False


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
        """Whether the save has finished (committed on every rank, or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Returns the checkpoint's path once the checkpoint is committed, on every rank
        (after it returns, any rank may read, copy or upload ``path``); raises the error
        the save met (on this rank, or ``CheckpointError`` naming the rank that failed);
        None if ``timeout`` seconds passed first."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        return self._result


# Saves started per checkpoint path by this process: every rank calls save_state_dict
# in the same order, so (path, count) names the same save on every rank.
_STARTED: Dict[str, int] = {}

# Without a process group's store, how long a rank waits for the others to commit.
_POLL_TIMEOUT_S = 30 * 60.0


def _store():
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class _Rendezvous:
    """What the ranks of one save share: the staging directory's token, and the barrier
    that makes every rank's ``wait()`` return only once the checkpoint is committed.

    Both go through the process group's key-value store (``init_process_group``'s
    TCPStore): lookups, not collectives, so they run on the save's thread without
    racing the training loop's collectives, and the training loop never waits for
    another rank. Rank 0 publishes a fresh token; each rank, once its part is written
    (or failed), records its status and adds one to a counter; the rank whose addition
    completes it commits (or, if a rank failed, does not) and publishes the outcome,
    which every rank waits for. Without a store (a process group not made by
    ``init_process_group``): the token by one broadcast now, and each rank polls the
    directory for the committed checkpoint."""

    def __init__(self, out: str, rank: int, world: int) -> None:
        n = _STARTED[out] = _STARTED.get(out, 0) + 1
        self.rank, self.world = rank, world
        self.key = f"ckpt.save_state_dict/{out}/{n}"
        self._mine = uuid.uuid4().hex
        self.store = None
        self._broadcast: Optional[str] = None
        if world == 1:
            return
        self.store = _store()
        if self.store is None:
            import torch.distributed as dist

            tok = [self._mine if rank == 0 else None]
            dist.broadcast_object_list(tok, src=0)
            self._broadcast = str(tok[0])

    def token(self) -> str:
        if self.world == 1:
            return self._mine
        if self.store is None:
            return self._broadcast
        key = f"{self.key}/token"
        if self.rank == 0:
            self.store.set(key, self._mine)
            return self._mine
        return self.store.get(key).decode()

    def finish(
        self, failure: Optional[str], commit: Callable[[], None], out: str, staging: str
    ) -> None:
        """This rank's part is written (``failure`` None) or failed: returns once the
        checkpoint is committed on every rank, raises if it will not be. A save that
        failed leaves no staging directory where the ranks can tell (every rank has
        finished: one process, or a store that counted them all)."""
        if self.world == 1:
            if failure is None:
                commit()
            else:
                shutil.rmtree(staging, ignore_errors=True)
            return
        if self.store is None:
            if failure is None:
                commit()  # only the rank that sees every part there commits
                _poll_committed(out)
            return
        self.store.set(f"{self.key}/status/{self.rank}", failure or "ok")
        if self.store.add(f"{self.key}/written", 1) == self.world:
            failed = [
                s.decode()
                for s in (self.store.get(f"{self.key}/status/{r}") for r in range(self.world))
                if s != b"ok"
            ]
            outcome = "ok"
            if failed:
                outcome = "; ".join(failed)
                shutil.rmtree(staging, ignore_errors=True)
            else:
                try:
                    commit()
                except Exception as e:  # noqa: BLE001 (told to every rank)
                    outcome = f"rank {self.rank} could not commit {out}: {e}"
            self.store.set(f"{self.key}/committed", outcome)
        outcome = self.store.get(f"{self.key}/committed").decode()
        if outcome != "ok" and failure is None:
            raise CheckpointError(f"{out} was not committed: {outcome}")


def _poll_committed(out: str) -> None:
    delay, deadline = 0.01, time.monotonic() + _POLL_TIMEOUT_S
    while not os.path.isdir(out):
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{out}: not committed after {_POLL_TIMEOUT_S:.0f} s (a rank did not finish its part)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _commit(staging: str, out: str, world: int, strategy: str) -> None:
    """Moves ``staging`` to ``out`` once every rank's ``ckpt_<r>/`` is in it (with a
    store, the one rank that completed the counter calls it; without one, each rank
    after its own directory appeared, and two that finish together race on one rename,
    which only one can win)."""
    if not all(os.path.isdir(os.path.join(staging, f"ckpt_{r}")) for r in range(world)):
        return
    top = os.path.join(staging, "strategy.json")
    tmp = f"{top}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(strategy)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, top)
        for n in os.listdir(staging):
            if n.startswith(".owner-"):
                os.remove(os.path.join(staging, n))
        _staging.fsync_dir(staging)
        os.rename(staging, out)
        _staging.fsync_dir(os.path.dirname(out))
    except OSError:
        # Another finisher committed it first: the staging directory is gone, and the
        # checkpoint is in place.
        if not (os.path.isdir(out) and not os.path.isdir(staging)):
            raise


def _is_url(x: str) -> bool:
    from ckpt import _is_url as is_url

    return is_url(x)


def _gather(value: Any, rank: int, world: int) -> List[Any]:
    """Every rank's ``value`` (rank order), on every rank; the process group's when
    there is one."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    out: List[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _remote_prepare(url: str, rank: int, world: int) -> None:
    """Rank 0 cleans up after a killed save to ``url`` and refuses an existing output;
    every rank learns the outcome before anything is staged."""
    failure = None
    if rank == 0:
        try:
            _ckpt.prepare_remote_output(url)
        except Exception as e:  # noqa: BLE001 - passed to every rank, then raised
            failure = e
    outcome = _gather(None if failure is None else (type(failure).__name__, str(failure)), rank, world)[0]
    if failure is not None:
        raise failure
    if outcome is not None:
        raise CheckpointError(f"rank 0 could not prepare {url}: {outcome[0]}: {outcome[1]}")


def _store_gather(store, key: str, rank: int, world: int) -> Callable[[Any], List[Any]]:
    """``_gather`` through the process group's key-value store (lookups, not
    collectives): for a save on a background thread, which must not race the training
    loop's collectives. Values are JSON; each call gets keys of its own under ``key``."""
    calls = [0]

    def gather(value: Any) -> List[Any]:
        if world == 1:
            return [value]
        calls[0] += 1
        at = f"{key}/gather/{calls[0]}"
        store.set(f"{at}/{rank}", json.dumps(value))
        return [json.loads(store.get(f"{at}/{r}").decode()) for r in range(world)]

    return gather


def _save_remote(url, rank, world, strategy, encoded, local_data, keep_all, checksums, gather=None) -> str:
    """``save_state_dict`` to an object store: each rank writes its ``ckpt_<rank>/``
    locally, uploads it as multipart uploads that are not completed (nothing visible),
    and once every rank has staged, rank 0 completes them all, ``strategy.json`` last
    (docs/storage.md). ``gather``: how the ranks exchange what they staged (the process
    group's collectives by default; its store from a background thread)."""
    if gather is None:
        gather = lambda value: _gather(value, rank, world)  # noqa: E731
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckpt-save-") as tmp:
        local = os.path.join(tmp, "out")
        private = os.path.join(tmp, "rank")
        ptrs = [(n, t.data_ptr(), t.numel() * t.element_size()) for n, t in local_data]
        failure = None
        staged = None
        stream = None
        try:
            # The rank's whole parts go up while write_rank writes them, and leave the
            # local disk (docs/storage.md); the rest is sent by stage_remote.
            stream = _ckpt.stream_remote(private, url, rank)
            _ckpt.write_rank(private, strategy, rank, ptrs, keep_all, checksums)
            os.makedirs(local)
            os.rename(os.path.join(private, f"ckpt_{rank}"), os.path.join(local, f"ckpt_{rank}"))
            if rank == 0:
                with open(os.path.join(local, "strategy.json"), "w") as f:
                    f.write(strategy)
                if encoded:
                    _write_objects(local, encoded)
            staged = _ckpt.stage_remote(local, url, rank, stream)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            failure = e
        finally:
            if stream is not None:
                stream.close()
        everyone = gather(staged if failure is None else None)
        if failure is not None:
            raise failure
        missing = [r for r, x in enumerate(everyone) if x is None]
        if missing:
            raise CheckpointError(f"{url}: rank(s) {missing} failed to stage their files: nothing was committed")
        failure = None
        if rank == 0:
            try:
                _ckpt.commit_remote(url, everyone)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                failure = e
        outcome = gather(None if failure is None else f"{type(failure).__name__}: {failure}")[0]
        if failure is not None:
            raise failure
        if outcome is not None:
            raise CheckpointError(f"{url}: rank 0 could not commit the save: {outcome}")
    return url


def _write_objects(staging: str, encoded: Dict[str, Any]) -> None:
    path = os.path.join(staging, _objects.FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(_objects.dumps(encoded))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_state_dict(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    background: bool = False,
    keep_all: bool = False,
    checksums: bool = True,
):
    """Called on every rank: writes this rank's local shards as a ckpt sliced checkpoint,
    ``path/ckpt_<rank>/model.safetensors`` plus ``strategy.json`` derived from the
    DTensors' placements on their device mesh (plain tensors are replicated; their
    owner, rank 0 of each replica group, stores them unless ``keep_all``), and
    ``path/non_tensor_state.json``: everything in the state dict that is not a tensor
    (optimizer ``param_groups``, LR scheduler state, step counters), as JSON (rank 0's
    values, taken as the same on every rank as DCP does). ``Stateful`` objects (with
    ``state_dict()``/``load_state_dict()``: modules, optimizers, schedulers) are saved
    as what their ``state_dict()`` returns, as ``torch.distributed.checkpoint.save``
    does.

    The checkpoint is committed atomically once every rank has written: until then it
    lives in a hidden sibling directory (``.<name>.partial-<token>``), and ``path``
    never exists half-written. With a process group, its store names that directory and
    is the barrier: the call (or the handle's ``wait()``) returns once the checkpoint is
    committed on every rank. Stale staging directories of crashed saves beside ``path``
    are removed by rank 0 (never one a live save is writing: see python/README.md).
    Every rank must call it for the same paths in the same order (as with any
    distributed save). ``checksums=False``: no CRC-32C recorded (this call only).
    ``ckpt merge``, ``ckpt reshard --to N`` and :func:`load_state_dict` (on any mesh)
    read the result.

    ``background=True`` copies the local shards into memory (the training stall: nothing
    else, no waiting for other ranks) and writes them on a thread: it returns a
    :class:`SaveHandle` whose ``wait()`` returns when the checkpoint is committed (to
    a URL too: the ranks then meet through the process group's store, never its
    collectives). Otherwise it returns ``path`` once the checkpoint is committed.
    """
    remote = _is_url(os.fspath(path))
    out = os.fspath(path) if remote else os.path.abspath(os.fspath(path))
    rank, world = _world()
    store = None
    if remote:
        if background and world > 1:
            # The ranks meet through the store from the save's thread (collectives
            # there would race the training loop's).
            store = _store()
            if store is None:
                raise Unsupported(
                    "background=True with a URL needs the process group's key-value store (a group made by init_process_group): save without background"
                )
        _remote_prepare(out, rank, world)
    elif os.path.exists(out):
        raise OutputExists(f"{out} already exists")
    walk = _Walk(state_dict)
    items = walk.tensors
    # Encoded now: refused before anything is written, and the values of this call.
    encoded = {name: _objects.encode(v, name) for name, v, _, _ in walk.others}
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
    if remote:
        if background:
            n = _STARTED[out] = _STARTED.get(out, 0) + 1
            gather = _store_gather(store, f"ckpt.save_state_dict/{out}/{n}", rank, world)
            return SaveHandle(
                lambda: _save_remote(out, rank, world, strategy, encoded, local_data, keep_all, checksums, gather)
            )
        return _save_remote(out, rank, world, strategy, encoded, local_data, keep_all, checksums)
    meet = _Rendezvous(out, rank, world)
    parent, base = os.path.split(out)

    def run() -> str:
        staging = os.path.join(parent, _staging.staging_name(base, meet.token()))
        os.makedirs(staging, exist_ok=True)
        if rank == 0:
            _staging.remove_stale(parent, keep=staging)
        owner = _staging.Owner(staging, rank)
        failure = None
        try:
            try:
                if rank == 0 and encoded:
                    _write_objects(staging, encoded)
                # This rank's directory appears whole: written under a private name,
                # renamed.
                private = os.path.join(staging, f".rank-{rank}")
                if os.path.exists(private):
                    shutil.rmtree(private)
                ptrs = [(n, t.data_ptr(), t.numel() * t.element_size()) for n, t in local_data]
                _ckpt.write_rank(private, strategy, rank, ptrs, keep_all, checksums)
                os.rename(os.path.join(private, f"ckpt_{rank}"), os.path.join(staging, f"ckpt_{rank}"))
                os.rmdir(private)
            except BaseException as e:
                failure = f"rank {rank}: {type(e).__name__}: {e}"
                # No longer writing: this rank's owner file no longer keeps the
                # directory live.
                owner.stop()
                with contextlib.suppress(OSError):
                    os.remove(owner.path)
                meet.finish(failure, lambda: None, out, staging)
                raise
        finally:
            owner.stop()
        meet.finish(None, lambda: _commit(staging, out, world, strategy), out, staging)
        return out

    if background:
        return SaveHandle(run)
    return run()
