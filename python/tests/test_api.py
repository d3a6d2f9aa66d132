"""The Python API as code written for the standard library, safetensors and
torch.distributed.checkpoint expects it: standard exception bases, `safe_open` with
safetensors' methods over every format ckpt reads, the tensor iterator, `dtype=`."""

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open as st_open
from safetensors.numpy import save_file

import ckpt
from conftest import chunk


# -- exceptions ----------------------------------------------------------------------


def test_a_missing_path_is_a_file_not_found_error(tmp_path, originals):
    d, _ = originals
    nope = tmp_path / "does-not-exist"
    calls = [
        lambda: ckpt.open(nope),
        lambda: ckpt.load(nope),
        lambda: ckpt.verify(nope),
        lambda: ckpt.merge(nope, tmp_path / "m"),
        lambda: ckpt.reshard(nope, tmp_path / "r", to=2),
        lambda: ckpt.compress(nope, tmp_path / "z"),
        lambda: ckpt.safe_open(nope),
    ]
    for call in calls:
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert isinstance(e.value, ckpt.PathNotFound)
        assert isinstance(e.value, ckpt.MissingData) and isinstance(e.value, ckpt.CheckpointError)
        assert e.value.errno == errno.ENOENT and e.value.filename == str(nope)
        assert str(e.value) == f"{nope}: no such file or directory"
    assert not (tmp_path / "m").exists() and not (tmp_path / "r").exists()


