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
#include "tests/testing/classifier_error_model.h"
#include "tests/testing/error_model.h"
#include "tests/worker/model/test_util.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using ::zeroshard::testing::RandomVector;

// The sums' error model: tests/testing/classifier_error_model.h.
double SumRelativeError(int64_t v, const ClassifierChunking& c, double gap) {
  return testing::ClassifierSumRelative(v, c.lanes, c.vector, gap);
}

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

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The case's packed [n, v] logits in rows ld >= v apart, the padding
// columns [v, ld) set to `pad`.
std::vector<float> Padded(const Case& c, int64_t ld, float pad) {
  std::vector<float> out(c.n * ld, pad);
  for (int64_t i = 0; i < c.n; ++i) {
    std::copy(c.logits.begin() + i * c.v, c.logits.begin() + (i + 1) * c.v, out.begin() + i * ld);
  }
  return out;
}

// Runs both algorithms and compares loss, lse and gradient within the error
// models above. With ld > v the chunked side runs on rows ld apart whose
// padding is NaN: one read of it would make that row's lse (and the loss)
// NaN. Its gradient buffer starts as NaN too, and the padding must come
// back 0.
void ExpectMatchesCpu(const Case& c, const ClassifierChunking& chunking, const std::string& what,
                      int64_t ld = 0) {
  SCOPED_TRACE(what + (ld == 0 ? "" : ", ld " + std::to_string(ld)));
  const int64_t n = c.n, v = c.v;
  if (ld == 0) ld = v;
  std::vector<float> probs(n * v), cpu_grad(n * v);
  const double cpu_loss =
      CrossEntropyForward(probs.data(), c.logits.data(), c.targets.data(), n, v);
  CrossEntropyBackward(cpu_grad.data(), probs.data(), c.targets.data(), n, v);

  const std::vector<float> logits = Padded(c, ld, kNaN);
  std::vector<float> lse(n, -1.0f), padded_grad(n * ld, ld == v ? 7.0f : kNaN);
  const double loss =
      ChunkedClassifierForward(lse.data(), logits.data(), c.targets.data(), n, v, ld, chunking);
  ChunkedClassifierBackward(padded_grad.data(), logits.data(), lse.data(), c.targets.data(), n, v,
                            ld);
  std::vector<float> grad(n * v);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = v; j < ld; ++j) {
      ASSERT_EQ(padded_grad[i * ld + j], 0.0f) << "padding of row " << i << ", column " << j;
    }
    std::copy(padded_grad.begin() + i * ld, padded_grad.begin() + i * ld + v, grad.begin() + i * v);
  }

  const double sum_err = SumRelativeError(v, chunking, c.Gap());
  // The loss: log s off by the two sums' relative errors; the rest is double.
  EXPECT_NEAR(loss, cpu_loss,
              sum_err + testing::CrossEntropySumRelative(c.Gap()) + 1e-12 * std::fabs(cpu_loss));

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
    const double want_lse = LseReference(z, v);
    const double m = *std::max_element(z, z + v);
    const double lse_err = testing::ClassifierLseTolerance(sum_err, want_lse, m);
    ASSERT_NEAR(lse[i], want_lse, lse_err) << "row " << i;
    for (int64_t j = 0; j < v; ++j) {
      const double tol = testing::ClassifierGradientTolerance(z[j], want_lse, m, inv, lse_err);
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

// Device rows start at base + i ld elements, and each is split at its own
// first 16-byte boundary (classifier.cu's SplitRowAt): the host twin's
// ShiftedRowHead must give the same head for every row, stride and base.
TEST(ChunkedClassifierTest, RowHeadsFollowTheDeviceAddresses) {
  for (int bytes : {4, 2}) {
    const int vector = 16 / bytes;
    for (uintptr_t base = 0; base < 16; base += bytes) {
      const auto device_head = [&](int64_t row, int64_t ld) {
        const uintptr_t addr = 0x7f0000000000 + base + row * ld * bytes;
        return static_cast<int64_t>(((16 - (addr & 15)) & 15) / bytes);
      };
      for (int64_t ld : {1, 3, 8, 50257, 50304, 1000, 1001}) {
        for (int64_t row = 0; row < 20; ++row) {
          ASSERT_EQ(ShiftedRowHead(device_head(0, ld), row * ld, vector), device_head(row, ld))
              << bytes << "-byte logits, base " << base << ", ld " << ld << ", row " << row;
        }
      }
    }
  }
}

TEST(ChunkedClassifierTest, PaddedRowsMatchTwoPassCrossEntropy) {
  // Strides that keep every row's split (1024, 1064: multiples of 8 as
  // 1000 is), and strides that shift it from row to row (1001, 1003).
  Case c = RandomCase(6, 1000, -4.0f, 4.0f, 11);
  c.targets[2] = kUnscoredTarget;
  for (const ClassifierChunking& k : kChunkings) {
    for (int64_t ld : {1001, 1003, 1024, 1064}) ExpectMatchesCpu(c, k, Name(k), ld);
  }
  // GPT-2's vocabulary padded as the device GPT pads it (to a multiple of
  // 64), with the f32 and bf16 splits.
  const Case gpt = RandomCase(3, 50257, -6.0f, 6.0f, 12);
  for (const ClassifierChunking& k : {ClassifierChunking{256, 4, 0}, ClassifierChunking{256, 8, 0},
                                      ClassifierChunking{256, 8, 5}}) {
    ExpectMatchesCpu(gpt, k, "V 50257, " + Name(k), 50304);
  }
}

// When ld - v is a multiple of the vector, every row splits as it does
// packed: the same arithmetic, so the same bits.
TEST(ChunkedClassifierTest, PaddedRowsWithTheSameSplitAreBitwisePacked) {
  Case c = RandomCase(5, 1000, -3.0f, 3.0f, 13);
  c.targets[3] = kUnscoredTarget;
  const int64_t n = c.n, v = c.v, ld = 1024;  // 24 more: a multiple of 1, 4 and 8
  for (const ClassifierChunking& k : kChunkings) {
    SCOPED_TRACE(Name(k));
    std::vector<float> lse(n), grad(n * v);
    const double loss =
        ChunkedClassifierForward(lse.data(), c.logits.data(), c.targets.data(), n, v, k);
    ChunkedClassifierBackward(grad.data(), c.logits.data(), lse.data(), c.targets.data(), n, v);
    std::vector<float> padded = Padded(c, ld, kNaN), padded_lse(n);
    const double padded_loss =
        ChunkedClassifierForward(padded_lse.data(), padded.data(), c.targets.data(), n, v, ld, k);
    EXPECT_EQ(padded_loss, loss);
    EXPECT_EQ(padded_lse, lse);
    // In place, as the device GPT runs it.
    ChunkedClassifierBackward(padded.data(), padded.data(), padded_lse.data(), c.targets.data(), n,
                              v, ld);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < ld; ++j) {
        const float want = j < v ? grad[i * v + j] : 0.0f;
        ASSERT_EQ(padded[i * ld + j], want) << "row " << i << ", column " << j;
      }
    }
  }
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
  // Both in rows 336 apart (a multiple of every vector): each row then
  // splits the same wherever it sits, so the sums are the same bits.
  Case kept;
  kept.n = 3;
  kept.v = c.v;
  for (int64_t i : {0, 2, 3}) {
    kept.logits.insert(kept.logits.end(), c.logits.begin() + i * c.v,
                       c.logits.begin() + (i + 1) * c.v);
    kept.targets.push_back(c.targets[i]);
  }
  const int64_t ld = 336;
  const std::vector<float> all_rows = Padded(c, ld, kNaN), kept_rows = Padded(kept, ld, kNaN);
  for (const ClassifierChunking& k : kChunkings) {
    std::vector<float> lse(5), kept_lse(3);
    EXPECT_EQ(
        ChunkedClassifierForward(lse.data(), all_rows.data(), c.targets.data(), 5, c.v, ld, k),
        ChunkedClassifierForward(kept_lse.data(), kept_rows.data(), kept.targets.data(), 3, c.v, ld,
                                 k))
        << Name(k);
  }
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
