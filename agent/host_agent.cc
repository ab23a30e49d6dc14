#include "agent/host_agent.h"

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "agent/store_wait_fan_out.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard {
namespace {

using google::protobuf::util::MessageDifferencer;

// How a rank's beat is answered: the server's answer for it, or why there is
// none (error_code set).
using Deliver = std::function<void(const v1::RankAnswer&)>;
using JoinDone = std::function<void(const grpc::Status&, const v1::JoinResponse&)>;

v1::RankAnswer Refusal(grpc::StatusCode code, const std::string& message) {
  v1::RankAnswer answer;
  answer.set_error_code(code);
  answer.set_error_message(message);
  return answer;
}

// The "authorization" header a rank's call carried ("" if none): the agent
// passes it on unchanged.
std::string AuthorizationOf(grpc::CallbackServerContext* context) {
  auto it = context->client_metadata().find("authorization");
  if (it == context->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
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
  void Send(v1::HostAgent::Stub* stub, const std::string& authorization, const std::string& node) {
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
           absl::Duration batch_window, absl::Duration join_window)
      : stub_(v1::HostAgent::NewStub(channel)),
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

  // Puts the join in the open batch (a new one sends itself after the join
  // window). `hold` is handed the batch, for a cancellation, before `done`
  // can be called; neither is called when the agent is stopping except
  // `done`, at once.
  void Join(const v1::JoinRequest& join, absl::Time deadline, JoinDone done,
            const std::function<void(std::shared_ptr<JoinBatch>)>& hold) {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the node agent is stopping"),
           v1::JoinResponse());
      return;
    }
    std::shared_ptr<JoinBatch> batch = open_batch_;
    if (batch == nullptr) {
      batch = open_batch_ = std::make_shared<JoinBatch>();
      join_threads_.emplace_back([this, batch] { SendJoins(batch); });
    }
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
      if (open_batch_ != nullptr) open_batch_->Cancel();
    }
    if (writer_.joinable()) writer_.join();
    std::vector<std::thread> joins;
    {
      absl::MutexLock lock(&mu_);
      joins.swap(join_threads_);
    }
    for (std::thread& t : joins) t.join();
  }

 private:
  struct Queued {
    uint64_t local = 0;
    v1::HeartbeatRequest beat;
    Deliver deliver;
  };

  void SendJoins(std::shared_ptr<JoinBatch> batch) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), join_window_);
      if (open_batch_ == batch) open_batch_ = nullptr;  // later joins start a new batch
    }
    batch->Send(stub_.get(), authorization_, node_);
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
      if (!stream->Write(request)) break;
    }
    context.TryCancel();
    reader.join();
    stream->Finish();
    absl::MutexLock lock(&mu_);
    session_ = nullptr;
    // Sent but not answered: first in line on the next stream.
    for (auto batch = in_flight_.rbegin(); batch != in_flight_.rend(); ++batch) {
      for (auto q = batch->rbegin(); q != batch->rend(); ++q) queue_.push_front(std::move(*q));
    }
    in_flight_.clear();
    return answered;
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
        batch[i].deliver(response.answers(i));
      } else {
        batch[i].deliver(Refusal(grpc::StatusCode::INTERNAL,
                                 "the server answered fewer beats than the node agent sent"));
      }
    }
  }

  const std::unique_ptr<v1::HostAgent::Stub> stub_;
  const std::string authorization_;
  const std::string node_;
  const absl::Duration batch_window_;
  const absl::Duration join_window_;

  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);  // beats to send
  std::vector<v1::RankStreamClosed> closed_ ABSL_GUARDED_BY(mu_);  // closes to report
  bool urgent_ ABSL_GUARDED_BY(mu_) = false;  // send without waiting for the window
  std::deque<std::vector<Queued>> in_flight_ ABSL_GUARDED_BY(mu_);  // sent, oldest first
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // the session's stream can no longer be read
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* session_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::shared_ptr<JoinBatch> open_batch_ ABSL_GUARDED_BY(mu_);  // taking joins
  std::vector<std::thread> join_threads_ ABSL_GUARDED_BY(mu_);
  std::thread writer_;
};

}  // namespace

class HostAgent::Impl final : public v1::Coordinator::CallbackService {
 public:
  explicit Impl(HostAgentOptions options) : options_(std::move(options)) {}

