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

With `--bench`, it then writes a 2 GiB MindSpore checkpoint (8 ranks saved by
mindspore.save_checkpoint, 32 F32 parameters of 8192 x 2048, half split along dim 0 and
half along dim 1, with a MindSpore strategy file) and merges it into one checkpoint
with MindSpore's transform_checkpoints, with merge_sliced_parameter (every rank's file
loaded, each parameter merged), and with ckpt merge (to safetensors and to .ckpt), each
in its own process under /usr/bin/time: one table of seconds and peak RSS, and checks
that the outputs agree.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

# This folder holds no `mindspore` module, but keep imports unambiguous.
import numpy as np
import mindspore as ms

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FX = os.path.join(ROOT, "tests", "fixtures", "mindspore")
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
BENCH = "--bench" in sys.argv
CKPT = os.path.abspath(ARGS[0]) if ARGS else os.path.join(ROOT, "target", "debug", "ckpt")
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


def add_layout(strategy_map, name, world, tensor_map):
    """Adds `name` to a node_strategy_pb2.ParallelStrategyMap: a 1-D device matrix of
    `world` devices, the given tensor map, no optimizer sharding."""
    item = strategy_map.parallel_layout_item.add()
    item.param_name = name
    lay = item.parallel_layouts
    lay.dev_matrix.add().dim.extend([world])
    lay.tensor_map.add().dim.extend(tensor_map)
    lay.param_split_shape.add()
    lay.indices_offset.add()
    lay.field = 0
    lay.opt_weight_shard_step = 0
    lay.opt_weight_shard_size = 0


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

# MindSpore's own tools on the same inputs: where each is right, refuses or is wrong.
# (Not a pass/fail check of ckpt: a table for the docs.)
table = []


def verdict(name, fn):
    try:
        table.append((name, fn()))
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        table.append((name, "refuses: " + str(e).splitlines()[0][:90]))


def compare(got):
    """'right' when every tensor equals the full one (dtype kept), else what differs."""
    bad = []
    for k, (dt, a) in want.items():
        if k not in got:
            bad.append(f"{k} missing")
            continue
        g = got[k]
        if tuple(g.shape) != a.shape:
            bad.append(f"{k} shape {tuple(g.shape)}")
        elif not np.array_equal(as_numpy(g).astype(np.float64), a.astype(np.float64)):
            bad.append(f"{k} bytes differ")
        elif dt == "BF16" and g.dtype != ms.bfloat16:
            bad.append(f"{k} BF16 returned as {g.dtype}")
    return "right" if not bad else "wrong: " + "; ".join(bad)


