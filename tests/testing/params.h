// Comparing trained models in tests: the full parameters of a checkpoint
// step, and a relative difference that is meaningful for values near zero.
#ifndef ZEROSHARD_TESTS_TESTING_PARAMS_H_
#define ZEROSHARD_TESTS_TESTING_PARAMS_H_

#include <map>
#include <string>
#include <vector>

#include "common/model_spec.h"

namespace zeroshard::testing {

using Params = std::map<std::string, std::vector<float>>;

// Every tensor of `spec`, merged from the shard files of <root>/<job>/step-<step>.
// Fails the calling test (and returns what it could read) on error.
Params LoadCheckpointParams(const std::string& root, const std::string& job, int64_t step,
                            const ModelSpec& spec);

// Every tensor of a safetensors file (a consolidated checkpoint), as f32.
// Fails the calling test (and returns what it could read) on error.
Params LoadSafetensorsParams(const std::string& path);

// Per tensor max |a - b| / max |b| (the tensor's scale), worst over tensors;
// infinity when the tensor sets differ. Elementwise ratios are meaningless
// for entries that cross zero.
double MaxRelativeDifference(const Params& a, const Params& b);

// The smallest max|p| over the tensors of `params`: the denominator that makes
// an absolute error bound a bound on MaxRelativeDifference for every tensor.
double SmallestTensorScale(const Params& params);

// EXPECT_LE(measured, bound), and both printed to the test log: the margin
// under each CPU's kernels is what says whether an error model is tight.
void ExpectWithinBound(double measured, double bound, const std::string& what);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_PARAMS_H_
