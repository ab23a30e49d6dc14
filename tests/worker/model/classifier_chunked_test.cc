// The fused classifier's algorithm (worker/model/classifier_chunked.h, the
// host twin of worker/cuda/classifier.cu) against layers.h's two-pass
// cross-entropy and against float64 definitions.
#include "worker/model/classifier_chunked.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/model/test_util.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using ::zeroshard::testing::kFloat32Unit;
using ::zeroshard::testing::RandomVector;
using ::zeroshard::testing::SumErrorBound;

// Error model of a row's softmax sum s = sum_j e^(z_j - m), relative to s.
// One term z_j passes through: the subtraction z_j - m, rounded (u |z_j - m|
// relative once exponentiated; terms with z_j - m < -88 are below 1e-38 s and
// count for nothing, so the gap is capped there), expf (<= 2 u for glibc and
// CUDA's expf), the additions inside its vector (<= vector), in its lane one
// rescale per later step (expf of the max difference and a multiply, 3 u)
// and one addition per step (the vectors, and the head and tail logits: two
// steps more), then the combination of the lanes (a
// rescale, 3 u, and an addition per lane). The sum of those counts, as one
// gamma (tests/testing/error_model.h).
double SumRelativeError(int64_t v, const ClassifierChunking& c, double gap) {
  const int64_t steps = (v + static_cast<int64_t>(c.lanes) * c.vector - 1) /
                        (static_cast<int64_t>(c.lanes) * c.vector);
  const double roundings = std::min(gap, 88.0) + 2 + c.vector + 4.0 * (steps + 2) + 4.0 * c.lanes;
  return SumErrorBound(static_cast<int64_t>(std::ceil(roundings)));
}

// layers.h's CrossEntropyForward sums in double after FastExp (<= 2 u) of the
// rounded z - max: its sum is within (2 + gap) u, relative.
double CpuSumRelativeError(double gap) { return (2 + std::min(gap, 88.0)) * kFloat32Unit; }

struct Case {
  int64_t n = 0, v = 0;
  std::vector<float> logits;
  std::vector<int32_t> targets;
  float low = 0, high = 0;  // the logits' range: gap <= high - low
  double Gap() const { return static_cast<double>(high) - low; }
};

Case RandomCase(int64_t n, int64_t v, float low, float high, uint32_t seed) {
  Case c;
  c.n = n;
  c.v = v;
  c.low = low;
  c.high = high;
  c.logits = RandomVector(n * v, low, high, seed);
  c.targets.resize(n);
  for (int64_t i = 0; i < n; ++i) c.targets[i] = static_cast<int32_t>((i * 7919 + seed) % v);
  return c;
}

// log sum_j e^(z_j), in double.
double LseReference(const float* z, int64_t v) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < v; ++j) m = std::max<double>(m, z[j]);
  double s = 0;
  for (int64_t j = 0; j < v; ++j) s += std::exp(z[j] - m);
  return m + std::log(s);
}

// Runs both algorithms and compares loss, lse and gradient within the error
// models above.
void ExpectMatchesCpu(const Case& c, const ClassifierChunking& chunking, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t n = c.n, v = c.v;
  std::vector<float> probs(n * v), cpu_grad(n * v);
  const double cpu_loss =
      CrossEntropyForward(probs.data(), c.logits.data(), c.targets.data(), n, v);
  CrossEntropyBackward(cpu_grad.data(), probs.data(), c.targets.data(), n, v);

  std::vector<float> lse(n, -1.0f), grad(n * v, 7.0f);
  const double loss =
      ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), n, v, chunking);
  ChunkedClassifierBackward(grad.data(), c.logits.data(), lse.data(), c.targets.data(), n, v);

  const double u = kFloat32Unit;
  const double sum_err = SumRelativeError(v, chunking, c.Gap());
  // The loss: log s off by the two sums' relative errors; the rest is double.
  EXPECT_NEAR(loss, cpu_loss, sum_err + CpuSumRelativeError(c.Gap()) + 1e-12 * std::fabs(cpu_loss));

  int64_t scored = 0;
  for (int32_t t : c.targets) scored += t != kUnscoredTarget;
  const double inv = scored == 0 ? 0.0 : 1.0 / scored;
  for (int64_t i = 0; i < n; ++i) {
    const float* z = c.logits.data() + i * v;
    if (c.targets[i] == kUnscoredTarget) {
      EXPECT_EQ(lse[i], 0.0f) << "row " << i;
      for (int64_t j = 0; j < v; ++j) ASSERT_EQ(grad[i * v + j], 0.0f) << i << "," << j;
      continue;
    }
    // lse = m + logf(s), rounded twice: the sum's error plus u of |log s| and
    // u of |lse| (|log s| <= log v + ... <= |lse| + |m|).
    const double want_lse = LseReference(z, v);
    const double m = *std::max_element(z, z + v);
    const double lse_err = sum_err + u * (2 * std::fabs(want_lse) + std::fabs(m)) + u;
    ASSERT_NEAR(lse[i], want_lse, lse_err) << "row " << i;
    for (int64_t j = 0; j < v; ++j) {
      // p = e^(z - lse): lse's error, the rounding of z - lse and of z - max
      // (u per unit of each gap), expf / FastExp (2 u each), and about six
      // multiplies / divisions / subtractions between both sides; the target's
      // subtraction of inv rounds once more on each side. An element that
      // underflows on one side (here below 1e-37) is absolute.
      const double p = std::exp(z[j] - want_lse);
      const double gaps = std::min(std::fabs(z[j] - want_lse), 88.0) + std::min(m - z[j], 88.0);
      const double tol = p * inv * (lse_err + u * (gaps + 10)) + 4 * u * inv + 1e-37;
      ASSERT_NEAR(grad[i * v + j], cpu_grad[i * v + j], tol) << "row " << i << ", class " << j;
    }
  }
}

