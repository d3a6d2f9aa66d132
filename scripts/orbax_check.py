"""Checks an Orbax checkpoint directory against a reference safetensors file.

    python scripts/orbax_check.py DIR REFERENCE.safetensors [--step N] [--item NAME]
                                  [--no-numpy] [--no-mesh] [--no-raw]

DIR may be an item directory (holding `_METADATA`), a step directory (holding
item directories, or itself an item as StandardCheckpointer writes it), or a
CheckpointManager root (the latest *complete* step is taken, see
`complete_steps`; `--step` picks another). Every array of the checkpoint is
compared, byte for byte, with the tensor of the same name in REFERENCE (names:
tree keys joined with `.`, e.g. `params.layer0.kernel`); the sets of names, the
dtypes and the shapes must match too. Three independent readers are run:

1. orbax, restoring every leaf as a numpy array without a target
   (`RestoreArgs(restore_type=np.ndarray)`);
2. orbax, restoring every leaf as a jax.Array onto a 1-D mesh of all local
   devices (first axis sharded when it divides, else replicated; run with
   XLA_FLAGS=--xla_force_host_platform_device_count=4 -- set by this script if
   XLA_FLAGS is unset -- so that it is a real reshard);
3. "raw": a small pure-Python reader of the on-disk format as docs/orbax.md
   describes it (OCDBT manifest / version tree / B+tree nodes, zarr v2 and v3
   with sharding_indexed, zstd), using no tensorstore; it needs the `zstandard`
   package and is skipped with a note if that is missing.

If REFERENCE ends in `.json` and DIR is a bare OCDBT database (has
`manifest.ocdbt`, no `_METADATA`), only the raw OCDBT reader runs and its
key/value pairs are compared with the JSON (`{"latest": {key: hex}, ...,
"generation_N": {...}}`), as for tests/fixtures/orbax/ocdbt_multilevel.

Exits 0 if everything matches, 1 on any mismatch, 2 on usage errors.
"""

import argparse
import json
import os
import struct
import sys

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

try:
    import ml_dtypes  # noqa: E402

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    BF16 = None

try:
    import zstandard  # noqa: E402
except ImportError:
    zstandard = None


# =========================================================================== safetensors

