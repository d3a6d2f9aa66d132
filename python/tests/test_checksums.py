"""Checksums are a setting of each call, never of the process: `checksums=False` on one
call leaves every other call (later, or running at the same time on another thread)
with its own setting."""

import threading

import numpy as np
import pytest
from safetensors import safe_open as st_open

import ckpt
from conftest import chunk  # noqa: F401 (the conftest's fixtures)


def recorded(path):
    """The checksums ckpt recorded in a safetensors file's metadata (None if none)."""
    with st_open(str(path), "np") as f:
        return (f.metadata() or {}).get("ckpt.checksums")


def damaged_copy(tmp_path, orig_dir):
    """A ckpt-written (so checksummed) copy of the originals with one data byte flipped."""
    d = tmp_path / "damaged"
    ckpt.merge(orig_dir, d, one_file=True)
    p = d / "model.safetensors"
    b = bytearray(p.read_bytes())
    b[-1] ^= 0x01
    p.write_bytes(bytes(b))
    return d


def test_merge_without_checksums_leaves_later_calls_checking(tmp_path, originals):
    d, _ = originals
    bad = damaged_copy(tmp_path, d)
    off = ckpt.merge(d, tmp_path / "off", one_file=True, checksums=False)
    assert off.checksums_verified == 0
    assert recorded(tmp_path / "off" / "model.safetensors") is None
    # The next calls check and record as if the call above had never happened.
    with pytest.raises(ckpt.ChecksumMismatch):
        ckpt.verify(bad)
    with pytest.raises(ckpt.ChecksumMismatch):
        ckpt.load(bad)
    on = ckpt.merge(d, tmp_path / "on", one_file=True)
    assert recorded(tmp_path / "on" / "model.safetensors") is not None
    ckpt.reshard(tmp_path / "on", tmp_path / "r", to=2, shard=[("*.*", 0)], checksums=False)
    with pytest.raises(ckpt.ChecksumMismatch):
        ckpt.merge(bad, tmp_path / "again", one_file=True)
    assert on.checksums_verified == 0  # the source was written by safetensors: none recorded
    assert ckpt.merge(tmp_path / "on", tmp_path / "on2").checksums_verified == 7
    # And the opposite: verify(checksums=False) does not switch them off either.
    assert ckpt.verify(bad, checksums=False).checksums == 0
    with pytest.raises(ckpt.ChecksumMismatch):
        ckpt.verify(bad)


def test_concurrent_calls_keep_their_own_setting(tmp_path, originals):
    """Two threads, one merging with checksums off and one with them on, again and
    again at the same time (the native calls release the GIL): every output of the
    first has none recorded, every one of the second has them, and a check on a
    damaged file still fails while the other thread runs without checksums."""
    d, _ = originals
    bad = damaged_copy(tmp_path, d)
    big = tmp_path / "big"
    big.mkdir()
    rng = np.random.default_rng(1)
    from safetensors.numpy import save_file

    save_file({f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(8)},
              str(big / "model.safetensors"))
    errors = []
    stop = threading.Event()

    def without():
        try:
            i = 0
            while not stop.is_set():
                out = tmp_path / f"off{i}"
                ckpt.merge(big, out, one_file=True, checksums=False)
                assert recorded(out / "model.safetensors") is None, out
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=without)
    t.start()
    try:
        for i in range(6):
            out = tmp_path / f"on{i}"
            ckpt.merge(big, out, one_file=True)
            assert recorded(out / "model.safetensors") is not None, out
            with pytest.raises(ckpt.ChecksumMismatch):
                ckpt.verify(bad)
    finally:
        stop.set()
        t.join()
    assert not errors, errors


def test_background_save_keeps_its_setting_while_others_run(tmp_path, originals):
    torch = pytest.importorskip("torch")
    import ckpt.torch

    d, _ = originals
    bad = damaged_copy(tmp_path, d)
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.weight": torch.randn(512, 1024, generator=g) for i in range(8)}
    # A background save with checksums (the default) while this thread merges without.
    h = ckpt.torch.save_state_dict(sd, tmp_path / "bg_on", background=True)
    overlapped = 0
    i = 0
    while not h.done() or i == 0:
        overlapped += not h.done()
        ckpt.merge(d, tmp_path / f"m{i}", one_file=True, checksums=False)
        i += 1
    assert h.wait() == str(tmp_path / "bg_on")
    assert overlapped >= 1, "the merges ran while the save was writing"
    assert recorded(tmp_path / "bg_on" / "ckpt_0" / "model.safetensors") is not None
    assert ckpt.verify(tmp_path / "bg_on").checksums == len(sd)
    # A background save without checksums while this thread verifies with them.
    h = ckpt.torch.save_state_dict(sd, tmp_path / "bg_off", background=True, checksums=False)
    checked = 0
    while not h.done() or checked == 0:
        with pytest.raises(ckpt.ChecksumMismatch):
            ckpt.verify(bad)
        checked += 1
    h.wait()
    assert recorded(tmp_path / "bg_off" / "ckpt_0" / "model.safetensors") is None
    assert ckpt.verify(tmp_path / "bg_off").checksums == 0
    # And after both, a plain save records them again.
    ckpt.torch.save_state_dict(sd, tmp_path / "after")
    assert recorded(tmp_path / "after" / "ckpt_0" / "model.safetensors") is not None