// Lanes, vector, head: the device's f32 and bf16 splits at every row
// alignment, and smaller ones that exercise more steps per lane.
const ClassifierChunking kChunkings[] = {{256, 4, 0}, {256, 4, 3}, {256, 8, 7}, {8, 4, 1},
                                         {1, 1, 0},   {8, 8, 5},   {1024, 4, 2}};

std::string Name(const ClassifierChunking& c) {
  return "lanes " + std::to_string(c.lanes) + " vector " + std::to_string(c.vector) + " head " +
         std::to_string(c.head);
}

TEST(ChunkedClassifierTest, SplitCoversEveryLogitOnce) {
  for (const ClassifierChunking& c : kChunkings) {
    for (int64_t v = 0; v <= 300; ++v) {
      const RowSplit split = SplitRow(c.head, v, c.vector);
      std::vector<int> seen(v, 0);
      for (int64_t lane = 0; lane < c.lanes; ++lane) {
        if (lane < split.head) ++seen[lane];
        for (int64_t vec = lane; vec < split.vectors; vec += c.lanes) {
          for (int k = 0; k < c.vector; ++k) ++seen[split.head + vec * c.vector + k];
        }
        if (split.tail_begin + lane < v) ++seen[split.tail_begin + lane];
      }
      for (int64_t j = 0; j < v; ++j) {
        ASSERT_EQ(seen[j], 1) << Name(c) << ", v " << v << ", logit " << j;
      }
    }
  }
}

TEST(ChunkedClassifierTest, MatchesTwoPassCrossEntropy) {
  // V not a multiple of lanes * vector (1000 = 31 * 32 + 8), nor of 8.
  for (const ClassifierChunking& c : kChunkings) {
    ExpectMatchesCpu(RandomCase(6, 1000, -4.0f, 4.0f, 1), c, Name(c));
  }
}

TEST(ChunkedClassifierTest, GptVocabularyRow) {
  ExpectMatchesCpu(RandomCase(2, 50257, -6.0f, 6.0f, 2), ClassifierChunking{}, "V 50257");
}

TEST(ChunkedClassifierTest, SingleClass) {
  // V = 1: softmax is 1, the loss 0 and the gradient 0 exactly.
  for (const ClassifierChunking& c : kChunkings) {
    Case k = RandomCase(3, 1, -5.0f, 5.0f, 3);
    ExpectMatchesCpu(k, c, "V 1");
    std::vector<float> lse(3), grad(3);
    EXPECT_EQ(ChunkedClassifierForward(lse.data(), k.logits.data(), k.targets.data(), 3, 1, c), 0);
    ChunkedClassifierBackward(grad.data(), k.logits.data(), lse.data(), k.targets.data(), 3, 1);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(lse[i], k.logits[i]);
      EXPECT_EQ(grad[i], 0.0f);
    }
  }
}

TEST(ChunkedClassifierTest, UnscoredRowsAddNothing) {
  Case c = RandomCase(5, 333, -3.0f, 3.0f, 4);
  c.targets[1] = kUnscoredTarget;
  c.targets[4] = kUnscoredTarget;
  for (const ClassifierChunking& k : kChunkings) ExpectMatchesCpu(c, k, "rows 1 and 4 unscored");

  // The scored rows alone give the same loss (the mean is over scored rows).
  Case kept;
  kept.n = 3;
  kept.v = c.v;
  for (int64_t i : {0, 2, 3}) {
    kept.logits.insert(kept.logits.end(), c.logits.begin() + i * c.v,
                       c.logits.begin() + (i + 1) * c.v);
    kept.targets.push_back(c.targets[i]);
  }
  std::vector<float> lse(5), kept_lse(3);
  EXPECT_EQ(
      ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), 5, c.v),
      ChunkedClassifierForward(kept_lse.data(), kept.logits.data(), kept.targets.data(), 3, c.v));
}

