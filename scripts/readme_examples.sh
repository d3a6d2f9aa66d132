#!/usr/bin/env bash
# Runs the README's "By example" block as written, line by line and in order, in a new
# empty directory (with the repository's tests/ linked in, for the fixture paths), with
# the freshly built ckpt first on the PATH. Any line that fails stops the script and
# names the line: the README must hold as written.
#
#   scripts/readme_examples.sh [path/to/ckpt]      # default: target/release/ckpt
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=${1:-target/release/ckpt}
[ -x "$bin" ] || cargo build --release --quiet
bin=$(cd "$(dirname "$bin")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ln -s "$repo/tests" "$work/tests"
# The block: from the line after "## By example"'s ```sh to the closing ```.
awk '/^## By example/{f=1; next} f && /^```sh/{in_block=1; next} in_block && /^```/{exit} in_block{print}' \
  README.md > "$work/examples.sh"
n=$(grep -c . "$work/examples.sh")
[ "$n" -gt 10 ] || { echo "readme_examples: found only $n lines in the README's example block" >&2; exit 1; }
cd "$work"
export PATH="$bin:$PATH"
i=0
while IFS= read -r line; do
  i=$((i + 1))
  cmd=${line%%#*}                   # comments (and continuation comment lines) dropped
  [ -n "${cmd//[[:space:]]/}" ] || continue
  echo "+ $cmd"
  if ! eval "$cmd" > "out.$i" 2>&1; then
    echo "readme_examples: line $i failed: $line" >&2
    cat "out.$i" >&2
    exit 1
  fi
done < examples.sh
echo "readme_examples: every line of the README's example block ran ($n lines)"
