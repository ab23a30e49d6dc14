// Conversions between the planner's C++ types (common/model_spec.h,
// common/plan/shard_plan.h) and the wire messages of zeroshard.v1, plus the plan's
// JSON form for people and scripts.
//
// The conversions copy fields one to one and check nothing: run ValidatePlan
// (common/plan/planner.h) on a plan that came from the wire before using it.
#ifndef ZEROSHARD_COMMON_PLAN_PLAN_CODEC_H_
#define ZEROSHARD_COMMON_PLAN_PLAN_CODEC_H_

#include <string>

#include "common/model_spec.h"
#include "common/plan/shard_plan.h"
#include "nlohmann/json_fwd.hpp"
#include "proto/zeroshard.pb.h"

namespace zeroshard {

v1::ModelSpec ModelSpecToProto(const ModelSpec& spec);
ModelSpec ModelSpecFromProto(const v1::ModelSpec& proto);

v1::PlanOptions PlanOptionsToProto(const PlanOptions& options);
PlanOptions PlanOptionsFromProto(const v1::PlanOptions& proto);

v1::ShardPlan ShardPlanToProto(const ShardPlan& plan);
ShardPlan ShardPlanFromProto(const v1::ShardPlan& proto);

// (sum over units of W * chunk_elements) / (sum of tensor elements) - 1: the
// fraction of every rank's shard memory that holds no parameter. 0 for a plan
// without elements.
double PaddingOverhead(const ShardPlan& plan);

// {"world_size": W, "shard_group_size": G, "plan_hash": "...", "padding_overhead": f,
//  "units": [{"name": "...", "chunk_elements": n,
//             "pieces": [{"tensor": "<tensor name>", "row_begin": a,
//                         "row_end": b, "rank": r, "offset": o}, ...]}, ...]}
// in that key order, compact, pieces in plan order ((rank, offset) for plans
// from Plan). The fields of `extra` (a JSON object, or null for none) follow
// "units", e.g. {"memory_estimate": {...}}. Written straight into the string,
// without a JSON tree: a plan of a million pieces is ~80 MB of text.
std::string PlanToJson(const ShardPlan& plan);
std::string PlanToJson(const ShardPlan& plan, const nlohmann::ordered_json& extra);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_PLAN_PLAN_CODEC_H_
