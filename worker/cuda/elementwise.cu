// Elementwise kernels: activations, MSE, dtype casts, the Adam update, bias.
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BF16BitsToFloat;
using internal::BlockReduce;
using internal::CheckCount;
using internal::CheckPointer;
using internal::FloatToBF16Bits;
using internal::GlobalStride;
using internal::GlobalThread;
using internal::GridFor;
using internal::kThreads;
using internal::LaunchStatus;
using internal::SumOp;

// Same constants as worker/model/layers.cc.
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

// The checks every elementwise entry point makes: n >= 0 and, unless n == 0,
// non-null buffers.
absl::Status CheckElementwise(const char* what, int64_t n,
                              std::initializer_list<const void*> buffers) {
  if (absl::Status s = CheckCount(what, "n", n); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  for (const void* buffer : buffers) {
    if (buffer == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": null buffer"));
  }
  return absl::OkStatus();
}

__global__ void ReluForwardKernel(float* y, const float* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void ReluBackwardKernel(float* dx, const float* dy, const float* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

__global__ void GeluForwardKernel(float* y, const float* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const float xi = x[i];
    y[i] = 0.5f * xi * (1.0f + erff(xi * kInvSqrt2));
  }
}

__global__ void GeluBackwardKernel(float* dx, const float* dy, const float* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const float xi = x[i];
    const float cdf = 0.5f * (1.0f + erff(xi * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * expf(-0.5f * xi * xi);
    dx[i] = dy[i] * (cdf + xi * pdf);
  }
}

__global__ void GeluTanhForwardKernel(float* y, const float* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const float xi = x[i];
    const float u = kSqrt2OverPi * (xi + kGeluCubic * xi * xi * xi);
    y[i] = 0.5f * xi * (1.0f + tanhf(u));
  }
}

__global__ void GeluTanhBackwardKernel(float* dx, const float* dy, const float* x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const float xi = x[i];
    const float u = kSqrt2OverPi * (xi + kGeluCubic * xi * xi * xi);
    const float t = tanhf(u);
    const float du_dx = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * xi * xi);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * xi * (1.0f - t * t) * du_dx);
  }
}

// One block: the sum of squares in double, then the mean.
__global__ void MseForwardKernel(double* loss, const float* pred, const float* target, int64_t n) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double d = static_cast<double>(pred[i]) - target[i];
    sum += d * d;
  }
  sum = BlockReduce(sum, SumOp(), 0.0);
  if (threadIdx.x == 0) *loss = n == 0 ? 0.0 : sum / static_cast<double>(n);
}

__global__ void MseBackwardKernel(float* dpred, const float* pred, const float* target, int64_t n,
                                  float scale) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    dpred[i] = scale * (pred[i] - target[i]);
  }
}

__global__ void CastF32ToBF16Kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) out[i] = FloatToBF16Bits(in[i]);
}

__global__ void CastBF16ToF32Kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) out[i] = BF16BitsToFloat(in[i]);
}

__global__ void AddF32Kernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) dst[i] += src[i];
}

__global__ void AddBF16Kernel(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) dst[i] += BF16BitsToFloat(src[i]);
}

__global__ void ScaleKernel(float* x, int64_t n, float factor) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) x[i] = x[i] * factor;
}

// Pass 1: block b sums the squares of its grid-stride share into partial[b].
__global__ void SquaresPartialKernel(double* partial, const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    const double v = static_cast<double>(x[i]);
    sum += v * v;
  }
  sum = BlockReduce(sum, SumOp(), 0.0);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2: one block adds the partial sums.
__global__ void SumPartialsKernel(double* out, const double* partial, int64_t blocks) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < blocks; i += blockDim.x) sum += partial[i];
  sum = BlockReduce(sum, SumOp(), 0.0);
  if (threadIdx.x == 0) *out = sum;
}

// The float scalars of one step, rounded exactly as the CPU Optimizer rounds
// them (worker/zero/optimizer.cc, AdamScalars).
struct AdamScalars {
  float decay_factor;  // AdamW: 1 - lr * weight_decay (1 when unused)
  float wd;            // Adam: L2 weight decay (0 when unused)
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;
  float eps;
  float neg_step_size;
};

