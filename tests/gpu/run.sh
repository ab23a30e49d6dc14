#!/usr/bin/env bash
# GPU acceptance procedure for zeroshard's device path (NCCL data plane,
# CudaBackend, the device MLP and GPT). Run on a machine with NVIDIA GPUs
# (one is enough for every step but 4 and the multi-rank half of 6; ideally
# 4-8x A100/H100), the CUDA toolkit and NCCL installed, from anywhere in the
# repository:
#
#   tests/gpu/run.sh                 # everything
#   MIN_BUSBW_GBPS=150 tests/gpu/run.sh   # also require this bus bandwidth at 1 GiB
#
# Steps (each prints PASS / FAIL / SKIP; the summary lists them all):
#   1. Preconditions: nvidia-smi sees the GPUs; Bazel's @local_cuda found
#      CUDA and NCCL (CUDA_AVAILABLE = True), otherwise the GPU targets would
#      silently be left out of the build. Without a visible GPU every step
#      below is reported SKIP (nothing is built or run) and the exit status
#      is 2.
#   2. Build every GPU target (names containing "cuda" or "nccl") and
#      shard_server, shard_worker, shardctl.
#   3. The host-side GPU tests (the ones CI runs without a GPU).
#   4. The integration tests' assertions (every stage and prefetch equal to
#      one process, grad accumulation, model-state bytes, the GPT at stages 0
#      and 3, a killed peer) with --backend=nccl: worker r on GPU r
#      (ZEROSHARD_BACKEND=nccl). Needs as many GPUs as the tests' largest
#      world (4).
#   5. GPU-versus-CPU parity of every CUDA kernel (cuda_kernels_parity_check),
#      of the ZeRO engine on CudaBackend + CudaMlpModel + NCCL
#      (cuda_engine_parity_check: W = 1, stages 0 and 3, f32 and bf16), and of
#      the device GPT against the CPU GPT (cuda_gpt_parity_check: per-tensor
#      gradients of one pass, then 5 engine steps at stages 0 and 3, f32 and
#      bf16, every attention kernel; the tolerances are stated in that file),
#      of the fused classifier and the cuBLASLt epilogues
#      (cuda_fused_parity_check) and of cuDNN's attention
#      (cuda_cudnn_attention_check; SKIP when libcudnn does not load). The
#      per-tensor tables are in $OUT/gpt_parity.log.
#   6. The quickstart's GPT on one GPU (tests/gpu/quickstart_check.sh: W = 1,
#      stage 3, QUICKSTART_STEPS steps), consolidated by shardctl, then
#      loaded and evaluated by the CPU path (--backend=gloo --init_from):
#      the same validation loss on both sides.
#   7. NcclCommunicator on all visible GPUs: results, byte counts, timeouts,
#      Abort() (nccl_communicator_check).
#   8. All-gather / reduce-scatter bus bandwidth, 1 MiB .. 1 GiB, with the
#      nccl-tests definitions (algbw = bytes / time, busbw = algbw (W-1)/W);
#      the table is kept in $OUT/busbw_<dtype>.txt. Compare busbw at 1 GiB
#      with nccl-tests' all_gather_perf / reduce_scatter_perf on the same
#      machine; set MIN_BUSBW_GBPS to turn that into a pass/fail threshold.
#   9. Kernel benches (cuda_attention_bench: naive / flash (CUDA cores, tensor
#      cores: bf16, and f32 as 3xTF32) attention forward + backward at
#      GPT-2's shape, cuDNN's time at
#      that shape being printed by step 5's check; cuda_fused_bench: the fused
#      classifier and cuBLASLt epilogues against the unfused ops), tables in
#      $OUT/<bench>.txt, JSON beside them.
#  10. Device GPT throughput at W = 1 (cuda_gpt_bench: the gpt_bench GPT and
#      GPT-2 124M, f32 and bf16, stages 0 and 3, every attention kernel in
#      GPT_ATTENTION, default naive,flash,flash_tc,cudnn, flash_tc with both
#      dtypes (f32 as 3xTF32): tokens/s and peak device memory) and PyTorch FSDP2 (fully_shard, tests/gpu/torch_fsdp_gpt2.py)
#      on the same models and GPU, interleaved over ROUNDS (default 2) rounds;
#      tests/gpu/compare_gpt.py prints the ratios ($OUT/compare.txt). PyTorch
#      comes from TORCH_PYTHON if set, else python3 if its torch has CUDA,
#      else PyPI into $OUT/torch-venv (PyPI's Linux wheels carry CUDA); SKIP
#      when none of these works (e.g. no network on the GPU machine).
#
# Exit status: 0 when every step passed; 1 when any failed; 2 when none
# failed but some were skipped (the acceptance is incomplete).
#
# Without Bazel on the GPU machine: build a bundle where Bazel is
# (tools/gpu_bundle.sh: the binaries above plus the shared libraries they need
# beside glibc, CUDA and NCCL), unpack it there, and run with
# ZEROSHARD_GPU_BIN=<bundle>/bin. Steps 1b-4 need Bazel and are then reported
# SKIP (the bundle's machine built them and ran the host-side tests).
#
# Environment: BAZEL (default: bazel), OUT (default: /tmp/zeroshard-gpu),
# ZEROSHARD_GPU_BIN (default: unset = build with Bazel), STEP_TIMEOUT
# (seconds per step, default 900),
# MIN_BUSBW_GBPS (default: unset), BAZEL_FLAGS (extra flags for every build),
# QUICKSTART_STEPS (default: 1800), TORCH_PYTHON (default: unset), ROUNDS
# (default: 2), GPT_ATTENTION (default: naive,flash,flash_tc,cudnn), GPT_MODELS
# (default: gpt_bench,gpt2_124m), GPT_PREFETCH (stage 3's prefetch depths to
# compare, default: 1), GPT_BLOCKS (1: stage 3 also through NCCL's block
# collectives, default: 0), GPT_TORCH_COMPILE (1: PyTorch also with
# torch.compile in each round, compare_gpt.py's COMPILED column; default: 0),
# GPT_PROFILE (0: no profiled round; GPT_PROFILE_STAGES, _DTYPES and
# _ATTENTION narrow it), KERNEL_BENCHES
# (default: cuda_attention_bench cuda_fused_bench), RUN_STEPS (default:
# checks,bench; parts below).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

