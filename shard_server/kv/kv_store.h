// The key-value store workers bootstrap the data plane through (Gloo's
// rendezvous, the NCCL unique id), scoped to (job, generation): a new
// generation starts empty, and waiters of an old one are answered ABORTED.
// Gets and waits are held without a thread until the keys exist or their
// deadline passes.
//
// Isolation between jobs (#29): waiters are indexed by the keys they still
// miss, so a Set touches only the waiters of its key, and deadlines are kept
// in order, so a Tick touches only the waiters that expire; no call holds
// the store's lock for work proportional to another job's waiters. Memory is
// accounted as the server holds it (strings with their heap buffers, the
// index entries, the parsed request a held call keeps alive), per job
// (--kv_max_job_bytes) and in total (--kv_max_total_bytes).
#ifndef ZEROSHARD_SHARD_SERVER_KV_KV_STORE_H_
#define ZEROSHARD_SHARD_SERVER_KV_KV_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shard_server/base/clock.h"

namespace zeroshard {

// Every bound is on what a caller can make the server hold; a call beyond one
// is refused with RESOURCE_EXHAUSTED (INVALID_ARGUMENT for a single key or
// value too large) naming the bound and the shard_server flag that sets it.
struct KvLimits {
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = 4 << 20;
  // What one job makes the store hold: keys, values, its held gets and
  // waits with their keys, index entries and requests (--kv_max_job_bytes).
  size_t max_job_bytes = 256 << 20;
  // Keys one StoreWait may name (--kv_max_wait_keys): a rank waits for at
  // most one key per rank, and a job has at most 65,536 ranks.
  size_t max_wait_keys = 131072;
  // Gets and waits held at once for one job (--kv_max_waiters_per_job).
  size_t max_waiters_per_job = 1 << 17;
  // The same over every job (--kv_max_total_bytes): what bounds the
  // store's memory as a whole.
  size_t max_total_bytes = size_t{1} << 30;
};

// Thread-safe. Callbacks are never run while the lock is held.
class KvStore {
 public:
  using GetDone = std::function<void(absl::StatusOr<std::string>)>;
  using WaitDone = std::function<void(absl::Status)>;

  explicit KvStore(Clock* clock, KvLimits limits = {});

  absl::Status Set(const std::string& job, int64_t generation, const std::string& key,
                   std::string value);
  // Answers at once if the key exists, else when it is set or at `deadline`
  // (DEADLINE_EXCEEDED naming the key). Returns an id for Cancel (0: answered).
  // `request_bytes`: memory the caller keeps alive while the get is held (the
  // parsed request), counted against the limits with it.
  uint64_t Get(const std::string& job, int64_t generation, const std::string& key,
               absl::Time deadline, GetDone done, size_t request_bytes = 0);
  // Adds `delta` to the decimal integer at `key` (created at 0).
  absl::StatusOr<int64_t> Add(const std::string& job, int64_t generation, const std::string& key,
                              int64_t delta);
  // Answers when every key exists; a key that exists when the wait begins
  // counts as set even if it is deleted later (as TCPStore's wait).
  uint64_t Wait(const std::string& job, int64_t generation, std::vector<std::string> keys,
                absl::Time deadline, WaitDone done, size_t request_bytes = 0);
  // TCPStore's compare-and-set: when `key` holds `expected` (or is missing and
  // `expected` is empty), it is set to `desired`. Returns the value the key
  // holds afterwards (`expected` itself when the key is missing and
  // `expected` is not empty, as TCPStore answers).
  absl::StatusOr<std::string> CompareSet(const std::string& job, int64_t generation,
                                         const std::string& key, const std::string& expected,
                                         std::string desired);
  // Removes `key`; false when it did not exist.
  absl::StatusOr<bool> Delete(const std::string& job, int64_t generation, const std::string& key);
  // Whether every key exists now (no waiting).
  absl::StatusOr<bool> Check(const std::string& job, int64_t generation,
                             const std::vector<std::string>& keys);
  // Keys of the job's generation.
  int64_t NumKeys(const std::string& job, int64_t generation);
  void Cancel(uint64_t id);

