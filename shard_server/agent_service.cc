#include "shard_server/agent_service.h"

#include <atomic>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "shard_server/grpc_status.h"

namespace zeroshard {
namespace {

// Stream ids of ranks beating through an agent. The top bit keeps them apart
// from the ids of direct Heartbeat streams (coordinator_service.cc counts
// those up from 1), so that a rank moving between its own stream and an
// agent's is told apart like a rank moving between two streams.
uint64_t NextAgentRankStreamId() {
  static std::atomic<uint64_t> next{1};
  return (uint64_t{1} << 63) | next.fetch_add(1, std::memory_order_relaxed);
}

// RankAnswer and HostJoinResponse carry a refusal the same way.
template <typename Answer>
void SetError(const absl::Status& status, Answer* answer) {
  answer->set_error_code(static_cast<int32_t>(status.code()));
  answer->set_error_message(std::string(status.message()));
}

// One agent's stream: read a batch of its ranks' beats, answer each, read the
// next. Only the reactor's own callbacks touch its members, one at a time.
class HostHeartbeatStream
    : public grpc::ServerBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse> {
 public:
  HostHeartbeatStream(Membership* membership, ServerMetrics* metrics, EventLog* log,
                      const absl::StatusOr<Caller>& caller)
      : membership_(membership), metrics_(metrics), log_(log), caller_(caller.value_or(Caller())) {
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the agent closed its side, or its process or host is gone
      CloseEveryRank();
      Finish(grpc::Status::OK);
      return;
    }
    if (node_.empty() && log_ != nullptr) {
      log_->Log("agent_stream_opened", {{"node", request_.node()}});
    }
    node_ = request_.node().empty() ? "unnamed" : request_.node();
    for (const v1::RankStreamClosed& closed : request_.closed()) CloseRank(closed);
    response_.Clear();
    for (const v1::RankBeat& beat : request_.beats()) Answer(beat, response_.add_answers());
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      CloseEveryRank();
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "host heartbeat stream broken"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  // A rank's stream to the agent, as the server knows it.
  struct RankStream {
    uint64_t id = 0;  // the stream id Membership knows the rank's beats by
    v1::MemberCredentials member;  // of its latest beat
  };

  void Answer(const v1::RankBeat& beat, v1::RankAnswer* answer) {
    const v1::MemberCredentials& member = beat.beat().member();
    if (grpc::Status allowed = caller_.MayActOn(member.job_id()); !allowed.ok()) {
      answer->set_error_code(allowed.error_code());
      answer->set_error_message(allowed.error_message());
      return;
    }
    if (beat.local_stream() == 0) {
      SetError(absl::InvalidArgumentError("RankBeat.local_stream is 0; name the rank's stream"),
               answer);
      return;
    }
    RankStream& stream = ranks_[beat.local_stream()];
    if (stream.id == 0) stream.id = NextAgentRankStreamId();
    stream.member = member;
    if (metrics_ != nullptr) metrics_->AddHeartbeat();
    absl::StatusOr<v1::HeartbeatResponse> response = membership_->Heartbeat(beat.beat(), stream.id);
    if (!response.ok()) {
      SetError(response.status(), answer);
      return;
    }
    *answer->mutable_response() = *std::move(response);
  }

  // The agent saw the rank's stream close: as if its own stream to us closed.
  void CloseRank(const v1::RankStreamClosed& closed) {
    auto it = ranks_.find(closed.local_stream());
    if (it == ranks_.end()) return;  // never beat through us: nothing to close
    membership_->HeartbeatStreamClosed(it->second.member, it->second.id);
    ranks_.erase(it);
  }

  // The agent's stream is gone, and with it every rank stream it carried.
  void CloseEveryRank() {
    if (log_ != nullptr && !ranks_.empty()) {
      log_->Log("agent_stream_closed",
                {{"node", node_}, {"rank_streams", absl::StrCat(ranks_.size())}});
    }
    for (const auto& [local, stream] : ranks_) {
      membership_->HeartbeatStreamClosed(stream.member, stream.id);
    }
    ranks_.clear();
  }

  Membership* const membership_;
  ServerMetrics* const metrics_;  // may be null
  EventLog* const log_;           // may be null
  const Caller caller_;
  std::string node_;
  absl::flat_hash_map<uint64_t, RankStream> ranks_;  // by the agent's local stream id
  v1::HostHeartbeatRequest request_;
  v1::HostHeartbeatResponse response_;
};

// The joins of one host: each held by Membership as a Join is; the answers
// written as they come, one write at a time; the call finished when every
// join is answered and written.
class HostJoinCall : public grpc::ServerWriteReactor<v1::HostJoinResponse> {
 public:
  explicit HostJoinCall(Membership* membership) : membership_(membership) {}

