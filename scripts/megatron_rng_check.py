#!/usr/bin/env python3
"""torch.load reads the RNG state ckpt carries into Megatron legacy rank files.

From the committed TP=2 x PP=2 x VP=2 fixture (tests/fixtures/megatron/tp2pp2vp2: its
rank files hold `rng_state` as Megatron-LM's get_rng_state builds it, torch's generator
state a byte tensor), `ckpt reshard --format megatron`:
- to the same grid without virtual stages (`--mesh pp=2,tp=2`): every written rank file,
  loaded by torch.load as Megatron-LM's load_checkpoint loads it (weights_only=False),
  must hold `rng_state` equal to the same rank's in the source (Python's and numpy's
  states equal, torch's byte tensors bit for bit), and `args.no_save_rng` as the source
  had it;
- to another grid (`--mesh pp=1,tp=4`): no `rng_state`, `args.no_save_rng` True (Megatron
  ignores the RNG state when TP x PP changes, so none is carried).

    target/py/bin/python scripts/megatron_rng_check.py [target/debug/ckpt]

Needs torch and numpy. Exit 0 when every check passes, 1 otherwise (each failure printed).
"""

import glob
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

SRC = "tests/fixtures/megatron/tp2pp2vp2/legacy"


def same(a, b):
    """Deep equality of RNG states: tensors bit for bit, arrays element for element."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def main():
    ckpt = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "target/debug/ckpt"
    failures = []
    with tempfile.TemporaryDirectory(prefix="megatron-rng-") as work:
        same_grid = os.path.join(work, "pp2tp2")
        other_grid = os.path.join(work, "pp1tp4")
        for mesh, out in [("pp=2,tp=2", same_grid), ("pp=1,tp=4", other_grid)]:
            subprocess.run([ckpt, "reshard", SRC, "--mesh", mesh, "--format", "megatron",
                            "-o", out], check=True, capture_output=True)
        sources = sorted(glob.glob(os.path.join(SRC, "iter_*", "mp_rank_*", "model_optim_rng.pt")))
        if len(sources) != 4:
            failures.append(f"{SRC}: {len(sources)} rank files, expected 4")
        for src in sources:
            rel = os.path.relpath(src, SRC)
            want = load(src)
            got = load(os.path.join(same_grid, rel))
            if "rng_state" not in got:
                failures.append(f"{rel}: no rng_state written for the same grid")
            elif not same(want["rng_state"], got["rng_state"]):
                failures.append(f"{rel}: rng_state differs from the source's")
            if getattr(got["args"], "no_save_rng", None) != getattr(want["args"], "no_save_rng", None):
                failures.append(f"{rel}: args.no_save_rng changed")
            if got["args"].virtual_pipeline_model_parallel_size is not None:
                failures.append(f"{rel}: args still give virtual pipeline stages")
        for out in sorted(glob.glob(os.path.join(other_grid, "iter_*", "mp_rank_*", "model_optim_rng.pt"))):
            got = load(out)
            if "rng_state" in got or got["args"].no_save_rng is not True:
                failures.append(f"{out}: another grid must carry no rng_state and set no_save_rng")
    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print(f"megatron rng_state: carried bit for bit into {len(sources)} rank files of the same grid, "
          "none into another grid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