_ST = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        dt = BF16 if h["dtype"] == "BF16" else np.dtype(_ST[h["dtype"]]).newbyteorder("<")
        s, e = h["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + s : 8 + n + e], dtype=dt).reshape(tuple(h["shape"]))
    return out


# =========================================================================== locating the item


def step_is_complete(step_dir):
    """commit_success.txt, or (older orbax) a non-null commit_timestamp_nsecs, or
    (older still) no _CHECKPOINT_METADATA at all."""
    if os.path.exists(os.path.join(step_dir, "commit_success.txt")):
        return True
    meta = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    if os.path.exists(meta):
        try:
            return json.load(open(meta)).get("commit_timestamp_nsecs") is not None
        except (ValueError, OSError):
            return False
    return True


def complete_steps(root):
    steps = {}
    for name in os.listdir(root):
        p = os.path.join(root, name)
        if name.isdigit() and os.path.isdir(p) and step_is_complete(p):
            steps[int(name)] = p
    return steps


def resolve_item(d, step=None, item=None):
    """Returns the item directory (the one holding _METADATA) for DIR."""
    if os.path.exists(os.path.join(d, "_METADATA")) and item is None:
        return d
    subitems = sorted(n for n in os.listdir(d) if os.path.exists(os.path.join(d, n, "_METADATA")))
    if subitems:
        if item is not None:
            if item not in subitems:
                raise SystemExit(f"no item {item!r} in {d} (items: {subitems})")
            return os.path.join(d, item)
        if len(subitems) != 1:
            raise SystemExit(f"{d} has several items {subitems}: pick one with --item")
        return os.path.join(d, subitems[0])
    steps = complete_steps(d)
    if not steps:
        raise SystemExit(f"{d}: neither an item, a step nor a manager root with complete steps")
    s = max(steps) if step is None else step
    if s not in steps:
        raise SystemExit(f"step {s} is not a complete step of {d} (complete: {sorted(steps)})")
    print(f"manager root: complete steps {sorted(steps)}, using step {s}")
    return resolve_item(steps[s], None, item)


# =========================================================================== comparison


def compare(label, got, ref):
    """got/ref: dict name -> np.ndarray. Returns the number of problems."""
    bad = 0
    for name in sorted(set(ref) - set(got)):
        print(f"[{label}] MISSING in checkpoint: {name}")
        bad += 1
    for name in sorted(set(got) - set(ref)):
        print(f"[{label}] EXTRA in checkpoint (not in reference): {name}")
        bad += 1
    for name in sorted(set(got) & set(ref)):
        g, r = np.asarray(got[name]), ref[name]
        if g.dtype != r.dtype or g.shape != r.shape:
            print(f"[{label}] {name}: dtype/shape {g.dtype}{list(g.shape)} != reference {r.dtype}{list(r.shape)}")
            bad += 1
            continue
        gb = g.astype(g.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
        rb = r.tobytes(order="C")
        if gb != rb:
            nd = int(np.sum(np.frombuffer(gb, np.uint8) != np.frombuffer(rb, np.uint8)))
            print(f"[{label}] {name}: {nd} bytes differ")
            bad += 1
    print(f"[{label}] {len(got)} arrays, {'OK' if not bad else f'{bad} problem(s)'}")
    return bad


def flatten_tree(tree):
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            for attr in ("key", "idx", "name"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
            else:
                parts.append(str(k))
        out[".".join(parts)] = leaf
    return out


# =========================================================================== orbax readers


def orbax_restore(item_dir, mode):
    import jax
    import orbax.checkpoint as ocp
    from absl import logging

    logging.set_verbosity(logging.ERROR)
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(item_dir)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if mode == "numpy":
        args = jax.tree_util.tree_map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    else:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        devs = jax.devices()
        mesh = Mesh(np.array(devs), ("x",))

        def arg(m):
            shape = tuple(m.shape)
            spec = P("x") if shape and shape[0] % len(devs) == 0 else P()
            return ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, spec), global_shape=shape, dtype=m.dtype)

        args = jax.tree_util.tree_map(arg, tree)
    restored = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=args))
    flat = flatten_tree(restored)
    if mode == "mesh":
        for name, a in flat.items():
            if not isinstance(a, jax.Array):
                raise SystemExit(f"[mesh] {name} restored as {type(a)}, not jax.Array")
        print(f"[mesh] restored onto {len(jax.devices())} device(s)")
        flat = {k: np.asarray(v) for k, v in flat.items()}
    return flat


# =========================================================================== raw reader
# Pure Python, as docs/orbax.md describes the format. Only what orbax writes (and
# what tensorstore's OCDBT driver writes) is handled.


def _crc32c_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


