// The fused classifier's algorithm (worker/cuda/classifier.h) on the host:
// softmax cross-entropy over N rows of V logits without a probabilities
// buffer, so that the algorithm is tested without a GPU against layers.h's
// CrossEntropyForward / CrossEntropyBackward.
//
// Forward, per row: the row is split among `lanes` lanes (SplitRow), lane l
// taking the vectors l, l + lanes, l + 2 lanes, ... of `vector` consecutive
// logits (the device: one thread per lane, one 16-byte load per vector) and
// one logit of the unaligned head and tail. Each lane keeps
// an online softmax partial (running max m, running sum s of e^(z - m)),
// updated once per vector (SoftmaxPartialAddVector); the lanes' partials are
// then combined (CombineSoftmaxPartials; the device combines them in a tree,
// the host in lane order: same arithmetic, other order). lse = m + log s.
// The row's loss is (m + log s) - z_target in double; the mean over scored
// rows is summed in double in row order.
// Backward, per row: dlogits = (e^(z - lse) - onehot(target)) / scored, from
// the logits and lse alone (in place allowed).
//
// Rows may be padded: row i starts at element i * ld (ld >= v, the leading
// dimension; ld = v when packed), as a logits buffer whose rows are rounded
// up to a multiple of 64 columns for aligned tensor-core products. The
// forward never reads columns [v, ld); the backward writes them as 0, so that
// a product reading the padded gradient rows (cuBLASLt with leading
// dimension ld over v columns never should, but one over ld columns may)
// adds nothing from them.
//
// The element math below is shared with the device kernels (classifier.cu
// includes this header): one source for both.
#ifndef ZEROSHARD_WORKER_MODEL_CLASSIFIER_CHUNKED_H_
#define ZEROSHARD_WORKER_MODEL_CLASSIFIER_CHUNKED_H_

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define ZS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZS_HOST_DEVICE inline
#endif

namespace zeroshard {

// A lane's online softmax state: every logit z it has seen satisfies z <= max
// and sum = sum of e^(z - max). Empty: max -inf, sum 0.
struct SoftmaxPartial {
  float max;
  float sum;
};

ZS_HOST_DEVICE SoftmaxPartial EmptySoftmaxPartial() { return {-INFINITY, 0.0f}; }

// Merges two partials: max of the maxima, each sum rescaled to it. An empty
// side adds exactly 0 (never e^(-inf - -inf) = NaN); a NaN logit makes the
// result NaN.
ZS_HOST_DEVICE SoftmaxPartial CombineSoftmaxPartials(SoftmaxPartial a, SoftmaxPartial b) {
  const float m = fmaxf(a.max, b.max);
  const float sa = a.sum == 0.0f ? 0.0f : a.sum * expf(a.max - m);
  const float sb = b.sum == 0.0f ? 0.0f : b.sum * expf(b.max - m);
  SoftmaxPartial r;
  r.max = (a.max != a.max || b.max != b.max) ? NAN : m;  // fmaxf drops a NaN
  r.sum = sa + sb;
  return r;
}

// Adds `count` logits (one vector) to a partial: the new max first, the old
// sum rescaled once, then the vector's terms in order.
template <typename Load>
ZS_HOST_DEVICE SoftmaxPartial SoftmaxPartialAddVector(SoftmaxPartial p, const Load& z, int count) {
  float m = p.max;
  bool nan = m != m;
  for (int k = 0; k < count; ++k) {
    const float zk = z(k);
    nan = nan || zk != zk;
    m = fmaxf(m, zk);
  }
  float s = p.sum == 0.0f ? 0.0f : p.sum * expf(p.max - m);
  for (int k = 0; k < count; ++k) s += expf(z(k) - m);
  SoftmaxPartial r;
  r.max = nan ? NAN : m;
  r.sum = nan ? NAN : s;
  return r;
}

// The f32 lse a row's partial stands for.
ZS_HOST_DEVICE float SoftmaxPartialLse(SoftmaxPartial p) { return p.max + logf(p.sum); }

// -log softmax(z)[target] = (max + log sum) - z_target, in double.
ZS_HOST_DEVICE double RowLoss(SoftmaxPartial p, float z_target) {
  return (static_cast<double>(p.max) + log(static_cast<double>(p.sum))) -
         static_cast<double>(z_target);
}

// One gradient element: (e^(z - lse) - [j == target]) * inv_scored, in the
// CPU kernel's order (p * inv, then minus inv on the target).
ZS_HOST_DEVICE float ClassifierGradient(float z, float lse, bool is_target, float inv_scored) {
  const float d = expf(z - lse) * inv_scored;
  return is_target ? d - inv_scored : d;
}

// How a row of v logits splits for vector loads: `head` single logits up to
// the first vector boundary (the device: the first 16-byte aligned address),
// `vectors` whole vectors of `vector` logits, then single logits from
// tail_begin to v. Lane i takes head logit i, vectors i, i + lanes, ..., and
// tail logit tail_begin + i: every logit exactly once when lanes >= vector
// (head and tail are shorter than a vector).
struct RowSplit {
  int64_t head, vectors, tail_begin;
};

ZS_HOST_DEVICE RowSplit SplitRow(int64_t head, int64_t v, int vector) {
  RowSplit r;
  r.head = head < v ? head : v;
  r.vectors = (v - r.head) / vector;
  r.tail_begin = r.head + r.vectors * vector;
  return r;
}

// The head of the row that starts `offset` elements after a row whose head
// is `head` (0 <= head < vector): the device splits each row at its own
// first 16-byte boundary, so with ld not a multiple of the vector the rows'
// heads differ, row i's being (head - i ld) mod vector.
ZS_HOST_DEVICE int64_t ShiftedRowHead(int64_t head, int64_t offset, int vector) {
  const int64_t h = (head - offset % vector) % vector;
  return h < 0 ? h + vector : h;
}

// The host twin's chunking: the device kernel's threads per row, logits per
// 16-byte load (4 for f32, 8 for bf16), and row 0's logits before its first
// 16-byte boundary (0 to vector - 1: the buffer's address mod 16 on the
// device; row i's head follows from it, ShiftedRowHead).
struct ClassifierChunking {
  int lanes = 256;
  int vector = 4;
  int head = 0;
};

// lse [N] written (0 for unscored rows); returns the mean loss over scored
// rows (0 when none is scored; NaN when a scored row's target is outside
// [0, V)). logits [N, ld] with ld >= v: columns [v, ld) are never read.
// Requires chunking.vector >= 1, chunking.lanes >= chunking.vector and
// 0 <= chunking.head < chunking.vector.
double ChunkedClassifierForward(float* lse, const float* logits, const int32_t* targets, int64_t n,
                                int64_t v, int64_t ld, const ClassifierChunking& chunking = {});
// Packed rows (ld = v).
double ChunkedClassifierForward(float* lse, const float* logits, const int32_t* targets, int64_t n,
                                int64_t v, const ClassifierChunking& chunking = {});

// dlogits [N, ld] written (may alias logits, the same ld); rows of unscored
// positions 0, and columns [v, ld) of every row 0.
void ChunkedClassifierBackward(float* dlogits, const float* logits, const float* lse,
                               const int32_t* targets, int64_t n, int64_t v, int64_t ld);
// Packed rows (ld = v).
void ChunkedClassifierBackward(float* dlogits, const float* logits, const float* lse,
                               const int32_t* targets, int64_t n, int64_t v);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_CLASSIFIER_CHUNKED_H_
