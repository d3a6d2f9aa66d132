#!/usr/bin/env bash
# Runs the "By example" block of the README (the recipes) and of docs/examples.md (every
# command) as written, line by line and in order, each in a new empty directory (with
# the repository's tests/ linked in, for the fixture paths), with the freshly built ckpt
# first on the PATH. Any line that fails stops the script and names the file and the
# line: the documents must hold as written.
#
#   scripts/readme_examples.sh [path/to/ckpt] [FILE.md ...]
#       default: target/release/ckpt, README.md docs/examples.md
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=${1:-target/release/ckpt}
[ $# -gt 0 ] && shift
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(README.md docs/examples.md)
[ -x "$bin" ] || cargo build --release --quiet
bin=$(cd "$(dirname "$bin")" && pwd)
export PATH="$bin:$PATH"
for doc in "${files[@]}"; do
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  ln -s "$repo/tests" "$work/tests"
  # The block: from the line after "## By example"'s ```sh to the closing ```.
  awk '/^## By example/{f=1; next} f && /^```sh/{in_block=1; next} in_block && /^```/{exit} in_block{print}' \
    "$doc" > "$work/examples.sh"
  n=$(grep -c . "$work/examples.sh" || true)
  [ "$n" -gt 10 ] || { echo "readme_examples: found only $n lines in $doc's example block" >&2; exit 1; }
  (
    cd "$work"
    i=0
    while IFS= read -r line; do
      i=$((i + 1))
      cmd=${line%%#*}                   # comments (and continuation comment lines) dropped
      [ -n "${cmd//[[:space:]]/}" ] || continue
      echo "+ $cmd"
      if ! eval "$cmd" > "out.$i" 2>&1; then
        echo "readme_examples: $doc: line $i of its example block failed: $line" >&2
        cat "out.$i" >&2
        exit 1
      fi
    done < examples.sh
  )
  rm -rf "$work"
  trap - EXIT
  echo "readme_examples: every line of $doc's example block ran ($n lines)"
done