// The CPU loop's float operations one by one, with the _rn intrinsics so that
// nvcc cannot contract them into fused multiply-adds: the result is bitwise
// equal to the CPU update.
template <bool kScale, bool kDecay>
__global__ void AdamKernel(float* p, const float* g, float* m, float* v, int64_t n, AdamScalars s) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalStride()) {
    float pi = p[i];
    if (kScale) pi = __fmul_rn(pi, s.decay_factor);
    float grad = g[i];
    if (kDecay) grad = __fadd_rn(grad, __fmul_rn(s.wd, pi));
    float mi = __fmul_rn(m[i], s.beta1);
    mi = __fadd_rn(mi, __fmul_rn(s.one_minus_beta1, grad));
    float vi = __fmul_rn(v[i], s.beta2);
    vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(s.one_minus_beta2, grad), grad));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    p[i] = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.neg_step_size, mi), denom));
  }
}

template <typename T>
__device__ __forceinline__ float Load(const T* p, int64_t i);
template <>
__device__ __forceinline__ float Load<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float Load<uint16_t>(const uint16_t* p, int64_t i) {
  return BF16BitsToFloat(p[i]);
}

template <typename T>
__device__ __forceinline__ void Store(T* p, int64_t i, float value);
template <>
__device__ __forceinline__ void Store<float>(float* p, int64_t i, float value) {
  p[i] = value;
}
template <>
__device__ __forceinline__ void Store<uint16_t>(uint16_t* p, int64_t i, float value) {
  p[i] = FloatToBF16Bits(value);
}

template <typename T>
__global__ void BiasAddKernel(T* y, const T* b, int64_t n, int64_t out) {
  const int64_t total = n * out;
  for (int64_t i = GlobalThread(); i < total; i += GlobalStride()) {
    Store(y, i, Load(y, i) + Load(b, i % out));
  }
}

// Column sums: a block covers 32 columns; its 8 rows of threads take every
// 8th row and then add their partial sums in a fixed order.
constexpr int kColumnsPerBlock = 32;
constexpr int kRowGroups = 8;

template <typename T>
__global__ void BiasGradKernel(T* db, const T* dy, int64_t n, int64_t out) {
  __shared__ float partial[kRowGroups][kColumnsPerBlock];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  float sum = 0.0f;
  if (col < out) {
    for (int64_t row = threadIdx.y; row < n; row += kRowGroups) sum += Load(dy, row * out + col);
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < out) {
    float total = 0.0f;
    for (int r = 0; r < kRowGroups; ++r) total += partial[r][threadIdx.x];
    Store(db, col, Load(db, col) + total);
  }
}

bool IsFloatType(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

absl::Status CheckBias(const char* what, int64_t n, int64_t out, DType dtype, const void* a,
                       const void* b) {
  if (absl::Status s = CheckCount(what, "n", n); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "out", out); !s.ok()) return s;
  if (!IsFloatType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype ", DTypeName(dtype), " is not supported (F32 and BF16 are)"));
  }
  if (n == 0 || out == 0) return absl::OkStatus();
  if (a == nullptr || b == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null buffer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReluForward(float* y, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("ReluForward", n, {y, x}); !s.ok() || n == 0) return s;
  ReluForwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(y, x, n);
  return LaunchStatus("ReluForward");
}

absl::Status ReluBackward(float* dx, const float* dy, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("ReluBackward", n, {dx, dy, x}); !s.ok() || n == 0) {
    return s;
  }
  ReluBackwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(dx, dy, x, n);
  return LaunchStatus("ReluBackward");
}

absl::Status GeluForward(float* y, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("GeluForward", n, {y, x}); !s.ok() || n == 0) return s;
  GeluForwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(y, x, n);
  return LaunchStatus("GeluForward");
}

absl::Status GeluBackward(float* dx, const float* dy, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("GeluBackward", n, {dx, dy, x}); !s.ok() || n == 0) {
    return s;
  }
  GeluBackwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(dx, dy, x, n);
  return LaunchStatus("GeluBackward");
}

