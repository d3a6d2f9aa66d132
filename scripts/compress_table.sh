#!/usr/bin/env bash
# The compression table of docs/benchmarks.md (issue 26): per model and dtype, compressed/raw of
#   plain zstd -1 of the file, the byte-grouped numpy baseline
#   (scripts/compress_baseline.py), and `ckpt compress` (.ckptz version 2).
#
#   scripts/compress_table.sh [PYTHON]
#
# PYTHON must have numpy and zstandard (default: python3). Uses target/release/ckpt if
# built, else target/debug/ckpt. Trains ResNet-20, the ViT and the MLP for 3 epochs
# (`ckpt train --model M --epochs 3 --save integrated`, digits data, a few seconds
# each) under target/compress-table/, merges each without the optimizer as F32, BF16
# and F16 (`ckpt merge --dtype`), and compresses model.safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
ckpt=target/release/ckpt
[ -x "$ckpt" ] || ckpt=target/debug/ckpt
work=target/compress-table
mkdir -p "$work"
echo "| model | dtype | raw bytes | plain zstd -1 | byte-grouped zstd -1 (numpy) | ckpt compress (.ckptz v2) |"
echo "|---|---|---|---|---|---|"
for m in resnet vit mlp; do
  args=(--model "$m")
  [ "$m" = resnet ] && args+=(--depth 20)
  if [ ! -e "$work/train-$m/latest" ]; then
    "$ckpt" train "${args[@]}" --epochs 3 --save integrated --out "$work/train-$m" -q >/dev/null
  fi
  step="$work/train-$m/$(cat "$work/train-$m/latest")"
  for d in f32 bf16 f16; do
    out="$work/$m-$d"
    rm -rf "$out" "$out.ckptz"
    "$ckpt" merge "$step" -o "$out" --dtype "$d" -q >/dev/null
    "$ckpt" compress "$out/model.safetensors" -o "$out.ckptz" >/dev/null
    z=$(stat -c %s "$out.ckptz")
    "$py" scripts/compress_baseline.py "$out/model.safetensors" | "$py" -c '
import json, sys
r = json.load(sys.stdin)
m, d, z = sys.argv[1:4]
raw = r["bytes"]
print("| {} | {} | {:,} | {:.3f} | {:.3f} | **{:.3f}** |".format(
    m, d.upper(), raw, r["zstd"] / raw, r["grouped"] / raw, int(z) / raw))
' "$m" "$d" "$z"
  done
done