  absl::Status Start() {
    // sockaddr_un holds 108 bytes with the terminating NUL; gRPC's own error
    // for a longer path does not say which flag to change.
    constexpr size_t kMaxUnixPath = 107;
    if (options_.listen.rfind("unix:", 0) == 0 && options_.listen.size() - 5 > kMaxUnixPath) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", options_.listen, ": a unix socket path has at most ", kMaxUnixPath,
          " characters, this one ", options_.listen.size() - 5, "; choose a shorter path"));
    }
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options_.server);
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    builder.SetMaxReceiveMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on ", options_.listen,
          " (a unix socket's directory must exist and the path be free; a port must be free)"));
    }
    address_ = options_.listen;
    if (address_.rfind("unix:", 0) != 0 && address_.size() >= 2 &&
        address_.substr(address_.size() - 2) == ":0") {
      address_ = absl::StrCat(address_.substr(0, address_.size() - 1), port);
    }
    return absl::OkStatus();
  }

  ~Impl() override {
    std::vector<Upstream*> upstreams;
    std::vector<StoreWaitFanOut*> fan_outs;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [token, upstream] : upstreams_) upstreams.push_back(upstream.get());
      for (auto& [token, fan_out] : fan_outs_) fan_outs.push_back(fan_out.get());
    }
    for (Upstream* upstream : upstreams) upstream->Stop();
    for (StoreWaitFanOut* fan_out : fan_outs) fan_out->Stop();
    if (server_ != nullptr) {
      server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      server_.reset();  // every rank's reactor is done: the upstreams may go
    }
  }

  const std::string& address() const { return address_; }

  Upstream* UpstreamFor(const std::string& authorization) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Upstream>& upstream = upstreams_[authorization];
    if (upstream == nullptr) {
      upstream = std::make_unique<Upstream>(client_->channel(), authorization, options_.node,
                                            options_.batch_window, options_.join_window);
    }
    return upstream.get();
  }

  uint64_t NewLocalStream() { return next_local_.fetch_add(1, std::memory_order_relaxed); }

  // The bootstrap fan-out of the ranks presenting `authorization`.
  StoreWaitFanOut* FanOutFor(const std::string& authorization) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<StoreWaitFanOut>& fan_out = fan_outs_[authorization];
    if (fan_out == nullptr) {
      fan_out = std::make_unique<StoreWaitFanOut>(client_->channel(), authorization);
    }
    return fan_out.get();
  }

  HostAgent::StoreWaitCounts StoreWaits() {
    absl::MutexLock lock(&mu_);
    HostAgent::StoreWaitCounts counts;
    for (auto& [token, fan_out] : fan_outs_) {
      counts.held += fan_out->held();
      counts.server_calls += fan_out->calls();
    }
    return counts;
  }

  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* Heartbeat(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* StoreWait(grpc::CallbackServerContext* context,
                                      const v1::StoreWaitRequest* request,
                                      v1::StoreWaitResponse* response) override;

 private:
  const HostAgentOptions options_;
  std::unique_ptr<Client> client_;  // its channel to the server
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::atomic<uint64_t> next_local_{1};
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Upstream>> upstreams_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<StoreWaitFanOut>> fan_outs_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A rank's heartbeat stream to the agent: each beat goes upstream, its
// answer comes back on this stream; the next beat is read after the answer
// is written (as the server's own stream does).
class RankHeartbeat
    : public grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  RankHeartbeat(Upstream* upstream, uint64_t local) : upstream_(upstream), local_(local) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the rank closed its stream, or its process is gone: say so now
      if (beaten_) upstream_->Closed(local_, member_);
      Finish(grpc::Status::OK);
      return;
    }
    member_ = request_.member();
    beaten_ = true;
    upstream_->Beat(local_, request_, [this](const v1::RankAnswer& answer) { Answer(answer); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      upstream_->Closed(local_, member_);
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "heartbeat stream broken"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void Answer(const v1::RankAnswer& answer) {
    if (answer.error_code() != 0) {  // fenced, refused: the rank hears it as from the server
      Finish(grpc::Status(static_cast<grpc::StatusCode>(answer.error_code()),
                          answer.error_message()));
      return;
    }
    response_ = answer.response();
    StartWrite(&response_);
  }

  Upstream* const upstream_;
  const uint64_t local_;
  bool beaten_ = false;
  v1::MemberCredentials member_;  // of the latest beat
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
};

// A rank's join: held in the host's next batch until the server answers it.
class RankJoin : public grpc::ServerUnaryReactor {
 public:
  void Hold(std::shared_ptr<JoinBatch> batch) {
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      batch_ = std::move(batch);
      cancel = cancelled_;
    }
    if (cancel && batch_ != nullptr) batch_->Cancel();
  }
  void Done(const grpc::Status& status) { Finish(status); }
  void OnCancel() override {
    std::shared_ptr<JoinBatch> batch;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      batch = batch_;
    }
    if (batch != nullptr) batch->Cancel();
  }
  void OnDone() override { delete this; }

 private:
  absl::Mutex mu_;
  std::shared_ptr<JoinBatch> batch_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// A rank's StoreWait: held in the host's shared wait for the same keys. The
