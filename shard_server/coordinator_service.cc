#include "shard_server/coordinator_service.h"

#include <atomic>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "shard_server/auth/bearer_auth.h"
#include "shard_server/base/grpc_status.h"
#include "shard_server/observability/rank_views.h"

namespace zeroshard {
namespace {

constexpr int64_t kDefaultStoreTimeoutMs = 60'000;

// A unary call that is answered later (a join waiting for the barrier, a get
// waiting for its key). The owner of the pending operation finishes it; if
// the caller goes away first, `cancel` withdraws the operation, which then
// finishes the call with CANCELLED.
class HeldCall : public grpc::ServerUnaryReactor {
 public:
  explicit HeldCall(std::function<void(uint64_t)> cancel) : cancel_(std::move(cancel)) {}

  // Records the id of the pending operation (0: it already completed).
  void Hold(uint64_t id) {
    bool cancel_now = false;
    {
      absl::MutexLock lock(&mu_);
      id_ = id;
      cancel_now = cancelled_ && id != 0;
    }
    if (cancel_now) cancel_(id);
  }

  // Finishes the call once; later calls are ignored.
  void Complete(const grpc::Status& status) {
    if (!finished_.exchange(true)) Finish(status);
  }

  void OnCancel() override {
    uint64_t id = 0;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      id = id_;
    }
    if (id != 0) cancel_(id);
  }
  void OnDone() override { delete this; }

  // Released when the call is done: the request it was parsed from and the
  // request budget's hold on it. Set before Hold.
  void Keep(std::shared_ptr<void> keep) { keep_ = std::move(keep); }

