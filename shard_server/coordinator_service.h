// The zeroshard.v1.Coordinator gRPC service: adapts calls to Membership,
// KvStore and the planner, with the callback API so that held calls (joins
// waiting for the barrier, gets waiting for a key) cost no thread.
// Authentication (a bearer token) is checked here, at the edge. Heartbeat
// streams are served on the server's call queues (heartbeat_streams.h) with the async
// API: their cost per beat must not grow with the open streams.
#ifndef ZEROSHARD_SHARD_SERVER_COORDINATOR_SERVICE_H_
#define ZEROSHARD_SHARD_SERVER_COORDINATOR_SERVICE_H_

#include <functional>
#include <memory>
#include <string>

#include "common/request_budget.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/checkpoint/checkpoint_service.h"
#include "shard_server/base/clock.h"
#include "shard_server/heartbeat_streams.h"
#include "shard_server/auth/job_credentials.h"
#include "shard_server/kv/kv_store.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/history_store.h"
#include "shard_server/observability/telemetry_analyzer.h"
#include "shard_server/plan_service.h"
#include "shard_server/auth/worker_id_binding.h"

namespace zeroshard {

class CoordinatorService final : public HeartbeatAsyncService {
 public:
  // `credentials`: who may act on which job (not owned). `checkpoints` null: the
  // checkpoint RPCs answer FAILED_PRECONDITION. `diagnosis` adds hang and
  // straggler diagnoses to GetStatus. Pointers are not owned.
  CoordinatorService(Clock* clock, Membership* membership, KvStore* kv, PlanService* plans,
                     JobCredentials* credentials, CheckpointService* checkpoints = nullptr,
                     const TelemetryAnalyzer* diagnosis = nullptr, HistoryStore* history = nullptr);

  // GetStatus's control_plane (replicated_server.h); unset: a single server.
  // Call before serving.
  void SetControlPlaneSource(std::function<void(v1::ControlPlaneStatus*)> source) {
    control_plane_ = std::move(source);
  }

  // Replicated (etcd): OK while this server still holds its leadership. A
  // KV write is answered OK only if the check passes after it was applied,
  // so that a server paused past its lease acknowledges none of the writes
  // queued meanwhile (the next leader's store would not have them). Unset:
  // a single server. Call before serving.
  void SetLeadershipCheck(std::function<absl::Status()> check) {
    leadership_check_ = std::move(check);
  }

  // With mutual TLS: the worker ids each client certificate may join as
  // (null: any). Not owned; call before serving.
  void SetWorkerIdBinding(const WorkerIdBinding* binding) { worker_ids_ = binding; }

  // What large requests in flight may hold (request_budget.h); null: not
  // counted. Not owned; call before serving.
  void SetRequestBudget(RequestBudget* budget) { budget_ = budget; }

