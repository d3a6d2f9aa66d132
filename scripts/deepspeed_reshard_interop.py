#!/usr/bin/env python3
"""DeepSpeed loads what `ckpt reshard --format deepspeed --to N` writes, on N ranks.

For each fixture of tests/fixtures/deepspeed (ZeRO-1/2/3, fp32/fp16/bf16, 2
data-parallel ranks, written by DeepSpeed 0.19.8) and each N in --dps:

1. `ckpt reshard <fixture>/ckpt --to N --format deepspeed -o <tmp>/dpN`;
2. N gloo CPU ranks build the fixture's model and config, `engine.load_checkpoint`
   ckpt's output (optimizer and scheduler states included) and gather, with
   DeepSpeed's own `safe_get_full_fp32_param` / `safe_get_full_optimizer_state`, every
   trainable parameter's fp32 master weight and Adam moments: they must equal, byte for
   byte, the fixture's `expected.safetensors` (zero_to_fp32 of the source) and
   `moments.safetensors` (the same gathered by the engine that saved it); each rank's
   flat fp32 partition must be its part of the group (ZeRO-1/2: DeepSpeed's own
   `get_data_parallel_partitions` of the gathered weights; ZeRO-3: each parameter's
   `partition_numel()` elements at the rank's place, end to end per sub-group), the
   moments as long, their padding zero; the loss scaler, step counts and Adam's step
   must be the source's;
3. one more optimizer step, with the same batch on every rank, from ckpt's dp=N
   output and from the source on its 2 ranks: the fp32 weights after it must agree
   (to float rounding: averaging a gradient over 2 or N identical copies rounds
   differently).

Needs torch, deepspeed, ninja and safetensors (CPU). Run from the repository root:

    python3 -m venv target/venv-ds && target/venv-ds/bin/pip install torch deepspeed ninja safetensors
    cargo build && target/venv-ds/bin/python scripts/deepspeed_reshard_interop.py --ckpt target/debug/ckpt

or scripts/deepspeed_reshard_interop.sh, which does both. Exit status 0 when every
check passed, 1 otherwise (each failure printed).
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed")
# DeepSpeed JIT-builds its CPU communication op with ninja, found on PATH: the venv's.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
sys.path.append(os.path.join(HERE, "fixtures"))  # last: its torch.py must not shadow torch
from gloo_ranks import rank_exit_codes  # noqa: E402


def fixture_module():
    """The fixtures script (model and config), imported by path."""
    spec = importlib.util.spec_from_file_location(
        "deepspeed_fixtures", os.path.join(HERE, "fixtures", "deepspeed_fixtures.py")
    )
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def flat_groups(o, stage):
    """The optimizer's flat fp32 groups (the torch optimizer's parameters)."""
    if stage == 3:
        return list(o.fp32_partitioned_groups_flat)
    return [gr["params"][0] for gr in o.optimizer.param_groups]


def zero12_partitions(o, engine, full, rank, world):
    """This rank's ZeRO-1/2 flat partitions: their part of the group, cut by
    DeepSpeed's own code; moments as long as the padded partition, padding zero."""
    import torch

    failures = []
    for g, part in enumerate(o.single_partition_of_fp32_groups):
        flat = o.flatten_dense_tensors_aligned(
            [full[engine.param_names[p]] for p in o.bit16_groups[g]], o.nccl_start_alignment_factor * world
        )
        want = o.get_data_parallel_partitions(flat, g)[rank]
        if not torch.equal(part.detach().cpu().view(torch.int32), want.view(torch.int32)):
            failures.append(f"rank {rank}: group {g}'s flat fp32 partition is not its part of the group")
        st = o.optimizer.state[o.optimizer.param_groups[g]["params"][0]]
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].numel() != part.numel():
                failures.append(f"rank {rank}: group {g} {key} holds {st[key].numel()}, the partition {part.numel()}")
        pad = o.groups_padding[g]
        if pad and any(t[-pad:].abs().sum().item() != 0 for t in (part, st["exp_avg"], st["exp_avg_sq"])):
            failures.append(f"rank {rank}: group {g}'s padding is not zero")
    return failures