with tempfile.TemporaryDirectory() as tmp:
    strategy = os.path.join(FX, "strategy.ckpt")

    def transform():
        out = os.path.join(tmp, "tc")
        ms.transform_checkpoints(os.path.join(FX, "ckpt_fmt"), out, "checkpoint_", strategy, None)
        return compare(ms.load_checkpoint(os.path.join(out, "rank_0", "checkpoint_0.ckpt")))

    def merge_sliced():
        strat = ms.build_searched_strategy(strategy)
        ranks = [ms.load_checkpoint(os.path.join(FX, "ckpt_fmt", f"rank_{r}", f"checkpoint_{r}.ckpt"))
                 for r in range(4)]
        got, bad = {}, []
        for k in want:
            try:
                got[k] = ms.merge_sliced_parameter([d[k] for d in ranks], strat)
            except Exception as e:  # noqa: BLE001
                bad.append(f"{k} refused ({str(e)[:40]})")
        v = compare(got)
        return v if not bad else ("wrong: " if v != "right" else "partly: ") + "; ".join(bad) + (
            "" if v == "right" else "; " + v.split(": ", 1)[-1])

    def unified():
        from mindspore.parallel import unified_safetensors
        out = os.path.join(tmp, "us")
        unified_safetensors(os.path.join(FX, "safetensors_fmt"), strategy, out)
        got = {}
        for f in os.listdir(out):
            if f.endswith(".safetensors"):
                got.update(ms.load_checkpoint(os.path.join(out, f), format="safetensors"))
        return compare(got)

    def transform_dim1():
        # 4 ranks of [2, 2] -> 4 ranks of [4], safetensors in and out: mlp.weight, split
        # along both dims in the source, is split along dim 1 only in the target.
        import mindspore.train.node_strategy_pb2 as pb
        m = pb.ParallelStrategyMap()
        m.current_stage = 0
        for k in want:
            add_layout(m, k, 4, {"mlp.weight": [-1, 0]}.get(k, [-1] * want[k][1].ndim))
        dst = os.path.join(tmp, "dst.ckpt")
        open(dst, "wb").write(m.SerializeToString())
        out = os.path.join(tmp, "tc1")
        ms.transform_checkpoints(os.path.join(FX, "safetensors_fmt"), out, "checkpoint_", strategy, dst,
                                 output_format="safetensors")
        a = want["mlp.weight"][1]
        bad = []
        for r in range(4):
            files = os.listdir(os.path.join(out, f"rank_{r}"))
            got = ms.load_checkpoint(os.path.join(out, f"rank_{r}", files[0]), format="safetensors")
            exp = a[:, r * 2:(r + 1) * 2]
            g = as_numpy(got["mlp.weight"]).astype(np.float64)
            if g.shape != exp.shape or not np.array_equal(g, exp.astype(np.float64)):
                flat = np.array_equal(g.reshape(-1), a.reshape(-1)[r * 8:(r + 1) * 8].astype(np.float64))
                bad.append(f"rank {r} mlp.weight is not columns {r * 2}..{(r + 1) * 2}"
                           + (" (it is the flat slice)" if flat else ""))
        # ckpt, same input, same target strategy:
        run("reshard", os.path.join(FX, "safetensors_fmt"), "--source-strategy", strategy, "-o",
            os.path.join(tmp, "ours"), "--strategy", dst, "--keep-all", "--format", "mindspore", "-q")
        for r in range(4):
            g = ms.load_checkpoint(os.path.join(tmp, "ours", f"rank_{r}", f"checkpoint_{r}.ckpt"))["mlp.weight"]
            check(f"ckpt reshard to MindSpore's [4] strategy: rank {r} mlp.weight is columns {2 * r}..{2 * r + 2}",
                  np.array_equal(as_numpy(g), a[:, r * 2:(r + 1) * 2]) and g.dtype == ms.bfloat16)
        return "right" if not bad else "wrong: " + "; ".join(bad)

    verdict("transform_checkpoints (4 ranks -> 1, .ckpt)", transform)
    verdict("merge_sliced_parameter (each parameter)", merge_sliced)
    verdict("unified_safetensors (4 ranks -> 1)", unified)
    verdict("transform_checkpoints ([2,2] -> [4], dim-1 split, safetensors in and out)", transform_dim1)