// answer may come (and the call finish) before Wait returns: the reactor
// outlives Start.
class RankStoreWait : public grpc::ServerUnaryReactor {
 public:
  explicit RankStoreWait(StoreWaitFanOut* fan_out) : fan_out_(fan_out) {}
  void Start(const v1::StoreWaitRequest& request) {
    StoreWaitFanOut* const fan_out = fan_out_;
    const uint64_t id =
        fan_out->Wait(request, [this](const grpc::Status& status) { Finish(status); });
    bool cancelled = false;
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      id_ = id;
      starting_ = false;
      cancelled = cancelled_;
      done = done_;
    }
    if (done) {
      delete this;
    } else if (cancelled) {
      fan_out->Cancel(id);  // may finish and delete this
    }
  }
  void OnCancel() override {
    uint64_t id = 0;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      id = id_;
    }
    if (id != 0) fan_out_->Cancel(id);  // else Start cancels it
  }
  void OnDone() override {
    bool starting = false;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      starting = starting_;
    }
    if (!starting) delete this;
  }

 private:
  StoreWaitFanOut* const fan_out_;
  absl::Mutex mu_;
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool starting_ ABSL_GUARDED_BY(mu_) = true;  // Start has not returned from Wait
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerUnaryReactor* HostAgent::Impl::StoreWait(grpc::CallbackServerContext* context,
                                                     const v1::StoreWaitRequest* request,
                                                     v1::StoreWaitResponse* /*response*/) {
  auto* call = new RankStoreWait(FanOutFor(AuthorizationOf(context)));
  call->Start(*request);  // `call` may be finished and gone by now: only its pointer is returned
  return call;
}

grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* HostAgent::Impl::Heartbeat(
    grpc::CallbackServerContext* context) {
  return new RankHeartbeat(UpstreamFor(AuthorizationOf(context)), NewLocalStream());
}

grpc::ServerUnaryReactor* HostAgent::Impl::Join(grpc::CallbackServerContext* context,
                                                const v1::JoinRequest* request,
                                                v1::JoinResponse* response) {
  auto* call = new RankJoin();
  absl::Time deadline = absl::Now() + absl::Hours(1);
  absl::Time call_deadline = absl::FromChrono(context->deadline());
  if (call_deadline < deadline) deadline = call_deadline;
  // `call` (and `response`) live until `done` finishes it; nothing here
  // touches them after Join returns.
  UpstreamFor(AuthorizationOf(context))
      ->Join(
          *request, deadline,
          [call, response](const grpc::Status& status, const v1::JoinResponse& r) {
            if (status.ok()) *response = r;
            call->Done(status);
          },
          [call](std::shared_ptr<JoinBatch> batch) { call->Hold(std::move(batch)); });
  return call;
}

absl::StatusOr<std::unique_ptr<HostAgent>> HostAgent::Start(HostAgentOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<HostAgent>(new HostAgent(std::move(impl)));
}

HostAgent::HostAgent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostAgent::~HostAgent() = default;

const std::string& HostAgent::address() const { return impl_->address(); }

HostAgent::StoreWaitCounts HostAgent::StoreWaits() { return impl_->StoreWaits(); }

}  // namespace zeroshard
