// Model-state memory per rank implied by a shard plan, for ZeRO stages 0-3
// with Adam and fp32 master weights (docs/design.md, "ZeRO engine").
//
// Notation: psi = parameters (elements of every tensor in the plan); S = the
// elements of one rank's shards, the sum over units of chunk_elements (so S
// includes the plan's padding; without padding S = psi / W); p and g = bytes
// per element of the parameter (compute) dtype and of the gradient (reduce)
// dtype; K = optimizer bytes per parameter = 8 (two fp32 Adam moments) + 4
// for an fp32 master copy unless the parameter dtype is F32 itself (then the
// parameter is its own master).
//
//   stage 0:  params p*psi  grads g*psi  optimizer K*psi
//   stage 1:  params p*psi  grads g*psi  optimizer K*S
//   stage 2:  params p*psi  grads g*S    optimizer K*S
//   stage 3:  params p*S    grads g*S    optimizer K*S  + window
//
//   window = min(1 + prefetch, units) * p * G * max_u chunk_elements(u):
//   the gather buffers of the at most (1 + prefetch) units unsharded at once
//   (a gathered unit occupies G chunks, its padding included; G = W unless
//   the plan has shard groups).
//
// hpZ (secondary_shard_group_size = H > 0, stage 3): + secondary, each
// rank's f32 slice of every unit, 4 * sum over units of ceil(unit / H) (the
// engine splits each unit's flat elements evenly over the H ranks).
//
// F32 (p = g = 4, K = 8): 16 psi, 8 psi + 8 S, 4 psi + 12 S, 16 S (+ window).
// BF16 params and grads (p = g = 2, K = 12): 16 psi, 4 psi + 12 S,
// 2 psi + 14 S, 16 S (+ window) — the ZeRO paper's mixed-precision case.
//
// Every rank allocates full chunks, so every rank's total is the same;
// padding_bytes says how much of the sharded state holds no parameter,
// averaged over ranks (ranks differ by the pieces they own). Activations,
// communication buffers and the transient full-unit gradient of stage 2/3
// reduce-scatters are not counted.
#ifndef ZEROSHARD_COMMON_PLAN_MEMORY_ESTIMATE_H_
#define ZEROSHARD_COMMON_PLAN_MEMORY_ESTIMATE_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/plan/shard_plan.h"
#include "nlohmann/json_fwd.hpp"

namespace zeroshard {

struct MemoryEstimateOptions {
  std::string param_dtype = "F32";  // F32, BF16 or F16: the gathered/compute copy
  std::string reduce_dtype;         // F32, BF16 or F16; empty: param_dtype
  int prefetch = 1;                 // units gathered ahead at stage 3, 0 to 1024
  // hpZ's H (0: none). With a plan of units: H divides W and H < G.
  int secondary_shard_group_size = 0;
};

// Bytes per rank for one ZeRO stage.
struct StageMemory {
  int stage = 0;
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;         // Adam moments (+ fp32 master)
  int64_t unsharded_window_bytes = 0;  // stage 3 only
  int64_t secondary_bytes = 0;         // stage 3 with hpZ only
  int64_t padding_bytes = 0;           // part of the three above; mean over ranks
  int64_t total_bytes = 0;             // parameter + gradient + optimizer + window + secondary
};

struct MemoryEstimate {
  int world_size = 0;
  // G: the ranks one shard is spread over (W without hybrid sharding). The
  // figures are per rank, so with groups they are those of a G-rank job.
  int shard_group_size = 0;
  std::string param_dtype;
  std::string reduce_dtype;
  int prefetch = 0;
  int secondary_shard_group_size = 0;  // H; 0: no hpZ
  int64_t parameters = 0;                     // psi, elements
  int64_t shard_elements = 0;                 // S, elements per rank incl. padding
  int64_t largest_unit_elements = 0;          // G * the largest chunk: one gathered unit
  int64_t optimizer_bytes_per_parameter = 0;  // K
  std::array<StageMemory, 4> stages;          // stages[s].stage == s
};

// REQUIRES: `plan` passed ValidatePlan (chunks cover their pieces).
// INVALID_ARGUMENT for a dtype other than F32, BF16 or F16, a prefetch out of
// range, or sizes whose byte counts overflow int64.
absl::StatusOr<MemoryEstimate> EstimateMemory(const ShardPlan& plan,
                                              const MemoryEstimateOptions& options);

// {"world_size": W, "shard_group_size": G, "param_dtype": "BF16", "reduce_dtype": "BF16",
// "prefetch": 1, "secondary_shard_group_size": H,
//  "parameters": n, "shard_elements": n, "largest_unit_elements": n,
//  "optimizer_bytes_per_parameter": K,
//  "stages": [{"stage": 0, "parameter_bytes": n, "gradient_bytes": n,
//              "optimizer_bytes": n, "unsharded_window_bytes": n, "secondary_bytes": n,
//              "padding_bytes": n, "total_bytes": n}, ...]}
nlohmann::ordered_json MemoryEstimateJson(const MemoryEstimate& estimate);
std::string MemoryEstimateToJson(const MemoryEstimate& estimate);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_PLAN_MEMORY_ESTIMATE_H_
