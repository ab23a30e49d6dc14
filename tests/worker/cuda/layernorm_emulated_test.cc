// LayerNorm's kernels (worker/cuda/layernorm.cu) run on the CPU under the
// thread-per-CUDA-thread emulation (emulation/cuda_emulation.h), through their
// own host code (LayerNormForwardTo, LayerNormBackward), against layers.h's
// LayerNormForward / LayerNormBackward: F32 and BF16 output, dx with and
// without the skip path's dx_plus, the two-stage parameter gradients over row
// chunks of 256 (n not a multiple of 256, spanning several chunks), rows a
// warp each, 8 to a block (n below 8, and n past one block and not a multiple
// of 8: a block's last warps have no row), c not a multiple of a warp or of
// the column blocks (32). Not covered: the hardware's rounding of 1 / sqrt (host libm here) and speed.
#include <cuda_runtime.h>  // the emulation's (tests/worker/cuda/emulation)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/cuda/emulated_test_util.h"
#include "tests/worker/cuda/layernorm.cu.inc"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using emulated::Buffer;
using testing::kFloat32Unit;
using testing::SumErrorBound;

constexpr double kU = kFloat32Unit;
constexpr double kBF16Unit = 0x1p-8;  // bf16 keeps 8 significant bits
constexpr double kDoubleUnit = 0x1p-53;

struct Inputs {
  int64_t n, c;
  std::vector<float> x, w, b, dout, plus, dw0, db0;
};

// A large mean (x in [2, 4]): the variance must not be lost to cancellation.
Inputs MakeInputs(int64_t n, int64_t c, uint32_t seed) {
  Inputs in{n, c};
  in.x = emulated::Random(n * c, seed, 2.0f, 4.0f);
  in.w = emulated::Random(c, seed + 1, -1.0f, 1.0f);
  in.b = emulated::Random(c, seed + 2, -1.0f, 1.0f);
  in.dout = emulated::Random(n * c, seed + 3, -1.0f, 1.0f);
  in.plus = emulated::Random(n * c, seed + 4, -1.0f, 1.0f);
  in.dw0 = emulated::Random(c, seed + 5, -1.0f, 1.0f);
  in.db0 = emulated::Random(c, seed + 6, -1.0f, 1.0f);
  return in;
}

// Forward error model. Both sides sum x and (x - mean)^2 in double (c terms,
// other orders: c 2^-53 of the magnitudes, far below a float ulp), so the
// float mean and rstd they round to are equal or one ulp apart (2 u of the
// value). out = (x - mean) rstd w + b then takes four float roundings on
// each side (the CPU's compiler may fuse the last two into an FMA), and the
// one-ulp differences of mean and rstd move it by |w| (2 u |mean| rstd +
// 2 u |xhat|). A BF16 output is that f32 result rounded once more (2^-8 of
// its magnitude).
void CheckForward(const Inputs& in, DType out_dtype) {
  SCOPED_TRACE(absl::StrCat("forward n ", in.n, " c ", in.c, " ", DTypeName(out_dtype)));
  const int64_t n = in.n, c = in.c;
  std::vector<float> out(n * c), mean(n), rstd(n);
  LayerNormForward(out.data(), mean.data(), rstd.data(), in.x.data(), in.w.data(), in.b.data(), n,
                   c);
  Buffer d_out(n * c, out_dtype);  // NaN: every element must be written
  std::vector<float> d_mean(n, NAN), d_rstd(n, NAN);
  ASSERT_TRUE(gpu::LayerNormForwardTo(d_out.get(), out_dtype, d_mean.data(), d_rstd.data(),
                                      in.x.data(), in.w.data(), in.b.data(), n, c, nullptr)
                  .ok());
  std::vector<double> want(n * c), tol(n * c), want_mean(n), tol_mean(n), want_rstd(n), tol_rstd(n);
  for (int64_t i = 0; i < n; ++i) {
    want_mean[i] = mean[i], tol_mean[i] = 2 * kU * std::fabs(mean[i]);
    want_rstd[i] = rstd[i], tol_rstd[i] = 2 * kU * rstd[i];
    for (int64_t j = 0; j < c; ++j) {
      const double xhat = (in.x[i * c + j] - mean[i]) * static_cast<double>(rstd[i]);
      const double y = out[i * c + j];
      double t = std::fabs(in.w[j]) * 2 * kU * (std::fabs(mean[i]) * rstd[i] + std::fabs(xhat)) +
                 2 * 4 * kU * (std::fabs(xhat * in.w[j]) + std::fabs(in.b[j]));
      if (out_dtype == DType::kBF16) t += kBF16Unit * (std::fabs(y) + t);
      want[i * c + j] = y;
      tol[i * c + j] = t;
    }
  }
  EXPECT_TRUE(emulated::WithinTolerances(d_mean, want_mean, tol_mean, "mean"));
  EXPECT_TRUE(emulated::WithinTolerances(d_rstd, want_rstd, tol_rstd, "rstd"));
  EXPECT_TRUE(emulated::WithinTolerances(d_out.Get(), want, tol, "out"));
}

