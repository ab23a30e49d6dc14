// Collectives over the ranks of one job generation. Implementations:
// GlooCommunicator (TCP) and ShmCommunicator (shared memory on one host),
// chosen by CreateHostCommunicator (host_communicator.h), for host memory;
// NcclCommunicator for device memory.
//
// Every call has a timeout and returns DEADLINE_EXCEEDED (or UNAVAILABLE when
// a peer is gone) naming the collective, instead of waiting forever. Buffers
// are raw pointers to `count` elements of `dtype` (kF32 or kBF16) in the
// backend's memory space. Calls on one Communicator are not thread-safe; use
// one Communicator per thread/role (Create a second one with a different
// `tag`) so that gathers and reductions run at once. The exceptions are
// bytes_sent() and Abort(), which any thread may call.
//
// Abort() is how a job generation that is over (the server aborted it, or
// fenced this member) stops the data plane: a collective blocked in another
// thread returns promptly with an error instead of waiting out its timeout
// for peers that will never come, peers blocked on this rank fail promptly
// too, and every later call fails. The communicator cannot be revived:
// destroy it and Create a new one for the next generation.
#ifndef ZEROSHARD_WORKER_COMM_COMMUNICATOR_H_
#define ZEROSHARD_WORKER_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"

namespace zeroshard {

enum class ReduceOp { kSum, kAverage };

// One block of a sharded buffer: `count` elements at `full_offset` of the
// full (unsharded) buffer, kept by `rank` at `shard_offset` of its shard.
// A layout is a list of blocks, the same on every rank; blocks do not
// overlap in the full buffer nor within one rank's shard.
struct ShardBlock {
  int rank = 0;
  int64_t shard_offset = 0;
  int64_t full_offset = 0;
  int64_t count = 0;
};

struct CollectiveBytes {
  int64_t all_gather = 0;      // bytes this rank sent
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t broadcast = 0;
};

inline CollectiveBytes operator-(const CollectiveBytes& a, const CollectiveBytes& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter,
          a.all_reduce - b.all_reduce, a.broadcast - b.broadcast};
}

inline CollectiveBytes& operator+=(CollectiveBytes& a, const CollectiveBytes& b) {
  a.all_gather += b.all_gather;
  a.reduce_scatter += b.reduce_scatter;
  a.all_reduce += b.all_reduce;
  a.broadcast += b.broadcast;
  return a;
}

// INVALID_ARGUMENT naming `collective` and the block if a block's rank is
// not in [0, world_size) or an offset or count is negative.
absl::Status ValidateBlocks(const char* collective, const std::vector<ShardBlock>& blocks,
                            int world_size);

// Optional zero-copy all-gathers into memory every rank of one host reads in
// place (Communicator::MakeSharedGather): each rank writes its blocks once
// into one of `regions()` buffers in host-shared memory, and every rank
// computes straight from that buffer (read-only) until it Releases it.
//
// Gather is collective: every rank calls it in the same order, from one
// thread at a time (the communicator's collective thread). Gather number k
// (counting from 1 on every rank) uses region (k - 1) % regions() and first
// waits until every rank has released gather k - regions(), so at most
// regions() gathers are held at once: a caller holding more deadlocks until
// its deadline. Release may be called from any thread, in any order (a
// region is reused once every gather up to it is released on every rank).
// Failures as the communicator's collectives (DEADLINE_EXCEEDED, UNAVAILABLE
// when a peer is gone, ABORTED after Abort()); after one, every later call
// fails and the communicator is unusable. Valid as long as its communicator.
class SharedGather {
 public:
  struct Result {
    const void* full = nullptr;  // the gathered buffer (blocks' full offsets), read-only
    int64_t ticket = 0;          // for Release
  };
  virtual ~SharedGather() = default;
  virtual int regions() const = 0;
  virtual int64_t region_bytes() const = 0;
  // full[b.full_offset + i] = shard of rank b.rank [b.shard_offset + i] for
  // every block b; the layout must fit region_bytes(). Elements in no block
  // are unspecified.
  virtual absl::StatusOr<Result> Gather(const void* shard, const std::vector<ShardBlock>& blocks,
                                        DType dtype, absl::Duration timeout) = 0;
  // The caller is done reading gather `ticket`. Thread-safe; idempotent.
  virtual void Release(int64_t ticket) = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // output[r * count + i] = input of rank r [i]; output holds world_size * count.
  virtual absl::Status AllGather(const void* input, void* output, int64_t count, DType dtype,
                                 absl::Duration timeout) = 0;
  // input holds world_size * count; output[i] = op over ranks r of input_r[rank * count + i].
  // bf16 is accumulated in f32 and rounded once per hop.
  virtual absl::Status ReduceScatter(const void* input, void* output, int64_t count, DType dtype,
                                     ReduceOp op, absl::Duration timeout) = 0;
  // The same two collectives over a block layout, moving data straight
  // between shards and the full buffer (no packed staging copy where the
  // backend can avoid it):
  // AllGatherBlocks: for every block b, full[b.full_offset + i] = shard of
  // rank b.rank [b.shard_offset + i]. Elements of `full` in no block are left
  // as they are.
  virtual absl::Status AllGatherBlocks(const void* shard, void* full,
                                       const std::vector<ShardBlock>& blocks, DType dtype,
                                       absl::Duration timeout) = 0;
  // ReduceScatterBlocks: for every block b of this rank, shard[b.shard_offset
  // + i] = op over ranks r of full_r[b.full_offset + i]. Elements of `shard`
  // in none of this rank's blocks are left as they are.
  virtual absl::Status ReduceScatterBlocks(const void* full, void* shard,
                                           const std::vector<ShardBlock>& blocks, DType dtype,
                                           ReduceOp op, absl::Duration timeout) = 0;
  // In place.
  virtual absl::Status AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                                 absl::Duration timeout) = 0;
  virtual absl::Status Broadcast(void* buffer, int64_t count, DType dtype, int root,
                                 absl::Duration timeout) = 0;
  virtual absl::Status Barrier(absl::Duration timeout) = 0;
  // Bytes, every rank to every rank: output[r * bytes_per_rank + i] =
  // input of rank r [rank * bytes_per_rank + i]; both hold world_size *
  // bytes_per_rank bytes. The int8 reduce-scatter's exchange (quantized.h);
  // counted as reduce_scatter bytes. The default (NCCL): UNIMPLEMENTED.
  virtual absl::Status AllToAll(const void* input, void* output, int64_t bytes_per_rank,
                                absl::Duration timeout) {
    (void)input;
    (void)output;
    (void)bytes_per_rank;
    (void)timeout;
    return absl::UnimplementedError("all_to_all: not offered by this communicator");
  }

  // Collective: a SharedGather of `regions` buffers of `region_bytes` each,
  // owned by this communicator, or nullptr when the transport cannot offer
  // one (then every rank gets nullptr). Errors are the transport's. The
  // default (NCCL, TCP): nullptr.
  virtual absl::StatusOr<SharedGather*> MakeSharedGather(int regions, int64_t region_bytes,
                                                         absl::Duration timeout) {
    (void)regions;
    (void)region_bytes;
    (void)timeout;
    return nullptr;
  }

  // Bytes sent by this rank so far, per collective.
  virtual CollectiveBytes bytes_sent() const = 0;

  // Ends a collective waiting in another thread (it returns an error, ABORTED
  // where the implementation can tell) and makes every later call fail with
  // UNAVAILABLE. Returns promptly; idempotent. Any thread may call it at any
  // time until the communicator is destroyed (not during destruction).
  virtual void Abort() = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_COMMUNICATOR_H_
