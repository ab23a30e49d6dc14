// The key-value store the data plane bootstraps through. In production it is
// the shard server's store, scoped to (job, generation) (see
// client/client.h); tests may use an in-process implementation.
#ifndef ZEROSHARD_WORKER_COMM_KV_STORE_H_
#define ZEROSHARD_WORKER_COMM_KV_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace zeroshard {

// Thread-safe.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for the key; DEADLINE_EXCEEDED naming the key after.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // Adds `delta` to the integer counter at `key` (created at 0); returns the sum.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // Waits up to `timeout` until every key exists.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_KV_STORE_H_
