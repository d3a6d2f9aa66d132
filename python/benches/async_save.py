"""The training stall of a background save: ``ckpt.torch.save_state_dict(...,
background=True)`` against ``torch.distributed.checkpoint.async_save``.

    python python/benches/async_save.py [GB] [DIR] [SAVES]

4 gloo ranks hold GB gigabytes (default 1) of F32 DTensors (4096-wide rows,
``Shard(0)`` over the 4 ranks), the same state for both methods. Each method runs in
fresh processes and saves SAVES times (default 3) into DIR (default: a new temporary
directory), as a training loop would every few steps; each save is deleted once
measured. Per save and rank:

- stall: from the call until control returns to the training loop (ckpt: one copy of
  the local shards into memory and a broadcast naming the staging directory; dcp: its
  staging copy, and whatever planning it does before returning);
- durable: from the call until this rank's ``wait()`` / ``result()`` returns (both fsync
  their files; ckpt's checkpoint is committed by the last rank to finish, dcp's by rank
  0's metadata).

The slowest rank's figures are reported (the loop stalls until every rank goes on), for
the first save (which pays one-time setup: dcp's thread pool and planner caches) and the
best of the later ones; peak RSS summed over the 4 ranks (see _dist.py).
"""

import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist  # noqa: E402

SIDE = 4096


def worker(how, d, gb, saves):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckpt.torch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    n = max(1, int(gb * (1 << 30)) // (SIDE * SIDE * 4))
    sd = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i * 1000 + rank)
        local = torch.randn(SIDE // world, SIDE, generator=g)
        sd[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    before = _dist.status_kib("VmRSS")
    _dist.reset_peak()
    out = []
    for s in range(saves):
        path = os.path.join(d, f"{how}-{s}")
        dist.barrier()
        t = time.perf_counter()
        if how == "dcp":
            fut = dcp.async_save(sd, checkpoint_id=path)
        else:
            fut = ckpt.torch.save_state_dict(sd, path, background=True)
        stall = time.perf_counter() - t
        if how == "dcp":
            fut.result()
        else:
            fut.wait()
        durable = time.perf_counter() - t
        out.append({"stall": stall, "durable": durable})
        dist.barrier()
        if rank == 0:
            assert os.path.isdir(path), path
            shutil.rmtree(path)
    peak = _dist.status_kib("VmHWM")
    print(json.dumps({"saves": out, "save_peak_mib": (peak - before) / 1024,
                      "process_peak_mib": peak / 1024, "bytes": n * SIDE * SIDE * 4}))
    dist.destroy_process_group()


def main():
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    d = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="ckpt-bench-")
    saves = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    d = os.path.join(os.path.abspath(d), "async")
    os.makedirs(d, exist_ok=True)
    me = os.path.abspath(__file__)
    rows = {}
    for how in ("dcp", "ckpt"):
        ranks = _dist.run_ranks(me, 4, how, d, gb, saves)
        per_save = [
            {k: max(r["saves"][s][k] for r in ranks) for k in ("stall", "durable")}
            for s in range(saves)
        ]
        rows[how] = {
            "first": per_save[0],
            "later": min(per_save[1:], key=lambda m: m["stall"]) if saves > 1 else per_save[0],
            "rss": sum(r["process_peak_mib"] for r in ranks),
            "save_peak": sum(r["save_peak_mib"] for r in ranks),
        }
        total = ranks[0]["bytes"]
    print(f"4 gloo ranks, {total / 1e9:.2f} GB of F32 DTensors ({SIDE}-wide rows, Shard(0)), "
          f"{saves} saves each")
    print("| method | first save: stall s | durable s | later saves (best): stall s | durable s "
          "| summed peak RSS MiB | summed save peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for how, m in rows.items():
        print(f"| {how} | {m['first']['stall']:.2f} | {m['first']['durable']:.2f} | "
              f"{m['later']['stall']:.2f} | {m['later']['durable']:.2f} | {m['rss']:.0f} | "
              f"{m['save_peak']:.0f} |")
    a, b = rows["dcp"]["later"], rows["ckpt"]["later"]
    print(f"ckpt vs dcp (later saves): stall {ratio(a['stall'], b['stall'], 'shorter', 'longer')}, "
          f"durable {ratio(a['durable'], b['durable'], 'sooner', 'later')}")


def ratio(theirs, ours, better, worse):
    return f"{theirs / ours:.1f}x {better}" if theirs >= ours else f"{ours / theirs:.1f}x {worse}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("dcp", "ckpt"):
        worker(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