// Backward error model, given the same mean and rstd. dx: xhat and
// g = dout w are the same floats on both sides; sum(g) and sum(g xhat) are
// double sums in other orders (2 c 2^-53 of the magnitudes apart), so
// their means, rounded to float, are one ulp apart at most (2 u). dx =
// rstd (g - mean(g) - xhat mean(g xhat)) (+ plus) takes five float roundings
// (six with plus) on each side, FMAs or not. dw and db: f32 sums of n
// products (or terms) and the starting value, in other orders (the device by
// row groups and chunks, the CPU row by row), each within gamma_(n+1) of
// exact, the products rounded or fused (one u more).
void CheckBackward(const Inputs& in, bool with_dx, bool with_plus) {
  SCOPED_TRACE(absl::StrCat("backward n ", in.n, " c ", in.c, with_dx ? " dx" : " no dx",
                            with_plus ? " + plus" : ""));
  const int64_t n = in.n, c = in.c;
  std::vector<float> out(n * c), mean(n), rstd(n), dx(n * c), dw = in.dw0, db = in.db0;
  LayerNormForward(out.data(), mean.data(), rstd.data(), in.x.data(), in.w.data(), in.b.data(), n,
                   c);
  LayerNormBackward(dx.data(), dw.data(), db.data(), in.dout.data(), in.x.data(), in.w.data(),
                    mean.data(), rstd.data(), n, c);
  Buffer d_dx(with_dx ? n * c : 0, DType::kF32);  // NaN: every element must be written
  std::vector<float> d_dw = in.dw0, d_db = in.db0;
  ASSERT_TRUE(gpu::LayerNormBackward(with_dx ? d_dx.f32() : nullptr, d_dw.data(), d_db.data(),
                                     in.dout.data(), in.x.data(), in.w.data(), mean.data(),
                                     rstd.data(), n, c, nullptr,
                                     with_plus ? in.plus.data() : nullptr)
                  .ok());
  EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
  if (with_dx) {
    std::vector<double> want(n * c), tol(n * c);
    for (int64_t i = 0; i < n; ++i) {
      double g_sum = 0, gx_sum = 0, g_abs = 0, gx_abs = 0;
      for (int64_t j = 0; j < c; ++j) {
        const double xhat = (in.x[i * c + j] - mean[i]) * rstd[i];
        const double g = in.dout[i * c + j] * in.w[j];
        g_sum += g, gx_sum += g * xhat, g_abs += std::fabs(g), gx_abs += std::fabs(g * xhat);
      }
      const double g_mean = g_sum / c, gx_mean = gx_sum / c;
      const double g_mean_err = 2 * kU * std::fabs(g_mean) + 4 * c * kDoubleUnit * g_abs / c;
      const double gx_mean_err = 2 * kU * std::fabs(gx_mean) + 4 * c * kDoubleUnit * gx_abs / c;
      for (int64_t j = 0; j < c; ++j) {
        const double xhat = (in.x[i * c + j] - mean[i]) * rstd[i];
        const double g = in.dout[i * c + j] * in.w[j];
        const double plus = with_plus ? in.plus[i * c + j] : 0.0;
        const double terms = std::fabs(g) + std::fabs(g_mean) + std::fabs(xhat * gx_mean);
        want[i * c + j] = static_cast<double>(dx[i * c + j]) + plus;
        tol[i * c + j] =
            rstd[i] * (2 * 5 * kU * terms + g_mean_err + std::fabs(xhat) * gx_mean_err) +
            2 * kU * (std::fabs(want[i * c + j]) + std::fabs(plus));
      }
    }
    EXPECT_TRUE(emulated::WithinTolerances(d_dx.Get(), want, tol, "dx"));
  }
  std::vector<double> want_dw(c), tol_dw(c), want_db(c), tol_db(c);
  for (int64_t j = 0; j < c; ++j) {
    double dw_abs = std::fabs(in.dw0[j]), db_abs = std::fabs(in.db0[j]);
    for (int64_t i = 0; i < n; ++i) {
      const double xhat = (in.x[i * c + j] - mean[i]) * rstd[i];
      dw_abs += std::fabs(in.dout[i * c + j] * xhat);
      db_abs += std::fabs(in.dout[i * c + j]);
    }
    want_dw[j] = dw[j], tol_dw[j] = 2 * SumErrorBound(n + 2) * dw_abs;
    want_db[j] = db[j], tol_db[j] = 2 * SumErrorBound(n + 1) * db_abs;
  }
  EXPECT_TRUE(emulated::WithinTolerances(d_dw, want_dw, tol_dw, "dw"));
  EXPECT_TRUE(emulated::WithinTolerances(d_db, want_db, tol_db, "db"));
}

