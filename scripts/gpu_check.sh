#!/usr/bin/env bash
# Every GPU check of issue 37 on a GPU machine with no Rust toolchain and no network,
# in one run that ends within 5 minutes whatever hangs, with a JSON summary:
#
#   scripts/gpu_check.sh [OUT_DIR]          (default: $OUT, else ./gpu_check)
#
# Built beforehand, on a machine with Rust, and carried:
#   target/release/ckpt        cargo build --release --features cuda
#                              (--features cuda-candle for the `--device cuda` checks)
#   target/release/comm-check  the same build (cargo build --release -p ckpt-train
#                              --features cuda --bin comm-check)
#   target/wheels/ckpt-*.whl   maturin build --release -m python/Cargo.toml
# Needs there: python3 with torch (CUDA) and safetensors, nvidia-smi, and NCCL
# (libnccl.so.2: on the path, or torch's nvidia-nccl wheel, found below).
#
# Steps, each bounded by what is left of the 5 minutes (`timeout`), each writing
# OUT_DIR/<step>.log; OUT_DIR/gpu_check.json says for each step ok / failed / skipped
# and why, with the figures:
#   device       nvidia-smi: the GPU and driver
#   load         scripts/gpu_load_bench.py: ckpt.load / load_state_dict into GPU memory
#                against the pinned link and safetensors, host RSS added, tensors equal
#   nccl         comm-check --backend nccl at world size 1: every collective through a
#                real communicator of one (NCCL_DEBUG=INFO shows each call; counted)
#   nccl_abort   the same with CKPT_COMM_TIMEOUT far below a collective's time: the
#                communicator is aborted and the error says so
#   nccl_train   ckpt train --backend nccl --ranks 1 against --backend threads: the same
#                losses and checkpoint bytes
#   cuda_train   (a cuda-candle binary only) ckpt train --device cuda for ResNet-20,
#                ResNet-50 (batch 64 and 256) and the ViT, images/s against PyTorch
#                eager (scripts/torch_train_bench.py); the checkpoint verifies and
#                resumes on the CPU; ckpt infer --device cuda gives the CPU's predictions
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$PWD/gpu_check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
deadline=$(( $(date +%s) + 290 ))
ckpt=${CKPT_BIN:-$here/target/release/ckpt}
commcheck=${COMM_CHECK_BIN:-$here/target/release/comm-check}
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
: > "$out/steps.jsonl"

left() { echo $(( deadline - $(date +%s) )); }
# record STEP STATUS JSON-FIGURES-OR-null NOTE
record() {
  "$py" - "$1" "$2" "$3" "$4" >> "$out/steps.jsonl" <<'PY'
import json, sys
step, status, figures, note = sys.argv[1:5]
try:
    figures = json.loads(figures) if figures else None
except ValueError:
    figures = {"unparsed": figures[-2000:]}
print(json.dumps({"step": step, "status": status, "figures": figures, "note": note}))
PY
}
# run STEP CMD...: the command under what is left of the deadline; its output in the log.
run() {
  local step=$1; shift
  local t; t=$(left)
  if [ "$t" -le 10 ]; then
    rc=124
    return 124
  fi
  timeout -k 5 "$t" "$@" >> "$out/$step.log" 2>&1
  rc=$?
  return $rc
}

# device
if info=$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
  record device ok "{\"gpu\": \"$info\"}" ""
else
  record device failed null "nvidia-smi: $info"
fi

# the ckpt package
site=$work/site
wheel=$(ls "$here"/target/wheels/ckpt-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ] && run install "$py" -m pip install -q --no-index --no-deps --target "$site" "$wheel"; then
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  record install ok null "$(basename "$wheel")"
else
  record install failed null "no wheel under target/wheels, or pip failed (install.log)"
fi

# load
if run load "$py" "$here/scripts/gpu_load_bench.py" "$out/load.json" --gib 2 --dir "$work/load"; then
  met=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["targets_met"])' "$out/load.json")
  record load "$([ "$met" = True ] && echo ok || echo below-target)" "$(cat "$out/load.json")" ""
else
  record load failed null "exit $rc (load.log)"
fi

# NCCL: torch's wheel where NCCL is not on the loader's path
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2' && [ -z "${CKPT_NCCL_LIB:-}" ]; then
  lib=$("$py" -c 'import nvidia.nccl, os; d=os.path.join(list(nvidia.nccl.__path__)[0], "lib"); print(os.path.join(d, "libnccl.so.2"))' 2>/dev/null)
  [ -n "$lib" ] && [ -f "$lib" ] && export CKPT_NCCL_LIB=$lib
fi
if run nccl env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL "$commcheck" --backend nccl --mesh dp=1; then
  calls=$(grep -c -E 'AllGather: opCount' "$out/nccl.log")
  res=$(grep '^{' "$out/nccl.log" | tail -1)
  if [ "$calls" -gt 0 ]; then
    record nccl ok "{\"result\": $res, \"nccl_calls_logged\": $calls}" ""
  else
    record nccl failed "{\"result\": $res}" "no collective in NCCL's debug output"
  fi
