#!/usr/bin/env python3
"""Compare what a tool produced with the serving references in tests/fixtures/serving/.

  serving_check.py --lora MERGED REFERENCE   [--max-ulp N]
      MERGED: a safetensors file or a directory (all *.safetensors in it, sharded or not).
      REFERENCE: a safetensors file, or an adapter directory (then its merged.safetensors).
      Tensor names, dtypes and shapes must match; values are compared bit for bit and the
      max difference in units in the last place (ulp) of the stored dtype is reported.

  serving_check.py --fp8 OUTPUT REFERENCE    [--max-ulp N]
      Same comparison for FP8 work: OUTPUT is a file or directory, REFERENCE e.g.
      fp8/dequantized_bf16.safetensors or fp8/requant_fp8.safetensors. F8_E4M3 is
      compared as bytes; ulps of e4m3 are steps of the 8-bit sign-magnitude code.

  serving_check.py --gguf FILE REFERENCE.gguf [--ignore-key KEY ...] [--max-ulp N]
      Reads both with gguf-py's GGUFReader: header fields, every metadata key (type and
      value) and every tensor (name, ggml type, shape, raw bytes). Also checks the layout
      rules llama.cpp's gguf.cpp enforces (power-of-two alignment, each tensor's offset
      equal to the running sum of the previous tensors' sizes padded to the alignment).

  serving_check.py --self-test [FIXTURES_DIR]
      Compares every reference with itself (must pass) and with a corrupted copy (must fail).

Exit status: 0 when everything matches (within --max-ulp), 1 on any mismatch, 2 on usage
errors. Needs numpy; --gguf needs the gguf package (pip install gguf); no torch.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

# safetensors dtype -> (bytes per element, is float)
ST_DTYPES = {
    "BOOL": (1, False), "U8": (1, False), "I8": (1, False),
    "F8_E4M3": (1, True), "F8_E5M2": (1, True),
    "U16": (2, False), "I16": (2, False), "F16": (2, True), "BF16": (2, True),
    "U32": (4, False), "I32": (4, False), "F32": (4, True),
    "U64": (8, False), "I64": (8, False), "F64": (8, True),
}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Mismatch:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.notes: list[str] = []

    def err(self, msg: str) -> None:
        self.errors.append(msg)

    def note(self, msg: str) -> None:
        self.notes.append(msg)


# ----------------------------------------------------------------------------- safetensors


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Minimal reader: {name: (dtype, shape, raw little-endian bytes)}."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), data[base + b: base + e])
    return out


def load_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    if path.is_file():
        return read_safetensors(path)
    if not path.is_dir():
        raise SystemExit(f"no such file or directory: {path}")
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in wm.values()})
    if not files:
        raise SystemExit(f"no *.safetensors in {path}")
    out: dict = {}
    for f in files:
        for k, v in read_safetensors(f).items():
            if k in out:
                raise SystemExit(f"tensor {k} appears in more than one file under {path}")
            out[k] = v
    return out


def ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Sign-magnitude float bits -> integers whose difference counts ulps."""
    b = bits.astype(np.int64) if width < 8 else bits.view(np.int64)
    if width < 8:
        sign = np.int64(1) << (8 * width - 1)
        return np.where(b & sign, sign - b, b)
    return np.where(b < 0, np.int64(-(2**63)) - b, b)


def compare_raw(name: str, dtype: str, a: bytes, b: bytes, max_ulp: int, m: Mismatch) -> None:
    if a == b:
        return
    width, is_float = ST_DTYPES.get(dtype, (1, False))
    ua = np.frombuffer(a, dtype=UINT[width])
    ub = np.frombuffer(b, dtype=UINT[width])
    diff = ua != ub
    n = int(diff.sum())
    if is_float:
        ka, kb = ordered(ua, width), ordered(ub, width)
        ulps = np.abs(ka - kb)
        worst = int(ulps.max())
        i = int(np.argmax(ulps))
        msg = (f"{name}: {n}/{ua.size} elements differ, max {worst} ulp "
               f"(first worst at flat index {i}: got 0x{int(ua[i]):0{2 * width}x}, "
               f"reference 0x{int(ub[i]):0{2 * width}x})")
        if worst <= max_ulp:
            m.note(msg + f" [within --max-ulp {max_ulp}]")
        else:
            m.err(msg)
    else:
        m.err(f"{name}: {n}/{ua.size} elements differ ({dtype})")


def compare_safetensors(got_path: Path, ref_path: Path, max_ulp: int, subset: bool = False) -> Mismatch:
    m = Mismatch()
    got = load_tensors(got_path)
    ref = load_tensors(ref_path)
    missing = sorted(set(ref) - set(got))
    extra = [] if subset else sorted(set(got) - set(ref))
    for k in missing:
        m.err(f"missing tensor {k}")
    for k in extra:
        m.err(f"unexpected tensor {k}")
    for k in sorted(set(ref) & set(got)):
        gd, gs, gb = got[k]
        rd, rs, rb = ref[k]
        if gd != rd:
            m.err(f"{k}: dtype {gd}, reference {rd}")
            continue
        if gs != rs:
            m.err(f"{k}: shape {list(gs)}, reference {list(rs)}")
            continue
        compare_raw(k, rd, gb, rb, max_ulp, m)
    m.note(f"compared {len(set(ref) & set(got))} tensors of {len(ref)} in the reference")
    return m


