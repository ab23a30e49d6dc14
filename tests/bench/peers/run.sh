#!/usr/bin/env bash
# zeroshard beside PyTorch (DDP, ZeroRedundancyOptimizer, FSDP2) on one
# machine, interleaved: see run.py. Builds shard_worker, and on first use
# creates a venv with PyTorch 2.x from PyPI for the peers (large: a few GB;
# never used by CI or the tests).
#
#   tests/bench/peers/run.sh [--rounds 3] [--steps 8] [--suite gpt,mlp,threads,gpt2]
#                            [--gpt2_layers 12] [--json_out FILE]
#
# PEERS_VENV (default ~/.cache/zeroshard/peers-venv) picks the venv.
set -euo pipefail
cd "$(dirname "$0")/../../.."
VENV=${PEERS_VENV:-$HOME/.cache/zeroshard/peers-venv}
if ! "$VENV/bin/python" -c "import torch, numpy, transformers" 2>/dev/null; then
  echo "peers: creating $VENV with PyTorch from PyPI (first use; several GB)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch numpy transformers
fi
bazel build --jobs=2 //worker:shard_worker //shard_server >&2
BIN=$(bazel info bazel-bin 2>/dev/null)
# A copy, so that a build during the run does not change the binaries under it.
COPY=$(mktemp -d /tmp/zeroshard-peers-bin.XXXXXX)
trap 'rm -rf "$COPY"' EXIT
mkdir -p "$COPY/worker" "$COPY/shard_server"
cp -L "$BIN/worker/shard_worker" "$COPY/worker/"
cp -L "$BIN/shard_server/shard_server" "$COPY/shard_server/"
exec python3 tests/bench/peers/run.py --bin_dir "$COPY" --peers_python "$VENV/bin/python" "$@"