TEST(ChunkedClassifierTest, NothingScored) {
  Case c = RandomCase(4, 50, -3.0f, 3.0f, 5);
  std::fill(c.targets.begin(), c.targets.end(), kUnscoredTarget);
  std::vector<float> lse(4, 9.0f), grad(4 * 50, 9.0f);
  EXPECT_EQ(ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), 4, 50), 0.0);
  ChunkedClassifierBackward(grad.data(), c.logits.data(), lse.data(), c.targets.data(), 4, 50);
  for (float x : lse) EXPECT_EQ(x, 0.0f);
  for (float g : grad) ASSERT_EQ(g, 0.0f);
}

TEST(ChunkedClassifierTest, HugeLogitsKeepTheRunningMax) {
  // Logits in [-1e4, 1e4]: without the running max every e^z overflows (or
  // underflows); with it the loss is finite and as the CPU's. The row maxima
  // land in different lanes and vectors, so the rescaling path runs.
  for (const ClassifierChunking& k : kChunkings) {
    Case c = RandomCase(4, 777, -1e4f, 1e4f, 6);
    ExpectMatchesCpu(c, k, "logits +-1e4");
  }
  // Rising logits: every vector raises its lane's max (a rescale each step).
  Case rising;
  rising.n = 1;
  rising.v = 4096;
  rising.low = 0;
  rising.high = 4095 * 5.0f;
  for (int64_t j = 0; j < rising.v; ++j) rising.logits.push_back(5.0f * j);
  rising.targets = {17};
  for (const ClassifierChunking& k : kChunkings) ExpectMatchesCpu(rising, k, "rising logits");
}

TEST(ChunkedClassifierTest, InPlaceBackward) {
  Case c = RandomCase(3, 129, -2.0f, 2.0f, 7);
  std::vector<float> lse(3), grad(3 * 129);
  ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), 3, 129);
  ChunkedClassifierBackward(grad.data(), c.logits.data(), lse.data(), c.targets.data(), 3, 129);
  std::vector<float> in_place = c.logits;
  ChunkedClassifierBackward(in_place.data(), in_place.data(), lse.data(), c.targets.data(), 3, 129);
  EXPECT_EQ(in_place, grad);  // the same arithmetic per element
}

TEST(ChunkedClassifierTest, BadTargetMakesTheLossNaN) {
  for (int32_t bad : {50, 51, -2, 1 << 30}) {
    Case c = RandomCase(3, 50, -1.0f, 1.0f, 8);
    c.targets[1] = bad;
    std::vector<float> lse(3), grad(3 * 50);
    const double loss =
        ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), 3, 50);
    EXPECT_TRUE(std::isnan(loss)) << "target " << bad << ": loss " << loss;
    // The gradient stays in bounds: the bad row gets softmax / scored with no
    // one-hot term (3 rows count as scored).
    ChunkedClassifierBackward(grad.data(), c.logits.data(), lse.data(), c.targets.data(), 3, 50);
    double row_sum = 0;
    for (int j = 0; j < 50; ++j) row_sum += grad[50 + j];
    EXPECT_NEAR(row_sum, 1.0 / 3, 1e-5) << "target " << bad;
  }
}

TEST(ChunkedClassifierTest, NaNLogitPropagates) {
  Case c = RandomCase(2, 40, -1.0f, 1.0f, 9);
  c.logits[40 + 13] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> lse(2);
  EXPECT_TRUE(std::isnan(ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), 2,
                                                  40, ClassifierChunking{4, 4})));
  EXPECT_FALSE(std::isnan(lse[0]));
  EXPECT_TRUE(std::isnan(lse[1]));
}

TEST(ChunkedClassifierTest, CombineIsExactForEmptySides) {
  const SoftmaxPartial e = EmptySoftmaxPartial();
  const SoftmaxPartial p{3.0f, 2.5f};
  const SoftmaxPartial a = CombineSoftmaxPartials(e, p), b = CombineSoftmaxPartials(p, e);
  EXPECT_EQ(a.max, 3.0f);
  EXPECT_EQ(a.sum, 2.5f);
  EXPECT_EQ(b.max, 3.0f);
  EXPECT_EQ(b.sum, 2.5f);
  const SoftmaxPartial ee = CombineSoftmaxPartials(e, e);
  EXPECT_EQ(ee.sum, 0.0f);
  EXPECT_EQ(ee.max, -INFINITY);
}

}  // namespace
}  // namespace zeroshard
