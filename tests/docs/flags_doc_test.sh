#!/bin/bash
# Fails when docs/flags.md differs from what the binaries' --helpfull says,
# showing the difference and the command that regenerates it.
set -euo pipefail
flag_docs=$1 flags_md=$2 server=$3 worker=$4 shardctl=$5 agent=$6
python3 "$flag_docs" --check "$flags_md" --binary "shard_server=$server" \
    --binary "shard_worker=$worker" --binary "shardctl=$shardctl" --binary "shard_agent=$agent"
echo "docs/flags.md matches the binaries"
