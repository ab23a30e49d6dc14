// Error model of the fused classifier (worker/cuda/classifier.h, its host
// twin worker/model/classifier_chunked.h) against layers.h's
// CrossEntropyForward / CrossEntropyBackward: one model for the host twin's
// test, the kernels' CPU emulation test and the GPU parity check. Built on
// error_model.h's gamma_n.
#ifndef ZEROSHARD_TESTS_TESTING_CLASSIFIER_ERROR_MODEL_H_
#define ZEROSHARD_TESTS_TESTING_CLASSIFIER_ERROR_MODEL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tests/testing/error_model.h"

namespace zeroshard::testing {

// bf16 keeps 8 significant bits: round to nearest is within 2^-8 |x| (1 + 2^-8
// lies halfway between 1 and 1 + 2^-7).
inline constexpr double kBF16Unit = 0x1p-8;

// A row's softmax sum s = sum_j e^(z_j - m), relative to s, when `lanes`
// lanes (threads) each take vectors of `vector` logits. One term z_j passes
// through: the subtraction z_j - m, rounded (u |z_j - m| relative once
// exponentiated; terms with z_j - m < -88 are below 1e-38 s and count for
// nothing, so the gap, max z - min z, is capped there), expf (<= 2 u for
// glibc and CUDA's expf), the additions inside its vector (<= vector), in
// its lane one rescale per later step (expf of the max difference and a
// multiply, 3 u) and one addition per step (the vectors, and the head and
// tail logits: two steps more), then the combination of the lanes (a rescale,
// 3 u, and an addition per lane; in a tree or in lane order). The sum of
// those counts, as one gamma.
inline double ClassifierSumRelative(int64_t v, int lanes, int vector, double gap) {
  const int64_t per_step = static_cast<int64_t>(lanes) * vector;
  const int64_t steps = (v + per_step - 1) / per_step;
  const double roundings = std::min(gap, 88.0) + 2 + vector + 4.0 * (steps + 2) + 4.0 * lanes;
  return SumErrorBound(static_cast<int64_t>(std::ceil(roundings)));
}

// CrossEntropyForward's sum: double, of FastExp (<= 2 u) of the rounded
// z - max: within (2 + gap) u, relative.
inline double CrossEntropySumRelative(double gap) {
  return (2 + std::min(gap, 88.0)) * kFloat32Unit;
}

// lse = m + logf(s) in f32 against the exact value: the sum's relative error
// (sum_relative), logf and the final addition (u of |log s| and u of |lse|,
// |log s| <= |lse| + |m|), and one u more.
inline double ClassifierLseTolerance(double sum_relative, double lse, double m) {
  return sum_relative + kFloat32Unit * (2 * std::fabs(lse) + std::fabs(m)) + kFloat32Unit;
}

// One gradient element (e^(z - lse) - [j == target]) inv against
// CrossEntropyBackward's: p = e^(z - lse) off by lse's error, the rounding of
// z - lse and of z - max (u per unit of each gap), expf / FastExp (2 u each)
// and about six multiplies / divisions / subtractions between both sides; the
// target's subtraction of inv rounds once more on each side. An element that
// underflows on one side (below 1e-37) is absolute. lse is the exact value,
// m the row's max.
inline double ClassifierGradientTolerance(double z, double lse, double m, double inv,
                                          double lse_tolerance) {
  const double p = std::exp(z - lse);
  const double gaps = std::min(std::fabs(z - lse), 88.0) + std::min(m - z, 88.0);
  return p * inv * (lse_tolerance + kFloat32Unit * (gaps + 10)) + 4 * kFloat32Unit * inv + 1e-37;
}

// A gradient stored in bf16: the f32 result, within `tolerance` of `want`,
// rounded once more.
inline double Bf16StoredTolerance(double want, double tolerance) {
  return tolerance + kBF16Unit * (std::fabs(want) + tolerance) + 1e-38;
}

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_CLASSIFIER_ERROR_MODEL_H_