  // StoreSet, StoreWait, StoreCheck and StoreCompareSet as gRPC serves
  // them: the request's bytes are held in the request budget (refused
  // RESOURCE_EXHAUSTED beyond it) before they are parsed, until the call
  // ends (#44 finding 7).
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* StoreWait(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* StoreCheck(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* StoreCompareSet(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  // Numerical integrity: a member evicts a corrupted rank's machine; an
  // admin lifts the fence (shardctl unfence).
  grpc::ServerUnaryReactor* EvictHost(grpc::CallbackServerContext* context,
                                      const v1::EvictHostRequest* request,
                                      v1::EvictHostResponse* response) override;
  grpc::ServerUnaryReactor* UnfenceHost(grpc::CallbackServerContext* context,
                                        const v1::UnfenceHostRequest* request,
                                        v1::UnfenceHostResponse* response) override;
  // The same on parsed requests (the fuzzers call these).
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* context,
                                     const v1::StoreSetRequest* request,
                                     v1::StoreSetResponse* response);
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* context,
                                     const v1::StoreGetRequest* request,
                                     v1::StoreGetResponse* response) override;
  grpc::ServerUnaryReactor* StoreAdd(grpc::CallbackServerContext* context,
                                     const v1::StoreAddRequest* request,
                                     v1::StoreAddResponse* response) override;
  grpc::ServerUnaryReactor* StoreWait(grpc::CallbackServerContext* context,
                                      const v1::StoreWaitRequest* request,
                                      v1::StoreWaitResponse* response);
  grpc::ServerUnaryReactor* StoreCompareSet(grpc::CallbackServerContext* context,
                                            const v1::StoreCompareSetRequest* request,
                                            v1::StoreCompareSetResponse* response);
  grpc::ServerUnaryReactor* StoreDelete(grpc::CallbackServerContext* context,
                                        const v1::StoreDeleteRequest* request,
                                        v1::StoreDeleteResponse* response) override;
  grpc::ServerUnaryReactor* StoreCheck(grpc::CallbackServerContext* context,
                                       const v1::StoreCheckRequest* request,
                                       v1::StoreCheckResponse* response);
  grpc::ServerUnaryReactor* StoreNumKeys(grpc::CallbackServerContext* context,
                                         const v1::StoreNumKeysRequest* request,
                                         v1::StoreNumKeysResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* PlanShards(grpc::CallbackServerContext* context,
                                       const v1::PlanShardsRequest* request,
                                       v1::PlanShardsResponse* response) override;

  // Checkpoints: authenticated here, served by CheckpointService.
  grpc::ServerUnaryReactor* CommitShard(grpc::CallbackServerContext* context,
                                        const v1::CommitShardRequest* request,
                                        v1::CommitShardResponse* response) override;
  grpc::ServerReadReactor<v1::UploadShardRequest>* UploadShard(
      grpc::CallbackServerContext* context, v1::UploadShardResponse* response) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const v1::ListCheckpointsRequest* request,
                                            v1::ListCheckpointsResponse* response) override;
  grpc::ServerWriteReactor<v1::ConsolidateResponse>* Consolidate(
      grpc::CallbackServerContext* context, const v1::ConsolidateRequest* request) override;

  // The job's per-step history; NOT_FOUND when the server keeps none.
  grpc::ServerUnaryReactor* GetHistory(grpc::CallbackServerContext* context,
                                       const v1::GetHistoryRequest* request,
                                       v1::GetHistoryResponse* response) override;

  // OK, or UNAUTHENTICATED / PERMISSION_DENIED saying what is missing.
  // The bearer token (admin, or the member's job's), then the member's
  // credentials (generation, token).
  grpc::Status AdmitMember(grpc::CallbackServerContext* context,
                           const v1::MemberCredentials& member) const;
  // INVALID_ARGUMENT for a negative timeout.
  static grpc::Status CheckTimeout(int64_t timeout_ms);
  // A valid token, admin or any job's.
  grpc::Status Authenticate(grpc::CallbackServerContext* context) const;
  // A token that may act on `job`: the admin's or that job's.
  grpc::Status Authorize(grpc::CallbackServerContext* context, absl::string_view job) const;

 private:
  absl::Time Deadline(grpc::CallbackServerContext* context, int64_t timeout_ms) const;
  // StoreWait on `request`; `keep` (may be null) is released when the call
  // ends: what the request's memory and budget hold belong to.
  grpc::ServerUnaryReactor* ServeStoreWait(grpc::CallbackServerContext* context,
                                           const v1::StoreWaitRequest& request,
                                           std::shared_ptr<void> keep);
  // StoreCompareSet's answer in `response`.
  grpc::Status CompareAndSet(grpc::CallbackServerContext* context,
                             const v1::StoreCompareSetRequest& request,
                             v1::StoreCompareSetResponse* response);
  // StoreCheck's answer in `response`.
  grpc::Status CheckKeys(grpc::CallbackServerContext* context, const v1::StoreCheckRequest& request,
                         v1::StoreCheckResponse* response);
  // Holds the raw `wire` (its bytes, the parsed request and the handler's
  // copy of its keys or value) in the budget and parses it into `request`;
  // the hold in `*hold`.
  grpc::Status TakeAndParse(const grpc::ByteBuffer& wire, absl::string_view method,
                            google::protobuf::Message* request,
                            std::unique_ptr<RequestBudget::Hold>* hold);

  Clock* const clock_;
  Membership* const membership_;
  KvStore* const kv_;
  PlanService* const plans_;
  JobCredentials* const credentials_;
  std::unique_ptr<CheckpointService> no_checkpoints_;  // when none was given
  CheckpointService* const checkpoints_;
  std::function<void(v1::ControlPlaneStatus*)> control_plane_;
  std::function<absl::Status()> leadership_check_;
  // `done` of a KV write, unless this server no longer leads (SetLeadershipCheck).
  absl::Status StillLeading(absl::Status done) const;
  const WorkerIdBinding* worker_ids_ = nullptr;  // null: any worker id
  RequestBudget* budget_ = nullptr;              // null: large requests not counted
  const TelemetryAnalyzer* const diagnosis_;     // may be null: GetStatus without diagnoses
  HistoryStore* const history_;                  // may be null: GetHistory finds nothing
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_COORDINATOR_SERVICE_H_
