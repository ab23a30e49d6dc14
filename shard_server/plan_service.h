// PlanShards: one shard plan per job generation, computed by the first call,
// stored durably, and returned identically to every later call with the same
// spec and options.
#ifndef ZEROSHARD_SHARD_SERVER_PLAN_SERVICE_H_
#define ZEROSHARD_SHARD_SERVER_PLAN_SERVICE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/model_spec.h"
#include "common/plan/shard_plan.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/base/event_log.h"
#include "shard_server/state/state_store.h"

namespace zeroshard {

struct PlanServiceOptions {
  // Plans kept in memory (the state store has them all): the least recently
  // used beyond this are dropped and read back from SQLite when asked for.
  size_t max_cached_plans = 64;
  // The planner; tests may put another in its place. Null: zeroshard::Plan.
  std::function<absl::StatusOr<ShardPlan>(const ModelSpec&, int, const PlanOptions&)> planner;
};

// Thread-safe. A plan is computed and written outside the service's lock:
// one job's large plan never holds up another job's calls, nor GetStatus.
// The ranks of one generation that ask while its plan is being computed
// wait for that one computation.
class PlanService {
 public:
  // A one-off plan's pieces, at most, as OneOffPieces bounds them before
  // computing: ~18 bytes each in the answer (38 MB here, under the 64 MiB
  // a client receives) and ~130 bytes of the server's memory while it is
  // computed and sent (held_bounds_test measures both).
  static constexpr int64_t kMaxOneOffPlanPieces = int64_t{1} << 21;

  // `state` may be null. Not owned.
  PlanService(StateStore* state, EventLog* log, PlanServiceOptions options = {});

  // REQUIRES: the caller authenticated `job_id`/`generation` as a live member,
  // or `job_id` is empty: a one-off plan (shardctl plan), not stored, which
  // any caller may ask and so is bounded: at most kMaxOneOffPlanPieces
  // (INVALID_ARGUMENT beyond, naming shardctl plan --local), one computed
  // at a time (RESOURCE_EXHAUSTED while one is).
  absl::StatusOr<v1::ShardPlan> Plan(const std::string& job_id, int64_t generation, int world_size,
                                     const v1::ModelSpec& spec, const v1::PlanOptions& options);

  // Drops what the service keeps in memory for a forgotten job (the state
  // store forgets its plans with the job).
  void ForgetJob(const std::string& job_id);

  // The plan hash of the job's newest planned generation, or "". One this
  // process did not plan (after a restart or a failover) is read back from
  // the state store once.
  std::string PlanHash(const std::string& job_id);

  // Plans in memory now (for tests): at most max_cached_plans once no plan
  // is being computed.
  size_t cached_plans();

 private:
  // One generation's plan: being computed until `done` is notified.
  struct Entry {
    std::string digest;  // the request the plan answers (set before `done`)
    absl::Status status;
    v1::ShardPlan plan;
    absl::Notification done;
    uint64_t last_used = 0;  // guarded by mu_
  };
  using Key = std::pair<std::string, int64_t>;  // (job, generation)

  // The stored plan of `key`, or a new one computed and stored.
  void Fill(const Key& key, int world_size, const v1::ModelSpec& spec,
            const v1::PlanOptions& options, Entry* entry);
  absl::StatusOr<v1::ShardPlan> OneOff(int world_size, const v1::ModelSpec& spec,
                                       const v1::PlanOptions& options);
  absl::StatusOr<v1::ShardPlan> Compute(int world_size, const v1::ModelSpec& spec,
                                        const v1::PlanOptions& options);
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  StateStore* const state_;
  EventLog* const log_;
  const PlanServiceOptions options_;
  absl::Mutex mu_;
  std::map<Key, std::shared_ptr<Entry>> plans_ ABSL_GUARDED_BY(mu_);
  uint64_t uses_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::string> latest_hash_ ABSL_GUARDED_BY(mu_);  // job -> plan hash
  bool one_off_in_progress_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_PLAN_SERVICE_H_
