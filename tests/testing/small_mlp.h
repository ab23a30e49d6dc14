// The small MLP that jobs in the integration tests train, in one place: its
// shard_worker flags, its checkpoints' parameters, and tests/testing/
// error_model.h's Adam bound for comparing a sharded run with one process
// (which sums each gradient in another order: one GEMM over all rows).
#ifndef ZEROSHARD_TESTS_TESTING_SMALL_MLP_H_
#define ZEROSHARD_TESTS_TESTING_SMALL_MLP_H_

#include <string>
#include <vector>

#include "tests/testing/params.h"

namespace zeroshard::testing {

struct SmallMlp {
  int layers = 3;
  int width = 32;
  double lr = 0.01;
  int seed = 3;
  // GELU: the error model assumes no unit within rounding of a kink.
  std::string activation = "gelu";

  // The model, `steps`, lr, seed, a checkpoint at the end, then `extra`.
  std::vector<std::string> Flags(int steps, const std::vector<std::string>& extra) const;
  // `job`'s checkpoint at `step` under `checkpoint_root`.
  Params Load(const std::string& checkpoint_root, const std::string& job, int step) const;
  // The bound for `steps` steps on `rows` rows per step against `reference`.
  double Bound(int steps, int rows, const Params& reference) const;
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_SMALL_MLP_H_
