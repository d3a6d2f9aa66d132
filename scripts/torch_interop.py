#!/usr/bin/env python3
"""Interoperability with PyTorch's own DCP tools, and the merge speed comparison.

Needs torch (CPU is enough), safetensors and numpy; not part of the default test run
because torch is a multi-gigabyte install. Run from the repository root:

    python3 scripts/torch_interop.py [--bench-dir target/bench/tp8-h2048-l19-c]

1. Four gloo processes save DTensors (Shard(0), Shard(1), nested, uneven, replicated)
   with torch's HuggingFaceStorageWriter(save_distributed=True); `ckpt merge` joins
   them and every tensor is compared with the originals.
2. `ckpt reshard --format dcp-safetensors` writes sharded safetensors that torch's
   HuggingFaceStorageReader loads with dcp.load: every tensor compared again.
3. The same DTensors saved with DCP's default FileSystemWriter (`.distcp` +
   `.metadata`): `ckpt merge` joins them byte-exactly, `ckpt reshard --to 2 --format
   distcp` writes DCP's default format that two gloo processes load with dcp.load into
   DTensors of the new layout (and one process loads whole), and `ckpt merge --format
   torch` writes a model.pth that torch.load(weights_only=True) reads.
4. With --bench-dir (a sliced checkpoint, e.g. the one `cargo bench --bench copy`
   builds), the same DCP-format input is merged by torch's
   consolidate_safetensors_files and by `ckpt merge`, timed side by side; and the
   checkpoint in DCP's default format is converted to one torch.save file by torch's
   dcp_to_torch_save and by `ckpt merge --format torch`.
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
    print(ckpt("reshard", merged, "-o", out, "--strategy", sp, "--format", "dcp-safetensors").strip())
    target = {k: torch.empty_like(v) for k, v in orig.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(path=out), no_dist=True)
    for k, v in orig.items():
        assert same(target[k], v), k
    print(f"2. torch's HuggingFaceStorageReader loads ckpt reshard --format dcp-safetensors: {len(orig)} tensors byte-identical")


def save_default_worker(rank, world, path, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = {k: distribute_tensor(v, mesh, placements(k)) for k, v in originals().items()}
    dcp.save(sd, checkpoint_id=path)
    dist.destroy_process_group()


def load_distcp_worker(rank, world, path, port, layout):
    """Loads ckpt's --format distcp output into DTensors of the layout it was written
    for and checks each rank's local shard against the originals."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    orig = originals()
    place = {k: [Shard(int(p[6:-1]))] if p.startswith("Shard") else [Replicate()] for k, p in layout.items()}
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, place[k]) for k, v in orig.items()}
    dcp.load(target, checkpoint_id=path)
    for k, v in orig.items():
        want = distribute_tensor(v, mesh, place[k]).to_local()
        assert same(target[k].to_local(), want), (rank, k)
    dist.destroy_process_group()


def interop_default_format(work):
    orig = originals()
    src = os.path.join(work, "torch_distcp")
    mp.spawn(save_default_worker, args=(4, src, 29512), nprocs=4, join=True)
    print("torch wrote", sorted(os.listdir(src)))
    merged = os.path.join(work, "merged_distcp")
    print(ckpt("merge", src, "-o", merged).strip())
    from safetensors.torch import load_file
    got = load_file(os.path.join(merged, "model.safetensors"))
    assert sorted(got) == sorted(orig)
    for k, v in orig.items():
        assert same(got[k], v), k
    print(f"3a. ckpt merge of torch's DCP default format: {len(orig)} tensors byte-identical")

    out = os.path.join(work, "distcp2")
    print(ckpt("reshard", src, "--to", "2", "--format", "distcp", "-o", out).strip())
    with open(os.path.join(out, "strategy.json")) as f:
        layout = {k: t["placements"][0] for k, t in json.load(f)["tensors"].items()}
    mp.spawn(load_distcp_worker, args=(2, out, 29513, layout), nprocs=2, join=True)
    whole = {k: torch.zeros_like(v) for k, v in orig.items()}
    dcp.load(whole, checkpoint_id=out, no_dist=True)
    for k, v in orig.items():
        assert same(whole[k], v), k
    print(f"3b. dcp.load reads ckpt reshard --to 2 --format distcp into 2-rank DTensors {layout} and whole: byte-identical")

    pth = os.path.join(work, "pth")
    print(ckpt("merge", src, "--format", "torch", "-o", pth).strip())
    sd = torch.load(os.path.join(pth, "model.pth"), weights_only=True)
    assert sorted(sd) == sorted(orig)
    for k, v in orig.items():
        assert same(sd[k], v), k
    print(f"3c. torch.load(weights_only=True) reads ckpt merge --format torch: {len(orig)} tensors byte-identical")


def peak_rss_run(cmd):
    """Runs a command under /usr/bin/time -v when present; returns (seconds, peak MiB)."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    secs = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{cmd} failed:\n{r.stderr[-2000:]}")
    kb = [l for l in r.stderr.splitlines() if "Maximum resident set size" in l]
    return secs, int(kb[0].split()[-1]) / 1024 if kb else float("nan")


def bench_default_format(work, bench_dir, sp):
    """torch's dcp_to_torch_save against ckpt merge --format torch, on the bench
    checkpoint in DCP's default format (written by ckpt, read by both)."""
    src = os.path.join(work, "distcp_in")
    ckpt("reshard", bench_dir, "-o", src, "--strategy", sp, "--format", "distcp", "-q")
    nbytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    subprocess.run(f"cat {src}/* > /dev/null", shell=True, check=True)
    script = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
              "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
    rows = []
    os.sync()
    rows.append(("torch dcp_to_torch_save", *peak_rss_run([sys.executable, "-c", script, src, os.path.join(work, "torch.pth")])))
    os.remove(os.path.join(work, "torch.pth"))
    os.sync()
    rows.append(("ckpt merge --format torch", *peak_rss_run([CKPT, "merge", src, "--format", "torch", "-o", os.path.join(work, "ckpt_pth"), "-q"])))
    print(f"\n5. DCP default format ({nbytes / 1e9:.2f} GB, {len(os.listdir(src)) - 2} .distcp files) to one torch.save file (one run)")
    print("| run | seconds | peak RSS MiB | x ckpt |")
    print("|---|---|---|---|")
    for name, secs, rss in rows:
        print(f"| {name} | {secs:.2f} | {rss:.0f} | {secs / rows[-1][1]:.2f} |")


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
    ckpt("reshard", bench_dir, "-o", dcp_in, "--strategy", sp, "--format", "dcp-safetensors", "-q", "--exclude", "step")
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
    print(f"\n4. merge of a {nbytes / 1e9:.2f} GB DCP checkpoint, {len(os.listdir(dcp_in))} files, from the page cache (one run)")
    print("| run | seconds | seconds incl. sync | x ckpt merge (incl. sync) |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / rows[2][2]:.2f} |")
    shutil.rmtree(ours)
    shutil.rmtree(dcp_in)
    bench_default_format(work, bench_dir, sp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-dir")
    ap.add_argument("--work")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="ckpt-torch-")
    try:
        interop(work)
        interop_default_format(work)
        if a.bench_dir:
            bench(work, a.bench_dir)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
