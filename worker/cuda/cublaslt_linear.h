// Linear layers through cuBLASLt with fused epilogues: bias, tanh-GELU (with
// its input saved for the backward), a residual added in the same product,
// and in the backward the GELU derivative and the bias gradient fused into
// the products. Operands (x, w, dy) are F32 or BF16 (raw bits); f32
// accumulation always (no TF32 unless Create asked for it: then f32 operands
// multiply as TF32 on tensor cores). Shapes and weight layouts as
// kernels.h's CublasLinear (kOutIn: w [OUT,IN]; kInOut: w [IN,OUT]).
//
// Precision, following cuBLASLt's rules (cublaslt_linear.cc): with a BF16 y
// the f32 bias is rounded to bf16 before it is added (as autocast does);
// gelu_input has y's (dx's) type; with a BF16 dx the fused bias gradient is
// rounded to bf16 once before it is added into the f32 gradient. Products
// cuBLASLt cannot fuse (path_counts) run unfused with the same results to
// rounding.
//
// libcublasLt is loaded on first use, as libcublas is (cublas_lazy.cc).
// Gradients accumulate, as everywhere in the models: dw += ..., db += ....
// One instance owns one cuBLASLt handle, a workspace and one stream; not
// thread-safe.
//
// Padded rows: y (Forward) and dy (BackwardInput, BackwardWeight) may have
// rows ld_y / ld_dy >= OUT elements apart (0: OUT, packed), so that the LM
// head's [N,V] logits and their gradient live in rows padded to a multiple of
// 64 columns: every row then starts 128-byte aligned and cuBLASLt takes its
// tensor-core kernels (with V = 50257 a bf16 row starts only 2-byte aligned).
// Columns [OUT, ld) of y are never written, those of dy never read; the
// bias gradient sums OUT columns. A stride below OUT is INVALID_ARGUMENT.
#ifndef ZEROSHARD_WORKER_CUDA_CUBLASLT_LINEAR_H_
#define ZEROSHARD_WORKER_CUDA_CUBLASLT_LINEAR_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {

class CublasLtLinear {
 public:
  using Layout = CublasLinear::Layout;

  // tf32: f32 products on tensor cores as TF32 (10-bit mantissa operands).
  static absl::StatusOr<std::unique_ptr<CublasLtLinear>> Create(void* stream, bool tf32);
  ~CublasLtLinear();
  CublasLtLinear(const CublasLtLinear&) = delete;
  CublasLtLinear& operator=(const CublasLtLinear&) = delete;

  struct ForwardArgs {
    void* y = nullptr;  // [N,OUT] in y_dtype
    DType y_dtype = DType::kF32;
    const void* x = nullptr;  // [N,IN] in in_dtype
    const void* w = nullptr;  // in in_dtype, `layout`
    DType in_dtype = DType::kF32;
    Layout layout = Layout::kInOut;
    const float* bias = nullptr;      // [OUT], optional
    const float* residual = nullptr;  // [N,OUT] f32, optional: y = residual + x W + b
                                      // (y_dtype must be F32; may alias y)
    void* gelu_input = nullptr;       // [N,OUT] in y_dtype, optional: y = gelu_tanh(x W + b)
                                      // and x W + b saved here for BackwardInput
    int64_t n = 0, in = 0, out = 0;
    // Elements between the starts of y's rows (>= out); 0: out. Padded rows
    // (ld_y > out) only without residual and gelu_input (the LM head has
    // neither; those stay packed).
    int64_t ld_y = 0;
  };
  absl::Status Forward(const ForwardArgs& a);

  // dx [N,IN] (dx_dtype) written = dy W^T, where dy [N,OUT] and w are in
  // in_dtype. With gelu_input (the [N,IN] pre-activation a previous
  // Forward saved, in dx_dtype): dx = (dy W^T) * gelu_tanh'(gelu_input),
  // and with gelu_bias_grad [IN] (f32, optional) += the column sums of that
  // dx (the bias gradient of the layer that produced gelu_input).
  struct BackwardInputArgs {
    void* dx = nullptr;
    DType dx_dtype = DType::kF32;
    const void* dy = nullptr;
    const void* w = nullptr;
    DType in_dtype = DType::kF32;
    Layout layout = Layout::kInOut;
    const void* gelu_input = nullptr;
    float* gelu_bias_grad = nullptr;
    int64_t n = 0, in = 0, out = 0;
    int64_t ld_dy = 0;  // elements between the starts of dy's rows (>= out); 0: out
  };
  absl::Status BackwardInput(const BackwardInputArgs& a);

  // dw (w's shape, f32) += x^T dy (as the layout needs); db [OUT] (f32,
  // optional) += column sums of dy. x and dy in in_dtype.
  struct BackwardWeightArgs {
    float* dw = nullptr;
    float* db = nullptr;
    const void* dy = nullptr;
    const void* x = nullptr;
    DType in_dtype = DType::kF32;
    Layout layout = Layout::kInOut;
    int64_t n = 0, in = 0, out = 0;
    int64_t ld_dy = 0;  // elements between the starts of dy's rows (>= out); 0: out
  };
  absl::Status BackwardWeight(const BackwardWeightArgs& a);

  // The argument checks each call above runs before any CUDA call (dtypes,
  // shapes, row strides, null and misaligned pointers, residual with a
  // non-F32 y, ...):
  // INVALID_ARGUMENT naming the value and what was expected. Static, so that
  // they are tested on machines without a GPU.
  static absl::Status CheckForward(const ForwardArgs& a);
  static absl::Status CheckBackwardInput(const BackwardInputArgs& a);
  static absl::Status CheckBackwardWeight(const BackwardWeightArgs& a);

  // Products whose epilogue ran fused in cuBLASLt, and products that fell
  // back to a plain cuBLASLt product plus cublaslt_epilogue.h's kernels
  // (cuBLASLt offered no algorithm for the fused form: a buffer not 16-byte
  // aligned, a GELU leading dimension (OUT or IN) not a multiple of 8, or a
  // configuration this GPU's cuBLASLt lacks). Both give the same results
  // within bf16/f32 rounding; the fallback costs extra passes over memory.
  struct PathCounts {
    int64_t fused = 0;
    int64_t unfused = 0;
  };
  PathCounts path_counts() const;

 private:
  struct State;
  explicit CublasLtLinear(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUBLASLT_LINEAR_H_
