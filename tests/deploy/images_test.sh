#!/bin/bash
# Runs images_test.py with Debian's python3 (PyYAML: python3-yaml).
set -euo pipefail
PYTHON=/usr/bin/python3
if ! "$PYTHON" -c "import yaml" 2>/dev/null; then
  echo "images_test: $PYTHON cannot import yaml; install python3-yaml" >&2
  exit 1
fi
exec "$PYTHON" "$(dirname "$0")/images_test.py" "$@"
