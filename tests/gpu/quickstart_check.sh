#!/usr/bin/env bash
# The quickstart's GPT trained by one worker on a GPU (W = 1,
# --backend=nccl, ZeRO stage 3), checkpointed and consolidated through
# `shardctl consolidate`; then the CPU path (--backend=gloo) loads the
# consolidated file (--init_from, --steps=0) and evaluates it. Passes when
# both evaluate the same first validation batch to the same loss (relative
# difference <= 1e-3: the same weights, f32 on both sides), the CPU's
# addition accuracy is the GPU run's within 0.15 (greedy answers may flip on
# near-ties), and the trained accuracy on held-out sums is at least
# --min_accuracy (default 0.95: deploy/quickstart.sh's run reaches 100 % on
# the CPU path).
#
#   tests/gpu/quickstart_check.sh BIN_DIR OUT_DIR [--backend=nccl] [--steps=1800]
#                                 [--min_accuracy=0.95]
#
# BIN_DIR holds shard_server/shard_server, worker/shard_worker and
# client/shardctl (bazel-bin). --backend=gloo runs the same procedure on the
# CPU (to check this script without a GPU). Exit 0 on success, 1 otherwise.
set -uo pipefail

BIN="$1"
OUT="$2"
shift 2
backend=nccl
steps=1800
min_accuracy=0.95
for arg in "$@"; do
  case "$arg" in
    --backend=*) backend="${arg#*=}" ;;
    --steps=*) steps="${arg#*=}" ;;
    --min_accuracy=*) min_accuracy="${arg#*=}" ;;
    *) echo "quickstart_check.sh: unknown option '$arg'" >&2; exit 2 ;;
  esac
done

rm -rf "$OUT"
mkdir -p "$OUT/state" "$OUT/checkpoints"
"$BIN/shard_server/shard_server" --listen=127.0.0.1:0 --port_file="$OUT/port" \
  --state_dir="$OUT/state" --checkpoint_root="$OUT/checkpoints" >"$OUT/server.log" 2>&1 &
server=$!
worker=""
trap 'kill $worker "$server" 2>/dev/null; wait "$server" 2>/dev/null' EXIT
# run.sh's step limit (TERM): the worker and the server end with this script.
trap 'exit 143' TERM INT
# Runs a worker command in the background and waits for it, so that a TERM
# is acted on at once (bash defers traps while a foreground child runs).
run_worker() {
  "$@" &
  worker=$!
  wait "$worker"
  local rc=$?
  worker=""
  return "$rc"
}
for _ in $(seq 1 200); do
  [[ -s "$OUT/port" ]] && break
  kill -0 "$server" 2>/dev/null || { echo "shard_server failed: $(tail -n 5 "$OUT/server.log")" >&2; exit 1; }
  sleep 0.05
done
[[ -s "$OUT/port" ]] || { echo "shard_server wrote no port within 10 s" >&2; exit 1; }
address="127.0.0.1:$(cat "$OUT/port")"

# The quickstart's run (deploy/quickstart.sh: model, task, loss on the
# answers, optimizer and schedule) with its global batch of 4 workers x 16 in
# one worker. (Until 2026-11-30 every token was scored here, at lr 1e-2 and
# 600 steps, which reached 1.6 % of held-out sums on the GPU and the CPU
# alike: a check of the plumbing, not of training.)
common=(--model=gpt --layers=3 --heads=4 --d_model=96 --context=32 --task=reversed-addition
  --digits=2 --batch=64 --loss_on=answers --seed=1 --threads=1 --host=127.0.0.1 --world_size=1
  --checkpoint_dir="$OUT/checkpoints")
device_flags=(--backend="$backend")
[[ "$backend" == nccl ]] && device_flags+=(--local_rank=0)

echo "training on --backend=$backend: $steps steps"
if ! run_worker timeout 1800 "$BIN/worker/shard_worker" --server="$address" --job=gpu-quickstart \
  --worker_id=gpu/0 "${common[@]}" "${device_flags[@]}" --steps="$steps" --stage=3 --prefetch=1 \
  --optimizer=adamw --lr=3e-3 --min_lr=3e-4 --lr_schedule=cosine --warmup_steps=100 \
  --max_grad_norm=1.0 --val_every=$((steps / 5 > 0 ? steps / 5 : 1)) --sample=60 \
  --checkpoint_at_end --summary_out="$OUT/train_summary.json" --eval_out="$OUT/train_eval.json" \
  >"$OUT/train.log" 2>&1; then
  echo "training failed:" >&2
  tail -n 20 "$OUT/train.log" >&2
  exit 1
fi
tail -n 25 "$OUT/train.log"

if ! "$BIN/client/shardctl" --server="$address" consolidate --job=gpu-quickstart --step=latest \
  --out="$OUT/model.safetensors" >"$OUT/consolidate.log" 2>&1; then
  echo "consolidation failed:" >&2
  cat "$OUT/consolidate.log" >&2
  exit 1
fi
echo "consolidated: $(ls -l "$OUT/model.safetensors")"

echo "evaluating $OUT/model.safetensors on the CPU (--backend=gloo)"
if ! run_worker timeout 900 "$BIN/worker/shard_worker" --server="$address" --job=cpu-eval \
  --worker_id=cpu/0 \
  "${common[@]}" --backend=gloo --init_from="$OUT/model.safetensors" --steps=0 --stage=3 \
  --optimizer=adamw --summary_out="$OUT/cpu_summary.json" --eval_out="$OUT/cpu_eval.json" \
  >"$OUT/cpu_eval.log" 2>&1; then
  echo "CPU evaluation failed:" >&2
  tail -n 20 "$OUT/cpu_eval.log" >&2
  exit 1
fi

python3 - "$OUT" "$min_accuracy" <<'EOF'
import json, sys
out = sys.argv[1]
min_accuracy = float(sys.argv[2])
train = json.load(open(f"{out}/train_eval.json"))
cpu = json.load(open(f"{out}/cpu_eval.json"))
ts = json.load(open(f"{out}/train_summary.json"))
cs = json.load(open(f"{out}/cpu_summary.json"))
ok = True
if train["tokens"] != cpu["tokens"] or train["targets"] != cpu["targets"]:
    print("FAIL: the two evaluations saw different validation batches"); ok = False
rel = abs(train["loss"] - cpu["loss"]) / max(abs(cpu["loss"]), 1e-12)
print(f"first validation batch: loss trained-side {train['loss']:.6f}, CPU on the consolidated "
      f"file {cpu['loss']:.6f} (relative difference {rel:.2e}, bound 1e-3)")
ok &= rel <= 1e-3
print(f"training: loss {ts['loss_first']:.4f} -> {ts['loss_last']:.4f}, val loss {ts['val_loss']:.4f}, "
      f"accuracy {ts['accuracy']}, {ts['items_per_second']:.0f} tokens/s")
print(f"CPU on the consolidated file: val loss {cs['val_loss']:.4f}, accuracy {cs['accuracy']}")
if ts["accuracy"] is not None and cs["accuracy"] is not None:
    if abs(ts["accuracy"] - cs["accuracy"]) > 0.15:
        print("FAIL: accuracies differ by more than 0.15"); ok = False
if ts["accuracy"] is None or ts["accuracy"] < min_accuracy:
    print(f"FAIL: held-out accuracy {ts['accuracy']} is below {min_accuracy}"); ok = False
if abs(ts["val_loss"] - cs["val_loss"]) > 1e-3 * max(abs(cs["val_loss"]), 1e-12):
    print("FAIL: validation losses differ by more than 1e-3 relative"); ok = False
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
