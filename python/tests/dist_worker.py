"""One gloo process of the distributed tests (test_torch.py starts them):

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dist_worker.py MODE DIR...

- ``save``: DTensor state on a 2x2 (dp, tp) mesh (4 ranks), saved with
  ``ckpt.torch.save_state_dict`` into DIR, and in the background into a second DIR.
- ``train`` / ``resume``: a tensor-parallel MLP trained, saved, and resumed.
- ``commit`` (2 ranks): a background save of DTensors, a model, its optimizer, LR
  scheduler and step into DIR, rank 1's write slowed down by 2 s: once ``wait()``
  returns, on rank 0 too, the checkpoint is committed and every rank loads it at once
  (tensors and non-tensor state); then a foreground save into a second DIR.
- ``load``: a state dict of zeros in *another* layout on this world's mesh, filled by
  ``ckpt.torch.load_state_dict`` from each DIR; every tensor must equal the original bit for
  bit (``full_tensor()`` gathers the pieces of every rank).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckpt.torch


def full_tensors():
    g = torch.Generator().manual_seed(25)
    return {
        "w2d": torch.randn(8, 6, generator=g),
        "nested": torch.randn(7, 3, generator=g),
        # 3 rows split twice over 4 ranks: chunk(3, 2) = 2, 1, then 1, 1 and 1, 0.
        "few": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "col": torch.randn(4, 10, generator=g),
        "bias": torch.randn(6, generator=g),
        "step": torch.tensor(7, dtype=torch.int64),
    }


def layouts(world):
    if world == 4:
        return ("dp", "tp"), (2, 2), {
            "w2d": [Shard(0), Shard(1)],
            "nested": [Shard(0), Shard(0)],
            "few": [Shard(0), Shard(0)],
            "col": [Replicate(), Shard(1)],
        }
    # Loading: other placements than the save's (load-time resharding).
    return ("tp",), (world,), {
        "w2d": [Shard(1)],
        "nested": [Shard(0)],
        "few": [Shard(0)],
        "col": [Replicate()],
    }


def state(world, zeros):
    names, shape, place = layouts(world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    sd = {}
    for k, v in full_tensors().items():
        v = torch.zeros_like(v) if zeros else v
        sd[k] = distribute_tensor(v, mesh, place[k]) if k in place else v.clone()
    return sd


def mlp(world, init):
    """A tensor-parallel MLP on a 1-D mesh: column-parallel w1, row-parallel w2."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    place = {"w1": [Shard(1)], "w2": [Shard(0)]}
    return mesh, {
        k: torch.nn.Parameter(distribute_tensor(v, mesh, place[k])) for k, v in init.items()
    }


def train(mesh, params, steps, first):
    """SGD steps on fixed batches; the losses as exact hex floats."""
    opt = torch.optim.SGD(list(params.values()), lr=0.1)
    losses = []
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 + s)
        x = distribute_tensor(torch.randn(16, 12, generator=g), mesh, [Replicate()])
        y = distribute_tensor(torch.randn(16, 6, generator=g), mesh, [Replicate()])
        out = torch.relu(x @ params["w1"]) @ params["w2"]
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.full_tensor()).hex())
    return losses


def mlp_init():
    g = torch.Generator().manual_seed(3)
    return {"w1": torch.randn(12, 32, generator=g) * 0.3, "w2": torch.randn(32, 6, generator=g) * 0.3}


def small_training(lr):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return lin, opt, sched


