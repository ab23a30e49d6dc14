// Helpers shared by the CPU communicators (GlooCommunicator, ShmCommunicator).
// Internal to worker/comm.
#ifndef ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_
#define ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
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

// How many collectives of one communicator are in progress (past their
// checks, not yet returned), for HostCommunicator::AwaitCollectiveInFlight.
// Thread-safe.
class CollectiveInFlight {
 public:
  // Marks a collective in progress for its lifetime.
  class Scope {
   public:
    explicit Scope(CollectiveInFlight* owner) : owner_(owner) { owner_->Add(1); }
    ~Scope() { owner_->Add(-1); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CollectiveInFlight* const owner_;
  };

  // Waits up to `timeout` for a collective to be in progress; returns whether
  // one is.
  bool Await(absl::Duration timeout) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto in_flight = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ > 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&in_flight), timeout);
  }

 private:
  void Add(int delta) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    count_ += delta;
  }

  mutable absl::Mutex mu_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace comm_internal
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_COMM_INTERNAL_H_