BAZEL="${BAZEL:-bazel}"
OUT="${OUT:-/tmp/zeroshard-gpu}"
read -r -a EXTRA <<<"${BAZEL_FLAGS:-}"
mkdir -p "$OUT"

declare -a SUMMARY=()
failed=0
skipped=0
step() {  # step NAME STATUS [DETAIL]
  local line
  line=$(printf '%-44s %s' "$1" "$2${3:+ ($3)}")
  SUMMARY+=("$line")
  echo "== $line"
  case "$2" in
    FAIL) failed=1 ;;
    SKIP) skipped=1 ;;
  esac
}
finish() {
  trap - TERM INT
  echo
  echo "== GPU acceptance summary (logs in $OUT)"
  printf '   %s\n' "${SUMMARY[@]}"
  if ((failed)); then exit 1; fi
  if ((skipped)); then exit 2; fi
  exit 0
}

# A step's time limit. --foreground: the step stays in this script's process
# group, so that a limit on the whole session (the device tool's `timeout`)
# ends it too, and nothing runs on after the session; and 124 says it timed
# out (step_failed tells). An array, not a function: a trap that runs while
# a function's redirections hold would write into the step's log.
LIMIT=(timeout --foreground -k 5)
# "FAIL (timed out after N s)" for exit 124, else "FAIL (see LOG)".
step_failed() {  # step_failed NAME RC LOG [LIMIT_S]
  if (($2 == 124 || $2 == 137)); then
    step "$1" FAIL "timed out after ${4:-$STEP_TIMEOUT} s; see $3"
  else
    step "$1" FAIL "see $3"
  fi
}
# The session's own limit (TERM) or Ctrl-C: the summary so far, not nothing.
exec 3>&1
trap 'step "session" FAIL "interrupted (TERM or INT) before its last step" >&3; finish >&3' TERM INT

