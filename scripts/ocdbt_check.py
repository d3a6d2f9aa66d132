"""Checks an OCDBT database directory with tensorstore itself.

    python scripts/ocdbt_check.py DIR EXPECTED.json [--generation N]

Opens DIR with tensorstore's OCDBT driver
(`tensorstore.KvStore.open({'driver': 'ocdbt', 'base': 'file://DIR'})`), lists every
key, reads every value, and compares them with EXPECTED, a JSON object
`{key: value as lowercase hex}` (keys as UTF-8 strings; the Rust tests of
`ckpt-ocdbt` write these next to the databases they write, see
`ocdbt/tests/tensorstore.rs`). With `--generation N` the database is read at that
generation (`version`). Prints what it found and `PASS` or `FAIL`.

Exits 0 if the keys and values match exactly, 1 on any mismatch or tensorstore
error, 2 on usage errors. Needs the `tensorstore` package (the venv
/work/venv-jax has it: tensorstore 0.1.86).
"""

import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("expected")
    ap.add_argument("--generation", type=int)
    a = ap.parse_args()
    if not os.path.isdir(a.dir):
        print(f"not a directory: {a.dir}")
        return 2
    import tensorstore as ts
    from importlib.metadata import version

    want = json.load(open(a.expected))
    spec = {"driver": "ocdbt", "base": "file://" + os.path.abspath(a.dir)}
    if a.generation is not None:
        spec["version"] = a.generation
    try:
        kv = ts.KvStore.open(spec).result()
        keys = kv.list().result()
        got = {}
        for k in keys:
            r = kv.read(k).result()
            if r.state != "value":
                print(f"key {k!r}: listed but read as {r.state}")
                return 1
            got[k.decode("utf-8", "backslashreplace")] = bytes(r.value).hex()
    except Exception as e:  # tensorstore raises ValueError and friends on bad data
        print(f"tensorstore error: {type(e).__name__}: {e}")
        print("FAIL")
        return 1
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    total = sum(len(v) // 2 for v in got.values())
    print(f"{a.dir}: tensorstore {version('tensorstore')} read {len(got)} keys, {total} value bytes")
    for label, ks in (("missing", missing), ("unexpected", extra), ("differing", differ)):
        if ks:
            print(f"  {len(ks)} {label}: {ks[:5]}{' ...' if len(ks) > 5 else ''}")
    # tensorstore lists in no particular order (its B+tree walk is concurrent): only
    # the sets are compared.
    ok = not (missing or extra or differ)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