else
  record nccl failed "$(grep '^{' "$out/nccl.log" | tail -1)" "exit $rc (nccl.log)"
fi
if run nccl_abort env CKPT_COMM_TIMEOUT=0.000001 "$commcheck" --backend nccl --mesh dp=1; then
  record nccl_abort failed null "a collective finished within a microsecond: nothing was aborted"
elif grep -q 'aborted' "$out/nccl_abort.log"; then
  record nccl_abort ok null "$(grep -m1 -o 'did not complete[^"]*' "$out/nccl_abort.log")"
else
  record nccl_abort failed null "no abort in nccl_abort.log"
fi

# NCCL in training: one rank, against threads
train_args=(train --model mlp --ranks 1 --max-steps 40 --json)
if run nccl_train "$ckpt" "${train_args[@]}" --backend threads --out t_threads &&
   run nccl_train env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL "$ckpt" "${train_args[@]}" --backend nccl --out t_nccl; then
  same=$(cmp -s t_threads/step_40/ckpt_0/model.safetensors t_nccl/step_40/ckpt_0/model.safetensors 2>/dev/null && echo true || echo false)
  losses=$(grep -h -o '"final_loss":[^,]*' "$out/nccl_train.log" | tr '\n' ' ')
  calls=$(grep -c -E 'opCount' "$out/nccl_train.log")
  record nccl_train "$([ "$same" = true ] && echo ok || echo failed)" \
    "{\"same_checkpoint_bytes\": $same, \"nccl_calls_logged\": $calls}" "$losses"
else
  record nccl_train failed null "exit $rc (nccl_train.log)"
fi

# the model maths on the GPU (cuda-candle builds only)
probe=$(timeout 60 "$ckpt" train --model mlp --ranks 1 --max-steps 1 --device cuda --out probe -q 2>&1)
if echo "$probe" | grep -q "built without candle's CUDA kernels"; then
  record cuda_train skipped null "the carried binary was built without cuda-candle"
else
  # CIFAR-10 shapes, random content (the speed does not depend on it; no network there).
  "$py" -c 'import os,sys; d=sys.argv[1]; os.makedirs(d, exist_ok=True)
rec = bytearray(os.urandom(3073 * 4096))
for i in range(4096): rec[i * 3073] %= 10
open(os.path.join(d, "data_batch_1.bin"), "wb").write(rec)
open(os.path.join(d, "test_batch.bin"), "wb").write(rec[: 3073 * 512])' cifar
  rows=()
  for spec in "resnet 20 64" "resnet 20 256" "resnet 50 64" "resnet 50 256" "vit 0 64"; do
    set -- $spec
    model=$1 depth=$2 batch=$3
    margs=(--model "$model" --data cifar10:cifar)
    [ "$model" = resnet ] && margs+=(--depth "$depth")
    name="$model$([ "$depth" != 0 ] && echo "$depth")_b$batch"
    if run cuda_train "$ckpt" train "${margs[@]}" --mesh dp=1 --device cuda --batch-size "$batch" \
        --max-steps 30 --json --out "run_$name" > /dev/null; then
      ips=$(grep -h -o '"images_per_sec":[0-9.]*' "$out/cuda_train.log" | tail -1 | cut -d: -f2)
      tname=$([ "$model" = vit ] && echo "" || ([ "$depth" = 50 ] && echo resnet50 || echo resnet))
      tips=null
      [ -n "$tname" ] && tips=$(run cuda_train "$py" "$here/scripts/torch_train_bench.py" "$tname" 30 8 cuda "$batch" && tail -1 "$out/cuda_train.log" || echo null)
      rows+=("\"$name\": {\"ckpt_images_per_sec\": ${ips:-null}, \"torch_images_per_sec\": $tips}")
    else
      rows+=("\"$name\": {\"error\": \"exit $rc\"}")
    fi
  done
  # The GPU-trained checkpoint verifies, resumes on the CPU, and infers the same on both.
  r=run_resnet20_b64
  ok=true
  run cuda_train "$ckpt" verify "$r/step_30" || ok=false
  run cuda_train "$ckpt" train --resume "$r" --device cpu --max-steps 32 --out "$r" -q || ok=false
  a=$(timeout 60 "$ckpt" infer "$r" --device cuda 2>/dev/null | md5sum)
  b=$(timeout 60 "$ckpt" infer "$r" --device cpu 2>/dev/null | md5sum)
  [ "$a" = "$b" ] || ok=false
  record cuda_train "$([ $ok = true ] && echo ok || echo failed)" "{$(IFS=,; echo "${rows[*]}")}" \
    "verify, CPU resume and infer on cuda = cpu: $ok"
fi

"$py" - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
steps = [json.loads(l) for l in open(os.path.join(out, "steps.jsonl")) if l.strip()]
summary = {"steps": steps, "ok": all(s["status"] in ("ok", "skipped") for s in steps)}
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
