# Shared by quickstart.sh and local_cluster.sh: a shard server and W workers
# on this machine, every process stopped on exit, Ctrl-C or a crash.
# shellcheck shell=bash

ZS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ZS_PIDS=()
ZS_SERVER_PID=""
ZS_EXTRA_PIDS=()  # etcd members and the servers of a replicated control plane

zs_log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

zs_cleanup() {
  local pid
  for pid in "${ZS_PIDS[@]}" $ZS_SERVER_PID "${ZS_EXTRA_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${ZS_PIDS[@]}" $ZS_SERVER_PID "${ZS_EXTRA_PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  ZS_PIDS=()
  ZS_SERVER_PID=""
  ZS_EXTRA_PIDS=()
}

zs_on_interrupt() {
  echo >&2
  zs_log "interrupted: stopping every process started here"
  zs_cleanup
  exit 130
}

trap zs_cleanup EXIT
trap zs_on_interrupt INT TERM

# Installs what is missing and builds the three binaries. With ZS_BIN_DIR set
# (a directory holding shard_server, shard_worker and shardctl), uses those
# instead and builds nothing.
zs_build() {
  if [[ -n "${ZS_BIN_DIR:-}" ]]; then
    local b
    for b in shard_server shard_worker shardctl; do
      [[ -x "$ZS_BIN_DIR/$b" ]] || { echo "ZS_BIN_DIR=$ZS_BIN_DIR has no executable '$b'" >&2; exit 1; }
    done
    ZS_SERVER_BIN="$ZS_BIN_DIR/shard_server"
    ZS_WORKER_BIN="$ZS_BIN_DIR/shard_worker"
    ZS_SHARDCTL_BIN="$ZS_BIN_DIR/shardctl"
    return 0
  fi
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

# zs_free_port: a TCP port on 127.0.0.1 that was free a moment ago.
zs_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# zs_start_replicated OUT_DIR N [server flags...]: a three-member etcd cluster
# (Debian's etcd-server; data under OUT_DIR/etcd) and N shard servers on it
# (docs/deploy.md); sets ZS_ADDRESS to every server's address, comma-separated,
# once one of them leads.
zs_start_replicated() {
  local out="$1" n="$2"
  shift 2
  command -v etcd >/dev/null || { echo "etcd is not installed: run tools/install_deps.sh" >&2; exit 1; }
  mkdir -p "$out/etcd" "$out/checkpoints"
  rm -f "$out"/port-*
  local i cluster="" endpoints="" clients=() peers=() servers=()
  for i in 0 1 2; do
    clients+=("$(zs_free_port)")
    peers+=("$(zs_free_port)")
    cluster+="${cluster:+,}e$i=http://127.0.0.1:${peers[i]}"
    endpoints+="${endpoints:+,}127.0.0.1:${clients[i]}"
  done
  for i in 0 1 2; do
    etcd --name="e$i" --data-dir="$out/etcd/e$i" --log-level=warn \
      --listen-client-urls="http://127.0.0.1:${clients[i]}" \
      --advertise-client-urls="http://127.0.0.1:${clients[i]}" \
      --listen-peer-urls="http://127.0.0.1:${peers[i]}" \
      --initial-advertise-peer-urls="http://127.0.0.1:${peers[i]}" \
      --initial-cluster="$cluster" --initial-cluster-state=new \
      --initial-cluster-token="zeroshard-$$" >"$out/etcd-e$i.log" 2>&1 &
    ZS_EXTRA_PIDS+=($!)
  done
  for ((i = 0; i < n; i++)); do
    local port
    port="$(zs_free_port)"
    "$ZS_SERVER_BIN" --listen="127.0.0.1:$port" --etcd_endpoints="$endpoints" \
      --port_file="$out/port-$i" --checkpoint_root="$out/checkpoints" "$@" >"$out/server-$i.log" 2>&1 &
    ZS_EXTRA_PIDS+=($!)
    servers+=("127.0.0.1:$port")
  done
  for i in $(seq 1 600); do
    if compgen -G "$out/port-*" >/dev/null; then break; fi
    sleep 0.05
  done
  compgen -G "$out/port-*" >/dev/null || {
    echo "no shard server leads within 30 s; logs: $out/server-*.log, $out/etcd-e*.log" >&2
    tail -n 5 "$out/server-0.log" >&2
    exit 1
  }
  ZS_ADDRESS="$(IFS=,; echo "${servers[*]}")"
  zs_log "etcd on $endpoints; $n shard servers on it, one leading (kill it: another takes over)"
}

# Restarts allowed over the whole run (zs_run_workers): a worker that dies is
# started again with its worker id, and rejoins the job.
ZS_MAX_RESTARTS="${ZS_MAX_RESTARTS:-0}"
ZS_RESTARTS=0

# zs_start_worker OUT_DIR JOB W RANK [worker flags...]: starts worker RANK
# (worker id local/RANK) in the background, appending to its log; sets
# ZS_PIDS[RANK].
zs_start_worker() {
  local out="$1" job="$2" world="$3" r="$4"
  shift 4
  "$ZS_WORKER_BIN" --server="$ZS_ADDRESS" --job="$job" --world_size="$world" \
    --worker_id="local/$r" --host=127.0.0.1 --checkpoint_dir="$out/checkpoints" \
    "$@" >>"$out/worker-$r.log" 2>&1 &
  ZS_PIDS[$r]=$!
}

# zs_run_workers OUT_DIR JOB W [worker flags...]: starts W workers, streams
# rank 0's progress, and waits. A worker that fails is started again while
# restarts are left (ZS_MAX_RESTARTS over the whole run; exit code 2, a bad
# flag, is never retried); otherwise the run stops: its log tail is shown and
# the others are stopped. Returns 0 when all succeeded.
zs_run_workers() {
  local out="$1" job="$2" world="$3"
  shift 3
  local r
  ZS_PIDS=()
  ZS_RESTARTS=0
  for ((r = 0; r < world; r++)); do
    : >"$out/worker-$r.log"
    zs_start_worker "$out" "$job" "$world" "$r" "$@"
  done
  # Worker local/0 prints the progress; -F follows its log across restarts.
  tail -n +1 -F "$out/worker-0.log" >&2 2>/dev/null &
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
      if ((code == 0)); then continue; fi
      if ((code != 2 && ZS_RESTARTS < ZS_MAX_RESTARTS)); then
        ZS_RESTARTS=$((ZS_RESTARTS + 1))
        zs_log "worker local/$r exited with code $code; restarting it" \
          "(restart $ZS_RESTARTS of $ZS_MAX_RESTARTS)"
        echo "==> restart $ZS_RESTARTS of $ZS_MAX_RESTARTS (previous exit code $code)" >>"$out/worker-$r.log"
        zs_start_worker "$out" "$job" "$world" "$r" "$@"
        remaining=$((remaining + 1))
        continue
      fi
      failed="$r:$code"
      break 2
    done
    sleep 0.2
  done
  sleep 0.3  # lets tail print the last lines of worker local/0's log
  kill "$tail_pid" 2>/dev/null || true
  wait "$tail_pid" 2>/dev/null || true
  if [[ -n "$failed" ]]; then
    local rank=${failed%%:*} code=${failed##*:} why=""
    if ((code == 2)); then why=" (a bad flag: not restarted)";
    elif ((ZS_MAX_RESTARTS > 0)); then why=" after $ZS_RESTARTS of $ZS_MAX_RESTARTS restarts"; fi
    echo >&2
    echo "worker local/$rank exited with code $code$why; stopping the run. Last lines of its log ($out/worker-$rank.log):" >&2
    tail -n 15 "$out/worker-$rank.log" >&2
    local pid
    for pid in "${ZS_PIDS[@]}"; do [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || true; done
    ZS_PIDS=()
    return 1
  fi
  if ((ZS_RESTARTS > 0)); then zs_log "$ZS_RESTARTS worker restart(s) during the run"; fi
  ZS_PIDS=()
  return 0
}
