#!/usr/bin/env bash
# Packs tests/gpu/run.sh's binaries for a GPU machine that has no Bazel and
# none of Debian's libraries (a CUDA image): the GPU checks and benches,
# shard_server, shard_worker and shardctl under bin/ in bazel-bin's layout,
# and under lib/ every shared library they load except glibc's, the C++
# runtime's, CUDA's driver and NCCL (the GPU machine's own CUDA and NCCL are
# used: set LD_LIBRARY_PATH to lib/ and to where they live there).
#
#   tools/gpu_bundle.sh OUT.tar.xz
#   # there:  mkdir B && tar xJf OUT.tar.xz -C B
#   #         LD_LIBRARY_PATH=B/lib:<cuda lib64>:<nccl lib> ZEROSHARD_GPU_BIN=B/bin tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:?usage: tools/gpu_bundle.sh OUT.tar.xz}")"
BAZEL="${BAZEL:-bazel}"

checks=(cuda_kernels_parity_check cuda_engine_parity_check cuda_gpt_parity_check
  cuda_fused_parity_check cuda_cudnn_attention_check nccl_communicator_check nccl_busbw_bench
  cuda_attention_bench cuda_fused_bench cuda_gpt_bench)
# cuda_cudnn_attention_check exists only in a build with cuDNN's frontend
# (CUDNN_AVAILABLE): a check that is not defined is left out, said here.
present=()
for c in "${checks[@]}"; do
  if "$BAZEL" query "//tests/gpu:$c" >/dev/null 2>&1; then present+=("$c"); else
    echo "gpu_bundle: //tests/gpu:$c is not defined in this build; left out" >&2
    # Only cuDNN's check may be missing: without the others the bundle is
    # useless on the GPU machine (is @local_cuda configured? bazel info
    # output_base, then external/local_cuda/defs.bzl says why not).
    if [[ "$c" != cuda_cudnn_attention_check ]]; then
      echo "gpu_bundle: no bundle without //tests/gpu:$c" >&2
      exit 1
    fi
  fi
done
checks=("${present[@]}")
targets=(//shard_server //worker:shard_worker //client:shardctl)
for c in "${checks[@]}"; do targets+=("//tests/gpu:$c"); done
"$BAZEL" build "${targets[@]}"
bin="$("$BAZEL" info bazel-bin 2>/dev/null)"

mkdir -p "$(dirname "$out")"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin/tests/gpu" "$stage/bin/shard_server" "$stage/bin/worker" "$stage/bin/client" "$stage/lib"
files=()
for c in "${checks[@]}"; do cp "$bin/tests/gpu/$c" "$stage/bin/tests/gpu/"; files+=("$stage/bin/tests/gpu/$c"); done
cp "$bin/shard_server/shard_server" "$stage/bin/shard_server/"
cp "$bin/worker/shard_worker" "$stage/bin/worker/"
cp "$bin/client/shardctl" "$stage/bin/client/"
files+=("$stage/bin/shard_server/shard_server" "$stage/bin/worker/shard_worker" "$stage/bin/client/shardctl")

# Libraries the target machine is expected to have: glibc, the C++ runtime,
# CUDA's runtime and NCCL (taken from the machine, matching its driver).
skip='^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libstdc\+\+|libgcc_s|linux-vdso|libnccl|libcuda)\.'
for f in "${files[@]}"; do
  ldd "$f" | awk -v f="$f" '$2 == "=>" && $3 ~ /^\// {print $1, $3}
    $2 == "=>" && $3 == "not" {print "gpu_bundle: " f ": " $1 " not found" > "/dev/stderr"}'
done | sort -u | while read -r name path; do
  [[ "$name" =~ $skip ]] && continue
  cp -L "$path" "$stage/lib/$name"
done
strip --strip-unneeded "$stage"/bin/*/* "$stage"/bin/tests/gpu/* "$stage"/lib/* 2>/dev/null || true
tar -C "$stage" -cJf "$out" bin lib
echo "gpu_bundle: $(du -h "$out" | cut -f1) -> $out ($(ls "$stage/lib" | wc -l) libraries)"
