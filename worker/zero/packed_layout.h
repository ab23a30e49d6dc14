// A unit's block layout (communicator.h) as W packed chunks: rank r's shard
// at r * chunk of one buffer, as the plain AllGather and ReduceScatter take
// it. Stage 3's device collectives move a unit this way (one NCCL call
// straight from or into the packed buffer) and convert between the packed and
// the full layout in one pass (Backend::Pack / Unpack), where the block
// collectives stage the data and copy every block on its own.
//
// The layout is a list of runs in packed order that covers [0, W * chunk):
// each run is a stretch of consecutive packed elements that is either a
// stretch of consecutive full elements or padding (zeros when packed).
#ifndef ZEROSHARD_WORKER_ZERO_PACKED_LAYOUT_H_
#define ZEROSHARD_WORKER_ZERO_PACKED_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace zeroshard {

struct PackedRun {
  int64_t packed_begin = 0;  // the run ends where the next begins (the last: at W * chunk)
  int64_t full_offset = -1;  // where its first element lives in the full buffer; -1: padding
};

struct PackedLayout {
  int world_size = 0;
  int64_t chunk = 0;
  std::vector<PackedRun> runs;  // packed order; runs[0].packed_begin == 0 when W * chunk > 0
  // Elements of the full buffer the runs cover (the blocks' total).
  int64_t full_elements = 0;
  // The runs in the backend's memory, where a backend needs them there
  // (Backend::PreparePacked); null otherwise.
  std::shared_ptr<const PackedRun> device_runs;

  int64_t packed_elements() const { return world_size * chunk; }
  int64_t RunLength(size_t i) const {
    const int64_t end = i + 1 < runs.size() ? runs[i + 1].packed_begin : packed_elements();
    return end - runs[i].packed_begin;
  }
};

// The runs of `blocks` over `world_size` chunks of `chunk` elements: each
// block at packed offset rank * chunk + shard_offset; consecutive blocks that
// continue each other in both layouts become one run; gaps become padding
// runs. INVALID_ARGUMENT (naming the block) when a block's rank is not in
// [0, world_size), an offset or count is negative, a block reaches past its
// rank's chunk, or two blocks overlap in a chunk.
absl::StatusOr<PackedLayout> MakePackedLayout(const std::vector<ShardBlock>& blocks,
                                              int world_size, int64_t chunk);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_PACKED_LAYOUT_H_
