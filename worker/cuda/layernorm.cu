// LayerNorm forward and backward.
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/kernels.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BlockReduce;
using internal::CheckCount;
using internal::LaunchStatus;
using internal::SumOp;

// Threads per row.
constexpr int kRowThreads = 256;

// One block per row. The two passes accumulate in double, as the CPU kernel
// does (a one-pass float variance of activations with a large mean loses
// everything to cancellation).
__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* x,
                                       const float* w, const float* b, int64_t c) {
  const int64_t row = blockIdx.x;
  const float* x_i = x + row * c;
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) sum += x_i[j];
  const double m = BlockReduce(sum, SumOp(), 0.0) / static_cast<double>(c);
  double sq = 0.0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const double d = x_i[j] - m;
    sq += d * d;
  }
  const double var = BlockReduce(sq, SumOp(), 0.0) / static_cast<double>(c);
  const float s = static_cast<float>(1.0 / sqrt(var + static_cast<double>(kLayerNormEps)));
  const float mf = static_cast<float>(m);
  float* out_i = out + row * c;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) out_i[j] = (x_i[j] - mf) * s * w[j] + b[j];
  if (threadIdx.x == 0) {
    mean[row] = mf;
    rstd[row] = s;
  }
}

// dx, one block per row: with xhat = (x - mean) rstd and g = dout * w,
// dx = rstd (g - mean(g) - xhat mean(g xhat)).
__global__ void LayerNormBackwardDxKernel(float* dx, const float* dout, const float* x,
                                          const float* w, const float* mean, const float* rstd,
                                          int64_t c) {
  const int64_t row = blockIdx.x;
  const float* x_i = x + row * c;
  const float* dout_i = dout + row * c;
  const float m = mean[row];
  const float s = rstd[row];
  double g_sum = 0.0;
  double g_xhat_sum = 0.0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const float xhat = (x_i[j] - m) * s;
    const float g = dout_i[j] * w[j];
    g_sum += g;
    g_xhat_sum += static_cast<double>(g) * xhat;
  }
  const float g_mean = static_cast<float>(BlockReduce(g_sum, SumOp(), 0.0) / c);
  const float g_xhat_mean = static_cast<float>(BlockReduce(g_xhat_sum, SumOp(), 0.0) / c);
  float* dx_i = dx + row * c;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const float xhat = (x_i[j] - m) * s;
    dx_i[j] = s * (dout_i[j] * w[j] - g_mean - xhat * g_xhat_mean);
  }
}

// dw += sum over rows of dout * xhat and db += column sums of dout. A block
// covers 32 columns; its 8 rows of threads take every 8th row and then add
// their partial sums in a fixed order (deterministic, no atomics).
constexpr int kColumnsPerBlock = 32;
constexpr int kRowGroups = 8;

__global__ void LayerNormBackwardParamsKernel(float* dw, float* db, const float* dout,
                                              const float* x, const float* mean, const float* rstd,
                                              int64_t n, int64_t c) {
  __shared__ float dw_partial[kRowGroups][kColumnsPerBlock];
  __shared__ float db_partial[kRowGroups][kColumnsPerBlock];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  float dw_sum = 0.0f;
  float db_sum = 0.0f;
  if (col < c) {
    for (int64_t row = threadIdx.y; row < n; row += kRowGroups) {
      const float d = dout[row * c + col];
      const float xhat = (x[row * c + col] - mean[row]) * rstd[row];
      dw_sum += d * xhat;
      db_sum += d;
    }
  }
  dw_partial[threadIdx.y][threadIdx.x] = dw_sum;
  db_partial[threadIdx.y][threadIdx.x] = db_sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    float dw_total = 0.0f;
    float db_total = 0.0f;
    for (int r = 0; r < kRowGroups; ++r) {
      dw_total += dw_partial[r][threadIdx.x];
      db_total += db_partial[r][threadIdx.x];
    }
    dw[col] += dw_total;
    db[col] += db_total;
  }
}

absl::Status CheckShape(const char* what, int64_t n, int64_t c) {
  if (absl::Status s = CheckCount(what, "n", n); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "c", c); !s.ok()) return s;
  if (n > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": n ", n, " exceeds the grid limit"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w,
                              const float* b, int64_t n, int64_t c, void* stream) {
  static constexpr char kWhat[] = "LayerNormForward";
  if (absl::Status s = CheckShape(kWhat, n, c); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  if (c == 0) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": c is 0 (no features to normalize)"));
  }
  if (out == nullptr || mean == nullptr || rstd == nullptr || x == nullptr || w == nullptr ||
      b == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  LayerNormForwardKernel<<<static_cast<unsigned int>(n), kRowThreads, 0, AsStream(stream)>>>(
      out, mean, rstd, x, w, b, c);
  return LaunchStatus(kWhat);
}

absl::Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                               const float* w, const float* mean, const float* rstd, int64_t n,
                               int64_t c, void* stream) {
  static constexpr char kWhat[] = "LayerNormBackward";
  if (absl::Status s = CheckShape(kWhat, n, c); !s.ok()) return s;
  if (n == 0 || c == 0) return absl::OkStatus();
  if (dw == nullptr || db == nullptr || dout == nullptr || x == nullptr || w == nullptr ||
      mean == nullptr || rstd == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  if (dx == dout) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": dx must not alias dout"));
  }
  const cudaStream_t st = AsStream(stream);
  if (dx != nullptr) {
    LayerNormBackwardDxKernel<<<static_cast<unsigned int>(n), kRowThreads, 0, st>>>(dx, dout, x, w,
                                                                                    mean, rstd, c);
    if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  }
  const int64_t blocks = (c + kColumnsPerBlock - 1) / kColumnsPerBlock;
  LayerNormBackwardParamsKernel<<<static_cast<unsigned int>(blocks),
                                  dim3(kColumnsPerBlock, kRowGroups), 0, st>>>(dw, db, dout, x,
                                                                               mean, rstd, n, c);
  return LaunchStatus(kWhat);
}

}  // namespace gpu
}  // namespace zeroshard
