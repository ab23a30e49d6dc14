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

// Per tensor max |a - b| / max |b| (the tensor's scale), worst over tensors;
// infinity when the tensor sets differ. Elementwise ratios are meaningless
// for entries that cross zero.
double MaxRelativeDifference(const Params& a, const Params& b);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_PARAMS_H_
