// The fused classifier of the device GPT: softmax cross-entropy over N rows
// of V logits without a probabilities buffer. The forward reads each row of
// logits once per vocabulary chunk with an online (running max, running sum)
// softmax and keeps only lse [N] (f32, the natural log of the row's softmax
// denominator); the backward turns the logits into their gradient in place
// from the logits and lse. The logits are stored in `dtype`, F32 or BF16
// (raw bits; arithmetic is f32, sums of the loss in double).
//
// targets[i] in [0, V), or kUnscoredTarget (-1, worker/model/layers.h) for a
// position that adds nothing to the loss or the gradient (--loss_on=answers);
// the loss is the mean over scored positions (0 when none is scored), as
// layers.h's CrossEntropyForward. A target outside [0, V) other than -1 makes
// the loss NaN. Deterministic: fixed reduction orders, no atomics.
#ifndef ZEROSHARD_WORKER_CUDA_CLASSIFIER_H_
#define ZEROSHARD_WORKER_CUDA_CLASSIFIER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace zeroshard {
namespace gpu {

// Padded rows: logits (and dlogits) are [N, ld], row i starting at element
// i * ld, ld >= v (INVALID_ARGUMENT naming ld otherwise). The device GPT pads
// its logits rows to a multiple of 64 columns (GPT-2's V = 50257 to 50304,
// as llm.c does) so that every row starts 128-byte aligned and cuBLASLt's
// tensor-core kernels take the LM head's products. The forward never reads
// columns [v, ld) (they may hold anything, NaN included); the backward writes
// them as 0, so a product that reads the padded gradient rows adds nothing
// from them. The overloads without ld are packed rows (ld = v).

// *loss (one device double) and lse [N] written.
absl::Status ClassifierForward(double* loss, float* lse, const void* logits, const int32_t* targets,
                               int64_t n, int64_t v, int64_t ld, DType dtype, void* stream);
inline absl::Status ClassifierForward(double* loss, float* lse, const void* logits,
                                      const int32_t* targets, int64_t n, int64_t v, DType dtype,
                                      void* stream) {
  return ClassifierForward(loss, lse, logits, targets, n, v, v, dtype, stream);
}

// dlogits [N,ld] (same dtype and ld; may alias logits): columns [0, v) =
// (softmax(logits) - onehot(target)) / (scored positions, counted on the
// device), 0 in rows of unscored positions; columns [v, ld) = 0.
absl::Status ClassifierBackward(void* dlogits, const void* logits, const float* lse,
                                const int32_t* targets, int64_t n, int64_t v, int64_t ld,
                                DType dtype, void* stream);
inline absl::Status ClassifierBackward(void* dlogits, const void* logits, const float* lse,
                                       const int32_t* targets, int64_t n, int64_t v, DType dtype,
                                       void* stream) {
  return ClassifierBackward(dlogits, logits, lse, targets, n, v, v, dtype, stream);
}

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CLASSIFIER_H_
