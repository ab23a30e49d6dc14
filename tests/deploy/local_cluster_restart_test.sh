#!/usr/bin/env bash
# deploy/local_cluster.sh --max_restarts: a worker killed with SIGKILL in the
# middle of a run is started again with its worker id, the survivor re-joins,
# and the run finishes with every step trained (exit 0). With no restarts left
# the same kill fails the run. Real server, real workers, the real script.
#
#   local_cluster_restart_test.sh SHARD_SERVER SHARD_WORKER SHARDCTL
set -uo pipefail
server_bin=$(realpath "$1") worker_bin=$(realpath "$2") shardctl_bin=$(realpath "$3")
root=$(pwd)
tmp="${TEST_TMPDIR:-$(mktemp -d)}/lc"
rm -rf "$tmp"
mkdir -p "$tmp/bin"
ln -s "$server_bin" "$tmp/bin/shard_server"
ln -s "$worker_bin" "$tmp/bin/shard_worker"
ln -s "$shardctl_bin" "$tmp/bin/shardctl"

launcher_pid=""
cleanup() {
  if [[ -n "$launcher_pid" ]]; then kill "$launcher_pid" 2>/dev/null; wait "$launcher_pid" 2>/dev/null; fi
  pkill -9 -f -- "--job=lcr-" 2>/dev/null || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$tmp"/out*/launcher.log "$tmp"/out*/worker-*.log; do [[ -f "$f" ]] && { echo "--- $f"; tail -n 20 "$f"; }; done >&2; exit 1; }

# Polls `shardctl status` until the job's member with worker id local/1 reports
# step >= $3, within a deadline.
wait_for_step() {
  local out="$1" job="$2" step="$3" deadline=$((SECONDS + 90))
  while ((SECONDS < deadline)); do
    if [[ -s "$out/port" ]]; then
      local s
      s=$("$shardctl_bin" --server="127.0.0.1:$(cat "$out/port")" status --job="$job" --json 2>/dev/null |
        python3 -c '
import json, sys
for j in json.load(sys.stdin).get("jobs", []):
  for m in j.get("members", []):
    if m.get("worker_id") == "local/1": print(int(m.get("step", 0)))' 2>/dev/null)
      if [[ -n "$s" ]] && ((s >= step)); then return 0; fi
    fi
    if ! kill -0 "$launcher_pid" 2>/dev/null; then fail "the run ended before worker local/1 reached step $step"; fi
    sleep 0.1
  done
  fail "worker local/1 did not reach step $step within 90 s"
}

# run NAME MAX_RESTARTS: starts the launcher, kills worker local/1 at step 20,
# waits for the launcher (deadline 180 s) and leaves its exit code in $rc.
run() {
  local name="$1" restarts="$2"
  local out="$tmp/out-$name" job="lcr-$name-$$"
  mkdir -p "$out"
  (cd "$root" && ZS_BIN_DIR="$tmp/bin" exec bash deploy/local_cluster.sh --workers=2 --job="$job" \
      --out="$out" --max_restarts="$restarts" -- --model=mlp --layers=4 --width=1024 --batch=32 \
      --steps=300 --stage=3 --snapshot_every=10 --threads=1) >"$out/launcher.log" 2>&1 &
  launcher_pid=$!
  wait_for_step "$out" "$job" 20
  local victim
  victim=$(pgrep -f -- "--job=$job .*--worker_id=local/1") || fail "no process for worker local/1"
  kill -9 $victim
  local deadline=$((SECONDS + 180))
  while kill -0 "$launcher_pid" 2>/dev/null; do
    ((SECONDS < deadline)) || fail "$name: the launcher did not finish within 180 s"
    sleep 0.2
  done
  rc=0
  wait "$launcher_pid" || rc=$?
  launcher_pid=""
  OUT="$out"
}

run restart 1
((rc == 0)) || fail "with --max_restarts=1 the run failed (exit $rc)"
grep -q "restarting it (restart 1 of 1)" "$OUT/launcher.log" || fail "the launcher did not say it restarted local/1"
# Both ranks end with the same parameters, and the survivor recovered once
# without leaving its process.
python3 - "$OUT/report-0.json" "$OUT/report-1.json" <<'PY' || fail "the reports disagree (above)"
import json, sys
r0, r1 = (json.load(open(p)) for p in sys.argv[1:3])
ok = abs(r0["params_sum"] - r1["params_sum"]) <= 1e-9 * max(1.0, abs(r0["params_sum"]))
if not ok: print("params_sum differs: %r vs %r" % (r0["params_sum"], r1["params_sum"]))
if len(r0.get("recoveries", [])) < 1:
  print("rank 0 reports no recovery: %r" % r0.get("recoveries")); ok = False
sys.exit(0 if ok else 1)
PY
echo "ok: killed worker restarted, run finished at 300 steps"

run norestart 0
((rc != 0)) || fail "with --max_restarts=0 a killed worker must fail the run"
grep -q "exited with code 137" "$OUT/launcher.log" || fail "the launcher did not name the killed worker's exit"
echo "ok: without restarts the kill fails the run"
echo PASS
