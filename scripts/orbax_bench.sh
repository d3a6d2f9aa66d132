#!/usr/bin/env bash
# Issue 48's speed and memory targets, in one run:
#
# 1. An 8-device Orbax save (544 MiB of float32 and bfloat16 kernels on a (4, 2) CPU
#    mesh, saved by orbax's StandardCheckpointer: OCDBT, one chunk per device's box)
#    merged into one safetensors file by `ckpt merge`, beside what a JAX user runs
#    today: orbax's restore (as numpy) + `safetensors.flax.save_file`
#    (scripts/orbax_bench.py restore). Target: ckpt at most 0.4x the anchor's time,
#    peak RSS at most 64 MiB.
# 2. A ~1 GB MaxText Llama step (scripts/fixtures/maxtext_fixtures.py's tree and save at
#    hidden 1024, 13 layers, vocabulary 32000) exported by `ckpt merge --format hf`,
#    against `cat` + `sync` of the bytes the export writes (scripts/cat_bench.sh).
#    Target: at most 1.2x, 64 MiB. MaxText's own converter needs Python 3.12 and is not
#    run here.
#
#   scripts/orbax_bench.sh [OUT_DIR]      # default target/orbax-bench
#   ROUNDS=5 JAX_PYTHON=/work/venv-jax/bin/python scripts/orbax_bench.sh
#
# Every ckpt and anchor step is timed to its output's `sync`, after reading the inputs
# into the page cache, deleting the previous output, syncing and waiting SETTLE_SECONDS
# (default 3); the order alternates round by round. Needs the release build (CKPT) and a
# Python with jax[cpu], orbax-checkpoint and safetensors (JAX_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/orbax-bench}
ckpt=${CKPT:-target/release/ckpt}
py=${JAX_PYTHON:-/work/venv-jax/bin/python}
rounds=${ROUNDS:-3}
[ -x "$ckpt" ] || { echo "build first: cargo build --release (or CKPT=target/debug/ckpt)" >&2; exit 1; }
"$py" -c "import jax, orbax.checkpoint, safetensors.flax" 2>/dev/null ||
  { echo "$py lacks jax, orbax-checkpoint or safetensors (JAX_PYTHON)" >&2; exit 1; }
mkdir -p "$out"
. scripts/cat_bench.sh

orbax="$out/orbax/ckpt"
[ -f "$orbax/_CHECKPOINT_METADATA" ] || "$py" -P scripts/orbax_bench.py orbax "$out/orbax"
maxtext="$out/maxtext"
[ -d "$maxtext/ckpt/0" ] || "$py" -P scripts/orbax_bench.py maxtext "$maxtext"

# `seconds peak_KiB` of a command, timed to the sync of what it wrote.
timed_to_sync() {
  local t0 t1
  t0=$(now)
  /usr/bin/time -f "%M" -o "$out/rss.txt" "$@" > /dev/null 2>"$out/err.txt" ||
    { cat "$out/err.txt" >&2; echo "failed: $*" >&2; exit 1; }
  sync
  t1=$(now)
  echo "$(python3 -c "print(f'{$t1 - $t0:.2f}')") $(cat "$out/rss.txt")"
}

echo "== 1. Orbax save ($(du -sh "$orbax" | cut -f1)) -> one safetensors file"
inputs=("$orbax")
rows=()
for r in $(seq 1 "$rounds"); do
  for step in $( [ $((r % 2)) -eq 1 ] && echo "anchor ckpt" || echo "ckpt anchor"); do
    output="$out/orbax-$step"
    rm -rf "$output"
    cat $(find "$orbax" -type f) > /dev/null
    sync
    sleep "${SETTLE_SECONDS:-3}"
    if [ "$step" = anchor ]; then
      mkdir -p "$output"
      a=$(timed_to_sync "$py" -P scripts/orbax_bench.py restore "$orbax" "$output/model.safetensors")
    else
      c=$(timed_to_sync "$ckpt" merge "$orbax" -o "$output" --quiet)
    fi
  done
  echo "round $r: orbax restore + safetensors.flax.save_file ${a% *} s (peak RSS $(( ${a#* } / 1024 )) MiB), ckpt merge ${c% *} s (peak RSS $(( ${c#* } / 1024 )) MiB)"
  rows+=("${a% *} ${c% *} ${c#* }")
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
rows = [list(map(float, l.split())) for l in sys.stdin]
a = statistics.median(r[0] for r in rows); c = statistics.median(r[1] for r in rows)
print(f"median: anchor {a:.2f} s, ckpt {c:.2f} s, ratio {statistics.median(r[1] / r[0] for r in rows):.2f}x (target 0.4x); ckpt peak RSS max {max(r[2] for r in rows) / 1024:.0f} MiB (target 64)")'
# Both outputs hold the same tensors, byte for byte (only ckpt writes `__metadata__`).
python3 - "$out/orbax-anchor/model.safetensors" "$out/orbax-ckpt/model.safetensors" <<'PY'
import json, struct, sys
def tensors(path):
    f = open(path, "rb")
    n = struct.unpack("<Q", f.read(8))[0]
    head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    def data(e):
        f.seek(8 + n + e["data_offsets"][0])
        return f.read(e["data_offsets"][1] - e["data_offsets"][0])
    return {k: (e["dtype"], e["shape"], data(e)) for k, e in head.items()}
a, c = (tensors(p) for p in sys.argv[1:])
bad = sorted(k for k in a.keys() | c.keys() if a.get(k) != c.get(k))
print(f"{len(a)} tensors, the same bytes in both outputs" if not bad else f"outputs differ: {bad[:5]}")
sys.exit(1 if bad else 0)
PY

echo "== 2. MaxText step -> Hugging Face"
inputs=($(find "$maxtext/ckpt" -type f))
output="$out/maxtext-hf"
label="ckpt merge --format hf;HF safetensors"
ckpt_cmd=("$ckpt" merge "$maxtext/ckpt" --format hf --hf-config "$maxtext/config.json" -o "$output" --quiet)
written_bytes() { du -cb "$output"/*.safetensors | tail -1 | cut -f1; }
# The anchor is the bytes written (the input also holds the optimizer state the export
# leaves out): `cat` reads the export's own files, kept from a first run.
rm -rf "$output" "$out/maxtext-hf-kept"
"${ckpt_cmd[@]}"
mkdir -p "$out/maxtext-hf-kept"
cp "$output"/*.safetensors "$out/maxtext-hf-kept/"
cat_inputs=("$out/maxtext-hf-kept"/*.safetensors)
cat_bench