def timed(cmd):
    """Seconds and peak RSS (MiB) of a command in its own process."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    secs = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{r.stderr[-3000:]}")
    kb = [l for l in r.stderr.splitlines() if "Maximum resident set size" in l]
    return secs, int(kb[0].split()[-1]) / 1024


BENCH_WORLD, BENCH_PARAMS, BENCH_SHAPE = 8, 32, (8192, 2048)


def bench_param(i):
    """Parameter i, its tensor map over the 8 ranks (dim 0 or dim 1), and its values."""
    tmap = [0, -1] if i % 2 == 0 else [-1, 0]
    a = (np.arange(BENCH_SHAPE[0] * BENCH_SHAPE[1], dtype=np.float32) % 1021 + i).reshape(BENCH_SHAPE)
    return f"layers.{i}.weight", tmap, a


def bench(tmp):
    import mindspore.train.node_strategy_pb2 as pb
    src = os.path.join(tmp, "bench_src")
    m = pb.ParallelStrategyMap()
    m.current_stage = 0
    per_rank = [[] for _ in range(BENCH_WORLD)]
    for i in range(BENCH_PARAMS):
        name, tmap, a = bench_param(i)
        add_layout(m, name, BENCH_WORLD, tmap)
        axis = 0 if tmap[0] == 0 else 1
        for r, part in enumerate(np.split(a, BENCH_WORLD, axis=axis)):
            per_rank[r].append({"name": name, "data": ms.Tensor(np.ascontiguousarray(part))})
    strategy = os.path.join(tmp, "bench_strategy.ckpt")
    open(strategy, "wb").write(m.SerializeToString())
    for r in range(BENCH_WORLD):
        d = os.path.join(src, f"rank_{r}")
        os.makedirs(d)
        ms.save_checkpoint(per_rank[r], os.path.join(d, f"checkpoint_{r}.ckpt"))
    del per_rank
    nbytes = sum(os.path.getsize(os.path.join(src, f"rank_{r}", f"checkpoint_{r}.ckpt")) for r in range(BENCH_WORLD))
    subprocess.run(f"cat {src}/*/* > /dev/null", shell=True, check=True)
    py = sys.executable
    rows = []
    rows.append(("python + import mindspore (the floor of the two MindSpore rows)",
                 *timed([py, "-c", "import mindspore"])))
    out_tc = os.path.join(tmp, "bench_tc")
    rows.append(("MindSpore transform_checkpoints (8 ranks -> 1)", *timed([py, "-c",
                 "import sys, mindspore as ms; ms.transform_checkpoints(sys.argv[1], sys.argv[2], 'checkpoint_', sys.argv[3], None)",
                 src, out_tc, strategy])))
    merge_script = (
        "import sys, os, mindspore as ms\n"
        "src, strategy, out, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])\n"
        "strat = ms.build_searched_strategy(strategy)\n"
        "ranks = [ms.load_checkpoint(os.path.join(src, f'rank_{r}', f'checkpoint_{r}.ckpt')) for r in range(world)]\n"
        "merged = [ms.Parameter(ms.merge_sliced_parameter([d[k] for d in ranks], strat), name=k) for k in ranks[0]]\n"
        "ms.save_checkpoint(merged, out)\n")
    out_msp = os.path.join(tmp, "bench_msp.ckpt")
    rows.append(("MindSpore merge_sliced_parameter (all ranks loaded) + save_checkpoint",
                 *timed([py, "-c", merge_script, src, strategy, out_msp, str(BENCH_WORLD)])))
    out_st = os.path.join(tmp, "bench_ckpt_st")
    rows.append(("ckpt merge (to safetensors)", *timed([CKPT, "merge", src, "--source-strategy", strategy, "-o", out_st, "-q"])))
    out_ms = os.path.join(tmp, "bench_ckpt_ms")
    rows.append(("ckpt merge --format mindspore (to .ckpt)",
                 *timed([CKPT, "merge", src, "--source-strategy", strategy, "-o", out_ms, "--format", "mindspore", "-q"])))
    # The outputs agree: MindSpore's two, and ckpt's .ckpt, against the originals.
    tc_files = [f for f in os.listdir(os.path.join(out_tc, "rank_0"))]
    outs = {"transform_checkpoints": os.path.join(out_tc, "rank_0", tc_files[0]),
            "merge_sliced_parameter": out_msp,
            "ckpt merge --format mindspore": os.path.join(out_ms, "model.ckpt")}
    for label, path in outs.items():
        got = ms.load_checkpoint(path)
        ok = all(np.array_equal(got[name].asnumpy(), a) for name, _, a in map(bench_param, range(BENCH_PARAMS)))
        check(f"bench: {label} gives every parameter of the 2 GiB checkpoint", ok)
        del got
    # The safetensors output holds the same tensors: converted to .ckpt, the same file.
    again = os.path.join(tmp, "bench_again")
    run("merge", out_st, "-o", again, "--format", "mindspore", "-q")
    import filecmp
    check("bench: ckpt merge to safetensors holds the same tensors as to .ckpt",
          filecmp.cmp(os.path.join(again, "model.ckpt"), os.path.join(out_ms, "model.ckpt"), shallow=False))
    base = rows[3][1]
    print(f"\nmerging a {nbytes / 2**30:.2f} GiB MindSpore checkpoint, {BENCH_WORLD} ranks, from the page cache (one run)")
    print("| run | seconds | peak RSS MiB | x ckpt merge |")
    print("|---|---|---|---|")
    for name, secs, rss in rows:
        print(f"| {name} | {secs:.2f} | {rss:.0f} | {secs / base:.2f} |")
    shutil.rmtree(src)


if BENCH:
    with tempfile.TemporaryDirectory(dir=os.environ.get("CKPT_BENCH_DIR")) as tmp:
        bench(tmp)

print("\n| MindSpore tool | result on tests/fixtures/mindspore |")
print("|---|---|")
for name, v in table:
    print(f"| {name} | {v} |")
print()
passed = sum(results)
print(f"{passed} passed, {len(results) - passed} failed")
sys.exit(0 if all(results) else 1)
