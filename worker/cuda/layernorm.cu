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
using internal::CheckCount;
using internal::LaunchStatus;
using internal::SumOp;
using internal::WarpReduce;

// Threads per block: 8 warps, one row each. A warp per row needs no
// barrier and no shared memory: its sums are shuffles, and its second and
// third reads of the row (3 KiB at GPT-2's C = 768) come from L1. A block
// per row (256 threads over 768 elements, three block reductions) spent
// most of its time in __syncthreads.
constexpr int kRowThreads = 256;
constexpr int kRowsPerBlock = kRowThreads / 32;

// Stores an f32 result as float or as bf16 raw bits (common/dtype.h's
// FloatToBF16, bit for bit).
__device__ __forceinline__ void Store(float* out, int64_t i, float v) { out[i] = v; }
__device__ __forceinline__ void Store(uint16_t* out, int64_t i, float v) {
  out[i] = internal::FloatToBF16Bits(v);
}

// This warp's row of n (the same for its 32 lanes), or -1 past the last.
__device__ __forceinline__ int64_t WarpRow(int64_t n) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  return row < n ? row : -1;
}

// One warp per row. The two passes accumulate in double, as the CPU kernel
// does (a one-pass float variance of activations with a large mean loses
// everything to cancellation).
template <typename Out>
__global__ void LayerNormForwardKernel(Out* out, float* mean, float* rstd, const float* x,
                                       const float* w, const float* b, int64_t n, int64_t c) {
  const int64_t row = WarpRow(n);
  if (row < 0) return;  // the whole warp; nothing below waits for other warps
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* x_i = x + row * c;
  double sum = 0.0;
  for (int64_t j = lane; j < c; j += 32) sum += x_i[j];
  const double m = WarpReduce(sum, SumOp()) / static_cast<double>(c);
  double sq = 0.0;
  for (int64_t j = lane; j < c; j += 32) {
    const double d = x_i[j] - m;
    sq += d * d;
  }
  const double var = WarpReduce(sq, SumOp()) / static_cast<double>(c);
  const float s = static_cast<float>(1.0 / sqrt(var + static_cast<double>(kLayerNormEps)));
  const float mf = static_cast<float>(m);
  Out* out_i = out + row * c;
  for (int64_t j = lane; j < c; j += 32) Store(out_i, j, (x_i[j] - mf) * s * w[j] + b[j]);
  if (lane == 0) {
    mean[row] = mf;
    rstd[row] = s;
  }
}

// dx, one warp per row: with xhat = (x - mean) rstd and g = dout * w,
// dx = rstd (g - mean(g) - xhat mean(g xhat)).
// With plus: dx += plus (read before dx is written, by the same thread).
__global__ void LayerNormBackwardDxKernel(float* dx, const float* dout, const float* x,
                                          const float* w, const float* mean, const float* rstd,
                                          const float* plus, int64_t n, int64_t c) {
  const int64_t row = WarpRow(n);
  if (row < 0) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* x_i = x + row * c;
  const float* dout_i = dout + row * c;
  const float m = mean[row];
  const float s = rstd[row];
  double g_sum = 0.0;
  double g_xhat_sum = 0.0;
  for (int64_t j = lane; j < c; j += 32) {
    const float xhat = (x_i[j] - m) * s;
    const float g = dout_i[j] * w[j];
    g_sum += g;
    g_xhat_sum += static_cast<double>(g) * xhat;
  }
  const float g_mean = static_cast<float>(WarpReduce(g_sum, SumOp()) / c);
  const float g_xhat_mean = static_cast<float>(WarpReduce(g_xhat_sum, SumOp()) / c);
  float* dx_i = dx + row * c;
  for (int64_t j = lane; j < c; j += 32) {
    const float xhat = (x_i[j] - m) * s;
    const float add = plus != nullptr ? plus[row * c + j] : 0.0f;
    dx_i[j] = s * (dout_i[j] * w[j] - g_mean - xhat * g_xhat_mean) + add;
  }
}

// dw += sum over rows of dout * xhat and db += column sums of dout, in two
// deterministic stages (no atomics). Stage 1: block (x, y) covers 32 columns
// and the rows of chunk y (kChunkRows rows); its 8 rows of threads take every
// 8th row of the chunk and add their partial sums in a fixed order into
// partial[y][col] (dw) and partial[chunks + y][col] (db). Stage 2: one thread
// per column adds the chunks' partials in chunk order. Chunks give the
// stage-1 grid enough blocks to fill the GPU (GPT-2: C 768 is 24 column
// blocks; 8192 rows are 32 chunks).
constexpr int kColumnsPerBlock = 32;
constexpr int kRowGroups = 8;
constexpr int64_t kChunkRows = 256;

