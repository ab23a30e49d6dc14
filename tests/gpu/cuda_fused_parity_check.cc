// GPU-versus-CPU parity of #46's fused kernels: the fused classifier
// (worker/cuda/classifier.h) against layers.h's CrossEntropyForward /
// Backward, and CublasLtLinear (worker/cuda/cublaslt_linear.h) with each
// epilogue against layers.h's Linear / Conv1D and GeluTanh on the same
// (bf16-rounded, for bf16) operands: both weight layouts, an odd shape (which
// takes the unfused fallback for GELU) and GPT-2 124M's shapes (N = 8192
// positions, C = 768, 4C = 3072, V = 50257), and the logits (and their
// gradient) in rows padded to ld = 50304 as the device GPT keeps them: the
// padding NaN where it must not be read, checked untouched where it must not
// be written and 0 where the classifier's backward writes it. Needs a GPU;
// without one it exits 2 and says so. Tolerances come from the error models beside each
// check (tests/testing/error_model.h's gamma_n for sums).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testing/classifier_error_model.h"
#include "tests/testing/error_model.h"
#include "worker/cuda/classifier.h"
#include "worker/cuda/cublaslt_epilogue.h"
#include "worker/cuda/cublaslt_linear.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using gpu_test::DeviceBuffer;
using gpu_test::RandomFloats;
using testing::kFloat32Unit;
using testing::SumErrorBound;

constexpr double kU = kFloat32Unit;
using testing::kBF16Unit;  // 2^-8 (was 2^-9 here, which bf16 roundings exceed)

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A packed [rows, cols] matrix in rows ld >= cols apart, the padding `pad`;
// and back.
std::vector<float> PadRows(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t ld,
                           float pad) {
  if (ld == cols) return m;
  std::vector<float> out(rows * ld, pad);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(m.begin() + i * cols, m.begin() + (i + 1) * cols, out.begin() + i * ld);
  }
  return out;
}
std::vector<float> UnpadRows(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) return m;
  std::vector<float> out(rows * cols);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(m.begin() + i * ld, m.begin() + i * ld + cols, out.begin() + i * cols);
  }
  return out;
}

// How many padding elements (columns [cols, ld) of each row) are not NaN
// (want_nan) or not exactly 0 (otherwise).
int64_t BadPadding(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t ld,
                   bool want_nan) {
  int64_t bad = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = cols; j < ld; ++j) {
      const float x = m[i * ld + j];
      bad += want_nan ? !std::isnan(x) : x != 0.0f;
    }
  }
  return bad;
}

std::vector<float> RoundTo(const std::vector<float>& v, DType dtype) {
  if (dtype == DType::kF32) return v;
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = BF16ToFloat(FloatToBF16(v[i]));
  return out;
}

// A device tensor in F32 or BF16, filled from / read back as floats.
class Tensor {
 public:
  Tensor(size_t n, DType dtype) : dtype_(dtype), bytes_(std::max<size_t>(n, 1) * DTypeSize(dtype)) {
    n_ = n;
    gpu_test::CudaOrDie(cudaMalloc(&data_, bytes_), "cudaMalloc");
  }
  Tensor(const std::vector<float>& v, DType dtype) : Tensor(v.size(), dtype) { Upload(v); }
  ~Tensor() { cudaFree(data_); }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  void Upload(const std::vector<float>& v) {
    if (dtype_ == DType::kF32) {
      gpu_test::CudaOrDie(cudaMemcpy(data_, v.data(), n_ * 4, cudaMemcpyHostToDevice), "upload");
      return;
    }
    std::vector<uint16_t> bits(n_);
    for (size_t i = 0; i < n_; ++i) bits[i] = FloatToBF16(v[i]);
    gpu_test::CudaOrDie(cudaMemcpy(data_, bits.data(), n_ * 2, cudaMemcpyHostToDevice), "upload");
  }
  std::vector<float> Download() const {
    gpu_test::CudaOrDie(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<float> out(n_);
    if (dtype_ == DType::kF32) {
      gpu_test::CudaOrDie(cudaMemcpy(out.data(), data_, n_ * 4, cudaMemcpyDeviceToHost), "down");
      return out;
    }
    std::vector<uint16_t> bits(n_);
    gpu_test::CudaOrDie(cudaMemcpy(bits.data(), data_, n_ * 2, cudaMemcpyDeviceToHost), "down");
    for (size_t i = 0; i < n_; ++i) out[i] = BF16ToFloat(bits[i]);
    return out;
  }
  void* get() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }

