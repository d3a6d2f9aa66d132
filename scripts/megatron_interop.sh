#!/usr/bin/env bash
# megatron-core loads what `ckpt reshard --format megatron` writes: from the committed
# TP=2 x PP=2 fixture, ckpt writes legacy checkpoints for pp=1,tp=4 and for pp=4,tp=1; each
# is loaded by megatron-core's GPTModel on that many gloo ranks (CPU) with
# load_state_dict, and the loaded parameters, gathered by Megatron's own attributes,
# must equal tests/fixtures/megatron/tp2pp2/full.safetensors.
#
#   scripts/megatron_interop.sh [path/to/ckpt]    # default: target/debug/ckpt
#
# Needs torch and megatron-core: a venv (MEGATRON_VENV, default target/venv-megatron),
# installed here when missing. scripts/test.sh runs it with its own venv, which already
# has torch. About a minute and a half on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/debug/ckpt}
[ -x "$bin" ] || cargo build --quiet
venv=${MEGATRON_VENV:-target/venv-megatron}
if ! "$venv/bin/python" -c "import torch, megatron.core, safetensors" 2>/dev/null; then
  [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
  # megatron-core 0.16.1 is the version the fixtures were written with.
  "$venv/bin/pip" install -q --disable-pip-version-check torch megatron-core==0.16.1 psutil numpy safetensors
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
full=tests/fixtures/megatron/tp2pp2/full.safetensors
for mesh in pp=1,tp=4 pp=4,tp=1; do
  out="$work/${mesh//[=,]/_}"
  "$bin" reshard tests/fixtures/megatron/tp2pp2/legacy --mesh "$mesh" --format megatron -o "$out" > /dev/null 2>&1
  "$venv/bin/python" scripts/fixtures/megatron_fixtures.py "$full" --load "$out" 2>&1 | grep "megatron-core loaded"
done
