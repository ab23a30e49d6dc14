// The fused classifier's kernels (worker/cuda/classifier.cu) run on the CPU
// under the thread-per-CUDA-thread emulation (emulation/cuda_emulation.h),
// through their own host code (ClassifierForward / ClassifierBackward, whose
// <<<...>>> launches the test genrule turns into emulated ones), against
// layers.h's CrossEntropyForward / CrossEntropyBackward: f32 and bf16 logits,
// rows at every alignment the 16-byte vector split can meet (the logits
// placed 0 or 1 element past a 256-byte boundary, and strides ld that are not
// multiples of the vector), padding that is NaN (a read of it makes the row
// NaN), unscored rows, a gradient buffer aligned unlike the logits (the
// backward's element-by-element path), in place. A vector load from a
// misaligned address aborts (the test builds with -fsanitize=alignment), as
// the GPU faults. Not covered: the hardware's expf / logf (host libm here;
// the error model allows 2 u for expf either way) and speed.
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
#include "tests/testing/classifier_error_model.h"
#include "tests/worker/cuda/classifier.cu.inc"
#include "tests/worker/cuda/emulated_test_util.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using emulated::Buffer;
using testing::Bf16StoredTolerance;
using testing::ClassifierGradientTolerance;
using testing::ClassifierLseTolerance;
using testing::ClassifierSumRelative;
using testing::CrossEntropySumRelative;

// The error model: tests/testing/classifier_error_model.h, for the kernel's
// 256 threads per row and 16-byte vectors (4 f32 or 8 bf16 logits).
constexpr int kThreadsPerRow = 256;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Case {
  int64_t n = 7, v = 1000, ld = 0;  // ld 0: packed (v)
  DType dtype = DType::kF32;
  float range = 4.0f;      // logits uniform in [-range, range]
  size_t offset = 0;       // the logits' first element past a 256-byte boundary
  bool in_place = false;   // dlogits over the logits
  size_t grad_offset = 0;  // out of place: the gradient's offset
  int unscored_every = 5;  // rows 3, 3 + k, ... unscored (0: none)
  int64_t Ld() const { return ld == 0 ? v : ld; }
};

std::string Describe(const Case& c) {
  return absl::StrCat("n ", c.n, " v ", c.v, " ld ", c.Ld(), " ", DTypeName(c.dtype), " range ",
                      c.range, " offset ", c.offset,
                      c.in_place ? " in place" : absl::StrCat(" grad offset ", c.grad_offset));
}

std::vector<int32_t> Targets(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(c.v - 1));
  std::vector<int32_t> t(c.n);
  for (int32_t& x : t) x = dist(rng);
  if (c.unscored_every > 0) {
    for (int64_t i = 3; i < c.n; i += c.unscored_every) t[i] = kUnscoredTarget;
  }
  return t;
}

std::vector<float> PadRows(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(rows * ld, kNaN);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(m.begin() + i * cols, m.begin() + (i + 1) * cols, out.begin() + i * ld);
  }
  return out;
}

void CheckClassifier(const Case& c, uint32_t seed) {
  SCOPED_TRACE(Describe(c));
  const int64_t n = c.n, v = c.v, ld = c.Ld();
  const std::vector<float> logits =
      emulated::RoundTo(emulated::Random(n * v, seed, -c.range, c.range), c.dtype);
  const std::vector<int32_t> targets = Targets(c, seed + 1);
  std::vector<float> probs(n * v), want_grad(n * v);
  const double want_loss = CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v);
  CrossEntropyBackward(want_grad.data(), probs.data(), targets.data(), n, v);

  Buffer d_logits(PadRows(logits, n, v, ld), c.dtype, c.offset);
  Buffer d_grad(c.in_place ? 0 : n * ld, c.dtype, c.grad_offset);  // all NaN
  std::vector<float> lse(n, kNaN);
  double loss = kNaN;
  ASSERT_TRUE(gpu::ClassifierForward(&loss, lse.data(), d_logits.get(), targets.data(), n, v, ld,
                                     c.dtype, nullptr)
                  .ok());
  // The forward reads no padding: it is still NaN, and no row is NaN.
  const std::vector<float> after_forward = d_logits.Get();
  void* grad_ptr = c.in_place ? d_logits.get() : d_grad.get();
  ASSERT_TRUE(gpu::ClassifierBackward(grad_ptr, d_logits.get(), lse.data(), targets.data(), n, v,
                                      ld, c.dtype, nullptr)
                  .ok());
  EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
  const std::vector<float> grad_padded = c.in_place ? d_logits.Get() : d_grad.Get();

  const double gap = 2.0 * c.range;
  const double sum_err =
      ClassifierSumRelative(v, kThreadsPerRow, c.dtype == DType::kF32 ? 4 : 8, gap);
  // The loss: log s off by both sums' relative errors; the rest is double.
  EXPECT_NEAR(loss, want_loss,
              sum_err + CrossEntropySumRelative(gap) + 1e-12 * std::fabs(want_loss));
  int64_t scored = 0;
  for (int32_t t : targets) scored += t != kUnscoredTarget;
  const double inv = scored == 0 ? 0.0 : 1.0 / scored;
  std::vector<float> grad(n * v);
  std::vector<double> want(n * v), tol(n * v);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = v; j < ld; ++j) {
      ASSERT_TRUE(std::isnan(after_forward[i * ld + j])) << "padding written by the forward";
      ASSERT_EQ(grad_padded[i * ld + j], 0.0f) << "gradient padding, row " << i << " col " << j;
    }
    std::copy(grad_padded.begin() + i * ld, grad_padded.begin() + i * ld + v, grad.begin() + i * v);
    const float* z = logits.data() + i * v;
    if (targets[i] == kUnscoredTarget) {
      EXPECT_EQ(lse[i], 0.0f) << "row " << i;
      for (int64_t j = 0; j < v; ++j) want[i * v + j] = 0, tol[i * v + j] = 0;  // exactly 0
      continue;
    }
    const double m = *std::max_element(z, z + v);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(static_cast<double>(z[j]) - m);
    const double want_lse = m + std::log(s);
    const double lse_err = ClassifierLseTolerance(sum_err, want_lse, m);
    EXPECT_NEAR(lse[i], want_lse, lse_err) << "row " << i;
    for (int64_t j = 0; j < v; ++j) {
      const double w = want_grad[i * v + j];
      const double t = ClassifierGradientTolerance(z[j], want_lse, m, inv, lse_err);
      want[i * v + j] = w;
      tol[i * v + j] = c.dtype == DType::kBF16 ? Bf16StoredTolerance(w, t) : t;
    }
  }
  EXPECT_TRUE(emulated::WithinTolerances(grad, want, tol, "dlogits"));
}