 private:
  DType dtype_;
  size_t bytes_;
  size_t n_ = 0;
  void* data_ = nullptr;
};

// Every element within its own tolerance; reports the worst excess.
::testing::AssertionResult WithinTolerances(const std::vector<float>& got,
                                            const std::vector<float>& want,
                                            const std::vector<double>& tol,
                                            const std::string& what) {
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (!(err <= tol[i])) {
      ++bad;
      const double ratio = std::isnan(err) ? 1e300 : err / std::max(tol[i], 1e-300);
      if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " elements off; worst [" << worst
         << "] got " << got[worst] << " want " << want[worst] << " tolerance " << tol[worst] << " ("
         << worst_ratio << "x)";
}

// ----------------------------------------------------------------------------
// The fused classifier. Error model: tests/testing/classifier_error_model.h
// (shared with the host twin's test and the kernels' emulated test), for the
// kernel's 256 threads per row and 16-byte vectors (4 f32 or 8 bf16 logits).

// ld: the logits' row stride (0: v). Padded, the logits' padding is NaN
// (a read of it would make that row's lse NaN) and so is a separate
// gradient buffer's; the gradient's padding must come back 0.
void CheckClassifier(int64_t n, int64_t v, DType dtype, float range, bool in_place,
                     int64_t ld = 0) {
  if (ld == 0) ld = v;
  SCOPED_TRACE(absl::StrCat("classifier n ", n, " v ", v, " ld ", ld, " ", DTypeName(dtype),
                            in_place ? " in place" : ""));
  const std::vector<float> logits = RoundTo(RandomFloats(n * v, 41, -range, range), dtype);
  std::vector<int32_t> targets = gpu_test::RandomInts(n, 42, 0, static_cast<int32_t>(v - 1));
  for (int64_t i = 3; i < n; i += 5) targets[i] = kUnscoredTarget;  // --loss_on=answers rows
  std::vector<float> probs(n * v), want_grad(n * v);
  const double want_loss = CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v);
  CrossEntropyBackward(want_grad.data(), probs.data(), targets.data(), n, v);
  probs.clear();
  probs.shrink_to_fit();

  Tensor d_logits(PadRows(logits, n, v, ld, kNaN), dtype);
  std::unique_ptr<Tensor> d_grad =
      in_place ? nullptr
               : std::make_unique<Tensor>(std::vector<float>(n * ld, ld == v ? 0.0f : kNaN), dtype);
  DeviceBuffer<int32_t> d_targets(targets);
  DeviceBuffer<float> d_lse(n);
  DeviceBuffer<double> d_loss(1);
  ASSERT_TRUE(gpu::ClassifierForward(d_loss.get(), d_lse.get(), d_logits.get(), d_targets.get(), n,
                                     v, ld, dtype, nullptr)
                  .ok());
  void* grad_ptr = in_place ? d_logits.get() : d_grad->get();
  ASSERT_TRUE(gpu::ClassifierBackward(grad_ptr, d_logits.get(), d_lse.get(), d_targets.get(), n, v,
                                      ld, dtype, nullptr)
                  .ok());
  const double loss = d_loss.Download()[0];
  const std::vector<float> lse = d_lse.Download();
  std::vector<float> grad = in_place ? d_logits.Download() : d_grad->Download();
  EXPECT_EQ(BadPadding(grad, n, v, ld, /*want_nan=*/false), 0) << "gradient padding not 0";
  grad = UnpadRows(grad, n, v, ld);

  const double gap = 2.0 * range;
  const double sum_err = testing::ClassifierSumRelative(v, 256, dtype == DType::kF32 ? 4 : 8, gap);
  // The loss: log s off by both sums' relative errors; the rest is double.
  EXPECT_NEAR(loss, want_loss,
              sum_err + testing::CrossEntropySumRelative(gap) + 1e-12 * std::fabs(want_loss));
  int64_t scored = 0;
  for (int32_t t : targets) scored += t != kUnscoredTarget;
  const double inv = 1.0 / scored;
  std::vector<double> tol(n * v);
  for (int64_t i = 0; i < n; ++i) {
    const float* z = logits.data() + i * v;
    if (targets[i] == kUnscoredTarget) {
      for (int64_t j = 0; j < v; ++j) tol[i * v + j] = 0;  // exactly 0
      continue;
    }
    const double m = *std::max_element(z, z + v);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(z[j] - m);
    const double want_lse = m + std::log(s);
    const double lse_err = testing::ClassifierLseTolerance(sum_err, want_lse, m);
    EXPECT_NEAR(lse[i], want_lse, lse_err) << "row " << i;
    for (int64_t j = 0; j < v; ++j) {
      const double t = testing::ClassifierGradientTolerance(z[j], want_lse, m, inv, lse_err);
      tol[i * v + j] =
          dtype == DType::kBF16 ? testing::Bf16StoredTolerance(want_grad[i * v + j], t) : t;
    }
  }
  EXPECT_TRUE(WithinTolerances(grad, want_grad, tol, "dlogits"));
}

