#!/usr/bin/env bash
# GPU acceptance procedure for zeroshard's NCCL data plane. Run on a machine
# with NVIDIA GPUs (ideally 2 or more, e.g. 8x A100/H100), the CUDA toolkit
# and NCCL installed, from anywhere in the repository:
#
#   tests/gpu/run.sh                 # everything
#   MIN_BUSBW_GBPS=150 tests/gpu/run.sh   # also require this bus bandwidth at 1 GiB
#
# Steps (each prints PASS / FAIL / SKIP; the summary lists them all):
#   1. Preconditions: nvidia-smi sees the GPUs; Bazel's @local_cuda found
#      CUDA and NCCL (CUDA_AVAILABLE = True), otherwise the GPU targets would
#      silently be left out of the build.
#   2. Build every GPU target (names containing "cuda" or "nccl") and
#      shard_worker.
#   3. The host-side GPU tests (the ones CI runs without a GPU).
#   4. The MLP integration tests' assertions (every stage and prefetch equal
#      to one process, grad accumulation, model-state bytes, a killed peer)
#      with --backend=nccl: worker r on GPU r (ZEROSHARD_BACKEND=nccl). Needs
#      as many GPUs as the tests' largest world (4). The GPT test is left out:
#      --backend=nccl trains the MLP only so far.
#   5. GPU-versus-CPU parity of every CUDA kernel (cuda_kernels_parity_check),
#      and of the ZeRO engine itself on CudaBackend + CudaMlpModel + NCCL
#      (cuda_engine_parity_check: W = 1, stages 0 and 3, f32 and bf16).
#   6. NcclCommunicator on all visible GPUs: results, byte counts, timeouts,
#      Abort() (nccl_communicator_check).
#   7. All-gather / reduce-scatter bus bandwidth, 1 MiB .. 1 GiB, with the
#      nccl-tests definitions (algbw = bytes / time, busbw = algbw (W-1)/W);
#      the table is kept in $OUT/busbw_<dtype>.txt. Compare busbw at 1 GiB
#      with nccl-tests' all_gather_perf / reduce_scatter_perf on the same
#      machine; set MIN_BUSBW_GBPS to turn that into a pass/fail threshold.
#
# Exit status: 0 when every step passed; 1 when any failed; 2 when none
# failed but some were skipped (the acceptance is incomplete).
#
# Environment: BAZEL (default: bazel), OUT (default: /tmp/zeroshard-gpu),
# MIN_BUSBW_GBPS (default: unset), BAZEL_FLAGS (extra flags for every build).
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
  echo
  echo "== GPU acceptance summary (logs in $OUT)"
  printf '   %s\n' "${SUMMARY[@]}"
  if ((failed)); then exit 1; fi
  if ((skipped)); then exit 2; fi
  exit 0
}

# --- 1. Preconditions ---------------------------------------------------------
if command -v nvidia-smi >/dev/null && nvidia-smi -L >"$OUT/gpus.txt" 2>&1; then
  GPUS=$(grep -c '^GPU ' "$OUT/gpus.txt")
  cat "$OUT/gpus.txt"
  step "nvidia-smi" PASS "$GPUS GPU(s)"
else
  step "nvidia-smi" FAIL "no GPU visible; this procedure needs one"
  finish
fi
if ((GPUS < 2)); then
  echo "note: with one GPU the multi-rank checks are skipped and busbw is 0 by definition"
fi

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
if "$BAZEL" build "${EXTRA[@]}" $GPU_TARGETS //worker:shard_worker >"$OUT/build.log" 2>&1; then
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
  --test_env=ZEROSHARD_BACKEND=nccl --test_filter=-TrainingTest.Gpt* --test_output=errors \
  >"$OUT/integration.log" 2>&1; then
  step "integration tests, --backend=nccl" PASS
else
  step "integration tests, --backend=nccl" FAIL "see $OUT/integration.log"
fi

# --- 5. GPU-versus-CPU parity ----------------------------------------------------
if "$BIN/tests/gpu/cuda_kernels_parity_check" >"$OUT/parity.log" 2>&1; then
  step "CUDA kernels vs CPU kernels" PASS
else
  step "CUDA kernels vs CPU kernels" FAIL "see $OUT/parity.log"
fi

# --- 5b. The ZeRO engine on the GPU vs the CPU --------------------------------------
if "$BIN/tests/gpu/cuda_engine_parity_check" >"$OUT/engine_parity.log" 2>&1; then
  step "ZeRO engine on GPU vs CPU (stages 0, 3)" PASS
else
  step "ZeRO engine on GPU vs CPU (stages 0, 3)" FAIL "see $OUT/engine_parity.log"
fi

# --- 6. NcclCommunicator on all GPUs ----------------------------------------------
if "$BIN/tests/gpu/nccl_communicator_check" >"$OUT/nccl_check.log" 2>&1; then
  if grep -q '\[  SKIPPED \]' "$OUT/nccl_check.log"; then
    step "NcclCommunicator on $GPUS GPU(s)" SKIP "some cases need 2 GPUs; see $OUT/nccl_check.log"
  else
    step "NcclCommunicator on $GPUS GPU(s)" PASS
  fi
else
  step "NcclCommunicator on $GPUS GPU(s)" FAIL "see $OUT/nccl_check.log"
fi

# --- 7. Bus bandwidth -------------------------------------------------------------
for dtype in F32 BF16; do
  table="$OUT/busbw_${dtype}.txt"
  if "$BIN/tests/gpu/nccl_busbw_bench" --dtype="$dtype" --min_bytes=$((1 << 20)) \
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

finish
