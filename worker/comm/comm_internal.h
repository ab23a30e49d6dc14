// Helpers shared by the CPU communicators (GlooCommunicator, ShmCommunicator).
// Internal to worker/comm.
#ifndef ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_
#define ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_

#include <cstdint>
#include <vector>

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

}  // namespace comm_internal
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_
