#!/usr/bin/env python3
"""Checks ckpt's MindSpore outputs with the real MindSpore (2.x).

    python3 -m venv /tmp/ms && /tmp/ms/bin/pip install "mindspore>=2,<3" "numpy<2"
    cargo build && /tmp/ms/bin/python scripts/mindspore_interop.py [target/debug/ckpt]

1. `ckpt merge --format mindspore` of MindSpore's own per-rank checkpoints
   (tests/fixtures/mindspore) gives a model.ckpt that mindspore.load_checkpoint reads,
   equal to the full tensors, BF16 kept as BF16.
2. `ckpt reshard --to 3 --format mindspore` (4 -> 3, uneven: MindSpore refuses it)
   writes rank_<r>/checkpoint_<r>.ckpt files MindSpore loads, each holding exactly the
   rows/columns ckpt's strategy gives that rank.
Prints one line per check and `N passed, N failed` at the end; exits 1 on a failure.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

# This folder holds no `mindspore` module, but keep imports unambiguous.
import numpy as np
import mindspore as ms

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FX = os.path.join(ROOT, "tests", "fixtures", "mindspore")
CKPT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "ckpt")
NP = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def full():
    b = open(os.path.join(FX, "full.safetensors"), "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        raw = b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
        if v["dtype"] == "BF16":
            a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(raw, NP[v["dtype"]])
        out[k] = (v["dtype"], a.reshape(v["shape"]))
    return out


def as_numpy(t):
    if t.dtype == ms.bfloat16:
        return t.float().asnumpy()
    return t.asnumpy()


results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(("ok   " if ok else "FAIL ") + name + (f": {detail}" if detail and not ok else ""))


def run(*args):
    subprocess.run([CKPT, *args], check=True, stdout=subprocess.DEVNULL)


with tempfile.TemporaryDirectory() as tmp:
    want = full()
    run("merge", os.path.join(FX, "ckpt_fmt"), "--source-strategy", os.path.join(FX, "strategy.ckpt"),
        "-o", os.path.join(tmp, "merged"), "--format", "mindspore", "-q")
    got = ms.load_checkpoint(os.path.join(tmp, "merged", "model.ckpt"))
    for k, (dt, a) in want.items():
        g = got[k]
        same = tuple(g.shape) == a.shape and np.array_equal(as_numpy(g), a)
        check(f"merge --format mindspore: {k}", same, f"{g.shape} vs {a.shape}")
    check("merge keeps BF16 as BF16", got["mlp.weight"].dtype == ms.bfloat16, str(got["mlp.weight"].dtype))

    run("reshard", os.path.join(FX, "ckpt_fmt"), "--source-strategy", os.path.join(FX, "strategy.json"),
        "-o", os.path.join(tmp, "r3"), "--to", "3", "--keep-all", "--format", "mindspore", "-q")
    layout = json.load(open(os.path.join(tmp, "r3", "strategy.json")))
    for r in range(3):
        got = ms.load_checkpoint(os.path.join(tmp, "r3", f"rank_{r}", f"checkpoint_{r}.ckpt"))
        # Rank r of mesh d1=1,d0=3: torch.chunk pieces along the dims split by d0.
        for k, (dt, a) in want.items():
            sl = [slice(None)] * a.ndim
            for axis, p in zip(["d1", "d0"], layout["tensors"][k]["placements"]):
                if axis == "d0" and isinstance(p, str) and p.startswith("Shard("):
                    d = int(p[len("Shard("):].split(")")[0].split(",")[0])
                    step = -(-a.shape[d] // 3)
                    sl[d] = slice(min(r * step, a.shape[d]), min((r + 1) * step, a.shape[d]))
            exp = a[tuple(sl)]
            g = got[k]
            check(f"reshard 4->3 rank {r}: {k}", tuple(g.shape) == exp.shape and np.array_equal(as_numpy(g), exp),
                  f"{g.shape} vs {exp.shape}")

passed = sum(results)
print(f"{passed} passed, {len(results) - passed} failed")
sys.exit(0 if all(results) else 1)
