#!/usr/bin/env python3
"""Loads into GPU memory, against the link and safetensors (issue 37), one run:

    python3 scripts/gpu_load_bench.py OUT.json [--gib 2] [--device cuda:0] [--dir DIR]

- the host-to-device link from pinned and from pageable memory (1 GiB, best of 3);
- a GIB safetensors file (bf16, 64 MiB tensors) loaded with
  ``ckpt.load(framework="torch", device=...)`` and with
  ``safetensors.torch.load_file(device=...)``; the same file resharded by ckpt to 4
  ranks and rank 0's slice loaded with ``ckpt.load(rank=0, ...)``; a state dict of
  CUDA tensors filled by ``ckpt.torch.load_state_dict``;
- each load in its own process (the page cache warm), timed from the call to the
  tensors being on the GPU, its peak host RSS added sampled every 2 ms; every tensor
  compared with the reference on the GPU.

Writes OUT.json: the figures, their ratios (to the pinned link, to safetensors) and
whether every tensor was equal. Needs torch with CUDA, safetensors and ckpt.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    """Peak RSS of this process while in the block, sampled every 2 ms."""

    def __enter__(self):
        self.base = rss_mib()
        self.peak = self.base
        self.done = threading.Event()

        def run():
            while not self.done.is_set():
                self.peak = max(self.peak, rss_mib())
                self.done.wait(0.002)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss_mib())

    @property
    def added(self) -> float:
        return self.peak - self.base


def child(kind: str, path: str, device: str, reference: str) -> None:
    """One measured load; prints JSON."""
    import torch

    sync = _sync(device)
    torch.empty(1, device=device)  # the CUDA context before the baseline
    sync()
    sd = None
    if kind == "load_state_dict":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            sd = {k: torch.empty(f.get_slice(k).get_shape(), dtype=torch.bfloat16, device=device) for k in f.keys()}
        sync()
    with Peak() as peak:
        t = time.perf_counter()
        if kind == "safetensors":
            from safetensors.torch import load_file

            got = load_file(path, device=device)
        elif kind == "ckpt":
            import ckpt

            got = ckpt.load(path, framework="torch", device=device)
        elif kind == "ckpt_rank":
            import ckpt

            got = ckpt.load(path, rank=0, framework="torch", device=device)
        else:
            import ckpt.torch

            got = ckpt.torch.load_state_dict(sd, path)
        sync()
        seconds = time.perf_counter() - t
    nbytes = sum(v.numel() * v.element_size() for v in got.values())
    equal = None
    if reference:
        import ckpt

        ref_rank = 0 if kind == "ckpt_rank" else None
        want = ckpt.load(reference, rank=ref_rank, framework="torch")
        equal = set(want) == set(got) and all(
            torch.equal(got[k], want[k].to(device)) for k in want
        )
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "rss_added_mib": peak.added, "equal": equal}))


def _sync(device: str):
    import torch

    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def link(device: str) -> dict:
    """Host-to-device GB/s from pinned and pageable memory (a CPU dry run: none)."""
    import torch

    if torch.device(device).type != "cuda":
        return {"pinned_gbps": float("nan"), "pageable_gbps": float("nan")}

    n = 1 << 30
    out = {}
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    for name, pinned in (("pinned", True), ("pageable", False)):
        src = torch.ones(n, dtype=torch.uint8, pin_memory=pinned)
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        out[name + "_gbps"] = n / best / 1e9
        del src
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--device", default="cuda:0", help="cuda:N; cpu for a dry run of the script")
    ap.add_argument("--dir", default="/tmp/ckpt-gpu-load")
    ap.add_argument("--child", nargs=4, metavar=("KIND", "PATH", "DEVICE", "REFERENCE"))
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    import torch

    import ckpt
    from safetensors.torch import save_file

    os.makedirs(a.dir, exist_ok=True)
    merged = os.path.join(a.dir, "model.safetensors")
    sliced = os.path.join(a.dir, "sliced")
    per = 64 << 20
    count = max(1, int(a.gib * (1 << 30)) // per)
    if not os.path.exists(merged):
        g = torch.Generator().manual_seed(37)
        tensors = {
            f"layers.{i}.weight": torch.randn(4096, per // 2 // 4096, generator=g).to(torch.bfloat16)
            for i in range(count)
        }
        save_file(tensors, merged)
        del tensors
    if not os.path.exists(sliced):
        ckpt.reshard(merged, sliced, to=4, shard=[("*", 0)])
    for root, _, files in os.walk(a.dir):  # the page cache warm for every run
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass
    on_gpu = torch.device(a.device).type == "cuda"
    name = torch.cuda.get_device_name(a.device) if on_gpu else "cpu (dry run: no figure is the GPU's)"
    result = {"device": name, "gib": a.gib, **link(a.device)}

    def run(kind, path, reference):
        p = subprocess.run(
            [sys.executable, __file__, "x", "--child", kind, path, a.device, reference],
            capture_output=True,
            text=True,
            check=False,
        )
        if p.returncode != 0:
            return {"error": p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
        return json.loads(p.stdout.strip().splitlines()[-1])

    result["safetensors"] = run("safetensors", merged, "")
    result["ckpt"] = run("ckpt", merged, merged)
    result["ckpt_rank"] = run("ckpt_rank", sliced, sliced)
    result["load_state_dict"] = run("load_state_dict", merged, merged)
    pinned = result["pinned_gbps"]
    for kind in ("ckpt", "ckpt_rank", "load_state_dict", "safetensors"):
        r = result[kind]
        if "seconds" in r:
            r["gbps"] = r["bytes"] / r["seconds"] / 1e9
            r["of_pinned_link"] = r["gbps"] / pinned
    st = result["safetensors"].get("seconds")
    for kind in ("ckpt", "load_state_dict"):
        if st and "seconds" in result[kind]:
            result[kind]["x_safetensors"] = st / result[kind]["seconds"]
    # Issue 37's targets: at least 0.8 of the pinned link, 4x safetensors, at most
    # 512 MiB of host RSS added, every tensor equal.
    checks = []
    for kind in ("ckpt", "ckpt_rank"):
        r = result[kind]
        checks.append(r.get("of_pinned_link", 0) >= 0.8 and r.get("rss_added_mib", 1e9) <= 512 and r.get("equal") is True)
    checks.append(result["ckpt"].get("x_safetensors", 0) >= 4)
    checks.append(result["load_state_dict"].get("equal") is True)
    result["targets_met"] = all(checks)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
