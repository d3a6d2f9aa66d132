#!/usr/bin/env bash
# Many-tensor benchmark (issue 49): the cost per tensor and per piece, with tensors made
# tiny so that the bytes do not count. For each size and layout it prints each
# command's wall time and peak RSS beside two anchors measured in the same run: the
# safetensors library opening the same files and listing their keys (the least a
# reader can do), and `cat` + `sync` of the files (the copy itself).
#
#   scripts/scale_bench.sh                 # 1,000 / 10,000 / 100,000 tensors
#   LAYERS="200 2000" scripts/scale_bench.sh
#   PIECES=1 scripts/scale_bench.sh        # also 1,000,000 pieces (125,002 tensors x 8)
#
# Layouts: ckpt's sliced rank directories (`ckpt example --mesh tp=8`, five tensors a
# layer), the same as one integrated file (its merge), and as DCP sharded safetensors
# on 8 ranks (the integrated file cut on every tensor's first dimension). Needs the release build and a Python
# with safetensors (CKPT_PYTHON, default target/py/bin/python, which scripts/test.sh
# makes).
set -euo pipefail
cd "$(dirname "$0")/.."
ckpt=${CKPT:-target/release/ckpt}
py=${CKPT_PYTHON:-target/py/bin/python}
[ -x "$ckpt" ] || { echo "build first: cargo build --release" >&2; exit 1; }
"$py" -c "import safetensors" 2>/dev/null || { echo "$py has no safetensors" >&2; exit 1; }
layers=(${LAYERS:-200 2000 20000})
[ -z "${PIECES:-}" ] || layers+=(25000)
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-scale.XXXXXX")
trap 'rm -rf "$work"' EXIT

# `seconds peak_MiB` of a command (its output discarded).
measure() {
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" >/dev/null 2>"$work/err" || {
    cat "$work/err" >&2
    echo "failed: $*" >&2
    echo failed
    return
  }
  awk '{printf "%s s %d MiB", $1, $2 / 1024}' "$work/time"
}

# The safetensors library: every file's header opened and its keys listed.
list_keys() {
  "$py" - "$@" <<'EOF'
import sys
from safetensors import safe_open
n = 0
for path in sys.argv[1:]:
    with safe_open(path, "np") as f:
        n += len(list(f.keys()))
print(n)
EOF
}

cat_sync() {
  cat "$@" >"$work/cat.out"
  sync "$work/cat.out"
  rm -f "$work/cat.out"
}
# /usr/bin/time runs programs, not functions: through bash.
export -f list_keys cat_sync
export py work

row() { printf '| %-9s | %-16s | %-22s | %-18s |\n' "$@"; }

echo "ckpt: $ckpt ($(git rev-parse --short HEAD 2>/dev/null || echo '?')); $(nproc) cores"
row tensors layout command "time, peak RSS"
row --- --- --- ---
for n in "${layers[@]}"; do
  src="$work/ex$n"
  "$ckpt" example "$src" --mesh tp=8 --hidden 16 --vocab 64 --layers "$n" >/dev/null
  tensors=$("$ckpt" inspect "$src" --json | "$py" -c 'import json,sys; print(len(json.load(sys.stdin)["tensors"]))')
  whole="$work/whole$n"
  "$ckpt" merge "$src" -o "$whole" >/dev/null
  # DCP holds one box per tensor and rank (no blocked shards): every weight cut on
  # its first dimension over 8 ranks, from the whole copy.
  dcp="$work/dcp$n"
  "$ckpt" reshard "$whole" --to 8 --shard '*.weight=0' --format dcp-safetensors -o "$dcp" >/dev/null
  for layout in sliced dcp whole; do
    case $layout in
      sliced) in=$src; files=("$src"/ckpt_*/model.safetensors) ;;
      dcp) in=$dcp; files=("$dcp"/*.safetensors) ;;
      whole) in=$whole; files=("$whole"/*.safetensors) ;;
    esac
    sync
    row "$tensors" "$layout" "safetensors list keys" "$(measure bash -c 'list_keys "$@"' _ "${files[@]}")"
    row "$tensors" "$layout" "cat + sync" "$(measure bash -c 'cat_sync "$@"' _ "${files[@]}")"
    for cmd in merge "reshard --to 3" inspect verify; do
      rm -rf "$work/out"
      case $cmd in
        merge) what=(merge "$in" -o "$work/out") ;;
        reshard*) what=(reshard "$in" --to 3 -o "$work/out")
          [ "$layout" != whole ] || what+=(--shard '*.weight=0') ;;
        *) what=($cmd "$in") ;;
      esac
      row "$tensors" "$layout" "$cmd" "$(measure "$ckpt" "${what[@]}")"
    done
  done
  rm -rf "$src" "$dcp" "$whole" "$work/out"
done

# A DeepSeek-V3-shaped mixture as a Hugging Face checkpoint (58 MoE layers x 256
# experts, FP8 weights with their block scales, 90,427 tensors in 8 shards with an
# index; tiny sizes): merged, resharded with the experts cut over 2 ranks, verified.
ds="$work/deepseek"
"$py" scripts/fixtures/deepseek_shaped.py "$ds" >/dev/null
files=("$ds"/*.safetensors)
tensors=$("$ckpt" inspect "$ds" --json | "$py" -c 'import json,sys; print(len(json.load(sys.stdin)["tensors"]))')
sync
row "$tensors" "DeepSeek-V3 HF" "safetensors list keys" "$(measure bash -c 'list_keys "$@"' _ "${files[@]}")"
row "$tensors" "DeepSeek-V3 HF" "cat + sync" "$(measure bash -c 'cat_sync "$@"' _ "${files[@]}")"
rm -rf "$work/out"
row "$tensors" "DeepSeek-V3 HF" "merge" "$(measure "$ckpt" merge "$ds" -o "$work/out")"
rm -rf "$work/out"
row "$tensors" "DeepSeek-V3 HF" "reshard experts / 2" "$(measure "$ckpt" reshard "$ds" --to 2 --shard '*.experts.*=0' -o "$work/out")"
row "$tensors" "DeepSeek-V3 HF" "verify the reshard" "$(measure "$ckpt" verify "$work/out")"
row "$tensors" "DeepSeek-V3 HF" "inspect" "$(measure "$ckpt" inspect "$ds")"
