"""ckpt without torch: open, load (whole, per target rank, zero-copy views), merge,
reshard, verify, compress, errors and the `ckpt` command."""

import mmap
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ckpt
from conftest import chunk


def _bases(a):
    """The chain of objects owning an array's memory: array bases, then the object a
    memoryview exports (numpy wraps buffers in one)."""
    while a is not None:
        yield a
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)


def sliced(tmp_path, orig_dir, n=4, name="s"):
    """The originals split over n ranks along dim 0 (uneven: 37 rows, 3 rows, 5)."""
    out = tmp_path / name
    # Every tensor but the 0-d `step` split along dim 0 (`step` is replicated).
    r = ckpt.reshard(orig_dir, out, to=n, shard=[("*.*", 0), ("few", 0), ("mask", 0)])
    assert r.files == n and r.output == str(out)
    return out


def test_open_reports_format_kind_and_tensors(originals):
    d, t = originals
    ck = ckpt.open(d)
    assert ck.format == "safetensors"
    assert ck.kind == "integrated"
    assert set(ck.tensors) == set(t)
    for k, v in t.items():
        info = ck.tensors[k]
        assert info.shape == v.shape, k
        assert len(info.pieces) == 1
    assert ck.tensors["embed.weight"].dtype == "F32"
    assert "integrated checkpoint" in ck.inspect()


def test_load_whole_is_zero_copy_and_byte_equal(originals):
    d, t = originals
    got = ckpt.load(d)
    assert set(got) == set(t)
    for k, v in t.items():
        a = got[k]
        assert a.dtype == v.dtype and a.shape == v.shape, k
        assert a.tobytes() == v.tobytes(), k
        # One run of an uncompressed file: a view of the mapping, no copy.
        assert any(isinstance(b, mmap.mmap) for b in _bases(a)), k
    # Copy-on-write: writable, and the file keeps its bytes.
    got["embed.weight"][0, 0] = 123.0
    again = ckpt.load(d, names=["embed.weight"])
    assert again["embed.weight"].tobytes() == t["embed.weight"].tobytes()


def test_pieces_equal_torch_chunk_slices(tmp_path, originals):
    d, t = originals
    s4 = sliced(tmp_path, d, 4)
    ck = ckpt.open(s4)
    assert ck.kind == "sliced" and ck.mesh is not None
    for n in (4, 2, 3):
        for r in range(n):
            got = ckpt.load(s4, rank=r, to=n)
            for k, v in t.items():
                want = v if v.ndim == 0 else v[chunk(v.shape[0], n, r)]
                if k not in got:
                    # Empty pieces are still returned, with their (empty) shape.
                    pytest.fail(f"{k} missing for rank {r} of {n}")
                assert got[k].shape == want.shape, (k, n, r)
                assert got[k].tobytes() == want.tobytes(), (k, n, r)


def test_empty_piece_and_contiguous_piece_is_a_view(tmp_path, originals):
    d, t = originals
    s4 = sliced(tmp_path, d, 4)
    # 3 rows over 4 ranks: rank 3 holds nothing.
    got = ckpt.load(s4, rank=3)
    assert got["few"].shape == (0, 4)
    # Rank 1 of 2 from 4: rows of two source files -> assembled; rank 1 of 4 (the
    # source's own layout) is one run of ckpt_1's file -> a view.
    own = ckpt.load(s4, rank=1, names=["embed.weight"])["embed.weight"]
    assert any(isinstance(b, mmap.mmap) for b in _bases(own))
    two = ckpt.load(s4, rank=1, to=2, names=["embed.weight"])["embed.weight"]
    assert not any(isinstance(b, mmap.mmap) for b in _bases(two))
    assert two.tobytes() == t["embed.weight"][19:].tobytes()


