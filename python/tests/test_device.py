"""The pipeline of device loads (ckpt/_device.py), run on the CPU: chunks assembled into
a few reused buffers and copied out, here by HostCopier in place of the CUDA copies.
What it proves: every tensor (whole, or a rank's slice) arrives byte for byte through
buffers of the size asked for, and the host memory a load adds stays bounded. The GPU
copies themselves run only in scripts/gpu_check.sh, on a GPU machine."""

import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt
from ckpt import _device
from ckpt._device import HostCopier, Staging


def _plan(path, rank=None, to=None):
    ck = ckpt.Checkpoint(path)
    return ck, ck._native.plan(None, rank, to, None, None, None)


def _through_buffers(plan, chunk_bytes, streams):
    dests = {}
    names = {}
    tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
           "BOOL": torch.bool, "I8": torch.int8, "I16": torch.int16}
    for i, (name, dt, shape, _view) in enumerate(plan.entries()):
        dests[i] = torch.full(shape, 7, dtype=tdt[dt]) if dt != "BOOL" else torch.zeros(shape, dtype=torch.bool)
        names[i] = name
    copier = HostCopier()
    _device.fill_through_buffers(plan, dests, Staging(chunk_bytes, streams), copier)
    return {names[i]: t for i, t in dests.items()}, copier


def _same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("chunk_bytes,streams", [(64, 1), (200, 2), (4096, 3), (1 << 20, 2)])
def test_whole_tensors_arrive_through_small_buffers(fixtures, chunk_bytes, streams):
    f = fixtures / "torch" / "full.safetensors"
    truth = load_file(str(f))
    _, plan = _plan(f)
    got, copier = _through_buffers(plan, chunk_bytes, streams)
    assert set(got) == set(truth)
    for k, v in truth.items():
        assert _same_bytes(got[k], v), k
    # The buffers: `streams` of at most one chunk (one innermost row where a row is
    # larger), never the load's size.
    widest_row = max(v[..., :].reshape(-1, v.shape[-1])[0].numel() * v.element_size()
                     if v.dim() else v.element_size() for v in truth.values())
    assert copier.buffer_bytes <= streams * max(chunk_bytes, widest_row)
    total = sum(v.numel() * v.element_size() for v in truth.values())
    if chunk_bytes < total // 4:
        assert copier.buffer_bytes < total


def test_a_ranks_slice_arrives_through_small_buffers(tmp_path, fixtures):
    f = fixtures / "torch" / "full.safetensors"
    s = tmp_path / "s"
    ckpt.reshard(f, s, to=4, shard=[("*.*", 0), ("counts", 0)])
    for r in range(3):
        want = ckpt.load(s, rank=r, to=3, framework="torch")
        _, plan = _plan(s, rank=r, to=3)
        got, _ = _through_buffers(plan, 96, 2)
        for k, v in want.items():
            assert _same_bytes(got[k], v), (k, r)


def _rss_kib():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0])


def test_host_memory_added_stays_bounded(tmp_path):
    # 192 MiB of sources loaded into 192 MiB of preallocated destinations: the load
    # itself may add its buffers (2 x 8 MiB) and a window of mapped source pages, not
    # the sources (which the page cache holds, and the mapping releases as consumed).
    mib = 1 << 20
    tensors = {f"w{i}": torch.arange(24 * mib // 4, dtype=torch.float32) + i for i in range(8)}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    del tensors
    _, plan = _plan(path)
    dests = {i: torch.empty(shape, dtype=torch.float32) for i, (_, _, shape, _) in enumerate(plan.entries())}
    for t in dests.values():
        t.fill_(0)  # the destinations resident before measuring
    base = _rss_kib()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kib())
            done.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        _device.fill_through_buffers(plan, dests, Staging(8 * mib, 2), HostCopier())
    finally:
        done.set()
        sampler.join()
    added_mib = (peak[0] - base) / 1024
    assert added_mib < 96, f"the load added {added_mib:.0f} MiB for 192 MiB of sources"
    for i, t in dests.items():
        assert torch.equal(t, torch.arange(24 * mib // 4, dtype=torch.float32) + i)


def test_bad_staging_options_are_usage_errors(fixtures):
    f = fixtures / "torch" / "full.safetensors"
    with pytest.raises(ckpt.errors.UsageError, match="chunk_mb"):
        ckpt.load(f, framework="torch", chunk_mb=0)
    with pytest.raises(ckpt.errors.UsageError, match="streams"):
        ckpt.load(f, framework="torch", streams=0)