TEST(FusedParityTest, ClassifierSmall) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckClassifier(37, 1000, dtype, 4.0f, false);
    CheckClassifier(5, 1, dtype, 4.0f, false);
    CheckClassifier(16, 777, dtype, 1e4f, false);  // huge logits: the running max
    CheckClassifier(11, 50257, dtype, 8.0f, true);
  }
}

TEST(FusedParityTest, ClassifierPaddedRows) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckClassifier(37, 1000, dtype, 4.0f, false, 1024);  // every row split alike
    CheckClassifier(37, 1000, dtype, 4.0f, true, 1003);   // each row at another alignment
    CheckClassifier(5, 1, dtype, 4.0f, false, 64);
    CheckClassifier(16, 777, dtype, 1e4f, true, 832);
    CheckClassifier(11, 50257, dtype, 8.0f, false, 50304);
  }
}

// GPT-2's vocabulary with 1024 of a step's 8192 rows: the row's width
// decides the kernel's work per block; the row count only the grid. (All
// 8192 rows, which passed on an H200, took the CPU reference 105 s.)
TEST(FusedParityTest, ClassifierGpt2Shape) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckClassifier(1024, 50257, dtype, 8.0f, true);
    CheckClassifier(1024, 50257, dtype, 8.0f, true, 50304);  // as the device GPT pads it
  }
}

TEST(FusedParityTest, ClassifierBadTargetIsNaN) {
  const int64_t n = 4, v = 100;
  std::vector<int32_t> targets = {1, 100, kUnscoredTarget, 5};
  DeviceBuffer<float> d_logits(RandomFloats(n * v, 43)), d_lse(n);
  DeviceBuffer<int32_t> d_targets(targets);
  DeviceBuffer<double> d_loss(1);
  ASSERT_TRUE(gpu::ClassifierForward(d_loss.get(), d_lse.get(), d_logits.get(), d_targets.get(), n,
                                     v, DType::kF32, nullptr)
                  .ok());
  EXPECT_TRUE(std::isnan(d_loss.Download()[0]));
  targets = {kUnscoredTarget, kUnscoredTarget, kUnscoredTarget, kUnscoredTarget};
  d_targets.Upload(targets);
  ASSERT_TRUE(gpu::ClassifierForward(d_loss.get(), d_lse.get(), d_logits.get(), d_targets.get(), n,
                                     v, DType::kF32, nullptr)
                  .ok());
  EXPECT_EQ(d_loss.Download()[0], 0.0) << "nothing scored: loss 0";
  ASSERT_TRUE(gpu::ClassifierBackward(d_logits.get(), d_logits.get(), d_lse.get(), d_targets.get(),
                                      n, v, DType::kF32, nullptr)
                  .ok());
  for (float g : d_logits.Download()) ASSERT_EQ(g, 0.0f);
}

// ----------------------------------------------------------------------------
// CublasLtLinear. Error model: an output element is a k-term f32 dot
// product (bf16 operands multiply exactly into f32), within gamma_k S of
// exact on either side, S = sum |terms| (computed by the same CPU product
// on absolute values), so the two are apart by <= 2 gamma_k S; TF32 rounds
// each operand to 10 mantissa bits (2^-11 relative each: 2^-10 S more).
// GELU's slope is at most 1.13 in magnitude, so an input error e becomes
// <= 1.13 e. The GELU itself: our kernels and the CPU use tanhf (their
// formulas differ by <= 16 u max(1, |y|), layers_test's element model), but
// cuBLASLt's epilogue may use the hardware tanh.approx.f32, whose relative
// error is <= 2^-10.987 (PTX ISA): with t = tanh(u) off by <= 2^-10 |t|, the
// value 0.5 x (1 + t) is off by <= 2^-10 |x| / 2 and the slope
// 0.5 (1 + t) + 0.5 x (1 - t^2) u' by <= 2^-10 (0.5 + |x| u'). (So these
// checks cannot tell tanh-GELU from erf-GELU, which differ by < 5e-4; the
// CPU-vs-GPU GPT parity check can.) A bf16 result rounds at most twice (the
// fallback rounds the product, then the bias add or GELU): 2^-8 of the
// magnitudes; a bias added to a bf16 y is itself rounded to bf16 first.

