// CUDA twins of the CPU kernels in worker/model/layers.h (and of the Adam
// update in worker/zero/optimizer.h), callable from host C++: this header has
// no CUDA types. Same shapes, layouts and accumulate-vs-overwrite conventions
// as layers.h (read that header first); the differences:
//
//  - Every pointer is device memory (or managed memory). Scalars that the
//    CPU versions return (losses) are written to a device pointer instead, so
//    that a training step needs no host synchronization.
//  - `stream` is a cudaStream_t passed as void* (nullptr: the legacy default
//    stream). Work is enqueued on it and the call returns without waiting.
//    The returned status covers argument checks and the launch; a fault while
//    the kernel runs surfaces at the next synchronization on the stream.
//  - The calling thread's current device (cudaSetDevice) is the one used; the
//    pointers and the stream must belong to it.
//  - n == 0 (or an empty shape) is a no-op. Negative sizes, a null pointer
//    that is not optional, or shapes that do not fit are INVALID_ARGUMENT.
//  - Results match the CPU kernels to float rounding, not bitwise (reductions
//    run in another order, and nvcc fuses multiply-adds), except the Adam
//    update and the dtype casts, which are bitwise identical. Every kernel is
//    deterministic (no atomics) except EmbeddingBackward's dwte scatter-add.
//
// Linear layers are GEMMs: see CublasLinear at the end.
#ifndef ZEROSHARD_WORKER_CUDA_KERNELS_H_
#define ZEROSHARD_WORKER_CUDA_KERNELS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace zeroshard {
namespace gpu {

// ----------------------------------------------------------------------------
// Activations, elementwise over n floats (y may alias x, dx may alias dy).

absl::Status ReluForward(float* y, const float* x, int64_t n, void* stream);
absl::Status ReluBackward(float* dx, const float* dy, const float* x, int64_t n, void* stream);

// GELU, exact (erf).
absl::Status GeluForward(float* y, const float* x, int64_t n, void* stream);
absl::Status GeluBackward(float* dx, const float* dy, const float* x, int64_t n, void* stream);

// GELU, tanh approximation.
absl::Status GeluTanhForward(float* y, const float* x, int64_t n, void* stream);
absl::Status GeluTanhBackward(float* dx, const float* dy, const float* x, int64_t n, void* stream);

// ----------------------------------------------------------------------------
// MSE loss: *loss (one device double) = mean((pred - target)^2), summed in
// double; 0 for n == 0.

absl::Status MseForward(double* loss, const float* pred, const float* target, int64_t n,
                        void* stream);
absl::Status MseBackward(float* dpred, const float* pred, const float* target, int64_t n,
                         void* stream);

// ----------------------------------------------------------------------------
// LayerNorm over the last dim C, eps 1e-5 (kLayerNormEps), biased variance;
// row statistics in double as on the CPU.

absl::Status LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w,
                              const float* b, int64_t n, int64_t c, void* stream);
// The same with `out` in out_dtype, F32 or BF16 (rounded once, from the f32
// result): the device GPT's bf16 activations.
absl::Status LayerNormForwardTo(void* out, DType out_dtype, float* mean, float* rstd,
                                const float* x, const float* w, const float* b, int64_t n,
                                int64_t c, void* stream);
// dx written (may be nullptr; must not alias dout); dw, db accumulated.
// With dx_plus: dx = the LayerNorm's input gradient + dx_plus (the skip
// path's gradient, added in the same pass; may alias dx).
absl::Status LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                               const float* w, const float* mean, const float* rstd, int64_t n,
                               int64_t c, void* stream, const float* dx_plus = nullptr);

// ----------------------------------------------------------------------------
// Causal multi-head self-attention on packed qkv [B,T,3C] (layers.h). One
// thread block per (b, head, t) row: scores, masked softmax and the weighted
// sum of v. att [B,NH,T,T] is written in full (zeros above the diagonal).
// The device GPT's attention before #46, kept as --gpu_attention=naive: the
// plain reference the flash kernels are checked against.

absl::Status AttentionForward(float* out, float* att, const float* qkv, int64_t b, int64_t t,
                              int64_t c, int64_t nh, void* stream);
