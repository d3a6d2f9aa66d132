"""What the distributed benchmarks share: starting N gloo processes of a script,
collecting one JSON line from each, and a process's memory from /proc.

Peak RSS is measured two ways, both from Linux's /proc/self/status:
- ``VmHWM`` at the end: the process's whole peak (torch, gloo, the state dict and the
  operation);
- the operation's own peak: ``VmHWM`` is reset (``5`` into /proc/self/clear_refs) just
  before the operation and read after it, minus ``VmRSS`` before it. That is the memory
  the operation adds on top of a training process that already holds its state.
"""

import json
import os
import socket
import subprocess
import sys


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak():
    """Sets VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script, n, *args, threads=1):
    """Runs ``python script args...`` as ranks 0..n-1 of a gloo group, with
    ``OMP_NUM_THREADS`` as torchrun sets it; returns each rank's last stdout line
    parsed as JSON, in rank order."""
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *map(str, args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate() for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"rank {r} of {n} ({' '.join(map(str, args))}) failed:\n{err}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def warm(path):
    """Reads every file under ``path`` once, so every contender starts from a warm page
    cache alike."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def du(path):
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(path)
        for name in files
    )