  // Drops the job's data; waiters are answered ABORTED. Called when the job's
  // generation changes, the job finishes, or (new_generation = INT64_MAX) it
  // is forgotten.
  void DropJob(const std::string& job, int64_t new_generation);

  // Expires waiters whose deadline passed.
  void Tick();

  // Keys held for the job (0 when none): for tests and status.
  size_t KeyCount(const std::string& job);
  // Bytes held now (as accounted): keys, values and waiters of every job.
  size_t TotalBytes();
  // The same for one job (0 when none).
  size_t JobBytes(const std::string& job);
  // Held waiters that a Set, Add, CompareSet or Tick looked at, since the
  // start: what the key index and the deadline order keep to the waiters
  // concerned. For tests.
  uint64_t WaiterVisits();
  // Wait calls since the start (a node agent's fan-out sends one for its
  // host's ranks). For tests.
  uint64_t WaitsBegun();

  // What the store counts for a string it holds: the object and, when the
  // text does not fit inline, its heap block (malloc's header and rounding).
  static size_t HeldBytes(const std::string& s);

 private:
  struct Waiter {
    uint64_t id = 0;
    // Distinct keys not set when the wait began (a Get's one key, set or
    // not); each is indexed in JobData::waiting_on until it is set.
    std::vector<std::string> keys;
    size_t missing = 0;  // of `keys`, how many are not set yet
    size_t bytes = 0;    // what the waiter counts against the limits
    absl::Time deadline;
    GetDone get_done;    // set for Get
    WaitDone wait_done;  // set for Wait
  };
  struct JobData {
    int64_t generation = 0;
    size_t bytes = 0;       // keys and values
    size_t wait_bytes = 0;  // its waiters, their keys, index entries and requests
    absl::flat_hash_map<std::string, std::string> values;
    absl::flat_hash_map<uint64_t, Waiter> waiters;
    // key -> the waiters that still miss it.
    absl::flat_hash_map<std::string, absl::flat_hash_set<uint64_t>> waiting_on;
  };
  using Deferred = std::vector<std::function<void()>>;

  absl::Status CheckKey(const std::string& key);
  // The job's data for `generation`, reset if it belonged to an older one.
  JobData& Data(const std::string& job, int64_t generation, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `key` was just created: the waiters that missed it count it, and those
  // that miss nothing more are answered.
  void WakeWaitersOf(JobData& data, const std::string& key, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers every waiter of `data` with `why` and empties it (bytes released).
  void Clear(JobData& data, const absl::Status& why, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the waiter's bytes, index entries and deadline (the caller
  // erases it).
  void ReleaseWaiter(JobData& data, const Waiter& waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED naming the bound and its flag when `job` (holding
  // `data`) may not hold `more` bytes beyond what it holds now.
  absl::Status CheckRoom(const JobData& data, const std::string& job, size_t more,
                         absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores `value`; sets `*created` when the key is new.
  absl::Status StoreValue(JobData& data, const std::string& job, const std::string& key,
                          std::string value, bool* created) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores and wakes the key's waiters: Set, Add and CompareSet.
  absl::Status StoreAndWake(JobData& data, const std::string& job, const std::string& key,
                            std::string value, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Holds a Get or Wait (`waiter` has its id, keys and callback), or answers
  // it at once through `deferred` when it must be refused. Returns its id
  // (0: answered).
  uint64_t HoldOrRefuse(JobData& data, const std::string& job, Waiter waiter,
                        Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  const KvLimits limits_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, JobData> jobs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::string> waiter_job_ ABSL_GUARDED_BY(mu_);
  // Every held waiter by deadline: Tick takes only the expired ones.
  std::set<std::pair<absl::Time, uint64_t>> deadlines_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t waiter_visits_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> waits_begun_{0};
  size_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // sum of every job's bytes + wait_bytes
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_KV_KV_STORE_H_
