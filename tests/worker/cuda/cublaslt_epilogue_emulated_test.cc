// CublasLtLinear's unfused fallback kernels (worker/cuda/cublaslt_epilogue.cu)
// run on the CPU under the thread-per-CUDA-thread emulation
// (emulation/cuda_emulation.h), through their own host code: GELU forward and
// backward against layers.h's GeluTanhForward / GeluTanhBackward, the bias
// added to rows ld apart and the deterministic column sums against plain
// loops, F32 and BF16. Padding is NaN: never read, never written. Not
// covered: the hardware's tanhf (host libm here) and speed.
#include <cuda_runtime.h>  // the emulation's (tests/worker/cuda/emulation)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/cuda/cublaslt_epilogue.cu.inc"
#include "tests/worker/cuda/emulated_test_util.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using emulated::Buffer;
using testing::kFloat32Unit;
using testing::SumErrorBound;

constexpr double kU = kFloat32Unit;
constexpr double kBF16Unit = 0x1p-8;  // bf16 keeps 8 significant bits

// GELU error model (tests/worker/model/layers_test.cc's element model): each
// side is within 16 u max(1, |y|) of the real tanh-GELU (a polynomial, tanhf
// or FastExp, a few products), so they are 32 u apart. The slope has twice
// the operations, and its 1 - t^2 cancels where t -> 1: tanh's absolute
// error (<= 4 u) doubled and amplified by 0.5 |x| sqrt(2/pi) (1 + 3 *
// 0.044715 x^2); on each side. A BF16 result is the f32 one rounded once
// more (2^-8 of its magnitude); the inputs are the same bf16 values on both
// sides.
double ValueTolerance(double y) { return 2 * 16 * kU * std::max(1.0, std::fabs(y)); }
double SlopeTolerance(double x, double slope) {
  const double amplification =
      0.5 * std::fabs(x) * std::sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * x * x);
  return 2 * (2 * 16 * kU * std::max(1.0, std::fabs(slope)) + amplification * 8 * kU);
}

void CheckGelu(int64_t n, DType dtype, size_t offset) {
  SCOPED_TRACE(absl::StrCat("gelu n ", n, " ", DTypeName(dtype), " offset ", offset));
  const std::vector<float> pre = emulated::RoundTo(emulated::Random(n, 31, -6.0f, 6.0f), dtype);
  const std::vector<float> dy = emulated::RoundTo(emulated::Random(n, 32, -2.0f, 2.0f), dtype);
  std::vector<float> y(n), ones(n, 1.0f), slope(n), dx(n);
  GeluTanhForward(y.data(), pre.data(), n);
  GeluTanhBackward(slope.data(), ones.data(), pre.data(), n);
  GeluTanhBackward(dx.data(), dy.data(), pre.data(), n);

  Buffer d_pre(pre, dtype, offset), d_y(n, dtype, offset + 1), d_d(dy, dtype);
  ASSERT_TRUE(gpu::internal::LtGeluTanhForward(d_y.get(), d_pre.get(), n, dtype, nullptr).ok());
  ASSERT_TRUE(
      gpu::internal::LtGeluTanhBackwardInPlace(d_d.get(), d_pre.get(), n, dtype, nullptr).ok());
  std::vector<double> want_y(n), tol_y(n), want_dx(n), tol_dx(n);
  for (int64_t i = 0; i < n; ++i) {
    want_y[i] = y[i];
    tol_y[i] = ValueTolerance(y[i]);
    // dx = dy slope: the slope's error times |dy|, and the product's rounding
    // on each side.
    want_dx[i] = dx[i];
    tol_dx[i] = std::fabs(dy[i]) * SlopeTolerance(pre[i], slope[i]) + 2 * kU * std::fabs(dx[i]);
    if (dtype == DType::kBF16) {
      tol_y[i] += kBF16Unit * (std::fabs(y[i]) + tol_y[i]);
      tol_dx[i] += kBF16Unit * (std::fabs(dx[i]) + tol_dx[i]);
    }
  }
  EXPECT_TRUE(emulated::WithinTolerances(d_y.Get(), want_y, tol_y, "gelu y"));
  EXPECT_TRUE(emulated::WithinTolerances(d_d.Get(), want_dx, tol_dx, "gelu dx"));
}

// n below one block, not a multiple of 256, over several blocks.
TEST(CublasLtEpilogueEmulatedTest, Gelu) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckGelu(1, dtype, 0);
    CheckGelu(1000, dtype, 1);
    CheckGelu(3 * 256 + 5, dtype, 0);
  }
}

// y [rows, cols] in rows ld apart, padding NaN; b [cols].
void CheckBiasAdd(int64_t rows, int64_t cols, int64_t ld, DType dtype) {
  SCOPED_TRACE(
      absl::StrCat("bias add rows ", rows, " cols ", cols, " ld ", ld, " ", DTypeName(dtype)));
  std::vector<float> y(rows * ld, NAN);
  const std::vector<float> packed =
      emulated::RoundTo(emulated::Random(rows * cols, 33, -2, 2), dtype);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(packed.begin() + i * cols, packed.begin() + (i + 1) * cols, y.begin() + i * ld);
  }
  const std::vector<float> b = emulated::RoundTo(emulated::Random(cols, 34, -1, 1), dtype);
  Buffer d_y(y, dtype), d_b(b, dtype);
  ASSERT_TRUE(
      gpu::internal::LtBiasAddRows(d_y.get(), d_b.get(), rows, cols, ld, dtype, nullptr).ok());
  const std::vector<float> got = d_y.Get();
  // One f32 addition, then (BF16) one rounding, as common/dtype.h's
  // FloatToBF16: the same bits as the plain loop.
  int64_t bad = 0, padding = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < ld; ++j) {
      const float g = got[i * ld + j];
      if (j >= cols) {
        padding += !std::isnan(g);
        continue;
      }
      float want = y[i * ld + j] + b[j];
      if (dtype == DType::kBF16) want = BF16ToFloat(FloatToBF16(want));
      bad += std::memcmp(&g, &want, sizeof(float)) != 0;
    }
  }
  EXPECT_EQ(bad, 0) << "elements not y + b";
  EXPECT_EQ(padding, 0) << "padding written";
}

