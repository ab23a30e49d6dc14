#!/bin/bash
# Runs templates_test.py with Debian's python3 (it has PyYAML: python3-yaml);
# the `python3` on PATH may be another interpreter without it.
set -euo pipefail
PYTHON=/usr/bin/python3
if ! "$PYTHON" -c "import yaml" 2>/dev/null; then
  echo "templates_test: $PYTHON cannot import yaml; install python3-yaml" >&2
  exit 1
fi
exec "$PYTHON" "$(dirname "$0")/templates_test.py" "$@"
