// The fallback epilogues of CublasLtLinear (cublaslt_epilogue.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cublaslt_epilogue.h"
#include "worker/cuda/cuda_util.cuh"

namespace zeroshard {
namespace gpu {
namespace internal {
namespace {

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float Load(const uint16_t* p, int64_t i) {
  return BF16BitsToFloat(p[i]);
}
__device__ __forceinline__ void Put(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void Put(uint16_t* p, int64_t i, float x) { p[i] = FloatToBF16Bits(x); }

// The formulas of elementwise.cu's GeluTanh kernels (and of cuBLASLt's GELU
// epilogue: the tanh approximation).
__device__ __forceinline__ float GeluTanh(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float GeluTanhSlope(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  const float t = tanhf(u);
  const float du_dx = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du_dx;
}

template <typename T>
__global__ void GeluForwardKernel(T* y, const T* pre, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) Put(y, i, GeluTanh(Load(pre, i)));
}

template <typename T>
__global__ void GeluBackwardKernel(T* d, const T* pre, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    Put(d, i, Load(d, i) * GeluTanhSlope(Load(pre, i)));
  }
}

// y[i, j] += b[j] over rows ld apart.
template <typename T>
__global__ void BiasAddRowsKernel(T* y, const T* b, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t total = rows * cols;
  for (int64_t e = GlobalThread(); e < total; e += GlobalStride()) {
    const int64_t i = e / cols, j = e % cols;
    Put(y, i * ld + j, Load(y, i * ld + j) + Load(b, j));
  }
}

constexpr int kColumns = 32;     // columns per block (one warp wide: coalesced rows)
constexpr int kRowLanes = 8;     // threads per column
constexpr int kChunkRows = 256;  // rows per block of the first pass
constexpr int64_t kMaxChunks = 128;

// First pass: partial[chunk, j] = sum of x[i, j] over the chunk's rows, each
// thread a strided subset, then the 8 lanes in order.
template <typename T>
__global__ void ColumnChunkKernel(float* partial, const T* x, int64_t rows, int64_t cols,
                                  int64_t ld, int64_t rows_per_chunk) {
  __shared__ float lane_sum[kRowLanes][kColumns];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = rows < begin + rows_per_chunk ? rows : begin + rows_per_chunk;
  float s = 0.0f;
  if (j < cols) {
    for (int64_t i = begin + threadIdx.y; i < end; i += kRowLanes) s += Load(x, i * ld + j);
  }
  lane_sum[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float total = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) total += lane_sum[k][threadIdx.x];
    partial[blockIdx.y * cols + j] = total;
  }
}

// Second pass: sums[j] += the chunks' partials in chunk order.
__global__ void ColumnTotalKernel(float* sums, const float* partial, int64_t chunks, int64_t cols) {
  for (int64_t j = GlobalThread(); j < cols; j += GlobalStride()) {
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += partial[c * cols + j];
    sums[j] += total;
  }
}

absl::Status CheckDtype(const char* what, DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": dtype ", DTypeName(dtype), " is not F32 or BF16"));
}

// The error for a row stride below the row's columns.
absl::Status CheckLd(const char* what, int64_t ld, int64_t cols) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ld ", ld, " is less than cols ", cols, " (ld: the row stride)"));
}

}  // namespace

absl::Status LtGeluTanhForward(void* y, const void* pre, int64_t n, DType dtype, void* stream) {
  if (absl::Status s = CheckDtype("LtGeluTanhForward", dtype); !s.ok() || n <= 0) return s;
  const cudaStream_t st = AsStream(stream);
  if (dtype == DType::kF32) {
    GeluForwardKernel<<<GridFor(n), kThreads, 0, st>>>(static_cast<float*>(y),
                                                       static_cast<const float*>(pre), n);
  } else {
    GeluForwardKernel<<<GridFor(n), kThreads, 0, st>>>(static_cast<uint16_t*>(y),
                                                       static_cast<const uint16_t*>(pre), n);
  }
  return LaunchStatus("LtGeluTanhForward");
}