// V 1000 (a multiple of both vectors), 777 and 1003 (of neither: a tail),
// 1 (a head or tail only); the logits 0 or 1 element past a 256-byte boundary
// (the head empty, or 3 f32 / 7 bf16 logits).
TEST(ClassifierEmulatedTest, PackedRows) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (size_t offset : {0, 1}) {
      CheckClassifier({.n = 7, .v = 1000, .dtype = dtype, .offset = offset}, 1);
      CheckClassifier({.n = 5, .v = 777, .dtype = dtype, .offset = offset, .in_place = true}, 2);
      CheckClassifier({.n = 6, .v = 1003, .dtype = dtype, .offset = offset}, 3);
      CheckClassifier({.n = 5, .v = 1, .dtype = dtype, .offset = offset}, 4);
    }
  }
}

// Rows padded with NaN: ld a multiple of 64 (every row split alike), ld 1003
// (each row at another alignment), v 1 in rows of 64.
TEST(ClassifierEmulatedTest, PaddedRows) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckClassifier({.n = 7, .v = 1000, .ld = 1024, .dtype = dtype}, 5);
    CheckClassifier({.n = 7, .v = 1000, .ld = 1003, .dtype = dtype, .offset = 1, .in_place = true},
                    6);
    CheckClassifier({.n = 5, .v = 1, .ld = 64, .dtype = dtype}, 7);
    CheckClassifier({.n = 6, .v = 777, .ld = 832, .dtype = dtype, .offset = 1}, 8);
  }
}

// A gradient buffer aligned unlike the logits: the backward's
// element-by-element path (and its padding zeros).
TEST(ClassifierEmulatedTest, GradientAlignedUnlikeLogits) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckClassifier({.n = 5, .v = 777, .dtype = dtype, .offset = 0, .grad_offset = 1}, 9);
    CheckClassifier({.n = 5, .v = 1000, .ld = 1003, .dtype = dtype, .offset = 1, .grad_offset = 2},
                    10);
  }
}

// Logits of +-1e4: the running max must keep every e^(z - m) finite.
TEST(ClassifierEmulatedTest, LargeLogits) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CheckClassifier({.n = 6, .v = 777, .dtype = dtype, .range = 1e4f, .offset = 1}, 11);
    CheckClassifier(
        {.n = 6, .v = 1000, .ld = 1024, .dtype = dtype, .range = 1e4f, .in_place = true}, 12);
  }
}

// GPT-2's vocabulary, packed (V 50257: each row at another alignment) and in
// the device GPT's padded rows (ld 50304).
TEST(ClassifierEmulatedTest, Gpt2Vocabulary) {
  CheckClassifier({.n = 4,
                   .v = 50257,
                   .dtype = DType::kF32,
                   .range = 8.0f,
                   .offset = 1,
                   .in_place = true,
                   .unscored_every = 2},
                  16);
  CheckClassifier({.n = 4,
                   .v = 50257,
                   .ld = 50304,
                   .dtype = DType::kBF16,
                   .range = 8.0f,
                   .in_place = true,
                   .unscored_every = 2},
                  17);
}

TEST(ClassifierEmulatedTest, EveryRowScored) {
  CheckClassifier({.n = 4, .v = 1000, .unscored_every = 0}, 13);
}