_CRC_T = _crc32c_table()


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = _CRC_T[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def zstd_decompress(b):
    # Frames may lack the content size: use the streaming decoder.
    return zstandard.ZstdDecompressor().decompressobj().decompress(b)


class _Reader:
    def __init__(self, b):
        self.b, self.p = b, 0

    def byte(self):
        v = self.b[self.p]
        self.p += 1
        return v

    def varint(self):  # unsigned LEB128
        v = sh = 0
        while True:
            x = self.byte()
            v |= (x & 0x7F) << sh
            sh += 7
            if not x & 0x80:
                return v
            if sh > 63:
                raise ValueError("varint too long")

    def raw(self, n):
        v = bytes(self.b[self.p : self.p + n])
        if len(v) != n:
            raise ValueError("truncated")
        self.p += n
        return v

    def u64le(self):
        return struct.unpack("<Q", self.raw(8))[0]

    def i32le(self):
        return struct.unpack("<i", self.raw(4))[0]

    def at_end(self):
        return self.p == len(self.b)


MANIFEST_MAGIC, VERSION_NODE_MAGIC, BTREE_NODE_MAGIC = 0x0CDB3A2A, 0x0CDB1234, 0x0CDB20DE
MISSING = 2**64 - 1


def ocdbt_unwrap(buf, magic):
    """Outer framing shared by manifests, version tree nodes and B+tree nodes."""
    if len(buf) < 16:
        raise ValueError("too short")
    if struct.unpack(">I", buf[:4])[0] != magic:
        raise ValueError(f"bad magic {buf[:4].hex()} (want {magic:08x})")
    if struct.unpack("<Q", buf[4:12])[0] != len(buf):
        raise ValueError("length field != actual length")
    if crc32c(buf[:-4]) != struct.unpack("<I", buf[-4:])[0]:
        raise ValueError("CRC-32C mismatch")
    r = _Reader(buf[12:-4])
    if r.varint() != 0:
        raise ValueError("unsupported format version")
    comp = r.varint()
    body = buf[12 + r.p : -4]
    if comp == 1:
        body = zstd_decompress(body)
    elif comp != 0:
        raise ValueError(f"unknown compression {comp}")
    return _Reader(body)


def read_data_file_table(r, transitive=b""):
    n = r.varint()
    prefix = [0] + [r.varint() for _ in range(max(n - 1, 0))]
    suffix = [r.varint() for _ in range(n)]
    base_len = [r.varint() for _ in range(n)]
    files, prev = [], b""
    for i in range(n):
        path = prev[: prefix[i]] + r.raw(suffix[i])
        prev = path
        files.append((transitive + path[: base_len[i]], path[base_len[i] :]))
    return files  # (base_path incl. transitive prefix, relative_path)


def _refs(r, n, files):
    fid = [r.varint() for _ in range(n)]
    off = [r.varint() for _ in range(n)]
    ln = [r.varint() for _ in range(n)]
    return [(files[f], o, l) for f, o, l in zip(fid, off, ln)]


def _stats(r, n):
    return list(zip(*[[r.varint() for _ in range(n)] for _ in range(3)]))  # num_keys, tree_bytes, indirect_bytes


def _version_leaf_entries(r, files):
    n = r.varint()
    gens = [r.varint() for _ in range(n)]
    heights = [r.byte() for _ in range(n)]
    locs = _refs(r, n, files)
    _stats(r, n)
    times = [r.u64le() for _ in range(n)]
    return [dict(generation=g, root_height=h, root=l, commit_time=t) for g, h, l, t in zip(gens, heights, locs, times)]


def _version_interior_entries(r, files, with_height, node_height=None):
    n = r.varint()
    gens = [r.varint() for _ in range(n)]
    locs = _refs(r, n, files)
    [r.varint() for _ in range(n)]  # num_generations
    [r.u64le() for _ in range(n)]  # commit_time
    heights = [r.byte() for _ in range(n)] if with_height else [node_height - 1] * n
    return [dict(generation=g, location=l, height=h) for g, l, h in zip(gens, locs, heights)]


class RawOcdbt:
    def __init__(self, root):
        self.root = root
        r = ocdbt_unwrap(open(os.path.join(root, "manifest.ocdbt"), "rb").read(), MANIFEST_MAGIC)
        r.raw(16)  # uuid
        kind = r.byte()
        r.varint(), r.varint()  # max_inline_value_bytes, max_decoded_node_bytes
        self.arity_log2 = r.byte()
        if r.varint() == 1:
            r.i32le()  # zstd level
        if kind != 0:
            raise ValueError("numbered manifests (manifest_kind=1) are not handled here")
        files = read_data_file_table(r)
        self.versions = _version_leaf_entries(r, files)
        self.version_nodes = _version_interior_entries(r, files, True)
        if not r.at_end():
            raise ValueError("trailing bytes in manifest")
        self.nodes = 0

    def read_ref(self, ref):
        (base, rel), off, ln = ref
        with open(os.path.join(self.root, (base + rel).decode()), "rb") as f:
            f.seek(off)
            b = f.read(ln)
        if len(b) != ln:
            raise ValueError(f"short read {base + rel}")
        return b

    def find_version(self, generation=None):
        if generation is None:
            return self.versions[-1]
        for v in self.versions:
            if v["generation"] == generation:
                return v
        # Older generations: descend the version tree. Each manifest entry covers
        # (previous entry's generation, its generation].
        lo = 0
        for e in self.version_nodes:
            if lo < generation <= e["generation"]:
                return self._find_in_version_node(e, generation)
            lo = e["generation"]
        raise KeyError(f"generation {generation} not present")

    def _find_in_version_node(self, entry, generation):
        (base, _), _, _ = entry["location"]
        r = ocdbt_unwrap(self.read_ref(entry["location"]), VERSION_NODE_MAGIC)
        arity_log2, height = r.byte(), r.byte()
        assert arity_log2 == self.arity_log2 and height == entry["height"]
        files = read_data_file_table(r, base)
        if height == 0:
            for v in _version_leaf_entries(r, files):
                if v["generation"] == generation:
                    return v
            raise KeyError(f"generation {generation} not present")
        lo = 0
        for e in _version_interior_entries(r, files, False, height):
            if lo < generation <= e["generation"]:
                return self._find_in_version_node(e, generation)
            lo = e["generation"]
        raise KeyError(f"generation {generation} not present")

    def items(self, generation=None):
        """dict key -> value bytes of one generation (latest by default)."""
        v = self.find_version(generation)
        out = {}
        if v["root"][1] == MISSING:  # empty tree
            return out
        self._walk(v["root"], v["root_height"], b"", out)
        return out

    def _walk(self, ref, height, prefix, out):
        (base, _), _, _ = ref
        r = ocdbt_unwrap(self.read_ref(ref), BTREE_NODE_MAGIC)
        self.nodes += 1
        h = r.byte()
        if h != height:
            raise ValueError(f"node height {h} != expected {height}")
        files = read_data_file_table(r, base)
        n = r.varint()
        pre = [0] + [r.varint() for _ in range(n - 1)]
        suf = [r.varint() for _ in range(n)]
        scp = [r.varint() for _ in range(n)] if h > 0 else None
        keys, prev = [], b""
        for i in range(n):
            k = prev[: pre[i]] + r.raw(suf[i])
            keys.append(k)
            prev = k
        if h > 0:
            locs = _refs(r, n, files)
            _stats(r, n)
            for k, s, loc in zip(keys, scp, locs):
                self._walk(loc, h - 1, prefix + k[:s], out)
        else:
            lens = [r.varint() for _ in range(n)]
            kinds = [r.byte() for _ in range(n)]
            ind = [i for i in range(n) if kinds[i] == 1]
            fids = [r.varint() for _ in ind]
            offs = [r.varint() for _ in ind]
            for i, f, o in zip(ind, fids, offs):
                out[prefix + keys[i]] = self.read_ref((files[f], o, lens[i]))
            for i in range(n):
                if kinds[i] == 0:
                    out[prefix + keys[i]] = r.raw(lens[i])
        if not r.at_end():
            raise ValueError("trailing bytes in b+tree node")


class FileStore:
    """Plain directory key-value store (use_ocdbt=False)."""

    def __init__(self, root):
        self.root = root

    def get(self, key):
        p = os.path.join(self.root, key)
        return open(p, "rb").read() if os.path.isfile(p) else None


class DictStore:
    def __init__(self, d):
        self.d = d

    def get(self, key):
        return self.d.get(key.encode())


_ZARR2_DTYPES = {"<f4": "<f4", "<f8": "<f8", "<f2": "<f2", "<i4": "<i4", "<i8": "<i8", "<i2": "<i2",
                 "|i1": "i1", "|u1": "u1", "<u2": "<u2", "<u4": "<u4", "<u8": "<u8", "|b1": "?"}
_ZARR3_DTYPES = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "int8": "i1", "int16": "<i2",
                 "int32": "<i4", "int64": "<i8", "uint8": "u1", "uint16": "<u2", "uint32": "<u4",
                 "uint64": "<u8", "bool": "?"}