absl::Status LtGeluTanhBackwardInPlace(void* d, const void* pre, int64_t n, DType dtype,
                                       void* stream) {
  if (absl::Status s = CheckDtype("LtGeluTanhBackwardInPlace", dtype); !s.ok() || n <= 0) return s;
  const cudaStream_t st = AsStream(stream);
  if (dtype == DType::kF32) {
    GeluBackwardKernel<<<GridFor(n), kThreads, 0, st>>>(static_cast<float*>(d),
                                                        static_cast<const float*>(pre), n);
  } else {
    GeluBackwardKernel<<<GridFor(n), kThreads, 0, st>>>(static_cast<uint16_t*>(d),
                                                        static_cast<const uint16_t*>(pre), n);
  }
  return LaunchStatus("LtGeluTanhBackwardInPlace");
}

absl::Status LtBiasAddRows(void* y, const void* b, int64_t rows, int64_t cols, int64_t ld,
                           DType dtype, void* stream) {
  static constexpr char kWhat[] = "LtBiasAddRows";
  if (absl::Status s = CheckDtype(kWhat, dtype); !s.ok() || rows <= 0 || cols <= 0) return s;
  if (ld < cols) return CheckLd(kWhat, ld, cols);
  const cudaStream_t st = AsStream(stream);
  const int64_t total = rows * cols;
  if (dtype == DType::kF32) {
    BiasAddRowsKernel<<<GridFor(total), kThreads, 0, st>>>(
        static_cast<float*>(y), static_cast<const float*>(b), rows, cols, ld);
  } else {
    BiasAddRowsKernel<<<GridFor(total), kThreads, 0, st>>>(
        static_cast<uint16_t*>(y), static_cast<const uint16_t*>(b), rows, cols, ld);
  }
  return LaunchStatus(kWhat);
}

absl::Status LtColumnSumsAdd(float* sums, const void* x, int64_t rows, int64_t cols, int64_t ld,
                             DType dtype, void* stream) {
  static constexpr char kWhat[] = "LtColumnSumsAdd";
  if (absl::Status s = CheckDtype(kWhat, dtype); !s.ok() || rows <= 0 || cols <= 0) return s;
  if (ld < cols) return CheckLd(kWhat, ld, cols);
  const cudaStream_t st = AsStream(stream);
  const int64_t chunks = std::min(kMaxChunks, (rows + kChunkRows - 1) / kChunkRows);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const int64_t column_blocks = (cols + kColumns - 1) / kColumns;
  if (column_blocks > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": cols ", cols, " is too large"));
  }
  float* partial = nullptr;
  const size_t bytes = static_cast<size_t>(chunks * cols) * sizeof(float);
  if (absl::Status s =
          CudaErrorToStatus(cudaMallocAsync(reinterpret_cast<void**>(&partial), bytes, st),
                            absl::StrCat(kWhat, ": allocating ", bytes, " bytes of partial sums"));
      !s.ok()) {
    return s;
  }
  const dim3 grid(static_cast<unsigned int>(column_blocks), static_cast<unsigned int>(chunks));
  const dim3 block(kColumns, kRowLanes);
  if (dtype == DType::kF32) {
    ColumnChunkKernel<<<grid, block, 0, st>>>(partial, static_cast<const float*>(x), rows, cols, ld,
                                              rows_per_chunk);
  } else {
    ColumnChunkKernel<<<grid, block, 0, st>>>(partial, static_cast<const uint16_t*>(x), rows, cols,
                                              ld, rows_per_chunk);
  }
  absl::Status status = LaunchStatus(kWhat);
  if (status.ok()) {
    ColumnTotalKernel<<<GridFor(cols), kThreads, 0, st>>>(sums, partial, chunks, cols);
    status.Update(LaunchStatus(kWhat));
  }
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(partial, st), "LtColumnSumsAdd: free");
  return status.ok() ? freed : status;
}

}  // namespace internal
}  // namespace gpu
}  // namespace zeroshard