// Nothing scored: loss 0, lse 0, the whole gradient 0 (padding included).
TEST(ClassifierEmulatedTest, NoRowScored) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const int64_t n = 4, v = 100, ld = 128;
    const std::vector<int32_t> targets(n, kUnscoredTarget);
    Buffer logits(PadRows(emulated::Random(n * v, 14, -4, 4), n, v, ld), dtype);
    std::vector<float> lse(n, kNaN);
    double loss = kNaN;
    ASSERT_TRUE(gpu::ClassifierForward(&loss, lse.data(), logits.get(), targets.data(), n, v, ld,
                                       dtype, nullptr)
                    .ok());
    EXPECT_EQ(loss, 0.0);
    for (float x : lse) EXPECT_EQ(x, 0.0f);
    ASSERT_TRUE(gpu::ClassifierBackward(logits.get(), logits.get(), lse.data(), targets.data(), n,
                                        v, ld, dtype, nullptr)
                    .ok());
    for (float g : logits.Get()) ASSERT_EQ(g, 0.0f);
  }
}

// A target outside [0, V) (other than kUnscoredTarget) makes the loss NaN;
// the other rows' lse stay finite.
TEST(ClassifierEmulatedTest, BadTargetIsNaN) {
  for (int32_t bad : {100, -2}) {
    const int64_t n = 4, v = 100;
    const std::vector<int32_t> targets = {1, bad, kUnscoredTarget, 5};
    Buffer logits(emulated::Random(n * v, 15, -4, 4), DType::kF32);
    std::vector<float> lse(n, kNaN);
    double loss = 0;
    ASSERT_TRUE(gpu::ClassifierForward(&loss, lse.data(), logits.get(), targets.data(), n, v,
                                       DType::kF32, nullptr)
                    .ok());
    EXPECT_TRUE(std::isnan(loss)) << "target " << bad;
    EXPECT_TRUE(std::isfinite(lse[0]) && std::isfinite(lse[1]) && std::isfinite(lse[3]));
  }
}

// n = 0: the loss is 0 and nothing is launched (a zero grid is a launch
// error); bad arguments are errors before any launch.
TEST(ClassifierEmulatedTest, EmptyAndBadArguments) {
  const int64_t launches = cuda_emulation::Launcher::g_launches;
  double loss = kNaN;
  ASSERT_TRUE(
      gpu::ClassifierForward(&loss, nullptr, nullptr, nullptr, 0, 10, DType::kF32, nullptr).ok());
  EXPECT_EQ(loss, 0.0);
  EXPECT_TRUE(
      gpu::ClassifierBackward(nullptr, nullptr, nullptr, nullptr, 0, 10, DType::kF32, nullptr)
          .ok());
  EXPECT_EQ(cuda_emulation::Launcher::g_launches, launches);
  float lse = 0;
  float z = 0;
  int32_t t = 0;
  EXPECT_EQ(gpu::ClassifierForward(&loss, &lse, &z, &t, 1, 2, 1, DType::kF32, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // ld < v
  EXPECT_EQ(gpu::ClassifierForward(&loss, &lse, &z, &t, 1, 1, DType::kF16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_emulation::Launcher::g_launches, launches);
}

// The host code's error paths: a failed scratch allocation is
// RESOURCE_EXHAUSTED naming the bytes, with nothing launched; a failed launch
// is reported and the scratch still freed.
TEST(ClassifierEmulatedTest, AllocationAndLaunchFailures) {
  const int64_t n = 3, v = 100;
  const std::vector<int32_t> targets = {1, 2, 3};
  Buffer logits(emulated::Random(n * v, 18, -4, 4), DType::kF32);
  std::vector<float> lse(n, kNaN);
  double loss = kNaN;
  const int64_t launches = cuda_emulation::Launcher::g_launches;
  cuda_emulation::g_fail_allocations = 1;
  absl::Status s = gpu::ClassifierForward(&loss, lse.data(), logits.get(), targets.data(), n, v,
                                          DType::kF32, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("24 bytes of row losses"), std::string::npos) << s;
  cuda_emulation::g_fail_allocations = 1;
  s = gpu::ClassifierBackward(logits.get(), logits.get(), lse.data(), targets.data(), n, v,
                              DType::kF32, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(cuda_emulation::Launcher::g_launches, launches);

  // Forward: the row kernel, then the mean; backward: the count, then the
  // rows.
  for (int k : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("launch ", k, " fails"));
    cuda_emulation::g_launches_until_failure = k;
    s = gpu::ClassifierForward(&loss, lse.data(), logits.get(), targets.data(), n, v, DType::kF32,
                               nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("ClassifierForward: kernel launch"), std::string::npos) << s;
    EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
    cuda_emulation::g_launches_until_failure = k;
    s = gpu::ClassifierBackward(logits.get(), logits.get(), lse.data(), targets.data(), n, v,
                                DType::kF32, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("ClassifierBackward: kernel launch"), std::string::npos) << s;
    EXPECT_EQ(cuda_emulation::LiveAllocations(), 0) << "scratch not freed";
    EXPECT_EQ(cuda_emulation::g_launches_until_failure, 0);
  }
}

}  // namespace
}  // namespace zeroshard
