// A gloo::rendezvous::Store over a zeroshard::KeyValueStore, so that Gloo
// contexts bootstrap through the shard server's store (or, in tests, an
// InMemoryKvStore) instead of a file, TCP or Redis store.
//
// Every key is prefixed (e.g. "gloo/<tag>/"), so several Gloo contexts can
// bootstrap through one KeyValueStore without seeing each other's keys. The
// store holds no keys of its own and never deletes any: a prefix must be used
// for one rendezvous per rank only (a second rendezvous under the same prefix
// would read the first one's addresses). Scope the KeyValueStore to the job
// generation, or vary the prefix.
//
// Gloo's Store interface reports errors by throwing; this class throws
// gloo::IoException (message: the KeyValueStore status) and remembers the
// status, so that callers that catch the exception can return the original
// code (e.g. DEADLINE_EXCEEDED) through last_error().
#ifndef ZEROSHARD_WORKER_COMM_KV_GLOO_STORE_H_
#define ZEROSHARD_WORKER_COMM_KV_GLOO_STORE_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "worker/comm/kv_store.h"

namespace zeroshard {

class KvGlooStore : public gloo::rendezvous::Store {
 public:
  // `store` must outlive this object. `default_timeout` bounds get() and the
  // timeout-less wait(): Gloo calls get() on keys that peers may not have
  // written yet and expects it to block until they do.
  KvGlooStore(KeyValueStore* store, std::string prefix,
              absl::Duration default_timeout = absl::Seconds(30));

  // The prefix GlooCommunicator uses for `tag`: "gloo/<tag>/".
  static std::string PrefixForTag(const std::string& tag);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  const std::string& prefix() const { return prefix_; }

  // Waits last at least `wait` whatever timeout Gloo passes: GlooCommunicator
  // sizes the Gloo context's timeout for its pairs' connect (a fifth of the
  // rendezvous's bound), which is also what Gloo passes to wait().
  void set_min_wait(absl::Duration wait) { min_wait_ = wait; }

  // The status behind the most recent exception thrown (OK if none).
  absl::Status last_error() const;

 private:
  std::string FullKey(const std::string& key) const { return prefix_ + key; }
  // Records `status` and throws gloo::IoException carrying its message.
  [[noreturn]] void Fail(const absl::Status& status);

  KeyValueStore* const store_;
  const std::string prefix_;
  const absl::Duration default_timeout_;
  absl::Duration min_wait_ = absl::ZeroDuration();

  mutable absl::Mutex mu_;
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_KV_GLOO_STORE_H_