# --- 1. Preconditions ---------------------------------------------------------
if command -v nvidia-smi >/dev/null && nvidia-smi -L >"$OUT/gpus.txt" 2>&1 &&
  grep -q '^GPU ' "$OUT/gpus.txt"; then
  GPUS=$(grep -c '^GPU ' "$OUT/gpus.txt")
  cat "$OUT/gpus.txt"
  step "nvidia-smi" PASS "$GPUS GPU(s)"
else
  echo "No NVIDIA GPU is visible on this machine (nvidia-smi missing or lists none):"
  echo "every step of the GPU procedure is skipped. CI builds the GPU targets without one."
  step "nvidia-smi" SKIP "no GPU visible"
  for name in "@local_cuda configured" "build GPU targets" "host-side GPU tests" \
    "integration tests, --backend=nccl" "CUDA kernels vs CPU kernels" \
    "ZeRO engine on GPU vs CPU (stages 0, 3)" "device GPT vs CPU GPT" \
    "fused classifier, cuBLASLt epilogues vs CPU" "cuDNN attention vs CPU" \
    "quickstart GPT on GPU, evaluated on CPU" "NcclCommunicator on all GPUs" \
    "bus bandwidth F32" "bus bandwidth BF16" "cuda_attention_bench" "cuda_fused_bench" \
    "device GPT throughput (W = 1)" "PyTorch FSDP2 GPT beside it"; do
    step "$name" SKIP "no GPU visible"
  done
  finish
fi
if ((GPUS < 2)); then
  echo "note: with one GPU the multi-rank checks are skipped and busbw is 0 by definition"
fi

STEP_TIMEOUT="${STEP_TIMEOUT:-900}"
if [[ -n "${ZEROSHARD_GPU_BIN:-}" ]]; then
  BIN="$ZEROSHARD_GPU_BIN"
  for name in "@local_cuda configured" "build GPU targets" "host-side GPU tests" \
    "integration tests, --backend=nccl"; do
    step "$name" SKIP "prebuilt binaries from $BIN"
  done
else  # --- 1b-4 need Bazel ---
if ! "$BAZEL" build "${EXTRA[@]}" @local_cuda//:cudart >"$OUT/configure.log" 2>&1; then
  step "@local_cuda configured" FAIL "see $OUT/configure.log"
  finish
fi
DEFS="$("$BAZEL" info output_base 2>/dev/null)/external/local_cuda/defs.bzl"
if grep -q '^CUDA_AVAILABLE = True' "$DEFS" 2>/dev/null; then
  step "@local_cuda configured" PASS "$(grep -E '^(CUDA_HOME|CUDA_VERSION|NCCL_VERSION)' "$DEFS" | tr '\n' ' ')"
else
  step "@local_cuda configured" FAIL "CUDA/NCCL not found: $(grep '^CUDA_REASON' "$DEFS" 2>/dev/null)"
  finish
fi

# --- 2. Build -----------------------------------------------------------------
GPU_TARGETS=$("$BAZEL" query 'attr(name, "cuda|nccl", //...) except kind("source file", //...)' \
  2>/dev/null | tr '\n' ' ')
echo "GPU targets: $GPU_TARGETS"
# shellcheck disable=SC2086
if "$BAZEL" build "${EXTRA[@]}" $GPU_TARGETS //shard_server //worker:shard_worker //client:shardctl \
  >"$OUT/build.log" 2>&1; then
  step "build GPU targets" PASS "$(wc -w <<<"$GPU_TARGETS") targets"
else
  step "build GPU targets" FAIL "see $OUT/build.log"
  finish
