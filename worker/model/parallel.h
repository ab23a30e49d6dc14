// The threads of one rank's CPU compute: OpenMP, shared with OpenBLAS (linked
// in its OpenMP build, so its GEMMs and our kernels use one pool of threads
// instead of two pools spinning against each other).
//
// Kernels split their work so that every output element is computed by the
// same arithmetic whatever the number of threads: rows or columns are divided,
// never a sum. Results do not depend on --threads.
#ifndef ZEROSHARD_WORKER_MODEL_PARALLEL_H_
#define ZEROSHARD_WORKER_MODEL_PARALLEL_H_

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace zeroshard {

// Sets the threads of this process's compute (our kernels and OpenBLAS's).
// n >= 1.
void SetComputeThreads(int n);
int ComputeThreads();

// Calls f(begin, end) over a partition of [0, n) into contiguous ranges, in
// parallel on the compute threads. Ranges hold at least `grain` items (but
// the last), so small loops stay on the calling thread. Nested calls (from
// inside f) run serially.
void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> f);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_PARALLEL_H_
