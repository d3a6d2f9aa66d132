#!/usr/bin/env bash
# The main job on the embedded default, in a fresh temporary directory (or $1).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
ckpt="$root/target/release/ckpt"
work="${1:-$(mktemp -d)}"
mkdir -p "$work" && cd "$work"
echo "working in $work"
set -x
"$ckpt" example ex --mesh dp=2,tp=4 --force
"$ckpt" verify ex --deep
"$ckpt" inspect ex
"$ckpt" merge ex -o merged --force
"$ckpt" reshard ex -o r3 --to 3 --force
"$ckpt" verify r3
"$ckpt" reshard r3 -o back --mesh dp=2,tp=4 --force
"$ckpt" merge back -o merged2 --force
cmp merged/model.safetensors merged2/model.safetensors
