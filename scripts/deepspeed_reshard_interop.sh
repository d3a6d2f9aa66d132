#!/usr/bin/env bash
# DeepSpeed loads what `ckpt reshard --format deepspeed --to N` writes: the committed
# 2-rank ZeRO-1/2/3 fixtures (fp32, fp16 and bf16) are written for dp=1, 3 and 4, each
# loaded by DeepSpeed's engine.load_checkpoint on that many gloo CPU ranks;
# fp32 master weights, Adam moments, partitions, padding, loss scaler and step counts
# must equal the source's byte for byte, and one more step must agree with the source's
# (scripts/deepspeed_reshard_interop.py says how).
#
#   scripts/deepspeed_reshard_interop.sh [path/to/ckpt] [--quick]   # default: target/debug/ckpt
#
# Needs torch and deepspeed: a venv under target/ (DS_VENV, default target/venv-ds),
# installed here when missing (several GB of wheels with torch, so it is not part of
# scripts/test.sh; a venv that already has torch only adds deepspeed).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/debug/ckpt
if [ $# -gt 0 ] && [ "$1" != "--quick" ]; then bin=$1; shift; fi
[ -x "$bin" ] || cargo build --quiet
venv=${DS_VENV:-target/venv-ds}
if ! "$venv/bin/python" -c "import torch, deepspeed, safetensors" 2>/dev/null; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch deepspeed ninja safetensors
fi
# DeepSpeed logs every rank's setup on stderr; the script's verdicts are on stdout.
"$venv/bin/python" scripts/deepspeed_reshard_interop.py --ckpt "$bin" "$@" 2>/dev/null
