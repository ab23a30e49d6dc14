#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs every
# test, and ends with one line "N passed, N failed" (test cases, counted from
# the GoogleTest / JUnit XML each test target writes). Exits non-zero on any
# failure.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

bash tools/install_deps.sh || { echo "0 passed, 1 failed"; exit 1; }

# Python interop tests run in a venv that sees Debian's python3-torch and
# takes safetensors and numpy from PyPI.
VENV="${ZEROSHARD_VENV:-$HOME/.cache/zeroshard/venv}"
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import safetensors, torch, numpy, transformers" 2>/dev/null; then
  /usr/bin/python3 -m venv --system-site-packages "$VENV" &&
    "$VENV/bin/pip" install -q safetensors numpy "transformers>=4.40,<4.46" || { echo "0 passed, 1 failed"; exit 1; }
fi

JOBS_FLAGS=()
if [[ "${CI:-}" == "true" ]]; then JOBS_FLAGS+=(--noshow_progress); fi

bazel test //... "${JOBS_FLAGS[@]}" --test_env=ZEROSHARD_PYTHON="$VENV/bin/python" "$@" 2>&1 | tee /tmp/zeroshard-test.log
rc=${PIPESTATUS[0]}

# Count test cases from the XML reports of this run's test targets.
read -r passed failed < <(python3 - "$ROOT" /tmp/zeroshard-test.log <<'PY'
import glob, os, re, sys, xml.etree.ElementTree as ET
root, log = sys.argv[1], sys.argv[2]
passed = failed = 0
targets = []
for line in open(log, errors="replace"):
    m = re.match(r"^(//\S+)\s+(?:\(cached\) )?(PASSED|FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|FLAKY)", line)
    if m:
        targets.append((m.group(1), m.group(2)))
for target, result in targets:
    path = os.path.join(root, "bazel-testlogs", target[2:].replace(":", "/"), "test.xml")
    cases = []
    if result in ("PASSED", "FAILED", "FLAKY") and os.path.exists(path):
        try:
            cases = ET.parse(path).getroot().iter("testcase")
            cases = list(cases)
        except ET.ParseError:
            cases = []
    if not cases:
        # No per-case report: the target counts as one test.
        if result == "PASSED": passed += 1
        else: failed += 1
        continue
    for c in cases:
        if c.find("failure") is not None or c.find("error") is not None:
            failed += 1
        elif c.get("status", "run") == "notrun" or c.find("skipped") is not None:
            continue
        else:
            passed += 1
    if result != "PASSED" and all(c.find("failure") is None and c.find("error") is None for c in cases):
        failed += 1  # the target failed outside any test case (crash, leak, timeout)
print(passed, failed)
PY
)
if [[ $rc -ne 0 && ${failed:-0} -eq 0 ]]; then failed=1; fi
echo "${passed:-0} passed, ${failed:-0} failed"
if [[ $rc -ne 0 || ${failed:-0} -ne 0 ]]; then exit 1; fi
exit 0
