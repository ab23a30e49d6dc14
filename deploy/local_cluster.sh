#!/usr/bin/env bash
# Runs a custom zeroshard job on this machine: a shard server and W workers
# (CPU, Gloo), any worker flags. Ctrl-C stops every process it started. A
# worker that dies is started again with its worker id while restarts are left
# (--max_restarts over the whole run, default 0); otherwise the run stops and
# shows its log tail. ZS_BIN_DIR=DIR uses prebuilt binaries from DIR.
#
#   deploy/local_cluster.sh [--workers=N] [--job=ID] [--out=DIR] [--max_restarts=N] \
#       [--servers=N --etcd] [--server_flag=F ...] -- [shard_worker flags...]
#
# --etcd: a replicated control plane instead of one server: a three-member
# etcd cluster and --servers shard servers (default 3) on it (docs/deploy.md).
#
# Example: deploy/local_cluster.sh --workers=2 -- --model=mlp --layers=20 --width=2000 --stage=3
set -euo pipefail
source "$(dirname "$0")/lib.sh"

workers=2
job="local-$(date +%Y%m%d-%H%M%S)"
out="$ZS_ROOT/local-cluster-out"
server_flags=()
servers=""
etcd=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers=*) workers="${1#*=}" ;;
    --job=*) job="${1#*=}" ;;
    --out=*) out="${1#*=}" ;;
    --max_restarts=*) ZS_MAX_RESTARTS="${1#*=}" ;;
    --server_flag=*) server_flags+=("${1#*=}") ;;
    --servers=*) servers="${1#*=}" ;;
    --etcd) etcd=1 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "local_cluster.sh: unknown option '$1' (worker flags go after --)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "--workers must be a positive integer" >&2; exit 2; }
[[ "$ZS_MAX_RESTARTS" =~ ^[0-9]+$ ]] || { echo "--max_restarts must be a non-negative integer, not '$ZS_MAX_RESTARTS'" >&2; exit 2; }

if ((etcd)); then
  servers="${servers:-3}"
  [[ "$servers" =~ ^[1-9][0-9]*$ ]] || { echo "--servers must be a positive integer" >&2; exit 2; }
elif [[ -n "$servers" && "$servers" != 1 ]]; then
  echo "--servers=$servers needs --etcd (several servers share their state through etcd)" >&2
  exit 2
fi

zs_build
mkdir -p "$out"
if ((etcd)); then
  zs_start_replicated "$out" "$servers" "${server_flags[@]+"${server_flags[@]}"}"
else
  zs_start_server "$out" "${server_flags[@]+"${server_flags[@]}"}"
fi
zs_log "shard server on $ZS_ADDRESS; job '$job' with $workers workers; logs in $out"
if zs_run_workers "$out" "$job" "$workers" --report="$out/report-{rank}.json" "$@"; then
  zs_log "job '$job' finished; reports: $out/report-*.json"
  "$ZS_SHARDCTL_BIN" --server="$ZS_ADDRESS" status --job="$job" >&2 || true
else
  exit 1
fi
