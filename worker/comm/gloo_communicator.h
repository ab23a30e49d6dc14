// GlooCommunicator: the CPU Communicator over Gloo's TCP transport. (When
// every rank runs on one host, CreateHostCommunicator gives a
// ShmCommunicator instead, which keeps one of these for broadcast and
// barrier: host_communicator.h.)
//
// Each communicator owns one Gloo TCP device (one event-loop thread) and one
// fully connected Gloo context, bootstrapped through a KeyValueStore under the
// key prefix "gloo/<tag>/". Distinct tags give independent contexts, so one
// thread can run gathers on a "gather" communicator while another runs
// reductions on a "reduce" communicator. A tag may be used for one Create per
// rank per store (the store is scoped to the job generation).
//
// Algorithms (the rings: gloo_ring.h) and bytes this rank sends (n = count *
// element size, W = world):
//   AllGather      ring all-gather (AllGatherBlocks over   (W-1) * n
//                  W equal chunks)
//   ReduceScatter  ring reduce-scatter on unbound buffers  (W-1) * n
//   AllReduce      ring reduce-scatter + ring all-gather   2 * (total - own chunk)
//                  over W chunks (sizes differ by at most one element when count
//                  is not divisible by W); about 2 (W-1)/W * count * size
//   Broadcast      Gloo's binomial tree                    n per child in the tree
//   Barrier        Gloo's barrier                          (not counted)
// Reductions travel in the caller's dtype (bf16 stays 2 bytes on the wire); each
// hop adds in f32 and rounds once, kAverage divides by W at the last hop.
//
// Timeouts and failures. Every wait is bounded: the ring algorithms hold a
// deadline of `timeout` for the whole call; Gloo's own collectives (broadcast,
// barrier) apply `timeout` to each wait inside them. A timeout is
// DEADLINE_EXCEEDED ("all_gather timed out after 5s (rank 1 of 2, tag
// 'gather')"); a peer that closed its connection or whose connection failed is
// UNAVAILABLE ("... a peer is gone ..."). After either, THE COMMUNICATOR IS
// UNUSABLE: Gloo closes every connection of a context when one wait times out,
// and an I/O error leaves the ring half-done, so this class also closes all of
// its connections on any failure (which makes peers blocked in the same
// collective fail promptly instead of waiting for their own timeout). Every
// later call returns UNAVAILABLE; destroy it and Create a new one (with a new
// tag or store generation).
//
// Abort() from another thread does the same on purpose: the collective in
// flight returns ABORTED, the peers see this rank's connections close, and
// later calls return UNAVAILABLE. The ring algorithms (every collective but
// broadcast and barrier) end at once, whatever state the connections are in; Gloo's own
// broadcast and barrier end at once while the connections are up (Abort()
// makes one wait of the context time out, which ends all of them: see
// gloo_communicator.cc), else at their timeout.
//
// Gloo writes to sockets without MSG_NOSIGNAL, so a write to a peer that is
// gone raises SIGPIPE. Create therefore sets SIGPIPE to SIG_IGN if (and only if)
// it is still SIG_DFL, so that a dead peer is an UNAVAILABLE status rather than
// the death of this process.
//
// Not thread-safe per instance (see Communicator), except bytes_sent(), which
// any thread may read, and Abort().
#ifndef ZEROSHARD_WORKER_COMM_GLOO_COMMUNICATOR_H_
#define ZEROSHARD_WORKER_COMM_GLOO_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/comm_internal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo_ring.h"
#include "worker/comm/host_communicator.h"
#include "worker/comm/kv_store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace zeroshard {

struct BlockGroups;

class GlooCommunicator : public HostCommunicator {
 public:
  // shared_memory and shm_slot_bytes are CreateHostCommunicator's: this
  // class is TCP only.
  using Options = HostCommunicatorOptions;

