"""Turning a load plan into arrays: views of the file where the bytes are one run,
else memory the framework allocates, filled by ckpt's copy engine (without the GIL,
in parallel). Private."""

from __future__ import annotations

import mmap
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

# safetensors dtype name -> numpy dtype. BF16 and the 8-bit floats have no numpy type:
# they come back as their bit patterns (BF16 as uint16, F8 as uint8), which
# ``framework="torch"`` turns into real torch dtypes (or `.view(torch.bfloat16)`).
NUMPY = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
    "F8_E8M0": np.uint8,
}

# Sub-byte types (F4, F6) are returned as their packed bytes, one dimension.
_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


FRAMEWORKS = ("numpy", "np", "torch", "pt")


def dtype_name(dtype: Any) -> Optional[str]:
    """A dtype given as a string, or as a torch/numpy dtype, as ckpt's name."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    text = str(dtype).replace("torch.", "")
    try:
        import numpy as np

        if isinstance(dtype, type) or isinstance(dtype, np.dtype):
            text = np.dtype(dtype).name
    except TypeError:
        pass
    return text


def torch_dtypes():
    import torch

    m = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "C64": torch.complex64,
    }
    for name, attr in [
        ("U16", "uint16"),
        ("U32", "uint32"),
        ("U64", "uint64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"),
    ]:
        if hasattr(torch, attr):
            m[name] = getattr(torch, attr)
    return m


def dtype_name_of_torch(dtype) -> str:
    for name, d in torch_dtypes().items():
        if d == dtype:
            return name
    from ckpt.errors import Unsupported

    raise Unsupported(f"torch dtype {dtype} has no safetensors equivalent")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Maps:
    """One copy-on-write mapping per file: arrays are writable, writes never reach the
    file, and untouched pages are the page cache's."""

    def __init__(self) -> None:
        self.maps: Dict[str, mmap.mmap] = {}

    def get(self, path: str) -> mmap.mmap:
        m = self.maps.get(path)
        if m is None:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.maps[path] = m
        return m


def materialize(
    plan,
    framework: str = "numpy",
    device: Optional[str] = None,
    checksums: bool = True,
    maps: Optional[_Maps] = None,
    staging: Any = None,
) -> Dict[str, Any]:
    """Arrays for every entry of ``plan`` (see ``ckpt.load``); ``maps``: the file
    mappings to reuse (a lazy handle's), else new ones; ``staging``: how device loads
    are staged (``ckpt._device.Staging``, its defaults where None)."""
    if framework not in FRAMEWORKS:
        from ckpt.errors import UsageError

        raise UsageError(f"framework={framework!r}: 'numpy' ('np') or 'torch' ('pt')")
    torch_fw = framework in ("torch", "pt")
    if device is not None and not torch_fw and str(device) != "cpu":
        from ckpt.errors import UsageError

        raise UsageError("device= needs framework='torch'")
    if checksums:
        plan.check_checksums()
    entries = plan.entries()
    maps = _Maps() if maps is None else maps
    out: Dict[str, Any] = {}
    fills: List[Tuple[int, int, int]] = []
    if torch_fw:
        import torch

        tdt = torch_dtypes()
        on_device = device is not None and torch.device(device).type != "cpu"
        dests: Dict[int, Any] = {}
        for i, (name, dt, shape, view) in enumerate(entries):
            if on_device:
                # Allocated on the device, filled through a few small pinned buffers.
                t = (
                    torch.empty((_numel(shape) * _BITS[dt] + 7) // 8, dtype=torch.uint8, device=device)
                    if dt in _BITS
                    else torch.empty(shape, dtype=tdt[dt], device=device)
                )
                dests[i] = t
            elif dt in _BITS:
                n = (_numel(shape) * _BITS[dt] + 7) // 8
                t = torch.empty(n, dtype=torch.uint8)
                fills.append((i, t.data_ptr(), n))
            elif view is not None:
                path, offset = view
                t = torch.frombuffer(
                    maps.get(os.fspath(path)), dtype=tdt[dt], count=_numel(shape), offset=offset
                ).reshape(shape)
            else:
                t = torch.empty(shape, dtype=tdt[dt])
                fills.append((i, t.data_ptr(), t.numel() * t.element_size()))
            out[name] = t
        plan.fill(fills)
        if dests:
            from ckpt import _device

            staging = staging or _device.Staging()
            _device.fill_through_buffers(
                plan, dests, staging, _device.copier_for(device, staging)
            )
        return out
    for i, (name, dt, shape, view) in enumerate(entries):
        if dt in _BITS:
            n = (_numel(shape) * _BITS[dt] + 7) // 8
            a = np.empty(n, dtype=np.uint8)
            fills.append((i, a.ctypes.data, n))
        elif view is not None:
            path, offset = view
            a = np.frombuffer(
                maps.get(os.fspath(path)), dtype=NUMPY[dt], count=_numel(shape), offset=offset
            ).reshape(shape)
        else:
            a = np.empty(shape, dtype=NUMPY[dt])
            fills.append((i, a.ctypes.data, a.nbytes))
        out[name] = a
    plan.fill(fills)
    return out