using Layout = gpu::CublasLtLinear::Layout;

constexpr double kTanhApprox = 0x1p-10;

double GeluValueError(double x, double y) {
  return kTanhApprox * 0.5 * std::fabs(x) + 16 * kU * std::max(1.0, std::fabs(y));
}

// Relative to |dy|: the error of GELU's slope at x.
double GeluSlopeError(double x) {
  const double du = 0.7978845608 * (1 + 3 * 0.044715 * x * x);
  return kTanhApprox * (0.5 + std::fabs(x) * du) + 20 * kU;
}

struct LinearCase {
  std::string name;
  Layout layout = Layout::kInOut;
  int64_t n = 0, in = 0, out = 0;
  DType in_dtype = DType::kF32, out_dtype = DType::kF32;
  bool bias = true, gelu = false, residual = false, tf32 = false;
  // y's and dy's row stride (0: out, packed); padded, their padding is NaN.
  int64_t ld = 0;
  bool dx_f32 = false;  // dx in F32 whatever out_dtype (the LM head's dx)
  int64_t Ld() const { return ld == 0 ? out : ld; }
  DType DxDtype() const { return dx_f32 ? DType::kF32 : out_dtype; }
};

void CpuForward(Layout layout, float* y, const float* x, const float* w, const float* b, int64_t n,
                int64_t in, int64_t out) {
  if (layout == Layout::kOutIn) {
    LinearForward(y, x, w, b, n, in, out);
  } else {
    Conv1dForward(y, x, w, b, n, in, out);
  }
}

void CpuBackward(Layout layout, float* dx, float* dw, float* db, const float* dy, const float* x,
                 const float* w, int64_t n, int64_t in, int64_t out) {
  if (layout == Layout::kOutIn) {
    LinearBackward(dx, dw, db, dy, x, w, n, in, out);
  } else {
    Conv1dBackward(dx, dw, db, dy, x, w, n, in, out);
  }
}

std::vector<float> Abs(std::vector<float> v) {
  for (float& x : v) x = std::fabs(x);
  return v;
}

double ProductBound(double s, int64_t k, bool tf32) {
  return 2 * SumErrorBound(k) * s + (tf32 ? 0x1p-10 * s : 0.0);
}

struct LinearInputs {
  std::vector<float> x, w, b, dy, residual, pre, dw0, db0, gb0;
};

LinearInputs MakeInputs(const LinearCase& c) {
  LinearInputs in;
  const DType op = c.in_dtype;
  in.x = RoundTo(RandomFloats(c.n * c.in, 51), op);
  in.w = RoundTo(RandomFloats(c.in * c.out, 52, -0.5f, 0.5f), op);
  in.b = RandomFloats(c.out, 53);
  in.dy = RoundTo(RandomFloats(c.n * c.out, 54), op);
  if (c.residual) in.residual = RandomFloats(c.n * c.out, 55, -2.0f, 2.0f);
  if (c.gelu) in.pre = RoundTo(RandomFloats(c.n * c.in, 56, -3.0f, 3.0f), c.DxDtype());
  in.dw0 = RandomFloats(c.in * c.out, 57);
  in.db0 = RandomFloats(c.out, 58);
  in.gb0 = RandomFloats(c.in, 59);
  return in;
}

