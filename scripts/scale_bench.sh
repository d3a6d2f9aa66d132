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
#   BASE=/tmp/ckpt-old ROUNDS=2 scripts/scale_bench.sh   # before/after, alternated
#   DEEPSEEK=0 scripts/scale_bench.sh      # without the DeepSeek-V3-shaped mixture
#   EXPERTS=0 scripts/scale_bench.sh       # without the Megatron dist_ckpt with experts
#
# With BASE (another ckpt binary, e.g. the release build of the commit before a
# change), every ckpt command runs ROUNDS times (default 2) alternating BASE and CKPT,
# in this one run, and each gets a row: on a shared machine only rounds taken side by
# side compare. Every figure is `wall s (cpu s) peak MiB`; the CPU time (user + sys)
# moves less than the wall time when other work shares the cores.
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
base=${BASE:-}
rounds=${ROUNDS:-2}
[ -x "$ckpt" ] || { echo "build first: cargo build --release" >&2; exit 1; }
[ -z "$base" ] || [ -x "$base" ] || { echo "BASE=$base is not an executable" >&2; exit 1; }
"$py" -c "import safetensors" 2>/dev/null || { echo "$py has no safetensors" >&2; exit 1; }
layers=(${LAYERS:-200 2000 20000})
[ -z "${PIECES:-}" ] || layers+=(25000)
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-scale.XXXXXX")
trap 'rm -rf "$work"' EXIT

# `seconds peak_MiB` of a command (its output discarded).
measure() {
  /usr/bin/time -f "%e %U %S %M" -o "$work/time" "$@" >/dev/null 2>"$work/err" || {
    cat "$work/err" >&2
    echo "failed: $*" >&2
    echo failed
    return
  }
  awk '{printf "%s s (cpu %.2f s) %d MiB", $1, $2 + $3, $4 / 1024}' "$work/time"
}

# One row per run of a ckpt command (`label`, then the arguments after the binary):
# once, or with BASE, ROUNDS alternated rounds of both binaries. The output directory
# is removed before every run.
ckpt_rows() {
  local tensors=$1 layout=$2 label=$3
  shift 3
  if [ -z "$base" ]; then
    rm -rf "$work/out"
    row "$tensors" "$layout" "$label" "$(measure "$ckpt" "$@")"
    return
  fi
  for r in $(seq "$rounds"); do
    for which in base new; do
      local bin=$ckpt
      [ "$which" = new ] || bin=$base
      rm -rf "$work/out"
      row "$tensors" "$layout" "$label ($which, round $r)" "$(measure "$bin" "$@")"
    done
  done
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
[ -z "$base" ] || echo "base: $base, $rounds alternated rounds"
row tensors layout command "time (cpu), peak RSS"
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
      case $cmd in
        merge) what=(merge "$in" -o "$work/out") ;;
        reshard*) what=(reshard "$in" --to 3 -o "$work/out")
          [ "$layout" != whole ] || what+=(--shard '*.weight=0') ;;
        *) what=($cmd "$in") ;;
      esac
      ckpt_rows "$tensors" "$layout" "$cmd" "${what[@]}"
    done
  done
  rm -rf "$src" "$dcp" "$whole" "$work/out"
done

# (DEEPSEEK=0 leaves the DeepSeek-shaped mixture out, EXPERTS=0 the Megatron one.)
if [ "${DEEPSEEK:-1}" = 1 ]; then
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
  ckpt_rows "$tensors" "DeepSeek-V3 HF" "merge" merge "$ds" -o "$work/out"
  ckpt_rows "$tensors" "DeepSeek-V3 HF" "inspect" inspect "$ds"
  # The reshard's output is verified (by the binary under test), so it is kept.
  rm -rf "$work/out"
  row "$tensors" "DeepSeek-V3 HF" "reshard experts / 2" "$(measure "$ckpt" reshard "$ds" --to 2 --shard '*.experts.*=0' -o "$work/out")"
  row "$tensors" "DeepSeek-V3 HF" "verify the reshard" "$(measure "$ckpt" verify "$work/out")"
fi

# A Qwen3-235B-A22B-shaped mixture (94 layers x 128 experts, tiny sizes: 36,946 tensors
# in 8 shards with an index) imported as a megatron-core dist_ckpt with its experts cut
# over tensor- and expert-parallel ranks (`reshard --format megatron-dist --mesh
# tp=4,ep=8`: the experts stacked, every expert's box a piece), then the dist_ckpt
# merged, exported to Hugging Face, inspected and verified: the pieces of a Megatron
# save with experts. EXPERT_LAYERS and EXPERT_COUNT change the shape.
if [ "${EXPERTS:-1}" = 1 ]; then
  moe="$work/qwen3moe"
  "$py" scripts/fixtures/qwen3_moe_shaped.py "$moe" --layers "${EXPERT_LAYERS:-94}" --experts "${EXPERT_COUNT:-128}" >/dev/null
  files=("$moe"/*.safetensors)
  tensors=$("$ckpt" inspect "$moe" --json | "$py" -c 'import json,sys; print(len(json.load(sys.stdin)["tensors"]))')
  sync
  row "$tensors" "Qwen3-MoE HF" "safetensors list keys" "$(measure bash -c 'list_keys "$@"' _ "${files[@]}")"
  row "$tensors" "Qwen3-MoE HF" "cat + sync" "$(measure bash -c 'cat_sync "$@"' _ "${files[@]}")"
  dist="$work/qwen3moe-dist"
  row "$tensors" "Qwen3-MoE HF" "reshard to dist_ckpt" "$(measure "$ckpt" reshard "$moe" --format megatron-dist --mesh tp=4,ep=8 -o "$dist")"
  pieces=$("$ckpt" inspect "$dist" --json | "$py" -c 'import json,sys; t=json.load(sys.stdin)["tensors"]; n = sum(len(x["pieces"]) for x in t); print(len(t), "(%d pieces)" % n)')
  layout="dist_ckpt tp4 ep8"
  row "$pieces" "$layout" "cat + sync" "$(measure bash -c 'cat_sync "$@"' _ "$dist"/*/*.distcp)"
  ckpt_rows "$pieces" "$layout" "merge" merge "$dist" -o "$work/out"
  ckpt_rows "$pieces" "$layout" "merge --format hf" merge "$dist" --format hf -o "$work/out"
  ckpt_rows "$pieces" "$layout" "inspect" inspect "$dist"
  ckpt_rows "$pieces" "$layout" "verify" verify "$dist"
fi