 private:
  std::function<void(uint64_t)> cancel_;
  std::shared_ptr<void> keep_;
  std::atomic<bool> finished_{false};
  absl::Mutex mu_;
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// What a held StoreGet or StoreWait keeps alive until it is answered: the
// parsed request (its keys: a wait may name 131,072) and the reactor. The KV
// store counts it against the job's and the server's bounds. gRPC's own
// per-call state is not in it.
size_t HeldCallBytes(const google::protobuf::Message& request) {
  return request.SpaceUsedLong() + sizeof(HeldCall);
}

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace

CoordinatorService::CoordinatorService(Clock* clock, Membership* membership, KvStore* kv,
                                       PlanService* plans, JobCredentials* credentials,
                                       CheckpointService* checkpoints,
                                       const TelemetryAnalyzer* diagnosis, HistoryStore* history)
    : clock_(clock),
      membership_(membership),
      kv_(kv),
      plans_(plans),
      credentials_(credentials),
      no_checkpoints_(checkpoints == nullptr
                          ? std::make_unique<CheckpointService>(nullptr, membership, nullptr)
                          : nullptr),
      checkpoints_(checkpoints != nullptr ? checkpoints : no_checkpoints_.get()),
      diagnosis_(diagnosis),
      history_(history) {}

grpc::Status CoordinatorService::AdmitMember(grpc::CallbackServerContext* context,
                                             const v1::MemberCredentials& member) const {
  if (grpc::Status auth = Authorize(context, member.job_id()); !auth.ok()) return auth;
  return ToGrpcStatus(membership_->CheckMember(member));
}

grpc::Status CoordinatorService::CheckTimeout(int64_t timeout_ms) {
  if (timeout_ms >= 0) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("timeout_ms ", timeout_ms, " is negative"));
}

grpc::Status CoordinatorService::Authenticate(grpc::CallbackServerContext* context) const {
  return ToGrpcStatus(credentials_->Identify(context->client_metadata()).status());
}

grpc::Status CoordinatorService::Authorize(grpc::CallbackServerContext* context,
                                           absl::string_view job) const {
  return credentials_->Authorize(context->client_metadata(), job);
}

absl::Time CoordinatorService::Deadline(grpc::CallbackServerContext* context,
                                        int64_t timeout_ms) const {
  absl::Time deadline =
      clock_->Now() + absl::Milliseconds(timeout_ms > 0 ? timeout_ms : kDefaultStoreTimeoutMs);
  // The caller's own gRPC deadline, if sooner, less a margin: gRPC cancels
  // the call at that deadline, and the caller would read a bare "Deadline
  // Exceeded" instead of the server's answer (a join: how many had joined,
  // who is missing). A tenth of the time left, at most a second.
  absl::Time call_deadline = absl::FromChrono(context->deadline());
  if (call_deadline < absl::Now() + absl::Hours(24 * 365)) {
    const absl::Duration left = call_deadline - absl::Now();
    const absl::Duration margin = std::min(absl::Seconds(1), left / 10);
    deadline = std::min(deadline, clock_->Now() + left - margin);
  }
  return deadline;
}

grpc::ServerUnaryReactor* CoordinatorService::Join(grpc::CallbackServerContext* context,
                                                   const v1::JoinRequest* request,
                                                   v1::JoinResponse* response) {
  if (grpc::Status auth = Authorize(context, request->job_id()); !auth.ok()) {
    return FinishNow(context, auth);
  }
  if (worker_ids_ != nullptr) {
    absl::Status bound =
        worker_ids_->Check(CertificateIdentities(*context->auth_context()), request->worker_id());
    if (!bound.ok()) return FinishNow(context, ToGrpcStatus(bound));
  }
  auto* call = new HeldCall([this](uint64_t id) { membership_->CancelJoin(id); });
  absl::Time deadline = Deadline(context, /*timeout_ms=*/int64_t{1} << 50);
  uint64_t id = membership_->Join(*request, deadline,
                                  [call, response](absl::StatusOr<v1::JoinResponse> result) {
                                    if (result.ok()) *response = std::move(*result);
                                    call->Complete(ToGrpcStatus(result.status()));
                                  });
  call->Hold(id);
  return call;
}

grpc::ServerUnaryReactor* CoordinatorService::Leave(grpc::CallbackServerContext* context,
                                                    const v1::LeaveRequest* request,
                                                    v1::LeaveResponse* /*response*/) {
  if (grpc::Status auth = Authorize(context, request->member().job_id()); !auth.ok()) {
    return FinishNow(context, auth);
  }
  return FinishNow(context, ToGrpcStatus(membership_->Leave(request->member(), request)));
}

grpc::ServerUnaryReactor* CoordinatorService::EvictHost(grpc::CallbackServerContext* context,
                                                        const v1::EvictHostRequest* request,
                                                        v1::EvictHostResponse* response) {
  // The job's token (or the admin's), then the member's credentials, which
  // Membership::EvictHost checks (a member of the last formed generation).
  if (grpc::Status auth = Authorize(context, request->member().job_id()); !auth.ok()) {
    return FinishNow(context, auth);
  }
  absl::StatusOr<v1::EvictHostResponse> evicted = membership_->EvictHost(*request);
  if (evicted.ok()) *response = *std::move(evicted);
  return FinishNow(context, ToGrpcStatus(StillLeading(evicted.status())));
}

grpc::ServerUnaryReactor* CoordinatorService::UnfenceHost(grpc::CallbackServerContext* context,
                                                          const v1::UnfenceHostRequest* request,
                                                          v1::UnfenceHostResponse* response) {
  absl::StatusOr<Caller> caller = credentials_->Identify(context->client_metadata());
  if (!caller.ok()) return FinishNow(context, ToGrpcStatus(caller.status()));
  // A job's own token must not lift what its members asked for: an
  // operator's call (the admin token), after the machine was checked.
  if (!caller->admin) {
    return FinishNow(context, grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                           "UnfenceHost needs the admin token (a job token "
                                           "cannot lift its own job's fences)"));
  }
  if (request->job_id().empty() || request->host().empty()) {
    return FinishNow(context, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                           "UnfenceHost needs job_id and host (a hostname, or "
                                           "the '<hostname> <boot id>' status shows)"));
  }
  absl::StatusOr<v1::UnfenceHostResponse> lifted =
      membership_->UnfenceHost(request->job_id(), request->host());
  if (lifted.ok()) *response = *std::move(lifted);
  return FinishNow(context, ToGrpcStatus(StillLeading(lifted.status())));
}

