// The fused classifier (classifier.h): one thread block per row. The forward
// pass reads the row once with an online softmax (worker/model/
// classifier_chunked.h, whose element math this file shares: that header's
// host twin is the tested reference); the backward reads the logits once and
// writes the gradient over them.
//
// Loads are 16 bytes (4 f32 or 8 bf16 logits): row r starts at element
// r * ld, for packed rows of V = 50257 logits at any 4- or 2-byte boundary,
// so each row is split at its own address into a head of single logits up
// to the first 16-byte boundary, the aligned vectors, and a tail of single
// logits (with ld a multiple of 8, every row alike). Thread i takes head
// element i, vectors i, i + 256, ..., and tail element i, all into one
// partial; the 256 partials are then combined in a fixed tree (warp
// butterfly, then warp 0 over the 8 warps).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/classifier.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/model/classifier_chunked.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BF16BitsToFloat;
using internal::BlockReduce;
using internal::CheckCount;
using internal::FloatToBF16Bits;
using internal::LaunchStatus;
using internal::SumOp;

constexpr int kRowThreads = 256;  // ClassifierChunking's default lanes
constexpr int kCountThreads = 1024;

__device__ __forceinline__ float Widen(float x) { return x; }
__device__ __forceinline__ float Widen(uint16_t x) { return BF16BitsToFloat(x); }
__device__ __forceinline__ void Store(float* p, float x) { *p = x; }
__device__ __forceinline__ void Store(uint16_t* p, float x) { *p = FloatToBF16Bits(x); }

// 16 bytes of T, as floats.
template <typename T>
struct Vec16 {
  static constexpr int kCount = 16 / sizeof(T);
  float x[kCount];

  __device__ __forceinline__ void Load(const T* p) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kCount; ++k) x[k] = Widen(e[k]);
  }
  __device__ __forceinline__ void StoreTo(T* p) const {
    uint4 raw{};  // every byte is written below; GCC's emulated build cannot tell
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < kCount; ++k) Store(&e[k], x[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

// The row's split (classifier_chunked.h's SplitRow): the head runs to the
// first 16-byte boundary.
template <typename T>
__device__ __forceinline__ RowSplit SplitRowAt(const T* z, int64_t v) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(z);
  return SplitRow(static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(T)), v, Vec16<T>::kCount);
}

__device__ __forceinline__ SoftmaxPartial ShuffleXor(SoftmaxPartial p, int offset) {
  SoftmaxPartial o;
  o.max = __shfl_xor_sync(0xffffffffu, p.max, offset);
  o.sum = __shfl_xor_sync(0xffffffffu, p.sum, offset);
  return o;
}

// The block's combination of its threads' partials; every thread gets it.
__device__ SoftmaxPartial BlockCombine(SoftmaxPartial p) {
  __shared__ SoftmaxPartial warp_partial[kRowThreads / 32];
  __shared__ SoftmaxPartial result;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    p = CombineSoftmaxPartials(p, ShuffleXor(p, offset));
  }
  if (lane == 0) warp_partial[warp] = p;
  __syncthreads();
  if (warp == 0) {
    SoftmaxPartial w = lane < kRowThreads / 32 ? warp_partial[lane] : EmptySoftmaxPartial();
    for (int offset = 16; offset > 0; offset >>= 1) {
      w = CombineSoftmaxPartials(w, ShuffleXor(w, offset));
    }
    if (lane == 0) result = w;
  }
  __syncthreads();
  return result;
}

template <typename T>
__device__ SoftmaxPartial RowPartial(const T* z, int64_t v) {
  const RowSplit split = SplitRowAt(z, v);
  SoftmaxPartial p = EmptySoftmaxPartial();
  const int64_t i = threadIdx.x;
  if (i < split.head) {
    const float zi = Widen(z[i]);
    p = SoftmaxPartialAddVector(
        p, [&](int) { return zi; }, 1);
  }
  const T* body = z + split.head;
  // Unrolled so that several loads are in flight per thread (the arithmetic
  // order is the loop's either way).
#pragma unroll 4
  for (int64_t vec = i; vec < split.vectors; vec += kRowThreads) {
    Vec16<T> x;
    x.Load(body + vec * Vec16<T>::kCount);
    p = SoftmaxPartialAddVector(
        p, [&](int k) { return x.x[k]; }, Vec16<T>::kCount);
  }
  if (split.tail_begin + i < v) {
    const float zi = Widen(z[split.tail_begin + i]);
    p = SoftmaxPartialAddVector(
        p, [&](int) { return zi; }, 1);
  }
  return BlockCombine(p);
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    ForwardRowKernel(double* row_loss, float* lse, const T* logits, const int32_t* targets,
                     int64_t v, int64_t ld) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t == kUnscoredTarget) {  // the whole block leaves: no barrier is skipped
    if (threadIdx.x == 0) {
      lse[row] = 0.0f;
      row_loss[row] = 0.0;
    }
    return;
  }
  const T* z = logits + row * ld;
  const SoftmaxPartial p = RowPartial(z, v);
  if (threadIdx.x == 0) {
    lse[row] = SoftmaxPartialLse(p);
    row_loss[row] = t >= 0 && t < v ? RowLoss(p, Widen(z[t])) : NAN;
  }
}