TEST(CublasLtEpilogueEmulatedTest, BiasAddRows) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckBiasAdd(7, 45, 45, dtype);
    CheckBiasAdd(7, 45, 64, dtype);
    CheckBiasAdd(300, 3, 8, dtype);  // more elements than one block
  }
}

// sums[j] += sum over rows of x[i, j], x in rows ld apart (padding NaN: a
// read of it makes the column NaN). Error model: an f32 sum of rows + 1
// terms (the starting value too) in any order is within gamma_(rows + 1) of
// exact (the reference is exact in double), and rounding the double to
// float u. Deterministic: a second run gives the same bits.
void CheckColumnSums(int64_t rows, int64_t cols, int64_t ld, DType dtype) {
  SCOPED_TRACE(
      absl::StrCat("column sums rows ", rows, " cols ", cols, " ld ", ld, " ", DTypeName(dtype)));
  std::vector<float> x(rows * ld, NAN);
  const std::vector<float> packed =
      emulated::RoundTo(emulated::Random(rows * cols, 35, -2, 2), dtype);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(packed.begin() + i * cols, packed.begin() + (i + 1) * cols, x.begin() + i * ld);
  }
  const std::vector<float> sums0 = emulated::Random(cols, 36, -1, 1);
  Buffer d_x(x, dtype);
  std::vector<float> sums = sums0, again = sums0;
  ASSERT_TRUE(
      gpu::internal::LtColumnSumsAdd(sums.data(), d_x.get(), rows, cols, ld, dtype, nullptr).ok());
  ASSERT_TRUE(
      gpu::internal::LtColumnSumsAdd(again.data(), d_x.get(), rows, cols, ld, dtype, nullptr).ok());
  EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
  std::vector<double> want(cols), tol(cols);
  for (int64_t j = 0; j < cols; ++j) {
    double s = sums0[j], mag = std::fabs(sums0[j]);
    for (int64_t i = 0; i < rows; ++i) s += x[i * ld + j], mag += std::fabs(x[i * ld + j]);
    want[j] = s;
    tol[j] = SumErrorBound(rows + 1) * mag + kU * std::fabs(s);
  }
  EXPECT_TRUE(emulated::WithinTolerances(sums, want, tol, "column sums"));
  EXPECT_EQ(std::memcmp(sums.data(), again.data(), cols * sizeof(float)), 0) << "not deterministic";
}

// Rows: under one chunk (256), several chunks with a partial last one, and
// more than 128 chunks' worth (33000 rows: the chunks are capped at 128 of
// 258 rows); cols not a multiple of the 32-column blocks; ld packed and
// padded.
TEST(CublasLtEpilogueEmulatedTest, ColumnSums) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckColumnSums(5, 45, 45, dtype);
    CheckColumnSums(600, 45, 64, dtype);
    CheckColumnSums(257, 1, 8, dtype);
  }
  CheckColumnSums(33000, 3, 4, DType::kF32);
}

// Empty shapes launch nothing; bad arguments are errors before any launch.
TEST(CublasLtEpilogueEmulatedTest, EmptyAndBadArguments) {
  const int64_t launches = cuda_emulation::Launcher::g_launches;
  float f = 0;
  EXPECT_TRUE(gpu::internal::LtGeluTanhForward(&f, &f, 0, DType::kF32, nullptr).ok());
  EXPECT_TRUE(gpu::internal::LtColumnSumsAdd(&f, &f, 0, 4, 4, DType::kF32, nullptr).ok());
  EXPECT_EQ(gpu::internal::LtBiasAddRows(&f, &f, 2, 4, 3, DType::kF32, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // ld < cols
  EXPECT_EQ(gpu::internal::LtColumnSumsAdd(&f, &f, 2, 4, 3, DType::kF32, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::internal::LtGeluTanhForward(&f, &f, 1, DType::kF16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_emulation::Launcher::g_launches, launches);
}

// The column sums' error paths: a failed scratch allocation is
// RESOURCE_EXHAUSTED naming the bytes; a failed launch (either pass) is
// reported and the scratch freed.
TEST(CublasLtEpilogueEmulatedTest, ColumnSumsAllocationAndLaunchFailures) {
  const std::vector<float> x = emulated::Random(10 * 4, 37, -1, 1);
  std::vector<float> sums(4, 0.0f);
  auto column_sums = [&] {
    return gpu::internal::LtColumnSumsAdd(sums.data(), x.data(), 10, 4, 4, DType::kF32, nullptr);
  };
  cuda_emulation::g_fail_allocations = 1;
  absl::Status s = column_sums();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("16 bytes of partial sums"), std::string::npos) << s;
  for (int k : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("launch ", k, " fails"));
    cuda_emulation::g_launches_until_failure = k;
    s = column_sums();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("LtColumnSumsAdd: kernel launch"), std::string::npos) << s;
    EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
    EXPECT_EQ(cuda_emulation::g_launches_until_failure, 0);
  }
}

}  // namespace
}  // namespace zeroshard