fi
BIN="$("$BAZEL" info bazel-bin 2>/dev/null)"

# --- 3. Host-side GPU tests -----------------------------------------------------
GPU_TESTS=$("$BAZEL" query 'kind(".*_test", attr(name, "cuda|nccl", //...))' 2>/dev/null |
  tr '\n' ' ')
# shellcheck disable=SC2086
if [[ -z "$GPU_TESTS" ]]; then
  step "host-side GPU tests" SKIP "none found"
elif "$BAZEL" test "${EXTRA[@]}" $GPU_TESTS >"$OUT/host_tests.log" 2>&1; then
  step "host-side GPU tests" PASS "$GPU_TESTS"
else
  step "host-side GPU tests" FAIL "see $OUT/host_tests.log"
fi

# --- 4. Integration tests with --backend=nccl ---------------------------------
if ((GPUS < 4)); then
  step "integration tests, --backend=nccl" SKIP "needs 4 GPUs, found $GPUS"
elif "$BAZEL" test "${EXTRA[@]}" //tests/integration:training_test \
  --test_env=ZEROSHARD_BACKEND=nccl --test_output=errors \
  >"$OUT/integration.log" 2>&1; then
  step "integration tests, --backend=nccl" PASS
else
  step "integration tests, --backend=nccl" FAIL "see $OUT/integration.log"
fi

fi  # Bazel steps

# RUN_STEPS (default checks,bench) picks the parts below: checks = parity
# (step 5), quickstart (6) and nccl (7-8); bench = kernel_bench (9) and
# gpt_bench (10). tests/gpu/device_session.sh runs them apart, or in a short
# "focus" session of a few of them.
want() {
  local steps=",${RUN_STEPS:-checks,bench},"
  steps="${steps//,checks,/,parity,quickstart,nccl,}"
  steps="${steps//,bench,/,kernel_bench,gpt_bench,}"
  [[ "$steps" == *",$1,"* ]]
}

if want parity || want quickstart || want nccl; then
if want parity; then
# --- 5. GPU-versus-CPU parity ----------------------------------------------------
if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_kernels_parity_check" >"$OUT/parity.log" 2>&1; then
  step "CUDA kernels vs CPU kernels" PASS
else
  step "CUDA kernels vs CPU kernels" FAIL "see $OUT/parity.log"
fi
# The device GPT's fused kernels: the classifier and cuBLASLt's epilogues,
# and cuDNN's attention (exit 2: cuDNN could not be loaded: SKIP, the GPT then
# runs our flash kernel).
if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_fused_parity_check" >"$OUT/fused_parity.log" 2>&1; then
  step "fused classifier, cuBLASLt epilogues vs CPU" PASS
else
  step "fused classifier, cuBLASLt epilogues vs CPU" FAIL "see $OUT/fused_parity.log"
fi
if [[ -x "$BIN/tests/gpu/cuda_cudnn_attention_check" ]]; then
  "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_cudnn_attention_check" >"$OUT/cudnn_attention.log" 2>&1
  code=$?
else
  echo "not built: this build has no cuDNN frontend (CUDNN_AVAILABLE = False)" >"$OUT/cudnn_attention.log"
  code=2
fi
case $code in
  0) step "cuDNN attention vs CPU" PASS ;;
  2) step "cuDNN attention vs CPU" SKIP "$(tail -n 1 "$OUT/cudnn_attention.log")" ;;
  *) step "cuDNN attention vs CPU" FAIL "see $OUT/cudnn_attention.log" ;;
esac

# --- 5b. The ZeRO engine on the GPU vs the CPU --------------------------------------
if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_engine_parity_check" >"$OUT/engine_parity.log" 2>&1; then
  step "ZeRO engine on GPU vs CPU (stages 0, 3)" PASS
else
  step "ZeRO engine on GPU vs CPU (stages 0, 3)" FAIL "see $OUT/engine_parity.log"
fi

