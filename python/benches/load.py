"""ckpt.load against safetensors.torch.load_file on one large safetensors file.

    python python/benches/load.py [GB] [DIR]

Writes DIR/model.safetensors (F32/BF16 tensors, GB gigabytes, default 2) once, then runs
each loader in a fresh process (warm page cache: the file is read once first) and prints
wall time and the process's peak RSS, for the load alone and for load + reading every
byte (torch's sum over each tensor), since ckpt's views read lazily.
"""

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time
import torch
path, how, touch = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
t = time.perf_counter()
if how == "safetensors":
    from safetensors.torch import load_file
    sd = load_file(path)
elif how == "ckpt":
    import ckpt
    sd = ckpt.load(path, framework="torch")
else:
    import ckpt
    sd = ckpt.load(path, framework="torch", checksums=False)
load = time.perf_counter() - t
if touch:
    s = 0.0
    for v in sd.values():
        s += float(v.float().sum()) if v.dtype == torch.bfloat16 else float(v.sum())
total = time.perf_counter() - t
print(json.dumps({"load": load, "total": total,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write(path, gb):
    import torch
    from safetensors.torch import save_file

    n = int(gb * (1 << 30)) // (32 << 20)  # 32 MiB tensors
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(n):
        if i % 4 == 3:
            sd[f"layers.{i}.w"] = torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
        else:
            sd[f"layers.{i}.w"] = torch.randn(2048, 4096, generator=g)
    save_file(sd, path)


def main():
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    d = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="ckpt-bench-")
    path = os.path.join(d, "model.safetensors")
    if not os.path.exists(path):
        write(path, gb)
    size = os.path.getsize(path)
    with open(path, "rb") as f:  # warm the page cache for every contender alike
        while f.read(64 << 20):
            pass
    print(f"{path}: {size / 1e9:.2f} GB")
    print("| loader | touch | load s | load+read s | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for how in ("safetensors", "ckpt", "ckpt-nochecksums"):
        for touch in ("0", "1"):
            r = subprocess.run([sys.executable, "-c", CHILD, path, how, touch],
                               capture_output=True, text=True, check=True)
            m = json.loads(r.stdout)
            print(f"| {how} | {'yes' if touch == '1' else 'no'} | {m['load']:.2f} | "
                  f"{m['total']:.2f} | {m['rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