// Forward: y (and gelu_input) against the CPU.
void CheckLinearForward(gpu::CublasLtLinear& lt, const LinearCase& c, const LinearInputs& in) {
  const int64_t ny = c.n * c.out;
  const bool bf16_out = c.out_dtype == DType::kBF16;
  std::vector<float> b = in.b;
  if (bf16_out) b = RoundTo(b, DType::kBF16);  // cuBLASLt's bias has y's type
  std::vector<float> pre(ny), s(ny);
  CpuForward(c.layout, pre.data(), in.x.data(), in.w.data(), c.bias ? b.data() : nullptr, c.n, c.in,
             c.out);
  const std::vector<float> abs_b = Abs(b);
  CpuForward(c.layout, s.data(), Abs(in.x).data(), Abs(in.w).data(),
             c.bias ? abs_b.data() : nullptr, c.n, c.in, c.out);
  std::vector<float> want = pre;
  if (c.residual) {
    for (int64_t i = 0; i < ny; ++i) want[i] += in.residual[i];
  }
  if (c.gelu) GeluTanhForward(want.data(), pre.data(), ny);

  Tensor d_x(in.x, c.in_dtype), d_w(in.w, c.in_dtype), d_b(in.b, DType::kF32);
  // y starts NaN, so every element must be written, and its padding must
  // come back untouched. The residual has a buffer of its own (C != D), as
  // the model adds it (x into res2, res2 into the next residual stream).
  Tensor d_y(PadRows(std::vector<float>(ny, kNaN), c.n, c.out, c.Ld(), kNaN), c.out_dtype);
  Tensor d_res(c.residual ? in.residual : std::vector<float>(1, 0.0f), DType::kF32);
  Tensor d_pre(ny, c.out_dtype);
  gpu::CublasLtLinear::ForwardArgs a;
  a.y = d_y.get();
  a.y_dtype = c.out_dtype;
  a.x = d_x.get();
  a.w = d_w.get();
  a.in_dtype = c.in_dtype;
  a.layout = c.layout;
  a.bias = c.bias ? d_b.f32() : nullptr;
  a.residual = c.residual ? d_res.f32() : nullptr;
  a.gelu_input = c.gelu ? d_pre.get() : nullptr;
  a.n = c.n;
  a.in = c.in;
  a.out = c.out;
  a.ld_y = c.ld;
  const absl::Status status = lt.Forward(a);
  ASSERT_TRUE(status.ok()) << status;
  std::vector<double> tol_pre(ny), tol(ny);
  for (int64_t i = 0; i < ny; ++i) {
    double e = ProductBound(s[i], c.in, c.tf32) + 2 * kU * std::fabs(pre[i]);
    if (bf16_out) e += 2 * kBF16Unit * (std::fabs(pre[i]) + std::fabs(in.b[i % c.out]));
    tol_pre[i] = e;
    if (c.residual) e += kU * (std::fabs(want[i]) + std::fabs(in.residual[i]));
    if (c.gelu) {
      e = 1.13 * e + GeluValueError(pre[i], want[i]);
      if (bf16_out) e += 1.13 * kBF16Unit * std::fabs(pre[i]) + kBF16Unit * std::fabs(want[i]);
    }
    tol[i] = e;
  }
  const std::vector<float> y = d_y.Download();
  EXPECT_EQ(BadPadding(y, c.n, c.out, c.Ld(), /*want_nan=*/true), 0) << "y's padding written";
  if (c.residual) {
    EXPECT_EQ(d_res.Download(), in.residual) << "the residual was written";
  }
  EXPECT_TRUE(WithinTolerances(UnpadRows(y, c.n, c.out, c.Ld()), want, tol, "y"));
  if (c.gelu) {
    EXPECT_TRUE(WithinTolerances(d_pre.Download(), pre, tol_pre, "gelu_input"));
  }
}