  // Starts every join of `request`; a join the caller may not make is
  // answered with why at once.
  // `bound`: OK when the call's client certificate may join as the worker id
  // (worker_id_binding.h).
  void Start(const v1::HostJoinRequest& request, const absl::StatusOr<Caller>& caller,
             const std::function<absl::Status(const std::string&)>& bound, absl::Time deadline) {
    {
      absl::MutexLock lock(&mu_);
      // One more than the joins until this loop is over: the call cannot
      // finish (and delete itself) under it.
      unanswered_ = request.joins_size() + 1;
      ids_.assign(request.joins_size(), 0);
      answered_.assign(request.joins_size(), false);
    }
    for (int i = 0; i < request.joins_size(); ++i) {
      const v1::JoinRequest& join = request.joins(i);
      grpc::Status allowed =
          caller.ok() ? caller->MayActOn(join.job_id()) : ToGrpcStatus(caller.status());
      if (!allowed.ok()) {
        Answered(i, absl::Status(static_cast<absl::StatusCode>(allowed.error_code()),
                                 allowed.error_message()));
        continue;
      }
      if (absl::Status s = bound(join.worker_id()); !s.ok()) {
        Answered(i, s);
        continue;
      }
      uint64_t id = membership_->Join(
          join, deadline, [this, i](absl::StatusOr<v1::JoinResponse> r) { Answered(i, std::move(r)); });
      absl::MutexLock lock(&mu_);
      if (answered_[i]) continue;
      ids_[i] = id;
      if (cancelled_ && id != 0) to_cancel_.push_back(id);
    }
    CancelCollected();
    {
      absl::MutexLock lock(&mu_);
      --unanswered_;
    }
    Pump();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      for (uint64_t id : ids_) {
        if (id != 0) to_cancel_.push_back(id);
      }
    }
    CancelCollected();
  }

  void OnWriteDone(bool /*ok*/) override {
    // A failed write (the agent went away) still counts as done: the joins
    // are cancelled (OnCancel) and their answers dropped.
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
    }
    Pump();
  }

  void OnDone() override { delete this; }

 private:
  void Answered(int index, absl::StatusOr<v1::JoinResponse> result) {
    v1::HostJoinResponse answer;
    answer.set_index(index);
    if (result.ok()) {
      *answer.mutable_response() = *std::move(result);
    } else {
      SetError(result.status(), &answer);
    }
    {
      absl::MutexLock lock(&mu_);
      ids_[index] = 0;
      answered_[index] = true;
      --unanswered_;
      queue_.push_back(std::move(answer));
    }
    Pump();
  }

  // Writes the next answer, or finishes the call once every join is
  // answered and written. gRPC is called outside mu_: it may run the next
  // reaction on this thread.
  void Pump() {
    enum { kNothing, kWrite, kFinish } action = kNothing;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      if (!queue_.empty()) {
        writing_ = true;
        current_ = std::move(queue_.front());
        queue_.pop_front();
        action = kWrite;
      } else if (unanswered_ == 0) {
        finished_ = true;
        action = kFinish;
      }
    }
    // current_ is only touched again after OnWriteDone (writing_ guards it).
    if (action == kWrite) StartWrite(&current_);
    if (action == kFinish) Finish(grpc::Status::OK);
  }

  void CancelCollected() {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&mu_);
      ids.swap(to_cancel_);
    }
    for (uint64_t id : ids) membership_->CancelJoin(id);
  }

  Membership* const membership_;
  absl::Mutex mu_;
  int unanswered_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> ids_ ABSL_GUARDED_BY(mu_);  // pending joins' ids by index (0: none)
  std::vector<bool> answered_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> to_cancel_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::HostJoinResponse> queue_ ABSL_GUARDED_BY(mu_);
  v1::HostJoinResponse current_;  // the answer being written (while writing_)
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

HostAgentService::HostAgentService(Clock* clock, Membership* membership,
                                   JobCredentials* credentials, ServerMetrics* metrics,
                                   EventLog* log)
    : clock_(clock),
      membership_(membership),
      credentials_(credentials),
      metrics_(metrics),
      log_(log) {}

grpc::ServerBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>*
HostAgentService::HostHeartbeat(grpc::CallbackServerContext* context) {
  return new HostHeartbeatStream(membership_, metrics_, log_,
                                 credentials_->Identify(context->client_metadata()));
}

grpc::ServerWriteReactor<v1::HostJoinResponse>* HostAgentService::HostJoin(
    grpc::CallbackServerContext* context, const v1::HostJoinRequest* request) {
  auto* call = new HostJoinCall(membership_);
  // Membership caps a join's wait at its join timeout; the caller's own
  // deadline, if sooner, ends the call (OnCancel withdraws the joins).
  absl::Time deadline = clock_->Now() + absl::Hours(24 * 365);
  absl::Time call_deadline = absl::FromChrono(context->deadline());
  if (call_deadline < absl::Now() + absl::Hours(24 * 365)) {
    deadline = clock_->Now() + (call_deadline - absl::Now());
  }
  std::vector<std::string> identities;
  if (worker_ids_ != nullptr) identities = CertificateIdentities(*context->auth_context());
  call->Start(
      *request, credentials_->Identify(context->client_metadata()),
      [&](const std::string& worker_id) {
        return worker_ids_ == nullptr ? absl::OkStatus() : worker_ids_->Check(identities, worker_id);
      },
      deadline);
  return call;
}

}  // namespace zeroshard
