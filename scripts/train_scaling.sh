#!/bin/sh
# Thread-rank scaling of `train-bench`, as ratios of runs made one after the other (this
# machine's speed drifts between minutes, so ratios within a round are what to compare).
#
#   scripts/train_scaling.sh MODEL STEPS ROUNDS     e.g. resnet 40 5, or mlp 1000 5
#
# Per round: 1 rank, 2 ranks, 1 rank on one core (RAYON_NUM_THREADS=1), then PyTorch
# (scripts/torch_train_bench.py) with 1 and 2 threads when CKPT_TORCH_PYTHON names a
# Python with torch. Needs `cargo build --release -p ckpt-train --bin train-bench`.
set -eu
m=$1 steps=$2 rounds=$3
here=$(cd "$(dirname "$0")/.." && pwd)
bench="$here/target/release/train-bench"
ckpt() { TRAIN_BENCH_CHILD=1 "$bench" --models "$m" --ranks "$1" --steps "$steps" | awk -v m="$m" '$1 == m { print $5 }'; }
torch() {
  if [ -n "${CKPT_TORCH_PYTHON:-}" ]; then
    "$CKPT_TORCH_PYTHON" "$here/scripts/torch_train_bench.py" "$m" "$steps" "$1"
  else
    echo nan
  fi
}
i=0
while [ "$i" -lt "$rounds" ]; do
  i=$((i + 1))
  one=$(CKPT_TORCH_PYTHON="" ckpt 1)
  two=$(CKPT_TORCH_PYTHON="" ckpt 2)
  core=$(CKPT_TORCH_PYTHON= RAYON_NUM_THREADS=1 ckpt 1)
  t1=$(torch 1)
  t2=$(torch 2)
  echo "$one $two $core $t1 $t2" | awk '{
    printf "1 rank %s, 2 ranks %s, 1 rank on 1 core %s, torch 1 thread %s, 2 threads %s", $1, $2, $3, $4, $5
    printf " | 2r/1r %.2f, 2r/1r-on-1-core %.2f, 1r/1r-on-1-core %.2f, torch 2t/1t %.2f, 1r-on-1-core/torch-1t %.2f\n", $2/$1, $2/$3, $1/$3, $5/$4, $3/$4
  }'
done
