// A unit's two layouts (engine.h, "Layouts"): the flat one the model
// computes on and the chunked one collectives move, with the pieces as range
// copies between them; built once at Create (engine_setup.cc).
#ifndef ZEROSHARD_WORKER_ZERO_UNIT_LAYOUT_H_
#define ZEROSHARD_WORKER_ZERO_UNIT_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/model_spec.h"
#include "worker/comm/communicator.h"
#include "worker/zero/packed_layout.h"

namespace zeroshard {

// A piece as a range copy between layouts (elements).
struct Segment {
  int rank = 0;
  int64_t chunk_offset = 0;  // inside rank's chunk
  int64_t flat_offset = 0;   // inside the unit's flat layout
  int64_t length = 0;
  int tensor = 0;  // unit tensor index
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

struct UnitLayout {
  std::string name;
  std::vector<TensorSpec> tensors;
  std::vector<int64_t> tensor_offsets;  // flat offset of each tensor
  int64_t flat_elements = 0;
  int64_t chunk_elements = 0;
  std::vector<Segment> segments;  // every rank's pieces
  std::vector<int> own_segments;  // indices of this rank's (its group member's)
  // The pieces this rank saves in checkpoints and snapshots: its own plan
  // pieces. Without shard groups, the own segments; with them, this rank's
  // run of its member's shard (the replicas save disjoint runs of it).
  std::vector<Segment> saved;
  // With shard groups and R = W / G >= 2 replicas: the next replica's run of
  // the same member's shard (rank ((r / G + 1) mod R) G + r % G), which this
  // rank holds too. A snapshot of saved + these covers the runs of two
  // replicas, so that any one lost rank's rows survive on its replica
  // without a buddy copy (SnapshotSchedule).
  std::vector<Segment> replica_peer_saved;
  // The segments as the communicators' block layout (shard = chunk, full =
  // flat): gathers and reductions move data straight between the two.
  std::vector<ShardBlock> blocks;
  // The blocks as G packed chunks of chunk_elements (EngineOptions::
  // packed_collectives); empty runs when the engine does not pack.
  PackedLayout packed;
  // hpZ: member m of the secondary group keeps the unit's flat elements
  // [m * secondary_elements, + its block's count); the blocks gather them.
  int64_t secondary_elements = 0;
  std::vector<ShardBlock> secondary_blocks;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_UNIT_LAYOUT_H_