def zero3_partitions(o, engine, full, rank, world):
    """This rank's ZeRO-3 flat groups: each sub-group's parameters' parts
    (`ds_tensor`: elements [rank * p, (rank + 1) * p) with p = partition_numel())
    end to end; the moments as long, zero in the padding."""
    import torch

    failures = []
    for s, flat in enumerate(o.fp32_partitioned_groups_flat):
        parts, pads = [], []
        for p in o.fp16_groups[s]:
            n, pn = p.ds_numel, p.partition_numel()
            padded = torch.zeros(pn * world, dtype=torch.float32)
            padded[:n] = full[engine.param_names[p]].reshape(-1)
            parts.append(padded[rank * pn : (rank + 1) * pn])
            pads.append(torch.arange(rank * pn, (rank + 1) * pn) >= n)
        want, pad = torch.cat(parts), torch.cat(pads)
        # The weights' padding is whatever memory held in the saving run (DeepSpeed
        # allocates parts with torch.empty): only the parameters' elements are compared.
        got = flat.detach().cpu().view(torch.int32)
        if not torch.equal(got[~pad], want.view(torch.int32)[~pad]):
            failures.append(f"rank {rank}: sub-group {s}'s flat fp32 group is not its parameters' parts")
        st = o.optimizer.state[flat]
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].numel() != flat.numel():
                failures.append(f"rank {rank}: sub-group {s} {key} holds {st[key].numel()}, the flat group {flat.numel()}")
            elif st[key][pad].abs().sum().item() != 0:
                failures.append(f"rank {rank}: sub-group {s} {key}: padding is not zero")
    return failures


def worker(rank, world, port, variant, load_dir, out_json, step_out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    fx = fixture_module()
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import load_file, save_file

    stage = int(variant[4])
    dtype = variant.split("_")[1]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = fx.Tiny()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=fx.config(stage, dtype))
    path, _ = engine.load_checkpoint(load_dir)
    failures = []
    if path is None:
        failures.append(f"rank {rank}: load_checkpoint found nothing in {load_dir}")
    # DeepSpeed links each parameter to its optimizer-state fragments lazily, at the
    # first step (stage_1_and_2.py: step() -> _lazy_init_hp_params_optimizer_state);
    # safe_get_full_optimizer_state needs the link before that (ZeRO-3 reads its own
    # flat groups).
    if stage < 3:
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    expected = load_file(os.path.join(FIXTURES, variant, "expected.safetensors"))
    moments = load_file(os.path.join(FIXTURES, variant, "moments.safetensors"))
    full = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        w = safe_get_full_fp32_param(p).detach().float().cpu()
        full[name] = w
        if not torch.equal(w.view(torch.int32), expected[name].view(torch.int32)):
            failures.append(f"rank {rank}: fp32 master weight `{name}` differs from the source's")
        for key in ("exp_avg", "exp_avg_sq"):
            m = safe_get_full_optimizer_state(p, key).detach().float().cpu()
            want = moments[f"optim.{name}.{key}"]
            if not torch.equal(m.view(torch.int32), want.view(torch.int32)):
                failures.append(f"rank {rank}: `{name}` {key} differs from the source's")
    o = engine.optimizer
    if stage == 3:
        failures += zero3_partitions(o, engine, full, rank, world)
    else:
        failures += zero12_partitions(o, engine, full, rank, world)
    state = {
        "global_steps": engine.global_steps,
        "adam_step": [float(o.optimizer.state[f]["step"]) for f in flat_groups(o, stage)],
        "loss_scale": float(o.loss_scaler.cur_scale),
        "scaler_iter": int(getattr(o.loss_scaler, "cur_iter", -1)),
    }
    # One more step, the same batch on every rank.
    x = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(99))
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    after = {
        name: safe_get_full_fp32_param(p).detach().float().cpu().clone()
        for name, p in engine.module.named_parameters()
        if p.requires_grad
    }
    if rank == 0:
        save_file(after, step_out)
        with open(out_json, "w") as f:
            json.dump({"failures": failures, "state": state}, f)
    else:
        with open(out_json + f".{rank}", "w") as f:
            json.dump({"failures": failures, "state": state}, f)
    fx.finish_rank()


