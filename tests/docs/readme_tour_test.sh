#!/bin/bash
# README.md's "A five-minute tour", run as a user runs it: its sh block as
# written, from a directory of its own, with this build's binaries where the
# tour says bazel-bin/ (the `bazel build` line skipped) and /tmp/zs moved
# into that directory. As root it runs in a network namespace of its own, so
# the tour's fixed port 7070 is free there whatever the machine runs; else on
# a free loopback port put in its place. Fails when a command of the tour
# fails or its job does not train, checkpoint and consolidate as the tour
# says; the tour's server is stopped however the test ends.
set -euo pipefail
readme=$(realpath "$1") server=$(realpath "$2") worker=$(realpath "$3") shardctl=$(realpath "$4")
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/tour.XXXXXX")
mkdir -p "$work/bazel-bin/shard_server" "$work/bazel-bin/worker" "$work/bazel-bin/client"
ln -s "$server" "$work/bazel-bin/shard_server/shard_server"
ln -s "$worker" "$work/bazel-bin/worker/shard_worker"
ln -s "$shardctl" "$work/bazel-bin/client/shardctl"

awk '/^## A five-minute tour/ { in_section = 1 }
     in_section && /^```sh/ { in_block = 1; next }
     in_block && /^```/ { exit }
     in_block' "$readme" >"$work/tour.raw"
grep -q 'shard_server' "$work/tour.raw" || { echo "no tour found in $readme" >&2; exit 1; }

isolate=()
if [[ $(id -u) == 0 ]] && unshare --net true 2>/dev/null; then
  isolate=(unshare --net bash -c 'ip link set lo up && exec "$@"' tour)
  port=7070
else
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
grep -v '^bazel build' "$work/tour.raw" |
  sed -e "s|127\.0\.0\.1:7070|127.0.0.1:$port|g" -e "s|/tmp/zs|$work/zs|g" >"$work/tour.sh"

# The tour leaves its server running (a user stops it): stop it here.
stop_server() { pkill -f -- "--state_dir=$work/zs/state" 2>/dev/null || true; }
trap stop_server EXIT

cd "$work"
set +e
timeout 240 "${isolate[@]}" bash -e "$work/tour.sh" >"$work/tour.out" 2>&1
code=$?
set -e
stop_server
fail() {
  echo "README tour: $1 (exit code $code); its output:" >&2
  cat "$work/tour.out" >&2
  exit 1
}
((code == 0)) || fail "a command failed or it ran past 240 s"
grep -q 'Memory per rank' "$work/tour.out" || fail "shardctl plan printed no memory table"
# (Whether status shows the job depends on the tour's `sleep 2` against the
# workers' start on a loaded machine: not asserted; status must succeed.)
for step in 2000 4000 6000 8000; do
  grep -Eq "^$step +yes +verified +2/2" "$work/tour.out" || fail "no verified checkpoint of step $step"
done
grep -q 'consolidated step 8000 of job demo' "$work/tour.out" || fail "no consolidation of step 8000"
[[ -s "$work/demo.safetensors" ]] || fail "no demo.safetensors"
grep -q '^step 8000/8000' "$work/worker-0.log" || fail "worker 0 did not reach step 8000"
echo "README tour: ran as written (port $port${isolate:+, own network namespace}); job demo trained 8000 steps, 4 checkpoints, consolidated"
