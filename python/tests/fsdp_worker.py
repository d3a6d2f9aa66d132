"""One gloo process of the FSDP2 tests (test_fsdp.py starts them):

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fsdp_worker.py MODE ARGS...

- ``save OUT``, 4 ranks: the same small model wrapped two ways with ``fully_shard``
  (FSDP2): over a 1-D mesh of 4 (``Shard(0)``), and over the ``dp`` axis of a 2x2
  (dp, tp) mesh after tensor parallelism (column- and row-parallel linears), which gives
  ``_StridedShard`` placements. Each takes one Adam step, saves model and optimizer
  state (``get_state_dict``) with ``ckpt.torch.save_state_dict`` into OUT/fsdp1 and
  OUT/fsdp2d, and rank 0 writes the full tensors (``full_tensor()``) to
  OUT/fsdp1.pt, OUT/fsdp2d.pt as the truth. Then a fresh 2-D model is filled by
  ``load_state_dict`` from OUT/fsdp2d and must hold the saved local shards bit for bit.
- ``resume OUT DIR...``, any number of ranks: a fresh 1-D FSDP2 model and optimizer
  on this world, filled from each DIR in turn, ``set_state_dict``; rank 0 writes the
  full tensors to OUT/<basename of DIR>.resumed.pt.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import ckpt.torch


class Net(torch.nn.Module):
    # Uneven on purpose: 22 rows are 11 per TP rank, then 6 and 5 per DP rank.
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 22)
        self.down = torch.nn.Linear(22, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def build(kind, world):
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    model = Net()
    if kind == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model, opt):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 16, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state(model, opt):
    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def full(sd):
    """Every tensor whole (a collective), on every rank."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for k, v in flat(sd).items()
    }


def local(v):
    return v._local_tensor if hasattr(v, "_local_tensor") else v


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "save":
        for kind, name in (("1d", "fsdp1"), ("2d", "fsdp2d")):
            model, opt = build(kind, world)
            step(model, opt)
            sd = state(model, opt)
            ckpt.torch.save_state_dict(sd, os.path.join(out, name))
            truth = full(sd)
            if rank == 0:
                torch.save(truth, os.path.join(out, f"{name}.pt"))
        # Load-time mapping of _StridedShard: a fresh 2-D model (its optimizer state made
        # by one step) zeroed, then filled from the 2-D save.
        saved = {k: local(v).clone() for k, v in flat(sd).items()}
        model2, opt2 = build("2d", world)
        step(model2, opt2)
        sd2 = state(model2, opt2)
        with torch.no_grad():
            for v in flat(sd2).values():
                local(v).zero_()
        ckpt.torch.load_state_dict(sd2, os.path.join(out, "fsdp2d"))
        for k, v in flat(sd2).items():
            a, b = local(v).reshape(-1).view(torch.uint8), saved[k].reshape(-1).view(torch.uint8)
            assert torch.equal(a, b), k
    else:
        for d in sys.argv[3:]:
            model, opt = build("1d", world)
            sd = state(model, opt)  # get_state_dict makes Adam's state (zeros)
            ckpt.torch.load_state_dict(sd, d)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            got = full(state(model, opt))
            if rank == 0:
                torch.save(got, os.path.join(out, os.path.basename(d) + ".resumed.pt"))
    dist.barrier()
    dist.destroy_process_group()
    # As dist_worker.py: skip torch 2.15's gloo exit-time destructors, which sometimes
    # abort (SIGABRT) after everything has passed.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
