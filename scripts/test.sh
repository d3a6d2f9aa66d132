#!/usr/bin/env bash
# Runs every test of the workspace. The Python interoperability tests need numpy and
# safetensors: they are installed into a virtual environment under target/ (nothing
# system-wide), found by the tests through CKPT_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/py
if ! "$venv/bin/python" -c "import numpy, safetensors" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check numpy safetensors
fi
export CKPT_PYTHON="$PWD/$venv/bin/python"
cargo test --workspace "$@"
