#include "worker/zero/packed_layout.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::StatusOr<PackedLayout> MakePackedLayout(const std::vector<ShardBlock>& blocks,
                                              int world_size, int64_t chunk) {
  if (world_size < 1 || chunk < 0) {
    return absl::InvalidArgumentError(absl::StrCat("packed layout: world size ", world_size,
                                                   " and chunk ", chunk,
                                                   " (expected >= 1 and >= 0)"));
  }
  if (absl::Status s = ValidateBlocks("packed layout", blocks, world_size); !s.ok()) return s;
  struct Placed {
    int64_t packed, full, count;
    size_t index;
  };
  std::vector<Placed> placed;
  PackedLayout layout;
  layout.world_size = world_size;
  layout.chunk = chunk;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ShardBlock& b = blocks[i];
    if (b.count == 0) continue;
    if (b.shard_offset + b.count > chunk) {
      return absl::InvalidArgumentError(absl::StrCat(
          "packed layout: block ", i, " (rank ", b.rank, ", shard_offset ", b.shard_offset,
          ", count ", b.count, ") reaches past its chunk of ", chunk, " elements"));
    }
    placed.push_back({b.rank * chunk + b.shard_offset, b.full_offset, b.count, i});
    layout.full_elements += b.count;
  }
  std::sort(placed.begin(), placed.end(),
            [](const Placed& a, const Placed& b) { return a.packed < b.packed; });
  int64_t cursor = 0;
  for (size_t k = 0; k < placed.size(); ++k) {
    const Placed& p = placed[k];
    if (p.packed < cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("packed layout: block ", p.index, " overlaps block ", placed[k - 1].index,
                       " in rank ", p.packed / std::max<int64_t>(chunk, 1), "'s chunk"));
    }
    if (p.packed > cursor) layout.runs.push_back(PackedRun{cursor, -1});
    const bool continues = p.packed == cursor && !layout.runs.empty() &&
                           layout.runs.back().full_offset >= 0 &&
                           layout.runs.back().full_offset + (p.packed -
                                                             layout.runs.back().packed_begin) ==
                               p.full;
    if (!continues) layout.runs.push_back(PackedRun{p.packed, p.full});
    cursor = p.packed + p.count;
  }
  if (cursor < layout.packed_elements()) layout.runs.push_back(PackedRun{cursor, -1});
  return layout;
}

}  // namespace zeroshard
