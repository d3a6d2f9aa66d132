# Sourced by the benchmarks that time a ckpt command against `cat` + `sync` of the same
# input bytes (hf_export_bench.sh, moe_reshard_bench.sh): `bench_setup` first, then the
# caller sets
#   inputs   the input files (an array)
#   out      a work directory (the outputs go under it)
#   rounds   how many rounds
#   output   what the ckpt command writes (removed before every step)
#   label    the ckpt step's name in the report, and what it writes ("HF safetensors")
#   ckpt_cmd the ckpt command (an array; its peak RSS is taken with /usr/bin/time)
#   cat_inputs (optional) what `cat` reads instead of the inputs, where the anchor is the
#            bytes written rather than the bytes read (trainers_bench.sh: the export's own
#            files); kept in the page cache beside the inputs
# and defines `written_bytes` (the bytes it wrote), then calls `cat_bench`. Each round times both
# steps after reading the inputs into the page cache, deleting the previous outputs,
# syncing and waiting SETTLE_SECONDS (default 3); the order alternates round by round
# (odd rounds `cat` first). Prints every round, the medians and the peak RSS.

# The ckpt binary (CKPT, default the release build), ROUNDS (default 3), and a venv
# with torch and megatron-core for the generators (MEGATRON_VENV, made under target/
# when missing).
bench_setup() {
  venv=${MEGATRON_VENV:-target/venv-megatron}
  ckpt=${CKPT:-target/release/ckpt}
  rounds=${ROUNDS:-3}
  [ -x "$ckpt" ] || { echo "build first: cargo build --release (or CKPT=target/debug/ckpt)" >&2; exit 1; }
  if ! "$venv/bin/python" -c "import torch, megatron.core" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch megatron-core==0.16.1 psutil numpy safetensors
  fi
}

now() { date +%s.%N; }

settle() {
  rm -rf "$out/cat.bin" "$output"
  cat "${inputs[@]}" ${cat_inputs[@]+"${cat_inputs[@]}"} > /dev/null
  sync
  sleep "${SETTLE_SECONDS:-3}"
}

time_cat() {
  settle
  local src=("${inputs[@]}")
  [ -z "${cat_inputs+x}" ] || src=("${cat_inputs[@]}")
  t0=$(now)
  cat "${src[@]}" > "$out/cat.bin"
  sync; t1=$(now)
}

time_ckpt() {
  settle
  t2=$(now)
  /usr/bin/time -f "%M" -o "$out/rss.txt" "${ckpt_cmd[@]}" > /dev/null 2>&1
  sync; t3=$(now)
  written=$(written_bytes)
}

cat_bench() {
  local bytes r
  bytes=$(du -cb "${inputs[@]}" | tail -1 | cut -f1)
  : > "$out/rounds.txt"
  # The order alternates: this VM's disk write-back favours whichever step runs first
  # in a block, and must not favour one tool.
  for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then time_cat; time_ckpt; else time_ckpt; time_cat; fi
    echo "$t0 $t1 $t2 $t3 $(cat "$out/rss.txt") $written" >> "$out/rounds.txt"
  done
  python3 - "$out/rounds.txt" "$bytes" "$label" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
step, what = sys.argv[3].split(";")
cat = [r[1] - r[0] for r in rows]
ck = [r[3] - r[2] for r in rows]
for i, (c, k, r) in enumerate(zip(cat, ck, rows), 1):
    print(f"round {i}: cat+sync {c:.2f} s, {step} + sync {k:.2f} s ({k / c:.2f}x), peak RSS {r[4] / 1024:.0f} MiB")
print(f"inputs {int(sys.argv[2]) / 1e9:.2f} GB, {what} written {rows[0][5] / 1e9:.2f} GB")
print(f"median: cat+sync {statistics.median(cat):.2f} s, ckpt {statistics.median(ck):.2f} s, "
      f"ratio {statistics.median([k / c for c, k in zip(cat, ck)]):.2f}x; peak RSS max {max(r[4] for r in rows) / 1024:.0f} MiB")
PY
}
