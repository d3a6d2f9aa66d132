#!/usr/bin/env bash
# Reading and writing speed of .ckptz (issue 26), in one run, from the page cache:
#   - the anchor: `cat` of the uncompressed rank files into one file, then `sync` of
#     that file (fsync, as ckpt syncs its outputs before the rename; a bare `sync`
#     would also flush whatever other programs wrote);
#   - `ckpt merge`, `ckpt reshard --to 2` and `reshard --to 2 --rank 1` of the
#     checkpoint's `ckpt compress`ed copy, and merge and reshard of the original;
#   - `ckpt compress` and `decompress` on 1 and 2 threads (RAYON_NUM_THREADS, which
#     sets the size of the thread pool every ckpt command copies and codes in), MB/s of
#     raw bytes.
# Every round times each command once, next to the anchor, and takes the ratio to that
# round's anchor, so a load that changes between rounds moves both; the tables give the
# median of ROUNDS rounds (default 3), wall clock, outputs synced, and the CPU seconds
# (user + system) each took, which a shared machine disturbs less than wall clock.
#
#   scripts/compress_speed.sh            # prints the ratio lines and the table
#   ROUNDS=5 scripts/compress_speed.sh
#
# Uses target/release/ckpt (build it first: cargo build --release --bin ckpt; CKPT=path
# overrides). The checkpoint is docs/benchmarks.md's 30M-parameter MLP trained 40 steps with
# AdamW on dp=1,tp=2, saved sliced (356 MB), made once under target/compress-speed/.
set -euo pipefail
cd "$(dirname "$0")/.."
ckpt=${CKPT:-$PWD/target/release/ckpt}
if [ ! -x "$ckpt" ]; then
  echo "no $ckpt: run cargo build --release --bin ckpt first (or set CKPT)" >&2
  exit 2
fi
rounds=${ROUNDS:-3}
work=target/compress-speed
mkdir -p "$work"
if [ ! -e "$work/train/latest" ]; then
  "$ckpt" train --model mlp \
    --model-config '{"in_features":64,"hidden":4096,"width":1024,"blocks":4,"classes":10}' \
    --mesh dp=1,tp=2 --max-steps 40 --epochs 1 --save sliced --out "$work/train" -q >/dev/null
fi
src="$work/train/$(cat "$work/train/latest")"
z="$work/z"
# Made by this ckpt, so the file is in this build's format.
rm -rf "$z"
"$ckpt" compress "$src" -o "$z" >/dev/null
raw=$(cat "$src"/ckpt_*/model.safetensors | wc -c)
zbytes=$(cat "$z"/ckpt_*/model.ckptz | wc -c)
out=$work/out

# "wall CPU" seconds of "$@" (output discarded; CPU = user + system of it and its
# children), $out removed and dirty pages flushed first, so that no run pays for the
# previous one's writes.
seconds() {
  rm -rf "$out"
  sync
  local tf
  tf=$(mktemp)
  /usr/bin/time -f "%e %U %S" -o "$tf" "$@" >/dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }
  awk '{ printf "%.4f %.4f", $1, $2 + $3 }' "$tf"
  rm -f "$tf"
}
catsync() { cat "$src"/ckpt_*/model.safetensors >"$out" && sync "$out"; }
export -f catsync
export src out

names=(
  "ckpt merge (from .ckptz)"
  "ckpt reshard --to 2 (from .ckptz)"
  "ckpt reshard --to 2 --rank 1 (from .ckptz)"
  "ckpt merge (original)"
  "ckpt reshard --to 2 (original)"
  "ckpt compress, 1 thread"
  "ckpt compress, 2 threads"
  "ckpt decompress, 1 thread"
  "ckpt decompress, 2 threads"
)
run() { # index
  case $1 in
    0) seconds "$ckpt" merge "$z" -o "$out" -q ;;
    1) seconds "$ckpt" reshard "$z" -o "$out" --to 2 -q ;;
    2) seconds "$ckpt" reshard "$z" -o "$out" --to 2 --rank 1 -q ;;
    3) seconds "$ckpt" merge "$src" -o "$out" -q ;;
    4) seconds "$ckpt" reshard "$src" -o "$out" --to 2 -q ;;
    5) RAYON_NUM_THREADS=1 seconds "$ckpt" compress "$src" -o "$out" ;;
    6) RAYON_NUM_THREADS=2 seconds "$ckpt" compress "$src" -o "$out" ;;
    7) RAYON_NUM_THREADS=1 seconds "$ckpt" decompress "$z" -o "$out" ;;
    8) RAYON_NUM_THREADS=2 seconds "$ckpt" decompress "$z" -o "$out" ;;
  esac
}

# results: one line per round and command: "index wall cpu anchor-wall anchor-cpu".
results=$(mktemp)
trap 'rm -f "$results"; rm -rf "$out"' EXIT
for ((r = 1; r <= rounds; r++)); do
  for i in "${!names[@]}"; do
    a=$(seconds bash -c catsync)
    s=$(run "$i")
    echo "$i $s $a" >>"$results"
  done
done

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
col() { awk -v i="$1" -v c="$2" '$1 == i { print $c }' "$results"; }
ratio() { awk -v i="$1" '$1 == i { print $2 / $4 }' "$results"; }
anchor=$(awk '{ print $4 }' "$results" | median)
anchor_cpu=$(awk '{ print $5 }' "$results" | median)

echo "raw $raw bytes in $(ls -d "$src"/ckpt_* | wc -l) rank files, compressed $zbytes ($(awk -v a="$zbytes" -v b="$raw" 'BEGIN { printf "%.3f", a / b }')); $rounds rounds, load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
for i in 0 1 2; do
  printf '%s: %.2f x cat+sync (rounds: %s)\n' "${names[$i]}" "$(ratio "$i" | median)" \
    "$(ratio "$i" | awk '{ printf "%s%.2f", (NR > 1 ? " " : ""), $1 }')"
done
echo
echo "| run | seconds | x cat+sync | MB/s (raw) | CPU seconds |"
echo "|---|---|---|---|---|"
awk -v s="$anchor" -v c="$anchor_cpu" -v r="$raw" 'BEGIN { printf "| cat + sync (uncompressed bytes) | %.2f | 1.00 | %.0f | %.2f |\n", s, r / s / 1e6, c }'
for i in "${!names[@]}"; do
  s=$(col "$i" 2 | median)
  c=$(col "$i" 3 | median)
  x=$(ratio "$i" | median)
  awk -v n="${names[$i]}" -v s="$s" -v x="$x" -v r="$raw" -v c="$c" \
    'BEGIN { printf "| %s | %.2f | %.2f | %.0f | %.2f |\n", n, s, x, r / s / 1e6, c }'
done
