#!/usr/bin/env bash
# Megatron TP=4 -> TP=2 reshard of a legacy checkpoint, against cat + sync of the same
# bytes (Megatron's own converter, tools/checkpoint/convert.py, needs megatron/training,
# which the megatron-core wheel does not ship, and CUDA for its loader).
#
#   scripts/megatron_bench.sh [OUT_DIR]        # default target/megatron-bench
#   ROUNDS=5 CKPT=target/release/ckpt CKPT_OLD=path/to/other/ckpt scripts/megatron_bench.sh
#
# Makes the checkpoint with megatron-core itself (scripts/fixtures/megatron_fixtures.py,
# a venv under target/ with torch + megatron-core), 4 gloo ranks on CPU; then runs
# ROUNDS rounds (default 5), each timing one after the other:
#   cat  : cat every model_optim_rng.pt into one file, then sync
#   ckpt : ckpt reshard legacy --to 2 -o out (ckpt_<r>/model.safetensors), then sync
#   old  : the same with $CKPT_OLD, when given (to compare two builds in one run)
# Alternating the steps within a round spreads the machine's slow and fast moments
# (other processes, the VM's disk writeback) over all of them instead of over one.
# Before each timed step the inputs are read into the page cache (both tools read them
# warm), the previous step's outputs are deleted, everything is synced and the script
# waits SETTLE_SECONDS (default 3) for the deleted blocks' discard, so no earlier
# writeback or discard lands inside a timed step. Prints every round's times and ratios
# (each ckpt time over the cat+sync time of its own round), their medians, and the
# peak RSS of each binary.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/megatron-bench}
venv=target/venv-megatron
ckpt=${CKPT:-target/release/ckpt}
old=${CKPT_OLD:-}
rounds=${ROUNDS:-5}
[ -x "$ckpt" ] || { echo "build first: cargo build --release (or CKPT=target/debug/ckpt)" >&2; exit 1; }
[ -z "$old" ] || [ -x "$old" ] || { echo "CKPT_OLD=$old is not an executable" >&2; exit 1; }
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
inputs=("$ck"/iter_*/mp_rank_*/model_optim_rng.pt)
bytes=$(du -cb "${inputs[@]}" | tail -1 | cut -f1)
now() { date +%s.%N; }
# Untimed: outputs of the last step gone, inputs in the page cache, nothing dirty.
settle() {
  rm -rf "$out/cat.bin" "$out/tp2"
  cat "${inputs[@]}" > /dev/null
  sync
  # Without a pause, a step started right after the previous outputs were deleted ran
  # in one of two regimes (0.3 or 1.0 s of system CPU for ckpt) decided by which step
  # came before it, not by the binary; waiting lets the delete's aftermath (this VM's
  # ext4 is mounted with `discard`) settle, so every step starts alike.
  sleep "${SETTLE_SECONDS:-3}"
}
results="$out/rounds.txt"
: > "$results"
# One timed run of binary $1 (after settling): "start end rss user sys".
timed_ckpt() {
  settle
  local a b
  a=$(now)
  /usr/bin/time -f "%M %U %S" -o "$out/rss.txt" "$1" reshard "$ck" --to 2 -o "$out/tp2" > /dev/null 2>&1
  sync; b=$(now)
  echo "$a $b $(cat "$out/rss.txt")"
}
for r in $(seq 1 "$rounds"); do
  settle
  t0=$(now)
  /usr/bin/time -f "%M %U %S" -o "$out/cat_t.txt" cat "${inputs[@]}" > "$out/cat.bin"
  sync; t1=$(now)
  cat_t=$(cat "$out/cat_t.txt")
  # With two builds, their order alternates from round to round: a step's place in the
  # round (what the step before it left to the kernel to reclaim) must not favour one.
  if [ -n "$old" ] && [ $((r % 2)) -eq 0 ]; then
    o=$(timed_ckpt "$old"); n=$(timed_ckpt "$ckpt")
  else
    n=$(timed_ckpt "$ckpt"); [ -z "$old" ] || o=$(timed_ckpt "$old")
  fi
  read -r t2 t3 rss <<< "$n"
  line="$r $t0 $t1 $t2 $t3 $rss $cat_t"
  [ -z "$old" ] || line="$line $o"
  echo "$line" >> "$results"
done
settle
python3 - "$bytes" "$results" <<'PY'
import statistics, sys
b = int(sys.argv[1])
rows = [l.split() for l in open(sys.argv[2]) if l.strip()]
med = statistics.median
# Per row: round t0 t1 t2 t3 rss user sys cat_rss cat_user cat_sys [t4 t5 rss user sys]
cats, cks, olds, rss, rss_old, cpu = [], [], [], [], [], {"cat": [], "ckpt": [], "old": []}
print(f"megatron legacy tp=4 -> tp=2, {b / 1e6:.0f} MB, {len(rows)} rounds")
for row in rows:
    cat = float(row[2]) - float(row[1]); ck = float(row[4]) - float(row[3])
    cats.append(cat); cks.append(ck); rss.append(int(row[5]))
    cpu["ckpt"].append(float(row[6]) + float(row[7]))
    cpu["cat"].append(float(row[9]) + float(row[10]))
    msg = f"  round {row[0]}: cat+sync {cat:.2f} s, ckpt {ck:.2f} s ({ck / cat:.2f}x)"
    if len(row) > 11:
        o = float(row[12]) - float(row[11]); olds.append(o); rss_old.append(int(row[13]))
        cpu["old"].append(float(row[14]) + float(row[15]))
        msg += f", old ckpt {o:.2f} s ({o / cat:.2f}x)"
    print(msg)
print(f"median: cat+sync {med(cats):.2f} s, ckpt reshard {med(cks):.2f} s, "
      f"ratio {med([k / c for k, c in zip(cks, cats)]):.2f}x cat+sync, "
      f"ckpt peak RSS {max(rss) / 1024:.0f} MiB")
if olds:
    print(f"median old ckpt {med(olds):.2f} s, ratio "
          f"{med([o / c for o, c in zip(olds, cats)]):.2f}x cat+sync, "
          f"peak RSS {max(rss_old) / 1024:.0f} MiB")
# CPU seconds (user + system) of the processes themselves: steadier than wall time on
# a loaded machine (the writeback threads' and sync's work is in neither).
print("median CPU s: " + ", ".join(f"{k} {med(v):.2f}" for k, v in cpu.items() if v))
PY
