// ShmCommunicator: the CPU Communicator for ranks that all run on one host.
// All-gathers, reduce-scatters and all-reduces go through one shared-memory
// segment (ShmExchange: each rank copies its part into its slot, the ranks
// that need it copy it out, no system call unless a rank sleeps), and
// MakeSharedGather offers gathers that ranks read in place (ShmGather).
// Broadcast and barrier go over the GlooCommunicator (TCP) it owns, made by
// CreateHostCommunicator (host_communicator.h), which chooses this class.
//
// Byte counters as GlooCommunicator's (what its rings would send), so they
// do not depend on the transport. Failures as GlooCommunicator's, with
// "shared memory" in the message: every wait has the caller's deadline; a
// peer that exits or closes its communicator is noticed within 100 ms
// through its liveness lock (UNAVAILABLE); after any failure this rank
// marks the segment failed and closes its TCP connections, so peers in a
// collective fail at once, and every later call fails (UNAVAILABLE).
// Abort() from another thread ends a waiting collective (ABORTED).
//
// Not thread-safe per instance (see Communicator), except bytes_sent(),
// Abort() and SharedGather::Release.
#ifndef ZEROSHARD_WORKER_COMM_SHM_COMMUNICATOR_H_
#define ZEROSHARD_WORKER_COMM_SHM_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/host_communicator.h"
#include "worker/comm/shm_exchange.h"
#include "worker/comm/shm_gather.h"

namespace zeroshard {

class ShmCommunicator : public HostCommunicator {
 public:
  // `tcp` and `exchange` connect the same ranks (CreateHostCommunicator).
  ShmCommunicator(std::unique_ptr<GlooCommunicator> tcp, std::unique_ptr<ShmExchange> exchange);
  ~ShmCommunicator() override;

  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  int rank() const override { return tcp_->rank(); }
  int world_size() const override { return tcp_->world_size(); }
  const std::string& tag() const override { return tcp_->tag(); }

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

  CollectiveBytes bytes_sent() const override;
  void Abort() override;

  // A SharedGather whose segment is made here, collectively, through the
  // exchange; counted in shm_segment_bytes(). nullptr when some rank cannot
  // map it (shared_gather_note() says why). Once made, a later call with a
  // geometry that fits returns the same object, else nullptr. Call it from
  // the thread that runs this communicator's collectives.
  absl::StatusOr<SharedGather*> MakeSharedGather(int regions, int64_t region_bytes,
                                                 absl::Duration timeout) override;
  const std::string& shared_gather_note() const { return shared_gather_note_; }

  HostTransport transport() const override { return HostTransport::kSharedMemory; }
  const std::string& transport_note() const override { return transport_note_; }
  int64_t shm_segment_bytes() const override;
  absl::Status health() const override { return broken_; }
  bool AwaitCollectiveInFlight(absl::Duration timeout) const override {
    return in_flight_.Await(timeout);
  }

 private:
  class SharedGatherImpl;

  absl::Status CheckCall(const char* name, int64_t count, DType dtype,
                         absl::Duration timeout) const;
  absl::Status CheckBlockCall(const char* name, const std::vector<ShardBlock>& blocks, DType dtype,
                              absl::Duration timeout, const void* full, const void* shard,
                              BlockGroups* groups) const;
  // Runs a shared-memory collective; its failure becomes a status naming
  // `name` and this rank, and breaks the communicator (see Break).
  absl::Status Run(const char* name, absl::Duration timeout,
                   const std::function<absl::Status()>& body);
  // Records `status` as the failure that broke this communicator, marks the
  // segment failed and closes the TCP connections (peers fail fast).
  void Break(absl::Status status);

  const std::unique_ptr<GlooCommunicator> tcp_;
  const std::unique_ptr<ShmExchange> shm_;
  std::string transport_note_;
  std::unique_ptr<ShmGather> gather_;  // MakeSharedGather's
  std::unique_ptr<SharedGatherImpl> shared_gather_;
  std::atomic<ShmGather*> gather_for_abort_{nullptr};
  std::string shared_gather_note_;

  absl::Status broken_;  // only the thread calling collectives touches it
  std::atomic<bool> aborted_{false};
  comm_internal::CollectiveInFlight in_flight_;
  std::atomic<int64_t> all_gather_bytes_{0};
  std::atomic<int64_t> reduce_scatter_bytes_{0};
  std::atomic<int64_t> all_reduce_bytes_{0};
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_SHM_COMMUNICATOR_H_
