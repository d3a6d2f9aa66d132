#!/usr/bin/env bash
# Megatron TP=4 -> TP=2 reshard of a legacy checkpoint, against cat + sync of the same
# bytes (Megatron's own converter, tools/checkpoint/convert.py, needs megatron/training,
# which the megatron-core wheel does not ship, and CUDA for its loader).
#
#   scripts/megatron_bench.sh [OUT_DIR]        # default target/megatron-bench
#
# Makes the checkpoint with megatron-core itself (scripts/fixtures/megatron_fixtures.py,
# a venv under target/ with torch + megatron-core), 4 gloo ranks on CPU; then times, one
# after the other, with the files in the page cache both times:
#   cat  : cat every model_optim_rng.pt into one file, then sync
#   ckpt : ckpt reshard legacy --to 2 -o out (ckpt_<r>/model.safetensors), then sync
# and prints both wall times, their ratio and ckpt's peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/megatron-bench}
venv=target/venv-megatron
ckpt=${CKPT:-target/release/ckpt}
[ -x "$ckpt" ] || { echo "build first: cargo build --release (or CKPT=target/debug/ckpt)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch megatron-core psutil numpy safetensors
fi
ck="$out/tp4/legacy"
if [ ! -f "$ck/latest_checkpointed_iteration.txt" ]; then
  # ~150M parameters (600 MB of fp32): hidden 1024, 8 layers, ffn 4096, 32000 tokens.
  MEGATRON_FX_LEGACY_ONLY=1 MEGATRON_FX_LAYERS=8 MEGATRON_FX_HIDDEN=1024 \
  MEGATRON_FX_HEADS=16 MEGATRON_FX_GROUPS=4 MEGATRON_FX_FFN=4096 MEGATRON_FX_VOCAB=32000 \
    "$venv/bin/python" scripts/fixtures/megatron_fixtures.py "$out" --tp 4 --pp 1 --name tp4 \
    > "$out.log" 2>&1 || { tail -20 "$out.log"; exit 1; }
fi
bytes=$(du -cb "$ck"/iter_*/mp_rank_*/model_optim_rng.pt | tail -1 | cut -f1)
cat "$ck"/iter_*/mp_rank_*/model_optim_rng.pt > /dev/null   # into the page cache
now() { date +%s.%N; }
rm -f "$out/cat.bin"
t0=$(now); cat "$ck"/iter_*/mp_rank_*/model_optim_rng.pt > "$out/cat.bin"; sync; t1=$(now)
rm -rf "$out/tp2"
t2=$(now)
/usr/bin/time -f "%M" -o "$out/rss.txt" "$ckpt" reshard "$ck" --to 2 -o "$out/tp2" > /dev/null 2>&1
sync; t3=$(now)
rm -f "$out/cat.bin"
python3 - "$bytes" "$t0" "$t1" "$t2" "$t3" "$(cat "$out/rss.txt")" <<'PY'
import sys
b, t0, t1, t2, t3, rss = sys.argv[1:]
b = int(b); cat = float(t1) - float(t0); ck = float(t3) - float(t2)
print(f"megatron legacy tp=4 -> tp=2, {b / 1e6:.0f} MB: cat+sync {cat:.2f} s, "
      f"ckpt reshard {ck:.2f} s ({ck / cat:.2f}x cat), ckpt peak RSS {int(rss) / 1024:.0f} MiB")
PY
