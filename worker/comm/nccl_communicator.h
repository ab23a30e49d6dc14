// NcclCommunicator: the GPU Communicator, over NCCL, on device buffers.
//
// Bootstrap. Rank 0 creates an ncclUniqueId and publishes its raw bytes in the
// KeyValueStore at "nccl/<tag>/unique_id"; the other ranks wait for it there
// (PublishOrFetchNcclUniqueId). The store is scoped to the job generation, so
// each generation gets a fresh id; a tag may be used for one Create per rank
// per store. Distinct tags give independent communicators, each with its own
// CUDA stream: one for the "gather" role and one for the "reduce" role let
// ZeRO-3 prefetch all-gathers while reduce-scatters run.
//
// Initialization is non-blocking (ncclConfig_t.blocking = 0): Create polls
// ncclCommGetAsyncError until the communicator is ready or `init_timeout`
// (which also bounds waiting for the unique id) passes; then it calls
// ncclCommAbort and returns DEADLINE_EXCEEDED.
//
// Collectives. Each call enqueues one NCCL collective on the communicator's
// stream and waits for it by polling cudaStreamQuery and
// ncclCommGetAsyncError until it completes, fails, or `timeout` passes. The
// caller must make the input ready before the call: the communicator's stream
// does not wait for other streams (synchronize the producing stream, or make
// stream() wait on an event recorded after the producer). When the call
// returns OK the output is complete, and the buffers may be reused.
//
//   AllGather      ncclAllGather
//   ReduceScatter  ncclReduceScatter, ncclSum or ncclAvg
//   AllReduce      ncclAllReduce in place
//   Broadcast      ncclBroadcast in place
//   Barrier        ncclAllReduce of one f32 element
// F32 and BF16 (ncclFloat32 / ncclBfloat16). bytes_sent() counts what the ring
// algorithm sends (n = count * element size, W = world size):
//   AllGather, ReduceScatter  (W-1) * n, i.e. (W-1)/W of the full buffer
//   AllReduce                 2 (W-1)/W * n
//   Broadcast                 n, except 0 for the rank before the root in the ring
// These are the nominal figures of the ring algorithm (the ones nccl-tests'
// bus bandwidth is defined by); NCCL may pick trees, NVLS or CollNet, which
// send different amounts.
//
// Failures. A timeout is DEADLINE_EXCEEDED ("all_gather timed out after 5s
// (rank 1 of 2, tag 'gather', device 0)"); an NCCL error is a status carrying
// ncclGetErrorString and ncclGetLastError (UNAVAILABLE for ncclRemoteError and
// ncclSystemError, a peer or the network being gone). After either, or after
// Abort(), the NCCL communicator is aborted (ncclCommAbort) and every later
// call returns UNAVAILABLE naming the first failure: destroy this object and
// Create a new one (with a new tag or store generation).
//
// Device. Create binds the communicator to CUDA device `device`, and each call
// makes it the calling thread's current device (cudaSetDevice), so a thread
// may drive communicators of several devices; it does not restore the
// previous device.
//
// Thread safety. Calls on one instance are not thread-safe (see
// Communicator), except bytes_sent() and Abort(), which any thread may call at
// any time.
#ifndef ZEROSHARD_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define ZEROSHARD_WORKER_COMM_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/comm/kv_store.h"
#include "worker/cuda/cuda_device.h"  // CheckCudaDevice

struct ncclComm;  // ncclComm_t is ncclComm*; nccl.h stays out of this header

namespace zeroshard {

// The key rank 0 publishes the unique id of communicator `tag` at.
std::string NcclUniqueIdKey(const std::string& tag);

// Rank 0: creates an ncclUniqueId (ncclGetUniqueId, which needs no GPU) and
// publishes its raw bytes at NcclUniqueIdKey(tag). Other ranks: waits up to
// `timeout` for it. Returns the id's NCCL_UNIQUE_ID_BYTES raw bytes.
// DEADLINE_EXCEEDED (naming the key and tag) when rank 0 has not published in
// time; DATA_LOSS when the stored value has the wrong size; INVALID_ARGUMENT
// for a null store, negative rank or empty tag; the store's error otherwise.
absl::StatusOr<std::string> PublishOrFetchNcclUniqueId(KeyValueStore* store, int rank,
                                                       const std::string& tag,
                                                       absl::Duration timeout);

class NcclCommunicator : public Communicator {
 public:
  // Joins the `world_size` ranks of communicator `tag` on CUDA device
  // `device` (see the file comment). FAILED_PRECONDITION when there is no
  // such device (CheckCudaDevice's message); INVALID_ARGUMENT for bad
  // arguments; DEADLINE_EXCEEDED when the unique id or the peers do not
  // arrive within init_timeout; NCCL's and CUDA's errors otherwise.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(KeyValueStore* store, int rank,
                                                                  int world_size, int device,
                                                                  const std::string& tag,
                                                                  absl::Duration init_timeout);

