// Helpers shared by the CPU communicators (GlooCommunicator, ShmCommunicator).
// Internal to worker/comm.
#ifndef ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_
#define ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/comm/shm_exchange.h"

namespace zeroshard {
namespace comm_internal {

// Gloo's own cap on timeouts (100 hours, gloo/transport/tcp/pair.h).
inline constexpr absl::Duration kMaxTimeout = absl::Hours(100);

inline bool Supported(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

inline int Mod(int a, int n) { return ((a % n) + n) % n; }

// Bytes rank `rank` sends in the ring all-gather (step s forwards group
// rank - s) and ring reduce-scatter (step s sends group rank - s - 1) of a
// grouped layout. The shared-memory path counts the same, so the counters do
// not depend on the transport.
inline int64_t RingAllGatherBytes(const BlockGroups& g, int rank, int w, size_t esize) {
  int64_t sum = 0;
  for (int s = 0; s < w - 1; ++s) sum += g.total[Mod(rank - s, w)];
  return sum * static_cast<int64_t>(esize);
}
inline int64_t RingReduceScatterBytes(const BlockGroups& g, int rank, int w, size_t esize) {
  int64_t sum = 0;
  for (int s = 0; s < w - 1; ++s) sum += g.total[Mod(rank - s - 1, w)];
  return sum * static_cast<int64_t>(esize);
}

// The layout of W equal chunks of `count` elements: chunk r at r * count of
// the full buffer, the whole of rank r's shard.
inline std::vector<ShardBlock> ChunkBlocks(int world_size, int64_t count) {
  std::vector<ShardBlock> blocks(world_size);
  for (int r = 0; r < world_size; ++r) blocks[r] = {r, 0, r * count, count};
  return blocks;
}

// The all-reduce's layout: W chunks in order whose sizes differ by at most
// one element (the first count % W are one longer), chunk r at the same
// offset of rank r's buffer and of the full one.
inline std::vector<ShardBlock> EvenChunkBlocks(int world_size, int64_t count) {
  std::vector<ShardBlock> blocks(world_size);
  const int64_t base = count / world_size;
  const int64_t extra = count % world_size;
  int64_t at = 0;
  for (int c = 0; c < world_size; ++c) {
    const int64_t size = base + (c < extra ? 1 : 0);
    blocks[c] = {c, at, at, size};
    at += size;
  }
  return blocks;
}

// The checks every collective of a host communicator (rank `rank` of
// `world_size`, tag `tag`) starts with: it is usable (not aborted, not
// broken by an earlier failure: UNAVAILABLE naming it) and the count, dtype
// and timeout are valid (INVALID_ARGUMENT naming the value).
absl::Status CheckCall(const char* name, int rank, int world_size, const std::string& tag,
                       bool aborted, const absl::Status& broken, int64_t count, DType dtype,
                       absl::Duration timeout);
// Then, for the block collectives: the blocks (ValidateBlocks), grouped into
// *groups, and the buffers (non-null where the layout moves data).
absl::Status CheckBlocks(const char* name, const std::vector<ShardBlock>& blocks, int rank,
                         int world_size, const void* full, const void* shard, BlockGroups* groups);

}  // namespace comm_internal
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_
