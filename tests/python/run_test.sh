#!/usr/bin/env bash
# Runs a Python test file of this folder with the venv's python (PyTorch 2 from PyPI;
# tests/run.sh passes it as ZEROSHARD_PYTHON), from the runfiles tree, where
# the built package is python/site/zeroshard.
set -euo pipefail
PYTHON="${ZEROSHARD_PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  PYTHON="$HOME/.cache/zeroshard/venv-torch2/bin/python"
  [[ -x "$PYTHON" ]] || PYTHON=/usr/bin/python3
fi
exec "$PYTHON" -W ignore::ResourceWarning "$(dirname "$0")/$1" -v
