"""Shared helpers of the ckpt Python tests: the repository's fixtures (written by the
real torch and MindSpore, see tests/fixtures/*/README.md) and small builders."""

import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


def chunk(n: int, k: int, i: int):
    """torch.chunk(n, k)'s i-th piece as a slice: pieces of ceil(n/k), trailing ones
    shorter or empty (written out so the numpy tests need no torch)."""
    size = -(-n // k)
    lo = min(i * size, n)
    return slice(lo, min(lo + size, n))


@pytest.fixture
def fixtures() -> pathlib.Path:
    return FIXTURES


@pytest.fixture
def originals(tmp_path):
    """An integrated safetensors checkpoint written by the safetensors library:
    every dtype numpy has, BF16 bit patterns, uneven and tiny shapes, a 0-d tensor."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(25)
    t = {
        "embed.weight": rng.standard_normal((37, 12)).astype(np.float32),
        "qkv.weight": rng.standard_normal((18, 12)).astype(np.float16),
        "proj.weight": rng.integers(-1000, 1000, (12, 7)).astype(np.int32),
        "norm.weight": rng.standard_normal((12,)).astype(np.float64),
        "few": rng.standard_normal((3, 4)).astype(np.float32),
        "mask": rng.integers(0, 255, (5, 3, 4)).astype(np.uint8),
        "step": np.array(42, dtype=np.int64),
    }
    d = tmp_path / "orig"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    return d, t
