#!/usr/bin/env python3
"""megatron-core loads the expert-parallel checkpoints `ckpt reshard --format megatron`
writes from its own MoE fixtures, on as many gloo ranks as the new sizes need, with every
tensor equal to the model's and the same logits (scripts/fixtures/moe_megatron.py
--load does the loading and comparing):

  EP2 -> EP4;  EP4 -> EP1 x TP2;  EP2 x TP2 -> EP2 x PP2

  moe_reshard_interop.py CKPT"""
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "moe" / "megatron"
CASES = [("ep2tp1", "ep=4"), ("ep4tp1", "ep=1,tp=2"), ("ep2tp2", "ep=2,tp=1,pp=2")]


def main():
    ckpt = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        for case, mesh in CASES:
            out = pathlib.Path(tmp) / f"{case}-{mesh.replace(',', '-').replace('=', '')}"
            subprocess.run(
                [ckpt, "reshard", str(FIXTURES / case / "legacy"), "--format", "megatron", "--mesh", mesh, "-o", str(out), "-q"],
                check=True,
            )
            subprocess.run(
                [sys.executable, str(REPO / "scripts" / "fixtures" / "moe_megatron.py"), str(FIXTURES / case), "--load", str(out)],
                check=True,
            )


if __name__ == "__main__":
    main()
