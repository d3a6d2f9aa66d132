#!/usr/bin/env python3
"""DeepSpeed loads the mixture-of-experts checkpoints ckpt re-cuts for another world and
expert-parallel size (`ckpt reshard --format deepspeed --mesh dp=N,ep=K`), issue 36.

For the DeepSpeed MoE fixtures (tests/fixtures/moe/deepspeed, written by DeepSpeed's own
`deepspeed.moe.layer.MoE` on 4 gloo ranks): each case is resharded by ckpt, then
DeepSpeed builds the fixture's model at the new EP size on the new number of gloo ranks,
`engine.load_checkpoint`s it (weights, optimizer, scheduler) and
scripts/fixtures/moe_deepspeed.py's load check compares every weight and Adam moment
with what the training run itself held, byte for byte. The loss of one fixed batch, and
the loss after one more training step from the loaded state, must equal (within 1e-5)
those of DeepSpeed loading the fixture itself at its own EP size.

Needs torch, deepspeed, ninja and safetensors. Run from the repository root:

    target/py/bin/python scripts/moe_deepspeed_interop.py target/debug/ckpt [scratch_dir]

Exit 0 when every check passes, 1 otherwise.
"""

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
FIXTURES = "tests/fixtures/moe/deepspeed"
# (fixture, new mesh): EP2 -> EP4 and EP2 -> EP1 on fewer ranks (ZeRO-2), EP4 -> EP1
# (ZeRO-1), and the D + E rank rule at a new world size.
CASES = [
    ("ep2_zero2", "dp=4,ep=4"),
    ("ep2_zero2", "dp=2,ep=1"),
    ("ep4_zero1", "dp=2,ep=1"),
    ("ep2_zero2_dbe", "dp=2,ep=2"),
]
TOLERANCE = 1e-5


def main():
    ckpt = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "target/debug/ckpt"
    scratch = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="moe-ds-interop-")
    os.makedirs(scratch, exist_ok=True)
    # Last on the path (its torch.py must not shadow torch); the spawned ranks import
    # their target from it by name.
    sys.path.append(os.path.join(HERE, "fixtures"))
    import moe_deepspeed as fx

    # (The fixture scripts take their own directory off the path as they load.)
    sys.path.append(os.path.join(HERE, "fixtures"))
    port = 29500 + os.getpid() % 400
    failures = []
    baseline = {}
    for case, mesh in CASES:
        fixture = os.path.join(FIXTURES, case)
        try:
            if case not in baseline:
                port += 1
                baseline[case] = fx.load_and_compare(os.path.join(fixture, "ckpt"), fixture, None, False, port)
            out = os.path.join(scratch, f"{case}-{mesh.replace('=', '').replace(',', '-')}")
            shutil.rmtree(out, ignore_errors=True)
            r = subprocess.run([ckpt, "reshard", os.path.join(fixture, "ckpt"), "--format", "deepspeed",
                                "--mesh", mesh, "-o", out], capture_output=True, text=True)
            if r.returncode != 0:
                failures.append(f"{case} -> {mesh}: ckpt reshard failed: {r.stderr.strip()}")
                continue
            port += 1
            got = fx.load_and_compare(out, fixture, None, False, port)
            for what, a, b in zip(("loss", "loss after one more step"), got, baseline[case]):
                if abs(a - b) > TOLERANCE:
                    failures.append(f"{case} -> {mesh}: {what} {a!r}, DeepSpeed's own checkpoint gives {b!r}")
            print(f"{case} -> {mesh}: DeepSpeed's loss {got[0]!r} then {got[1]!r}; at the fixture's own EP {baseline[case][0]!r} then {baseline[case][1]!r}", flush=True)
        except AssertionError as e:
            failures.append(f"{case} -> {mesh}: {e}")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