def commit(dirs):
    rank = dist.get_rank()
    if rank == 1:
        real = ckpt.torch._ckpt.write_rank

        def slow(*args, **kwargs):
            time.sleep(2.0)
            return real(*args, **kwargs)

        ckpt.torch._ckpt.write_rank = slow
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    w = distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])
    lin, opt, sched = small_training(0.1)
    x = torch.arange(6.0).reshape(2, 3)
    lin(x).sum().backward()
    opt.step()
    sched.step()
    sd = {"w": w, "model": lin, "optim": opt, "sched": sched, "step": 17}
    t0 = time.monotonic()
    h = ckpt.torch.save_state_dict(sd, dirs[0], background=True)
    assert h.wait() == os.path.abspath(dirs[0])
    took = time.monotonic() - t0
    # No barrier of our own: wait() returning means committed, on every rank.
    assert os.path.isdir(dirs[0]), "wait() returned before the commit"
    assert took > 1.5, f"rank {rank}: wait() returned after {took:.2f} s, before rank 1 wrote"
    ckpt.verify(dirs[0])
    mesh2 = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w2 = distribute_tensor(torch.zeros(6, 4), mesh2, [Shard(1)])
    lin2, opt2, sched2 = small_training(1.0)
    with torch.no_grad():
        for p in lin2.parameters():
            p.zero_()
            p.grad = torch.zeros_like(p)
    opt2.step()  # creates the momentum buffers the load fills
    sd2 = {"w": w2, "model": lin2, "optim": opt2, "sched": sched2, "step": 0}
    ckpt.torch.load_state_dict(sd2, dirs[0])
    assert torch.equal(w2.full_tensor(), w.full_tensor())
    for a, b in zip(lin.parameters(), lin2.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.05
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert sched2.state_dict() == sched.state_dict() and sd2["step"] == 17
    # A save that is not in the background returns once committed, too.
    assert ckpt.torch.save_state_dict(sd, dirs[1]) == os.path.abspath(dirs[1])
    assert os.path.isdir(dirs[1])


def main():
    mode, dirs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if mode == "train":
        # Train 3 steps on this world, save with ckpt, and keep the whole state in a
        # torch.save file: the in-memory state an uninterrupted run would go on from.
        mesh, params = mlp(world, mlp_init())
        train(mesh, params, 3, 0)
        sd = {k: v.detach() for k, v in params.items()}
        ckpt.torch.save_state_dict(sd, dirs[0])
        full = {k: v.full_tensor() for k, v in sd.items()}
        if dist.get_rank() == 0:
            torch.save(full, dirs[1])
    elif mode == "resume":
        # The next 3 steps from each source; rank 0 writes the losses, one line each.
        lines = []
        for d in dirs[1:]:
            if d.endswith(".pt"):
                mesh, params = mlp(world, torch.load(d))
            else:
                mesh, params = mlp(world, {k: torch.zeros_like(v) for k, v in mlp_init().items()})
                with torch.no_grad():
                    ckpt.torch.load_state_dict({k: v.data for k, v in params.items()}, d)
            lines.append(" ".join(train(mesh, params, 3, 3)))
        if dist.get_rank() == 0:
            with open(dirs[0], "w") as f:
                f.write("\n".join(lines) + "\n")
    elif mode == "commit":
        commit(dirs)
    elif mode == "save":
        # DIR saved as the call returns; a second DIR saved in the background.
        sd = state(world, zeros=False)
        # A URL (a bucket) is returned as given.
        want = dirs[0] if "://" in dirs[0] else os.path.abspath(dirs[0])
        assert ckpt.torch.save_state_dict(sd, dirs[0]) == want
        if len(dirs) > 1:
            h = ckpt.torch.save_state_dict(sd, dirs[1], background=True)
            # The training loop may change the tensors once the call returns: the
            # write must still hold the values of the call.
            for v in sd.values():
                (v._local_tensor if hasattr(v, "_local_tensor") else v).zero_()
            assert h.wait() == (dirs[1] if "://" in dirs[1] else os.path.abspath(dirs[1]))
    else:
        # Each directory in turn, into a fresh state dict of zeros.
        for d in dirs:
            sd = state(world, zeros=True)
            ckpt.torch.load_state_dict(sd, d)
            for k, want in full_tensors().items():
                got = sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]
                assert got.dtype == want.dtype and got.shape == want.shape, (d, k)
                assert torch.equal(got, want), (d, k)
    # Everything this rank checks has passed; what follows is torch's teardown.
    print(f"ckpt-worker: {mode} checked", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.15's gloo sometimes aborts in its C++ teardown at interpreter exit
    # ("terminate called without an active exception", SIGABRT) after everything above
    # has passed; leave without running those destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
