#include "shard_server/agent_service.h"

#include <atomic>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/arena.h"
#include "grpcpp/alarm.h"
#include "shard_server/base/grpc_status.h"

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

// Rank streams one HostHeartbeat stream may carry at once: a host's ranks
// (8 a host at scale, docs/scale.md), with room for many more.
constexpr size_t kMaxRankStreamsPerAgentStream = 4096;

// RankAnswer and HostJoinAnswer carry a refusal the same way.
template <typename Answer>
void SetError(const absl::Status& status, Answer* answer) {
  answer->set_error_code(static_cast<int32_t>(status.code()));
  answer->set_error_message(std::string(status.message()));
}

// One agent's stream: read a batch of its ranks' beats, answer each, read the
// next. Every step runs on its queue's thread, one at a time: no lock.
class HostHeartbeatCall final : public CallQueues::Call {
 public:
  enum Step { kAccepted, kRead, kWritten, kFinished };

  // Asks for the next agent stream to arrive on `queue`.
  HostHeartbeatCall(CallQueues* queues, HostAgentServices services,
                    grpc::ServerCompletionQueue* queue)
      : Call(queues),
        queues_(queues),
        services_(services),
        queue_(queue),
        stream_(&context_),
        arena_(ArenaOptionsForAMessage()) {
    NewMessages();
    services_.service->RequestHostHeartbeat(&context_, &stream_, queue_, queue_, &accepted_);
  }

  void Proceed(int step, bool ok) override {
    switch (step) {
      case kAccepted:
        return Accepted(ok);
      case kRead:
        return RequestRead(ok);
      case kWritten:
        return ResponseWritten(ok);
      default:
        return End();
    }
  }

 private:
  // A rank's stream to the agent, as the server knows it.
  struct RankStream {
    uint64_t id = 0;  // the stream id Membership knows the rank's beats by
    v1::MemberCredentials member;  // of its latest beat
  };

  // A host's message of beats and its answer live on an arena, freed at once
  // when the answer is written: parsed onto the heap, the ranks' strings and
  // sub-messages were ~80 mallocs and frees per message, every second, per
  // host (perf: malloc and free 14 % of the server at 32K ranks).
  static google::protobuf::ArenaOptions ArenaOptionsForAMessage() {
    google::protobuf::ArenaOptions options;
    options.start_block_size = 1024;  // an idle stream's empty messages
    options.max_block_size = 64 << 10;
    return options;
  }

  void NewMessages() {
    arena_.Reset();
    request_ = google::protobuf::Arena::CreateMessage<v1::HostHeartbeatRequest>(&arena_);
    response_ = google::protobuf::Arena::CreateMessage<v1::HostHeartbeatResponse>(&arena_);
  }

  void Accepted(bool ok) {
    if (!ok) return End();  // the server is shutting down: no stream came
    new HostHeartbeatCall(queues_, services_, queue_);  // the next stream on this queue
    absl::StatusOr<Caller> caller = services_.credentials->Identify(context_.client_metadata());
    if (!caller.ok()) return Finish(ToGrpcStatus(caller.status()));
    caller_ = *std::move(caller);
    identified_ = absl::Now();
    stream_.Read(request_, &read_);
  }

  // A job token is checked again at most once a second: a revoked one (its
  // file removed) ends the stream and with it its ranks' (#44 finding 10).
  grpc::Status StillIdentified() {
    if (caller_.admin) return grpc::Status::OK;
    const absl::Time now = absl::Now();
    if (now - identified_ < absl::Seconds(1)) return grpc::Status::OK;
    identified_ = now;
    absl::StatusOr<Caller> caller = services_.credentials->Identify(context_.client_metadata());
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    caller_ = *std::move(caller);
    return grpc::Status::OK;
  }

  void RequestRead(bool ok) {
    if (!ok) {  // the agent closed its side, or its process or host is gone
      CloseEveryRank();
      return Finish(grpc::Status::OK);
    }
    if (node_.empty()) {
      node_ = request_->node().empty() ? "unnamed" : request_->node();
      if (services_.log != nullptr) services_.log->Log("agent_stream_opened", {{"node", node_}});
    }
    for (const v1::RankStreamClosed& closed : request_->closed()) CloseRank(closed);
    if (grpc::Status token = StillIdentified(); !token.ok()) {
      CloseEveryRank();
      return Finish(token);
    }
    AnswerEveryBeat();
    stream_.Write(*response_, &written_);
  }

