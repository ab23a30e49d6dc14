#!/usr/bin/env bash
# The prepared GPU session: tests/gpu/run.sh and the GPU benches on a lent
# GPU machine that has no Bazel (the `device` tool's machines: a CUDA image
# with PyTorch, nothing downloadable). Two parts, so that each fits one
# command of that machine (10 minutes) with room for a rerun:
#
#   here, where Bazel is (once per commit; ~40 MB):
#     echo /.gpu/ >> .git/info/exclude; tools/gpu_bundle.sh .gpu/bundle.tar.xz
#   there (carry .gpu; $OUT is the folder that comes back):
#     bash tests/gpu/device_session.sh .gpu/bundle.tar.xz checks   # ~3 min
#     bash tests/gpu/device_session.sh .gpu/bundle.tar.xz bench    # ~5 min
#     bash tests/gpu/device_session.sh .gpu/bundle.tar.xz focus    # ~3.5 min, see below
#
# focus runs FOCUS_STEPS (default parity,quickstart,kernel_bench,gpt_bench;
# also nccl), each step limited to STEP_TIMEOUT s (the quickstart to
# QUICKSTART_TIMEOUT, default STEP_TIMEOUT) and the whole to what the
# caller's `timeout` allows: a TERM prints the summary so far.
#
# checks: every parity check and the quickstart (1800 steps, a few seconds on a GPU) (run.sh steps
# 1, 5-7); bench: the kernel benches and the device GPT beside PyTorch FSDP2
# in interleaved rounds (steps 9-10; ROUNDS, GPT_ATTENTION as run.sh). The
# part not asked for is skipped by run.sh's own switches (RUN_STEPS).
#
# Libraries: the bundle carries ours and CUDA's runtime; cuBLAS, cuBLASLt,
# cuDNN and NCCL come from the machine (its PyTorch's pip packages,
# nvidia/*/lib under python3's site-packages, when it has no system copy).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
bundle="${1:?usage: tests/gpu/device_session.sh BUNDLE.tar.xz checks|bench|all|focus}"
part="${2:-all}"
case "$part" in
  checks) steps="checks" ;;
  bench) steps="bench" ;;
  all) steps="checks,bench" ;;
  focus)
    # A short session after a first full one: the parity checks, the
    # quickstart, the attention bench and GPT-2 124M beside PyTorch in one
    # round, stage 3 also through NCCL's block collectives (the packed
    # path's before), and a short profile of bf16 at stages 0 and 3 with the
    # default attention, where stage 3's extra milliseconds go (~3.5 min).
    steps="${FOCUS_STEPS:-parity,quickstart,kernel_bench,gpt_bench}"
    for s in ${steps//,/ }; do
      case "$s" in
        parity | quickstart | nccl | kernel_bench | gpt_bench | checks | bench) ;;
        *) echo "device_session: FOCUS_STEPS has '$s': expected parity, quickstart, nccl," \
             "kernel_bench, gpt_bench, checks or bench" >&2; exit 2 ;;
      esac
    done
    export ROUNDS="${ROUNDS:-1}" GPT_MODELS="${GPT_MODELS:-gpt2_124m}" GPT_PROFILE="${GPT_PROFILE:-1}"
    export GPT_PROFILE_DTYPES="${GPT_PROFILE_DTYPES:-bf16}"
    export GPT_PROFILE_ATTENTION="${GPT_PROFILE_ATTENTION:-auto}"
    export KERNEL_BENCHES="${KERNEL_BENCHES:-cuda_attention_bench}" GPT_PREFETCH="${GPT_PREFETCH:-1}"
    export GPT_BLOCKS="${GPT_BLOCKS:-1}"
    ;;
  *) echo "device_session: part '$part': expected checks, bench, all or focus" >&2; exit 2 ;;
esac
OUT="${OUT:-/tmp/zeroshard-gpu}"
mkdir -p "$OUT"
B=/tmp/zeroshard-bundle
# Unpacked each time: a warm machine may hold an older bundle.
rm -rf "$B"
mkdir -p "$B" && tar xJf "$bundle" -C "$B" || { echo "cannot unpack $bundle" >&2; exit 1; }
libs="$B/lib"
nvidia_dir="$(python3 -c 'import nvidia, sys; print(list(nvidia.__path__)[0])' 2>/dev/null)"
# CUDA 13's wheels keep cuBLAS and NVRTC in nvidia/cu13/lib, older ones in
# nvidia/<library>/lib.
for d in cudnn cu13 cublas nccl cuda_nvrtc; do
  [[ -n "$nvidia_dir" && -d "$nvidia_dir/$d/lib" ]] && libs="$libs:$nvidia_dir/$d/lib"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee "$OUT/session_env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  | tee -a "$OUT/session_env.txt"
# The naive attention's figures are known (docs/gpu.md); the session's
# minutes go to the fused kernels.
# cuBLASLt's and cuDNN's own reasons, should they refuse something.
export CUBLASLT_LOG_LEVEL="${CUBLASLT_LOG_LEVEL:-1}" CUDNN_LOGERR_DBG="${CUDNN_LOGERR_DBG:-1}"
export CUDNN_LOGDEST_DBG="${CUDNN_LOGDEST_DBG:-$OUT/cudnn_errors.log}"
# The logs that matter, in one file (the device tool returns a few files).
trap 'tar -C "$OUT" -czf "$OUT/logs.tar.gz" --exclude="*.safetensors" --exclude=checkpoints \
  --exclude=state --exclude=logs.tar.gz . 2>/dev/null' EXIT
ZEROSHARD_GPU_BIN="$B/bin" TORCH_PYTHON="${TORCH_PYTHON:-python3}" \
  GPT_ATTENTION="${GPT_ATTENTION:-flash,flash_tc,cudnn}" \
  QUICKSTART_STEPS="${QUICKSTART_STEPS:-1800}" STEP_TIMEOUT="${STEP_TIMEOUT:-240}" \
  RUN_STEPS="$steps" OUT="$OUT" tests/gpu/run.sh
