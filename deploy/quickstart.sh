#!/usr/bin/env bash
# zeroshard quickstart: installs what is missing, builds, starts a shard
# server and W workers on this machine (CPU, Gloo), trains a GPT-2-style
# decoder with ZeRO stage 3 on a synthetic addition task, checkpoints,
# consolidates the final checkpoint into quickstart-out/model.safetensors
# through `shardctl consolidate`, and prints a summary and a sample.
#
#   deploy/quickstart.sh [--workers=4] [--steps=1800] [--stage=3] [--seed=1] [--max_restarts=0]
#
# A worker that dies is started again with its worker id while restarts are
# left (--max_restarts over the whole run). Ctrl-C stops every process it started.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

workers=4
steps=1800
stage=3
seed=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers=*) workers="${1#*=}" ;;
    --steps=*) steps="${1#*=}" ;;
    --stage=*) stage="${1#*=}" ;;
    --seed=*) seed="${1#*=}" ;;
    --max_restarts=*) ZS_MAX_RESTARTS="${1#*=}" ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "quickstart.sh: unknown option '$1' (expected --workers, --steps, --stage, --seed, --max_restarts)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "--workers must be a positive integer" >&2; exit 2; }
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "--steps must be a positive integer" >&2; exit 2; }
[[ "$stage" =~ ^[0-3]$ ]] || { echo "--stage must be 0, 1, 2 or 3" >&2; exit 2; }
[[ "$seed" =~ ^[0-9]+$ ]] || { echo "--seed must be a non-negative integer, not '$seed'" >&2; exit 2; }
[[ "$ZS_MAX_RESTARTS" =~ ^[0-9]+$ ]] || { echo "--max_restarts must be a non-negative integer, not '$ZS_MAX_RESTARTS'" >&2; exit 2; }

started=$(date +%s)
out="$ZS_ROOT/quickstart-out"
run="$out/run"
rm -rf "$run"
mkdir -p "$run"
zs_build
zs_start_server "$run"
job="quickstart-$(date +%Y%m%d-%H%M%S)"
zs_log "shard server on $ZS_ADDRESS (logs in $run)"
zs_log "training job '$job': GPT (3 layers, 4 heads, d_model 96, context 32) on 2-digit sums (written least-significant digit first; the loss on the answers), $workers workers, ZeRO stage $stage, $steps steps"

# 2 cores shared by all workers: one BLAS thread each.
if ! zs_run_workers "$run" "$job" "$workers" \
    --model=gpt --layers=3 --heads=4 --d_model=96 --context=32 --task=reversed-addition --digits=2 \
    --loss_on=answers --batch=16 --steps="$steps" --stage="$stage" --prefetch=1 \
    --optimizer=adamw --lr=3e-3 --min_lr=3e-4 --lr_schedule=cosine --warmup_steps=100 --max_grad_norm=1.0 \
    --val_every=$((steps / 5 > 0 ? steps / 5 : 1)) --sample=120 --seed="$seed" --threads=1 \
    --checkpoint_every=$((steps / 2 > 0 ? steps / 2 : 1)) --checkpoint_at_end \
    --summary_out="$out/summary.json" --report="$run/report-{rank}.json"; then
  echo "quickstart: training failed (logs in $run)" >&2
  exit 1
fi

zs_log "checkpoints of '$job'"
"$ZS_SHARDCTL_BIN" --server="$ZS_ADDRESS" checkpoints --job="$job" >&2
zs_log "consolidating the final checkpoint into $out/model.safetensors"
"$ZS_SHARDCTL_BIN" --server="$ZS_ADDRESS" consolidate --job="$job" --step=latest \
  --out="$out/model.safetensors"

elapsed=$(( $(date +%s) - started ))
zs_log "done in ${elapsed}s: $out/model.safetensors and $out/summary.json"
cat >&2 <<EOT
Load it in PyTorch:
  from safetensors.torch import load_file
  state = load_file("$out/model.safetensors")   # Hugging Face GPT-2 tensor names
EOT