  void ResponseWritten(bool ok) {
    if (!ok) {
      CloseEveryRank();
      return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "host heartbeat stream broken"));
    }
    NewMessages();
    stream_.Read(request_, &read_);
  }

  void Finish(const grpc::Status& status) { stream_.Finish(status, &finished_); }

  // One answer per beat, in order. The beats that may be recorded go to
  // Membership together (one lock for the host's ranks).
  void AnswerEveryBeat() {
    const int n = request_->beats_size();
    response_->mutable_answers()->Reserve(n);
    beats_.clear();
    recorded_.clear();
    undo_.clear();
    for (int i = 0; i < n; ++i) {
      const v1::RankBeat& beat = request_->beats(i);
      v1::RankAnswer* answer = response_->add_answers();
      if (beat.local_stream() == 0) {
        SetError(absl::InvalidArgumentError("RankBeat.local_stream is 0; name the rank's stream"),
                 answer);
        continue;
      }
      absl::StatusOr<RankStream*> stream = StreamOf(beat);
      if (!stream.ok()) {
        SetError(stream.status(), answer);
        continue;
      }
      if (services_.metrics != nullptr) services_.metrics->AddHeartbeat();
      beats_.push_back({&beat.beat(), (*stream)->id, &(*stream)->member});
      recorded_.push_back(i);
    }
    if (beats_.empty()) return;
    std::vector<absl::StatusOr<v1::HeartbeatResponse>> responses =
        services_.membership->Heartbeats(beats_);
    for (size_t k = 0; k < responses.size(); ++k) {
      v1::RankAnswer* answer = response_->mutable_answers(recorded_[k]);
      if (!responses[k].ok()) {
        SetError(responses[k].status(), answer);
      } else {
        // Not Swap: the answer lives on the stream's arena and the response
        // on the heap, where Swap is a deep copy through reflection.
        *answer->mutable_response() = std::move(*responses[k]);
      }
    }
    ForgetRefused(responses);
  }

  // A rank stream is remembered only for credentials Membership accepted:
  // a refused beat (a wrong token, a job that does not exist) leaves the
  // table as it was, so refusals cost the stream nothing held (#44 finding
  // 2). Newest first: a later accepted beat of the same local stream in
  // this message keeps its entry.
  void ForgetRefused(const std::vector<absl::StatusOr<v1::HeartbeatResponse>>& responses) {
    kept_.clear();
    for (size_t k = responses.size(); k-- > 0;) {
      const Undo& undo = undo_[k];
      if (responses[k].ok()) {
        kept_.insert(undo.local);
        continue;
      }
      if (undo.local == 0 || kept_.count(undo.local) > 0) continue;  // same_member: unchanged
      auto it = ranks_.find(undo.local);
      if (it == ranks_.end()) continue;
      if (undo.fresh) {
        ranks_.erase(it);
      } else {
        it->second.member = undo.previous;
      }
    }
  }

  // The rank stream a beat came on, holding the beat's credentials (its own,
  // or those kept for RankBeat.same_member), which the caller may act on.
  absl::StatusOr<RankStream*> StreamOf(const v1::RankBeat& beat) {
    if (beat.same_member()) {
      auto it = ranks_.find(beat.local_stream());
      if (it == ranks_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "RankBeat.same_member for local stream ", beat.local_stream(),
            ", whose credentials this HostHeartbeat stream has not carried; send them"));
      }
      undo_.push_back(Undo{});  // nothing to undo: the entry is unchanged
      return &it->second;       // its job was allowed when they came
    }
    const v1::MemberCredentials& member = beat.beat().member();
    if (grpc::Status allowed = caller_.MayActOn(member.job_id()); !allowed.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(allowed.error_code()),
                          allowed.error_message());
    }
    auto it = ranks_.find(beat.local_stream());
    if (it == ranks_.end() && ranks_.size() >= kMaxRankStreamsPerAgentStream) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this HostHeartbeat stream carries ", ranks_.size(), " rank streams, the most one may (",
          kMaxRankStreamsPerAgentStream,
          " per host); report closed ones (HostHeartbeatRequest.closed) before opening more"));
    }
    Undo undo;
    undo.local = beat.local_stream();
    undo.fresh = it == ranks_.end();
    if (undo.fresh) {
      it = ranks_.try_emplace(beat.local_stream()).first;
      it->second.id = NextAgentRankStreamId();
    } else {
      undo.previous = it->second.member;
    }
    it->second.member = member;
    undo_.push_back(std::move(undo));
    return &it->second;
  }

  // The agent saw the rank's stream close: as if its own stream to us closed.
  void CloseRank(const v1::RankStreamClosed& closed) {
    auto it = ranks_.find(closed.local_stream());
    if (it == ranks_.end()) return;  // never beat through us: nothing to close
    services_.membership->HeartbeatStreamClosed(it->second.member, it->second.id);
    ranks_.erase(it);
  }

  // The agent's stream is gone, and with it every rank stream it carried.
  void CloseEveryRank() {
    if (services_.log != nullptr && !ranks_.empty()) {
      services_.log->Log("agent_stream_closed",
                         {{"node", node_}, {"rank_streams", absl::StrCat(ranks_.size())}});
    }
    for (const auto& [local, stream] : ranks_) {
      services_.membership->HeartbeatStreamClosed(stream.member, stream.id);
    }
    ranks_.clear();
  }

  CallQueues* const queues_;
  const HostAgentServices services_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<v1::HostHeartbeatResponse, v1::HostHeartbeatRequest> stream_;
  Caller caller_;
  absl::Time identified_;  // when caller_ was last checked
  std::string node_;
  // By the agent's local stream id. Node-based: AnswerEveryBeat keeps
  // pointers to the entries' credentials while it adds entries.
  absl::node_hash_map<uint64_t, RankStream> ranks_;
  std::vector<Membership::StreamBeat> beats_;  // AnswerEveryBeat's, kept for their capacity
  std::vector<int> recorded_;                  // which beat each of beats_ is
  // How to undo what each of beats_ did to ranks_ if Membership refuses it.
  struct Undo {
    uint64_t local = 0;  // 0: nothing to undo
    bool fresh = false;  // the beat added the entry
    v1::MemberCredentials previous;
  };
  std::vector<Undo> undo_;
  absl::flat_hash_set<uint64_t> kept_;  // ForgetRefused's, kept for its capacity
  google::protobuf::Arena arena_;
  v1::HostHeartbeatRequest* request_ = nullptr;    // on arena_
  v1::HostHeartbeatResponse* response_ = nullptr;  // on arena_
  Tag accepted_{this, kAccepted};
  Tag read_{this, kRead};
  Tag written_{this, kWritten};
  Tag finished_{this, kFinished};
};

