// Packed layouts (worker/zero/packed_layout.h) on the device: PackRuns,
// UnpackRuns and their variants of kernels.h. One thread per packed element
// (grid-stride) finds its run by binary search over the run starts (a few
// hundred bytes per unit, read by every thread: they stay in cache), so a
// unit moves in one launch however many blocks its layout has.
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BF16BitsToFloat;
using internal::FloatToBF16Bits;
using internal::GlobalStride;
using internal::GlobalThread;
using internal::GridFor;
using internal::kThreads;
using internal::LaunchStatus;

// runs: pairs (packed_begin, full_offset), packed_begin increasing from 0.
// The last run whose start is at or before i.
__device__ __forceinline__ int64_t FindRun(const int64_t* runs, int64_t num_runs, int64_t i) {
  int64_t lo = 0, hi = num_runs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (runs[2 * mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ void Store(float* p, float v) { *p = v; }
__device__ __forceinline__ void Store(uint16_t* p, float v) { *p = FloatToBF16Bits(v); }
__device__ __forceinline__ float Load(const float* p) { return *p; }
__device__ __forceinline__ float Load(const uint16_t* p) { return BF16BitsToFloat(*p); }

template <typename T>
__global__ void PackKernel(T* packed, const float* full, const int64_t* runs, int64_t num_runs,
                           int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const int64_t r = FindRun(runs, num_runs, i);
    const int64_t at = runs[2 * r + 1];
    Store(packed + i, at < 0 ? 0.0f : full[at + (i - runs[2 * r])]);
  }
}

template <typename T>
__global__ void UnpackKernel(float* full, const T* packed, const int64_t* runs, int64_t num_runs,
                             int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const int64_t r = FindRun(runs, num_runs, i);
    const int64_t at = runs[2 * r + 1];
    if (at >= 0) full[at + (i - runs[2 * r])] = Load(packed + i);
  }
}

// UnpackKernel from bf16 into bf16: the bits as they are.
__global__ void UnpackBF16RawKernel(uint16_t* full, const uint16_t* packed, const int64_t* runs,
                                    int64_t num_runs, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const int64_t r = FindRun(runs, num_runs, i);
    const int64_t at = runs[2 * r + 1];
    if (at >= 0) full[at + (i - runs[2 * r])] = packed[i];
  }
}

// UnpackKernel from f32 with each value rounded through bf16.
__global__ void UnpackThroughBF16Kernel(float* full, const float* packed, const int64_t* runs,
                                        int64_t num_runs, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const int64_t r = FindRun(runs, num_runs, i);
    const int64_t at = runs[2 * r + 1];
    if (at >= 0) full[at + (i - runs[2 * r])] = BF16BitsToFloat(FloatToBF16Bits(packed[i]));
  }
}

absl::Status CheckPacking(const char* what, DType dtype, const void* a, const void* b,
                          const int64_t* runs, int64_t num_runs, int64_t n) {
  if (n < 0 || num_runs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": negative count (", n, " elements, ", num_runs, " runs)"));
  }
  if (n > 0 && (a == nullptr || b == nullptr || runs == nullptr || num_runs == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null buffer or no runs"));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype ", DTypeName(dtype), " is not F32 or BF16"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PackRuns(void* packed, DType to, const float* full, const int64_t* runs,
                      int64_t num_runs, int64_t n, void* stream) {
  if (absl::Status s = CheckPacking("PackRuns", to, packed, full, runs, num_runs, n);
      !s.ok() || n == 0) {
    return s;
  }
  if (to == DType::kF32) {
    PackKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(static_cast<float*>(packed), full,
                                                              runs, num_runs, n);
  } else {
    PackKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(static_cast<uint16_t*>(packed), full,
                                                              runs, num_runs, n);
  }
  return LaunchStatus("PackRuns");
}

absl::Status UnpackRuns(float* full, const void* packed, DType from, const int64_t* runs,
                        int64_t num_runs, int64_t n, void* stream) {
  if (absl::Status s = CheckPacking("UnpackRuns", from, full, packed, runs, num_runs, n);
      !s.ok() || n == 0) {
    return s;
  }
  if (from == DType::kF32) {
    UnpackKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
        full, static_cast<const float*>(packed), runs, num_runs, n);
  } else {
    UnpackKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
        full, static_cast<const uint16_t*>(packed), runs, num_runs, n);
  }
  return LaunchStatus("UnpackRuns");
}

absl::Status UnpackRunsRaw(void* full, const void* packed, DType dtype, const int64_t* runs,
                           int64_t num_runs, int64_t n, void* stream) {
  // f32 into f32 is UnpackRuns's copy.
  if (dtype == DType::kF32) {
    return UnpackRuns(static_cast<float*>(full), packed, dtype, runs, num_runs, n, stream);
  }
  if (absl::Status s = CheckPacking("UnpackRunsRaw", dtype, full, packed, runs, num_runs, n);
      !s.ok() || n == 0) {
    return s;
  }
  UnpackBF16RawKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
      static_cast<uint16_t*>(full), static_cast<const uint16_t*>(packed), runs, num_runs, n);
  return LaunchStatus("UnpackRunsRaw");
}

absl::Status UnpackRunsThrough(float* full, const float* packed, DType through, const int64_t* runs,
                               int64_t num_runs, int64_t n, void* stream) {
  if (through == DType::kF32) return UnpackRuns(full, packed, through, runs, num_runs, n, stream);
  if (absl::Status s = CheckPacking("UnpackRunsThrough", through, full, packed, runs, num_runs, n);
      !s.ok() || n == 0) {
    return s;
  }
  UnpackThroughBF16Kernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(full, packed, runs,
                                                                         num_runs, n);
  return LaunchStatus("UnpackRunsThrough");
}

}  // namespace gpu
}  // namespace zeroshard