// dqkv written. Uses B*NH*T*T floats of scratch, allocated and freed on
// `stream` (cudaMallocAsync), so that dk and dv are column sums computed
// without atomics.
absl::Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                               int64_t b, int64_t t, int64_t c, int64_t nh, void* stream);

// ----------------------------------------------------------------------------
// Token + position embedding. Token ids outside [0, V) are not checked on the
// CPU; here the forward writes NaN for such a row and the backward skips it,
// so a bad id cannot read or write out of bounds.

absl::Status EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                              int64_t b, int64_t t, int64_t c, int64_t v, void* stream);
// dwte += scatter of dout (atomicAdd: rows of repeated tokens add in any
// order); dwpe += sums over the batch (deterministic).
absl::Status EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                               int64_t b, int64_t t, int64_t c, int64_t v, void* stream);

// ----------------------------------------------------------------------------
// Bias, for y[N,OUT] in F32 or BF16 (bias and gradient in the same dtype;
// BF16 sums in f32 and rounds once).

// y[i,j] += b[j].
absl::Status BiasAdd(void* y, const void* b, int64_t n, int64_t out, DType dtype, void* stream);
// db[j] += sum_i dy[i,j] (deterministic).
absl::Status BiasGrad(void* db, const void* dy, int64_t n, int64_t out, DType dtype, void* stream);

// ----------------------------------------------------------------------------
// Adam / AdamW on an f32 shard, in place: torch.optim's single-tensor
// algorithm with the CPU Optimizer's exact float operations (bias correction
// computed in double on the host, eps added outside the sqrt), so a shard
// updated here is bitwise equal to the CPU update.

struct AdamStepParams {
  double lr = 1e-3;
  // The step being taken, counting from 1 (PyTorch's state["step"] after
  // its increment; the CPU Optimizer's step() + 1).
  int64_t step = 1;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: AdamW (param *= 1 - lr * weight_decay first); false: Adam (L2 term
  // weight_decay * param added to the gradient).
  bool decoupled = false;
};

absl::Status AdamStep(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                      int64_t n, const AdamStepParams& p, void* stream);

// ----------------------------------------------------------------------------
// dtype casts, round to nearest even with NaN kept NaN (common/dtype.h's
// FloatToBF16, bit for bit). bf16 values are raw uint16_t bits.

absl::Status CastF32ToBF16(uint16_t* out, const float* in, int64_t n, void* stream);
absl::Status CastBF16ToF32(float* out, const uint16_t* in, int64_t n, void* stream);

// ----------------------------------------------------------------------------
// Packed layouts (worker/zero/packed_layout.h; packing.cu): `runs` holds
// num_runs pairs (packed_begin, full_offset) in device memory, packed_begin
// increasing from 0, a full_offset of -1 marking padding; a run ends where
// the next begins, the last at n (the packed elements).
// PackRuns: packed[i] = full[run's full_offset + i - packed_begin] converted
// from f32 to `to` (F32 or BF16, rounded as CastF32ToBF16), 0 in padding.
absl::Status PackRuns(void* packed, DType to, const float* full, const int64_t* runs,
                      int64_t num_runs, int64_t n, void* stream);
// UnpackRuns: the reverse, widening from `from`; padding writes nothing.
absl::Status UnpackRuns(float* full, const void* packed, DType from, const int64_t* runs,
                        int64_t num_runs, int64_t n, void* stream);
// UnpackRunsRaw: UnpackRuns with no conversion, `full` in `dtype` (F32 or
// BF16) like `packed`: every element copied bit for bit.
absl::Status UnpackRunsRaw(void* full, const void* packed, DType dtype, const int64_t* runs,
                           int64_t num_runs, int64_t n, void* stream);
// UnpackRunsThrough: UnpackRuns from f32 `packed` with each value rounded
// to `through` on the way (F32: stored as it is; BF16: rounded as
// CastF32ToBF16 and widened back): what PackRuns to `through` from the
// packed values, then UnpackRuns, would store, in one pass.
absl::Status UnpackRunsThrough(float* full, const float* packed, DType through, const int64_t* runs,
                               int64_t num_runs, int64_t n, void* stream);

// ----------------------------------------------------------------------------
// The ZeRO engine's gradient arithmetic (CudaBackend).

// dst[i] += src[i] for i < n; src is F32 or BF16 (widened exactly).
absl::Status AddInto(float* dst, const void* src, DType src_dtype, int64_t n, void* stream);
// x[i] *= factor.
absl::Status Scale(float* x, int64_t n, float factor, void* stream);
// *out (one device double) = sum of x[i]^2 in double, in a fixed order
// (per-block partial sums, then one block over them): deterministic. Uses
// scratch allocated and freed on `stream`.
absl::Status SquaredNorm(double* out, const float* x, int64_t n, void* stream);

// ----------------------------------------------------------------------------
// Linear layers through cuBLAS (cublasGemmEx, f32 compute: no TF32). x, w, y
// and their gradients share one dtype, F32 or BF16 (BF16 multiplies on tensor
// cores with f32 accumulation and rounds the result once). GEMM dimensions
// must fit in int (cuBLAS's 32-bit API).
//
// One instance owns one cuBLAS handle bound to one stream and device; it is
// not thread-safe.
class CublasLinear {
 public:
  // The weight matrix layout.
  enum class Layout {
    kOutIn,  // w [OUT,IN]: PyTorch nn.Linear, and the tied LM head (wte [V,C])
    kInOut,  // w [IN,OUT]: Hugging Face GPT-2 Conv1D
  };

