#!/usr/bin/env bash
# Each trainer's save (a ~1.05 GB fp32 Llama, written by the trainer's own code on the
# CPU) exported as a Hugging Face model with `ckpt merge OUTPUT_DIR --format hf`, against
# `cat` + `sync` of the bytes the export writes (issue 45's anchor: at most 1.1x, peak RSS
# at most 64 MiB), and beside it the trainer's own converter, its time and peak RSS.
#
#   HF_PYTHON=/path/venv-hf/bin/python RL_PYTHON=/path/venv-rl/bin/python \
#     [ROUNDS=3] [TRAINERS="hf_trainer lightning verl torchtitan megatron_bridge nemo2"] \
#     [KEEP_SAVES=1] scripts/trainers_bench.sh [OUT_DIR]          # default target/trainers-bench
#
# HF_PYTHON: torch, transformers, accelerate, lightning (the Python of
# scripts/fixtures/trainers_hf_trainer.py and trainers_lightning.py); RL_PYTHON: verl and
# torchtitan (trainers_verl.py, trainers_torchtitan.py); MC_PYTHON: megatron-core and
# pyyaml (trainers_megatron_bridge.py, with BRIDGE_GIT and MEGATRON_LM_GIT: git object
# stores of Megatron-Bridge and Megatron-LM holding the generator's pinned commits). A
# trainer whose Python or sources are missing is skipped, saying so. CKPT: the ckpt binary
# (default the release build).
#
# The saves: the fixture generators with TRAINERS_FX_* sizes (scripts/fixtures/
# trainers_size.py; defaults below: hidden 1024, 13 layers, FFN 4096, 16 heads in 4 groups,
# vocabulary 32000: 262M parameters, 1.05 GB of fp32), one training step (AdamW: the save
# is ~3 GB, the optimizer's moments included), 2 gloo ranks; made once under
# OUT_DIR/<trainer>/ (a `.complete` marker) and, to keep the disk in use under ~6 GB,
# deleted after the trainer's rounds unless KEEP_SAVES=1. Rounds and logs: OUT_DIR/results/.
#
# Per trainer: one untimed export (its output becomes the `cat` source: the bytes the
# export writes), then ROUNDS rounds of scripts/cat_bench.sh (page cache warm with the
# save and the source, outputs deleted, sync, SETTLE_SECONDS, order alternating):
#   cat  : cat of the export's own files into one file, then sync
#   ckpt : ckpt merge OUTPUT_DIR --format hf [--hf-config] -o out, then sync
# then ROUNDS runs of the trainer's converter (settled the same way), its time + sync and
# peak RSS (/usr/bin/time). A table at the end; every round is in OUT_DIR/results/<trainer>/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-target/trainers-bench}
ckpt=${CKPT:-target/release/ckpt}
rounds=${ROUNDS:-3}
hf_py=${HF_PYTHON:-python3}
rl_py=${RL_PYTHON:-python3}
mc_py=${MC_PYTHON:-python3}
trainers=${TRAINERS:-hf_trainer lightning verl torchtitan megatron_bridge nemo2}
[ -x "$ckpt" ] || { echo "build first: cargo build --release -p ckpt (or CKPT=...)" >&2; exit 1; }
export TRAINERS_FX_HIDDEN=${TRAINERS_FX_HIDDEN:-1024} TRAINERS_FX_LAYERS=${TRAINERS_FX_LAYERS:-13} \
  TRAINERS_FX_FFN=${TRAINERS_FX_FFN:-4096} TRAINERS_FX_HEADS=${TRAINERS_FX_HEADS:-16} \
  TRAINERS_FX_KV_HEADS=${TRAINERS_FX_KV_HEADS:-4} TRAINERS_FX_VOCAB=${TRAINERS_FX_VOCAB:-32000} \
  TRAINERS_FX_STEPS=${TRAINERS_FX_STEPS:-1}
step=$TRAINERS_FX_STEPS
. scripts/cat_bench.sh
mkdir -p "$root"
summary="$root/summary.txt"
: > "$summary"

skip() { echo "$t: skipped: $*"; echo "$t|skip|$*" >> "$summary"; }

# Makes the save of $t once: generator $1 run by $py with the arguments after it.
make_save() {
  [ -f "$dir/.complete" ] && return 0
  echo "$t: making the save ($1) ..."
  local gen=$1; shift
  if ! "$py" -P "scripts/fixtures/$gen" "$@" > "$root/$t.gen.log" 2>&1; then
    tail -20 "$root/$t.gen.log"; return 1
  fi
  touch "$dir/.complete"
}

