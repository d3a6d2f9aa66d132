#!/usr/bin/env python3
"""megatron-core loads the expert-parallel checkpoints `ckpt reshard --format megatron`
writes from its own MoE fixtures, on as many gloo ranks as the new sizes need, with every
tensor equal to the model's and the same logits (scripts/fixtures/moe_megatron.py
--load does the loading and comparing):

  EP2 -> EP4;  EP4 -> EP1 x TP2;  EP2 x TP2 -> EP2 x PP2;
  EP2 x TP2 with expert TP 1 -> EP2 x TP2 with expert TP 1 and with expert TP 2;
  EP2 x TP2 -> EP2 x TP2 with expert TP 1;
  EP2 x TP4 with expert TP 2 -> EP2 x TP2 (expert TP 1) and -> EP2 x TP4 (expert TP 4);
  GroupedMLP EP2 -> EP4 and -> EP2 x TP2 (expert TP 1): tensors only

and the megatron-core dist_ckpts `ckpt reshard --format megatron-dist` writes from the
legacy fixtures (experts stacked `[layers, experts, ...]` under megatron-core's keys, the
`_extra_state` objects of every expert), loaded with `dist_checkpointing.load` at the EP
size the args say and at another (Megatron reshards a dist_ckpt itself):

  EP2 x TP1 -> dist TP1 (loaded at EP1 and EP2);  EP2 x TP2 -> dist TP2 x PP2 (at EP1);
  EP2 x TP2 with expert TP 1 -> dist TP1 (at EP2); EP2 x TP4 with expert TP 2 -> dist
  TP2 (at EP2);
  GroupedMLP EP2 -> dist TP1 (at EP2) and -> dist TP2 x PP2 (at EP1): each expert the
  transpose of a run of the grouped weights

  moe_reshard_interop.py CKPT

Every load runs in this process (moe_megatron.load_and_compare), its gloo ranks forked
from it: torch and megatron-core are imported once, not once per rank."""
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "scripts" / "fixtures"))
import moe_megatron  # noqa: E402

PORT = 29711
FIXTURES = REPO / "tests" / "fixtures" / "moe" / "megatron"
CASES = [
    ("ep2tp1", "ep=4"),
    ("ep4tp1", "ep=1,tp=2"),
    ("ep2tp2", "ep=2,tp=1,pp=2"),
    # expert TP 1 under TP 2 (two rank directories), kept; and written with expert TP = TP
    ("ep2tp2etp1", "ep=2,tp=2"),
    ("ep2tp2etp1", "ep=2,tp=2,etp=2"),
    # expert TP = TP 2 written with expert TP 1
    ("ep2tp2", "ep=2,tp=2,etp=1"),
    # expert TP 2 under TP 4 (four rank directories, each an expert-TP half), written
    # with expert TP 1 and with expert TP = TP
    ("ep2tp4etp2", "ep=2,tp=2"),
    ("ep2tp4etp2", "ep=2,tp=4,etp=4"),
    # GroupedMLP (no logits: its forward needs bf16 and CUDA's grouped GEMM)
    ("ep2grouped", "ep=4"),
    ("ep2grouped", "ep=2,tp=2"),
]
# (fixture, --mesh, the EP sizes megatron-core loads the dist_ckpt at)
DIST_CASES = [
    ("ep2tp1", "tp=1,pp=1", (1, 2)),
    ("ep2tp2", "tp=2,pp=2", (1,)),
    ("ep2tp2etp1", "tp=1,pp=1", (2,)),
    ("ep2tp4etp2", "tp=2,pp=1", (2,)),
    ("ep2grouped", "tp=1,pp=1", (2,)),
    ("ep2grouped", "tp=2,pp=2", (1,)),
]


def main():
    ckpt = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        for case, mesh in CASES:
            out = pathlib.Path(tmp) / f"{case}-{mesh.replace(',', '-').replace('=', '')}"
            subprocess.run(
                [ckpt, "reshard", str(FIXTURES / case / "legacy"), "--format", "megatron", "--mesh", mesh, "-o", str(out), "-q"],
                check=True,
            )
            moe_megatron.load_and_compare(str(out), str(FIXTURES / case), PORT)
        for case, mesh, eps in DIST_CASES:
            out = pathlib.Path(tmp) / f"{case}-dist-{mesh.replace(',', '-').replace('=', '')}"
            subprocess.run(
                [ckpt, "reshard", str(FIXTURES / case / "legacy"), "--format", "megatron-dist", "--mesh", mesh,
                 "-o", str(out), "-q"],
                check=True,
            )
            for ep in eps:
                moe_megatron.load_and_compare(str(out / "iter_0000001"), str(FIXTURES / case), PORT, load_ep=ep)


if __name__ == "__main__":
    main()