def run(world, variant, load_dir, tmp, tag):
    port = 29000 + (os.getpid() * 7 + world * 31 + hash(tag)) % 2000
    out_json = os.path.join(tmp, f"{tag}.json")
    step_out = os.path.join(tmp, f"{tag}.step.safetensors")
    codes = rank_exit_codes(worker, (world, port, variant, load_dir, out_json, step_out), world)
    if any(codes):
        return None, [f"{tag}: DeepSpeed exited with {codes}"]
    failures = []
    states = []
    for r in range(world):
        with open(out_json + (f".{r}" if r else "")) as f:
            d = json.load(f)
        failures += d["failures"]
        states.append(d["state"])
    return (states, step_out), failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "debug", "ckpt"))
    ap.add_argument(
        "--variants",
        default="zero1_fp32,zero2_fp32,zero2_fp16,zero1_bf16,zero2_bf16,zero3_fp32,zero3_fp16,zero3_bf16",
    )
    ap.add_argument("--dps", default="1,3,4")
    ap.add_argument("--keep", help="keep the outputs in this directory")
    ap.add_argument("--quick", action="store_true", help="zero2_fp16 and zero3_fp16 to dp=3 only (CI)")
    args = ap.parse_args()
    if args.quick:
        args.variants, args.dps = "zero2_fp16,zero3_fp16", "3"
    import torch
    from safetensors.torch import load_file

    # DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels for this
    # CPU (is_fp16_supported; engine: "Type fp16 is not supported on your device"): on
    # other CPUs the fp16 variants cannot be loaded here, and their bf16 siblings (the
    # same half-precision write-back) run instead, said as such.
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        asked = args.variants.split(",")
        fp16 = [v for v in asked if v.endswith("_fp16")]
        if fp16:
            print(f"SKIPPED: {', '.join(fp16)}: DeepSpeed runs no fp16 on this CPU", flush=True)
            kept = [v.replace("_fp16", "_bf16") if args.quick else v for v in asked if not v.endswith("_fp16") or args.quick]
            args.variants = ",".join(dict.fromkeys(kept))
            print(f"running {args.variants} instead", flush=True)

    tmp = args.keep or tempfile.mkdtemp(prefix="ckpt-ds-interop-")
    os.makedirs(tmp, exist_ok=True)
    failures = []
    report = []
    for v in args.variants.split(","):
        src = os.path.join(FIXTURES, v, "ckpt")
        ref, f = run(2, v, src, tmp, f"{v}-source")
        failures += f
        if ref is None:
            continue
        ref_states, ref_step = ref
        for dp in [int(x) for x in args.dps.split(",")]:
            out = os.path.join(tmp, f"{v}-dp{dp}")
            shutil.rmtree(out, ignore_errors=True)
            r = subprocess.run(
                [args.ckpt, "reshard", src, "--to", str(dp), "--format", "deepspeed", "-o", out],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                failures.append(f"{v} dp={dp}: ckpt reshard failed: {r.stderr.strip()}")
                continue
            res, f = run(dp, v, out, tmp, f"{v}-dp{dp}")
            failures += f
            if res is None:
                continue
            states, step = res
            for s in states:
                if s != ref_states[0]:
                    failures.append(f"{v} dp={dp}: loaded state {s}, the source's {ref_states[0]}")
            a, b = load_file(ref_step), load_file(step)
            worst = max((a[k] - b[k]).abs().max().item() for k in a)
            # The gradient is averaged over 2 ranks in one run and N in the other, in
            # the training dtype: fp32 agrees to a few ulps; fp16 to its epsilon (1e-3)
            # times Adam's normalised step (lr 0.1), bf16 to its epsilon (8e-3) times it.
            tol = {"fp16": 1e-4, "bf16": 1e-3}.get(v.split("_")[1], 1e-6)
            close = all(torch.allclose(a[k], b[k], rtol=0, atol=tol) for k in a)
            if not close:
                failures.append(f"{v} dp={dp}: after one more step the weights differ by up to {worst:g}")
            report.append(
                f"{v} dp=2 -> dp={dp}: loaded byte-equal; one more step: max |diff| {worst:g} (tolerance {tol:g})"
            )
            print(report[-1], flush=True)
    for f in failures:
        print("FAIL:", f, flush=True)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(report)} resharded checkpoints loaded by DeepSpeed, {len(failures)} failure(s)")
    sys.exit(1 if failures or not report else 0)


if __name__ == "__main__":
    main()
