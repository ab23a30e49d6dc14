// Helpers shared by the .cu files of //worker/cuda:cuda_kernels (private to
// them: included only by nvcc-compiled code).
#ifndef ZEROSHARD_WORKER_CUDA_CUDA_UTIL_CUH_
#define ZEROSHARD_WORKER_CUDA_CUDA_UTIL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {
namespace gpu {
namespace internal {

inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Threads per block of the elementwise kernels.
constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to fill any current
// GPU, few enough that the launch never exceeds the grid limit.
inline unsigned int GridFor(int64_t n, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 1 << 16));
}

// Status of the kernel just launched (launch configuration errors, and any
// sticky error from earlier work on the device).
inline absl::Status LaunchStatus(const char* what) {
  return CudaErrorToStatus(cudaGetLastError(), absl::StrCat(what, ": kernel launch"));
}

inline absl::Status CheckCount(const char* what, const char* name, int64_t value) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": negative ", name, " ", value));
  }
  return absl::OkStatus();
}

inline absl::Status CheckPointer(const char* what, const char* name, const void* p) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " is null"));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Device code.

// Grid-stride loop index helpers.
__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GlobalStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

template <typename T, typename Op>
__device__ __forceinline__ T WarpReduce(T v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Reduces one value per thread over the block; every thread gets the result.
// blockDim.x must be a multiple of 32 (at most 1024), and every thread of the
// block must call it (it synchronizes). The combination order is fixed by the
// block shape, so results are deterministic.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T identity) {
  __shared__ T partial[32];
  __shared__ T result;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpReduce(v, op);
  __syncthreads();  // a previous call may still be reading `partial` / `result`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    T w = lane < warps ? partial[lane] : identity;
    w = WarpReduce(w, op);
    if (lane == 0) result = w;
  }
  __syncthreads();
  return result;
}

// common/dtype.h's FloatToBF16, bit for bit.
__device__ __forceinline__ uint16_t FloatToBF16Bits(float value) {
  uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7fffu + lsb;
  return static_cast<uint16_t>(bits >> 16);
}

__device__ __forceinline__ float BF16BitsToFloat(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

}  // namespace internal
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDA_UTIL_CUH_
