"""4 ranks load their DTensor shards from an 8-rank DCP checkpoint:
``ckpt.torch.load_state_dict`` against ``torch.distributed.checkpoint.load``.

    python python/benches/dcp_load.py [GB] [DIR] [ROUNDS]

Once: 8 gloo processes write DIR/dcp8 with ``dcp.save`` (the default format): GB
gigabytes (default 1) of F32 tensors (a 32768x4096 embedding and 4096x4096 layers), each
``Shard(0)`` over the 8 ranks. Then, per round (default 2), each method in fresh
processes: 4 gloo ranks build the state dict of a 4-rank model (zeroed DTensors, the
embedding and every other layer ``Shard(1)``, the rest ``Shard(0)``: half the pieces
are columns cut out of the saved row blocks) and load it.
Timed on each rank between two barriers, the slowest rank's time reported; peak RSS
summed over the 4 ranks, both the whole process's and what the load adds (see
_dist.py). The page cache is warm for both. Every rank's loaded bytes are digested
and the two methods must agree.
"""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist  # noqa: E402

SIDE = 4096
VOCAB = 32768


def tensors(gb):
    """(name, global shape) of a transformer-like state of about ``gb`` GB (F32): one
    VOCAB x SIDE embedding (512 MiB), then SIDE x SIDE layer weights (64 MiB each)."""
    out = [("embed.weight", (VOCAB, SIDE))]
    n = max(0, int(gb * (1 << 30)) - VOCAB * SIDE * 4) // (SIDE * SIDE * 4)
    out += [(f"layers.{i}.weight", (SIDE, SIDE)) for i in range(n)]
    return out


def load_dim(i):
    """The 4-rank model's shard dim of tensor i: the embedding and every other layer by
    columns (``Shard(1)``: a column block of each of the 8 saved row blocks), the rest
    by rows (``Shard(0)``: two whole saved row blocks)."""
    return 1 if i % 2 == 0 else 0


def local_shape(shape, dim, world):
    return tuple(s // world if d == dim else s for d, s in enumerate(shape))


def worker(mode, d, gb):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if mode == "save":
        # Each rank makes only its own rows (a seed per tensor and rank): no rank ever
        # holds a whole tensor.
        sd = {}
        for i, (n, shape) in enumerate(tensors(gb)):
            g = torch.Generator().manual_seed(i * 1000 + rank)
            local = torch.randn(local_shape(shape, 0, world), generator=g)
            sd[n] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        dcp.save(sd, checkpoint_id=os.path.join(d, "dcp8"))
        dist.barrier()
        print(json.dumps({}))
        return
    sd = {}
    for i, (n, shape) in enumerate(tensors(gb)):
        # Written, so its pages are resident as a live model's are.
        local = torch.empty(local_shape(shape, load_dim(i), world)).zero_()
        sd[n] = DTensor.from_local(local, mesh, [Shard(load_dim(i))], run_check=False)
    import ckpt.torch

    before = _dist.status_kib("VmRSS")
    _dist.reset_peak()
    dist.barrier()
    t = time.perf_counter()
    if mode == "dcp":
        dcp.load(sd, checkpoint_id=os.path.join(d, "dcp8"))
    else:
        ckpt.torch.load_state_dict(sd, os.path.join(d, "dcp8"))
    dist.barrier()
    seconds = time.perf_counter() - t
    peak = _dist.status_kib("VmHWM")
    digest = 0
    for n, _ in tensors(gb):
        local = sd[n].to_local()
        digest += int(local.view(torch.int32).to(torch.int64).sum()) * (1 + len(n))
        assert bool(local.any()), n  # filled, not left zero
    print(
        json.dumps(
            {
                "seconds": seconds,
                "load_peak_mib": (peak - before) / 1024,
                "process_peak_mib": peak / 1024,
                "digest": digest,
            }
        )
    )
    dist.destroy_process_group()


def main():
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    d = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="ckpt-bench-")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    me = os.path.abspath(__file__)
    src = os.path.join(d, "dcp8")
    if not os.path.exists(src):
        _dist.run_ranks(me, 8, "save", d, gb)
    _dist.warm(src)
    n = len(tensors(gb)) - 1
    print(f"{src}: F32 embedding {VOCAB}x{SIDE} and {n} tensors of {SIDE}x{SIDE}, "
          f"{_dist.du(src) / 1e9:.2f} GB on disk, saved by 8 ranks (Shard(0)); "
          f"loaded by 4 gloo ranks (Shard(1) and Shard(0) in turn)")
    print("| round | method | wall s (slowest rank) | summed peak RSS MiB | summed load peak MiB |")
    print("|---|---|---|---|---|")
    results = {"dcp": [], "ckpt": []}
    for r in range(rounds):
        for how in ("dcp", "ckpt"):
            ranks = _dist.run_ranks(me, 4, how, d, gb)
            m = {
                "seconds": max(x["seconds"] for x in ranks),
                "rss": sum(x["process_peak_mib"] for x in ranks),
                "load": sum(x["load_peak_mib"] for x in ranks),
                "digests": [x["digest"] for x in ranks],
            }
            results[how].append(m)
            print(f"| {r + 1} | {how} | {m['seconds']:.2f} | {m['rss']:.0f} | {m['load']:.0f} |",
                  flush=True)
    for a, b in zip(results["dcp"], results["ckpt"]):
        if a["digests"] != b["digests"]:
            raise SystemExit("ckpt and dcp loaded different bytes")
    best = {k: min(v, key=lambda m: m["seconds"]) for k, v in results.items()}
    print(
        f"ckpt vs dcp (best round each): {best['dcp']['seconds'] / best['ckpt']['seconds']:.1f}x "
        f"faster; summed peak RSS {best['ckpt']['rss'] / best['dcp']['rss']:.2f} of dcp's; "
        f"summed load peak {best['ckpt']['load'] / max(best['dcp']['load'], 1):.2f} of dcp's"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("save", "dcp", "ckpt"):
        worker(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    else:
        main()
