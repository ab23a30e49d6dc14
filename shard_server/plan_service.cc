#include "shard_server/plan_service.h"

namespace zeroshard {

absl::StatusOr<v1::ShardPlan> PlanService::Plan(const std::string& job_id, int64_t generation,
                                                int world_size, const v1::ModelSpec& spec,
                                                const v1::PlanOptions& options) {
  return absl::UnimplementedError("PlanShards: the planner is not built yet");
}

std::string PlanService::PlanHash(const std::string& job_id) { return ""; }

}  // namespace zeroshard