// c 769: not a multiple of 32 (lanes per row, columns per block); c 33: one
// lane with two features; c 1: fewer features than lanes. n 5 and 3: one
// block, part idle; n 9 and 19: a second and a third block, part idle.
TEST(LayerNormEmulatedTest, Forward) {
  for (const auto& [n, c] :
       {std::pair<int64_t, int64_t>{5, 769}, {9, 33}, {3, 1}, {19, 100}}) {
    const Inputs in = MakeInputs(n, c, static_cast<uint32_t>(n * 1000 + c));
    CheckForward(in, DType::kF32);
    CheckForward(in, DType::kBF16);
  }
}

TEST(LayerNormEmulatedTest, BackwardDxAndSkipPath) {
  const Inputs in = MakeInputs(6, 769, 21);
  CheckBackward(in, /*with_dx=*/true, /*with_plus=*/false);
  CheckBackward(in, /*with_dx=*/true, /*with_plus=*/true);
  const Inputs small = MakeInputs(4, 33, 22);
  CheckBackward(small, /*with_dx=*/true, /*with_plus=*/true);
  const Inputs blocks = MakeInputs(19, 100, 24);  // three blocks of 8 rows, the last part idle
  CheckBackward(blocks, /*with_dx=*/true, /*with_plus=*/true);
}

// The parameter gradients' two stages: n 600 rows are chunks of 256, 256 and
// 88; n 256 exactly one chunk; n 257 one row into a second; c 45 is one full
// and one partial column block.
TEST(LayerNormEmulatedTest, ParameterGradientsOverRowChunks) {
  for (const auto& [n, c] : {std::pair<int64_t, int64_t>{600, 45}, {256, 40}, {257, 33}}) {
    CheckBackward(MakeInputs(n, c, static_cast<uint32_t>(n + c)), /*with_dx=*/false, false);
  }
}

// n = 0 or c = 0 launch nothing (a zero grid is a launch error); bad
// arguments are errors before any launch.
TEST(LayerNormEmulatedTest, EmptyAndBadArguments) {
  const int64_t launches = cuda_emulation::Launcher::g_launches;
  float f = 0;
  EXPECT_TRUE(gpu::LayerNormForwardTo(nullptr, DType::kF32, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, 0, 8, nullptr)
                  .ok());
  EXPECT_TRUE(gpu::LayerNormBackward(&f, &f, &f, &f, &f, &f, &f, &f, 4, 0, nullptr).ok());
  EXPECT_EQ(gpu::LayerNormForwardTo(&f, DType::kF32, &f, &f, &f, &f, &f, 1, 0, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::LayerNormForwardTo(&f, DType::kF16, &f, &f, &f, &f, &f, 1, 1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::LayerNormBackward(&f, &f, &f, &f, &f, &f, &f, &f, 1, 1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // dx aliases dout
  EXPECT_EQ(cuda_emulation::Launcher::g_launches, launches);
}

// The backward's error paths: a failed scratch allocation is
// RESOURCE_EXHAUSTED naming the bytes; a failed launch (dx, the partial sums,
// their total) is reported and the scratch freed.
TEST(LayerNormEmulatedTest, AllocationAndLaunchFailures) {
  const Inputs in = MakeInputs(3, 40, 23);
  std::vector<float> out(3 * 40), mean(3), rstd(3), dx(3 * 40), dw(40), db(40);
  LayerNormForward(out.data(), mean.data(), rstd.data(), in.x.data(), in.w.data(), in.b.data(), 3,
                   40);
  auto backward = [&] {
    return gpu::LayerNormBackward(dx.data(), dw.data(), db.data(), in.dout.data(), in.x.data(),
                                  in.w.data(), mean.data(), rstd.data(), 3, 40, nullptr);
  };
  cuda_emulation::g_fail_allocations = 1;
  absl::Status s = backward();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("320 bytes of scratch"), std::string::npos) << s;
  for (int k : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("launch ", k, " fails"));
    cuda_emulation::g_launches_until_failure = k;
    s = backward();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("LayerNormBackward: kernel launch"), std::string::npos) << s;
    EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
    EXPECT_EQ(cuda_emulation::g_launches_until_failure, 0);
  }
}

}  // namespace
}  // namespace zeroshard