  // Healthy: finalizes the communicator (bounded; aborts it if that does not
  // finish) and destroys it. Aborted: only frees the local resources.
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  const std::string& tag() const { return tag_; }
  int device() const { return device_; }
  // The stream every collective of this communicator runs on.
  cudaStream_t stream() const { return stream_; }

  absl::Status AllGather(const void* input, void* output, int64_t count, DType dtype,
                         absl::Duration timeout) override;
  absl::Status ReduceScatter(const void* input, void* output, int64_t count, DType dtype,
                             ReduceOp op, absl::Duration timeout) override;
  // Block layouts: packed into device staging (kept across calls) with
  // cudaMemcpyAsync, moved with ncclAllGather / ncclReduceScatter over the
  // largest shard, and unpacked the same way.
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

  CollectiveBytes bytes_sent() const override;

  // Aborts the communicator (ncclCommAbort): for when the server reports a
  // new generation and the ranks of this one will never complete a
  // collective. A collective waiting in another thread returns ABORTED
  // promptly; every later call returns UNAVAILABLE. Returns once the NCCL
  // communicator is aborted. Idempotent.
  void Abort() override;

  // OK while usable; otherwise the status of the failure (or Abort) that
  // broke it.
  absl::Status health() const;
  // For tests that must abort while a collective is in progress rather than
  // sleep and hope: waits up to `timeout` until a call is inside NCCL (or
  // waiting for its stream); returns whether one is.
  bool AwaitCollectiveInFlight(absl::Duration timeout) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  NcclCommunicator(int rank, int world_size, int device, std::string tag, ncclComm* comm,
                   cudaStream_t stream, float* barrier_buffer);

  // Checks the common arguments and that the communicator is usable, marks a
  // call in progress, and makes device_ current. `name` is the collective
  // ("all_gather", ...). On OK the caller must end with Finish().
  absl::Status Begin(const char* name, int64_t count, DType dtype, absl::Duration timeout,
                     std::initializer_list<const void*> buffers);
  // Takes the result of enqueuing the collective, waits for it up to
  // `timeout` (aborting the communicator on any failure), clears the call in
  // progress, and returns the call's status. On OK adds `bytes` to `counter`.
  absl::Status Finish(const char* name, int enqueue_result, absl::Duration timeout,
                      std::atomic<int64_t>* counter, int64_t bytes);
  // Ends a call begun with Begin() with `status` (the result of Wait and any
  // work after it): as Finish.
  absl::Status Complete(absl::Status status, std::atomic<int64_t>* counter, int64_t bytes);
  // Device staging of at least `bytes` for the block collectives; grows.
  absl::StatusOr<char*> Staging(const char* name, size_t bytes);
  // Waits until the enqueued work is done; OK, or the status to fail with.
  absl::Status Wait(const char* name, int enqueue_result, absl::Duration timeout);
  // Aborts the NCCL communicator, recording `why` as the reason every later
  // call fails. Idempotent (the first reason stays).
  void AbortComm(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  std::string Where() const;

  const int rank_;
  const int world_size_;
  const int device_;
  const std::string tag_;
  const cudaStream_t stream_;
  float* const barrier_buffer_;  // one f32 on device_, for Barrier
  char* staging_ = nullptr;      // owned by the thread in a call
  size_t staging_bytes_ = 0;

  mutable absl::Mutex mu_;
  ncclComm* comm_ ABSL_GUARDED_BY(mu_);       // null once aborted or destroyed
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // OK while usable
  // Abort() from another thread asks the calling thread (which is using
  // comm_) to abort, rather than freeing comm_ under it.
  bool in_call_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> abort_requested_{false};

  std::atomic<int64_t> all_gather_bytes_{0};
  std::atomic<int64_t> reduce_scatter_bytes_{0};
  std::atomic<int64_t> all_reduce_bytes_{0};
  std::atomic<int64_t> broadcast_bytes_{0};
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_NCCL_COMMUNICATOR_H_