# --- 5c. The device GPT vs the CPU GPT ---------------------------------------------
if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_gpt_parity_check" >"$OUT/gpt_parity.log" 2>&1; then
  step "device GPT vs CPU GPT" PASS "per-tensor figures in $OUT/gpt_parity.log"
else
  step "device GPT vs CPU GPT" FAIL "see $OUT/gpt_parity.log"
fi

fi  # parity

# --- 6. The quickstart's GPT on one GPU, evaluated on the CPU ------------------------
if want quickstart; then
if "${LIMIT[@]}" "${QUICKSTART_TIMEOUT:-$STEP_TIMEOUT}" tests/gpu/quickstart_check.sh "$BIN" \
  "$OUT/quickstart" --backend=nccl --steps="${QUICKSTART_STEPS:-1800}" \
  >"$OUT/quickstart.log" 2>&1; then
  step "quickstart GPT on GPU, evaluated on CPU" PASS "$(grep '^first validation' "$OUT/quickstart.log")"
else
  step_failed "quickstart GPT on GPU, evaluated on CPU" $? "$OUT/quickstart.log" \
    "${QUICKSTART_TIMEOUT:-$STEP_TIMEOUT}"
fi

  grep -E '^(training|CPU on)' "$OUT/quickstart.log"
fi

# --- 7. NcclCommunicator on all GPUs ----------------------------------------------
if want nccl; then
if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/nccl_communicator_check" >"$OUT/nccl_check.log" 2>&1; then
  if grep -q '\[  SKIPPED \]' "$OUT/nccl_check.log"; then
    step "NcclCommunicator on all GPUs" SKIP "some cases need 2 GPUs; see $OUT/nccl_check.log"
  else
    step "NcclCommunicator on all GPUs" PASS "$GPUS GPU(s)"
  fi
else
  step "NcclCommunicator on all GPUs" FAIL "see $OUT/nccl_check.log"
fi

# --- 8. Bus bandwidth -------------------------------------------------------------
for dtype in F32 BF16; do
  table="$OUT/busbw_${dtype}.txt"
  if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/nccl_busbw_bench" --dtype="$dtype" --min_bytes=$((1 << 20)) \
    --max_bytes=$((1 << 30)) >"$table" 2>&1; then
    cat "$table"
    # The last row is the largest size; its fields 6 and 10 are the busbw of
    # all-gather and reduce-scatter (GB/s).
    read -r ag rs < <(awk '$1 ~ /^[0-9]+$/ {ag = $6; rs = $10} END {print ag, rs}' "$table")
    detail="busbw at 1 GiB: all_gather ${ag} GB/s, reduce_scatter ${rs} GB/s"
    if [[ -n "${MIN_BUSBW_GBPS:-}" ]] &&
      ! awk -v a="$ag" -v r="$rs" -v m="$MIN_BUSBW_GBPS" 'BEGIN {exit !(a >= m && r >= m)}'; then
      step "bus bandwidth $dtype" FAIL "$detail < $MIN_BUSBW_GBPS"
    else
      step "bus bandwidth $dtype" PASS "$detail"
    fi
  else
    step "bus bandwidth $dtype" FAIL "see $table"
  fi
done

fi  # nccl
else
  step "checks (steps 5-8)" SKIP "not in RUN_STEPS=$RUN_STEPS"
fi

if want kernel_bench || want gpt_bench; then
# --- 9. Kernel benches: attention (naive / flash / cuDNN) and the fused ops ---------
KERNEL_BENCHES="${KERNEL_BENCHES:-cuda_attention_bench cuda_fused_bench}"
want kernel_bench || KERNEL_BENCHES=""
for b in $KERNEL_BENCHES; do
  if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/$b" --json_out="$OUT/$b.json" >"$OUT/$b.txt" \
    2>"$OUT/$b.log"; then
    cat "$OUT/$b.txt"
    step "$b" PASS "$OUT/$b.json"
  else
    step "$b" FAIL "see $OUT/$b.log"
  fi
done