absl::Status GeluTanhForward(float* y, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("GeluTanhForward", n, {y, x}); !s.ok() || n == 0) return s;
  GeluTanhForwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(y, x, n);
  return LaunchStatus("GeluTanhForward");
}

absl::Status GeluTanhBackward(float* dx, const float* dy, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("GeluTanhBackward", n, {dx, dy, x}); !s.ok() || n == 0) {
    return s;
  }
  GeluTanhBackwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(dx, dy, x, n);
  return LaunchStatus("GeluTanhBackward");
}

absl::Status MseForward(double* loss, const float* pred, const float* target, int64_t n,
                        void* stream) {
  if (absl::Status s = CheckCount("MseForward", "n", n); !s.ok()) return s;
  if (absl::Status s = CheckPointer("MseForward", "loss", loss); !s.ok()) return s;
  if (n > 0 && (pred == nullptr || target == nullptr)) {
    return absl::InvalidArgumentError("MseForward: null buffer");
  }
  // Launched for n == 0 too: the loss must still be written (0).
  MseForwardKernel<<<1, 1024, 0, AsStream(stream)>>>(loss, pred, target, n);
  return LaunchStatus("MseForward");
}

absl::Status MseBackward(float* dpred, const float* pred, const float* target, int64_t n,
                         void* stream) {
  if (absl::Status s = CheckElementwise("MseBackward", n, {dpred, pred, target});
      !s.ok() || n == 0) {
    return s;
  }
  const float scale = 2.0f / static_cast<float>(n);
  MseBackwardKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(dpred, pred, target, n, scale);
  return LaunchStatus("MseBackward");
}

absl::Status CastF32ToBF16(uint16_t* out, const float* in, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("CastF32ToBF16", n, {out, in}); !s.ok() || n == 0) return s;
  CastF32ToBF16Kernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(out, in, n);
  return LaunchStatus("CastF32ToBF16");
}

absl::Status CastBF16ToF32(float* out, const uint16_t* in, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("CastBF16ToF32", n, {out, in}); !s.ok() || n == 0) return s;
  CastBF16ToF32Kernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(out, in, n);
  return LaunchStatus("CastBF16ToF32");
}

absl::Status AddInto(float* dst, const void* src, DType src_dtype, int64_t n, void* stream) {
  if (absl::Status s = CheckElementwise("AddInto", n, {dst, src}); !s.ok() || n == 0) return s;
  if (src_dtype == DType::kF32) {
    AddF32Kernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
        dst, static_cast<const float*>(src), n);
  } else if (src_dtype == DType::kBF16) {
    AddBF16Kernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
        dst, static_cast<const uint16_t*>(src), n);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("AddInto: dtype ", DTypeName(src_dtype), " is not F32 or BF16"));
  }
  return LaunchStatus("AddInto");
}

absl::Status Scale(float* x, int64_t n, float factor, void* stream) {
  if (absl::Status s = CheckElementwise("Scale", n, {x}); !s.ok() || n == 0) return s;
  ScaleKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(x, n, factor);
  return LaunchStatus("Scale");
}

absl::Status SquaredNorm(double* out, const float* x, int64_t n, void* stream) {
  if (absl::Status s = CheckCount("SquaredNorm", "n", n); !s.ok()) return s;
  if (absl::Status s = CheckPointer("SquaredNorm", "out", out); !s.ok()) return s;
  if (n > 0 && x == nullptr) return absl::InvalidArgumentError("SquaredNorm: null buffer");
  const int64_t blocks = std::min<int64_t>(GridFor(n), 1024);
  void* scratch = nullptr;
  if (absl::Status s = CudaErrorToStatus(
          cudaMallocAsync(&scratch, blocks * sizeof(double), AsStream(stream)),
          "SquaredNorm: cudaMallocAsync");
      !s.ok()) {
    return s;
  }
  double* partial = static_cast<double*>(scratch);
  SquaresPartialKernel<<<static_cast<unsigned int>(blocks), kThreads, 0, AsStream(stream)>>>(
      partial, x, n);
  SumPartialsKernel<<<1, 1024, 0, AsStream(stream)>>>(out, partial, blocks);
  absl::Status launched = LaunchStatus("SquaredNorm");
  cudaFreeAsync(scratch, AsStream(stream));
  return launched;
}

