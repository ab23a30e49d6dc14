// The ring algorithms of the TCP communicator, over one Gloo context: each
// rank sends to its right neighbour and receives from its left, W - 1 steps,
// one message per block, straight between the caller's buffers (no packed
// staging but the reduce-scatter's two accumulation buffers).
//
//   AllGatherBlocks   step s forwards rank (rank - s)'s blocks
//   ReduceScatter     step s forwards the partial sums of rank (rank - s - 1)'s
//                     blocks, adding this rank's values on arrival
//   AllGatherInPlace  step s forwards chunk (rank - s)
//
// GlooCommunicator owns one and runs them inside its Run() (which turns
// Gloo's exceptions into statuses); it supplies the wait, which Abort() can
// end. Every method throws Gloo exceptions (gloo::IoException on a timeout,
// a failed pair or an abort). Not thread-safe: one collective at a time.
#ifndef ZEROSHARD_WORKER_COMM_GLOO_RING_H_
#define ZEROSHARD_WORKER_COMM_GLOO_RING_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/shm_exchange.h"  // BlockGroups

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace zeroshard {

class GlooRing {
 public:
  // Waits for `buffer`'s pending send (or recv) until `deadline`; throws
  // gloo::IoException on a timeout, an error of the pair, or an abort.
  using WaitFn =
      std::function<void(gloo::transport::UnboundBuffer* buffer, bool send, absl::Time deadline)>;

  // `context` outlives the ring.
  GlooRing(gloo::Context* context, int rank, int world_size, WaitFn wait);

  // For every block b: out[b.full_offset..] = rank b.rank's in[b.shard_offset..]
  // (`in` is this rank's shard, `out` the full buffer). `copy_own` copies this
  // rank's own blocks; it runs while the first messages travel. Adds the
  // bytes sent to `*counter`. REQUIRES: world_size > 1.
  void AllGatherBlocks(const char* in, char* out, const BlockGroups& g, DType dtype, uint64_t slot,
                       absl::Time deadline, const std::function<void()>& copy_own,
                       std::atomic<int64_t>* counter);
  // Ring reduce-scatter of `in` (the full extent of `g`) by blocks: on
  // return each of this rank's blocks holds, at its shard_offset in `out`,
  // the sum over ranks of its full_offset range of `in`, divided by
  // `divisor`. `out` may alias `in` where the ranges coincide (all-reduce).
  // Adds the bytes sent to `*counter`.
  void ReduceScatter(const char* in, char* out, const BlockGroups& g, DType dtype, float divisor,
                     uint64_t slot, absl::Time deadline, std::atomic<int64_t>* counter);
  // Ring all-gather in place over the chunks of `buffer`: chunk r comes from
  // rank r. Adds the bytes sent to `*counter`.
  void AllGatherInPlace(void* buffer, const std::vector<int64_t>& chunk_offset,
                        const std::vector<int64_t>& chunk_size, DType dtype, uint64_t slot,
                        absl::Time deadline, std::atomic<int64_t>* counter);

 private:
  // Staging for the reduce-scatters, kept across calls (grow-only) so that a
  // call does not page-fault fresh memory in.
  char* Stage(int index, size_t bytes);

  gloo::Context* const context_;
  const int rank_;
  const int world_size_;
  const WaitFn wait_;
  std::vector<char> stage_[2];
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_GLOO_RING_H_
