#!/usr/bin/env bash
# Runs every test of the workspace.
# - The Python interoperability tests need numpy and safetensors: they are installed into
#   a virtual environment under target/ (nothing system-wide), found through CKPT_PYTHON.
# - The MPI backend's tests run when Open MPI is installed
#   (apt-get install libopenmpi-dev openmpi-bin libclang-dev; .ci/run does it).
# - The CUDA/NCCL build is checked to compile and to fail cleanly on a machine without
#   a GPU; the build with candle's CUDA kernels (cuda-candle) is type-checked with nvcc
#   from NVIDIA's wheels, installed into a venv under target/.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's time, printed as it ends and in a table at the end, so that the next
# regression of CI's time shows where it is (`stage NAME` starts one).
stage_name="" stage_start=$SECONDS stage_log=()
stage() {
  if [ -n "$stage_name" ]; then
    stage_log+=("$(printf '%6d s  %s' $((SECONDS - stage_start)) "$stage_name")")
    echo "scripts/test.sh: stage '$stage_name' took $((SECONDS - stage_start)) s"
  fi
  stage_name=${1:-} stage_start=$SECONDS
}
stage_table() {
  stage
  echo "scripts/test.sh: stage times (total ${SECONDS} s):"
  printf '  %s\n' "${stage_log[@]}"
}
trap stage_table EXIT
# One command of a stage, its time printed and kept for the table (the interop stages
# run several scripts each: their times say which one grew).
timed() {
  local start=$SECONDS name rc=0
  name=$(printf '%s ' "$@" | sed -E 's#^env ##; s#[A-Z_]+=[^ ]+ ##g; s#[^ ]*/bin/(python|pip) #\1 #; s#target/debug/ckpt ?##g; s# +$##')
  # Its status returned, not the echo's: a failure inside `a || timed b` must not pass.
  "$@" || rc=$?
  stage_log+=("$(printf '%6d s    %s' $((SECONDS - start)) "$name")")
  echo "scripts/test.sh: '$name' took $((SECONDS - start)) s (exit $rc)"
  return $rc
}
stage "Debian packages and Python venv"

