#!/usr/bin/env python3
"""Baselines for `.ckptz` sizes (issue 26), re-runnable on any safetensors file.

For one safetensors file, prints as JSON the file's size and:

- `zstd`: the whole file through zstd level 1 (what `zstd -1 model.safetensors` gives);
- `grouped`: the numpy baseline: every floating-point value of the file (F32, BF16,
  F16, F64) byte-grouped dtype by dtype into planes (all byte 0s, all byte 1s, ...),
  each plane zstd level 1; the header and other dtypes' bytes zstd level 1 as one
  stream;
- with `--entropy`, per floating-point dtype, for the planes `.ckptz` version 2 codes
  (each element rotated left by one bit, so that the top plane is the exponent): the
  plane's size, its zstd level 1 size, and its order-0 entropy in bytes (the bound of
  any Huffman or FSE coding of the plane's bytes taken one by one).

Needs numpy and zstandard (`pip install numpy zstandard`).

Usage: compress_baseline.py FILE.safetensors [--entropy]
"""

import json
import struct
import sys

import numpy as np
import zstandard

FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def zstd1(data):
    return len(zstandard.ZstdCompressor(level=1).compress(bytes(data)))


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    data = memoryview(blob)[8 + n :]
    tensors = sorted(header.values(), key=lambda t: t["data_offsets"][0])
    return blob, n, data, tensors


def streams(data, tensors):
    """The bytes of each floating-point dtype (file order) and the rest."""
    by = {}
    rest = bytearray()
    for t in tensors:
        a, b = t["data_offsets"]
        if t["dtype"] in FLOATS:
            by.setdefault(t["dtype"], bytearray()).extend(data[a:b])
        else:
            rest.extend(data[a:b])
    return by, rest


def planes(raw, k, rotate):
    """The k byte planes of `raw` (elements of k bytes), rotated left by one bit first."""
    v = np.frombuffer(bytes(raw), dtype=UINT[k])
    if rotate:
        bits = 8 * k
        v = (v << np.array(1, dtype=v.dtype)) | (v >> np.array(bits - 1, dtype=v.dtype))
    return [p.tobytes() for p in v.view(np.uint8).reshape(-1, k).T]


def entropy_bytes(plane):
    counts = np.bincount(np.frombuffer(plane, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / len(plane)
    return float(-(p * np.log2(p)).sum() * len(plane) / 8)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit(__doc__)
    blob, n, data, tensors = read(args[0])
    by, rest = streams(data, tensors)
    grouped = zstd1(blob[: 8 + n]) + zstd1(rest)
    for dtype, raw in by.items():
        grouped += sum(zstd1(p) for p in planes(raw, FLOATS[dtype], rotate=False))
    out = {
        "file": args[0],
        "bytes": len(blob),
        "zstd": zstd1(blob),
        "grouped": grouped,
    }
    if "--entropy" in sys.argv:
        out["planes"] = {
            dtype: [
                {"bytes": len(p), "zstd": zstd1(p), "entropy": round(entropy_bytes(p))}
                for p in planes(raw, FLOATS[dtype], rotate=True)
            ]
            for dtype, raw in by.items()
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