// The joins of one host: each held by Membership as a Join is; the answers
// written as they come, one write at a time, each write carrying every answer
// that came while the one before was in flight (a host's answers when its
// generation forms: one or two writes, not one per rank); the call finished
// when every join is answered and written. A rank's heartbeat clock starts
// at its first beat (Membership::ClockStart::kAtFirstBeat; at the latest
// --answer_delivery_timeout after formation, at once when the write with its
// answer fails): at 100,000 ranks the answers take longer than a heartbeat
// timeout to reach every agent on a busy machine. The answers come on Membership's threads
// (or at once, inside Start), the call's events on its queue's thread: mu_
// orders them. The call ends when gRPC has reported it done (the
// AsyncNotifyWhenDone tag: finished, or cancelled by the agent), its finish
// has completed and Membership has answered every join; then nothing can
// reach it any more.
class HostJoinCall final : public CallQueues::Call {
 public:
  enum Step { kAccepted, kWritten, kFinished, kDone, kPump };

  // Asks for the next join call to arrive on `queue`.
  HostJoinCall(CallQueues* queues, HostAgentServices services, grpc::ServerCompletionQueue* queue)
      : Call(queues), queues_(queues), services_(services), queue_(queue), writer_(&context_) {
    context_.AsyncNotifyWhenDone(&done_tag_);  // delivered only for a call that arrives
    services_.service->RequestHostJoin(&context_, &request_, &writer_, queue_, queue_, &accepted_);
  }

