#include "worker/model/parallel.h"

#include <omp.h>

#include <algorithm>

extern "C" void openblas_set_num_threads(int num_threads);

namespace zeroshard {

void SetComputeThreads(int n) {
  n = std::max(n, 1);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int ComputeThreads() { return omp_get_max_threads(); }

void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int threads = omp_in_parallel()
                          ? 1
                          : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), max_chunks));
  if (threads <= 1) {
    f(0, n);
    return;
  }
  // One contiguous range per thread, as equal as the grain allows.
#pragma omp parallel num_threads(threads)
  {
    const int64_t id = omp_get_thread_num();
    const int64_t count = omp_get_num_threads();
    const int64_t begin = n * id / count;
    const int64_t end = n * (id + 1) / count;
    if (begin < end) f(begin, end);
  }
}

}  // namespace zeroshard
