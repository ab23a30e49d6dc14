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

// *loss (one device double) and lse [N] written.
absl::Status ClassifierForward(double* loss, float* lse, const void* logits,
                               const int32_t* targets, int64_t n, int64_t v, DType dtype,
                               void* stream);

// dlogits [N,V] (same dtype; may alias logits) =
// (softmax(logits) - onehot(target)) / (scored positions, counted on the
// device); rows of unscored positions are 0.
absl::Status ClassifierBackward(void* dlogits, const void* logits, const float* lse,
                                const int32_t* targets, int64_t n, int64_t v, DType dtype,
                                void* stream);

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CLASSIFIER_H_
