# Shared by quickstart.sh and local_cluster.sh: a shard server and W workers
# on this machine, every process stopped on exit, Ctrl-C or a crash.
# shellcheck shell=bash

ZS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ZS_PIDS=()
ZS_SERVER_PID=""

zs_log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

zs_cleanup() {
  local pid
  for pid in "${ZS_PIDS[@]}" $ZS_SERVER_PID; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${ZS_PIDS[@]}" $ZS_SERVER_PID; do
    wait "$pid" 2>/dev/null || true
  done
  ZS_PIDS=()
  ZS_SERVER_PID=""
}

zs_on_interrupt() {
  echo >&2
  zs_log "interrupted: stopping every process started here"
  zs_cleanup
  exit 130
}

trap zs_cleanup EXIT
trap zs_on_interrupt INT TERM

# Installs what is missing and builds the three binaries.
zs_build() {
  bash "$ZS_ROOT/tools/install_deps.sh"
  zs_log "building (bazel build //shard_server //worker:shard_worker //client:shardctl)"
  (cd "$ZS_ROOT" && bazel build --noshow_progress //shard_server //worker:shard_worker \
    //client:shardctl 2>&1 | grep -E "^(ERROR|error)" >&2; exit "${PIPESTATUS[0]}") || {
    echo "build failed; run: bazel build //shard_server //worker:shard_worker //client:shardctl" >&2
    exit 1
  }
  ZS_SERVER_BIN="$ZS_ROOT/bazel-bin/shard_server/shard_server"
  ZS_WORKER_BIN="$ZS_ROOT/bazel-bin/worker/shard_worker"
  ZS_SHARDCTL_BIN="$ZS_ROOT/bazel-bin/client/shardctl"
}

# zs_start_server OUT_DIR [server flags...]: sets ZS_ADDRESS.
zs_start_server() {
  local out="$1"
  shift
  mkdir -p "$out/state" "$out/checkpoints"
  rm -f "$out/port"
  "$ZS_SERVER_BIN" --listen=127.0.0.1:0 --port_file="$out/port" --state_dir="$out/state" \
    --checkpoint_root="$out/checkpoints" "$@" >"$out/server.log" 2>&1 &
  ZS_SERVER_PID=$!
  local i
  for i in $(seq 1 200); do
    if [[ -s "$out/port" ]]; then break; fi
    if ! kill -0 "$ZS_SERVER_PID" 2>/dev/null; then
      echo "shard_server failed to start:" >&2
      tail -n 20 "$out/server.log" >&2
      exit 1
    fi
    sleep 0.05
  done
  [[ -s "$out/port" ]] || { echo "shard_server did not write its port within 10 s" >&2; exit 1; }
  ZS_ADDRESS="127.0.0.1:$(cat "$out/port")"
}

# zs_run_workers OUT_DIR JOB W [worker flags...]: starts W workers, streams
# rank 0's progress, and waits. A worker that fails stops the run: its log
# tail is shown and the others are stopped. Returns 0 when all succeeded.
zs_run_workers() {
  local out="$1" job="$2" world="$3"
  shift 3
  local r
  ZS_PIDS=()
  for ((r = 0; r < world; r++)); do
    "$ZS_WORKER_BIN" --server="$ZS_ADDRESS" --job="$job" --world_size="$world" \
      --worker_id="local/$r" --host=127.0.0.1 --checkpoint_dir="$out/checkpoints" \
      "$@" >"$out/worker-$r.log" 2>&1 &
    ZS_PIDS+=($!)
  done
  # Rank 0 (worker id local/0) prints the progress.
  tail -n +1 -f "$out/worker-0.log" --pid="${ZS_PIDS[0]}" >&2 &
  local tail_pid=$!
  local remaining=$world failed=""
  while ((remaining > 0)); do
    remaining=0
    for ((r = 0; r < world; r++)); do
      local pid=${ZS_PIDS[$r]}
      [[ -z "$pid" ]] && continue
      if kill -0 "$pid" 2>/dev/null; then
        remaining=$((remaining + 1))
        continue
      fi
      local code=0
      wait "$pid" || code=$?
      ZS_PIDS[$r]=""
      if ((code != 0)); then
        failed="$r:$code"
        break 2
      fi
    done
    sleep 0.2
  done
  if [[ -n "$failed" ]]; then
    local rank=${failed%%:*} code=${failed##*:}
    kill "$tail_pid" 2>/dev/null || true
    echo >&2
    echo "worker $rank exited with code $code; stopping the run. Last lines of its log ($out/worker-$rank.log):" >&2
    tail -n 15 "$out/worker-$rank.log" >&2
    local pid
    for pid in "${ZS_PIDS[@]}"; do [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || true; done
    ZS_PIDS=()
    return 1
  fi
  wait "$tail_pid" 2>/dev/null || true
  ZS_PIDS=()
  return 0
}
