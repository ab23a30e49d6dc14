// ShmExchange: the bulk collectives of ShmCommunicator (all-gather and
// reduce-scatter over block layouts) through one shared-memory segment, for
// jobs whose ranks all run on one host.
//
// Over loopback TCP every byte of a collective is copied into and out of the
// kernel's socket buffers, with a system call per message and Gloo's event
// loop in between: on a 2-core machine running 2 ranks, about half of a ZeRO
// step's CPU time went to the kernel. Here each rank copies its part into its
// own slot of the segment, publishes a round counter, and the ranks that need
// it copy it straight out — two user-space copies and no system call unless a
// rank has to sleep.
//
// Segment: a header, one cache line per rank (its published round counter,
// used as a futex word, and a count of sleepers), then two buffers of
// world_size slots of `slot_bytes` each. Collectives run in rounds of at most
// one slot per rank; round n uses buffer n % 2, so a rank may fill round n + 1
// while others still read round n, and it refills a buffer only after every
// rank has published the round after the one that used it (which each does
// only after reading it).
//
// Failure. Every wait has the caller's deadline. Each rank holds an
// open-file-description lock on its own byte of the segment; the kernel drops
// it when the rank's process dies or the rank closes its exchange, so a
// waiting rank notices within 100 ms that a peer is gone (UNAVAILABLE) rather
// than at its deadline. A rank that fails marks the segment failed, and peers
// blocked in the same collective return UNAVAILABLE at once. After any
// failure the exchange is unusable.
//
// Bootstrap (Create, collective, within one deadline): every rank publishes
// what it offers — its host identity (hostname and kernel boot id) and the
// segment geometry, or why it cannot take part (shared memory off, bad
// settings). Rank 0 decides for all: if every offer matches, it creates an
// anonymous memfd, reserves its memory (posix_fallocate, so a lack of memory
// fails here rather than with SIGBUS later) and publishes its
// /proc/<pid>/fd/<n> path; every rank opens and maps it and reports; every
// rank reads every report, so either all ranks use the segment or none does
// (then every Create returns nullptr with the reason and the communicator
// stays on TCP). A memfd has no name: nothing is left behind in /dev/shm
// however the job ends, and it is not bounded by /dev/shm's size (a
// container's 64 MiB default) but by the memory limits of the processes.
#ifndef ZEROSHARD_WORKER_COMM_SHM_EXCHANGE_H_
#define ZEROSHARD_WORKER_COMM_SHM_EXCHANGE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/comm/kv_store.h"

namespace zeroshard {

// A block layout grouped by rank: each rank's non-empty blocks in list
// order, the packed offset of each inside its rank's group, the group's
// total, and how far the layout reaches into the full buffer and into each
// shard (elements).
struct BlockGroups {
  std::vector<std::vector<const ShardBlock*>> blocks;
  std::vector<std::vector<int64_t>> packed_offset;
  std::vector<int64_t> total;
  int64_t full_extent = 0;
  std::vector<int64_t> shard_extent;
};

// The blocks must outlive the result (it points into them).
BlockGroups GroupBlocks(const std::vector<ShardBlock>& blocks, int world_size);

class ShmExchange {
 public:
  // Collective over the `world_size` ranks, which all call it with the same
  // store and prefix (whether or not they are `enabled`). Returns nullptr
  // and sets *why_not when shared memory cannot be used by every rank (one
  // has it off, ranks on different hosts or with different slot sizes, no
  // memory, slot_bytes outside [4 KiB, 1 GiB] or below 4 KiB per rank, ...).
  // Errors are for the store only (a peer that does not show up within
  // `timeout`, which bounds the whole call).
  static absl::StatusOr<std::unique_ptr<ShmExchange>> Create(
      KeyValueStore* store, const std::string& prefix, int rank, int world_size, bool enabled,
      int64_t slot_bytes, absl::Duration timeout, std::string* why_not);
  ~ShmExchange();

  ShmExchange(const ShmExchange&) = delete;
  ShmExchange& operator=(const ShmExchange&) = delete;

  // For every block b: full[b.full_offset + i] = shard of rank b.rank
  // [b.shard_offset + i]. `g` groups the layout (GroupBlocks).
  absl::Status AllGatherBlocks(const void* shard, void* full, const BlockGroups& g, DType dtype,
                               absl::Time deadline);
  // For every block b of this rank: shard[b.shard_offset + i] = (sum over
  // ranks r of full_r[b.full_offset + i]) / divisor, added in f32 (this
  // rank's value first, then the others' in rank order) and rounded once to
  // `dtype`. `shard` may alias `full` at the same
  // elements (in place).
  absl::Status ReduceScatterBlocks(const void* full, void* shard, const BlockGroups& g, DType dtype,
                                   float divisor, absl::Time deadline);

  // Marks the segment failed and wakes every waiter: peers in a collective
  // return UNAVAILABLE. Called by the owner after a failure of its own.
  void Abort();

  int64_t segment_bytes() const { return static_cast<int64_t>(mapped_bytes_); }

  // Whether `peer` has closed its exchange (or its process died): its
  // liveness lock is free. A few microseconds (one fcntl).
  bool PeerGone(int peer) const;
  // Whether some rank marked the segment failed (Abort).
  bool SegmentFailed() const;

 private:
  struct Header;
  struct RankLine;

  ShmExchange(int rank, int world_size, int fd, void* base, size_t mapped_bytes,
              int64_t slot_bytes);

  // failed_, or UNAVAILABLE if a peer marked the segment failed.
  absl::Status CheckUsable();
  char* Slot(uint32_t round, int rank) const;
  void Post(uint32_t round);
  // Waits until every other rank has posted `round`.
  absl::Status WaitAll(uint32_t round, absl::Time deadline);

  const int rank_;
  const int world_size_;
  const int fd_;
  void* const base_;
  const size_t mapped_bytes_;
  const int64_t slot_bytes_;
  Header* header_;
  RankLine* lines_;
  char* data_;
  uint32_t round_ = 0;
  absl::Status failed_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_SHM_EXCHANGE_H_
