// This rank's peak compute, measured once: what MFU divides by when
// --peak_flops does not say it (docs/goodput.md).
#ifndef ZEROSHARD_WORKER_MODEL_PEAK_FLOPS_H_
#define ZEROSHARD_WORKER_MODEL_PEAK_FLOPS_H_

#include "absl/time/time.h"

namespace zeroshard {

// FLOP/s of OpenBLAS's f32 GEMM (n = 512 square products, 2 n^3 FLOPs each)
// at the process's compute threads (SetComputeThreads), the best call of
// those that fit in about `budget` after one warm-up call. The best, not the
// mean: the peak is what the machine can do, and a loaded machine makes
// calls slower, never faster. > 0.
double MeasureGemmFlops(absl::Duration budget);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_PEAK_FLOPS_H_
