// Kernels behind CublasLtLinear (cublaslt_linear.cc) for what a cuBLASLt
// epilogue does when cuBLASLt has no fused algorithm for a product (an
// unaligned buffer, a leading dimension that is not a multiple of 8, or a
// configuration the GPU's cuBLASLt does not offer), and for the gradients
// that cuBLASLt writes (=) where the models accumulate (+=). F32 or BF16
// (raw bits) tensors, f32 arithmetic; same stream conventions as kernels.h.
// Private to //worker/cuda:cuda_cublaslt_linear.
#ifndef ZEROSHARD_WORKER_CUDA_CUBLASLT_EPILOGUE_H_
#define ZEROSHARD_WORKER_CUDA_CUBLASLT_EPILOGUE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace zeroshard {
namespace gpu {
namespace internal {

// y = gelu_tanh(pre) over n elements, both in `dtype` (y may not alias pre:
// pre is kept for the backward).
absl::Status LtGeluTanhForward(void* y, const void* pre, int64_t n, DType dtype, void* stream);

// d *= gelu_tanh'(pre) over n elements, both in `dtype`.
absl::Status LtGeluTanhBackwardInPlace(void* d, const void* pre, int64_t n, DType dtype,
                                       void* stream);

// y[i, j] += b[j] for i < rows, j < cols: y [rows, cols] with rows ld >= cols
// elements apart (columns [cols, ld) untouched), y and b in `dtype` (f32
// arithmetic, one rounding).
absl::Status LtBiasAddRows(void* y, const void* b, int64_t rows, int64_t cols, int64_t ld,
                           DType dtype, void* stream);

// sums[j] += sum over i < rows of x[i, j] (x [rows, cols] in `dtype`, rows
// ld >= cols elements apart; columns [cols, ld) are not read), in f32 in a
// fixed order (row chunks, then the chunks in order): deterministic. Uses
// scratch allocated and freed on `stream`.
absl::Status LtColumnSumsAdd(float* sums, const void* x, int64_t rows, int64_t cols, int64_t ld,
                             DType dtype, void* stream);

}  // namespace internal
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUBLASLT_EPILOGUE_H_
