// An in-process KeyValueStore: a map guarded by a mutex, with waiters woken
// on every write. For tests that run several ranks as threads of one process.
#ifndef ZEROSHARD_WORKER_COMM_IN_MEMORY_KV_STORE_H_
#define ZEROSHARD_WORKER_COMM_IN_MEMORY_KV_STORE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/comm/kv_store.h"

namespace zeroshard {

// Thread-safe.
class InMemoryKvStore : public KeyValueStore {
 public:
  InMemoryKvStore() = default;
  InMemoryKvStore(const InMemoryKvStore&) = delete;
  InMemoryKvStore& operator=(const InMemoryKvStore&) = delete;

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;
  // The counter is stored as its decimal text, so Get sees it too. Adding to a
  // key that holds something other than an integer is INVALID_ARGUMENT.
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

  // Number of keys stored (for tests).
  size_t size() const;
  // For tests that must know a reader is blocked before they write: waits up
  // to `timeout` until Get/Wait calls have begun blocking on a missing key `n`
  // times in all (a reader woken by a write that still misses a key blocks
  // again and counts again); returns whether they have.
  bool AwaitReaderBlocks(int64_t n, absl::Duration timeout) const;

 private:
  // Waits until every key exists or `deadline` passes; returns the first
  // missing key, or nullopt when all exist.
  std::optional<std::string> AwaitKeys(const std::vector<std::string>& keys, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  int64_t reader_blocks_ ABSL_GUARDED_BY(mu_) = 0;  // times AwaitKeys began waiting
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_IN_MEMORY_KV_STORE_H_
