"""save_state_dict / load_state_dict as a drop-in for torch.distributed.checkpoint:
non-tensor state (optimizer param_groups, LR schedulers, step counters, Stateful
objects) saved as JSON and restored; strict=False and key maps; stale staging
directories of crashed saves removed, live ones never; a background save whose wait()
has returned is committed and loadable on every rank at once."""

import json
import os
import subprocess
import sys
import time
import warnings

import pytest

torch = pytest.importorskip("torch")

import ckpt  # noqa: E402
import ckpt.torch  # noqa: E402
from ckpt import _staging  # noqa: E402

from test_torch import run_ranks  # noqa: E402


class Counter:
    """An application's own Stateful object (DCP's protocol: state_dict/load_state_dict)."""

    def __init__(self):
        self.seen, self.tags = 0, ("a",)

    def state_dict(self):
        return {"seen": self.seen, "tags": self.tags, "rate": torch.tensor([0.5, 0.25])}

    def load_state_dict(self, sd):
        self.seen, self.tags, self.rate = sd["seen"], sd["tags"], sd["rate"].clone()


def training(seed=0, lr=0.01):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def step(model, optim, sched, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    sched.step()
    return loss.item()


def app_state(model, optim, sched, step_no, counter):
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "step": step_no,
        "counter": counter,
        "extra": {"run": "r1", "best": float("inf"), "history": (1, 2.5), "flags": [True, None]},
    }


def test_param_groups_scheduler_step_and_stateful_survive_save_and_load(tmp_path):
    model, optim, sched = training()
    for i in range(3):
        step(model, optim, sched, i)
    counter = Counter()
    counter.seen, counter.tags = 11, ("x", "y")
    out = tmp_path / "ck"
    ckpt.torch.save_state_dict(app_state(model, optim, sched, 3, counter), out)

    # The non-tensor part: strict JSON in the documented file.
    doc = json.loads((out / "non_tensor_state.json").read_text(), parse_constant=None)
    assert doc["format"] == "ckpt non-tensor state" and doc["version"] == 1
    values = doc["values"]
    assert values["step"] == 3
    assert values["optim.param_groups.0.lr"] == optim.param_groups[0]["lr"]
    assert values["optim.param_groups.0.betas"] == {"$tuple": [0.8, 0.95]}
    assert values["sched.last_epoch"] == 3
    assert values["extra.best"] == {"$float": "inf"}
    # Tensors are where they always were.
    assert "optim.state.0.exp_avg" in ckpt.open(out).tensors
    assert "counter.rate" in ckpt.open(out).tensors

    # A fresh run: other lr, other weights, an optimizer whose state exists (one step
    # with zero gradients, as DCP's get_state_dict initialises it) but is wrong.
    model2, optim2, sched2 = training(seed=7, lr=1.0)
    for p in model2.parameters():
        p.grad = torch.zeros_like(p)
    optim2.step()
    counter2 = Counter()
    sd2 = app_state(model2, optim2, sched2, 0, counter2)
    sd2["extra"] = {"run": "", "best": 0.0, "history": (0, 0), "flags": []}
    assert ckpt.torch.load_state_dict(sd2, out) is sd2

    assert sd2["step"] == 3
    assert sd2["extra"] == {"run": "r1", "best": float("inf"), "history": (1, 2.5), "flags": [True, None]}
    assert isinstance(sd2["extra"]["history"], tuple)
    assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"] != 1.0
    assert optim2.param_groups[0]["betas"] == (0.8, 0.95)
    assert {k: v for k, v in optim2.param_groups[0].items() if k != "params"} == {
        k: v for k, v in optim.param_groups[0].items() if k != "params"
    }
    assert sched2.state_dict() == sched.state_dict()
    assert counter2.seen == 11 and counter2.tags == ("x", "y")
    assert torch.equal(counter2.rate, torch.tensor([0.5, 0.25]))
    for (k, a), b in zip(optim.state.items(), optim2.state.values()):
        for n in a:
            assert torch.equal(a[n], b[n]), (k, n)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    # Resumed training goes on exactly as the original.
    for i in range(3, 6):
        assert step(model, optim, sched, i) == step(model2, optim2, sched2, i)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_non_tensor_state_is_carried_by_reshard_and_merge(tmp_path):
    sd = {"w": torch.arange(12.0).reshape(4, 3), "step": 9, "groups": [{"lr": 0.5}]}
    out = tmp_path / "ck"
    ckpt.torch.save_state_dict(sd, out)
    for dest, run in (
        (tmp_path / "r2", lambda d: ckpt.reshard(out, d, to=2)),
        (tmp_path / "m", lambda d: ckpt.merge(out, d)),
    ):
        run(dest)
        back = {"w": torch.zeros(4, 3), "step": 0, "groups": [{"lr": 0.0}]}
        ckpt.torch.load_state_dict(back, dest)
        assert back["step"] == 9 and back["groups"] == [{"lr": 0.5}]
        assert torch.equal(back["w"], sd["w"])