def test_a_shard_missing_from_an_index_is_a_file_not_found_error(tmp_path, originals):
    d, t = originals
    m = tmp_path / "m"
    ckpt.merge(d, m, max_shard_size=800)
    index = json.loads((m / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.remove(m / shard)
    with pytest.raises(FileNotFoundError) as e:
        ckpt.load(m)
    assert isinstance(e.value, ckpt.PathNotFound) and shard in str(e.value)


def test_usage_errors_are_value_errors(originals):
    d, _ = originals
    for call in (
        lambda: ckpt.load(d, framework="jax"),
        lambda: ckpt.load(d, to=2),
        lambda: ckpt.load(d, dtype="complex-ish"),
        lambda: ckpt.reshard(d, "x", to=0),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert isinstance(e.value, ckpt.UsageError)


def test_every_error_class_pickles_with_its_bases():
    for cls in (
        ckpt.CheckpointError,
        ckpt.MissingData,
        ckpt.ChecksumMismatch,
        ckpt.AmbiguousInput,
        ckpt.UsageError,
        ckpt.InvalidInput,
        ckpt.Mismatch,
        ckpt.Unsupported,
        ckpt.OutputExists,
        ckpt.PathNotFound,
    ):
        e = cls("tensor `w`: a problem")
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and str(back) == str(e) and back.message == e.message
    e = ckpt.PathNotFound("x: no such file or directory", "x")
    back = pickle.loads(pickle.dumps(e))
    assert back.filename == "x" and back.errno == errno.ENOENT and isinstance(back, FileNotFoundError)
    assert issubclass(ckpt.UsageError, ValueError) and issubclass(ckpt.OutputExists, FileExistsError)


# -- safe_open -----------------------------------------------------------------------


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


INDEXES = [
    (slice(None),),
    (slice(2, 9),),
    (3,),
    (-1,),
    (slice(1, 8, 3),),
    (Ellipsis, slice(1, 3)),
    (slice(0, 0),),
    (slice(5, 100),),
    (2, slice(None)),
]


def test_safe_open_agrees_with_safetensors_on_a_safetensors_file(tmp_path, originals):
    d, t = originals
    f = d / "model.safetensors"
    with_meta = tmp_path / "meta.safetensors"
    save_file(t, str(with_meta), metadata={"format": "np", "note": "hello"})
    for path in (f, with_meta):
        with st_open(str(path), "np") as ref, ckpt.safe_open(path, framework="np") as got:
            assert got.keys() == ref.keys()
            assert got.metadata() == ref.metadata()
            for k in ref.keys():
                assert same(got.get_tensor(k), ref.get_tensor(k)), k
                rs, gs = ref.get_slice(k), got.get_slice(k)
                assert gs.get_shape() == rs.get_shape(), k
                assert gs.get_dtype() == rs.get_dtype(), k
                if not rs.get_shape():
                    continue
                for idx in INDEXES:
                    if len(idx) > len(rs.get_shape()):
                        continue
                    try:
                        want = rs[idx]
                    except Exception:  # noqa: BLE001 (an index safetensors refuses)
                        continue
                    assert same(gs[idx], want), (k, idx)


def test_safe_open_torch_agrees_with_safetensors(fixtures):
    torch = pytest.importorskip("torch")
    f = fixtures / "torch" / "full.safetensors"
    with st_open(str(f), "pt", device="cpu") as ref, ckpt.safe_open(f, framework="pt", device="cpu") as got:
        assert got.keys() == ref.keys() and got.metadata() == ref.metadata()
        for k in ref.keys():
            a, b = got.get_tensor(k), ref.get_tensor(k)
            assert a.dtype == b.dtype and torch.equal(a, b), k
            rs, gs = ref.get_slice(k), got.get_slice(k)
            assert gs.get_shape() == rs.get_shape() and gs.get_dtype() == rs.get_dtype()
            if rs.get_shape():
                assert torch.equal(gs[1:], rs[1:]), k
                assert torch.equal(gs[0], rs[0]), k
                assert torch.equal(gs[...], rs[...]), k


def sliced(tmp_path, orig_dir, n):
    out = tmp_path / f"s{n}"
    ckpt.reshard(orig_dir, out, to=n, shard=[("*.*", 0), ("few", 0), ("mask", 0)])
    return out


def test_safe_open_on_sliced_dcp_and_compressed_gives_what_load_gives(tmp_path, originals, fixtures):
    d, t = originals
    s4 = sliced(tmp_path, d, 4)
    z = tmp_path / "z"
    m = tmp_path / "m"
    ckpt.merge(d, m, max_shard_size=900)
    ckpt.compress(m, z)
    dcp = tmp_path / "dcp"
    ckpt.reshard(d, dcp, to=2, format="distcp", shard=[("*.*", 0)])
    sources = [s4, m, z, dcp, fixtures / "torch" / "dcp_mesh", fixtures / "torch" / "ddp.pth"]
    for src in sources:
        whole = ckpt.load(src)
        with ckpt.safe_open(src, framework="numpy") as f:
            assert f.keys() == sorted(whole), src
            for k in f.keys():
                assert same(f.get_tensor(k), whole[k]), (src, k)
                sl = f.get_slice(k)
                assert sl.get_shape() == list(whole[k].shape)
                if whole[k].ndim:
                    n = whole[k].shape[0]
                    # A box that crosses the ranks' pieces, reading only its bytes.
                    lo, hi = n // 3, max(n // 3 + 1, n - 1)
                    assert same(sl[lo:hi], whole[k][lo:hi]), (src, k)
                    assert same(sl[n - 1], whole[k][n - 1]), (src, k)
        # The iterator: every tensor once, in keys() order, the same bytes.
        names = []
        for name, a in ckpt.iter_tensors(src):
            names.append(name)
            assert same(a, whole[name]), (src, name)
        assert names == sorted(whole)
    # Slices of the sliced checkpoint equal the originals' rows, rank by rank.
    with ckpt.safe_open(s4, framework="np") as f:
        for r in range(4):
            sl = chunk(37, 4, r)
            assert same(f.get_slice("embed.weight")[sl], t["embed.weight"][sl])


def test_safe_open_refusals(originals):
    d, _ = originals
    with ckpt.safe_open(d, framework="np") as f:
        with pytest.raises(ckpt.MissingData):
            f.get_tensor("nope")
        with pytest.raises(IndexError):
            f.get_slice("few")[3]
        with pytest.raises(IndexError):
            f.get_slice("few")[0, 0, 0]
        with pytest.raises(ValueError):
            f.get_slice("few")[::-1]
        assert "few" in f and len(f) == 7
    with pytest.raises(ValueError):
        ckpt.safe_open(d, framework="jax")


def test_load_dtype_converts_floats_only(tmp_path, originals):
    d, t = originals
    got = ckpt.load(d, dtype="f64")
    for k, v in t.items():
        if v.dtype.kind == "f":
            assert got[k].dtype == np.float64 and np.array_equal(got[k], v.astype(np.float64)), k
        else:
            assert same(got[k], v), k
    # Per rank, from a sliced checkpoint, too; and through safe_open.
    s2 = sliced(tmp_path, d, 2)
    half = ckpt.load(s2, rank=1, dtype="float16")
    assert half["embed.weight"].dtype == np.float16
    assert np.array_equal(half["embed.weight"], t["embed.weight"][chunk(37, 2, 1)].astype(np.float16))
    with ckpt.safe_open(s2, framework="np", dtype="f64") as f:
        assert f.get_tensor("few").dtype == np.float64
        assert np.array_equal(f.get_slice("few")[1:], t["few"][1:].astype(np.float64))
        assert f.get_tensor("proj.weight").dtype == np.int32


def test_load_dtype_torch(fixtures):
    torch = pytest.importorskip("torch")
    f = fixtures / "torch" / "full.safetensors"
    got = ckpt.load(f, framework="torch", dtype=torch.bfloat16)
    whole = ckpt.load(f, framework="torch")
    for k, v in whole.items():
        if v.is_floating_point():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
        else:
            assert torch.equal(got[k], v), k


# -- the rest of the surface -----------------------------------------------------------


def test_inspect_is_in_process_and_says_what_the_command_says(tmp_path, originals, monkeypatch):
    import subprocess
    import sys

    d, _ = originals
    s2 = sliced(tmp_path, d, 2)
    for src in (d, s2):
        cli = subprocess.run(
            [sys.executable, "-m", "ckpt", "inspect", str(src)], capture_output=True, text=True
        )
        assert cli.returncode == 0, cli.stderr
        # No process is started for it.
        monkeypatch.setattr(subprocess, "run", None)
        monkeypatch.setattr(subprocess, "Popen", None)
        ck = ckpt.open_checkpoint(src)
        assert ck.inspect() == cli.stdout
        doc = ck.inspect(json=True)
        assert isinstance(doc, dict) and doc
        monkeypatch.undo()


def test_star_import_leaves_the_builtin_open_alone():
    import builtins

    ns = {}
    exec("from ckpt import *", ns)
    assert "open" not in ns and "open_checkpoint" in ns and "safe_open" in ns
    assert ckpt.open is ckpt.open_checkpoint
    assert "open" not in ckpt.__all__
    ns3 = {"__builtins__": builtins}
    exec("from ckpt import *\nresult = open", ns3)
    assert ns3["result"] is builtins.open


def test_merge_and_reshard_have_typed_signatures():
    import inspect

    for fn, names in (
        (ckpt.merge, {"max_shard_size", "dtype", "include", "exclude", "format", "one_file", "checksums"}),
        (ckpt.reshard, {"to", "mesh", "strategy", "rank", "format", "shard", "keep_all", "checksums"}),
    ):
        params = inspect.signature(fn).parameters
        assert names <= set(params), fn
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), fn
    # The native stubs say the same.
    stub = (Path(ckpt.__file__).parent / "_ckpt.pyi").read_text()
    assert "**opts" not in stub
    with pytest.raises(TypeError):
        ckpt.merge("x", "y", no_such_option=1)
