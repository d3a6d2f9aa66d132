"""Checks that orbax-checkpoint restores what `ckpt merge --format orbax` writes.

    CKPT_PYTHON_JAX=/work/venv-jax/bin/python \\
        python scripts/orbax_write_check.py [--ckpt BIN] [--work DIR] [SOURCE.safetensors ...]

Without CKPT_PYTHON_JAX this prints SKIPPED and exits 0 (CI installs no jax); with it,
the script runs under that Python (re-executing itself there), which needs jax,
orbax-checkpoint (0.12.8 checked) and ml_dtypes.

Sources: the SOURCE files given, and one the script writes itself with every dtype
ckpt writes to Orbax (bool, u/int 8-64, float16/32/64, bfloat16, float8_e4m3fn,
float8_e5m2), a 0-d array, nested and numeric keys. Each source is merged twice:
`--format orbax -o WORK/<i>/root/1` (one chunk per array), and with
CKPT_TEST_ORBAX_CHUNK_BYTES=256 and `--orbax-item items` (arrays cut into chunks along
dimension 0, the last padded). Each output is then restored by orbax:

1. `StandardCheckpointer().restore(item)` without a target: numpy arrays;
2. `PyTreeCheckpointer().restore(item)` without arguments: numpy arrays;
3. `CheckpointManager(root).restore(1)` (the step's `_CHECKPOINT_METADATA` names the
   handler): numpy arrays;
4. `StandardCheckpointer().restore(item, target)` with a target of
   `jax.ShapeDtypeStruct`s on a 1-D mesh of 4 CPU devices (dimension 0 sharded where
   it divides, else replicated): jax.Arrays with those shardings (`jax_enable_x64` on,
   so that 64-bit arrays stay 64-bit);
5. as MaxText restores: `CheckpointManager(root, item_names=(item,)).restore(1,
   args=Composite(item=PyTreeRestore(item=target, restore_args=...)))` onto the mesh;

and every array is compared with the source: names (keys joined with `.`), dtypes,
shapes and every byte. Last, ckpt reads its own output back (`ckpt merge OUT -o
BACK`) and that is compared too.

Then `ckpt reshard --format orbax` (sharded on a mesh): a source of every kind of
placement (one axis, two axes on two dimensions, two axes on one dimension in either
order, replicated, 0-d) is written by `ckpt reshard --strategy` on a dp=2,tp=4 mesh
(8 devices) as an Orbax step, and from ckpt's rank directories of that layout by
`--mesh tp=2` (4 devices) and `--to 4`. Each is restored by orbax

6. without a target (`StandardCheckpointer().restore(item)`): jax.Arrays with the
   shardings of `_sharding`, each compared with the NamedSharding this script derives
   from the strategy on its own;
7. as numpy (`PyTreeCheckpointer().restore(item, restore_args=RestoreArgs(
   restore_type=np.ndarray))`);
8. with a target on the same mesh, and with a target replicated on 2 devices;

every leaf exact; each array's write shape is the NamedSharding's `shard_shape`
(one chunk per device box); and `_sharding` is byte for byte the file orbax itself
writes when it saves the same arrays with those shardings (`StandardCheckpointer().save`).
Exits 0 and prints PASS when everything matches, 1 (FAIL) otherwise, 2 on usage errors.
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def reexec_under_jax_python():
    """SKIPPED without CKPT_PYTHON_JAX; under another Python, run again under it."""
    py = os.environ.get("CKPT_PYTHON_JAX")
    if not py:
        print("SKIPPED: set CKPT_PYTHON_JAX to a Python with jax and orbax-checkpoint "
              "(e.g. /work/venv-jax/bin/python)")
        sys.exit(0)
    if not os.environ.get("_ORBAX_WRITE_CHECK_CHILD"):
        env = dict(os.environ, _ORBAX_WRITE_CHECK_CHILD="1")
        os.execve(py, [py, os.path.abspath(__file__)] + sys.argv[1:], env)


reexec_under_jax_python()

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from absl import logging  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

logging.set_verbosity(logging.ERROR)
# 64-bit arrays stay 64-bit as jax.Arrays (JAX narrows them to 32 bits by default).
jax.config.update("jax_enable_x64", True)

# safetensors dtype names <-> numpy dtypes (little-endian).
ST = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype("<i2"), "U16": np.dtype("<u2"), "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
ST_NAME = {v: k for k, v in ST.items()}


def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        s, e = h["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + s : 8 + n + e], dtype=ST[h["dtype"]]).reshape(h["shape"])
    return out


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": ST_NAME[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def mixed_source():
    """Every dtype ckpt writes to Orbax, with values that exercise every byte."""
    rng = np.random.default_rng(48)

    def floats(dt, shape):
        return (rng.standard_normal(shape) * 3).astype(dt)

    def ints(dt, shape):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)

    t = {
        "params.embed": floats(ml_dtypes.bfloat16, (12, 8)),
        "params.layers.0.w": floats(np.float32, (8, 8)),
        "params.layers.1.w": floats(np.float16, (7, 3, 2)),
        "params.layers.1.b": floats(np.float64, (5,)),
        # 37 rows of 12 bytes: in 256-byte chunks, 2 chunks of 19 rows, the last padded.
        "params.tall": floats(np.float32, (37, 3)),
        "params.f8.e4m3": floats(ml_dtypes.float8_e4m3fn, (16, 3)),
        "params.f8.e5m2": floats(ml_dtypes.float8_e5m2, (9,)),
        "opt.mask": rng.integers(0, 2, size=(6, 5)).astype(np.bool_),
        "opt.count": np.array(123456789012, dtype=np.int64),
        "opt.scale": np.array(0.5, dtype=np.float32),
    }
    for dt in (np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64):
        t[f"ints.{np.dtype(dt).name}"] = ints(dt, (4, 6))
    return t


def flatten(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tree
    return out


def nest(flat):
    tree = {}
    for name, v in flat.items():
        *path, last = name.split(".")
        d = tree
        for k in path:
            d = d.setdefault(k, {})
        d[last] = v
    return tree


def compare(label, got, ref, kind=None):
    bad = 0
    for name in sorted(set(ref) ^ set(got)):
        print(f"  [{label}] {'MISSING' if name in ref else 'EXTRA'}: {name}")
        bad += 1
    for name in sorted(set(ref) & set(got)):
        g, r = got[name], ref[name]
        if kind is not None and not isinstance(g, kind):
            print(f"  [{label}] {name}: restored as {type(g).__name__}, not {kind.__name__}")
            bad += 1
            continue
        g = np.asarray(g)
        if g.dtype != r.dtype or g.shape != r.shape:
            print(f"  [{label}] {name}: {g.dtype}{list(g.shape)} != source {r.dtype}{list(r.shape)}")
            bad += 1
        elif g.tobytes() != r.tobytes():
            print(f"  [{label}] {name}: bytes differ")
            bad += 1
    print(f"  [{label}] {len(got)} arrays, {'OK' if not bad else f'{bad} problem(s)'}")
    return bad


def mesh_target(ref):
    devs = jax.devices()[:4]
    mesh = Mesh(np.array(devs), ("x",))

    def leaf(a):
        spec = P("x") if a.ndim and a.shape[0] % len(devs) == 0 else P()
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    return nest({k: leaf(v) for k, v in ref.items()}), len(devs)


def check_output(ckpt, root, step, item, ref, work):
    bad = 0
    item_dir = os.path.join(root, str(step), item)
    got = flatten(ocp.StandardCheckpointer().restore(item_dir))
    bad += compare("StandardCheckpointer, no target", got, ref, np.ndarray)
    got = flatten(ocp.PyTreeCheckpointer().restore(item_dir))
    bad += compare("PyTreeCheckpointer, no arguments", got, ref, np.ndarray)
    mngr = ocp.CheckpointManager(root)
    if mngr.latest_step() != step:
        print(f"  [CheckpointManager] latest step {mngr.latest_step()}, not {step}")
        bad += 1
    restored = mngr.restore(step)
    if not isinstance(restored, dict) or set(restored) != set(nest(ref)):
        restored = restored[item]  # a Composite of the step's items
    bad += compare("CheckpointManager.restore(step)", flatten(restored), ref, np.ndarray)
    mngr.close()
    target, n = mesh_target(ref)
    restored = ocp.StandardCheckpointer().restore(item_dir, target)
    got = flatten(restored)
    want = flatten(target)
    for name, a in got.items():
        if isinstance(a, jax.Array) and name in want and a.sharding != want[name].sharding:
            print(f"  [mesh] {name}: sharding {a.sharding}, asked {want[name].sharding}")
            bad += 1
    bad += compare(f"StandardCheckpointer, target on a {n}-device mesh", got, ref, jax.Array)
    # As MaxText restores its `items`: a manager, a Composite of PyTreeRestore with the
    # abstract tree and its restore args.
    mngr = ocp.CheckpointManager(root, item_names=(item,))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.Composite(**{item: ocp.args.PyTreeRestore(item=target, restore_args=restore_args)})
    got = flatten(mngr.restore(step, args=args)[item])
    mngr.close()
    bad += compare("CheckpointManager + Composite(PyTreeRestore), target on the mesh", got, ref, jax.Array)
    back = os.path.join(os.path.dirname(root), "back")
    r = subprocess.run([ckpt, "merge", root, "-o", back], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  [ckpt reads it back] failed ({r.returncode}): {r.stderr.strip()}")
        return bad + 1
    bad += compare("ckpt reads it back", read_safetensors(os.path.join(back, "model.safetensors")), ref)
    return bad


# The sharded source: (dtype, shape, placements on the dp=2,tp=4 mesh).
SHARDED = {
    "params.embed": (ml_dtypes.bfloat16, (16, 8), ["Replicate", "Shard(0)"]),
    "params.layers.0.w": (np.float32, (8, 12), ["Shard(0)", "Shard(1)"]),
    "params.layers.0.b": (np.float32, (12,), ["Replicate", "Replicate"]),
    "params.vec": (np.float16, (16,), ["Shard(0)", "Shard(0)"]),
    "params.swap": (np.float32, (8, 4), ["Shard(1)", "Shard(0)"]),
    "params.order": (np.int32, (16, 2), ["Shard(0,order=1)", "Shard(0)"]),
    "params.f8": (ml_dtypes.float8_e4m3fn, (8, 4), ["Replicate", "Shard(0)"]),
    "ints.u8": (np.uint8, (8, 8), ["Shard(1)", "Replicate"]),
    "opt.mask": (np.bool_, (4, 6), ["Shard(0)", "Replicate"]),
    "opt.count": (np.int64, (), ["Replicate", "Replicate"]),
}


def sharded_source():
    rng = np.random.default_rng(4848)
    out = {}
    for name, (dt, shape, _) in SHARDED.items():
        if dt is np.bool_:
            out[name] = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(np.dtype(dt), np.integer):
            info = np.iinfo(dt)
            out[name] = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
        else:
            out[name] = (rng.standard_normal(shape) * 3).astype(dt)
    return out


def strategy_json(axes, placements):
    tensors = {}
    for name, (dt, shape, _) in SHARDED.items():
        tensors[name] = {"dtype": ST_NAME[np.dtype(dt)], "placements": placements[name], "shape": list(shape)}
    return {"format": "ckpt-strategy", "mesh": {"axes": [{"name": n, "size": k} for n, k in axes]},
            "tensors": tensors, "version": 1}


def partition_spec(placements, axes, ndim):
    """The PartitionSpec of ckpt placements, derived here on its own: per dimension the
    axes that shard it in (order, mesh position) order; trailing unsplit dims left out."""
    import re
    per_dim = [[] for _ in range(ndim)]
    for i, p in enumerate(placements):
        m = re.fullmatch(r"Shard\((\d+)(?:,order=(\d+))?\)", p)
        if m:
            per_dim[int(m.group(1))].append((int(m.group(2) or 0), i, axes[i][0]))
    spec = []
    for d in per_dim:
        names = tuple(n for _, _, n in sorted(d))
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def check_sharded(ckpt, work, src, ref, label, out_root, cmd, axes, placements):
    bad = 0
    print(f"{label}: {' '.join(cmd[1:])}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  ckpt failed ({r.returncode}): {r.stderr.strip()}")
        return 1
    item_dir = os.path.join(out_root, "1", "default")
    n = int(np.prod([k for _, k in axes]))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape([k for _, k in axes]), tuple(a for a, _ in axes))
    want = {name: NamedSharding(mesh, partition_spec(placements[name], axes, ref[name].ndim)) for name in ref}
    # The write shapes (= chunk shapes): each device's box.
    meta = json.load(open(os.path.join(item_dir, "_METADATA")))["tree_metadata"]
    for entry in meta.values():
        name = ".".join(k["key"] for k in entry["key_metadata"])
        ws = entry["value_metadata"].get("write_shape")
        box = list(want[name].shard_shape(ref[name].shape))
        if entry["value_metadata"]["value_type"] != "jax.Array" or ws != box:
            print(f"  [_METADATA] {name}: {entry['value_metadata']}, device box {box}")
            bad += 1
    # 6. No target: jax.Arrays as `_sharding` says.
    got = flatten(ocp.StandardCheckpointer().restore(item_dir))
    for name, a in got.items():
        if isinstance(a, jax.Array) and name in want and a.sharding != want[name]:
            print(f"  [no target] {name}: sharding {a.sharding}, expected {want[name]}")
            bad += 1
    bad += compare("StandardCheckpointer, no target (shardings from _sharding)", got, ref, jax.Array)
    # 7. As numpy.
    restore_args = nest({k: ocp.RestoreArgs(restore_type=np.ndarray) for k in ref})
    got = flatten(ocp.PyTreeCheckpointer().restore(item_dir, restore_args=restore_args))
    bad += compare("PyTreeCheckpointer, restore_type=np.ndarray", got, ref, np.ndarray)
    # 8. Targets: the same mesh, and replicated on 2 devices.
    for tlabel, sh in ((f"target on the {n}-device mesh", want),
                       ("target replicated on 2 devices",
                        {k: NamedSharding(Mesh(np.array(jax.devices()[:2]), ("r",)), P()) for k in ref})):
        target = nest({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in ref.items()})
        got = flatten(ocp.StandardCheckpointer().restore(item_dir, target))
        for name, a in got.items():
            if isinstance(a, jax.Array) and a.sharding != sh[name]:
                print(f"  [{tlabel}] {name}: sharding {a.sharding}, asked {sh[name]}")
                bad += 1
        bad += compare(f"StandardCheckpointer, {tlabel}", got, ref, jax.Array)
    # `_sharding` against orbax's own, for the same arrays on the same mesh.
    theirs = os.path.join(work, f"orbax-{label.split()[0]}")
    shutil.rmtree(theirs, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(theirs, nest({k: jax.device_put(v, want[k]) for k, v in ref.items()}))
    ckptr.wait_until_finished()
    ours_b = open(os.path.join(item_dir, "_sharding"), "rb").read()
    theirs_b = open(os.path.join(theirs, "_sharding"), "rb").read()
    if ours_b != theirs_b:
        print(f"  [_sharding] differs from orbax's:\n    ours   {ours_b[:400]!r}\n    orbax's {theirs_b[:400]!r}")
        bad += 1
    else:
        print(f"  [_sharding] byte for byte orbax's ({len(ours_b)} bytes, {len(ref)} arrays)")
    back = os.path.join(work, f"back-{label.split()[0]}")
    r = subprocess.run([ckpt, "merge", out_root, "-o", back], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  [ckpt reads it back] failed ({r.returncode}): {r.stderr.strip()}")
        return bad + 1
    bad += compare("ckpt reads it back", read_safetensors(os.path.join(back, "model.safetensors")), ref)
    return bad


def reshard_checks(ckpt, work):
    bad = 0
    ref = sharded_source()
    src = os.path.join(work, "sharded.safetensors")
    write_safetensors(src, ref)
    axes = [("dp", 2), ("tp", 4)]
    placements = {k: v[2] for k, v in SHARDED.items()}
    strategy = os.path.join(work, "dp2-tp4.json")
    json.dump(strategy_json(axes, placements), open(strategy, "w"))
    ranks = os.path.join(work, "ranks-dp2-tp4")
    shutil.rmtree(ranks, ignore_errors=True)
    r = subprocess.run([ckpt, "reshard", src, "--strategy", strategy, "-o", ranks], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"ckpt reshard to rank directories failed: {r.stderr.strip()}")
        return 1
    for label, cmd_tail, new_axes in (
        ("strategy dp=2,tp=4 (8 devices)", [src, "--strategy", strategy], axes),
        ("mesh-resized dp=2,tp=2 (4 devices, from rank directories)", [ranks, "--mesh", "tp=2"], [("dp", 2), ("tp", 2)]),
        ("to-4 dp=1,tp=4 (4 devices, from rank directories)", [ranks, "--to", "4"], [("dp", 1), ("tp", 4)]),
    ):
        out_root = os.path.join(work, "sharded-" + label.split()[0], "root")
        shutil.rmtree(os.path.dirname(out_root), ignore_errors=True)
        cmd = [ckpt, "reshard"] + cmd_tail + ["--format", "orbax", "-o", os.path.join(out_root, "1")]
        bad += check_sharded(ckpt, work, src, ref, label, out_root, cmd, new_axes, placements)
    return bad


def find_ckpt():
    for p in ("target/release/ckpt", "target/debug/ckpt"):
        p = os.path.join(ROOT, p)
        if os.path.exists(p):
            return p
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="*", help="safetensors files to merge to Orbax")
    ap.add_argument("--ckpt", default=os.environ.get("CKPT_BIN") or find_ckpt(), help="the ckpt binary")
    ap.add_argument("--work", help="a directory for the outputs (default: a temporary one)")
    a = ap.parse_args()
    if not a.ckpt or not os.path.exists(a.ckpt):
        print("no ckpt binary: build it (cargo build) or pass --ckpt")
        return 2
    print(f"jax {jax.__version__}, orbax-checkpoint {ocp.__version__ if hasattr(ocp, '__version__') else '?'}, "
          f"{len(jax.devices())} CPU devices; ckpt {a.ckpt}")
    work = a.work or tempfile.mkdtemp(prefix="orbax_write_check.")
    sources = list(a.sources)
    mixed = os.path.join(work, "mixed.safetensors")
    write_safetensors(mixed, mixed_source())
    sources.append(mixed)
    bad = 0
    for i, src in enumerate(sources):
        ref = read_safetensors(src)
        for variant, env, item in (
            ("one chunk per array", {}, "default"),
            ("chunks of <= 256 bytes along dim 0", {"CKPT_TEST_ORBAX_CHUNK_BYTES": "256"}, "items"),
        ):
            root = os.path.join(work, f"{i}-{item}", "root")
            shutil.rmtree(os.path.dirname(root), ignore_errors=True)
            cmd = [a.ckpt, "merge", src, "--format", "orbax", "-o", os.path.join(root, "1")]
            if item != "default":
                cmd += ["--orbax-item", item]
            print(f"{os.path.basename(src)} ({len(ref)} arrays), {variant}: {' '.join(cmd[1:])}")
            r = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True)
            if r.returncode != 0:
                print(f"  ckpt failed ({r.returncode}): {r.stderr.strip()}")
                bad += 1
                continue
            bad += check_output(a.ckpt, root, 1, item, ref, work)
    bad += reshard_checks(a.ckpt, work)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    print("FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
