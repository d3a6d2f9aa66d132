#!/usr/bin/env bash
# megatron-core's GroupedMLP experts (~1.6 GB of them; EP 2, written by megatron-core
# itself on 2 gloo ranks) written as a megatron-core dist_ckpt with
# `ckpt reshard --format megatron-dist --mesh tp=1,pp=1`: every expert the transpose of
# a run of the grouped weights, read through the copy engine's transposed views;
# against `cat` + `sync` of the same input bytes.
#
#   scripts/moe_grouped_bench.sh [OUT_DIR]          # default target/moe-grouped-bench
#   ROUNDS=5 CKPT=target/release/ckpt scripts/moe_grouped_bench.sh
#
# Makes the checkpoint with scripts/fixtures/moe_megatron.py (case ep2grouped, legacy
# only: 4 layers, hidden 1024, 8 experts of FFN 4096 with SwiGLU, vocabulary 1024; a
# venv under target/ with torch + megatron-core, or MEGATRON_VENV); then the rounds of
# scripts/cat_bench.sh (alternating order, page cache warm, outputs deleted and synced
# before each step; medians and ckpt's peak RSS).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/moe-grouped-bench}
. scripts/cat_bench.sh
bench_setup
ck="$out/ep2grouped/legacy"
if [ ! -f "$ck/latest_checkpointed_iteration.txt" ]; then
  mkdir -p "$out"
  MOE_FX_LEGACY_ONLY=1 MOE_FX_LAYERS=4 MOE_FX_HIDDEN=1024 MOE_FX_HEADS=8 MOE_FX_FFN=4096 \
  MOE_FX_MOE_FFN=4096 MOE_FX_SHARED_FFN=1024 MOE_FX_EXPERTS=8 MOE_FX_VOCAB=1024 \
    "$venv/bin/python" scripts/fixtures/moe_megatron.py "$out" --case ep2grouped --port 29913 > "$out.log" 2>&1 ||
    { tail -20 "$out.log"; exit 1; }
fi
inputs=("$ck"/iter_*/mp_rank_*/model_optim_rng.pt)
output="$out/dist"
label="ckpt reshard GroupedMLP->dist_ckpt;dist_ckpt files"
ckpt_cmd=("$ckpt" reshard "$ck" --format megatron-dist --mesh tp=1,pp=1 -o "$output" --quiet)
written_bytes() { du -cb "$output"/iter_*/*.distcp | tail -1 | cut -f1; }
cat_bench
