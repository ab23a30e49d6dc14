#!/bin/bash
# README's first command, deploy/quickstart.sh, end to end: installs nothing
# and builds nothing (ZS_BIN_DIR: this build's binaries), then a shard server
# and 4 workers train, checkpoint and consolidate, as the script does, for
# fewer steps (--steps=60: the script's path; docs/quickstart.md measures what
# 1,800 steps learn). Then README's "Loading the consolidated file" snippet,
# run as written on the file it wrote, with the venv's PyTorch and
# transformers (tests/run.sh passes ZEROSHARD_PYTHON): it loads the file into
# Hugging Face's GPT-2 and prints the model's answer, 3 bytes.
set -euo pipefail
readme=$(realpath "$1")
shift
scripts=()
while [[ "$1" == *.sh ]]; do scripts+=("$(realpath "$1")"); shift; done
server=$(realpath "$1") worker=$(realpath "$2") shardctl=$(realpath "$3")
python="${ZEROSHARD_PYTHON:-$HOME/.cache/zeroshard/venv-torch2/bin/python}"
[[ -x "$python" ]] || python=python3

work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/quickstart.XXXXXX")
mkdir -p "$work/repo/deploy" "$work/bin"
cp "${scripts[@]}" "$work/repo/deploy/"
ln -s "$server" "$work/bin/shard_server"
ln -s "$worker" "$work/bin/shard_worker"
ln -s "$shardctl" "$work/bin/shardctl"
fail() {
  echo "readme_quickstart_test: $1" >&2
  for f in "$work"/*.out "$work"/*.err; do [[ -s "$f" ]] && { echo "--- $f" >&2; tail -n 40 "$f" >&2; }; done
  exit 1
}

cd "$work/repo"
ZS_BIN_DIR="$work/bin" timeout 300 bash deploy/quickstart.sh --steps=60 \
  >"$work/quickstart.out" 2>"$work/quickstart.err" || fail "deploy/quickstart.sh failed"
grep -q 'verified' "$work/quickstart.err" || fail "no verified checkpoint listed"
[[ -s quickstart-out/model.safetensors ]] || fail "no quickstart-out/model.safetensors"
[[ -s quickstart-out/summary.json ]] || fail "no quickstart-out/summary.json"
# Every worker's log says it trained: rank 0's with the job and the steps,
# the others with a line as they start and one as they finish.
logs=(quickstart-out/run/worker-{0,1,2,3}.log)
[[ $(grep -l '^job quickstart-.*: 4 ranks' "${logs[@]}" | wc -l) == 1 ]] ||
  fail "not one worker log with rank 0's job line"
[[ $(grep -l '^rank [1-3] of 4: job quickstart-' "${logs[@]}" | xargs -r grep -l '^rank [1-3]: done' |
  wc -l) == 3 ]] || fail "not three worker logs saying that their rank trained"

awk '/^## Loading the consolidated file/ { in_section = 1 }
     in_section && /^```python/ { in_block = 1; next }
     in_block && /^```/ { exit }
     in_block' "$readme" >"$work/snippet.py"
grep -q 'load_file("quickstart-out/model.safetensors")' "$work/snippet.py" ||
  fail "README has no snippet loading quickstart-out/model.safetensors"
timeout 180 "$python" "$work/snippet.py" >"$work/snippet.out" 2>"$work/snippet.err" ||
  fail "README's snippet failed ($python)"
grep -Eq "^b'.{3}'$" "$work/snippet.out" || fail "README's snippet printed no 3-byte answer"
echo "quickstart (60 steps) and README's snippet ran: the model answered $(cat "$work/snippet.out") to 12+34="
