// A node agent's side of one bearer token at the server (host_agent.h): the
// HostHeartbeat stream its ranks' beats go on, re-opened when it breaks, and
// its joins, sent in batches per job. Internal to agent/.
#ifndef ZEROSHARD_AGENT_UPSTREAM_H_
#define ZEROSHARD_AGENT_UPSTREAM_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "agent/verified_credentials.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard::agent_internal {

using google::protobuf::util::MessageDifferencer;

// How a rank's beat is answered: the server's answer for it, or why there is
// none (error_code set).
using Deliver = std::function<void(const v1::RankAnswer&)>;
using JoinDone = std::function<void(const grpc::Status&, const v1::JoinResponse&)>;

inline v1::RankAnswer Refusal(grpc::StatusCode code, const std::string& message) {
  v1::RankAnswer answer;
  answer.set_error_code(code);
  answer.set_error_message(message);
  return answer;
}

// Joins sent to the server in one HostJoin call.
class JoinBatch {
 public:
  void Add(const v1::JoinRequest& join, absl::Time deadline, JoinDone done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    joins_.push_back(join);
    dones_.push_back(std::move(done));
    deadline_ = std::max(deadline_, deadline);
  }
  // A rank's caller went away: the whole call is withdrawn (the server then
  // forgets every join of it), and the others are told to join again.
  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (context_ != nullptr) context_->TryCancel();
  }
  // Sends the joins and hands each its answer; every `done` is called once.
  void Send(v1::HostAgent::Stub* stub, const std::string& authorization, const std::string& node,
            VerifiedCredentials* verified) {
    v1::HostJoinRequest request;
    request.set_node(node);
    grpc::ClientContext context;
    {
      absl::MutexLock lock(&mu_);
      for (const v1::JoinRequest& join : joins_) *request.add_joins() = join;
      context_ = &context;
      if (cancelled_) context.TryCancel();
    }
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
    context.set_deadline(absl::ToChronoTime(deadline_));
    std::vector<bool> answered(dones_.size(), false);
    auto reader = stub->HostJoin(&context, request);
    v1::HostJoinResponse answers;
    while (reader->Read(&answers)) {
      for (const v1::HostJoinAnswer& answer : answers.answers()) {
        const int i = answer.index();
        if (i < 0 || i >= static_cast<int>(dones_.size()) || answered[i]) continue;
        answered[i] = true;
        if (answer.error_code() == 0) {  // the server issued these credentials
          v1::MemberCredentials member;
          member.set_job_id(joins_[i].job_id());
          member.set_generation(answer.response().generation());
          member.set_rank(answer.response().rank());
          member.set_token(answer.response().token());
          verified->Add(member);
        }
        dones_[i](grpc::Status(static_cast<grpc::StatusCode>(answer.error_code()),
                               answer.error_message()),
                  answer.response());
      }
    }
    grpc::Status status = reader->Finish();
    bool cancelled = false;
    {
      absl::MutexLock lock(&mu_);
      context_ = nullptr;
      cancelled = cancelled_;
    }
    // Joins the call ended without answering: the server or the network went
    // away (UNAVAILABLE: the rank's client joins again), or another rank of
    // the batch withdrew it.
    grpc::Status unanswered = status;
    if (status.ok() || cancelled) {
      unanswered = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                cancelled ? "the node agent withdrew this join with another "
                                            "rank's that went away; join again"
                                          : "the server ended the host's join call early");
    }
    for (size_t i = 0; i < dones_.size(); ++i) {
      if (!answered[i]) dones_[i](unanswered, v1::JoinResponse());
    }
  }

  absl::Mutex mu_;

 private:
  std::vector<v1::JoinRequest> joins_;  // written before Send, read by it
  std::vector<JoinDone> dones_;
  absl::Time deadline_ = absl::InfinitePast();
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// The server's side of one bearer token: a HostHeartbeat stream, re-opened
// when it breaks (beats in flight are sent again on the next one), and the
// join batches.
class Upstream {
 public:
  Upstream(std::shared_ptr<grpc::Channel> channel, std::string authorization, std::string node,
           absl::Duration batch_window, absl::Duration join_window, VerifiedCredentials* verified)
      : verified_(verified),
        stub_(v1::HostAgent::NewStub(channel)),
        authorization_(std::move(authorization)),
        node_(std::move(node)),
        batch_window_(batch_window),
        join_window_(join_window) {
    writer_ = std::thread([this] { Run(); });
  }
  ~Upstream() { Stop(); }