# The tests' Python packages, in a virtual environment under target/, installed by one
# pip command; beside apt-get when python3-venv is already there (both mostly wait on
# downloads).
venv=target/py
python_env() {
  local pkgs=()
  "$venv/bin/python" -c "import numpy, safetensors" 2>/dev/null || pkgs+=(numpy safetensors)
  # The layout pictures' checks: Selenium drives Chromium, TensorBoard reads event files.
  "$venv/bin/python" -c "import selenium, tensorboard" 2>/dev/null || pkgs+=(selenium tensorboard)
  # Checkpoints in a bucket (tests/storage.rs): a real S3-compatible server, moto's,
  # which the tests start on the loopback address; boto3 (which it brings) checks what
  # ckpt wrote.
  "$venv/bin/python" -c "import moto.server, boto3" 2>/dev/null || pkgs+=("moto[server]")
  [ ${#pkgs[@]} -gt 0 ] || return 0
  "$venv/bin/python" -c "" 2>/dev/null || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${pkgs[@]}"
}
python_job=""
if python3 -m venv --help >/dev/null 2>&1; then
  python_env &
  python_job=$!
fi

# What the tests need from Debian: Open MPI (the MPI backend's tests), Fashion-MNIST
# (an accuracy test), python3-venv. Installed here when missing (as root, as on CI and
# these machines); otherwise the script stops with the line to run, rather than let a
# test that could not run count as passed.
need=()
python3 -m venv --help >/dev/null 2>&1 || need+=(python3-venv)
[ -f /usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz ] || need+=(dataset-fashion-mnist)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need+=(libopenmpi-dev)
dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "scripts/test.sh: missing ${need[*]}: run  sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi
if [ -n "$python_job" ]; then
  wait "$python_job"
else
  python_env
fi
export CKPT_PYTHON="$PWD/$venv/bin/python"
stage "cargo test --workspace"
cargo test --workspace "$@"

# The Python package (python/): built by maturin in the dev profile into this target/
# (its dependencies were compiled just above), installed with torch (CPU) into the venv,
# and its pytest suite run, gloo processes included. pytest exits 5 when it collects
# nothing, which fails here like any failure.
stage "Python package: torch, maturin build, pytest"
timed "$venv/bin/pip" install --quiet --disable-pip-version-check maturin pytest torch
PATH="$PWD/$venv/bin:$PATH" MATURIN_PEP517_ARGS="--profile dev" "$venv/bin/pip" install --quiet --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall ./python
# candle's CUDA kernels (`--device cuda`, feature cuda-candle) need nvcc to build but no
# GPU: NVIDIA's nvcc wheels of CUDA 13.0 (what the GPU machines' driver 580 runs, and
# the cudarc bindings cuda-candle selects) go into a venv under target/ (unless nvcc is
# on PATH), and the GPU code path is type-checked against candle's real CUDA backend: the
# binary and the crates that hold GPU code (train, infer), every target of theirs; the
# other crates' tests, which no CUDA feature changes, are not checked a second time.
# candle compiles its kernels for CUDA_COMPUTE_CAP since there is no GPU to ask. About
# 10 minutes of both cores, so it runs in the background, at the lowest priority, beside
# the interop stages below (Python scripts that mostly keep one core busy); its stage
# near the end waits for it and fails CI if it failed. It starts after the last cargo
# build those stages need (the maturin build above): until the CUDA/NCCL stage no other
# cargo command runs, so it takes target/'s lock from no one.
cuda_candle_check() {
  nvcc_env=()
  if ! command -v nvcc >/dev/null 2>&1; then
    nv=target/nvcc
    if ! [ -x "$nv/cuda/bin/nvcc" ]; then
      python3 -m venv "$nv"
      "$nv/bin/pip" install --quiet --disable-pip-version-check \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85
      site=$("$nv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      ln -sfn "$site/nvidia/cu13" "$nv/cuda"
    fi
    cuda_home="$PWD/$nv/cuda"
    nvcc_env=(PATH="$cuda_home/bin:$PATH" CUDA_HOME="$cuda_home")
  fi
  env "${nvcc_env[@]}" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}" \
    nice -n 19 cargo check -p ckpt -p ckpt-train -p ckpt-infer --all-targets --features cuda-candle
}
# Then, in the same background job (one cargo command at a time: they share target/'s
# lock), the test builds of the last two stages (MPI, CUDA/NCCL without a GPU): about
# 2 minutes of compiling that those stages otherwise spend with the cores idle. They
# leave target/debug/ckpt alone (the scripts before them run it); the stages below run
# the same cargo commands, which then find them built, or build and report a failure.
prebuild_last_stages() {
  if command -v mpirun >/dev/null 2>&1; then
    nice -n 19 cargo test --no-run -p ckpt-train --features mpi --lib --test mpi
  fi
  nice -n 19 cargo test --no-run -p ckpt-train --features cuda --lib
  nice -n 19 cargo build -p ckpt-train --features cuda --bin comm-check
}
cuda_candle=""
if [ -n "${CI:-}" ] || [ -n "${CKPT_CUDA_CHECK:-}" ]; then
  # In a session of its own, so that leaving early (a failed stage) stops all of it.
  export -f cuda_candle_check prebuild_last_stages
  # Its autogroup (a new session's) niced too: `nice` alone weighs only within the
  # group, and the group took half the cores from the interop scripts.
  setsid bash -c 'set -euo pipefail; echo 19 >/proc/self/autogroup 2>/dev/null || true
    cuda_candle_check; prebuild_last_stages' >target/cuda-candle.log 2>&1 &
  cuda_candle=$!
  trap 'kill -- -"$cuda_candle" 2>/dev/null || true; stage_table' EXIT
fi
"$venv/bin/python" -m pytest -q python/tests

# DeepSpeed loads a ZeRO-2 and a ZeRO-3 checkpoint ckpt wrote for 3 data-parallel ranks
# (gloo, CPU): weights and Adam moments byte-equal, one more step agrees. deepspeed added
# to the venv that has torch; about 2 minutes of CPU (the full set:
# scripts/deepspeed_reshard_interop.sh).
stage "DeepSpeed, UCP and MoE interop"
timed env DS_VENV=$venv scripts/deepspeed_reshard_interop.sh target/debug/ckpt --quick
# DeepSpeed's engine loads ckpt's universal checkpoint (merge --format ucp) of the ZeRO-2
# and ZeRO-3 fixtures on 3 gloo ranks: weights and moments bit for bit, one more step.
timed "$venv/bin/python" scripts/ucp_interop.py target/debug/ckpt
# DeepSpeed loads its own MoE checkpoints re-cut by ckpt for another world and EP size
# (reshard --format deepspeed --mesh dp=N,ep=K): weights and moments bit for bit, the
# loss before and after one more step as at the source's own EP size.
timed "$venv/bin/python" scripts/moe_deepspeed_interop.py target/debug/ckpt
# Megatron's per-rank RNG state, carried by `reshard --format megatron` to the same
# TP x PP grid (and to no other): torch.load compares it with the source's.
stage "Megatron interop"
timed "$venv/bin/python" scripts/megatron_rng_check.py target/debug/ckpt
# megatron-core's GPTModel loads the legacy checkpoints ckpt writes for TP=4 and PP=4
# from the TP=2 x PP=2 fixture on that many gloo ranks: every loaded value equal.
timed env MEGATRON_VENV=$venv scripts/megatron_interop.sh target/debug/ckpt
# Hugging Face models to and from Megatron (merge --format hf, reshard --format megatron
# from an HF model): transformers loads every export with Megatron's logits (fp32 and
# bf16), megatron-core loads the imports strictly with transformers' logits, and the
# round trips keep every tensor byte. Needs transformers beside torch and megatron-core
# (installed by the line above). About a minute.
stage "Hugging Face and MoE interop"
# accelerate: transformers loads FP8 models through it (scripts/fp8_transformers_check.py).
"$venv/bin/python" -c "import transformers, accelerate" 2>/dev/null ||
  timed "$venv/bin/pip" install --quiet --disable-pip-version-check transformers accelerate
timed "$venv/bin/python" scripts/hf_interop.py target/debug/ckpt
# Mixture-of-experts models to Hugging Face (Mixtral, Qwen2-MoE, Qwen3-MoE from
# megatron-core's EP2 legacy and dist_ckpt files): transformers loads every export with
# Megatron's logits. Seconds.
timed "$venv/bin/python" scripts/moe_hf_check.py target/debug/ckpt
# Trainers' save directories (HF Trainer + accelerate FSDP, Lightning, verl, torchtitan,
# megatron-core without args) exported by `merge OUTPUT_DIR --format hf`: transformers
# loads each with the trainer's own logits; the bf16 exports are torch's cast. Seconds.
timed "$venv/bin/python" scripts/trainers_check.py target/debug/ckpt
timed "$venv/bin/python" scripts/fp8_transformers_check.py target/debug/ckpt
# Expert-parallel reshards (EP2 -> EP4, EP4 -> EP1 x TP2, EP2 x TP2 -> EP2 x PP2) loaded
# by megatron-core on gloo ranks: every tensor and the logits equal. About a minute.
timed "$venv/bin/python" scripts/moe_reshard_interop.py target/debug/ckpt

# The "By example" blocks of README.md (the recipes) and docs/examples.md (every
# command), each line as written, in order, in a new directory.
stage "README and docs examples"
timed scripts/readme_examples.sh target/debug/ckpt

# Layout pictures: `ckpt inspect --html` in headless Chromium (tensor and piece counts
# against `inspect --json`, sorting, filtering, a screenshot) and `ckpt train`'s
# TensorBoard event file read by TensorBoard's EventAccumulator. About 20 seconds.
stage "layout pictures (Chromium, TensorBoard)"
pics=$(mktemp -d)
timed "$venv/bin/python" scripts/report_browser.py target/debug/ckpt "$pics" "$pics/report.png"
rm -rf "$pics"

# SIGKILL merge, reshard and training saves at random moments: outputs are old, new or
# absent, never partial, and a training run's `latest` always verifies (about a minute).
stage "kill -9 test"
timed scripts/kill_test.sh

stage "cuda-candle type-check (and the MPI and CUDA test builds)"
if [ -z "$cuda_candle" ]; then
  echo "SKIPPED: cuda-candle type-check (10 minutes; runs in CI, or here with CKPT_CUDA_CHECK=1)"
elif wait "$cuda_candle"; then
  echo "cuda-candle (candle's CUDA device) type-checks; MPI and CUDA tests built (background log: target/cuda-candle.log)"
else
  tail -n 60 target/cuda-candle.log >&2
  echo "scripts/test.sh: the background cuda-candle type-check or MPI/CUDA test build failed (log above)" >&2
  exit 1
fi

# NCCL/CUDA: builds without CUDA (libraries are loaded at run time), and without a GPU
# `ckpt train --backend nccl` must fail with a clear message, not a panic.
stage "CUDA/NCCL build without a GPU"
cargo test -p ckpt-train --features cuda --lib -- cuda nccl
cargo build --features cuda
# comm-check (scripts/gpu_check.sh's NCCL check) checks every collective's result; here
# on the thread backend, and without a GPU its NCCL run must name the missing driver.
cargo build -p ckpt-train --features cuda --bin comm-check
target/debug/comm-check --backend threads --mesh dp=2,tp=2 | grep -q '"ok": true'
if ! nvidia-smi >/dev/null 2>&1; then
  if target/debug/comm-check --backend nccl >/dev/null 2>&1; then
    echo "comm-check --backend nccl should fail without a GPU" >&2
    exit 1
  fi
fi
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

stage "MPI backend"
timed train/tests/mpi.sh
