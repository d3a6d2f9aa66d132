"""The Python API as code written for the standard library expects it: standard
exception bases."""

import errno
import json
import os
import pickle

import pytest

import ckpt


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
