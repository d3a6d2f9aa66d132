#!/usr/bin/env python3
"""`ckpt merge` against DeepSpeed's zero_to_fp32 on the same ZeRO checkpoint: wall time and
peak RSS (/usr/bin/time -v), one run each.

Needs the venv of scripts/fixtures/deepspeed_fixtures.py (torch, deepspeed, ninja,
safetensors) and a release ckpt (`cargo build --release`). From the repository root:

    target/venv-ds/bin/python scripts/bench_deepspeed.py [--mb 1024] [--ranks 4] [--stages 2 3]

It trains one step of a stack of square Linear layers holding `--mb` MiB of fp32 master
weights on `--ranks` data-parallel CPU processes (gloo, AdamW), saves the checkpoint
with `engine.save_checkpoint`, then times
  - `ckpt merge <ckpt> -o <out>` (release build), and
  - `python -c get_fp32_state_dict_from_zero_checkpoint + safetensors save_file`
    (zero_to_fp32's own API writing the same safetensors output),
checks that both outputs hold the same bytes, and prints one line per stage.

With `--modes save` it only trains, saves and keeps `WORK/zero<stage>` (`--work WORK`):
the DeepSpeed source of `scripts/s3_bench.sh`'s `deepspeed` layout.

With `--modes ucp` (or `merge ucp`, the default) it also times, on the same checkpoint,
  - `ckpt merge <ckpt> --format ucp -o <out>` (DeepSpeed's universal checkpoint), and
  - `python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state` with its
    default workers (4 extracting, 2 merging),
and checks that every `zero/<param>/*.pt` tensor of the two trees is equal.

The measurements in docs/benchmarks.md (one run each, on a machine shared with other builds):

    target/venv-ds/bin/python scripts/bench_deepspeed.py --mb 1024 --stages 3 --modes merge
    target/venv-ds/bin/python scripts/bench_deepspeed.py --mb 384 --stages 2 3 --modes ucp
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") not in (_here, os.path.join(_here, "fixtures"))]
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# DeepSpeed JIT-builds its CPU communication op into torch's extension cache: one of our
# own, so that other venvs' builds (another torch) neither rebuild it nor hold its lock.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.abspath("target/torch-extensions"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

WIDTH = 2048  # one layer: 2048*2048 fp32 = 16 MiB


def worker(rank, world, stage, layers, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }
    # ZeRO-3: parameters partitioned as they are made (each of 4 ranks building the
    # whole 1 GiB model first ran out of memory on a shared 23 GiB machine).
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=stage == 3):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=(i % 2 == 0)) for i in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    loss = engine(torch.randn(1, WIDTH)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)


def timed(cmd):
    t = time.monotonic()
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True)
    wall = time.monotonic() - t
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return wall, rss / 1024


def same_ucp(mine, theirs):
    """Every state file of DeepSpeed's tree has its twin in ckpt's, with equal tensors."""
    n = 0
    zero = os.path.join(theirs, "zero")
    for param in sorted(os.listdir(zero)):
        d = os.path.join(zero, param)
        if not os.path.isdir(d):
            continue
        for f in sorted(os.listdir(d)):
            a = torch.load(os.path.join(mine, "zero", param, f), weights_only=False)
            b = torch.load(os.path.join(d, f), weights_only=False)
            ta, tb = (a["param"], b["param"]) if isinstance(b, dict) else (a, b)
            if not (ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb)):
                return False, n
            n += 1
    return True, n


def bench_ucp(a, ck, stage, size, work):
    tag = open(os.path.join(ck, "latest")).read().strip()
    out_ckpt = os.path.join(work, f"ckpt-ucp{stage}")
    shutil.rmtree(out_ckpt, ignore_errors=True)
    t_ckpt, rss_ckpt = timed([a.ckpt, "merge", ck, "--format", "ucp", "-o", out_ckpt])
    subprocess.run(["sync"])
    out_ds = os.path.join(work, f"ds-ucp{stage}")
    shutil.rmtree(out_ds, ignore_errors=True)
    t_ds, rss_ds = timed([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          os.path.join(ck, tag), "--output_folder", out_ds, "--inject_missing_state"])
    mine = os.path.join(out_ckpt, open(os.path.join(out_ckpt, "latest_universal")).read())
    same, n = same_ucp(mine, out_ds)
    print(
        f"ZeRO-{stage} -> UCP: checkpoint {size / 2**20:.0f} MiB; ckpt merge --format ucp {t_ckpt:.2f} s, peak RSS "
        f"{rss_ckpt:.0f} MiB; ds_to_universal {t_ds:.2f} s, peak RSS {rss_ds:.0f} MiB; speedup {t_ds / t_ckpt:.1f}x; "
        f"{n} state files, same tensors: {same}",
        flush=True,
    )
    shutil.rmtree(out_ckpt, ignore_errors=True)
    shutil.rmtree(out_ds, ignore_errors=True)
    # ds_to_universal writes latest_universal beside its output folder.
    stray = os.path.join(work, "latest_universal")
    if os.path.exists(stray):
        os.remove(stray)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024, help="MiB of fp32 master weights")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--ckpt", default="target/release/ckpt")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--modes", nargs="+", default=["merge", "ucp"], choices=["merge", "ucp", "save"],
                    help="save: only train and keep WORK/zero<stage> (the source of scripts/s3_bench.sh's "
                    "deepspeed layout)")
    a = ap.parse_args()
    layers = max(1, a.mb // 16)
    work = a.work or tempfile.mkdtemp(prefix="bench-ds-")
    print(f"{layers} layers of {WIDTH}x{WIDTH} (~{layers * 16} MiB fp32), {a.ranks} dp ranks, scratch {work}")
    for stage in a.stages:
        ck = os.path.join(work, f"zero{stage}")
        shutil.rmtree(ck, ignore_errors=True)
        ctx = mp.get_context("spawn")
        port = 29600 + stage
        ps = [ctx.Process(target=worker, args=(r, a.ranks, stage, layers, ck, port)) for r in range(a.ranks)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        if any(p.exitcode for p in ps):
            raise SystemExit(f"DeepSpeed training failed (stage {stage})")
        subprocess.run(["sync"])
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs)
        if "save" in a.modes:
            print(f"ZeRO-{stage}: {ck} ({size / 2**20:.0f} MiB) kept", flush=True)
            continue
        if "ucp" in a.modes:
            bench_ucp(a, ck, stage, size, work)
        if "merge" not in a.modes:
            shutil.rmtree(ck, ignore_errors=True)
            continue
        out_ckpt = os.path.join(work, f"ckpt-out{stage}")
        shutil.rmtree(out_ckpt, ignore_errors=True)
        # Weights only, as zero_to_fp32 (ckpt would also write the moments).
        t_ckpt, rss_ckpt = timed([a.ckpt, "merge", ck, "-o", out_ckpt, "--exclude", "optim.*"])
        out_ds = os.path.join(work, f"ds-out{stage}.safetensors")
        script = (
            "import sys; from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g; "
            "from safetensors.torch import save_file; "
            "sd = g(sys.argv[1]); save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[2])"
        )
        t_ds, rss_ds = timed([sys.executable, "-c", script, ck, out_ds])
        from safetensors.torch import load_file

        mine = load_file(os.path.join(out_ckpt, "model.safetensors"))
        theirs = load_file(out_ds)
        same = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
        del mine, theirs
        shutil.rmtree(out_ckpt, ignore_errors=True)
        os.remove(out_ds)
        shutil.rmtree(ck, ignore_errors=True)
        print(
            f"ZeRO-{stage}: checkpoint {size / 2**20:.0f} MiB; ckpt merge {t_ckpt:.2f} s, peak RSS {rss_ckpt:.0f} MiB; "
            f"zero_to_fp32 {t_ds:.2f} s, peak RSS {rss_ds:.0f} MiB; speedup {t_ds / t_ckpt:.1f}x; same bytes: {same}",
            flush=True,
        )
    if not a.work and "save" not in a.modes:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