  // Connects to the other `world_size - 1` ranks, which must call Create with
  // the same store, tag and world_size. `store` is only used during Create.
  // INVALID_ARGUMENT for bad arguments; DEADLINE_EXCEEDED if the peers do not
  // show up within connect_timeout; UNAVAILABLE for network errors.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(KeyValueStore* store, int rank,
                                                                  int world_size,
                                                                  const std::string& tag,
                                                                  const Options& options);
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(KeyValueStore* store, int rank,
                                                                  int world_size,
                                                                  const std::string& tag) {
    return Create(store, rank, world_size, tag, Options());
  }

  // Closes the connections; peers blocked on this rank see UNAVAILABLE.
  ~GlooCommunicator() override;

  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  const std::string& tag() const override { return tag_; }

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

  // Point to point, bytes: posts every send and receive, then waits for all
  // (one deadline of `timeout`). A message is matched by (peer, tag) in
  // order; a receive must name the exact byte count its sender sends. Used
  // for snapshots (worker/recovery), not by the engine. Failures as the
  // collectives' ("send_recv ...").
  struct PointToPoint {
    int peer = 0;
    uint32_t tag = 0;
    void* data = nullptr;
    int64_t bytes = 0;
  };
  absl::Status SendRecv(const std::vector<PointToPoint>& sends,
                        const std::vector<PointToPoint>& recvs, absl::Duration timeout);
  // Bytes SendRecv sent.
  int64_t point_to_point_bytes() const { return p2p_bytes_.load(); }

  absl::Status health() const override { return broken_; }
  bool AwaitCollectiveInFlight(absl::Duration timeout) const override {
    return in_flight_.Await(timeout);
  }
  HostTransport transport() const override { return HostTransport::kTcp; }
  const std::string& transport_note() const override { return transport_note_; }
  int64_t shm_segment_bytes() const override { return 0; }
  void set_transport_note(std::string note) { transport_note_ = std::move(note); }
  // Closes every connection (peers blocked on this rank fail promptly)
  // without marking this communicator aborted: ShmCommunicator's failure.
  void CloseConnections();

 private:
  GlooCommunicator(int rank, int world_size, std::string tag,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::Context> context);

  // Checks that the communicator is usable and the common arguments are
  // valid; `name` is the collective ("all_gather", ...).
  absl::Status CheckCall(const char* name, int64_t count, DType dtype,
                         absl::Duration timeout) const;
  // Runs `body` (which may throw Gloo exceptions), converting any exception
  // into a status naming `name`; on failure closes all connections and marks
  // the communicator unusable.
  absl::Status Run(const char* name, absl::Duration timeout, const std::function<void()>& body);
  // Records the failure of collective `name` as a status naming it
  // and this rank, and makes the communicator (and its peers) fail fast.
  absl::Status Break(const char* name, absl::Duration timeout, absl::StatusCode code,
                     const std::string& detail);

  // Waits for `buffer`'s pending send (or recv) until `deadline`, where
  // Abort() can end the wait. Throws gloo::IoException on a timeout, an
  // error of the pair, or an abort.
  void Wait(gloo::transport::UnboundBuffer* buffer, bool send, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(wait_mu_);

  // The checks both block collectives start with: the call, the blocks and
  // the buffers. Sets *groups; groups->full_extent == 0: nothing to move.
  absl::Status CheckBlockCall(const char* name, const std::vector<ShardBlock>& blocks, DType dtype,
                              absl::Duration timeout, const void* full, const void* shard,
                              BlockGroups* groups);
  const int rank_;
  const int world_size_;
  const std::string tag_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;

  std::string transport_note_;

  // OK while usable; only the thread calling collectives touches it.
  absl::Status broken_;
  std::atomic<bool> aborted_{false};  // Abort() was called (any thread)
  comm_internal::CollectiveInFlight in_flight_;
  // The unbound buffer the calling thread waits on (in Wait), for Abort().
  absl::Mutex wait_mu_;
  gloo::transport::UnboundBuffer* waiting_ ABSL_GUARDED_BY(wait_mu_) = nullptr;
  bool waiting_for_send_ ABSL_GUARDED_BY(wait_mu_) = false;

  std::atomic<int64_t> all_gather_bytes_{0};
  std::atomic<int64_t> reduce_scatter_bytes_{0};
  std::atomic<int64_t> all_reduce_bytes_{0};
  std::atomic<int64_t> broadcast_bytes_{0};
  std::atomic<int64_t> p2p_bytes_{0};

  GlooRing ring_;  // the ring algorithms, over context_, waiting with Wait()
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_GLOO_COMMUNICATOR_H_
