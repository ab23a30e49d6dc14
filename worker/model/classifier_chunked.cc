#include "worker/model/classifier_chunked.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "worker/model/layers.h"

namespace zeroshard {
namespace {

// The row's partial as the device computes it (SplitRow's assignment of
// logits to lanes); the lanes are combined in order.
SoftmaxPartial RowPartial(const float* z, int64_t v, int64_t head, const ClassifierChunking& c) {
  const RowSplit split = SplitRow(head, v, c.vector);
  SoftmaxPartial row = EmptySoftmaxPartial();
  for (int64_t lane = 0; lane < c.lanes; ++lane) {
    SoftmaxPartial p = EmptySoftmaxPartial();
    auto single = [&](int64_t j) {
      p = SoftmaxPartialAddVector(
          p, [&](int) { return z[j]; }, 1);
    };
    if (lane < split.head) single(lane);
    for (int64_t vec = lane; vec < split.vectors; vec += c.lanes) {
      const int64_t begin = split.head + vec * c.vector;
      p = SoftmaxPartialAddVector(
          p, [&](int k) { return z[begin + k]; }, c.vector);
    }
    if (split.tail_begin + lane < v) single(split.tail_begin + lane);
    row = CombineSoftmaxPartials(row, p);
  }
  return row;
}

}  // namespace

double ChunkedClassifierForward(float* lse, const float* logits, const int32_t* targets, int64_t n,
                                int64_t v, int64_t ld, const ClassifierChunking& chunking) {
  int64_t scored = 0;
  double loss_sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = targets[i];
    if (t == kUnscoredTarget) {
      lse[i] = 0.0f;
      continue;
    }
    ++scored;
    const float* z = logits + i * ld;
    const SoftmaxPartial p =
        RowPartial(z, v, ShiftedRowHead(chunking.head, i * ld, chunking.vector), chunking);
    lse[i] = SoftmaxPartialLse(p);
    loss_sum += t >= 0 && t < v ? RowLoss(p, z[t]) : std::numeric_limits<double>::quiet_NaN();
  }
  return scored == 0 ? 0.0 : loss_sum / static_cast<double>(scored);
}

double ChunkedClassifierForward(float* lse, const float* logits, const int32_t* targets, int64_t n,
                                int64_t v, const ClassifierChunking& chunking) {
  return ChunkedClassifierForward(lse, logits, targets, n, v, v, chunking);
}

void ChunkedClassifierBackward(float* dlogits, const float* logits, const float* lse,
                               const int32_t* targets, int64_t n, int64_t v, int64_t ld) {
  int64_t scored = 0;
  for (int64_t i = 0; i < n; ++i) scored += targets[i] != kUnscoredTarget;
  const float inv = scored == 0 ? 0.0f : 1.0f / static_cast<float>(scored);
  for (int64_t i = 0; i < n; ++i) {
    float* d = dlogits + i * ld;
    const float* z = logits + i * ld;
    const int32_t t = targets[i];
    std::fill(d + v, d + ld, 0.0f);  // the padding: 0 for a product that reads it
    if (t == kUnscoredTarget) {
      std::fill(d, d + v, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < v; ++j) d[j] = ClassifierGradient(z[j], lse[i], j == t, inv);
  }
}

void ChunkedClassifierBackward(float* dlogits, const float* logits, const float* lse,
                               const int32_t* targets, int64_t n, int64_t v) {
  ChunkedClassifierBackward(dlogits, logits, lse, targets, n, v, v);
}

}  // namespace zeroshard