__global__ void LayerNormParamsPartialKernel(float* partial, const float* dout, const float* x,
                                             const float* mean, const float* rstd, int64_t n,
                                             int64_t c) {
  __shared__ float dw_partial[kRowGroups][kColumnsPerBlock];
  __shared__ float db_partial[kRowGroups][kColumnsPerBlock];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = min(n, (chunk + 1) * kChunkRows);
  float dw_sum = 0.0f;
  float db_sum = 0.0f;
  if (col < c) {
    for (int64_t row = chunk * kChunkRows + threadIdx.y; row < row_end; row += kRowGroups) {
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
    partial[chunk * c + col] = dw_total;
    partial[(gridDim.y + chunk) * c + col] = db_total;
  }
}

__global__ void LayerNormParamsSumKernel(float* dw, float* db, const float* partial, int64_t chunks,
                                         int64_t c) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= c) return;
  float dw_total = 0.0f;
  float db_total = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) {
    dw_total += partial[k * c + col];
    db_total += partial[(chunks + k) * c + col];
  }
  dw[col] += dw_total;
  db[col] += db_total;
}

absl::Status CheckShape(const char* what, int64_t n, int64_t c) {
  if (absl::Status s = CheckCount(what, "n", n); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "c", c); !s.ok()) return s;
  if (n > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": n ", n, " exceeds the grid limit"));
  }
  return absl::OkStatus();
}

// Blocks of kRowsPerBlock rows for n rows (CheckShape bounds n).
unsigned int RowBlocks(int64_t n) {
  return static_cast<unsigned int>((n + kRowsPerBlock - 1) / kRowsPerBlock);
}

}  // namespace

absl::Status LayerNormForwardTo(void* out, DType out_dtype, float* mean, float* rstd,
                                const float* x, const float* w, const float* b, int64_t n,
                                int64_t c, void* stream) {
  static constexpr char kWhat[] = "LayerNormForward";
  if (absl::Status s = CheckShape(kWhat, n, c); !s.ok()) return s;
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": output in ", DTypeName(out_dtype), " (F32 or BF16 expected)"));
  }
  if (n == 0) return absl::OkStatus();
  if (c == 0) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": c is 0 (no features to normalize)"));
  }
  if (out == nullptr || mean == nullptr || rstd == nullptr || x == nullptr || w == nullptr ||
      b == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  const unsigned int grid = RowBlocks(n);
  if (out_dtype == DType::kF32) {
    LayerNormForwardKernel<<<grid, kRowThreads, 0, AsStream(stream)>>>(static_cast<float*>(out),
                                                                       mean, rstd, x, w, b, n, c);
  } else {
    LayerNormForwardKernel<<<grid, kRowThreads, 0, AsStream(stream)>>>(static_cast<uint16_t*>(out),
                                                                       mean, rstd, x, w, b, n, c);
  }
  return LaunchStatus(kWhat);
}

absl::Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w,
                              const float* b, int64_t n, int64_t c, void* stream) {
  return LayerNormForwardTo(out, DType::kF32, mean, rstd, x, w, b, n, c, stream);
}

absl::Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                               const float* w, const float* mean, const float* rstd, int64_t n,
                               int64_t c, void* stream, const float* dx_plus) {
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
  if (dx_plus == dout) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": dx_plus must not alias dout"));
  }
  const cudaStream_t st = AsStream(stream);
  if (dx != nullptr) {
    LayerNormBackwardDxKernel<<<RowBlocks(n), kRowThreads, 0, st>>>(dx, dout, x, w, mean, rstd,
                                                                     dx_plus, n, c);
    if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  }
  const int64_t chunks = (n + kChunkRows - 1) / kChunkRows;
  if (chunks > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": n ", n, " rows exceed ",
                                                   65535 * kChunkRows, " (the grid's y limit)"));
  }
  float* partial = nullptr;
  const size_t bytes = static_cast<size_t>(2 * chunks * c) * sizeof(float);
  if (absl::Status s =
          CudaErrorToStatus(cudaMallocAsync(reinterpret_cast<void**>(&partial), bytes, st),
                            absl::StrCat(kWhat, ": allocating ", bytes, " bytes of scratch"));
      !s.ok()) {
    return s;
  }
  const int64_t col_blocks = (c + kColumnsPerBlock - 1) / kColumnsPerBlock;
  LayerNormParamsPartialKernel<<<dim3(static_cast<unsigned int>(col_blocks),
                                      static_cast<unsigned int>(chunks)),
                                 dim3(kColumnsPerBlock, kRowGroups), 0, st>>>(partial, dout, x,
                                                                              mean, rstd, n, c);
  absl::Status status = LaunchStatus(kWhat);
  if (status.ok()) {
    LayerNormParamsSumKernel<<<static_cast<unsigned int>((c + 255) / 256), 256, 0, st>>>(
        dw, db, partial, chunks, c);
    status.Update(LaunchStatus(kWhat));
  }
  // Stream-ordered: freed after the kernels above have run.
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(partial, st), absl::StrCat(kWhat, ": free"));
  return status.ok() ? freed : status;
}

}  // namespace gpu
}  // namespace zeroshard
