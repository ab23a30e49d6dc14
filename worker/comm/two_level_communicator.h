// Collectives in two levels for a job whose ranks share hosts: the bytes that
// must cross the network cross it once per host, not once per rank.
//
// With H hosts of L ranks each (rank r on host h(r) as local rank l(r)), the
// ranks with local index l on every host form rail l. A reduce-scatter of a
// block layout runs
//   1. inside each host (shared memory where it can be): local rank l gets
//      the host's sum of every block owned by rail l's ranks, packed in a
//      rail buffer;
//   2. across hosts, along rail l (TCP, one rank per host): each rank gets
//      the sum over hosts of its own blocks.
// An all-gather runs the same two steps backwards. Each host then sends
// (H - 1) / H of the buffer across the network, where the flat ring over W
// ranks sends up to (W - 1) / W of it over each host's link; inside a host
// the shared-memory exchange costs a copy, not a network transfer.
//
// Results equal the flat ring's up to the order of additions (a host's sum
// first, then the sum over hosts) and, with ReduceOp::kAverage, dividing by
// L and then by H instead of by W once. Broadcast and Barrier use a flat
// Gloo context over all W ranks. No SharedGather (ranks on other hosts
// cannot read this host's memory).
#ifndef ZEROSHARD_WORKER_COMM_TWO_LEVEL_COMMUNICATOR_H_
#define ZEROSHARD_WORKER_COMM_TWO_LEVEL_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/host_communicator.h"
#include "worker/comm/kv_store.h"

namespace zeroshard {

// Where each rank runs: hosts numbered in order of their lowest rank, local
// ranks in rank order within a host.
struct HostLayout {
  int hosts = 0;
  int local_size = 0;                      // ranks per host (every host has as many)
  std::vector<int> host_of;                // by rank
  std::vector<int> local_of;               // by rank
  std::vector<std::vector<int>> ranks_on;  // by host, ascending

  // The layout of `host_keys` (one per rank, equal for ranks on one host).
  // FAILED_PRECONDITION naming the counts when hosts hold different numbers
  // of ranks (two levels need the same number on every host).
  static absl::StatusOr<HostLayout> Of(const std::vector<std::string>& host_keys);
};

// Every rank's host key (`key` is this rank's), published under `tag` and
// read back in rank order: a collective, each rank waits up to `timeout` for
// all `world_size` keys. The store's errors.
absl::StatusOr<std::vector<std::string>> ExchangeHostKeys(KeyValueStore* store, int rank,
                                                          int world_size, const std::string& tag,
                                                          const std::string& key,
                                                          absl::Duration timeout);

// The two steps' block layouts for one block layout of the whole job (see
// above): `intra` over the L local ranks (shard = a rail buffer), `inter`
// over the H hosts of one rail (full = the rail buffer). Rail buffers pack
// their rail's blocks in the order of `blocks`.
struct RailLayouts {
  std::vector<ShardBlock> intra;  // every block, rank = its local index
  std::vector<ShardBlock> inter;  // the blocks of this rank's rail, rank = host
  int64_t rail_elements = 0;      // this rank's rail buffer
};
RailLayouts SplitByRail(const std::vector<ShardBlock>& blocks, const HostLayout& layout, int rank);

class TwoLevelCommunicator : public HostCommunicator {
 public:
  struct Options {
    HostCommunicatorOptions host;  // for the three contexts it makes
    // This rank's host identity; "" = HostIdentity() (hostname and boot id).
    // Tests give ranks of one process different keys to make hosts.
    std::string host_key;
  };

  // Collective over all `world_size` ranks (same store, tag, options):
  // publishes this rank's host key, and when the job spans more than one
  // host with more than one rank on each, the same number on every host,
  // connects the host's, the rail's and the flat context. Otherwise returns
  // nullptr with *why_not saying why (every rank agrees: they read the same
  // keys), and the caller uses a flat communicator. Errors as
  // CreateHostCommunicator's.
  static absl::StatusOr<std::unique_ptr<TwoLevelCommunicator>> Create(KeyValueStore* store,
                                                                      int rank, int world_size,
                                                                      const std::string& tag,
                                                                      const Options& options,
                                                                      std::string* why_not);

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  const std::string& tag() const override { return tag_; }
  HostTransport transport() const override { return HostTransport::kTwoLevel; }
  const std::string& transport_note() const override { return note_; }
  int64_t shm_segment_bytes() const override { return intra_->shm_segment_bytes(); }
  absl::Status health() const override;
  bool AwaitCollectiveInFlight(absl::Duration timeout) const override;
  const HostLayout& layout() const { return layout_; }

  absl::Status AllGather(const void* input, void* output, int64_t count, DType dtype,
                         absl::Duration timeout) override;
  absl::Status ReduceScatter(const void* input, void* output, int64_t count, DType dtype,
                             ReduceOp op, absl::Duration timeout) override;
  absl::Status AllGatherBlocks(const void* shard, void* full, const std::vector<ShardBlock>& blocks,
                               DType dtype, absl::Duration timeout) override;
  absl::Status ReduceScatterBlocks(const void* full, void* shard,
                                   const std::vector<ShardBlock>& blocks, DType dtype, ReduceOp op,
                                   absl::Duration timeout) override;
  absl::Status AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                         absl::Duration timeout) override;
  absl::Status Broadcast(void* buffer, int64_t count, DType dtype, int root,
                         absl::Duration timeout) override;
  absl::Status Barrier(absl::Duration timeout) override;
  absl::Status AllToAll(const void* input, void* output, int64_t bytes_per_rank,
                        absl::Duration timeout) override;
  // Inside the host plus across hosts plus the flat context's.
  CollectiveBytes bytes_sent() const override;
  // What crossed the network: the rail's (across hosts) and the flat
  // context's (broadcast, barrier) bytes.
  CollectiveBytes inter_host_bytes_sent() const;
  void Abort() override;

 private:
  TwoLevelCommunicator(int rank, int world_size, std::string tag, HostLayout layout,
                       std::unique_ptr<HostCommunicator> intra,
                       std::unique_ptr<HostCommunicator> inter,
                       std::unique_ptr<HostCommunicator> flat);
  // The rail buffer, grown as needed (one collective at a time) and kept:
  // host memory of about 1/L of the largest collective's buffer, outside
  // the engine's memory accounting.
  char* RailBuffer(int64_t bytes);

  const int rank_;
  const int world_size_;
  const std::string tag_;
  const HostLayout layout_;
  std::string note_;
  std::unique_ptr<HostCommunicator> intra_;  // this host's ranks
  std::unique_ptr<HostCommunicator> inter_;  // this rank's rail: one rank per host
  std::unique_ptr<HostCommunicator> flat_;   // every rank: broadcast, barrier
  std::vector<char> rail_buffer_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_TWO_LEVEL_COMMUNICATOR_H_