  void Proceed(int step, bool ok) override {
    switch (step) {
      case kAccepted:
        return Accepted(ok);
      case kWritten:
        return Written(ok);
      case kFinished:
        return Finished();
      case kPump:
        return AndThen([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { pump_posted_ = false; });
      default:
        return Done();
    }
  }

 private:
  void Accepted(bool ok) {
    if (!ok) return End();  // the server is shutting down: no call came
    new HostJoinCall(queues_, services_, queue_);  // the next call on this queue
    // Membership caps a join's wait at its join timeout; the caller's own
    // deadline, if sooner, ends the call (Done withdraws the joins).
    absl::Time deadline = services_.clock->Now() + absl::Hours(24 * 365);
    absl::Time call_deadline = absl::FromChrono(context_.deadline());
    if (call_deadline < absl::Now() + absl::Hours(24 * 365)) {
      deadline = services_.clock->Now() + (call_deadline - absl::Now());
    }
    std::vector<std::string> identities;
    if (services_.worker_ids != nullptr) identities = CertificateIdentities(*context_.auth_context());
    StartJoins(services_.credentials->Identify(context_.client_metadata()), identities, deadline);
  }

  // Starts every join of the request; a join the caller may not make is
  // answered with why at once.
  // `identities`: the client certificate's, checked against each worker id
  // when services_.worker_ids binds them (worker_id_binding.h).
  void StartJoins(const absl::StatusOr<Caller>& caller, const std::vector<std::string>& identities,
                  absl::Time deadline) {
    {
      absl::MutexLock lock(&mu_);
      // One more than the joins until this loop is over: the call cannot
      // finish under it.
      unanswered_ = request_.joins_size() + 1;
      ids_.assign(request_.joins_size(), 0);
      answered_.assign(request_.joins_size(), false);
    }
    for (int i = 0; i < request_.joins_size(); ++i) {
      const v1::JoinRequest& join = request_.joins(i);
      grpc::Status allowed =
          caller.ok() ? caller->MayActOn(join.job_id()) : ToGrpcStatus(caller.status());
      if (!allowed.ok()) {
        Answered(i, absl::Status(static_cast<absl::StatusCode>(allowed.error_code()),
                                 allowed.error_message()));
        continue;
      }
      if (services_.worker_ids != nullptr) {
        if (absl::Status s = services_.worker_ids->Check(identities, join.worker_id()); !s.ok()) {
          Answered(i, s);
          continue;
        }
      }
      uint64_t id = services_.membership->Join(
          join, deadline,
          [this, i](absl::StatusOr<v1::JoinResponse> r) { Answered(i, std::move(r)); },
          Membership::ClockStart::kAtFirstBeat);
      absl::MutexLock lock(&mu_);
      if (answered_[i]) continue;
      ids_[i] = id;
      if (cancelled_ && id != 0) to_cancel_.push_back(id);
    }
    CancelCollected();
    AndThen([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { --unanswered_; });
  }

  void Answered(int index, absl::StatusOr<v1::JoinResponse> result) {
    v1::HostJoinAnswer answer;
    answer.set_index(index);
    if (result.ok()) {
      *answer.mutable_response() = *std::move(result);
    } else {
      SetError(result.status(), &answer);
    }
    // Runs on whichever thread answered: for a barrier, the one thread that
    // answers every join of the job (100,000 at 100K ranks). Only the
    // answer is queued here; the write starts on this call's own queue
    // (pump_alarm_), so that the fan-out's writes spread over the queues
    // and the streams of the barrier thread's queue are not held up behind
    // it (their beats went unanswered for seconds, and their ranks died).
    absl::MutexLock lock(&mu_);
    ids_[index] = 0;
    answered_[index] = true;
    --unanswered_;
    queue_answers_.push_back(std::move(answer));
    if (!pump_posted_) {
      pump_posted_ = true;
      pump_alarm_.Set(queue_, gpr_now(GPR_CLOCK_MONOTONIC), &pump_);
    }
  }

  void Written(bool ok) {
    // A failed write (the agent went away) starts its ranks' clocks (they
    // are declared dead a heartbeat timeout later unless they beat), and
    // still counts as written: the done tag follows, and with it the joins'
    // withdrawal.
    std::vector<Membership::UndeliveredAnswer> undelivered;
    {
      absl::MutexLock lock(&mu_);
      undelivered.swap(in_write_);
    }
    if (!ok && !undelivered.empty()) services_.membership->AnswersUndeliverable(undelivered);
    AndThen([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      writing_ = false;
      if (!ok) broken_ = true;
    });
  }

  void Finished() {
    AndThen([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      writing_ = false;
      finish_completed_ = true;
    });
  }

  void Done() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      if (context_.IsCancelled()) {
        cancelled_ = true;
        for (uint64_t id : ids_) {
          if (id != 0) to_cancel_.push_back(id);
        }
      }
    }
    CancelCollected();  // Membership answers each withdrawn join (CANCELLED)
    AndThen([]() {});
  }

