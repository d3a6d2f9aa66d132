"""ckpt with real torch: torch dtypes, load_state_dict from checkpoints written by torch
(dcp.save, torch.save), MindSpore and ckpt, refusals that leave the state dict as it
was, and gloo processes saving DTensors on 4 ranks and loading them on 2."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

import ckpt  # noqa: E402
import ckpt.torch  # noqa: E402

HERE = Path(__file__).resolve().parent


def zeros_like(truth):
    return {k: torch.zeros_like(v) for k, v in truth.items()}


def assert_equal_bytes(sd, truth):
    assert set(sd) == set(truth)
    for k, v in truth.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape, k
        a = sd[k].contiguous().reshape(-1).view(torch.uint8)
        b = v.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), k


def test_load_gives_torch_dtypes(fixtures):
    f = fixtures / "torch" / "full.safetensors"
    got = ckpt.load(f, framework="torch")
    assert got["layer.q.weight"].dtype == torch.bfloat16
    assert_equal_bytes(got, load_file(str(f)))
    assert ckpt.torch.load(f)["scale"].shape == ()


def test_pieces_equal_torch_chunk(tmp_path, fixtures):
    truth = load_file(str(fixtures / "torch" / "full.safetensors"))
    s = tmp_path / "s"
    ckpt.reshard(fixtures / "torch" / "full.safetensors", s, to=4, shard=[("*.*", 0), ("counts", 0)])
    for n in (4, 3):
        for r in range(n):
            got = ckpt.load(s, rank=r, to=n, framework="torch")
            for k, v in truth.items():
                # torch.chunk returns fewer pieces when the trailing ones would be empty.
                pieces = torch.chunk(v, n) if v.dim() else None
                want = v if v.dim() == 0 else pieces[r] if r < len(pieces) else v[v.shape[0]:]
                assert got[k].shape == want.shape, (k, n, r)
                assert torch.equal(got[k], want), (k, n, r)


def test_load_state_dict_from_dcp_save(fixtures):
    t = fixtures / "torch"
    truth = load_file(str(t / "dcp_mesh_full.safetensors"))
    sd = zeros_like(truth)
    assert ckpt.torch.load_state_dict(sd, t / "dcp_mesh") is sd
    assert_equal_bytes(sd, truth)
    truth2 = load_file(str(t / "full.safetensors"))
    sd2 = zeros_like(truth2)
    ckpt.torch.load_state_dict(sd2, t / "dcp")
    assert_equal_bytes(sd2, truth2)


def test_load_state_dict_from_mindspore(fixtures):
    ms = fixtures / "mindspore"
    truth = load_file(str(ms / "full.safetensors"))
    sd = zeros_like(truth)
    ckpt.torch.load_state_dict(sd, ms / "ckpt_fmt", source_strategy=ms / "strategy.ckpt")
    assert_equal_bytes(sd, truth)


def test_load_state_dict_from_ddp_pth(fixtures):
    t = fixtures / "torch"
    truth = {
        k[len("module."):]: v
        for k, v in load_file(str(t / "full_torch_save.safetensors")).items()
        if k.startswith("module.")
    }
    assert len(truth) >= 6
    sd = zeros_like(truth)
    ckpt.torch.load_state_dict(sd, t / "ddp.pth", strip_prefix="module.")
    assert_equal_bytes(sd, truth)


def test_load_state_dict_from_merged_safetensors(tmp_path, fixtures):
    t = fixtures / "torch"
    truth = load_file(str(t / "dcp_mesh_full.safetensors"))
    ckpt.merge(t / "dcp_mesh", tmp_path / "m", one_file=True)
    sd = zeros_like(truth)
    ckpt.torch.load_state_dict(sd, tmp_path / "m")
    assert_equal_bytes(sd, truth)


def test_non_contiguous_and_cast_destinations(fixtures):
    f = fixtures / "torch" / "full.safetensors"
    truth = load_file(str(f))
    w = truth["embed.weight"]
    sd = {
        "embed.weight": torch.zeros(w.shape[1], w.shape[0]).t(),  # a transposed view
        "layer.norm.weight": torch.zeros(truth["layer.norm.weight"].shape, dtype=torch.float64),
    }
    ckpt.torch.load_state_dict(sd, f)
    assert torch.equal(sd["embed.weight"], w)
    assert torch.equal(sd["layer.norm.weight"], truth["layer.norm.weight"].double())


def snapshot(sd):
    return {k: v.clone() for k, v in sd.items()}


@pytest.fixture
def sliced2(tmp_path, fixtures):
    f = fixtures / "torch" / "full.safetensors"
    s = tmp_path / "s2"
    ckpt.reshard(f, s, to=2, shard=[("*.*", 0), ("counts", 0)])
    truth = load_file(str(f))
    sd = {k: torch.full_like(v, 3) for k, v in truth.items()}
    return s, sd


def test_refusals_leave_the_state_dict_unchanged(sliced2):
    s, sd = sliced2
    before = snapshot(sd)

    extra = dict(sd, nope=torch.zeros(2))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.torch.load_state_dict(extra, s)
    assert "`nope`" in str(e.value)
    assert_equal_bytes(sd, before)

    wrong = dict(sd, **{"embed.weight": torch.zeros(8, 7)})
    with pytest.raises(ckpt.Mismatch) as e:
        ckpt.torch.load_state_dict(wrong, s)
    assert "[8, 6]" in str(e.value) and "[8, 7]" in str(e.value) and "embed.weight" in str(e.value)
    assert_equal_bytes(sd, before)


def test_checksum_mismatch_leaves_the_state_dict_unchanged(sliced2):
    s, sd = sliced2
    before = snapshot(sd)
    p = s / "ckpt_1" / "model.safetensors"
    b = bytearray(p.read_bytes())
    b[-1] ^= 0xFF
    p.write_bytes(bytes(b))
    with pytest.raises(ckpt.ChecksumMismatch):
        ckpt.torch.load_state_dict(sd, s)
    assert_equal_bytes(sd, before)


def test_missing_rank_leaves_the_state_dict_unchanged(sliced2):
    s, sd = sliced2
    before = snapshot(sd)
    shutil.rmtree(s / "ckpt_1")
    with pytest.raises(ckpt.MissingData):
        ckpt.torch.load_state_dict(sd, s)
    assert_equal_bytes(sd, before)


def test_save_state_dict_single_process(tmp_path, fixtures):
    truth = load_file(str(fixtures / "torch" / "full.safetensors"))
    out = tmp_path / "saved"
    assert ckpt.torch.save_state_dict(truth, out) == str(out)
    assert ckpt.open(out).kind == "sliced"
    back = zeros_like(truth)
    ckpt.torch.load_state_dict(back, out)
    assert_equal_bytes(back, truth)
    with pytest.raises(ckpt.OutputExists):
        ckpt.torch.save_state_dict(truth, out)
    # Nothing but the checkpoint is left beside it.
    assert sorted(os.listdir(tmp_path)) == ["saved"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n, mode, *dirs, **env):
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(HERE),
            **env,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "dist_worker.py"), mode, *map(str, dirs)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {n} ({mode}) failed:\n{o}"


def test_gloo_save_4_reshard_to_2_and_load(tmp_path):
    pytest.importorskip("torch.distributed.tensor")
    saved, bg = tmp_path / "saved4", tmp_path / "bg4"
    run_ranks(4, "save", saved, bg)
    ck = ckpt.open(saved)
    assert ck.kind == "sliced" and ck.mesh == "dp=2,tp=2"
    assert ck.tensors["nested"].placements == ("Shard(0)", "Shard(0)")
    assert ck.tensors["bias"].placements == ("Replicate", "Replicate")
    # No staging directory is left beside the committed checkpoints.
    assert sorted(os.listdir(tmp_path)) == ["bg4", "saved4"]
    r2 = tmp_path / "r2"
    ckpt.reshard(saved, r2, to=2)
    # 2 ranks from the resharded checkpoint, straight from the 4-rank save (the pieces
    # cut at load time, no reshard step), and from the background save (the workers
    # zeroed their tensors as soon as it returned).
    run_ranks(2, "load", r2, saved, bg)


def test_gloo_resume_on_2_ranks_matches_an_uninterrupted_run(tmp_path):
    """4 ranks train and save; 2 ranks resume from the resharded checkpoint and straight
    from the 4-rank one, and the next steps' losses equal, bit for bit, those of a 2-rank
    run from the same state handed over in memory (a torch.save of the full tensors)."""
    pytest.importorskip("torch.distributed.tensor")
    saved, ref = tmp_path / "run4", tmp_path / "state.pt"
    run_ranks(4, "train", saved, ref)
    r2 = tmp_path / "r2"
    ckpt.reshard(saved, r2, to=2)
    losses = tmp_path / "losses.txt"
    run_ranks(2, "resume", losses, ref, r2, saved)
    uninterrupted, from_resharded, from_4 = losses.read_text().splitlines()
    assert len(uninterrupted.split()) == 3
    assert from_resharded == uninterrupted
    assert from_4 == uninterrupted
