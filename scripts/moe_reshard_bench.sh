#!/usr/bin/env bash
# An expert-parallel Megatron checkpoint of ~1.6 GB (experts ~1.5 GB; EP 4, written by
# megatron-core itself on 4 gloo ranks) resharded to EP 2 with
# `ckpt reshard --format megatron --mesh tp=1,pp=1,ep=2`, against `cat` + `sync` of the
# same input bytes.
#
#   scripts/moe_reshard_bench.sh [OUT_DIR]          # default target/moe-bench
#   ROUNDS=5 CKPT=target/release/ckpt scripts/moe_reshard_bench.sh
#
# Makes the checkpoint with scripts/fixtures/moe_megatron.py (case ep4tp1, legacy
# only: 4 layers, hidden 1024, 8 experts of FFN 4096 with SwiGLU, a shared expert of
# 1024, vocabulary 1024; a venv under target/ with torch + megatron-core, or
# MEGATRON_VENV); then ROUNDS rounds (default 3), each timing, in alternating order
# (odd rounds cat first, even rounds ckpt first),
#   cat  : cat every model_optim_rng.pt into one file, then sync
#   ckpt : ckpt reshard legacy --format megatron --mesh tp=1,pp=1,ep=2 -o out, then sync
# after reading the inputs into the page cache, deleting the previous outputs, syncing
# and waiting SETTLE_SECONDS (default 3). Prints every round, the medians and ckpt's
# peak RSS (/usr/bin/time).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/moe-bench}
. scripts/cat_bench.sh
bench_setup
ck="$out/ep4tp1/legacy"
if [ ! -f "$ck/latest_checkpointed_iteration.txt" ]; then
  mkdir -p "$out"
  MOE_FX_LEGACY_ONLY=1 MOE_FX_LAYERS=4 MOE_FX_HIDDEN=1024 MOE_FX_HEADS=8 MOE_FX_FFN=4096 \
  MOE_FX_MOE_FFN=4096 MOE_FX_SHARED_FFN=1024 MOE_FX_EXPERTS=8 MOE_FX_VOCAB=1024 \
    "$venv/bin/python" scripts/fixtures/moe_megatron.py "$out" --case ep4tp1 --port 29911 > "$out.log" 2>&1 ||
    { tail -20 "$out.log"; exit 1; }
fi
inputs=("$ck"/iter_*/mp_rank_*/model_optim_rng.pt)
output="$out/ep2"
label="ckpt reshard EP4->EP2;EP2 rank files"
ckpt_cmd=("$ckpt" reshard "$ck" --format megatron --mesh tp=1,pp=1,ep=2 -o "$output" --quiet)
written_bytes() { du -cb "$output"/iter_*/*/model_optim_rng.pt | tail -1 | cut -f1; }
cat_bench
