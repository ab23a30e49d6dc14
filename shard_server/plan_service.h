// PlanShards: one shard plan per job generation, computed by the first call,
// stored durably, and returned identically to every later call with the same
// spec and options.
#ifndef ZEROSHARD_SHARD_SERVER_PLAN_SERVICE_H_
#define ZEROSHARD_SHARD_SERVER_PLAN_SERVICE_H_

#include <map>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/event_log.h"
#include "shard_server/state_store.h"

namespace zeroshard {

// Thread-safe.
class PlanService {
 public:
  // `state` may be null. Not owned.
  PlanService(StateStore* state, EventLog* log) : state_(state), log_(log) {}

  // REQUIRES: the caller authenticated `job_id`/`generation` as a live member.
  absl::StatusOr<v1::ShardPlan> Plan(const std::string& job_id, int64_t generation,
                                     int world_size, const v1::ModelSpec& spec,
                                     const v1::PlanOptions& options);

  // The plan hash of the job's newest planned generation, or "".
  std::string PlanHash(const std::string& job_id);

 private:
  StateStore* const state_;
  EventLog* const log_;
  absl::Mutex mu_;
  // (job, generation) -> (request digest, plan). A cache of the state store.
  std::map<std::pair<std::string, int64_t>, std::pair<std::string, v1::ShardPlan>> plans_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> latest_hash_ ABSL_GUARDED_BY(mu_);  // job -> plan hash
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_PLAN_SERVICE_H_