  void Beat(uint64_t local, const v1::HeartbeatRequest& beat, Deliver deliver) {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_) {
        queue_.push_back(Queued{local, beat, std::move(deliver)});
        if (beat.peer_failure()) urgent_ = true;
        return;
      }
    }
    deliver(Refusal(grpc::StatusCode::UNAVAILABLE, "the node agent is stopping"));
  }

  void Closed(uint64_t local, const v1::MemberCredentials& member) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    v1::RankStreamClosed closed;
    closed.set_local_stream(local);
    *closed.mutable_member() = member;
    closed_.push_back(std::move(closed));
    urgent_ = true;
  }

  // Puts the join in its job's open batch (a new one sends itself after the
  // join window): a batch holds one job's joins, so that a caller going
  // away, which withdraws its whole batch, withdraws no other job's (#44
  // finding 3: another job's joins with 30 ms deadlines cancelled the
  // ranks' joins after their generation formed). `hold` is handed the batch, for a cancellation,
  // before `done` can be called; neither is called when the agent is stopping except `done`, at
  // once.
  void Join(const v1::JoinRequest& join, absl::Time deadline, JoinDone done,
            const std::function<void(std::shared_ptr<JoinBatch>)>& hold) {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the node agent is stopping"),
           v1::JoinResponse());
      return;
    }
    // Threads of batches already answered are joined here, so a caller that
    // sends many jobs' joins leaves none behind.
    for (uint64_t id : finished_joins_) {
      auto it = join_threads_.find(id);
      if (it == join_threads_.end()) continue;
      it->second.join();  // it only returns now: it finished under mu_
      join_threads_.erase(it);
    }
    finished_joins_.clear();
    auto open = open_batches_.find(join.job_id());
    if (open == open_batches_.end() && join_threads_.size() >= kMaxJoinBatches) {
      done(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("the node agent has ", join_threads_.size(),
                                     " join batches in flight for this bearer token, the most it "
                                     "may; join again when some are answered")),
           v1::JoinResponse());
      return;
    }
    if (open == open_batches_.end()) {
      open = open_batches_.emplace(join.job_id(), std::make_shared<JoinBatch>()).first;
      const uint64_t id = next_join_++;
      join_threads_.emplace(id, std::thread([this, id, batch = open->second, job = join.job_id()] {
                              SendJoins(id, job, batch);
                            }));
    }
    std::shared_ptr<JoinBatch> batch = open->second;
    hold(batch);
    absl::MutexLock batch_lock(&batch->mu_);
    batch->Add(join, deadline, std::move(done));
  }

  // Ends the stream; every beat not yet answered is refused (UNAVAILABLE).
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
      if (session_ != nullptr) session_->TryCancel();
      for (auto& [job, batch] : open_batches_) batch->Cancel();
    }
    if (writer_.joinable()) writer_.join();
    std::map<uint64_t, std::thread> joins;
    {
      absl::MutexLock lock(&mu_);
      joins.swap(join_threads_);
    }
    for (auto& [id, t] : joins) t.join();
  }

 private:
  struct Queued {
    uint64_t local = 0;
    v1::HeartbeatRequest beat;
    Deliver deliver;
  };

  void SendJoins(uint64_t id, const std::string& job, std::shared_ptr<JoinBatch> batch) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), join_window_);
      auto open = open_batches_.find(job);
      if (open != open_batches_.end() && open->second == batch) {
        open_batches_.erase(open);  // later joins start a new batch
      }
    }
    batch->Send(stub_.get(), authorization_, node_, verified_);
    absl::MutexLock lock(&mu_);
    finished_joins_.push_back(id);
  }

  // The writer: one session (stream) after another until Stop.
  void Run() {
    absl::Duration backoff = absl::Milliseconds(100);
    auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || !queue_.empty() || !closed_.empty();
    };
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(&has_work));
        if (stopping_) break;
      }
      if (RunSession()) backoff = absl::Milliseconds(100);
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff)) break;
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
    // Stopping: nobody will answer what is left.
    std::vector<Queued> left;
    {
      absl::MutexLock lock(&mu_);
      for (auto& batch : in_flight_) {
        for (Queued& q : batch) left.push_back(std::move(q));
      }
      for (Queued& q : queue_) left.push_back(std::move(q));
      in_flight_.clear();
      queue_.clear();
    }
    for (Queued& q : left) {
      q.deliver(Refusal(grpc::StatusCode::UNAVAILABLE, "the node agent is stopping"));
    }
  }

  // One HostHeartbeat stream, until it breaks or Stop; true when the server
  // answered on it. What was in flight is queued again, in order.
  bool RunSession() {
    grpc::ClientContext context;
    if (!authorization_.empty()) context.AddMetadata("authorization", authorization_);
    // As the workers' own streams (client.cc): wait for a server that is
    // away instead of failing, which keeps the reconnection polled.
    context.set_wait_for_ready(true);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return false;
      session_ = &context;
      broken_ = false;
    }
    std::unique_ptr<grpc::ClientReaderWriter<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>>
        stream = stub_->HostHeartbeat(&context);
    std::atomic<bool> answered{false};
    std::thread reader([&] {
      v1::HostHeartbeatResponse response;
      while (stream->Read(&response)) {
        answered = true;
        Answer(response);
      }
      absl::MutexLock lock(&mu_);
      broken_ = true;
    });
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || broken_ || !queue_.empty() || !closed_.empty();
    };
    auto flush_now = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || broken_ || urgent_;
    };
    // The credentials each local stream's beats carried on this stream: a
    // beat with the same ones says so instead (RankBeat.same_member).
    absl::flat_hash_map<uint64_t, v1::MemberCredentials> carried;
    while (true) {
      v1::HostHeartbeatRequest request;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(&ready));
        if (stopping_ || broken_) break;
        // More of the host's ranks beat within the window: one request.
        mu_.AwaitWithTimeout(absl::Condition(&flush_now), batch_window_);
        if (stopping_ || broken_) break;
        urgent_ = false;
        request.set_node(node_);
        for (v1::RankStreamClosed& closed : closed_) {
          carried.erase(closed.local_stream());
          *request.add_closed() = std::move(closed);
        }
        closed_.clear();
        std::vector<Queued> batch;
        for (Queued& q : queue_) {
          v1::RankBeat* beat = request.add_beats();
          beat->set_local_stream(q.local);
          *beat->mutable_beat() = q.beat;
          auto [known, fresh] = carried.try_emplace(q.local);
          if (!fresh && MessageDifferencer::Equals(known->second, q.beat.member())) {
            beat->set_same_member(true);
            beat->mutable_beat()->clear_member();
          } else {
            known->second = q.beat.member();
          }
          batch.push_back(std::move(q));
        }
        queue_.clear();
        in_flight_.push_back(std::move(batch));
      }
      if (!stream->Write(request)) break;  // the call is over: the reader ends too
    }
    // Cancelled only when stopping: a call the server ended keeps the
    // server's status (a refused token's UNAUTHENTICATED), which a
    // cancellation would replace.
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) context.TryCancel();
    }
    reader.join();
    const grpc::Status status = stream->Finish();
    if (!answered && (status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                      status.error_code() == grpc::StatusCode::PERMISSION_DENIED)) {
      RefuseEverything(status);
      return false;
    }
    absl::MutexLock lock(&mu_);
    session_ = nullptr;
    // Sent but not answered: first in line on the next stream.
    for (auto batch = in_flight_.rbegin(); batch != in_flight_.rend(); ++batch) {
      for (auto q = batch->rbegin(); q != batch->rend(); ++q) queue_.push_front(std::move(*q));
    }
    in_flight_.clear();
    return answered;
  }

  // The server refused the stream itself (the token the ranks presented):
  // every beat sent or queued hears so now, instead of being sent again
  // every second until its rank gives up (#44 finding 5).
  void RefuseEverything(const grpc::Status& status) {
    std::vector<Queued> refused;
    {
      absl::MutexLock lock(&mu_);
      session_ = nullptr;
      for (auto& batch : in_flight_) {
        for (Queued& q : batch) refused.push_back(std::move(q));
      }
      for (Queued& q : queue_) refused.push_back(std::move(q));
      in_flight_.clear();
      queue_.clear();
      closed_.clear();  // nothing of this token's is carried
    }
    for (Queued& q : refused) q.deliver(Refusal(status.error_code(), status.error_message()));
  }

  // The server answers requests in order: this response is the oldest
  // batch's.
  void Answer(const v1::HostHeartbeatResponse& response) {
    std::vector<Queued> batch;
    {
      absl::MutexLock lock(&mu_);
      if (in_flight_.empty()) return;
      batch = std::move(in_flight_.front());
      in_flight_.pop_front();
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      if (static_cast<int>(i) < response.answers_size()) {
        if (response.answers(i).error_code() == 0) verified_->Add(batch[i].beat.member());
        batch[i].deliver(response.answers(i));
      } else {
        batch[i].deliver(Refusal(grpc::StatusCode::INTERNAL,
                                 "the server answered fewer beats than the node agent sent"));
      }
    }
  }

  VerifiedCredentials* const verified_;
  const std::unique_ptr<v1::HostAgent::Stub> stub_;
  const std::string authorization_;
  const std::string node_;
  const absl::Duration batch_window_;
  const absl::Duration join_window_;

  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);                  // beats to send
  std::vector<v1::RankStreamClosed> closed_ ABSL_GUARDED_BY(mu_);  // closes to report
  bool urgent_ ABSL_GUARDED_BY(mu_) = false;  // send without waiting for the window
  std::deque<std::vector<Queued>> in_flight_ ABSL_GUARDED_BY(mu_);  // sent, oldest first
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // the session's stream can no longer be read
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* session_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Taking joins, by job.
  std::map<std::string, std::shared_ptr<JoinBatch>> open_batches_ ABSL_GUARDED_BY(mu_);
  // Join batches in flight at once (a thread each), over every job.
  static constexpr size_t kMaxJoinBatches = 64;
  std::map<uint64_t, std::thread> join_threads_ ABSL_GUARDED_BY(mu_);  // by batch id
  std::vector<uint64_t> finished_joins_ ABSL_GUARDED_BY(mu_);          // answered: to be joined
  uint64_t next_join_ ABSL_GUARDED_BY(mu_) = 1;
  std::thread writer_;
};

}  // namespace zeroshard::agent_internal

#endif  // ZEROSHARD_AGENT_UPSTREAM_H_
