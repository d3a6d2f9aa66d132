"""Inputs and the JAX user's anchor for scripts/orbax_bench.sh (issue 48's speed targets).

Run with a venv that has jax[cpu], orbax-checkpoint and safetensors (/work/venv-jax:
jax 0.10.2, orbax-checkpoint 0.12.8):

    python -P scripts/orbax_bench.py orbax OUT [MIB]     # an 8-device Orbax save
    python -P scripts/orbax_bench.py maxtext OUT [LAYERS]  # a MaxText Llama step, ~1 GB
    python -P scripts/orbax_bench.py restore ITEM OUT.safetensors  # the anchor

`orbax`: MIB (default 544) of float32 and bfloat16 arrays, as a model's weights, laid out
on 8 CPU devices (`--xla_force_host_platform_device_count=8`) on a (4, 2) mesh
('data', 'model') and saved by `ocp.StandardCheckpointer` with orbax's defaults (OCDBT,
one chunk per device's box), to OUT/ckpt.

`maxtext`: MaxText's scanned Llama 3.1 tree as scripts/fixtures/maxtext_fixtures.py
writes it (its own `tree` and `save`), at the sizes of a ~1 GB model (hidden 1024,
LAYERS layers (default 13), 16 heads of 64 in 4 key/value groups, MLP 4096, vocabulary
32000), to OUT/ckpt, and the Hugging Face config to OUT/config.json. No reference
logits: the benchmark times the export, the tests check it.

`restore`: what a JAX user runs today to get a safetensors file from an Orbax save:
`PyTreeCheckpointer().restore` of the item as numpy arrays (no mesh: this process has one
device), the tree flattened to `.`-joined names, `safetensors.flax.save_file`.
"""

import os
import sys

# This directory holds torch.py (a fixtures script): keep it off the path.
here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]


def make_orbax(out, mib):
    flag = "--xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(48)
    tree, total, i = {"params": {}}, 0, 0
    # 32 MiB float32 kernels, every fourth one bfloat16 (16 MiB), each cut over the whole
    # mesh: 8 chunks an array.
    while total < mib << 20:
        dtype = jnp.bfloat16 if i % 4 == 3 else jnp.float32
        host = rng.standard_normal((4096, 2048), dtype=np.float32)
        arr = jax.device_put(jnp.asarray(host, dtype=dtype), NamedSharding(mesh, P("data", "model")))
        tree["params"][f"layer{i}"] = {"kernel": arr}
        total += arr.nbytes
        i += 1
    tree["step"] = np.int32(1000)
    path = os.path.join(os.path.abspath(out), "ckpt")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()
    print(f"wrote {path}: {i} arrays, {total / 2**20:.0f} MiB", file=sys.stderr)


def make_maxtext(out, layers):
    import json

    import numpy as np

    sys.path.insert(0, os.path.join(here, "fixtures"))
    import maxtext_fixtures as mf

    mf.L, mf.E, mf.H, mf.KV, mf.D, mf.F, mf.V = layers, 1024, 16, 4, 64, 4096, 32000
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    params = mf.tree(np.random.default_rng(48))
    mf.save(os.path.join(out, "ckpt"), params)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(mf.hf_config(), f, indent=2)
    n = sum(a.nbytes for a in _leaves(params))
    print(f"wrote {out}/ckpt: {n / 1e9:.2f} GB of parameters", file=sys.stderr)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def restore(item, out):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, here)
    from orbax_check import orbax_restore
    from safetensors.flax import save_file
    import jax.numpy as jnp

    flat = orbax_restore(os.path.abspath(item), "numpy")
    save_file({k: jnp.asarray(v) for k, v in flat.items()}, out)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "orbax":
        make_orbax(args[0], int(args[1]) if len(args) > 1 else 544)
    elif what == "maxtext":
        make_maxtext(args[0], int(args[1]) if len(args) > 1 else 13)
    elif what == "restore":
        restore(args[0], args[1])
    else:
        raise SystemExit(f"unknown: {what}")