grpc::ServerUnaryReactor* CoordinatorService::StoreSet(grpc::CallbackServerContext* context,
                                                       const v1::StoreSetRequest* request,
                                                       v1::StoreSetResponse* /*response*/) {
  if (grpc::Status s = AdmitMember(context, request->member()); !s.ok()) {
    return FinishNow(context, s);
  }
  const v1::MemberCredentials& m = request->member();
  return FinishNow(context, ToGrpcStatus(StillLeading(kv_->Set(m.job_id(), m.generation(),
                                                               request->key(), request->value()))));
}

absl::Status CoordinatorService::StillLeading(absl::Status done) const {
  if (!done.ok() || !leadership_check_) return done;
  return leadership_check_();
}

grpc::ServerUnaryReactor* CoordinatorService::StoreGet(grpc::CallbackServerContext* context,
                                                       const v1::StoreGetRequest* request,
                                                       v1::StoreGetResponse* response) {
  if (grpc::Status s = AdmitMember(context, request->member()); !s.ok()) {
    return FinishNow(context, s);
  }
  if (grpc::Status s = CheckTimeout(request->timeout_ms()); !s.ok()) return FinishNow(context, s);
  const v1::MemberCredentials& m = request->member();
  auto* call = new HeldCall([this](uint64_t id) { kv_->Cancel(id); });
  uint64_t id = kv_->Get(
      m.job_id(), m.generation(), request->key(), Deadline(context, request->timeout_ms()),
      [call, response](absl::StatusOr<std::string> value) {
        if (value.ok()) response->set_value(std::move(*value));
        call->Complete(ToGrpcStatus(value.status()));
      },
      HeldCallBytes(*request));
  call->Hold(id);
  return call;
}

grpc::ServerUnaryReactor* CoordinatorService::StoreAdd(grpc::CallbackServerContext* context,
                                                       const v1::StoreAddRequest* request,
                                                       v1::StoreAddResponse* response) {
  if (grpc::Status s = AdmitMember(context, request->member()); !s.ok()) {
    return FinishNow(context, s);
  }
  const v1::MemberCredentials& m = request->member();
  absl::StatusOr<int64_t> value =
      kv_->Add(m.job_id(), m.generation(), request->key(), request->delta());
  if (value.ok()) response->set_value(*value);
  return FinishNow(context, ToGrpcStatus(StillLeading(value.status())));
}

grpc::ServerUnaryReactor* CoordinatorService::StoreWait(grpc::CallbackServerContext* context,
                                                        const v1::StoreWaitRequest* request,
                                                        v1::StoreWaitResponse* /*response*/) {
  return ServeStoreWait(context, *request, nullptr);
}

grpc::ServerUnaryReactor* CoordinatorService::ServeStoreWait(grpc::CallbackServerContext* context,
                                                             const v1::StoreWaitRequest& request,
                                                             std::shared_ptr<void> keep) {
  if (grpc::Status s = AdmitMember(context, request.member()); !s.ok()) {
    return FinishNow(context, s);
  }
  if (grpc::Status s = CheckTimeout(request.timeout_ms()); !s.ok()) return FinishNow(context, s);
  const v1::MemberCredentials& m = request.member();
  auto* call = new HeldCall([this](uint64_t id) { kv_->Cancel(id); });
  call->Keep(std::move(keep));
  std::vector<std::string> keys(request.keys().begin(), request.keys().end());
  uint64_t id = kv_->Wait(
      m.job_id(), m.generation(), std::move(keys), Deadline(context, request.timeout_ms()),
      [call](absl::Status status) { call->Complete(ToGrpcStatus(status)); },
      HeldCallBytes(request));
  call->Hold(id);
  return call;
}