// One block: the scored rows' count and the mean of the row losses, each in a
// fixed order (strided per thread, then BlockReduce's tree).
__global__ void __launch_bounds__(kCountThreads)
    MeanLossKernel(double* loss, const double* row_loss, const int32_t* targets, int64_t n) {
  double sum = 0.0;
  long long scored = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    sum += row_loss[i];
    scored += targets[i] != kUnscoredTarget;
  }
  sum = BlockReduce(sum, SumOp(), 0.0);
  scored = BlockReduce(scored, SumOp(), 0LL);
  if (threadIdx.x == 0) *loss = scored == 0 ? 0.0 : sum / static_cast<double>(scored);
}

// One block: *inv = 1 / (scored rows), 0 when none.
__global__ void __launch_bounds__(kCountThreads)
    InverseScoredKernel(float* inv, const int32_t* targets, int64_t n) {
  long long scored = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) scored += targets[i] != kUnscoredTarget;
  scored = BlockReduce(scored, SumOp(), 0LL);
  if (threadIdx.x == 0) *inv = scored == 0 ? 0.0f : 1.0f / static_cast<float>(scored);
}

// dlogits may alias logits: each element is read, then written, by one
// thread. The padding [v, ld) is written 0 without being read.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    BackwardRowKernel(T* dlogits, const T* logits, const float* lse, const int32_t* targets,
                      const float* inv_scored, int64_t v, int64_t ld) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  const T* z = logits + row * ld;
  T* d = dlogits + row * ld;
  const int64_t i = threadIdx.x;
  for (int64_t j = v + i; j < ld; j += kRowThreads) Store(&d[j], 0.0f);
  if (t == kUnscoredTarget) {  // zeros, without reading the row
    for (int64_t j = i; j < v; j += kRowThreads) Store(&d[j], 0.0f);
    return;
  }
  const float l = lse[row];
  const float inv = *inv_scored;
  auto grad = [&](float zj, int64_t j) { return ClassifierGradient(zj, l, j == t, inv); };
  // The vector path needs z and d equally aligned (equal mod 16, as when they
  // alias); otherwise one element per thread.
  const uintptr_t skew = reinterpret_cast<uintptr_t>(z) ^ reinterpret_cast<uintptr_t>(d);
  if ((skew & 15) != 0) {
    for (int64_t j = i; j < v; j += kRowThreads) Store(&d[j], grad(Widen(z[j]), j));
    return;
  }
  const RowSplit split = SplitRowAt(z, v);
  if (i < split.head) Store(&d[i], grad(Widen(z[i]), i));
#pragma unroll 4
  for (int64_t vec = i; vec < split.vectors; vec += kRowThreads) {
    const int64_t j0 = split.head + vec * Vec16<T>::kCount;
    Vec16<T> x;
    x.Load(z + j0);
#pragma unroll
    for (int k = 0; k < Vec16<T>::kCount; ++k) x.x[k] = grad(x.x[k], j0 + k);
    x.StoreTo(d + j0);
  }
  const int64_t j = split.tail_begin + i;
  if (j < v) Store(&d[j], grad(Widen(z[j]), j));
}

absl::Status CheckArgs(const char* what, int64_t n, int64_t v, int64_t ld, DType dtype) {
  if (absl::Status s = CheckCount(what, "n", n); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "v", v); !s.ok()) return s;
  if (ld < v) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ld ", ld, " is less than v ", v,
                     "; ld is the elements between the starts of consecutive rows (v for "
                     "packed rows, more for padded ones)"));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": logits dtype ", DTypeName(dtype),
                                                   " is not supported (F32 and BF16 are)"));
  }
  if (n > 0 && v == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": v is 0 (no classes) for ", n, " rows"));
  }
  if (n > 0x7fffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": n ", n, " exceeds the grid limit (2^31 - 1 rows)"));
  }
  return absl::OkStatus();
}

