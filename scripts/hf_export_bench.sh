#!/usr/bin/env bash
# Megatron TP=4 legacy checkpoint (a Llama-like model of ~1 GB, fp32, written by
# megatron-core itself on 4 gloo ranks) exported as a Hugging Face model with
# `ckpt merge --format hf`, against `cat` + `sync` of the same input bytes.
#
#   scripts/hf_export_bench.sh [OUT_DIR]          # default target/hf-bench
#   ROUNDS=5 CKPT=target/release/ckpt scripts/hf_export_bench.sh
#
# Makes the checkpoint with scripts/fixtures/hf_megatron.py (a venv under target/ with
# torch + megatron-core, or MEGATRON_VENV); then ROUNDS rounds (default 3), each timing,
# in alternating order (odd rounds cat first, even rounds ckpt first),
#   cat  : cat every model_optim_rng.pt into one file, then sync
#   ckpt : ckpt merge legacy --format hf -o out, then sync
# after reading the inputs into the page cache, deleting the previous outputs, syncing
# and waiting SETTLE_SECONDS (default 3). Prints every round and the medians, and ckpt's
# peak RSS (/usr/bin/time). The anchors (Megatron-Bridge, mbridge, transformers'
# Megatron GPT-2 script) are in docs/hf.md with why they do not run here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/hf-bench}
. scripts/cat_bench.sh
bench_setup
ck="$out/llama/legacy"
if [ ! -f "$ck/latest_checkpointed_iteration.txt" ]; then
  mkdir -p "$out"
  # ~285M parameters (1.05 GB of fp32): hidden 1024, 13 layers, SwiGLU MLP 4096,
  # 16 heads in 4 query groups, 32000 tokens; TP 4, one stage.
  HF_FX_LEGACY_ONLY=1 HF_FX_TP=4 HF_FX_PP=1 HF_FX_LAYERS=13 HF_FX_HIDDEN=1024 HF_FX_HEADS=16 HF_FX_GROUPS=4 \
  HF_FX_FFN=4096 HF_FX_VOCAB=32000 \
    "$venv/bin/python" scripts/fixtures/hf_megatron.py "$out" --family llama > "$out.log" 2>&1 ||
    { tail -20 "$out.log"; exit 1; }
fi
inputs=("$ck"/iter_*/mp_rank_*/model_optim_rng.pt)
output="$out/hf"
label="ckpt merge --format hf;HF safetensors"
ckpt_cmd=("$ckpt" merge "$ck" --format hf -o "$output" --quiet)
written_bytes() { du -cb "$output"/*.safetensors | tail -1 | cut -f1; }
cat_bench
