"""``ckpt.safe_open``: safetensors' lazy handle over every format ckpt reads, and
``ckpt.iter_tensors``. Nothing is read until a tensor is asked for, and then only its
bytes (a slice: only the bytes of the slice)."""

from __future__ import annotations

import operator
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ckpt._arrays import FRAMEWORKS, _Maps, dtype_name, materialize
from ckpt.errors import MissingData, UsageError


def _framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise UsageError(
            f"framework={framework!r}: ckpt gives 'pt' (torch) or 'np' (numpy) arrays"
        )
    return framework


def _device(device: Any) -> Optional[str]:
    if device is None:
        return None
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


class safe_open:  # noqa: N801 (safetensors' name, so that code written for it reads)
    """A lazy handle on a checkpoint, with ``safetensors.safe_open``'s methods::

        with ckpt.safe_open("run/step_220", framework="pt", device="cpu") as f:
            f.keys(); f.metadata()
            w = f.get_tensor("embed.weight")
            rows = f.get_slice("embed.weight")[0:128]      # reads only those rows
            f.get_slice("embed.weight").get_shape()

    ``path``: anything :func:`ckpt.open` takes (a safetensors file, a Hugging Face
    directory, a DCP or sliced checkpoint, ``torch.save`` files, ...); tensors are the
    global (merged) tensors. ``framework``: ``"pt"``/``"torch"`` or ``"np"``/``"numpy"``;
    ``device``: ``"cpu"`` or a torch device (``"cuda:0"``, or an int). ``dtype``: load
    floating-point tensors converted to it (``"bf16"``, ...). ``checksums``: check the
    recorded CRC-32C of each tensor read whole. ``chunk_mb``, ``streams``: the pinned
    buffers of device loads (as :func:`ckpt.load`).
    """

    def __init__(
        self,
        filename: Any,
        framework: str = "pt",
        device: Any = "cpu",
        *,
        source_strategy: Any = None,
        strip_prefix: Optional[str] = None,
        checksums: bool = True,
        dtype: Optional[str] = None,
        chunk_mb: Optional[float] = None,
        streams: Optional[int] = None,
    ) -> None:
        from ckpt import Checkpoint
        from ckpt._device import Staging

        self._framework = _framework(framework)
        self._device = _device(device)
        self._checksums = checksums
        self._dtype = dtype_name(dtype)
        self._staging = Staging.of(chunk_mb, streams)
        self._ck = (
            filename
            if isinstance(filename, Checkpoint)
            else Checkpoint(filename, source_strategy=source_strategy, strip_prefix=strip_prefix)
        )
        self._maps = _Maps()

    # safetensors' methods

    def keys(self) -> List[str]:
        """The tensor names, sorted (as safetensors')."""
        return sorted(self._ck.tensors)

    def offset_keys(self) -> List[str]:
        """The tensor names (safetensors orders them by offset in the file; ckpt's
        checkpoints may span files: sorted by name here)."""
        return self.keys()

    def metadata(self) -> Optional[Dict[str, str]]:
        """The file's ``__metadata__`` (for several files, the entries they agree on);
        None when there is none."""
        m = self._ck._native.metadata
        return None if m is None else dict(m)

    def get_tensor(self, name: str) -> Any:
        """The whole tensor ``name``."""
        self._known(name)
        plan = self._ck._native.plan([name], None, None, None, None, self._dtype)
        return self._arrays(plan)[name]

    def get_slice(self, name: str) -> "Slice":
        """A :class:`Slice` of ``name``: ``get_shape()``, ``get_dtype()``, and ``[...]``
        reading only the bytes the index selects."""
        self._known(name)
        return Slice(self, name)

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drops this handle's file mappings (arrays already returned keep theirs)."""
        self._maps = _Maps()

    # ckpt's additions

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        """``(name, tensor)`` for every tensor, one at a time, in :meth:`keys` order."""
        for name in self.keys():
            yield name, self.get_tensor(name)

    def __len__(self) -> int:
        return len(self._ck.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._ck.tensors

    def _known(self, name: str) -> None:
        if name not in self._ck.tensors:
            raise MissingData(f"not in the checkpoint: `{name}`")

    def _arrays(self, plan) -> Dict[str, Any]:
        return materialize(
            plan,
            framework=self._framework,
            device=self._device,
            checksums=self._checksums,
            maps=self._maps,
            staging=self._staging,
        )


class Slice:
    """One tensor of a :class:`safe_open` handle, read in part by indexing: integers,
    slices (positive steps), ``...``; only the box the index spans is read."""

    def __init__(self, handle: safe_open, name: str) -> None:
        self._h = handle
        self._name = name
        info = handle._ck.tensors[name]
        self._shape = list(info.shape)
        self._dtype = info.dtype

    def get_shape(self) -> List[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        """The safetensors dtype name (``"F32"``, ``"BF16"``, ...)."""
        return self._dtype

    def __getitem__(self, index: Any) -> Any:
        start, size, after = _box(index, self._shape)
        dtype = self._dtype
        if self._h._dtype is not None:
            dtype = self._cast(dtype)
        plan = self._h._ck._native.plan_boxes([(self._name, self._shape, dtype, start, size)])
        a = self._h._arrays(plan)[self._name]
        return a[tuple(after)] if any(x != slice(None) for x in after) else a

    def _cast(self, dtype: str) -> str:
        # The plan of the whole tensor says what the cast gives (floats only).
        plan = self._h._ck._native.plan([self._name], None, None, None, None, self._h._dtype)
        return plan.entries()[0][1]


def _box(index: Any, shape: Sequence[int]) -> Tuple[List[int], List[int], List[Any]]:
    """(start, size) of the box ``index`` spans in ``shape``, and the index that takes
    the result from that box (steps, dropped integer dimensions)."""
    idx = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if any(i is Ellipsis for i in idx):
        k = next(j for j, i in enumerate(idx) if i is Ellipsis)
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:k] + (slice(None),) * max(fill, 0) + idx[k + 1:]
    if len(idx) > len(shape):
        raise IndexError(f"too many indices for a tensor of {len(shape)} dimensions: {index!r}")
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    start, size, after = [], [], []
    for d, (i, n) in enumerate(zip(idx, shape)):
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step <= 0:
                raise UsageError(f"index {index!r}: dimension {d}: steps must be positive")
            r = range(a, b, step)
            lo = r[0] if len(r) else min(a, n)
            hi = r[-1] + 1 if len(r) else lo
            start.append(lo)
            size.append(hi - lo)
            after.append(slice(None) if step == 1 else slice(None, None, step))
        else:
            try:
                j = operator.index(i)
            except TypeError:
                raise TypeError(
                    f"index {index!r}: dimension {d}: integers, slices and '...' only"
                ) from None
            if j < 0:
                j += n
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for dimension {d} with size {n}")
            start.append(j)
            size.append(1)
            after.append(0)
    return start, size, after


def iter_tensors(path: Any, *, names: Optional[Sequence[str]] = None, **kwargs: Any) -> Iterator[Tuple[str, Any]]:
    """``(name, tensor)`` of every tensor of a checkpoint (or those in ``names``, in
    that order), loaded one at a time: memory holds one tensor beyond what the caller
    keeps. Options as :class:`safe_open` (``framework`` defaults to ``"numpy"``, as
    :func:`ckpt.load`)."""
    kwargs.setdefault("framework", "numpy")
    f = safe_open(path, **kwargs)
    for name in f.keys() if names is None else list(names):
        yield name, f.get_tensor(name)
