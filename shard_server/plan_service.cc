#include "shard_server/plan_service.h"

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"

namespace zeroshard {
namespace {

// Identifies a request: the spec, the options and the world size.
std::string RequestDigest(int world_size, const v1::ModelSpec& spec,
                          const v1::PlanOptions& options) {
  std::string bytes = absl::StrCat(world_size, "|", spec.SerializeAsString(), "|",
                                   options.SerializeAsString());
  return absl::StrFormat("%016x", XXH64(bytes.data(), bytes.size(), 0));
}

}  // namespace

absl::StatusOr<v1::ShardPlan> PlanService::Plan(const std::string& job_id, int64_t generation,
                                                int world_size, const v1::ModelSpec& spec,
                                                const v1::PlanOptions& options) {
  auto compute = [&]() -> absl::StatusOr<v1::ShardPlan> {
    absl::StatusOr<ShardPlan> plan =
        zeroshard::Plan(ModelSpecFromProto(spec), world_size, PlanOptionsFromProto(options));
    if (!plan.ok()) return plan.status();
    return ShardPlanToProto(*plan);
  };
  if (job_id.empty()) return compute();  // a one-off plan, not stored

  const std::string digest = RequestDigest(world_size, spec, options);
  // Under the lock throughout: the W ranks of a generation ask at once, and
  // exactly one of them computes the plan.
  absl::MutexLock lock(&mu_);
  auto key = std::make_pair(job_id, generation);
  auto it = plans_.find(key);
  if (it == plans_.end() && state_ != nullptr) {
    absl::StatusOr<std::optional<StoredPlan>> stored = state_->LoadPlan(job_id, generation);
    if (!stored.ok()) return stored.status();
    if (stored->has_value()) {
      v1::ShardPlan plan;
      if (!plan.ParseFromString((*stored)->plan_bytes)) {
        return absl::DataLossError(absl::StrCat("stored plan of job '", job_id,
                                                "' generation ", generation, " is corrupt"));
      }
      // A restarted server learns the job's plan here: status shows it again.
      latest_hash_[job_id] = plan.hash();
      it = plans_.emplace(key, std::make_pair((*stored)->spec_hash, std::move(plan))).first;
    }
  }
  if (it != plans_.end()) {
    if (it->second.first != digest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job_id, "' generation ", generation, " already has plan ",
          it->second.second.hash(), " for a different model spec or options (request ", digest,
          " vs ", it->second.first, "); every rank must send the same spec"));
    }
    return it->second.second;
  }
  absl::StatusOr<v1::ShardPlan> plan = compute();
  if (!plan.ok()) return plan.status();
  if (state_ != nullptr) {
    absl::Status s = state_->SavePlan(job_id, generation, {digest, plan->SerializeAsString()});
    if (!s.ok()) return s;
  }
  log_->Log("plan_computed", {{"job", job_id},
                              {"generation", absl::StrCat(generation)},
                              {"world_size", absl::StrCat(world_size)},
                              {"units", absl::StrCat(plan->units_size())},
                              {"plan", plan->hash()}});
  plans_[key] = {digest, *plan};
  latest_hash_[job_id] = plan->hash();
  return *plan;
}

std::string PlanService::PlanHash(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = latest_hash_.find(job_id);
  return it == latest_hash_.end() ? "" : it->second;
}

}  // namespace zeroshard