# --- 10. Device GPT throughput beside PyTorch FSDP2, interleaved -------------------------
if want gpt_bench; then
# ROUNDS rounds of (cuda_gpt_bench, torch_fsdp_gpt2.py), so that a clock or
# thermal drift shows as a difference between rounds rather than as a
# difference between the two; tests/gpu/compare_gpt.py prints the ratios.
torch_python=""
torch_note=""
has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  >/dev/null 2>&1; }
if [[ -n "${TORCH_PYTHON:-}" ]]; then
  if has_cuda_torch "$TORCH_PYTHON"; then torch_python="$TORCH_PYTHON"; else
    torch_note="TORCH_PYTHON=$TORCH_PYTHON has no torch with CUDA"; fi
elif has_cuda_torch python3; then
  torch_python=python3
elif has_cuda_torch "$OUT/torch-venv/bin/python"; then
  torch_python="$OUT/torch-venv/bin/python"
elif python3 -m venv "$OUT/torch-venv" >"$OUT/torch_install.log" 2>&1 &&
  "$OUT/torch-venv/bin/pip" install --quiet torch numpy >>"$OUT/torch_install.log" 2>&1 &&
  has_cuda_torch "$OUT/torch-venv/bin/python"; then
  torch_python="$OUT/torch-venv/bin/python"
else
  torch_note="no torch with CUDA: pip install torch from PyPI failed (see $OUT/torch_install.log)"