def _dtype(name, table):
    if name == "bfloat16":
        return BF16
    if name not in table:
        raise ValueError(f"dtype {name!r} not handled by the raw reader")
    return np.dtype(table[name])


def _fill(dtype, fill_value):
    if fill_value is None:
        return np.zeros((), dtype)
    if isinstance(fill_value, str):  # "NaN", "Infinity", "-Infinity", or hex "0x..."
        if fill_value.startswith("0x"):
            return np.frombuffer(int(fill_value, 16).to_bytes(dtype.itemsize, "little"), dtype)[0]
        return np.array(float(fill_value.replace("Infinity", "inf")), dtype)
    return np.array(fill_value, dtype)


def _grid(shape, chunks):
    import itertools

    return itertools.product(*[range(-(-s // c)) for s, c in zip(shape, chunks)])


def _place(out, idx, chunks, chunk_arr):
    sl = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, chunks, out.shape))
    out[sl] = chunk_arr[tuple(slice(0, x.stop - x.start) for x in sl)]


def read_zarr2(store, name):
    meta = json.loads(store.get(f"{name}/.zarray"))
    shape, chunks = tuple(meta["shape"]), tuple(meta["chunks"])
    dtype = _dtype(meta["dtype"], _ZARR2_DTYPES)
    assert meta.get("order", "C") == "C" and not meta.get("filters"), meta
    comp = meta.get("compressor")
    sep = meta.get("dimension_separator", ".")
    out = np.full(shape, _fill(dtype, meta.get("fill_value")), dtype)
    for idx in _grid(shape, chunks):
        key = f"{name}/" + (sep.join(map(str, idx)) if idx else "0")
        b = store.get(key)
        if b is None:
            continue
        if comp is not None:
            if comp["id"] != "zstd":
                raise ValueError(f"compressor {comp['id']} not handled by the raw reader")
            b = zstd_decompress(b)
        _place(out, idx, chunks, np.frombuffer(b, dtype).reshape(chunks))
    return out


def _decode_array_codecs(b, codecs, shape, dtype, fill):
    """Codec chain without sharding: [bytes(endian), (zstd)]."""
    for c in reversed(codecs):
        n = c["name"]
        if n == "zstd":
            b = zstd_decompress(b)
        elif n == "crc32c":
            assert crc32c(b[:-4]) == struct.unpack("<I", b[-4:])[0], "chunk crc32c"
            b = b[:-4]
        elif n == "bytes":
            endian = c.get("configuration", {}).get("endian", "little")
            dt = dtype if dtype.itemsize == 1 or dtype == BF16 else dtype.newbyteorder("<" if endian == "little" else ">")
            return np.frombuffer(b, dt).reshape(shape).astype(dtype)
        else:
            raise ValueError(f"codec {n} not handled by the raw reader")
    raise ValueError("no bytes codec")


def _decode_zarr3_chunk(b, codecs, shape, dtype, fill):
    if codecs[0]["name"] != "sharding_indexed":
        return _decode_array_codecs(b, codecs, shape, dtype, fill)
    cfg = codecs[0]["configuration"]
    inner = tuple(cfg["chunk_shape"])
    n_inner = [s // c for s, c in zip(shape, inner)]
    count = int(np.prod(n_inner)) if n_inner else 1
    idx_codecs = cfg.get("index_codecs", [{"name": "bytes"}, {"name": "crc32c"}])
    has_crc = any(c["name"] == "crc32c" for c in idx_codecs)
    isize = 16 * count + (4 if has_crc else 0)
    if cfg.get("index_location", "end") == "end":
        index = b[len(b) - isize :]
    else:
        index = b[:isize]
    if has_crc:
        assert crc32c(index[:-4]) == struct.unpack("<I", index[-4:])[0], "shard index crc32c"
    ent = np.frombuffer(index[: 16 * count], "<u8").reshape(count, 2)
    out = np.full(shape, fill, dtype)
    for k, cidx in enumerate(_grid(shape, inner) if inner else [()]):
        off, nb = int(ent[k, 0]), int(ent[k, 1])
        if off == MISSING and nb == MISSING:
            continue
        arr = _decode_zarr3_chunk(b[off : off + nb], cfg["codecs"], inner, dtype, fill)
        _place(out, cidx, inner, arr)
    return out


def read_zarr3(store, name):
    meta = json.loads(store.get(f"{name}/zarr.json"))
    shape = tuple(meta["shape"])
    grid = meta["chunk_grid"]
    assert grid["name"] == "regular"
    chunks = tuple(grid["configuration"]["chunk_shape"])
    dtype = _dtype(meta["data_type"], _ZARR3_DTYPES)
    fill = _fill(dtype, meta.get("fill_value"))
    cke = meta.get("chunk_key_encoding", {"name": "default"})
    sep = cke.get("configuration", {}).get("separator", "/" if cke["name"] == "default" else ".")
    out = np.full(shape, fill, dtype)
    for idx in _grid(shape, chunks):
        if cke["name"] == "default":
            key = f"{name}/c" + "".join(sep + str(i) for i in idx)
        else:  # v2 encoding
            key = f"{name}/" + (sep.join(map(str, idx)) if idx else "0")
        b = store.get(key)
        if b is None:
            continue
        _place(out, idx, chunks, _decode_zarr3_chunk(b, meta["codecs"], chunks, dtype, fill))
    return out


def raw_read_item(item_dir):
    meta = json.load(open(os.path.join(item_dir, "_METADATA")))
    use_ocdbt = meta.get("use_ocdbt", os.path.exists(os.path.join(item_dir, "manifest.ocdbt")))
    use_zarr3 = meta.get("use_zarr3", False)
    store = DictStore(RawOcdbt(item_dir).items()) if use_ocdbt else FileStore(item_dir)
    out = {}
    for entry in meta["tree_metadata"].values():
        vm = entry["value_metadata"]
        if vm.get("skip_deserialize") or vm["value_type"] not in ("jax.Array", "np.ndarray", "scalar"):
            print(f"[raw] skipping {entry['key_metadata']} ({vm['value_type']})")
            continue
        name = ".".join(str(k["key"]) for k in entry["key_metadata"])
        out[name] = read_zarr3(store, name) if use_zarr3 else read_zarr2(store, name)
    return out


def check_bare_ocdbt(db_dir, expected_json):
    exp = json.load(open(expected_json))
    db = RawOcdbt(db_dir)
    bad = 0
    for label, want in sorted(exp.items()):
        if label == "latest":
            gen = None
        elif label.startswith("generation_"):
            gen = int(label.split("_")[1])
        else:
            continue
        got = {k.decode(): v.hex() for k, v in db.items(gen).items()}
        if got != want:
            missing, extra = set(want) - set(got), set(got) - set(want)
            diff = [k for k in set(want) & set(got) if want[k] != got[k]]
            print(f"[raw-ocdbt] {label}: {len(missing)} missing, {len(extra)} extra, {len(diff)} differing values")
            bad += 1
        else:
            print(f"[raw-ocdbt] {label}: {len(got)} keys OK")
    print(f"[raw-ocdbt] {db.nodes} b+tree nodes read, {len(db.version_nodes)} version node reference(s) in manifest")
    return bad


# =========================================================================== main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("reference")
    ap.add_argument("--step", type=int, help="step to check when DIR is a manager root (default: latest complete)")
    ap.add_argument("--item", help="item name when the step has several (e.g. default, items)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the orbax numpy restore")
    ap.add_argument("--no-mesh", action="store_true", help="skip the orbax restore onto a jax mesh")
    ap.add_argument("--no-raw", action="store_true", help="skip the pure-Python reader")
    a = ap.parse_args()
    if not os.path.isdir(a.dir):
        print(f"not a directory: {a.dir}")
        return 2

    if a.reference.endswith(".json"):
        if zstandard is None:
            print("the raw OCDBT check needs the zstandard package")
            return 2
        bad = check_bare_ocdbt(a.dir, a.reference)
        print("FAIL" if bad else "PASS")
        return 1 if bad else 0

    ref = read_safetensors(a.reference)
    item = resolve_item(os.path.abspath(a.dir), a.step, a.item)
    print(f"item directory: {item}; reference: {len(ref)} arrays")
    bad = 0
    if not a.no_numpy:
        bad += compare("numpy", orbax_restore(item, "numpy"), ref)
    if not a.no_mesh:
        bad += compare("mesh", orbax_restore(item, "mesh"), ref)
    if not a.no_raw:
        if zstandard is None:
            print("[raw] skipped: `pip install zstandard` to run the pure-Python reader")
        else:
            bad += compare("raw", raw_read_item(item), ref)
    print("FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
