"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on gloo: 4 ranks save model and Adam
state with ``ckpt.torch.save_state_dict`` from a 1-D FSDP mesh and from FSDP over tensor
parallelism on a 2x2 mesh (``_StridedShard`` placements); ``ckpt reshard --to 2``; 2
ranks resume, and every tensor equals the saved one byte for byte."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("torch without FSDP2 (fully_shard, torch >= 2.6)", allow_module_level=True)
pytest.importorskip("torch.distributed.tensor.parallel")

import ckpt  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_ranks(n, *args):
    from test_torch import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "fsdp_worker.py"), *map(str, args)],
            env=dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(n)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    # Every failed rank's end of output: the first rank's is often only "connection
    # closed by peer", the cause being in another's.
    failed = [
        f"rank {r} of {n} ({args[0]}) failed:\n{o[-4000:]}"
        for r, (p, o) in enumerate(zip(procs, outs))
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)


def assert_same_bytes(got, want):
    assert set(got) == set(want)
    for k, v in want.items():
        g = got[k]
        assert g.dtype == v.dtype and g.shape == v.shape, (k, g.shape, v.shape)
        assert torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_fsdp2_save_reshard_resume(tmp_path):
    run_ranks(4, "save", tmp_path)
    truth1 = torch.load(tmp_path / "fsdp1.pt")
    truth2d = torch.load(tmp_path / "fsdp2d.pt")
    assert len(truth1) == 24  # 6 parameters: weights, Adam's exp_avg, exp_avg_sq, step

    # FSDP2 over TP: the TP axis cuts up.weight's rows first, then the DP axis each TP
    # piece (_StridedShard), which ckpt records as Shard(0, order=1) on dp.
    ck = ckpt.open(tmp_path / "fsdp2d")
    assert ck.mesh == "dp=2,tp=2"
    assert ck.tensors["model.up.weight"].placements == ("Shard(0,order=1)", "Shard(0)")
    assert ck.tensors["optim.state.up.weight.exp_avg"].placements == ("Shard(0,order=1)", "Shard(0)")
    assert ck.tensors["model.down.weight"].placements == ("Shard(0)", "Shard(1)")
    # head is not tensor-parallel: FSDP2 puts it on the dp slice of the mesh.
    assert ck.tensors["model.head.weight"].placements == ("Shard(0)", "Replicate")
    assert ckpt.open(tmp_path / "fsdp1").tensors["model.up.weight"].placements == ("Shard(0)",)

    # What was saved, merged by ckpt alone, is what torch's full_tensor() gave.
    for name, truth in (("fsdp1", truth1), ("fsdp2d", truth2d)):
        assert_same_bytes(ckpt.load(tmp_path / name, framework="torch"), truth)

    # `ckpt reshard --to 2`, then 2 ranks resume from each reshard and straight from the
    # 2-D save (its pieces cut at load time).
    for name in ("fsdp1", "fsdp2d"):
        r = subprocess.run(
            [sys.executable, "-m", "ckpt", "reshard", str(tmp_path / name), "--to", "2",
             "-o", str(tmp_path / f"{name}-to2")],
            capture_output=True, text=True,
        )
        assert r.returncode == 0, r.stderr
    run_ranks(2, "resume", tmp_path, tmp_path / "fsdp1-to2", tmp_path / "fsdp2d-to2", tmp_path / "fsdp2d")
    assert_same_bytes(torch.load(tmp_path / "fsdp1-to2.resumed.pt"), truth1)
    assert_same_bytes(torch.load(tmp_path / "fsdp2d-to2.resumed.pt"), truth2d)
    assert_same_bytes(torch.load(tmp_path / "fsdp2d.resumed.pt"), truth2d)


def test_unmappable_strided_shard_is_refused_by_name():
    pytest.importorskip("torch.distributed.tensor.placement_types")
    from torch.distributed.tensor.placement_types import _StridedShard, Shard

    import ckpt.torch as ct

    class Mesh:  # what _placements reads of a DeviceMesh
        mesh = torch.arange(4).reshape(2, 2)

    class T:
        device_mesh = Mesh()
        placements = (_StridedShard(0, split_factor=3), Shard(0))

    with pytest.raises(ckpt.Unsupported) as e:
        ct._placements(T(), "w")
    assert "`w`" in str(e.value) and "_StridedShard" in str(e.value)
    T.placements = (_StridedShard(0, split_factor=2), Shard(0))
    assert ct._placements(T(), "w") == [(0, 1), (0, 0)]