// BackwardInput: dx = dy W^T, then (with gelu) * gelu'(pre) and the bias
// gradient of the layer before, accumulated onto gb0.
void CheckLinearBackwardInput(gpu::CublasLtLinear& lt, const LinearCase& c,
                              const LinearInputs& in) {
  const int64_t nx = c.n * c.in;
  const bool bf16_out = c.DxDtype() == DType::kBF16;
  std::vector<float> raw(nx), s(nx), dw(c.in * c.out), db(c.out);
  CpuBackward(c.layout, raw.data(), dw.data(), db.data(), in.dy.data(), in.x.data(), in.w.data(),
              c.n, c.in, c.out);
  CpuBackward(c.layout, s.data(), dw.data(), db.data(), Abs(in.dy).data(), in.x.data(),
              Abs(in.w).data(), c.n, c.in, c.out);
  std::vector<float> want = raw;
  if (c.gelu) GeluTanhBackward(want.data(), raw.data(), in.pre.data(), nx);
  std::vector<double> tol(nx);
  for (int64_t i = 0; i < nx; ++i) {
    double e = ProductBound(s[i], c.out, c.tf32) + kU * std::fabs(raw[i]);
    if (c.gelu) {
      e = 1.13 * e + GeluSlopeError(in.pre[i]) * std::max(1.0, std::fabs(double{raw[i]}));
    }
    if (bf16_out) e += 2 * kBF16Unit * (1.13 * std::fabs(raw[i]) + std::fabs(want[i]));
    tol[i] = e;
  }
  // dy's padding NaN: a read of it would make dx NaN.
  Tensor d_dy(PadRows(in.dy, c.n, c.out, c.Ld(), kNaN), c.in_dtype), d_w(in.w, c.in_dtype);
  Tensor d_dx(nx, c.DxDtype());
  Tensor d_pre(c.gelu ? in.pre : std::vector<float>(1, 0.0f), c.DxDtype());
  Tensor d_gb(in.gb0, DType::kF32);
  gpu::CublasLtLinear::BackwardInputArgs a;
  a.dx = d_dx.get();
  a.dx_dtype = c.DxDtype();
  a.dy = d_dy.get();
  a.w = d_w.get();
  a.in_dtype = c.in_dtype;
  a.layout = c.layout;
  a.gelu_input = c.gelu ? d_pre.get() : nullptr;
  a.gelu_bias_grad = c.gelu ? d_gb.f32() : nullptr;
  a.n = c.n;
  a.in = c.in;
  a.out = c.out;
  a.ld_dy = c.ld;
  const absl::Status status = lt.BackwardInput(a);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(WithinTolerances(d_dx.Download(), want, tol, "dx"));
  if (!c.gelu) return;
  // gb = gb0 + column sums of dx: each term's error adds, plus the sum's own
  // (gamma_n of its magnitudes) and, for bf16, cuBLASLt's bf16 bias gradient
  // (2^-9 of it).
  std::vector<float> gb = in.gb0;
  std::vector<double> gb_tol(c.in), mag(c.in);
  for (int64_t i = 0; i < c.n; ++i) {
    for (int64_t j = 0; j < c.in; ++j) {
      gb[j] += want[i * c.in + j];
      gb_tol[j] += tol[i * c.in + j];
      mag[j] += std::fabs(want[i * c.in + j]);
    }
  }
  for (int64_t j = 0; j < c.in; ++j) {
    gb_tol[j] += 2 * SumErrorBound(c.n + 1) * (mag[j] + std::fabs(in.gb0[j]));
    if (bf16_out) gb_tol[j] += kBF16Unit * mag[j];
  }
  EXPECT_TRUE(WithinTolerances(d_gb.Download(), gb, gb_tol, "gelu_bias_grad"));
}

// BackwardWeight: dw += x^T dy, db += column sums of dy, from nonzero starts.
void CheckLinearBackwardWeight(gpu::CublasLtLinear& lt, const LinearCase& c,
                               const LinearInputs& in) {
  std::vector<float> dw = in.dw0, db = in.db0;
  CpuBackward(c.layout, nullptr, dw.data(), db.data(), in.dy.data(), in.x.data(), in.w.data(), c.n,
              c.in, c.out);
  std::vector<float> s_dw = Abs(in.dw0), s_db = Abs(in.db0);
  CpuBackward(c.layout, nullptr, s_dw.data(), s_db.data(), Abs(in.dy).data(), Abs(in.x).data(),
              in.w.data(), c.n, c.in, c.out);
  std::vector<double> tol_dw(dw.size()), tol_db(db.size());
  for (size_t i = 0; i < dw.size(); ++i) tol_dw[i] = ProductBound(s_dw[i], c.n + 1, c.tf32);
  for (size_t i = 0; i < db.size(); ++i) tol_db[i] = 2 * SumErrorBound(c.n + 1) * s_db[i];
  Tensor d_dy(PadRows(in.dy, c.n, c.out, c.Ld(), kNaN), c.in_dtype), d_x(in.x, c.in_dtype);
  Tensor d_dw(in.dw0, DType::kF32), d_db(in.db0, DType::kF32);
  gpu::CublasLtLinear::BackwardWeightArgs a;
  a.dw = d_dw.f32();
  a.db = c.bias ? d_db.f32() : nullptr;
  a.dy = d_dy.get();
  a.x = d_x.get();
  a.in_dtype = c.in_dtype;
  a.layout = c.layout;
  a.n = c.n;
  a.in = c.in;
  a.out = c.out;
  a.ld_dy = c.ld;
  const absl::Status status = lt.BackwardWeight(a);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(WithinTolerances(d_dw.Download(), dw, tol_dw, "dw"));
  if (c.bias) {
    EXPECT_TRUE(WithinTolerances(d_db.Download(), db, tol_db, "db"));
  }
}

