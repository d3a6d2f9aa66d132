#!/usr/bin/env python3
"""Interoperability with PyTorch's own DCP tools, and the merge speed comparison.

Needs torch (CPU is enough), safetensors and numpy; not part of the default test run
because torch is a multi-gigabyte install. Run from the repository root:

    python3 scripts/torch_interop.py [--bench-dir target/bench/tp8-h2048-l19]

1. Four gloo processes save DTensors (Shard(0), Shard(1), nested, uneven, replicated)
   with torch's HuggingFaceStorageWriter(save_distributed=True); `ckpt merge` joins
   them and every tensor is compared with the originals.
2. `ckpt reshard --format dcp` writes sharded safetensors that torch's
   HuggingFaceStorageReader loads with dcp.load: every tensor compared again.
3. With --bench-dir (a sliced checkpoint, e.g. the one `cargo bench --bench copy`
   builds), the same DCP-format input is merged by torch's
   consolidate_safetensors_files and by `ckpt merge`, timed side by side.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

CKPT = os.path.abspath(os.environ.get("CKPT", "target/release/ckpt"))


def originals():
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(37, 12, generator=g),                     # uneven rows over tp
        "proj.weight": torch.randn(12, 10, generator=g).to(torch.bfloat16),   # columns
        "both.weight": torch.randn(9, 8, generator=g),                       # dp and tp on dim 0
        "norm.weight": torch.randn(12, generator=g).to(torch.float16),        # replicated
        "count": torch.arange(6, dtype=torch.int64),
    }


def placements(name):
    from torch.distributed.tensor import Replicate, Shard
    return {
        "embed.weight": [Replicate(), Shard(0)],
        "proj.weight": [Replicate(), Shard(1)],
        "both.weight": [Shard(0), Shard(0)],
        "norm.weight": [Replicate(), Replicate()],
        "count": [Shard(0), Replicate()],
    }[name]


def save_worker(rank, world, path, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = {k: distribute_tensor(v, mesh, placements(k)) for k, v in originals().items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path=path, save_distributed=True))
    dist.destroy_process_group()


def ckpt(*args):
    r = subprocess.run([CKPT, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ckpt {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


def interop(work):
    from safetensors.torch import load_file
    src = os.path.join(work, "torch_dcp")
    mp.spawn(save_worker, args=(4, src, 29511), nprocs=4, join=True)
    sharded = os.path.join(src, "sharded") if os.path.isdir(os.path.join(src, "sharded")) else src
    files = sorted(os.listdir(sharded))
    print("torch wrote", files)
    merged = os.path.join(work, "merged")
    print(ckpt("merge", sharded, "-o", merged).strip())
    got = load_file(os.path.join(merged, "model.safetensors"))
    orig = originals()
    assert sorted(got) == sorted(orig), (sorted(got), sorted(orig))
    for k, v in orig.items():
        assert same(got[k], v), k
    print(f"1. ckpt merge of torch's DCP output: {len(orig)} tensors byte-identical")

    # ckpt -> torch: reshard the merged checkpoint to a 3-rank tensor-parallel strategy in
    # DCP layout, then load it with torch's own reader.
    strategy = {"format": "ckpt-strategy", "version": 1, "mesh": {"axes": [{"name": "tp", "size": 3}]}, "tensors": {}}
    layout = {"embed.weight": "Shard(0)", "proj.weight": "Shard(1)", "both.weight": "Shard(0)"}
    dtypes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
    for k, v in orig.items():
        strategy["tensors"][k] = {"shape": list(v.shape), "dtype": dtypes[v.dtype], "placements": [layout.get(k, "Replicate")]}
    sp = os.path.join(work, "tp3.json")
    with open(sp, "w") as f:
        json.dump(strategy, f)
    out = os.path.join(work, "dcp3")
    print(ckpt("reshard", merged, "-o", out, "--strategy", sp, "--format", "dcp").strip())
    target = {k: torch.empty_like(v) for k, v in orig.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(path=out), no_dist=True)
    for k, v in orig.items():
        assert same(target[k], v), k
    print(f"2. torch's HuggingFaceStorageReader loads ckpt reshard --format dcp: {len(orig)} tensors byte-identical")


def bench(work, bench_dir):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    with open(os.path.join(bench_dir, "strategy.json")) as f:
        s = json.load(f)
    for t in s["tensors"].values():  # DCP keeps one box per tensor: no blocked shards
        t["placements"] = [p.replace(",blocks=3", "") for p in t["placements"]]
    sp = os.path.join(work, "flat.json")
    with open(sp, "w") as f:
        json.dump(s, f)
    dcp_in = os.path.join(work, "dcp_in")
    # torch's consolidation calls torch.finfo on every dtype and fails on integer tensors,
    # so the integer `step` is left out of the comparison.
    ckpt("reshard", bench_dir, "-o", dcp_in, "--strategy", sp, "--format", "dcp", "-q", "--exclude", "step")
    os.remove(os.path.join(dcp_in, "strategy.json"))
    nbytes = sum(os.path.getsize(os.path.join(dcp_in, f)) for f in os.listdir(dcp_in))
    subprocess.run(f"cat {dcp_in}/* > /dev/null", shell=True, check=True)
    names = [n for n in s["tensors"] if n != "step"]
    # Every run starts with nothing dirty in the page cache and is timed twice: the
    # command alone, and through a `sync` that makes its output durable (ckpt merge
    # syncs its own output; cat and torch do not).
    def timed(fn):
        os.sync()
        t = time.perf_counter()
        fn()
        a = time.perf_counter() - t
        os.sync()
        return a, time.perf_counter() - t

    rows = [("cat (same bytes, one file)", *timed(lambda: subprocess.run(f"cat {dcp_in}/* > {work}/cat.out", shell=True, check=True)))]
    os.remove(f"{work}/cat.out")
    torch_out = os.path.join(work, "torch_out")
    os.makedirs(torch_out)
    rows.append(("torch consolidate_safetensors_files (2 threads)",
                 *timed(lambda: consolidate_safetensors_files(dcp_in, torch_out, dict.fromkeys(names, 1), num_threads=2))))
    shutil.rmtree(torch_out)
    ours = os.path.join(work, "ckpt_out")
    rows.append(("ckpt merge", *timed(lambda: ckpt("merge", dcp_in, "-o", ours, "-q"))))
    print(f"\n3. merge of a {nbytes / 1e9:.2f} GB DCP checkpoint, {len(os.listdir(dcp_in))} files, from the page cache (one run)")
    print("| run | seconds | seconds incl. sync | x ckpt merge (incl. sync) |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / rows[2][2]:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-dir")
    ap.add_argument("--work")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="ckpt-torch-")
    try:
        interop(work)
        if a.bench_dir:
            bench(work, a.bench_dir)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
