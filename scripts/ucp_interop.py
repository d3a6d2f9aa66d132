#!/usr/bin/env python3
"""DeepSpeed's own engine loads ckpt's universal checkpoint on another data-parallel size.

For the ZeRO-2 and ZeRO-3 fp32 fixtures (tests/fixtures/deepspeed, 2 data-parallel ranks):
`ckpt merge <fixture>/ckpt --format ucp -o OUT`, then 3 gloo ranks build the fixture's
model and optimizer with `"checkpoint": {"load_universal": true}` and call
`engine.load_checkpoint(OUT)`; the fp32 master weights and Adam moments DeepSpeed then
holds (gathered with `safe_get_full_fp32_param` / `safe_get_full_optimizer_state`) must
equal, bit for bit, the source's: `zero_to_fp32`'s weights (expected.safetensors) and the
moments the training engine gathered (moments.safetensors). It also checks that the
optimizer's step and hyperparameters came back, and trains one more step after the load.

Needs torch, deepspeed, ninja and safetensors (the fixture script's venv). Run from the
repository root:

    target/venv-ds/bin/python scripts/ucp_interop.py target/debug/ckpt [scratch_dir]

Exit 0 when every check passes, 1 otherwise (each failure printed).
"""

import os
import shutil
import subprocess
import sys
import tempfile

_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
# Last: scripts/fixtures/torch.py must not shadow the torch package.
sys.path.append(os.path.join(_here, "fixtures"))
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# DeepSpeed JIT-builds its CPU communication op into torch's extension cache: one of our
# own, so that other venvs' builds (another torch) neither rebuild it nor hold its lock.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.abspath("target/torch-extensions"))

import torch  # noqa: E402

from gloo_ranks import rank_exit_codes  # noqa: E402  (before deepspeed_fixtures, which takes fixtures/ off the path)
from deepspeed_fixtures import Tiny, config, finish_rank  # noqa: E402

LOAD_WORLD = 3


def worker(rank, stage, load_dir, out_file, port):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(LOAD_WORLD),
    )
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(123)  # other initial values than the trained ones
    model = Tiny()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.5, weight_decay=0.5)  # overwritten by the load
    cfg = config(stage, "fp32")
    cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.load_checkpoint(load_dir)
    got = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        got[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            t = safe_get_full_optimizer_state(p, key)
            if t is not None:
                got[f"optim.{name}.{key}"] = t.detach().float().cpu().clone()
    group = engine.optimizer.optimizer.param_groups[0]
    # (float now: the step is a tensor the next step increments in place.)
    steps = [float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s]
    # One more training step on the loaded state must run.
    x = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(rank))
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    if rank == 0:
        from safetensors.torch import save_file

        save_file(got, out_file)
        with open(out_file + ".txt", "w") as f:
            step = float(steps[0]) if steps else -1
            f.write(f"{group['lr']} {group['weight_decay']} {step} {float(loss)}\n")
    finish_rank()


def main():
    ckpt = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "target/debug/ckpt"
    scratch = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="ucp-interop-")
    os.makedirs(scratch, exist_ok=True)
    from safetensors.torch import load_file

    failures = []
    port = 29700 + os.getpid() % 500
    for stage in (2, 3):
        fx = os.path.join("tests/fixtures/deepspeed", f"zero{stage}_fp32")
        out = os.path.join(scratch, f"ucp{stage}")
        shutil.rmtree(out, ignore_errors=True)
        r = subprocess.run([ckpt, "merge", os.path.join(fx, "ckpt"), "--format", "ucp", "-o", out], capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"zero{stage}: ckpt merge --format ucp failed: {r.stderr}")
            continue
        got_file = os.path.join(scratch, f"loaded{stage}.safetensors")
        port += 1
        codes = rank_exit_codes(worker, (stage, out, got_file, port), LOAD_WORLD)
        if any(codes):
            failures.append(f"zero{stage}: DeepSpeed's load on {LOAD_WORLD} ranks failed (exit codes {codes})")
            continue
        got = load_file(got_file)
        want = load_file(os.path.join(fx, "expected.safetensors"))
        want.update(load_file(os.path.join(fx, "moments.safetensors")))
        checked = 0
        for name, t in got.items():
            if name not in want:
                failures.append(f"zero{stage}: `{name}` loaded but not in the source")
            elif not torch.equal(t, want[name]):
                failures.append(f"zero{stage}: `{name}` differs from the source (max |diff| {(t - want[name]).abs().max()})")
            else:
                checked += 1
        lr, wd, step, loss = open(got_file + ".txt").read().split()
        if float(lr) != 0.1 or float(wd) != 0.01:
            failures.append(f"zero{stage}: hyperparameters not loaded (lr {lr}, weight_decay {wd})")
        if float(step) != 2.0:
            failures.append(f"zero{stage}: optimizer step {step}, the source trained 2")
        print(f"zero{stage}: DeepSpeed loaded ckpt's UCP on {LOAD_WORLD} ranks: {checked} tensors equal the source bit for bit, step {step}, lr {lr}, next loss {loss}", flush=True)
        if checked != 15:
            failures.append(f"zero{stage}: {checked} tensors compared, 15 expected (5 parameters x 3 states)")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