grpc::ServerUnaryReactor* CoordinatorService::StoreCompareSet(
    grpc::CallbackServerContext* context, const v1::StoreCompareSetRequest* request,
    v1::StoreCompareSetResponse* response) {
  return FinishNow(context, CompareAndSet(context, *request, response));
}

grpc::Status CoordinatorService::CompareAndSet(grpc::CallbackServerContext* context,
                                               const v1::StoreCompareSetRequest& request,
                                               v1::StoreCompareSetResponse* response) {
  if (grpc::Status s = AdmitMember(context, request.member()); !s.ok()) return s;
  const v1::MemberCredentials& m = request.member();
  absl::StatusOr<std::string> value = kv_->CompareSet(m.job_id(), m.generation(), request.key(),
                                                      request.expected(), request.desired());
  if (value.ok()) response->set_value(std::move(*value));
  return ToGrpcStatus(StillLeading(value.status()));
}

grpc::ServerUnaryReactor* CoordinatorService::StoreDelete(grpc::CallbackServerContext* context,
                                                          const v1::StoreDeleteRequest* request,
                                                          v1::StoreDeleteResponse* response) {
  if (grpc::Status s = AdmitMember(context, request->member()); !s.ok()) {
    return FinishNow(context, s);
  }
  const v1::MemberCredentials& m = request->member();
  absl::StatusOr<bool> deleted = kv_->Delete(m.job_id(), m.generation(), request->key());
  if (deleted.ok()) response->set_deleted(*deleted);
  return FinishNow(context, ToGrpcStatus(StillLeading(deleted.status())));
}

grpc::ServerUnaryReactor* CoordinatorService::StoreCheck(grpc::CallbackServerContext* context,
                                                         const v1::StoreCheckRequest* request,
                                                         v1::StoreCheckResponse* response) {
  return FinishNow(context, CheckKeys(context, *request, response));
}

grpc::Status CoordinatorService::CheckKeys(grpc::CallbackServerContext* context,
                                           const v1::StoreCheckRequest& request,
                                           v1::StoreCheckResponse* response) {
  if (grpc::Status s = AdmitMember(context, request.member()); !s.ok()) return s;
  const v1::MemberCredentials& m = request.member();
  std::vector<std::string> keys(request.keys().begin(), request.keys().end());
  absl::StatusOr<bool> all = kv_->Check(m.job_id(), m.generation(), keys);
  if (all.ok()) response->set_all_exist(*all);
  return ToGrpcStatus(all.status());
}

grpc::Status CoordinatorService::TakeAndParse(const grpc::ByteBuffer& wire,
                                              absl::string_view method,
                                              google::protobuf::Message* request,
                                              std::unique_ptr<RequestBudget::Hold>* hold) {
  if (budget_ != nullptr) {
    absl::StatusOr<size_t> parsed = RequestBudget::ParsedBytes(wire);
    if (!parsed.ok()) return ToGrpcStatus(parsed.status());
    // The bytes, the parsed request and the copy the handler hands the KV
    // store (a wait's or check's keys, a set's value).
    absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> taken =
        budget_->Take(wire.Length() + 2 * *parsed, method);
    if (!taken.ok()) return ToGrpcStatus(taken.status());
    *hold = *std::move(taken);
  }
  grpc::ByteBuffer shared(wire);  // the same slices; parsing consumes this reference
  grpc::ProtoBufferReader reader(&shared);
  if (!request->ParseFromZeroCopyStream(&reader)) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat("the ", method, " request could not be parsed"));
  }
  return grpc::Status::OK;
}

