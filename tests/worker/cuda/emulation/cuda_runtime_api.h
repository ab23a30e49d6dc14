// Emulated CUDA (see cuda_emulation.h): the runtime API's names that
// worker/cuda/cuda_device.h and cuda_util.cuh declare against, and the
// stream-ordered memory calls the kernels' host code makes. "Device" memory is
// host memory: cudaMallocAsync returns 256-byte aligned blocks (as the CUDA
// allocator does) filled with 0xff bytes (NaN as f32 and bf16), so scratch
// read before it is written shows; every block is counted until freed, so a
// leak shows (LiveAllocations). Streams are ignored: launches run to
// completion before they return.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_RUNTIME_API_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_RUNTIME_API_H_

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorUnknown = 999
};
using cudaStream_t = void*;

namespace cuda_emulation {

// The error the last launch left (cudaGetLastError returns and clears it).
inline cudaError_t g_last_error = cudaSuccess;
inline std::atomic<int> g_live_allocations{0};
// Failure injection for the host code's error paths: the next this many
// allocations fail with cudaErrorMemoryAllocation; when positive, counted
// down by each launch, and the launch that brings it to 0 fails with
// cudaErrorInvalidConfiguration without running (cuda_emulation.h's
// Launcher).
inline int g_fail_allocations = 0;
inline int g_launches_until_failure = 0;

inline int LiveAllocations() { return g_live_allocations.load(); }

}  // namespace cuda_emulation

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = cuda_emulation::g_last_error;
  cuda_emulation::g_last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    default:
      return "cudaErrorUnknown";
  }
}

inline cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) {
  if (p == nullptr) return cudaErrorInvalidValue;
  if (cuda_emulation::g_fail_allocations > 0) {
    --cuda_emulation::g_fail_allocations;
    return cudaErrorMemoryAllocation;
  }
  const size_t rounded = (bytes + 255) / 256 * 256;
  *p = std::aligned_alloc(256, rounded == 0 ? 256 : rounded);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xff, rounded == 0 ? 256 : rounded);
  ++cuda_emulation::g_live_allocations;
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t bytes) { return cudaMallocAsync(p, bytes, nullptr); }
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  if (p == nullptr) return cudaSuccess;
  std::free(p);
  --cuda_emulation::g_live_allocations;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) { return cudaFreeAsync(p, nullptr); }
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (p == nullptr && bytes > 0) return cudaErrorInvalidValue;
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_RUNTIME_API_H_