absl::Status AdamStep(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                      int64_t n, const AdamStepParams& p, void* stream) {
  static constexpr char kWhat[] = "AdamStep";
  if (absl::Status s = CheckCount(kWhat, "n", n); !s.ok()) return s;
  if (p.step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": step must count from 1, got ", p.step));
  }
  if (!std::isfinite(p.lr) || p.lr < 0.0) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": invalid lr ", p.lr));
  }
  if (n == 0) return absl::OkStatus();
  if (params == nullptr || grads == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  // Host double arithmetic, then rounding to float, exactly as
  // AdamOptimizer::Step in worker/zero/optimizer.cc.
  const double t = static_cast<double>(p.step);
  const double bias_correction1 = 1.0 - std::pow(p.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(p.beta2, t);
  const double step_size = p.lr / bias_correction1;
  AdamScalars s;
  const bool scale = p.decoupled && p.weight_decay != 0.0;
  const bool decay = !p.decoupled && p.weight_decay != 0.0;
  s.decay_factor = scale ? static_cast<float>(1.0 - p.lr * p.weight_decay) : 1.0f;
  s.wd = static_cast<float>(p.weight_decay);
  s.beta1 = static_cast<float>(p.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  s.beta2 = static_cast<float>(p.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(p.eps);
  s.neg_step_size = static_cast<float>(-step_size);
  const cudaStream_t st = AsStream(stream);
  if (scale) {
    AdamKernel<true, false>
        <<<GridFor(n), kThreads, 0, st>>>(params, grads, exp_avg, exp_avg_sq, n, s);
  } else if (decay) {
    AdamKernel<false, true>
        <<<GridFor(n), kThreads, 0, st>>>(params, grads, exp_avg, exp_avg_sq, n, s);
  } else {
    AdamKernel<false, false>
        <<<GridFor(n), kThreads, 0, st>>>(params, grads, exp_avg, exp_avg_sq, n, s);
  }
  return LaunchStatus(kWhat);
}

absl::Status BiasAdd(void* y, const void* b, int64_t n, int64_t out, DType dtype, void* stream) {
  if (absl::Status s = CheckBias("BiasAdd", n, out, dtype, y, b); !s.ok() || n == 0 || out == 0) {
    return s;
  }
  const int64_t total = n * out;
  if (dtype == DType::kF32) {
    BiasAddKernel<<<GridFor(total), kThreads, 0, AsStream(stream)>>>(
        static_cast<float*>(y), static_cast<const float*>(b), n, out);
  } else {
    BiasAddKernel<<<GridFor(total), kThreads, 0, AsStream(stream)>>>(
        static_cast<uint16_t*>(y), static_cast<const uint16_t*>(b), n, out);
  }
  return LaunchStatus("BiasAdd");
}

absl::Status BiasGrad(void* db, const void* dy, int64_t n, int64_t out, DType dtype, void* stream) {
  if (absl::Status s = CheckBias("BiasGrad", n, out, dtype, db, dy);
      !s.ok() || n == 0 || out == 0) {
    return s;
  }
  const int64_t blocks = (out + kColumnsPerBlock - 1) / kColumnsPerBlock;
  if (blocks > 0x7fffffff) return absl::InvalidArgumentError("BiasGrad: out is too large");
  const dim3 block(kColumnsPerBlock, kRowGroups);
  if (dtype == DType::kF32) {
    BiasGradKernel<<<static_cast<unsigned int>(blocks), block, 0, AsStream(stream)>>>(
        static_cast<float*>(db), static_cast<const float*>(dy), n, out);
  } else {
    BiasGradKernel<<<static_cast<unsigned int>(blocks), block, 0, AsStream(stream)>>>(
        static_cast<uint16_t*>(db), static_cast<const uint16_t*>(dy), n, out);
  }
  return LaunchStatus("BiasGrad");
}

}  // namespace gpu
}  // namespace zeroshard