namespace {

// `message` serialized into a raw call's response.
void Serialize(const google::protobuf::Message& message, grpc::ByteBuffer* response) {
  bool own = false;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(message, response,
                                                                             &own);
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::StoreSet(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* wire,
                                                       grpc::ByteBuffer* response) {
  v1::StoreSetRequest request;
  std::unique_ptr<RequestBudget::Hold> hold;
  if (grpc::Status s = TakeAndParse(*wire, "StoreSet", &request, &hold); !s.ok()) {
    return FinishNow(context, s);
  }
  // Answered before this returns: the request and the hold may go then.
  Serialize(v1::StoreSetResponse(), response);
  v1::StoreSetResponse ignored;
  return StoreSet(context, &request, &ignored);
}

grpc::ServerUnaryReactor* CoordinatorService::StoreWait(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* wire,
                                                        grpc::ByteBuffer* response) {
  auto request = std::make_shared<v1::StoreWaitRequest>();
  std::unique_ptr<RequestBudget::Hold> hold;
  if (grpc::Status s = TakeAndParse(*wire, "StoreWait", request.get(), &hold); !s.ok()) {
    return FinishNow(context, s);
  }
  Serialize(v1::StoreWaitResponse(), response);
  // Held with the call: a held wait keeps its request (the KV store counts
  // it too) and its place in the budget.
  std::shared_ptr<RequestBudget::Hold> held = std::move(hold);
  const v1::StoreWaitRequest& parsed = *request;
  return ServeStoreWait(
      context, parsed,
      std::make_shared<
          std::pair<std::shared_ptr<v1::StoreWaitRequest>, std::shared_ptr<RequestBudget::Hold>>>(
          std::move(request), std::move(held)));
}

grpc::ServerUnaryReactor* CoordinatorService::StoreCompareSet(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* wire,
                                                              grpc::ByteBuffer* response) {
  v1::StoreCompareSetRequest request;
  std::unique_ptr<RequestBudget::Hold> hold;
  if (grpc::Status s = TakeAndParse(*wire, "StoreCompareSet", &request, &hold); !s.ok()) {
    return FinishNow(context, s);
  }
  v1::StoreCompareSetResponse answer;
  grpc::Status status = CompareAndSet(context, request, &answer);
  if (status.ok()) Serialize(answer, response);
  return FinishNow(context, status);
}

grpc::ServerUnaryReactor* CoordinatorService::StoreCheck(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* wire,
                                                         grpc::ByteBuffer* response) {
  v1::StoreCheckRequest request;
  std::unique_ptr<RequestBudget::Hold> hold;
  if (grpc::Status s = TakeAndParse(*wire, "StoreCheck", &request, &hold); !s.ok()) {
    return FinishNow(context, s);
  }
  v1::StoreCheckResponse answer;
  grpc::Status status = CheckKeys(context, request, &answer);
  if (status.ok()) Serialize(answer, response);
  return FinishNow(context, status);
}

grpc::ServerUnaryReactor* CoordinatorService::StoreNumKeys(grpc::CallbackServerContext* context,
                                                           const v1::StoreNumKeysRequest* request,
                                                           v1::StoreNumKeysResponse* response) {
  if (grpc::Status s = AdmitMember(context, request->member()); !s.ok()) {
    return FinishNow(context, s);
  }
  const v1::MemberCredentials& m = request->member();
  response->set_num_keys(kv_->NumKeys(m.job_id(), m.generation()));
  return FinishNow(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::GetStatus(grpc::CallbackServerContext* context,
                                                        const v1::GetStatusRequest* request,
                                                        v1::GetStatusResponse* response) {
  absl::StatusOr<Caller> caller = credentials_->Identify(context->client_metadata());
  if (!caller.ok()) return FinishNow(context, ToGrpcStatus(caller.status()));
  // A job token sees its own job only; another job reads as absent.
  const std::string job = caller->admin ? request->job_id() : caller->job;
  if (!caller->admin && !request->job_id().empty() && request->job_id() != caller->job) {
    return FinishNow(context, grpc::Status(grpc::StatusCode::NOT_FOUND,
                                           absl::StrCat("no job '", request->job_id(), "'")));
  }
  *response = membership_->Status(job);
  for (v1::JobStatus& job : *response->mutable_jobs()) {
    job.set_plan_hash(plans_->PlanHash(job.job_id()));
  }
  if (diagnosis_ != nullptr) diagnosis_->Annotate(response);
  SummarizeLargeJobs(*request, response);
  if (control_plane_) control_plane_(response->mutable_control_plane());
  if (!job.empty() && response->jobs().empty()) {
    return FinishNow(context,
                     grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("no job '", job, "'")));
  }
  return FinishNow(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::GetHistory(grpc::CallbackServerContext* context,
                                                         const v1::GetHistoryRequest* request,
                                                         v1::GetHistoryResponse* response) {
  if (grpc::Status auth = Authorize(context, request->job_id()); !auth.ok()) {
    return FinishNow(context, auth);
  }
  absl::StatusOr<std::vector<v1::HistoryPoint>> points =
      history_ == nullptr ? std::vector<v1::HistoryPoint>()
                          : history_->Points(request->job_id(), request->rank());
  if (!points.ok()) return FinishNow(context, ToGrpcStatus(points.status()));
  if (points->empty()) {
    return FinishNow(
        context,
        grpc::Status(
            grpc::StatusCode::NOT_FOUND,
            absl::StrCat("no history for job '", request->job_id(), "'",
                         request->rank() >= 0 ? absl::StrCat(" rank ", request->rank()) : "")));
  }
  for (v1::HistoryPoint& p : *points) *response->add_points() = std::move(p);
  return FinishNow(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::PlanShards(grpc::CallbackServerContext* context,
                                                         const v1::PlanShardsRequest* request,
                                                         v1::PlanShardsResponse* response) {
  const v1::MemberCredentials& m = request->member();
  // A one-off plan (no member) touches no job: any valid token may ask.
  if (grpc::Status auth =
          m.job_id().empty() ? Authenticate(context) : Authorize(context, m.job_id());
      !auth.ok()) {
    return FinishNow(context, auth);
  }
  absl::StatusOr<v1::ShardPlan> plan;
  if (m.job_id().empty()) {
    // Not a member: a one-off plan (shardctl plan), nothing stored.
    plan = plans_->Plan("", 0, request->world_size(), request->spec(), request->options());
  } else {
    if (absl::Status s = membership_->CheckMember(m); !s.ok()) {
      return FinishNow(context, ToGrpcStatus(s));
    }
    absl::StatusOr<int> world_size = membership_->WorldSize(m.job_id());
    if (!world_size.ok()) return FinishNow(context, ToGrpcStatus(world_size.status()));
    plan =
        plans_->Plan(m.job_id(), m.generation(), *world_size, request->spec(), request->options());
  }
  if (plan.ok()) *response->mutable_plan() = std::move(*plan);
  return FinishNow(context, ToGrpcStatus(plan.status()));
}

grpc::ServerUnaryReactor* CoordinatorService::CommitShard(grpc::CallbackServerContext* context,
                                                          const v1::CommitShardRequest* request,
                                                          v1::CommitShardResponse* response) {
  return checkpoints_->CommitShard(context, Authorize(context, request->member().job_id()), request,
                                   response);
}

grpc::ServerReadReactor<v1::UploadShardRequest>* CoordinatorService::UploadShard(
    grpc::CallbackServerContext* context, v1::UploadShardResponse* response) {
  return checkpoints_->UploadShard(context, credentials_->Identify(context->client_metadata()),
                                   response);
}

grpc::ServerUnaryReactor* CoordinatorService::ListCheckpoints(
    grpc::CallbackServerContext* context, const v1::ListCheckpointsRequest* request,
    v1::ListCheckpointsResponse* response) {
  return checkpoints_->ListCheckpoints(context, Authorize(context, request->job_id()), request,
                                       response);
}

grpc::ServerWriteReactor<v1::ConsolidateResponse>* CoordinatorService::Consolidate(
    grpc::CallbackServerContext* context, const v1::ConsolidateRequest* request) {
  return checkpoints_->Consolidate(context, Authorize(context, request->job_id()), request);
}

}  // namespace zeroshard