template <typename T>
void LaunchForwardRows(double* row_loss, float* lse, const void* logits, const int32_t* targets,
                       int64_t n, int64_t v, int64_t ld, cudaStream_t st) {
  ForwardRowKernel<T><<<static_cast<unsigned int>(n), kRowThreads, 0, st>>>(
      row_loss, lse, static_cast<const T*>(logits), targets, v, ld);
}

template <typename T>
void LaunchBackwardRows(void* dlogits, const void* logits, const float* lse, const int32_t* targets,
                        const float* inv, int64_t n, int64_t v, int64_t ld, cudaStream_t st) {
  BackwardRowKernel<T><<<static_cast<unsigned int>(n), kRowThreads, 0, st>>>(
      static_cast<T*>(dlogits), static_cast<const T*>(logits), lse, targets, inv, v, ld);
}

}  // namespace

absl::Status ClassifierForward(double* loss, float* lse, const void* logits, const int32_t* targets,
                               int64_t n, int64_t v, int64_t ld, DType dtype, void* stream) {
  static constexpr char kWhat[] = "ClassifierForward";
  if (absl::Status s = CheckArgs(kWhat, n, v, ld, dtype); !s.ok()) return s;
  if (loss == nullptr) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": loss is null"));
  const cudaStream_t st = AsStream(stream);
  if (n == 0) return CudaErrorToStatus(cudaMemsetAsync(loss, 0, sizeof(double), st), kWhat);
  if (lse == nullptr || logits == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer (lse ",
                                                   lse == nullptr ? "null" : "set", ", logits ",
                                                   logits == nullptr ? "null" : "set", ", targets ",
                                                   targets == nullptr ? "null" : "set", ")"));
  }
  double* row_loss = nullptr;
  if (absl::Status s = CudaErrorToStatus(
          cudaMallocAsync(reinterpret_cast<void**>(&row_loss), n * sizeof(double), st),
          absl::StrCat(kWhat, ": allocating ", n * sizeof(double), " bytes of row losses"));
      !s.ok()) {
    return s;
  }
  if (dtype == DType::kF32) {
    LaunchForwardRows<float>(row_loss, lse, logits, targets, n, v, ld, st);
  } else {
    LaunchForwardRows<uint16_t>(row_loss, lse, logits, targets, n, v, ld, st);
  }
  absl::Status status = LaunchStatus(kWhat);
  if (status.ok()) {
    MeanLossKernel<<<1, kCountThreads, 0, st>>>(loss, row_loss, targets, n);
    status.Update(LaunchStatus(kWhat));
  }
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(row_loss, st), "ClassifierForward: free");
  return status.ok() ? freed : status;
}

absl::Status ClassifierBackward(void* dlogits, const void* logits, const float* lse,
                                const int32_t* targets, int64_t n, int64_t v, int64_t ld,
                                DType dtype, void* stream) {
  static constexpr char kWhat[] = "ClassifierBackward";
  if (absl::Status s = CheckArgs(kWhat, n, v, ld, dtype); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  if (dlogits == nullptr || logits == nullptr || lse == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  const cudaStream_t st = AsStream(stream);
  float* inv = nullptr;
  if (absl::Status s =
          CudaErrorToStatus(cudaMallocAsync(reinterpret_cast<void**>(&inv), sizeof(float), st),
                            absl::StrCat(kWhat, ": allocating 4 bytes"));
      !s.ok()) {
    return s;
  }
  InverseScoredKernel<<<1, kCountThreads, 0, st>>>(inv, targets, n);
  absl::Status status = LaunchStatus(kWhat);
  if (status.ok()) {
    if (dtype == DType::kF32) {
      LaunchBackwardRows<float>(dlogits, logits, lse, targets, inv, n, v, ld, st);
    } else {
      LaunchBackwardRows<uint16_t>(dlogits, logits, lse, targets, inv, n, v, ld, st);
    }
    status.Update(LaunchStatus(kWhat));
  }
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(inv, st), "ClassifierBackward: free");
  return status.ok() ? freed : status;
}

}  // namespace gpu
}  // namespace zeroshard
