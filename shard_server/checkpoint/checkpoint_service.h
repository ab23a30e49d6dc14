// The checkpoint RPCs of zeroshard.v1.Coordinator (CommitShard, UploadShard,
// ListCheckpoints, Consolidate) over the CheckpointRegistry and the
// Consolidator. CoordinatorService authenticates each call and hands it here.
//
// Threads: commits, uploads and listings run on gRPC's callback threads
// (short file and SQLite operations). A consolidation runs on a thread of
// its own that feeds a ServerWriteReactor one message at a time (the next
// message is built while the previous one is on the wire), so a slow reader
// holds the producer back instead of filling memory.
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_SERVICE_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_SERVICE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/container/flat_hash_map.h"

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/checkpoint/checkpoint_registry.h"
#include "shard_server/auth/job_credentials.h"
#include "shard_server/membership/membership.h"
#include "shard_server/base/event_log.h"

namespace zeroshard {

struct CheckpointServiceOptions {
  // Consolidations running at once; more are refused with RESOURCE_EXHAUSTED
  // (each holds a thread, a read buffer and a few messages).
  int max_consolidations = 4;
  int64_t read_buffer_bytes = 4 << 20;  // per consolidation
  // A streamed consolidation whose caller reads nothing for this long is
  // cancelled (DEADLINE_EXCEEDED for the caller, if it is still there), so
  // that a stalled reader cannot hold a slot forever.
  absl::Duration stall_timeout = absl::Seconds(60);
  // Bytes of checkpoint uploads in flight: an upload reserves the size_bytes
  // its first message announces (its temporary file under the root grows to
  // it) until it is published or removed. One job's uploads may reserve
  // max_upload_job_bytes, all jobs' max_upload_total_bytes; an upload past
  // either is refused with RESOURCE_EXHAUSTED before it writes a byte (the
  // worker abandons that checkpoint step and retries at its next interval).
  int64_t max_upload_job_bytes = int64_t{64} << 30;
  int64_t max_upload_total_bytes = int64_t{256} << 30;
  // Told of every completed consolidation (bytes written, seconds): the
  // metrics. Empty: no one.
  std::function<void(int64_t bytes, double seconds)> on_consolidated;
  // Tests only (shard_server --testing_hold_commit_of_rank): this rank's
  // CommitShard waits `testing_commit_hold` before it is recorded, so that a
  // test can kill the server while the commit is in flight, the other ranks'
  // commits of the step already saved. -1: none.
  int testing_hold_commit_of_rank = -1;
  absl::Duration testing_commit_hold = absl::ZeroDuration();
};

// Thread-safe.
class CheckpointService {
 public:
  // `registry` null: the server has no checkpoint root and every call is
  // answered FAILED_PRECONDITION. Pointers are not owned.
  CheckpointService(CheckpointRegistry* registry, Membership* membership, EventLog* log,
                    CheckpointServiceOptions options = {});
  // Waits for running consolidations (cancel their calls first: shut the
  // gRPC server down).
  ~CheckpointService();

  // `auth` is the result of authenticating the call; not OK finishes it.
  grpc::ServerUnaryReactor* CommitShard(grpc::CallbackServerContext* context,
                                        const grpc::Status& auth,
                                        const v1::CommitShardRequest* request,
                                        v1::CommitShardResponse* response);
  // `caller`: who the call's token proved; the upload's job (in its first
  // message) must be one the caller may act on.
  grpc::ServerReadReactor<v1::UploadShardRequest>* UploadShard(grpc::CallbackServerContext* context,
                                                               const absl::StatusOr<Caller>& caller,
                                                               v1::UploadShardResponse* response);
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const grpc::Status& auth,
                                            const v1::ListCheckpointsRequest* request,
                                            v1::ListCheckpointsResponse* response);
  grpc::ServerWriteReactor<v1::ConsolidateResponse>* Consolidate(
      grpc::CallbackServerContext* context, const grpc::Status& auth,
      const v1::ConsolidateRequest* request);

  // Blocks until no consolidation is running.
  void WaitIdle();

 private:
  friend class UploadReactor;
  friend class ConsolidateReactor;

  // OK when the server has a checkpoint root.
  grpc::Status Available() const;
  // Reserves a consolidation slot; RESOURCE_EXHAUSTED when all are taken.
  grpc::Status BeginConsolidation();
  void EndConsolidation();
  // Reserves `bytes` of uploads in flight for `job`; RESOURCE_EXHAUSTED
  // naming the job, the bound and its flag when that passes a bound.
  absl::Status ReserveUpload(const std::string& job, int64_t bytes);
  void ReleaseUpload(const std::string& job, int64_t bytes);

  CheckpointRegistry* const registry_;
  Membership* const membership_;
  EventLog* const log_;
  const CheckpointServiceOptions options_;
  absl::Mutex mu_;
  int consolidations_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes reserved by uploads in flight, per job (no entry: 0) and in all.
  absl::flat_hash_map<std::string, int64_t> upload_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t upload_total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_SERVICE_H_
