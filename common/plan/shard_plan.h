// The shard plan: which rows of which tensor every rank owns, and where.
//
// Invariants (checked by ValidatePlan): every element of every tensor belongs
// to exactly one piece, on exactly one rank, at exactly one offset; a rank's
// pieces inside a unit are disjoint ranges of [0, chunk_elements).
#ifndef ZEROSHARD_COMMON_PLAN_SHARD_PLAN_H_
#define ZEROSHARD_COMMON_PLAN_SHARD_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/plan/shard_groups.h"

#include "common/model_spec.h"

namespace zeroshard {

// Rows [row_begin, row_end) of unit tensor `tensor`, stored on `rank` starting
// at element `offset` of that rank's chunk of the unit.
struct Piece {
  int tensor = 0;  // index into ShardUnit::tensors
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int rank = 0;
  int64_t offset = 0;  // elements
};

struct ShardUnit {
  std::string name;
  std::vector<TensorSpec> tensors;
  int64_t chunk_elements = 0;  // identical on every rank
  std::vector<Piece> pieces;   // every piece of every rank
};

struct PlanOptions {
  int64_t max_unit_bytes = 0;      // 0: default
  int64_t alignment_elements = 0;  // 0: default
  double split_fraction = 0;       // 0: default
  // 0: the balanced planner. S > 0: FSDP2's layout, every tensor cut as
  // torch.chunk(tensor, S, dim=0) cuts it, chunk k on rank k (planner.h).
  int32_t row_chunk_ranks = 0;
  // 0 or W: every rank holds a distinct shard. 0 < G < W (G divides W):
  // hybrid sharding (planner.h, "Shard groups").
  int32_t shard_group_size = 0;

  // The groups of a `world_size`-rank job under these options
  // (shard_groups.h): G ranks to a shard, or W for plain sharding.
  ShardGroups Groups(int world_size) const { return ShardGroups(world_size, shard_group_size); }
};

struct ShardPlan {
  int version = 1;
  int world_size = 0;
  std::string hash;  // hex digest of the plan's canonical form
  PlanOptions options;
  std::vector<ShardUnit> units;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_PLAN_SHARD_PLAN_H_
