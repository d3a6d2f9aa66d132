#!/usr/bin/env bash
# Runs every test of the workspace.
# - The Python interoperability tests need numpy and safetensors: they are installed into
#   a virtual environment under target/ (nothing system-wide), found through CKPT_PYTHON.
# - The MPI backend's tests run when Open MPI is installed
#   (apt-get install libopenmpi-dev openmpi-bin libclang-dev; .ci/run does it).
# - The CUDA/NCCL build is checked to compile and to fail cleanly on a machine without
#   a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/py
if ! "$venv/bin/python" -c "import numpy, safetensors" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check numpy safetensors
fi
export CKPT_PYTHON="$PWD/$venv/bin/python"
cargo test --workspace "$@"

# NCCL/CUDA: builds without CUDA (libraries are loaded at run time), and without a GPU
# `ckpt train --backend nccl` must fail with a clear message, not a panic.
cargo test -p ckpt-train --features cuda --lib -- cuda nccl
cargo build --features cuda
if nvidia-smi >/dev/null 2>&1; then
  echo "scripts/test.sh: a GPU is present; the no-GPU error check is skipped"
else
  if out=$(target/debug/ckpt train --backend nccl --ranks 2 --max-steps 1 2>&1); then
    echo "ckpt train --backend nccl should fail without a GPU" >&2
    exit 1
  fi
  echo "$out" | grep -q 'backend `nccl` unavailable: no CUDA driver' || { echo "$out" >&2; exit 1; }
  echo "nccl without a GPU fails as expected: $out"
fi

if command -v mpirun >/dev/null 2>&1; then
  train/tests/mpi.sh
else
  echo "scripts/test.sh: MPI tests not run: apt-get install libopenmpi-dev openmpi-bin libclang-dev" >&2
  [ -z "${CI:-}" ] || exit 1
fi
