// Shard files in the worker's checkpoint format, written without a worker:
// for tests and benchmarks of the checkpoint registry (commits,
// consolidation) against a real server.
#ifndef ZEROSHARD_TESTS_TESTING_SHARD_FILES_H_
#define ZEROSHARD_TESTS_TESTING_SHARD_FILES_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard::testing {

// Tensor name prefixes of the kinds a shard file holds: parameters, Adam's
// first and second moments.
inline const char* const kPrefix[] = {"", "optim.exp_avg.", "optim.exp_avg_sq."};

// Element `element` of model tensor `tensor` (spec index) for one kind: a
// deterministic value a reader can check.
float Value(int kind, int tensor, int64_t element);

struct ShardFile {
  std::string relative;  // <job>/step-<N>/rank-<R>-of-<W>.safetensors
  std::string path;      // under the root it was written to
  int64_t size = 0;      // bytes
  std::map<std::string, std::string> checksums;
};

// Rank `rank`'s shard file of `step` of `job` under the checkpoint root
// `dir`, holding Value()s for its pieces of `plan` (and the optimizer's
// moments when `optimizer`).
absl::StatusOr<ShardFile> WriteShardFile(const std::string& dir, const std::string& job,
                                         const v1::ShardPlan& plan, int64_t step, int rank,
                                         int64_t generation, bool optimizer = true);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_SHARD_FILES_H_