# ----------------------------------------------------------------------------- gguf


def gguf_fields(reader) -> dict[str, tuple[list[str], object]]:
    out = {}
    for name, f in reader.fields.items():
        types = [t.name for t in f.types]
        try:
            val = f.contents()
        except Exception:  # pragma: no cover - very old gguf-py
            val = [p.tolist() for p in f.parts]
        if isinstance(val, np.ndarray):
            val = val.tolist()
        out[name] = (types, val)
    return out


def check_gguf_layout(path: Path, reader, m: Mismatch) -> None:
    align = reader.alignment
    if align <= 0 or align & (align - 1):
        m.err(f"{path}: alignment {align} is not a power of two")
    if reader.data_offset % align:
        m.err(f"{path}: data section starts at {reader.data_offset}, not a multiple of {align}")
    expect = 0
    for t in reader.tensors:
        rel = t.data_offset - reader.data_offset
        if rel != expect:
            m.err(f"{path}: tensor {t.name} at data offset {rel}, llama.cpp expects {expect}")
        expect = rel + ((t.n_bytes + align - 1) // align) * align


def compare_gguf(got_path: Path, ref_path: Path, ignore: set[str], max_ulp: int) -> Mismatch:
    try:
        from gguf import GGUFReader, GGMLQuantizationType
    except ImportError:
        raise SystemExit("--gguf needs the gguf package: pip install gguf")
    m = Mismatch()
    g = GGUFReader(got_path)
    r = GGUFReader(ref_path)
    check_gguf_layout(got_path, g, m)
    gf, rf = gguf_fields(g), gguf_fields(r)
    # header pseudo-fields depend on how many keys there are; compare them only when no key
    # is ignored
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    skip = set(ignore)
    if ignore:
        skip |= {"GGUF.kv_count"}
    for k in sorted(set(rf) | set(gf)):
        if k in skip:
            continue
        if k not in gf:
            m.err(f"missing metadata key {k}")
            continue
        if k not in rf:
            m.err(f"unexpected metadata key {k} = {short(gf[k][1])}")
            continue
        if gf[k][0] != rf[k][0]:
            m.err(f"metadata {k}: type {gf[k][0]}, reference {rf[k][0]}")
        elif gf[k][1] != rf[k][1]:
            m.err(f"metadata {k}: {short(gf[k][1])}, reference {short(rf[k][1])}")
    gorder = [k for k in gf if k not in header]
    rorder = [k for k in rf if k not in header]
    if gorder != rorder and set(gorder) == set(rorder):
        m.note("metadata keys are in a different order (llama.cpp does not care)")
    gt = {t.name: t for t in g.tensors}
    rt = {t.name: t for t in r.tensors}
    for k in sorted(set(rt) - set(gt)):
        m.err(f"missing tensor {k}")
    for k in sorted(set(gt) - set(rt)):
        m.err(f"unexpected tensor {k}")
    if [t.name for t in g.tensors] != [t.name for t in r.tensors] and set(gt) == set(rt):
        m.note("tensors are in a different order (llama.cpp does not care)")
    fl = {GGMLQuantizationType.F32: "F32", GGMLQuantizationType.F16: "F16", GGMLQuantizationType.BF16: "BF16"}
    for k in sorted(set(gt) & set(rt)):
        a, b = gt[k], rt[k]
        if a.tensor_type != b.tensor_type:
            m.err(f"{k}: type {a.tensor_type.name}, reference {b.tensor_type.name}")
            continue
        if list(map(int, a.shape)) != list(map(int, b.shape)):
            m.err(f"{k}: shape (ne) {list(map(int, a.shape))}, reference {list(map(int, b.shape))}")
            continue
        ab, bb = np.asarray(a.data).tobytes(), np.asarray(b.data).tobytes()
        if ab == bb:
            continue
        if a.tensor_type in fl:
            compare_raw(k, fl[a.tensor_type], ab, bb, max_ulp, m)
        elif a.tensor_type == GGMLQuantizationType.Q8_0:
            qa = np.frombuffer(ab, np.uint8).reshape(-1, 34)
            qb = np.frombuffer(bb, np.uint8).reshape(-1, 34)
            da, db = qa[:, :2].copy().view(np.float16), qb[:, :2].copy().view(np.float16)
            sa, sb = qa[:, 2:].view(np.int8).astype(int), qb[:, 2:].view(np.int8).astype(int)
            m.err(f"{k}: Q8_0 {int((qa != qb).any(axis=1).sum())}/{qa.shape[0]} blocks differ; "
                  f"{int((da != db).sum())} scales differ, max |dq| = {int(np.abs(sa - sb).max())}")
        else:
            n = sum(x != y for x, y in zip(ab, bb))
            m.err(f"{k}: {a.tensor_type.name} data differs in {n} of {len(bb)} bytes")
    m.note(f"compared {len(rf)} metadata fields and {len(set(gt) & set(rt))} tensors")
    return m


def short(v, n: int = 120) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + f"... ({len(v) if hasattr(v, '__len__') else '?'} items)"


# ----------------------------------------------------------------------------- self-test


def corrupt_copy(src: Path, dst: Path, kind: str) -> None:
    data = bytearray(src.read_bytes())
    if kind == "safetensors":
        (n,) = struct.unpack("<Q", data[:8])
        pos = 8 + n + 1  # second byte of the first tensor's data
    else:
        from gguf import GGUFReader

        pos = GGUFReader(src).tensors[0].data_offset + 1
    data[pos] ^= 0x01
    dst.write_bytes(bytes(data))


def self_test(root: Path) -> int:
    failures = 0
    cases = []
    for d in sorted((root / "lora").glob("*/merged.safetensors")):
        cases.append(("lora", d, "safetensors"))
    for name in ("dequantized_bf16.safetensors", "requant_fp8.safetensors", "requant_fp8_transformers.safetensors"):
        p = root / "fp8" / name
        if p.exists():
            cases.append(("fp8", p, "safetensors"))
    for p in sorted((root / "gguf").glob("*.gguf")):
        cases.append(("gguf", p, "gguf"))
    with tempfile.TemporaryDirectory() as td:
        for mode, ref, kind in cases:
            same = run(mode, ref, ref, set(), 0, quiet=True)
            bad = Path(td) / ref.name
            corrupt_copy(ref, bad, kind)
            diff = run(mode, bad, ref, set(), 0, quiet=True)
            ok = same == 0 and diff == 1
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {mode:4s} {ref.relative_to(root)}: self {same}, corrupted {diff}")
        # the PEFT path difference must be caught with --max-ulp 0 and reported as such
        a = root / "lora" / "a_qv_r4"
        if (a / "merged_bf16_adapter_targets.safetensors").exists():
            rc = run("lora", a / "merged.safetensors", a / "merged_bf16_adapter_targets.safetensors", set(), 0,
                     quiet=True, subset=True)
            ok = rc == 1
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} lora merged.safetensors vs merged_bf16_adapter_targets: rc {rc} (must differ)")
    print(f"{len(cases) * 2 + 1 - failures} passed, {failures} failed")
    return 1 if failures else 0