void CheckLinear(const LinearCase& c) {
  SCOPED_TRACE(absl::StrCat(
      c.name, ": n ", c.n, " in ", c.in, " out ", c.out, " ld ", c.Ld(), " ", DTypeName(c.in_dtype),
      " -> ", DTypeName(c.out_dtype), c.dx_f32 ? " (dx F32)" : "",
      c.layout == Layout::kOutIn ? " Linear" : " Conv1D", c.bias ? " +bias" : "",
      c.gelu ? " +gelu" : "", c.residual ? " +residual" : "", c.tf32 ? " tf32" : ""));
  auto lt = gpu::CublasLtLinear::Create(nullptr, c.tf32);
  ASSERT_TRUE(lt.ok()) << lt.status();
  const LinearInputs in = MakeInputs(c);
  CheckLinearForward(**lt, c, in);
  CheckLinearBackwardInput(**lt, c, in);
  CheckLinearBackwardWeight(**lt, c, in);
  const auto counts = (*lt)->path_counts();
  std::printf(
      "  %-12s %-8s n %-5lld in %-5lld out %-5lld ld %-5lld %s->%s bias %d gelu %d residual %d: "
      "%lld fused, %lld unfused\n",
      c.name.c_str(), c.layout == Layout::kOutIn ? "Linear" : "Conv1D", static_cast<long long>(c.n),
      static_cast<long long>(c.in), static_cast<long long>(c.out), static_cast<long long>(c.Ld()),
      DTypeName(c.in_dtype).c_str(), DTypeName(c.out_dtype).c_str(), c.bias, c.gelu, c.residual,
      static_cast<long long>(counts.fused), static_cast<long long>(counts.unfused));
}

