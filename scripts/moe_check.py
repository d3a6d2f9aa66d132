#!/usr/bin/env python3
"""Compares a merged checkpoint with a MoE fixture's expected tensors, byte for byte.

    python3 scripts/moe_check.py MERGED REFERENCE [REFERENCE ...] [--allow-extra]

MERGED: a safetensors file or a directory of them (a merge's output, index and all).
REFERENCE: a safetensors file, or a fixture directory (tests/fixtures/moe/...), which
stands for its reference.safetensors. Several references are one expectation (e.g. a
DeepSpeed fixture's reference.safetensors and moments.safetensors).

Every reference tensor must be in MERGED under the same name with the same dtype,
shape and bytes; a name in MERGED that no reference holds is an error unless
--allow-extra. Plain Python (reads the safetensors headers itself): exit 0 when equal,
1 with one line per difference otherwise.
"""

import argparse
import json
import os
import struct
import sys


def tensors(path):
    """name -> (dtype, shape, bytes) of one safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], tuple(v["shape"]), data[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
            for k, v in header.items()}


def load(path, default=None):
    if os.path.isdir(path):
        if default and os.path.exists(os.path.join(path, default)):
            path = os.path.join(path, default)
        else:
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                sys.exit(f"{path}: no .safetensors file")
            out = {}
            for f in files:
                for k, v in tensors(f).items():
                    if k in out:
                        sys.exit(f"{k}: in two files of {path}")
                    out[k] = v
            return out
    return tensors(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("merged")
    ap.add_argument("reference", nargs="+")
    ap.add_argument("--allow-extra", action="store_true")
    a = ap.parse_args()
    got = load(a.merged)
    want = {}
    for r in a.reference:
        want.update(load(r, default="reference.safetensors"))
    bad = []
    for k, (dt, shape, raw) in sorted(want.items()):
        if k not in got:
            bad.append(f"missing: {k}")
        elif got[k][:2] != (dt, shape):
            bad.append(f"{k}: {got[k][0]}{list(got[k][1])}, expected {dt}{list(shape)}")
        elif got[k][2] != raw:
            bad.append(f"{k}: bytes differ")
    if not a.allow_extra:
        bad += [f"unexpected: {k}" for k in sorted(set(got) - set(want))]
    for line in bad:
        print(line)
    print(f"{len(want) - len([b for b in bad if not b.startswith('unexpected')])} of {len(want)} reference tensors equal"
          + ("" if not bad else f"; {len(bad)} differences"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