  // Applies `change` under mu_, then starts the next write or the finish,
  // or ends the call once nothing can reach it.
  void AndThen(const std::function<void()>& change) {
    bool end = false;
    {
      absl::MutexLock lock(&mu_);
      change();
      end = Pump();
    }
    if (end) End();
  }

  // True when the call should end. gRPC's async operations only queue their
  // completion, so starting them under mu_ is safe.
  bool Pump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_) return false;
    if (finishing_) return finish_completed_ && done_ && unanswered_ == 0 && !pump_posted_;
    if (cancelled_ || broken_) {
      finishing_ = writing_ = true;
      writer_.Finish(grpc::Status(grpc::StatusCode::CANCELLED, "host join call withdrawn"),
                     &finished_);
    } else if (!queue_answers_.empty()) {
      writing_ = true;
      current_.Clear();
      for (v1::HostJoinAnswer& answer : queue_answers_) {
        if (answer.error_code() == 0) {
          in_write_.push_back({request_.joins(answer.index()).job_id(),
                               answer.response().generation(), answer.response().rank()});
        }
        *current_.add_answers() = std::move(answer);
      }
      queue_answers_.clear();
      writer_.Write(current_, &written_);
    } else if (unanswered_ == 0) {
      finishing_ = writing_ = true;
      writer_.Finish(grpc::Status::OK, &finished_);
    }
    return false;
  }

  void CancelCollected() {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&mu_);
      ids.swap(to_cancel_);
    }
    for (uint64_t id : ids) services_.membership->CancelJoin(id);
  }

  CallQueues* const queues_;
  const HostAgentServices services_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  v1::HostJoinRequest request_;  // read-only once accepted
  grpc::ServerAsyncWriter<v1::HostJoinResponse> writer_;
  absl::Mutex mu_;
  int unanswered_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> ids_ ABSL_GUARDED_BY(mu_);  // pending joins' ids by index (0: none)
  std::vector<bool> answered_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> to_cancel_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // the agent withdrew the call
  bool broken_ ABSL_GUARDED_BY(mu_) = false;     // a write failed
  std::vector<v1::HostJoinAnswer> queue_answers_ ABSL_GUARDED_BY(mu_);  // not yet written
  v1::HostJoinResponse current_ ABSL_GUARDED_BY(mu_);  // the answers being written
  // The members answered by `current_`, told to Membership if it fails.
  std::vector<Membership::UndeliveredAnswer> in_write_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write or the finish in flight
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_completed_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // the AsyncNotifyWhenDone tag came
  Tag accepted_{this, kAccepted};
  Tag written_{this, kWritten};
  Tag finished_{this, kFinished};
  Tag done_tag_{this, kDone};
  // Starts the writes of answers queued by other threads on queue_'s thread.
  grpc::Alarm pump_alarm_;
  bool pump_posted_ ABSL_GUARDED_BY(mu_) = false;  // pump_alarm_ set, not yet run
  Tag pump_{this, kPump};
};

}  // namespace

CallQueues::Acceptor AcceptHostHeartbeats(CallQueues* queues, HostAgentServices services) {
  return [queues, services](grpc::ServerCompletionQueue* queue) {
    new HostHeartbeatCall(queues, services, queue);
  };
}

CallQueues::Acceptor AcceptHostJoins(CallQueues* queues, HostAgentServices services) {
  return [queues, services](grpc::ServerCompletionQueue* queue) {
    new HostJoinCall(queues, services, queue);
  };
}

}  // namespace zeroshard