  // Creates a handle on the current device, bound to `stream`.
  static absl::StatusOr<std::unique_ptr<CublasLinear>> Create(void* stream);
  ~CublasLinear();
  CublasLinear(const CublasLinear&) = delete;
  CublasLinear& operator=(const CublasLinear&) = delete;

  // y[N,OUT] = x[N,IN] W + b, where W is w^T (kOutIn) or w (kInOut); b [OUT]
  // may be nullptr.
  absl::Status Forward(void* y, const void* x, const void* w, const void* b, int64_t n, int64_t in,
                       int64_t out, DType dtype, Layout layout);
  // dx[N,IN] written (may be nullptr); dw (w's shape) += the weight gradient;
  // db [OUT] += column sums of dy (may be nullptr).
  absl::Status Backward(void* dx, void* dw, void* db, const void* dy, const void* x, const void* w,
                        int64_t n, int64_t in, int64_t out, DType dtype, Layout layout);

  // Mixed precision (the device GPT with --param_dtype=bf16): the operands
  // x, w and dy are BF16 (raw bits), the results y, dx and dw are F32 and
  // are not rounded to bf16 (tensor-core products, f32 accumulation; dw
  // accumulates in f32). The bias b [OUT] and its gradient db are F32, and
  // db sums `dy_f32` (the f32 gradient dy was rounded from). Same shapes and
  // conventions as Forward / Backward.
  absl::Status ForwardMixed(float* y, const uint16_t* x, const uint16_t* w, const float* b,
                            int64_t n, int64_t in, int64_t out, Layout layout);
  absl::Status BackwardMixed(float* dx, float* dw, float* db, const uint16_t* dy,
                             const float* dy_f32, const uint16_t* x, const uint16_t* w, int64_t n,
                             int64_t in, int64_t out, Layout layout);

 private:
  CublasLinear(void* handle, void* stream) : handle_(handle), stream_(stream) {}

  // cuBLAS's column-major c[m,n] = op(a) op(b) + beta c (alpha 1), f32
  // compute; a and b in `dtype`, c in `c_dtype`.
  absl::Status Gemm(const char* what, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c,
                    int64_t ldc, DType dtype, DType c_dtype);
  // Forward / Backward's products, operands in `dtype`, results in `c_dtype`
  // (no bias).
  absl::Status ForwardProduct(const char* what, void* y, const void* x, const void* w, int64_t n,
                              int64_t in, int64_t out, DType dtype, DType c_dtype, Layout layout);
  absl::Status BackwardProducts(const char* what, void* dx, void* dw, const void* dy, const void* x,
                                const void* w, int64_t n, int64_t in, int64_t out, DType dtype,
                                DType c_dtype, Layout layout);

  void* handle_;  // cublasHandle_t
  void* stream_;  // cudaStream_t
};

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_KERNELS_H_