def test_values_ckpt_cannot_store_safely_are_refused_before_writing(tmp_path):
    for bad in ({1, 2}, object(), lambda: 0):
        with pytest.raises(ckpt.Unsupported) as e:
            ckpt.torch.save_state_dict({"w": torch.ones(2), "meta": {"odd": bad}}, tmp_path / "x")
        assert "`meta.odd`" in str(e.value) and "never pickles" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_strict_and_key_map(tmp_path):
    sd = {"w": torch.arange(6.0), "step": 4}
    out = tmp_path / "ck"
    ckpt.torch.save_state_dict(sd, out)
    # A value the checkpoint lacks: refused, nothing changed.
    target = {"w": torch.zeros(6), "step": 0, "epoch": 1}
    with pytest.raises(ckpt.MissingData) as e:
        ckpt.torch.load_state_dict(target, out)
    assert "`epoch`" in str(e.value)
    assert target["step"] == 0 and not target["w"].any()
    # strict=False: the rest loaded, a warning names what was not.
    target["extra.bias"] = torch.full((2,), 7.0)
    with pytest.warns(UserWarning, match="epoch"):
        ckpt.torch.load_state_dict(target, out, strict=False)
    assert target["step"] == 4 and torch.equal(target["w"], sd["w"])
    assert target["epoch"] == 1 and torch.equal(target["extra.bias"], torch.full((2,), 7.0))
    # Shapes must agree even with strict=False.
    with pytest.raises(ckpt.Mismatch):
        ckpt.torch.load_state_dict({"w": torch.zeros(5)}, out, strict=False)
    # Key maps: a dict (other names kept) or a function (None skips).
    renamed = {"module.w": torch.zeros(6), "step": 0}
    ckpt.torch.load_state_dict(renamed, out, key_map={"module.w": "w"})
    assert torch.equal(renamed["module.w"], sd["w"]) and renamed["step"] == 4
    fn = {"model.w": torch.zeros(6), "skip": 5}
    ckpt.torch.load_state_dict(
        fn, out, key_map=lambda n: None if n == "skip" else n.removeprefix("model.")
    )
    assert torch.equal(fn["model.w"], sd["w"]) and fn["skip"] == 5
    # A checkpoint of another format has no non-tensor state: named, or skipped.
    other = tmp_path / "m"
    ckpt.merge(out, other)
    os.remove(other / "non_tensor_state.json")
    with pytest.raises(ckpt.MissingData, match="no non-tensor state"):
        ckpt.torch.load_state_dict({"w": torch.zeros(6), "step": 0}, other)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = {"w": torch.zeros(6), "step": 0}
        ckpt.torch.load_state_dict(t, other, strict=False)
    assert t["step"] == 0 and torch.equal(t["w"], sd["w"])


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def fake_staging(parent, base, owner=None, age=0.0, name=None):
    d = parent / (name or f".{base}.partial-{os.urandom(16).hex()}")
    (d / "ckpt_0").mkdir(parents=True)
    (d / "ckpt_0" / "model.safetensors").write_bytes(b"x")
    paths = [d, d / "ckpt_0", d / "ckpt_0" / "model.safetensors"]
    if owner is not None:
        f = d / ".owner-0.json"
        f.write_text(json.dumps({**owner, "rank": 0}))
        paths.append(f)
    if age:
        t = time.time() - age
        for p in paths:
            os.utime(p, (t, t))
    return d


def test_stale_staging_directories_are_removed_and_live_ones_kept(tmp_path):
    me = _staging.owner_record()
    old = _staging.STALE_AFTER_S + 60
    elsewhere = {"host": "another-host", "boot_id": "x", "pid": 1, "start_time": "1"}
    stale = [
        fake_staging(tmp_path, "ck", {**me, "pid": dead_pid(), "start_time": None}),  # crashed here, just now
        fake_staging(tmp_path, "ck", {**me, "start_time": "1"}),  # this pid, another process (reused)
        fake_staging(tmp_path, "ck", {**me, "boot_id": "before-a-reboot"}),
        fake_staging(tmp_path, "other_step", elsewhere, age=old),  # silent elsewhere
        fake_staging(tmp_path, "ck", None, age=old),  # no owner, untouched for long
    ]
    live = [
        fake_staging(tmp_path, "ck", me, age=old),  # this very process, however old
        fake_staging(tmp_path, "ck", elsewhere),  # another host, heartbeat fresh
        fake_staging(tmp_path, "ck", None),  # no owner yet, just created
        fake_staging(tmp_path, "ck", None, age=old, name=".ck.partial-not-a-token"),  # not ours
    ]
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = {**me, "pid": kid.pid, "start_time": _staging._start_time(kid.pid)}
        live.append(fake_staging(tmp_path, "ck", rec, age=old))  # another live process here
        ckpt.torch.save_state_dict({"w": torch.ones(3)}, tmp_path / "ck")
    finally:
        kid.kill()
        kid.wait()
    for d in stale:
        assert not d.exists(), d
    for d in live:
        assert d.exists(), d
    # The committed checkpoint carries no owner files.
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".owner")]
    assert ckpt.open(tmp_path / "ck").kind == "sliced"


def test_a_failed_save_raises_and_leaves_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch._ckpt, "write_rank", broken)
    sd = {"w": torch.ones(3), "step": 1}
    with pytest.raises(OSError, match="No space left"):
        ckpt.torch.save_state_dict(sd, tmp_path / "ck")
    h = ckpt.torch.save_state_dict(sd, tmp_path / "bg", background=True)
    with pytest.raises(OSError, match="No space left"):
        h.wait()
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert ckpt.torch.save_state_dict(sd, tmp_path / "ck") == str(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_gloo_background_save_is_committed_on_every_rank_when_wait_returns(tmp_path):
    """2 gloo ranks save in the background, rank 1's write slowed down by 2 s: rank 0's
    wait() returns only after rank 1 finished, and at that point the checkpoint is
    there and whole; both ranks then load it at once (tensors, param_groups, the
    scheduler and the step)."""
    pytest.importorskip("torch.distributed.tensor")
    run_ranks(2, "commit", tmp_path / "bg", tmp_path / "fg")
    assert sorted(os.listdir(tmp_path)) == ["bg", "fg"]
