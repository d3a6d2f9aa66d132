#!/usr/bin/env bash
# Builds and runs ckpt's fuzz targets (cargo-fuzz, nightly toolchain).
#
#   scripts/fuzz.sh                 # every target for 60 seconds each
#   scripts/fuzz.sh 600             # every target for 10 minutes each
#   scripts/fuzz.sh 600 checkpoint  # one target
#
# Each run starts from the committed seed corpus (fuzz/corpus/<target>, read only) and
# keeps what it finds in target/fuzz-corpus/<target>; a crash is saved under
# fuzz/artifacts/<target>/ and fails the script. The last line of each run (libFuzzer's
# `Done N runs in S second(s)`) is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=($(sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^ckpt-fuzz$'))
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "scripts/fuzz.sh: no nightly toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
command -v cargo-fuzz >/dev/null 2>&1 || cargo install --quiet --locked cargo-fuzz

# Every target at once when all are run: one cargo invocation links them side by side
# (a build per target's call ran the links one after the other).
start=$SECONDS
if [ $# -eq 0 ]; then
  (cd fuzz && cargo +nightly fuzz build -O >/dev/null 2>&1)
fi
for t in "${targets[@]}"; do
  (cd fuzz && cargo +nightly fuzz build -O "$t" >/dev/null 2>&1)
done
echo "scripts/fuzz.sh: ${#targets[@]} targets built in $((SECONDS - start)) s"
# Each target runs on one core: as many side by side as there are cores (CI's 2 halve
# the time of the runs).
fuzz_one() {
  local t=$1 work="target/fuzz-corpus/$1" log="target/fuzz-$1.log"
  mkdir -p "$work" "fuzz/corpus/$t"
  local seeds
  seeds=$(ls "fuzz/corpus/$t" | wc -l)
  if ! (cd fuzz && cargo +nightly fuzz run -O "$t" "../$work" "corpus/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=4096 -print_final_stats=1) >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "scripts/fuzz.sh: $t found a crash (see $log and fuzz/artifacts/$t/)" >&2
    return 1
  fi
  { echo "fuzz $t for ${secs}s (seeds: $seeds)"
    grep -E '^Done [0-9]+ runs|stat::number_of_executed_units|stat::peak_rss_mb' "$log" | sed "s/^/  $t: /"
  }
}
side_by_side=$(nproc 2>/dev/null || echo 1)
# Each run leaves its exit status in a file: the statuses are read once all have ended.
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$side_by_side" ]; do
    wait -n || true
  done
  rm -f "target/fuzz-$t.status"
  { status=0; fuzz_one "$t" || status=1; echo "$status" >"target/fuzz-$t.status"; } &
done
wait
failed=0
for t in "${targets[@]}"; do
  [ "$(cat "target/fuzz-$t.status" 2>/dev/null)" = 0 ] || failed=1
done
[ "$failed" -eq 0 ] || exit 1
echo "scripts/fuzz.sh: ${#targets[@]} targets run, $side_by_side at a time, in $((SECONDS - start)) s in all"
