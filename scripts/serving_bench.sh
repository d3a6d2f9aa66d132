#!/usr/bin/env bash
# Speed and memory of the serving steps (docs/serving.md, issue 47), each beside its
# anchor in the same run:
#   - LoRA: a ~1.1 GB BF16 Llama-shaped base, rank 16 on all seven projections of every
#     layer: `ckpt merge BASE --lora ADAPTER` against `cat` + `sync` of the output (and
#     PEFT's merge_and_unload + save_pretrained where CKPT_PYTHON_PEFT names a Python with
#     torch, transformers and peft);
#   - FP8 -> BF16: a ~1.1 GB block-scaled FP8 checkpoint dequantized, against `cat` + `sync`
#     of the output (DeepSeek's fp8_cast_bf16.py needs Triton on a GPU: not run here).
# Time and peak RSS (GNU time) per command; the inputs are made with numpy (CKPT_PYTHON).
#
#   scripts/serving_bench.sh [WORKDIR]     # WORKDIR default: target/serving-bench
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-target/serving-bench}
py=${CKPT_PYTHON:-target/py/bin/python}
[ -x target/release/ckpt ] || cargo build --release --quiet
ckpt=$PWD/target/release/ckpt
mkdir -p "$work"

if ! [ -f "$work/base/model.safetensors" ]; then
  "$py" - "$work" <<'EOF'
import json, os, struct, sys
import numpy as np

work = sys.argv[1]
H, I, L, V, R, HEADS, KV = 2048, 5632, 12, 1024, 16, 16, 8
rng = np.random.default_rng(0)

def bf16(shape, scale=0.02):
    x = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
    return ((x + 0x8000) >> 16).astype(np.uint16)   # round half up: any bf16 will do

def save(path, tensors, dtypes):
    # A plain safetensors writer (numpy has no bfloat16).
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        b = np.ascontiguousarray(tensors[name]).tobytes()
        header[name] = {"dtype": dtypes[name], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)

hd = H // HEADS
proj = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (KV * hd, H), "self_attn.v_proj": (KV * hd, H),
        "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
base, adapter = {}, {}
base["model.embed_tokens.weight"] = bf16((V, H))
base["lm_head.weight"] = bf16((V, H))
base["model.norm.weight"] = bf16((H,), 1.0)
for l in range(L):
    base[f"model.layers.{l}.input_layernorm.weight"] = bf16((H,), 1.0)
    base[f"model.layers.{l}.post_attention_layernorm.weight"] = bf16((H,), 1.0)
    for m, (o, i) in proj.items():
        base[f"model.layers.{l}.{m}.weight"] = bf16((o, i))
        p = f"base_model.model.model.layers.{l}.{m}"
        adapter[f"{p}.lora_A.weight"] = rng.standard_normal((R, i), dtype=np.float32) * 0.1
        adapter[f"{p}.lora_B.weight"] = rng.standard_normal((o, R), dtype=np.float32) * 0.01
save(f"{work}/base/model.safetensors", base, {k: "BF16" for k in base})
save(f"{work}/adapter/adapter_model.safetensors", adapter, {k: "F32" for k in adapter})
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "vocab_size": V, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False}, open(f"{work}/base/config.json", "w"))
json.dump({"peft_type": "LORA", "r": R, "lora_alpha": 32, "use_rslora": False, "fan_in_fan_out": False,
           "target_modules": sorted({m.split(".")[1] for m in proj}), "base_model_name_or_path": "base",
           "task_type": "CAUSAL_LM", "bias": "none"}, open(f"{work}/adapter/adapter_config.json", "w"))
# FP8: the same projections as E4M3 codes (no NaN codes) with a scale per 128x128 block.
fp8, dt = {}, {}
for name, t in base.items():
    if t.ndim == 2 and "layers" in name:
        o, i = t.shape
        fp8[name] = rng.integers(0, 0x7E, size=(o, i), dtype=np.uint8) | (rng.integers(0, 2, size=(o, i), dtype=np.uint8) << 7)
        dt[name] = "F8_E4M3"
        s = f"{name}_scale_inv"
        fp8[s] = rng.random(((o + 127) // 128, (i + 127) // 128), dtype=np.float32) * 1e-3
        dt[s] = "F32"
    else:
        fp8[name], dt[name] = t, "BF16"
# Twice the layers, so that the BF16 output is over 1 GB like the LoRA one.
for name in list(fp8):
    if ".layers." in name:
        l = int(name.split(".")[2])
        twin = name.replace(f".layers.{l}.", f".layers.{l + L}.", 1)
        fp8[twin], dt[twin] = fp8[name], dt[name]
save(f"{work}/fp8/model.safetensors", fp8, dt)
json.dump({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
           "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}, open(f"{work}/fp8/config.json", "w"))
EOF
fi

# Runs a command, prints "label  seconds  peak RSS MiB".
# (Leaves "seconds KiB" in t.)
measure() {
  local label=$1
  shift
  /usr/bin/time -f '%e %M' "$@" >/dev/null 2>"$work/time.err" || { cat "$work/time.err" >&2; exit 1; }
  t=$(tail -n 1 "$work/time.err")
  printf '%-44s %8s s %8d MiB\n' "$label" "${t% *}" $(( ${t#* } / 1024 ))
}

# One round: the command, then the anchor on its output; ratios per round (rounds
# alternate, so both see the same noise), ROUNDS of them (default 3).
rounds=${ROUNDS:-3}
compare() {
  local label=$1 out=$2
  shift 2
  local r ratios=()
  for r in $(seq 1 "$rounds"); do
    rm -rf "$out"
    sync
    measure "$label (round $r)" "$@"
    local t_cmd=${t% *}
    rm -f "$work/cat.out"
    measure "  anchor: cat + sync of the output" bash -c "cat $out/*.safetensors > $work/cat.out && sync"
    rm -f "$work/cat.out"
    ratios+=("$(awk -v a="$t_cmd" -v b="${t% *}" 'BEGIN { printf "%.2f", a / b }')")
  done
  rm -rf "$out"
  echo "  ratio to cat + sync per round: ${ratios[*]}"
}

echo "serving_bench: $(du -sh "$work/base" | cut -f1) base, rank-16 adapter on 7 projections"
compare "ckpt merge --lora" "$work/merged" "$ckpt" merge "$work/base" --lora "$work/adapter" -o "$work/merged" -q
if [ -n "${CKPT_PYTHON_PEFT:-}" ]; then
  rm -rf "$work/peft"
  measure "  PEFT merge_and_unload + save_pretrained" "$CKPT_PYTHON_PEFT" -c "
import sys, torch, transformers, peft
m = transformers.AutoModelForCausalLM.from_pretrained('$work/base', dtype=torch.bfloat16)
m = peft.PeftModel.from_pretrained(m, '$work/adapter').merge_and_unload()
m.save_pretrained('$work/peft')"
  rm -rf "$work/peft"
else
  echo "  PEFT: SKIPPED (set CKPT_PYTHON_PEFT to a Python with torch, transformers and peft)"
fi

echo "serving_bench: $(du -sh "$work/fp8" | cut -f1) FP8 checkpoint -> BF16"
compare "ckpt merge --dtype bf16 (FP8 dequantized)" "$work/bf16" "$ckpt" merge "$work/fp8" --dtype bf16 -o "$work/bf16" -q
echo "  DeepSeek fp8_cast_bf16.py: not run (its weight_dequant is a Triton kernel: GPU only)"