std::vector<LinearCase> Variants(const std::string& name, int64_t n, int64_t in, int64_t out) {
  std::vector<LinearCase> cases;
  for (Layout layout : {Layout::kOutIn, Layout::kInOut}) {
    for (auto [in_dtype, out_dtype] :
         {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16},
          std::pair{DType::kBF16, DType::kF32}}) {
      LinearCase c{name, layout, n, in, out, in_dtype, out_dtype};
      // none, bias, bias + GELU, bias + residual (f32 y), GELU without bias
      for (int v = 0; v < 5; ++v) {
        c.bias = v != 0 && v != 4;
        c.gelu = v == 2 || v == 4;
        c.residual = v == 3 && out_dtype == DType::kF32;
        if (v == 3 && !c.residual) continue;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

TEST(FusedParityTest, CublasLtLinearSmallAndOdd) {
  for (const LinearCase& c : Variants("small", 64, 96, 128)) CheckLinear(c);
  // Odd: no dimension a multiple of 8 (unaligned rows; GELU's aux ld falls
  // back to the unfused kernels).
  for (const LinearCase& c : Variants("odd", 37, 45, 53)) CheckLinear(c);
  LinearCase tf32{"tf32", Layout::kInOut, 64, 96, 128};
  tf32.gelu = true;
  tf32.tf32 = true;
  CheckLinear(tf32);
}

// Padded rows of y and dy (plain products only: no GELU, no residual), with
// and without a bias (its gradient sums OUT columns of the padded dy).
std::vector<LinearCase> PaddedVariants(const std::string& name, int64_t n, int64_t in, int64_t out,
                                       int64_t ld) {
  std::vector<LinearCase> cases;
  for (Layout layout : {Layout::kOutIn, Layout::kInOut}) {
    for (auto [in_dtype, out_dtype] :
         {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16},
          std::pair{DType::kBF16, DType::kF32}}) {
      for (bool bias : {false, true}) {
        LinearCase c{name, layout, n, in, out, in_dtype, out_dtype};
        c.bias = bias;
        c.ld = ld;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

TEST(FusedParityTest, CublasLtLinearPaddedRows) {
  for (const LinearCase& c : PaddedVariants("padded", 64, 96, 120, 128)) CheckLinear(c);
  // An odd OUT and an odd stride: rows at every alignment.
  for (const LinearCase& c : PaddedVariants("padded_odd", 37, 45, 53, 61)) CheckLinear(c);
}

// CublasLtLinear's fallback kernels on padded rows, run directly (cuBLASLt
// decides when the fallback runs, so the cases above may never take it):
// LtBiasAddRows must leave the padding (NaN) untouched and add exactly as the
// host does (one f32 addition, then for bf16 one rounding: the same bits);
// LtColumnSumsAdd must not read the padding (NaN) and is within gamma_n of
// the magnitudes (f32 sums in another order than the host's double).
TEST(FusedParityTest, FallbackKernelsHonourTheRowStride) {
  const int64_t rows = 300, cols = 53, ld = 64;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::vector<float> y = RoundTo(RandomFloats(rows * cols, 61), dtype);
    const std::vector<float> b = RoundTo(RandomFloats(cols, 62), dtype);
    Tensor d_y(PadRows(y, rows, cols, ld, kNaN), dtype), d_b(b, dtype);
    ASSERT_TRUE(
        gpu::internal::LtBiasAddRows(d_y.get(), d_b.get(), rows, cols, ld, dtype, nullptr).ok());
    const std::vector<float> got = d_y.Download();
    EXPECT_EQ(BadPadding(got, rows, cols, ld, /*want_nan=*/true), 0) << "padding written";
    std::vector<float> want(rows * cols);
    for (int64_t i = 0; i < rows * cols; ++i) want[i] = y[i] + b[i % cols];
    want = RoundTo(want, dtype);
    EXPECT_EQ(UnpadRows(got, rows, cols, ld), want);

    const std::vector<float> start = RandomFloats(cols, 63);
    Tensor d_sums(start, DType::kF32);
    Tensor d_x(PadRows(y, rows, cols, ld, kNaN), dtype);
    ASSERT_TRUE(
        gpu::internal::LtColumnSumsAdd(d_sums.f32(), d_x.get(), rows, cols, ld, dtype, nullptr)
            .ok());
    std::vector<float> sums = start;
    std::vector<double> tol(cols);
    for (int64_t j = 0; j < cols; ++j) {
      double s = start[j], mag = std::fabs(start[j]);
      for (int64_t i = 0; i < rows; ++i) s += y[i * cols + j], mag += std::fabs(y[i * cols + j]);
      sums[j] = static_cast<float>(s);
      tol[j] = SumErrorBound(rows + 1) * mag + kU * std::fabs(s);
    }
    EXPECT_TRUE(WithinTolerances(d_sums.Download(), sums, tol, "column sums"));
  }
}

TEST(FusedParityTest, CublasLtLinearGpt2Shapes) {
  // GPT-2 124M's MLP at T 1024, batch 8: c_fc (768 -> 3072, bias + GELU) and
  // c_proj (3072 -> 768, bias + residual), Conv1D layout, f32 and bf16.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    LinearCase fc{"gpt2_fc", Layout::kInOut, 8192, 768, 3072, dtype, dtype};
    fc.gelu = true;
    CheckLinear(fc);
    LinearCase proj{"gpt2_proj", Layout::kInOut, 8192, 3072, 768, dtype, DType::kF32};
    proj.residual = true;
    CheckLinear(proj);
  }
  // The tied LM head, logits = x wte^T (wte [V,C]: Linear layout, no bias),
  // bf16 logits as the fused classifier takes them. 512 of the step's 8192
  // rows: the reference's inputs and per-element bounds at 8192 rows (3 GB
  // each) outlasted the check's 4 minutes on the H200 machine.
  LinearCase head{"gpt2_lm_head", Layout::kOutIn, 512, 768, 50257, DType::kBF16, DType::kBF16};
  head.bias = false;
  CheckLinear(head);
  // The same head as the device GPT runs it with padded logits: y (bf16
  // logits) and dy (their bf16 gradient) in rows of 50304 = round_up(V, 64),
  // dx in f32 (it feeds ln_f's backward) and dw in f32.
  LinearCase padded = head;
  padded.name = "gpt2_lm_head_padded";
  padded.ld = 50304;
  padded.dx_f32 = true;
  CheckLinear(padded);
  // And OUT itself padded to 50304, as the device GPT runs the forward and
  // dx (its weight's padding rows are 0 there; any values here).
  LinearCase padded_out = padded;
  padded_out.name = "gpt2_lm_head_padded_out";
  padded_out.out = 50304;
  padded_out.ld = 0;
  CheckLinear(padded_out);
}

}  // namespace
}  // namespace zeroshard

// Exit 2 without a GPU (a skip, as tests/gpu/run.sh counts it), else the
// tests' result.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const absl::Status device = zeroshard::CheckCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "%s: no GPU, nothing checked: %s\n", argv[0],
                 std::string(device.message()).c_str());
    return 2;
  }
  return RUN_ALL_TESTS();
}