# ----------------------------------------------------------------------------- main


def run(mode: str, got: Path, ref: Path, ignore: set[str], max_ulp: int, quiet: bool = False,
        subset: bool = False) -> int:
    if mode in ("lora", "fp8"):
        if ref.is_dir() and (ref / "merged.safetensors").is_file():
            ref = ref / "merged.safetensors"
        m = compare_safetensors(got, ref, max_ulp, subset)
    else:
        m = compare_gguf(got, ref, ignore, max_ulp)
    if not quiet:
        for n in m.notes:
            print(f"note: {n}")
        for e in m.errors:
            print(f"MISMATCH: {e}")
        print(f"{mode}: {'OK' if not m.errors else f'{len(m.errors)} mismatch(es)'} ({got} vs {ref})")
    return 1 if m.errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--lora", nargs=2, metavar=("MERGED", "REFERENCE"), type=Path)
    g.add_argument("--fp8", nargs=2, metavar=("OUTPUT", "REFERENCE"), type=Path)
    g.add_argument("--gguf", nargs=2, metavar=("FILE", "REFERENCE"), type=Path)
    g.add_argument("--self-test", nargs="?", const=Path(__file__).resolve().parents[1] / "tests/fixtures/serving",
                   type=Path, metavar="FIXTURES_DIR")
    ap.add_argument("--max-ulp", type=int, default=0,
                    help="accept float differences up to this many ulps (reported, not failed); default 0")
    ap.add_argument("--subset", action="store_true",
                    help="--lora/--fp8: only check the reference's tensors; extra tensors in the output are fine "
                         "(e.g. against lora/a_qv_r4/merged_bf16_adapter_targets.safetensors)")
    ap.add_argument("--ignore-key", action="append", default=[],
                    help="GGUF metadata key to skip (repeatable), e.g. general.name")
    a = ap.parse_args()
    if a.self_test:
        return self_test(a.self_test)
    mode = "lora" if a.lora else "fp8" if a.fp8 else "gguf"
    got, ref = a.lora or a.fp8 or a.gguf
    return run(mode, got, ref, set(a.ignore_key), a.max_ulp, subset=a.subset)


if __name__ == "__main__":
    sys.exit(main())
