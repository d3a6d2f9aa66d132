#!/usr/bin/env bash
# Kills merge, reshard and training saves with SIGKILL at random moments and checks what
# is left: at an output path, either the complete old output or the complete new one
# (or nothing, for an output that did not exist), never a partial one; in a training
# --out, `latest` always names a checkpoint that verifies. Run by scripts/test.sh.
#
#   scripts/kill_test.sh [ITERATIONS]    (default 12 per command; needs target/debug/ckpt)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-12}
ckpt=${CKPT_BIN:-$PWD/target/debug/ckpt}
[ -x "$ckpt" ] || cargo build --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "kill_test: $*" >&2; exit 1; }
# Big enough that a copy takes a few hundred milliseconds.
"$ckpt" example ex --mesh tp=4 --hidden 1024 --vocab 64000 --layers 2 >/dev/null
rand_delay() { awk -v s="$RANDOM" 'BEGIN { srand(s); printf "%.3f", rand() * 0.6 }'; }
sum() { cat "$@" 2>/dev/null | md5sum | cut -d' ' -f1; }

kill_at_random() { # runs "$@" in the background and SIGKILLs it after a random delay
  "$@" >/dev/null 2>&1 &
  local pid=$!
  sleep "$(rand_delay)"
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

check_whole() { # $1: output dir, $2..: acceptable checksums of its safetensors files
  local out=$1; shift
  [ -e "$out" ] || return 0
  "$ckpt" verify "$out" >/dev/null || fail "$out does not verify after a kill"
  local s; s=$(sum $(find "$out" -name '*.safetensors' | sort))
  for ok in "$@"; do [ "$s" = "$ok" ] && return 0; done
  fail "$out is neither the old nor the new output"
}

killed=0
for cmd in merge reshard; do
  case $cmd in
    merge) new=(merge ex -q); old=(merge ex -q --exclude 'embed.*') ;;
    reshard) new=(reshard ex -q --to 2); old=(reshard ex -q --to 3) ;;
  esac
  "$ckpt" "${new[@]}" -o ref_new >/dev/null; "$ckpt" "${old[@]}" -o ref_old >/dev/null
  s_new=$(sum $(find ref_new -name '*.safetensors' | sort))
  s_old=$(sum $(find ref_old -name '*.safetensors' | sort))
  for i in $(seq "$n"); do
    # Replacing an existing output with --force: old or new, never neither.
    rm -rf out; cp -r ref_old out
    kill_at_random "$ckpt" "${new[@]}" -o out --force
    [ -e out ] || fail "$cmd --force killed: the old output is gone"
    check_whole out "$s_old" "$s_new"
    # A fresh output: nothing or the whole new one.
    rm -rf fresh
    kill_at_random "$ckpt" "${new[@]}" -o fresh
    check_whole fresh "$s_new"
    killed=$((killed + 2))
  done
  rm -rf ref_new ref_old out fresh .out.* .fresh.*
done

# Training: save every step, kill at random; `latest` must always verify, and the next
# run (which resumes from it) must clean up and go on.
for i in $(seq "$n"); do
  resume=()
  [ -f run/latest ] && resume=(--resume run)
  kill_at_random "$ckpt" train --ranks 2 --save-every 1 --keep 2 --max-steps 400 --out run -q "${resume[@]}"
  if [ -f run/latest ]; then
    "$ckpt" verify run >/dev/null || fail "training killed: run/latest ($(cat run/latest)) does not verify"
  fi
  killed=$((killed + 1))
done
echo "kill_test: $killed kills: every output old, new or absent; every latest verifies"
