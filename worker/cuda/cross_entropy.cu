// Softmax cross-entropy, forward and backward.
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BlockReduce;
using internal::CheckCount;
using internal::GlobalStride;
using internal::GlobalThread;
using internal::GridFor;
using internal::kThreads;
using internal::LaunchStatus;
using internal::MaxOp;
using internal::SumOp;

constexpr int kRowThreads = 256;

// One block per row, as the CPU kernel: probs = exp(z - max) / sum with the
// sum in double, and the row's loss log(sum) - (z_target - max), which never
// takes log(0) even when the target's probability underflows.
__global__ void CrossEntropyRowKernel(double* row_loss, float* probs, const float* logits,
                                      const int32_t* targets, int64_t v) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * v;
  float* p = probs + row * v;
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) local_max = fmaxf(local_max, z[j]);
  const float max_z = BlockReduce(local_max, MaxOp(), -INFINITY);
  double local_sum = 0.0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float e = expf(z[j] - max_z);
    p[j] = e;
    local_sum += e;
  }
  const double sum = BlockReduce(local_sum, SumOp(), 0.0);
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) p[j] *= inv_sum;
  if (threadIdx.x == 0) {
    const int64_t target = targets[row];
    row_loss[row] =
        target < 0 || target >= v ? NAN : log(sum) - (static_cast<double>(z[target]) - max_z);
  }
}

// One block: the mean of the row losses, in a fixed order.
__global__ void MeanKernel(double* mean, const double* values, int64_t n) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += values[i];
  sum = BlockReduce(sum, SumOp(), 0.0);
  if (threadIdx.x == 0) *mean = sum / static_cast<double>(n);
}

// dlogits = (probs - onehot(target)) / N; an out-of-range target adds no
// one-hot term.
__global__ void CrossEntropyBackwardKernel(float* dlogits, const float* probs,
                                           const int32_t* targets, int64_t v, int64_t total,
                                           float inv_n) {
  for (int64_t i = GlobalThread(); i < total; i += GlobalStride()) {
    const int64_t j = i % v;
    const float d = probs[i] * inv_n;
    dlogits[i] = targets[i / v] == j ? d - inv_n : d;
  }
}

}  // namespace

absl::Status CrossEntropyForward(double* loss, float* probs, const float* logits,
                                 const int32_t* targets, int64_t n, int64_t v, void* stream) {
  static constexpr char kWhat[] = "CrossEntropyForward";
  if (absl::Status s = CheckCount(kWhat, "n", n); !s.ok()) return s;
  if (absl::Status s = CheckCount(kWhat, "v", v); !s.ok()) return s;
  if (loss == nullptr) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": loss is null"));
  const cudaStream_t st = AsStream(stream);
  if (n == 0) {
    // The CPU kernel returns 0 for no rows.
    return CudaErrorToStatus(cudaMemsetAsync(loss, 0, sizeof(double), st), kWhat);
  }
  if (v == 0) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": v is 0 (no classes)"));
  if (n > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": n ", n, " exceeds the grid limit"));
  }
  if (probs == nullptr || logits == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  double* row_loss = nullptr;
  if (absl::Status s = CudaErrorToStatus(
          cudaMallocAsync(reinterpret_cast<void**>(&row_loss), n * sizeof(double), st),
          absl::StrCat(kWhat, ": allocating ", n * sizeof(double), " bytes of scratch"));
      !s.ok()) {
    return s;
  }
  CrossEntropyRowKernel<<<static_cast<unsigned int>(n), kRowThreads, 0, st>>>(row_loss, probs,
                                                                              logits, targets, v);
  absl::Status status = LaunchStatus(kWhat);
  if (status.ok()) {
    MeanKernel<<<1, 1024, 0, st>>>(loss, row_loss, n);
    status.Update(LaunchStatus(kWhat));
  }
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(row_loss, st), "CrossEntropyForward: free");
  return status.ok() ? freed : status;
}

absl::Status CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets,
                                  int64_t n, int64_t v, void* stream) {
  static constexpr char kWhat[] = "CrossEntropyBackward";
  if (absl::Status s = CheckCount(kWhat, "n", n); !s.ok()) return s;
  if (absl::Status s = CheckCount(kWhat, "v", v); !s.ok()) return s;
  const int64_t total = n * v;
  if (total == 0) return absl::OkStatus();
  if (dlogits == nullptr || probs == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  const float inv_n = 1.0f / static_cast<float>(n);
  CrossEntropyBackwardKernel<<<GridFor(total), kThreads, 0, AsStream(stream)>>>(
      dlogits, probs, targets, v, total, inv_n);
  return LaunchStatus(kWhat);
}

}  // namespace gpu
}  // namespace zeroshard
