#include "worker/model/peak_flops.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

#include "absl/time/clock.h"

namespace zeroshard {

double MeasureGemmFlops(absl::Duration budget) {
  // 512: large enough that OpenBLAS runs at its blocked kernels' speed and
  // spreads over the threads, small enough (3 MiB) that one call takes
  // milliseconds, so the budget holds several.
  constexpr int kN = 512;
  std::vector<float> a(kN * kN, 0.5f);
  std::vector<float> b(kN * kN, 0.25f);
  std::vector<float> c(kN * kN, 0.0f);
  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kN, kN, kN, 1.0f, a.data(), kN, b.data(),
                kN, 0.0f, c.data(), kN);
  };
  gemm();  // warm-up: thread pool start, page faults
  const double flops = 2.0 * kN * kN * kN;
  absl::Duration best = absl::InfiniteDuration();
  const absl::Time until = absl::Now() + budget;
  do {
    const absl::Time start = absl::Now();
    gemm();
    best = std::min(best, absl::Now() - start);
  } while (absl::Now() < until);
  return flops / std::max(absl::ToDoubleSeconds(best), 1e-9);
}

}  // namespace zeroshard
