"""Checkpoints in a bucket from Python: a real S3-compatible server (moto's, started on
the loopback address) holds a sliced checkpoint; ``ckpt.load`` of a target rank, whole
loads, ``safe_open`` and ``merge``/``reshard`` to and from the bucket give what the
local copy gives. Skipped (said so) without moto."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import ckpt
from conftest import REPO

moto = pytest.importorskip("moto.server", reason="needs moto[server] (scripts/test.sh installs it)")
boto3 = pytest.importorskip("boto3")


@pytest.fixture
def bucket(monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    t = time.time()
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            break
        except OSError:
            assert time.time() - t < 60, "moto did not start"
            time.sleep(0.1)
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        # Every tensor file through the on-demand path, not downloaded whole.
        "CKPT_SMALL_OBJECT_BYTES": "512",
    }.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="ckpt-py")
    yield client
    server.kill()
    server.wait()


def put_tree(client, local, prefix):
    for root, _, files in os.walk(local):
        for f in files:
            p = os.path.join(root, f)
            client.upload_file(p, "ckpt-py", f"{prefix}/{os.path.relpath(p, local)}")


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_loads_and_copies_from_a_bucket_equal_the_local_ones(bucket, tmp_path, originals):
    d, t = originals
    src = tmp_path / "s4"
    ckpt.reshard(d, src, to=4, shard=[("*.*", 0), ("few", 0), ("mask", 0)])
    put_tree(bucket, src, "s4")
    url = "s3://ckpt-py/s4"
    whole = ckpt.load(url)
    assert sorted(whole) == sorted(t)
    for k in t:
        assert same(whole[k], t[k]), k
    for r in range(2):
        got, want = ckpt.load(url, rank=r, to=2), ckpt.load(src, rank=r, to=2)
        assert sorted(got) == sorted(want)
        for k in want:
            assert same(got[k], want[k]), (r, k)
    with ckpt.safe_open(url, framework="numpy") as f:
        assert same(f.get_slice("embed.weight")[3:20], t["embed.weight"][3:20])
    # Merge from the bucket to the bucket: the same file as the local merge.
    ckpt.merge(url, "s3://ckpt-py/merged")
    ckpt.merge(src, tmp_path / "merged")
    body = bucket.get_object(Bucket="ckpt-py", Key="merged/model.safetensors")["Body"].read()
    assert body == (tmp_path / "merged" / "model.safetensors").read_bytes()
    with pytest.raises(ckpt.errors.OutputExists):
        ckpt.merge(url, "s3://ckpt-py/merged")
    with pytest.raises(FileNotFoundError):
        ckpt.load("s3://ckpt-py/nothing")


def test_files_of_a_bucket_are_named_by_their_urls(bucket, tmp_path, originals):
    d, _ = originals
    src = tmp_path / "s2"
    ckpt.reshard(d, src, to=2, shard=[("*.*", 0), ("few", 0), ("mask", 0)])
    put_tree(bucket, src, "s2")
    c = ckpt.open_checkpoint("s3://ckpt-py/s2")
    names = sorted(os.fspath(p) for p, _, _ in c.files)
    assert names == [f"s3://ckpt-py/s2/ckpt_{r}/model.safetensors" for r in range(2)], names


def test_save_state_dict_to_a_bucket_then_reshard(bucket, tmp_path):
    """One process (world 1) saves to the bucket; the output appears whole, the local
    save of the same state dict is the same files, `load_state_dict` and
    `ckpt reshard s3://… --to 2` read it."""
    torch = pytest.importorskip("torch")
    import ckpt.torch as ct

    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": torch.tensor(7)}
    url = "s3://ckpt-py/saved"
    assert ct.save_state_dict(sd, url) == url
    ct.save_state_dict(sd, tmp_path / "local")
    keys = sorted(o["Key"] for o in bucket.list_objects_v2(Bucket="ckpt-py", Prefix="saved")["Contents"])
    want = sorted("saved/" + str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*") if p.is_file())
    assert keys == want
    for k in keys:
        body = bucket.get_object(Bucket="ckpt-py", Key=k)["Body"].read()
        assert body == (tmp_path / "local" / k[len("saved/"):]).read_bytes(), k
    got = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    ct.load_state_dict(got, url)
    assert torch.equal(got["w"], sd["w"]) and int(got["step"]) == 7
    with pytest.raises(ckpt.errors.OutputExists):
        ct.save_state_dict(sd, url)
    subprocess.run([sys.executable, "-m", "ckpt", "reshard", url, "--to", "2", "-o", str(tmp_path / "r2")], check=True)
    assert (tmp_path / "r2" / "ckpt_1" / "model.safetensors").exists()
    # In the background: the values of the call, though the tensors change after it.
    h = ct.save_state_dict(sd, "s3://ckpt-py/saved-bg", background=True)
    for v in sd.values():
        v.zero_()
    assert h.wait() == "s3://ckpt-py/saved-bg"
    got = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    ct.load_state_dict(got, "s3://ckpt-py/saved-bg")
    assert torch.equal(got["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4)) and int(got["step"]) == 7


def test_a_large_save_goes_up_while_it_is_written(bucket, tmp_path, monkeypatch, capfd):
    """`save_state_dict` to a URL sends each whole 16 MiB part of its files while
    `write_rank` writes them (CKPT_UPLOAD_TRACE counts them), and the objects equal a
    local save byte for byte."""
    torch = pytest.importorskip("torch")
    import ckpt.torch as ct

    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.w": torch.randn(1024, 4096, generator=g) for i in range(5)}  # 80 MiB
    monkeypatch.setenv("CKPT_UPLOAD_TRACE", "1")
    ct.save_state_dict(sd, "s3://ckpt-py/big")
    err = capfd.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith("ckpt: streamed "))
    parts = int(line.split()[2])
    assert parts >= 3, line
    ct.save_state_dict(sd, tmp_path / "local")
    keys = sorted(o["Key"] for o in bucket.list_objects_v2(Bucket="ckpt-py", Prefix="big/")["Contents"])
    want = sorted("big/" + str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*") if p.is_file())
    assert keys == want
    for k in keys:
        body = bucket.get_object(Bucket="ckpt-py", Key=k)["Body"].read()
        assert body == (tmp_path / "local" / k[len("big/"):]).read_bytes(), k
    assert bucket.list_multipart_uploads(Bucket="ckpt-py").get("Uploads", []) == []
    assert "Contents" not in bucket.list_objects_v2(Bucket="ckpt-py", Prefix="big.ckpt-partial")


def test_gloo_ranks_save_to_and_load_from_a_bucket(bucket, tmp_path):
    """4 gloo ranks save DTensors of a (dp, tp) mesh to the bucket: the same files as
    their save to a local directory; 2 ranks of another layout then load from the bucket
    every tensor bit for bit, fetching only their ranges."""
    pytest.importorskip("torch.distributed.tensor")
    from test_torch import run_ranks

    url = "s3://ckpt-py/g4"
    run_ranks(4, "save", url)
    run_ranks(4, "save", tmp_path / "local")
    local = tmp_path / "local"
    keys = sorted(o["Key"] for o in bucket.list_objects_v2(Bucket="ckpt-py", Prefix="g4/")["Contents"])
    want = sorted("g4/" + str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert keys == want
    for k in keys:
        assert bucket.get_object(Bucket="ckpt-py", Key=k)["Body"].read() == (local / k[3:]).read_bytes(), k
    assert "Uploads" not in bucket.list_multipart_uploads(Bucket="ckpt-py")
    run_ranks(2, "load", url)
    # A background save to the bucket (the ranks meet through the store, not
    # collectives): the same objects, loaded back the same.
    run_ranks(4, "save", tmp_path / "sync", "s3://ckpt-py/g4-bg")
    keys = sorted(o["Key"] for o in bucket.list_objects_v2(Bucket="ckpt-py", Prefix="g4-bg/")["Contents"])
    assert keys == sorted("g4-bg/" + k[3:] for k in want)
    for k in keys:
        assert bucket.get_object(Bucket="ckpt-py", Key=k)["Body"].read() == (local / k[6:]).read_bytes(), k
    run_ranks(2, "load", "s3://ckpt-py/g4-bg")
