#!/bin/bash
# Fails when a command in the docs runs a shipped binary with a flag it does
# not take (or shardctl with a command it lacks), naming the file and line.
set -euo pipefail
checker=$1 server=$2 worker=$3 shardctl=$4 agent=$5
shift 5
python3 "$checker" --binary "shard_server=$server" --binary "shard_worker=$worker" \
    --binary "shardctl=$shardctl" --binary "shard_agent=$agent" "$@"