def test_bf16_is_uint16_bit_patterns(tmp_path):
    # BF16 bit patterns of 1.0, -2.0, 0.5 (the high halves of their F32 patterns).
    bits = (np.array([1.0, -2.0, 0.5], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    d = tmp_path / "bf"
    d.mkdir()
    # safetensors.numpy has no bfloat16: write the header by hand around the bytes.
    import json
    import struct

    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    header += b" " * (-len(header) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bits.tobytes())
    got = ckpt.load(d)["w"]
    assert got.dtype == np.uint16 and got.tobytes() == bits.tobytes()


def test_merge_reshard_roundtrip_and_reports(tmp_path, originals):
    from safetensors.numpy import load_file

    d, t = originals
    s4 = sliced(tmp_path, d, 4)
    r3 = tmp_path / "r3"
    rep = ckpt.reshard(s4, r3, to=3)
    assert rep.files == 3 and rep.tensors == len(t)
    m = tmp_path / "m"
    rep = ckpt.merge(r3, m)
    assert rep.bytes_written == sum(v.nbytes for v in t.values())
    assert rep.seconds >= 0
    back = load_file(str(m / "model.safetensors"))
    assert {k: v.tobytes() for k, v in back.items()} == {k: v.tobytes() for k, v in t.items()}
    with pytest.raises(ckpt.OutputExists):
        ckpt.merge(r3, m)
    v = ckpt.verify(r3)
    assert v.files == 3 and v.tensors == len(t) and v.checksums > 0


def test_compress_decompress_and_load_compressed(tmp_path, originals):
    d, t = originals
    m = tmp_path / "m"
    ckpt.merge(d, m)  # a file ckpt wrote: decompressing gives it back byte for byte
    z = tmp_path / "z"
    rep = ckpt.compress(m, z, level=3)
    assert rep.files == 1 and rep.raw_bytes == sum(v.nbytes for v in t.values())
    got = ckpt.load(z)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in t.items()}
    back = tmp_path / "back"
    ckpt.decompress(z, back)
    assert (back / "model.safetensors").read_bytes() == (m / "model.safetensors").read_bytes()


def test_missing_rank_is_missing_data(tmp_path, originals):
    d, _ = originals
    s4 = sliced(tmp_path, d, 4)
    shutil.rmtree(s4 / "ckpt_2")
    with pytest.raises(ckpt.MissingData) as e:
        ckpt.load(s4)
    assert "rank 2 of 4 is missing" in str(e.value)
    with pytest.raises(ckpt.MissingData):
        ckpt.verify(s4)


def damage(path):
    """Flips one byte of the last tensor's data (the end of the file)."""
    b = bytearray(path.read_bytes())
    b[-1] ^= 0xFF
    path.write_bytes(bytes(b))


def test_checksum_mismatch(tmp_path, originals):
    d, _ = originals
    s4 = sliced(tmp_path, d, 4)
    damage(s4 / "ckpt_0" / "model.safetensors")
    with pytest.raises(ckpt.ChecksumMismatch) as e:
        ckpt.load(s4, rank=0)
    assert "ckpt_0" in str(e.value) and "checksum mismatch" in str(e.value)
    with pytest.raises(ckpt.ChecksumMismatch):
        ckpt.verify(s4)
    assert isinstance(e.value, ckpt.CheckpointError)


def test_errors_pickle_with_class_and_message():
    for cls in (ckpt.MissingData, ckpt.ChecksumMismatch, ckpt.AmbiguousInput, ckpt.UsageError):
        e = cls("tensor `w`: elements [0..2] are missing")
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and str(back) == str(e)


def test_usage_errors(tmp_path, originals):
    d, _ = originals
    with pytest.raises(ckpt.UsageError):
        ckpt.load(d, to=2)  # a target without a rank
    with pytest.raises(ckpt.UsageError):
        ckpt.load(d, rank=0)  # an integrated checkpoint has no layout of its own
    with pytest.raises(ckpt.UsageError):
        ckpt.load(d, framework="jax")
    with pytest.raises(ckpt.MissingData):
        ckpt.load(d, names=["nope"])
    with pytest.raises(ckpt.MissingData):
        ckpt.open(tmp_path / "does-not-exist")


def test_mindspore_fixture_loads_whole(fixtures):
    ms = fixtures / "mindspore"
    # MindSpore's own per-rank .ckpt files and strategy, against the whole tensors its
    # script wrote (read by ckpt too: BF16 has no numpy type for safetensors.numpy).
    got = ckpt.load(ms / "ckpt_fmt", source_strategy=ms / "strategy.ckpt")
    truth = ckpt.load(ms / "full.safetensors")
    assert set(got) == set(truth) and len(got) == 7
    for k in truth:
        assert got[k].shape == truth[k].shape, k
        assert got[k].tobytes() == truth[k].tobytes(), k


def test_console_script_is_the_cli(tmp_path, originals):
    d, _ = originals
    exe = shutil.which("ckpt", path=os.path.dirname(sys.executable))
    assert exe, "pip install should put the ckpt command beside python"
    ok = subprocess.run([exe, "verify", str(d)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok
    bad = subprocess.run([exe, "verify", str(tmp_path / "none")], capture_output=True, text=True)
    assert bad.returncode == 1, bad
    usage = subprocess.run([exe, "merge", str(d)], capture_output=True, text=True)
    assert usage.returncode == 2, usage


def _tree(root):
    return {
        p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_every_cli_format_is_taken_and_writes_what_the_cli_writes(tmp_path, fixtures):
    """The package takes the formats by the CLI's own name table: DeepSpeed's universal
    checkpoint (merge) and ZeRO for another dp size (reshard), the same bytes as the
    console script writes."""
    exe = shutil.which("ckpt", path=os.path.dirname(sys.executable))
    assert exe, "pip install should put the ckpt command beside python"
    zero3 = fixtures / "deepspeed" / "zero3_fp32" / "ckpt"
    zero2 = fixtures / "deepspeed" / "zero2_fp16" / "ckpt"
    ckpt.merge(zero3, tmp_path / "u", format="ucp")
    ckpt.reshard(zero2, tmp_path / "z", to=3, format="deepspeed")
    for args in (
        ["merge", str(zero3), "--format", "ucp", "-o", str(tmp_path / "u-cli")],
        ["reshard", str(zero2), "--to", "3", "--format", "deepspeed", "-o", str(tmp_path / "z-cli")],
    ):
        r = subprocess.run([exe, *args], capture_output=True, text=True)
        assert r.returncode == 0, r
    for name in ("u", "z"):
        mine, cli = _tree(tmp_path / name), _tree(tmp_path / f"{name}-cli")
        assert mine and mine == cli, name
    with pytest.raises(ckpt.UsageError, match="ucp"):
        ckpt.merge(zero3, tmp_path / "x", format="nope")


def test_deepspeed_experts_reshard_to_another_ep_size(tmp_path, fixtures):
    """ckpt.reshard of DeepSpeed's own MoE checkpoint (EP2, ZeRO-2) to EP4 on 4 ranks
    and EP1 on 2: the same bytes as the console script writes, and merged back, the
    source's every weight and moment."""
    from safetensors.numpy import load_file

    src = fixtures / "moe" / "deepspeed" / "ep2_zero2" / "ckpt"
    exe = shutil.which("ckpt", path=os.path.dirname(sys.executable))
    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    ckpt.merge(src, tmp_path / "src-merged")
    want = tensors(tmp_path / "src-merged")
    assert any(".exp_avg" in k for k in want), sorted(want)[:4]
    for mesh in ("dp=4,ep=4", "dp=2,ep=1"):
        out = tmp_path / mesh.replace("=", "").replace(",", "-")
        ckpt.reshard(src, out, mesh=mesh, format="deepspeed")
        cli = tmp_path / f"{out.name}-cli"
        r = subprocess.run([exe, "reshard", str(src), "--mesh", mesh, "--format", "deepspeed",
                            "-o", str(cli)], capture_output=True, text=True)
        assert r.returncode == 0, r
        assert _tree(out) == _tree(cli), mesh
        ckpt.merge(out, tmp_path / f"{out.name}-merged")
        got = tensors(tmp_path / f"{out.name}-merged")
        assert sorted(got) == sorted(want), mesh
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (mesh, k)
    with pytest.raises(ckpt.CheckpointError, match="must divide"):
        ckpt.reshard(src, tmp_path / "x", mesh="dp=3,ep=2", format="deepspeed")
    assert not (tmp_path / "x").exists()


def test_megatron_experts_reshard_keeps_or_changes_the_expert_tp(tmp_path, fixtures):
    """ckpt.reshard of megatron-core's MoE save with expert TP 1 under TP 2 to Megatron's
    layout: by default the experts stay whole (the save's two directories), with
    ``etp=2`` they are split like the dense layers (four); each as the console script
    writes it, and merged back, the model's every tensor."""
    from safetensors.numpy import load_file

    case = fixtures / "moe" / "megatron" / "ep2tp2etp1"
    src = case / "legacy"
    exe = shutil.which("ckpt", path=os.path.dirname(sys.executable))
    want = load_file(str(case / "reference.safetensors"))
    for mesh, dirs in (("ep=2,tp=2", 2), ("ep=2,tp=2,etp=2", 4)):
        out = tmp_path / mesh.replace("=", "").replace(",", "-")
        ckpt.reshard(src, out, mesh=mesh, format="megatron")
        assert len(list((out / "iter_0000001").iterdir())) == dirs, mesh
        cli = tmp_path / f"{out.name}-cli"
        r = subprocess.run([exe, "reshard", str(src), "--mesh", mesh, "--format", "megatron",
                            "-o", str(cli)], capture_output=True, text=True)
        assert r.returncode == 0, r
        assert _tree(out) == _tree(cli), mesh
        ckpt.merge(out, tmp_path / f"{out.name}-merged", keep_vocab_padding=True)
        got = load_file(str(tmp_path / f"{out.name}-merged" / "model.safetensors"))
        assert sorted(got) == sorted(want), mesh
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (mesh, k)
    with pytest.raises(ckpt.CheckpointError, match="etp=4"):
        ckpt.reshard(src, tmp_path / "x", mesh="ep=2,tp=2,etp=4", format="megatron")
    assert not (tmp_path / "x").exists()


def test_megatron_merge_views_match_the_console_script(tmp_path, fixtures):
    """ckpt.merge of megatron-core's legacy save gives the same bytes as `ckpt merge`:
    vocabulary padding dropped by default (kept on request), fused QKV split on
    request into linear_q/k/v whose rows add up to the fused projection's."""
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.numpy import load_file

    legacy = fixtures / "megatron" / "tp2pp2" / "legacy"
    exe = shutil.which("ckpt", path=os.path.dirname(sys.executable))
    assert exe, "the package's console script `ckpt` is not beside the interpreter"
    for opts, flags in [({}, []), ({"split_qkv": True}, ["--split-qkv"]),
                        ({"keep_vocab_padding": True}, ["--keep-vocab-padding"])]:
        ours, cli = tmp_path / f"py{len(flags)}{opts}", tmp_path / f"cli{len(flags)}{opts}"
        ckpt.merge(legacy, ours, **opts)
        subprocess.run([exe, "merge", str(legacy), "-o", str(cli), *flags], check=True,
                       capture_output=True)
        a, b = (load_file(str(p / "model.safetensors")) for p in (ours, cli))
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
        rows = a["embedding.word_embeddings.weight"].shape[0]
        assert rows == (64 if "keep_vocab_padding" in opts else 50)
        if "split_qkv" in opts:
            q, k, v = (a[f"decoder.layers.0.self_attention.linear_{p}.weight"] for p in "qkv")
            assert "decoder.layers.0.self_attention.linear_qkv.weight" not in a
            assert q.shape[0] + k.shape[0] + v.shape[0] == 32 and k.shape == v.shape
