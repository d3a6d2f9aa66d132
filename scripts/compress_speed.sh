#!/usr/bin/env bash
# Reading and writing speed of .ckptz (issue 26), in one run, from the page cache:
#   - `cat` of the uncompressed rank files into one file + `sync` (the floor a merge
#     is compared with), `ckpt merge` and `ckpt reshard --to 4` of the original and of
#     its `ckpt compress`ed copy, and `reshard --to 4 --rank 1` from the copy;
#   - `ckpt compress` and `decompress` on 1 and 2 threads (RAYON_NUM_THREADS), MB/s of
#     raw bytes.
# Each time is the best of 3, wall clock, outputs synced (ckpt syncs before rename).
#
#   scripts/compress_speed.sh
#
# Uses target/release/ckpt if built, else target/debug/ckpt. The checkpoint is the
# README's 30M-parameter MLP trained 40 steps with AdamW on dp=1,tp=2, saved sliced
# (356 MB), made once under target/compress-speed/.
set -euo pipefail
cd "$(dirname "$0")/.."
ckpt=$PWD/target/release/ckpt
[ -x "$ckpt" ] || ckpt=$PWD/target/debug/ckpt
work=target/compress-speed
mkdir -p "$work"
if [ ! -e "$work/train/latest" ]; then
  "$ckpt" train --model mlp \
    --model-config '{"in_features":64,"hidden":4096,"width":1024,"blocks":4,"classes":10}' \
    --mesh dp=1,tp=2 --max-steps 40 --epochs 1 --save sliced --out "$work/train" -q >/dev/null
fi
src="$work/train/$(cat "$work/train/latest")"
z="$work/z"
[ -e "$z" ] || "$ckpt" compress "$src" -o "$z" >/dev/null
raw=$(cat "$src"/ckpt_*/model.safetensors | wc -c)
zbytes=$(cat "$z"/ckpt_*/model.ckptz | wc -c)

# Best wall-clock seconds of 3 runs of "$@", the output $work/out removed before each.
best() {
  local b=999999 t
  for _ in 1 2 3; do
    rm -rf "$work/out"
    sync
    local t0 t1
    t0=$(date +%s.%N)
    "$@" >/dev/null 2>&1
    t1=$(date +%s.%N)
    t=$(echo "$t0 $t1" | awk '{print $2 - $1}')
    b=$(echo "$t $b" | awk '{print ($1 < $2) ? $1 : $2}')
  done
  echo "$b"
}
catsync() { cat "$src"/ckpt_*/model.safetensors >"$work/out" && sync; }
export -f catsync
export src work
floor=$(best bash -c catsync)
row() { # name seconds
  awk -v n="$1" -v s="$2" -v f="$floor" -v r="$raw" \
    'BEGIN { printf "| %s | %.2f | %.2f | %.0f |\n", n, s, s / f, r / s / 1e6 }'
}
echo "raw $raw bytes in $(ls -d "$src"/ckpt_* | wc -l) rank files, compressed $zbytes ($(awk -v a="$zbytes" -v b="$raw" 'BEGIN{printf "%.3f", a/b}'))"
echo
echo "| run | seconds | x cat+sync | MB/s (raw) |"
echo "|---|---|---|---|"
row "cat + sync (uncompressed bytes)" "$floor"
row "ckpt merge (original)" "$(best "$ckpt" merge "$src" -o "$work/out" -q)"
row "ckpt merge (from .ckptz)" "$(best "$ckpt" merge "$z" -o "$work/out" -q)"
row "ckpt reshard --to 4 (original)" "$(best "$ckpt" reshard "$src" -o "$work/out" --to 4 -q)"
row "ckpt reshard --to 4 (from .ckptz)" "$(best "$ckpt" reshard "$z" -o "$work/out" --to 4 -q)"
row "ckpt reshard --to 4 --rank 1 (from .ckptz)" "$(best "$ckpt" reshard "$z" -o "$work/out" --to 4 --rank 1 -q)"
for n in 1 2; do
  row "ckpt compress, $n thread(s)" "$(RAYON_NUM_THREADS=$n best "$ckpt" compress "$src" -o "$work/out")"
  row "ckpt decompress, $n thread(s)" "$(RAYON_NUM_THREADS=$n best "$ckpt" decompress "$z" -o "$work/out")"
done