# Times the trainer's converter ($conv_cmd, writing $conv_out) ROUNDS times.
time_converter() {
  local r
  for r in $(seq 1 "$rounds"); do
    rm -rf "$conv_out" "$output" "$out/cat.bin"
    mkdir -p "$conv_out"
    cat "${inputs[@]}" > /dev/null
    sync; sleep "${SETTLE_SECONDS:-3}"
    t0=$(now)
    if ! /usr/bin/time -f "%M" -o "$out/conv_rss.txt" "${conv_cmd[@]}" > "$out/converter.log" 2>&1; then
      tail -5 "$out/converter.log"; echo "$t: the converter failed" >&2; return 1
    fi
    sync; t1=$(now)
    echo "$t0 $t1 $(tail -1 "$out/conv_rss.txt") $(du -cb "$conv_out" | tail -1 | cut -f1)" >> "$out/converter.txt"
    echo "converter round $r: $(echo "$t1 - $t0" | bc) s, peak RSS $(($(tail -1 "$out/conv_rss.txt") / 1024)) MiB"
  done
}

for t in $trainers; do
  out="$root/results/$t"
  output="$out/hf"
  conv_out="$out/converter_out"
  case $t in
    hf_trainer)
      py=$hf_py; dir="$root/hf_trainer_fsdp"; save="$dir/trainer_out"
      "$py" -c "import accelerate, transformers" 2>/dev/null || { skip "HF_PYTHON ($py) lacks accelerate/transformers"; continue; }
      make_save trainers_hf_trainer.py "$root" || { skip "the generator failed ($root/$t.gen.log)"; continue; }
      flags=(--hf-config "$dir/config.json")
      conv_name="accelerate merge_fsdp_weights"
      conv_cmd=("$py" -c 'import sys; from accelerate.utils import merge_fsdp_weights; merge_fsdp_weights(sys.argv[1], sys.argv[2], safe_serialization=True)'
                "$save/checkpoint-$step/pytorch_model_fsdp_0" "$conv_out") ;;
    lightning)
      py=$hf_py; dir="$root/lightning_fsdp"; save="$dir/lightning_out"
      "$py" -c "import lightning, transformers" 2>/dev/null || { skip "HF_PYTHON ($py) lacks lightning/transformers"; continue; }
      make_save trainers_lightning.py "$dir" || { skip "the generator failed ($root/$t.gen.log)"; continue; }
      flags=(--hf-config "$dir/config.json")
      conv_name="Lightning consolidate_checkpoint (a full .ckpt, optimizer included: not Hugging Face)"
      conv_cmd=("$py" -m lightning.pytorch.utilities.consolidate_checkpoint
                "$save/lightning_logs/version_0/checkpoints/epoch=0-step=$step.ckpt" --output_file "$conv_out/consolidated.ckpt") ;;
    verl)
      py=$rl_py; dir="$root/verl_fsdp"; save="$dir/verl_out"
      "$py" -c "import verl" 2>/dev/null || { skip "RL_PYTHON ($py) lacks verl"; continue; }
      make_save trainers_verl.py "$dir" || { skip "the generator failed ($root/$t.gen.log)"; continue; }
      flags=()
      conv_name="verl model_merger (writes bf16)"
      conv_cmd=(env VERL_PLATFORM=cpu VERL_ENGINE_DEVICE=cuda VERL_USE_EXTERNAL_PLUGINS=none
                "$py" -P -m verl.model_merger merge --backend fsdp --local_dir "$save/global_step_$step/actor"
                --target_dir "$conv_out") ;;
    torchtitan)
      py=$rl_py; dir="$root/torchtitan"; save="$dir/outputs"
      "$py" -c "import torchtitan" 2>/dev/null || { skip "RL_PYTHON ($py) lacks torchtitan"; continue; }
      make_save trainers_torchtitan.py "$dir" || { skip "the generator failed ($root/$t.gen.log)"; continue; }
      flags=(--hf-config "$dir/config.json")
      conv_name="torchtitan convert_to_hf (scripts/torchtitan_to_hf.py)"
      conv_cmd=("$py" -P scripts/torchtitan_to_hf.py "$save/checkpoint/step-$step" "$conv_out") ;;
    megatron_bridge)
      py=$mc_py; dir="$root/megatron_bridge"; save="$dir/nemo_experiments"
      [ -n "${BRIDGE_GIT:-}" ] && [ -n "${MEGATRON_LM_GIT:-}" ] ||
        { skip "its layout is read from Megatron-Bridge's and Megatron-LM's source: give BRIDGE_GIT and MEGATRON_LM_GIT (git object stores)"; continue; }
      "$py" -c "import megatron.core, yaml" 2>/dev/null || { skip "MC_PYTHON ($py) lacks megatron-core/pyyaml"; continue; }
      # hf_megatron.py's sizes: the same model, TP2 x PP2 on 4 gloo ranks (the layers
      # rounded up to a multiple of the 2 stages: 14 by default, 1.13 GB).
      export HF_FX_HIDDEN=$TRAINERS_FX_HIDDEN HF_FX_LAYERS=$(((TRAINERS_FX_LAYERS + 1) / 2 * 2)) HF_FX_FFN=$TRAINERS_FX_FFN \
        HF_FX_HEADS=$TRAINERS_FX_HEADS HF_FX_GROUPS=$TRAINERS_FX_KV_HEADS HF_FX_VOCAB=$TRAINERS_FX_VOCAB
      make_save trainers_megatron_bridge.py "$dir" --bridge-git "$BRIDGE_GIT" --megatron-lm-git "$MEGATRON_LM_GIT" ||
        { skip "the generator failed ($root/$t.gen.log)"; continue; }
      flags=()
      conv_name="not run: Megatron-Bridge's AutoBridge.export_ckpt imports Transformer Engine (CUDA), and its current releases need Python 3.12"
      conv_cmd=() ;;
    nemo2)
      skip "its generator (trainers_nemo2.py, megatron-core plus a second Python for NeMo's context files) is not sized for a benchmark yet; its weights are a dist_ckpt as megatron_bridge's (module. prefix). Its converter, nemo.collections.llm.export_ckpt, imports Transformer Engine (CUDA) and its current releases need Python 3.12"
      continue ;;
    *) echo "unknown trainer $t" >&2; exit 2 ;;
  esac
  mkdir -p "$out"
  echo "== $t: $(du -sb "$save" | cut -f1 | awk '{printf "%.2f GB", $1 / 1e9}') saved by the trainer"
  ckpt_cmd=("$ckpt" merge "$save" --format hf "${flags[@]}" -o "$output" --quiet)
  rm -rf "$output" "$out/cat_src"
  if ! "${ckpt_cmd[@]}" > "$out/export.log" 2>&1; then
    cat "$out/export.log"; skip "ckpt merge failed ($out/export.log)"; continue
  fi
  mkdir -p "$out/cat_src"
  mv "$output"/*.safetensors "$out/cat_src/"
  # Warm: the trainer's save (what ckpt reads) and the cat source; cat reads the latter.
  mapfile -t inputs < <(find "$save" -type f | sort)
  mapfile -t cat_inputs < <(find "$out/cat_src" -type f | sort)
  label="ckpt merge --format hf;HF safetensors"
  written_bytes() { du -cb "$output"/*.safetensors | tail -1 | cut -f1; }
  cat_bench | tee "$out/ckpt.txt"
  : > "$out/converter.txt"
  if [ ${#conv_cmd[@]} -gt 0 ]; then
    time_converter || { skip "the converter failed ($out/converter.log)"; continue; }
  fi
  python3 - "$out/rounds.txt" "$out/converter.txt" "$t" "$conv_name" >> "$summary" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
conv = [list(map(float, l.split())) for l in open(sys.argv[2])]
cat = statistics.median(r[1] - r[0] for r in rows)
ck = statistics.median(r[3] - r[2] for r in rows)
ratio = statistics.median((r[3] - r[2]) / (r[1] - r[0]) for r in rows)
conv_cols = [f"{statistics.median(c[1] - c[0] for c in conv):.2f}", f"{max(c[2] for c in conv) / 1024:.0f}",
             f"{conv[0][3] / 1e9:.2f}"] if conv else ["-", "-", "-"]
print("|".join([sys.argv[3], "ok", f"{rows[0][5] / 1e9:.2f}", f"{cat:.2f}", f"{ck:.2f}", f"{ratio:.2f}",
                f"{max(r[4] for r in rows) / 1024:.0f}", sys.argv[4], *conv_cols]))
PY
  rm -rf "$output" "$conv_out" "$out/cat.bin" "$out/cat_src"
  [ "${KEEP_SAVES:-0}" = 1 ] || rm -rf "$dir"
done

echo
echo "| trainer | HF written (GB) | cat + sync (s) | ckpt + sync (s) | ratio | ckpt peak RSS (MiB) | trainer's converter | its time + sync (s) | its peak RSS (MiB) | it wrote (GB) |"
echo "|---|---|---|---|---|---|---|---|---|---|"
while IFS='|' read -r name status rest; do
  if [ "$status" = skip ]; then
    echo "| $name | skipped: $rest |||||||||"
  else
    IFS='|' read -r gb c k ratio rss cname ct crss cgb <<< "$rest"
    echo "| $name | $gb | $c | $k | ${ratio}x | $rss | $cname | $ct | $crss | $cgb |"
  fi
done < "$summary"