fi
ROUNDS="${ROUNDS:-2}"
GPT_MODELS="${GPT_MODELS:-gpt_bench,gpt2_124m}"
GPT_PREFETCH="${GPT_PREFETCH:-1}"
bench_failed=0
torch_state=""
for round in $(seq 1 "$ROUNDS"); do
  if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_gpt_bench" --models="$GPT_MODELS" \
    --attention="${GPT_ATTENTION:-naive,flash,flash_tc,cudnn}" \
    --json_out="$OUT/gpt_bench.$round.json" >"$OUT/gpt_bench.$round.txt" 2>"$OUT/gpt_bench.$round.log"; then
    cat "$OUT/gpt_bench.$round.txt"
  else
    bench_failed=1
  fi
  # Stage 3 again with each deeper prefetch of GPT_PREFETCH (compare_gpt.py
  # shows them as "3 p2" ...).
  for p in ${GPT_PREFETCH//,/ }; do
    [[ "$p" == 1 ]] && continue
    if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_gpt_bench" --models="$GPT_MODELS" --stages=3 \
      --prefetch="$p" --attention="${GPT_ATTENTION:-naive,flash,flash_tc,cudnn}" \
      --json_out="$OUT/gpt_bench.p$p.$round.json" >"$OUT/gpt_bench.p$p.$round.txt" \
      2>"$OUT/gpt_bench.p$p.$round.log"; then
      cat "$OUT/gpt_bench.p$p.$round.txt"
    else
      bench_failed=1
    fi
  done
  # GPT_BLOCKS=1: stage 3 again through NCCL's block collectives
  # (--packed_collectives=false; compare_gpt.py shows "3 blk"), the
  # before of the packed collectives in the same run.
  if [[ "${GPT_BLOCKS:-0}" == 1 ]]; then
    if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_gpt_bench" --models="$GPT_MODELS" --stages=3 \
      --packed_collectives=false --attention="${GPT_ATTENTION:-naive,flash,flash_tc,cudnn}" \
      --json_out="$OUT/gpt_bench.blk.$round.json" >"$OUT/gpt_bench.blk.$round.txt" \
      2>"$OUT/gpt_bench.blk.$round.log"; then
      cat "$OUT/gpt_bench.blk.$round.txt"
    else
      bench_failed=1
    fi
  fi
  [[ -z "$torch_python" ]] && continue
  "${LIMIT[@]}" "$STEP_TIMEOUT" "$torch_python" tests/gpu/torch_fsdp_gpt2.py --models="$GPT_MODELS" \
    --json_out="$OUT/torch_fsdp.$round.json" >"$OUT/torch_fsdp.$round.txt" 2>"$OUT/torch_fsdp.$round.log"
  code=$?
  cat "$OUT/torch_fsdp.$round.txt"
  if ((code == 3)); then torch_state="skip"; torch_note="$(tail -n 1 "$OUT/torch_fsdp.$round.log")"
  elif ((code != 0)); then torch_state="fail"; fi
  # GPT_TORCH_COMPILE=1: PyTorch again under torch.compile (eager stays the
  # ratio's baseline; a compile that fails or runs out of time loses only
  # this column: see its log).
  if [[ "${GPT_TORCH_COMPILE:-0}" == 1 && "$torch_state" != skip ]]; then
    "${LIMIT[@]}" "$STEP_TIMEOUT" "$torch_python" tests/gpu/torch_fsdp_gpt2.py --models="$GPT_MODELS" \
      --compile --json_out="$OUT/torch_fsdp.compiled.$round.json" \
      >"$OUT/torch_fsdp.compiled.$round.txt" 2>"$OUT/torch_fsdp.compiled.$round.log" &&
      cat "$OUT/torch_fsdp.compiled.$round.txt"
  fi
done
if ((bench_failed)); then
  step "device GPT throughput (W = 1)" FAIL "see $OUT/gpt_bench.*.log"
else
  step "device GPT throughput (W = 1)" PASS "$OUT/gpt_bench.*.json"
fi
if [[ -z "$torch_python" || "$torch_state" == skip ]]; then
  step "PyTorch FSDP2 GPT beside it" SKIP "$torch_note"
elif [[ "$torch_state" == fail ]]; then
  step "PyTorch FSDP2 GPT beside it" FAIL "see $OUT/torch_fsdp.*.log"
else
  step "PyTorch FSDP2 GPT beside it" PASS "$OUT/torch_fsdp.*.json"
fi
# The tables (ours beside PyTorch, stage 3 beside stage 0) from whatever
# rounds finished, before the profile: a session cut short keeps them.
shopt -s nullglob
ours=("$OUT"/gpt_bench.*.json)
theirs=()
[[ -n "$torch_python" && -z "$torch_state" ]] && theirs=("$OUT"/torch_fsdp.*.json)
shopt -u nullglob
if ((${#ours[@]})); then
  python3 tests/gpu/compare_gpt.py "${ours[@]}" -- "${theirs[@]}" | tee "$OUT/compare.txt"
fi
# Where the GPU time goes, in a round of its own (CUDA events between the
# model's sections; not among the rounds compared above): GPT-2 124M,
# stages 0 and 3 side by side (what stage 3 adds), each kernel;
# GPT_PROFILE_STAGES, GPT_PROFILE_DTYPES and GPT_PROFILE_ATTENTION narrow it.
if [[ "${GPT_PROFILE:-1}" != 0 ]]; then
  if "${LIMIT[@]}" "$STEP_TIMEOUT" "$BIN/tests/gpu/cuda_gpt_bench" --profile --models=gpt2_124m \
    --stages="${GPT_PROFILE_STAGES:-0,3}" --dtypes="${GPT_PROFILE_DTYPES:-f32,bf16}" --steps=5 \
    --attention="${GPT_PROFILE_ATTENTION:-${GPT_ATTENTION:-naive,flash,flash_tc,cudnn}}" \
    --json_out="$OUT/gpt_profile.json" \
    >"$OUT/gpt_profile.txt" 2>"$OUT/gpt_profile.log"; then
    cat "$OUT/gpt_profile.txt"
    step "device GPT profile (stages 0 and 3)" PASS "$OUT/gpt_profile.json"
  else
    step_failed "device GPT profile (stages 0 and 3)" $? "$OUT/gpt_profile.log"
  fi
fi

fi  # gpt_bench
else
  step "benches (steps 9-10)" SKIP "not in RUN_STEPS=$RUN_STEPS"
fi

finish
