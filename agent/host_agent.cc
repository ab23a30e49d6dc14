#include "agent/host_agent.h"

#include <atomic>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "agent/store_wait_fan_out.h"
#include "agent/upstream.h"
#include "agent/verified_credentials.h"
#include "common/request_budget.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard {
namespace {

// The "authorization" header a rank's call carried ("" if none): the agent
// passes it on unchanged.
std::string AuthorizationOf(grpc::CallbackServerContext* context) {
  auto it = context->client_metadata().find("authorization");
  if (it == context->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
}

// A beat or join larger than this is refused at once: the server keeps at
// most 1 KiB of a member's telemetry and 256 bytes of a record, and takes
// ids of at most a few hundred bytes, so no legal one comes near it.
constexpr size_t kMaxForwardedBytes = 16 << 10;
// What a unary call held at the agent costs beyond its request (gRPC's
// server call, its arena and HTTP/2 stream, the reactor; a join's share of
// its batch's HostJoin call), counted with it: ledger_test measured ~30 KiB
// a held join, copies included.
constexpr size_t kCallBytes = 32 << 10;

absl::Status TooLarge(absl::string_view what, size_t bytes) {
  return absl::InvalidArgumentError(absl::StrCat(
      "a ", what, " of ", bytes, " bytes; the node agent forwards at most ", kMaxForwardedBytes,
      " (the server would refuse it: its fields are bounded far below)"));
}

using agent_internal::JoinBatch;
using agent_internal::Refusal;
using agent_internal::Upstream;

}  // namespace

// The ranks' side: Heartbeat and Join on the callback API, StoreWait taken
// as bytes, counted before it is parsed (a wait may name 131,072 keys:
// parsed first, a burst of them held the agent's memory uncounted).
using RankService =
    v1::Coordinator::WithCallbackMethod_Heartbeat<v1::Coordinator::WithCallbackMethod_Join<
        v1::Coordinator::WithRawCallbackMethod_StoreWait<v1::Coordinator::Service>>>;

namespace {

// --listen=unix:PATH: PATH's directory, made if missing as `mkdir -p`
// does (a fresh host has no /run/zeroshard; under systemd,
// RuntimeDirectory= makes it).
absl::Status MakeSocketDir(const std::string& listen) {
  if (listen.rfind("unix:", 0) != 0) return absl::OkStatus();
  const std::filesystem::path dir =
      std::filesystem::path(listen.substr(5)).lexically_normal().parent_path();
  if (dir.empty()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("--listen=", listen, ": cannot create the socket's directory ",
                     dir.string(), ": ", error.message(),
                     "; pass a path in a directory this user can write"));
  }
  return absl::OkStatus();
}

}  // namespace

class HostAgent::Impl final : public RankService {
 public:
  explicit Impl(HostAgentOptions options)
      : options_(std::move(options)),
        budget_(options_.max_request_bytes_in_flight,
                "the node agent's --max_request_bytes_in_flight") {}

  absl::Status Start() {
    // sockaddr_un holds 108 bytes with the terminating NUL; gRPC's own error
    // for a longer path does not say which flag to change.
    constexpr size_t kMaxUnixPath = 107;
    if (options_.listen.rfind("unix:", 0) == 0 && options_.listen.size() - 5 > kMaxUnixPath) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", options_.listen, ": a unix socket path has at most ", kMaxUnixPath,
          " characters, this one ", options_.listen.size() - 5, "; choose a shorter path"));
    }
    if (absl::Status s = MakeSocketDir(options_.listen); !s.ok()) return s;
    channel_ = options_.server_channel;
    if (channel_ == nullptr) {
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options_.server);
      if (!client.ok()) return client.status();
      client_ = *std::move(client);
      channel_ = client_->channel();
    }
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
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    reaper_.join();  // what was retired is gone
    std::vector<Upstream*> upstreams;
    std::vector<StoreWaitFanOut*> fan_outs;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [token, upstream] : upstreams_) upstreams.push_back(upstream.held.get());
      for (auto& [token, fan_out] : fan_outs_) fan_outs.push_back(fan_out.held.get());
    }
    for (Upstream* upstream : upstreams) upstream->Stop();
    for (StoreWaitFanOut* fan_out : fan_outs) fan_out->Stop();
    if (server_ != nullptr) {
      server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      server_.reset();  // every rank's reactor is done: the upstreams may go
    }
  }

  const std::string& address() const { return address_; }

  // The upstream of the ranks presenting `authorization`, held until
  // Release; RESOURCE_EXHAUSTED when kMaxTokens others are held.
  absl::StatusOr<Upstream*> AcquireUpstream(const std::string& authorization) {
    absl::MutexLock lock(&mu_);
    return Acquire(&upstreams_, authorization, [&] {
      return std::make_unique<Upstream>(channel_, authorization, options_.node,
                                        options_.batch_window, options_.join_window, &verified_);
    });
  }
  void Release(Upstream* upstream) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Upstream> gone = ReleaseFrom(&upstreams_, upstream);
    if (gone != nullptr) retired_upstreams_.push_back(std::move(gone));
  }

  uint64_t NewLocalStream() { return next_local_.fetch_add(1, std::memory_order_relaxed); }

  RequestBudget& budget() { return budget_; }

  // A rank stream's place (--max_rank_streams): OK, or RESOURCE_EXHAUSTED.
  absl::Status TakeRankStream() {
    if (rank_streams_.fetch_add(1) < options_.max_rank_streams) return absl::OkStatus();
    rank_streams_.fetch_sub(1);
    return absl::ResourceExhaustedError(
        absl::StrCat("the node agent has ", options_.max_rank_streams,
                     " heartbeat streams open, the most it may (its --max_rank_streams)"));
  }
  void ReleaseRankStream() { rank_streams_.fetch_sub(1); }

  // The bootstrap fan-out of the ranks presenting `authorization`, held
  // until Release.
  absl::StatusOr<StoreWaitFanOut*> AcquireFanOut(const std::string& authorization) {
    absl::MutexLock lock(&mu_);
    return Acquire(&fan_outs_, authorization, [&] {
      return std::make_unique<StoreWaitFanOut>(channel_, authorization, &verified_);
    });
  }
  void Release(StoreWaitFanOut* fan_out) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<StoreWaitFanOut> gone = ReleaseFrom(&fan_outs_, fan_out);
    if (gone == nullptr) return;
    retired_calls_ += gone->calls();
    retired_fan_outs_.push_back(std::move(gone));
  }

  HostAgent::StoreWaitCounts StoreWaits() {
    absl::MutexLock lock(&mu_);
    HostAgent::StoreWaitCounts counts;
    counts.server_calls = retired_calls_;
    for (auto& [token, fan_out] : fan_outs_) {
      counts.held += fan_out.held->held();
      counts.server_calls += fan_out.held->calls();
    }
    return counts;
  }

  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* Heartbeat(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* StoreWait(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;

 private:
  const HostAgentOptions options_;
  std::unique_ptr<Client> client_;          // null with options_.server_channel
  std::shared_ptr<grpc::Channel> channel_;  // to the server
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::atomic<uint64_t> next_local_{1};
  std::atomic<int> rank_streams_{0};  // open now (--max_rank_streams)
  RequestBudget budget_;              // what the ranks' requests hold
  // The credentials the server accepted (verified_credentials.h): what is
  // shared is shared among these only. 64K: every rank of a large host's
  // jobs over many re-joins.
  VerifiedCredentials verified_{65536};

  // Per bearer token: an upstream or a fan-out and how many ranks' calls
  // hold it. The last to let go retires it; the reaper stops and frees it
  // off the gRPC threads (#44 finding 5: a thread per bogus token forever).
  template <typename T>
  struct InUse {
    std::unique_ptr<T> held;
    int users = 0;
  };
  // Bearer tokens served at once, each with its upstream (two threads while
  // its ranks beat) and its fan-out.
  static constexpr size_t kMaxTokens = 256;

  template <typename T, typename Make>
  absl::StatusOr<T*> Acquire(std::map<std::string, InUse<T>>* by_token,
                             const std::string& authorization, const Make& make)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = by_token->find(authorization);
    if (it == by_token->end()) {
      if (by_token->size() >= kMaxTokens) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the node agent serves ranks of ", kMaxTokens,
                         " bearer tokens at once, the most it may; try again when some have left"));
      }
      it = by_token->emplace(authorization, InUse<T>{make(), 0}).first;
    }
    ++it->second.users;
    return it->second.held.get();
  }
  template <typename T>
  std::unique_ptr<T> ReleaseFrom(std::map<std::string, InUse<T>>* by_token, T* held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = by_token->begin(); it != by_token->end(); ++it) {
      if (it->second.held.get() != held || --it->second.users > 0) continue;
      std::unique_ptr<T> gone = std::move(it->second.held);
      by_token->erase(it);
      return gone;
    }
    return nullptr;
  }

  // Stops and frees what was retired, until the agent stops.
  void Reap() {
    while (true) {
      std::vector<std::unique_ptr<Upstream>> upstreams;
      std::vector<std::unique_ptr<StoreWaitFanOut>> fan_outs;
      {
        absl::MutexLock lock(&mu_);
        auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !retired_upstreams_.empty() || !retired_fan_outs_.empty();
        };
        mu_.Await(absl::Condition(&work));
        upstreams.swap(retired_upstreams_);
        fan_outs.swap(retired_fan_outs_);
        if (stopping_ && upstreams.empty() && fan_outs.empty()) return;
      }
      upstreams.clear();  // ~Upstream stops it and joins its threads
      fan_outs.clear();
    }
  }

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, InUse<Upstream>> upstreams_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, InUse<StoreWaitFanOut>> fan_outs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Upstream>> retired_upstreams_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<StoreWaitFanOut>> retired_fan_outs_ ABSL_GUARDED_BY(mu_);
  int64_t retired_calls_ ABSL_GUARDED_BY(mu_) = 0;  // server calls of retired fan-outs
  std::thread reaper_{[this] { Reap(); }};
};

namespace {

// A rank's heartbeat stream to the agent: each beat goes upstream, its
// answer comes back on this stream; the next beat is read after the answer
// is written (as the server's own stream does).
class RankHeartbeat : public grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  // `upstream`: held for this stream (released when it is done), or why
  // there is none (the stream is refused at once).
  RankHeartbeat(HostAgent::Impl* agent, absl::StatusOr<Upstream*> upstream, uint64_t local)
      : agent_(agent), upstream_(upstream.ok() ? *upstream : nullptr), local_(local) {
    if (!upstream.ok()) {
      Finish(grpc::Status(static_cast<grpc::StatusCode>(upstream.status().code()),
                          std::string(upstream.status().message())));
      return;
    }
    StartRead(&request_);
  }
  ~RankHeartbeat() override {
    if (upstream_ == nullptr) return;
    agent_->Release(upstream_);
    agent_->ReleaseRankStream();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the rank closed its stream, or its process is gone: say so now
      if (beaten_) upstream_->Closed(local_, member_);
      Finish(grpc::Status::OK);
      return;
    }
    // Held until its answer: the parsed beat, the queue's copy and the
    // request it goes upstream in.
    absl::Status held = request_.ByteSizeLong() > kMaxForwardedBytes
                            ? TooLarge("beat", request_.ByteSizeLong())
                            : Hold(3 * request_.SpaceUsedLong());
    if (!held.ok()) {
      if (beaten_) upstream_->Closed(local_, member_);
      Finish(grpc::Status(static_cast<grpc::StatusCode>(held.code()), std::string(held.message())));
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
  absl::Status Hold(size_t bytes) {
    absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> hold =
        agent_->budget().Take(bytes, "heartbeat");
    if (!hold.ok()) return hold.status();
    hold_ = *std::move(hold);
    return absl::OkStatus();
  }

  void Answer(const v1::RankAnswer& answer) {
    hold_.reset();
    if (answer.error_code() != 0) {  // fenced, refused: the rank hears it as from the server
      Finish(
          grpc::Status(static_cast<grpc::StatusCode>(answer.error_code()), answer.error_message()));
      return;
    }
    response_ = answer.response();
    StartWrite(&response_);
  }

  HostAgent::Impl* const agent_;
  Upstream* const upstream_;
  const uint64_t local_;
  bool beaten_ = false;
  v1::MemberCredentials member_;               // of the latest beat
  std::unique_ptr<RequestBudget::Hold> hold_;  // the beat in flight's
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
  // `fan_out`: held for this call (released when it is done).
  RankStoreWait(HostAgent::Impl* agent, StoreWaitFanOut* fan_out)
      : agent_(agent), fan_out_(fan_out) {}
  ~RankStoreWait() override { agent_->Release(fan_out_); }
  // Released with the call: what its request holds (request_budget.h).
  void Keep(std::unique_ptr<RequestBudget::Hold> hold) { hold_ = std::move(hold); }
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
  HostAgent::Impl* const agent_;
  StoreWaitFanOut* const fan_out_;
  std::unique_ptr<RequestBudget::Hold> hold_;
  absl::Mutex mu_;
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool starting_ ABSL_GUARDED_BY(mu_) = true;  // Start has not returned from Wait
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

// A reactor that finishes at once with `status`.
class Refused : public grpc::ServerUnaryReactor {
 public:
  explicit Refused(const absl::Status& status) {
    Finish(
        grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message())));
  }
  void OnDone() override { delete this; }
};

grpc::ServerUnaryReactor* HostAgent::Impl::StoreWait(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* wire,
                                                     grpc::ByteBuffer* response) {
  // Its bytes, the parsed request and the fan-out's copy of it, and the
  // call, before it is parsed.
  absl::StatusOr<size_t> parsed = RequestBudget::ParsedBytes(*wire);
  if (!parsed.ok()) return new Refused(parsed.status());
  absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> hold =
      budget_.Take(wire->Length() + 2 * *parsed + kCallBytes, "StoreWait");
  if (!hold.ok()) return new Refused(hold.status());
  v1::StoreWaitRequest request;
  grpc::ByteBuffer shared(*wire);  // the same slices; parsing consumes this reference
  grpc::ProtoBufferReader reader(&shared);
  if (!request.ParseFromZeroCopyStream(&reader)) {
    return new Refused(absl::InvalidArgumentError("the StoreWait request could not be parsed"));
  }
  // The answer is empty: written before the call can finish.
  bool own = false;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, v1::StoreWaitResponse>(v1::StoreWaitResponse(),
                                                                         response, &own);
  absl::StatusOr<StoreWaitFanOut*> fan_out = AcquireFanOut(AuthorizationOf(context));
  if (!fan_out.ok()) return new Refused(fan_out.status());
  auto* call = new RankStoreWait(this, *fan_out);
  call->Keep(*std::move(hold));
  call->Start(request);  // `call` may be finished and gone by now: only its pointer is returned
  return call;
}

grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* HostAgent::Impl::Heartbeat(
    grpc::CallbackServerContext* context) {
  if (absl::Status place = TakeRankStream(); !place.ok()) {
    return new RankHeartbeat(this, place, 0);
  }
  absl::StatusOr<Upstream*> upstream = AcquireUpstream(AuthorizationOf(context));
  if (!upstream.ok()) ReleaseRankStream();
  return new RankHeartbeat(this, upstream, NewLocalStream());
}

grpc::ServerUnaryReactor* HostAgent::Impl::Join(grpc::CallbackServerContext* context,
                                                const v1::JoinRequest* request,
                                                v1::JoinResponse* response) {
  if (request->ByteSizeLong() > kMaxForwardedBytes) {
    return new Refused(TooLarge("join", request->ByteSizeLong()));
  }
  // The parsed join, the batch's copy and the request it goes upstream in,
  // that request's bytes and gRPC's copy of them, and the call: held until
  // it is answered.
  absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> hold =
      budget_.Take(3 * request->SpaceUsedLong() + 2 * request->ByteSizeLong() + kCallBytes, "Join");
  if (!hold.ok()) return new Refused(hold.status());
  absl::StatusOr<Upstream*> upstream = AcquireUpstream(AuthorizationOf(context));
  if (!upstream.ok()) return new Refused(upstream.status());
  auto* call = new RankJoin();
  absl::Time deadline = absl::Now() + absl::Hours(1);
  absl::Time call_deadline = absl::FromChrono(context->deadline());
  if (call_deadline < deadline) deadline = call_deadline;
  // `call` (and `response`) live until `done` finishes it; nothing here
  // touches them after Join returns. The upstream is held until then.
  (*upstream)->Join(
      *request, deadline,
      [this, call, response, held = *upstream,
       bytes = std::shared_ptr<RequestBudget::Hold>(*std::move(hold))](
          const grpc::Status& status, const v1::JoinResponse& r) mutable {
        if (status.ok()) *response = r;
        bytes.reset();
        call->Done(status);
        Release(held);
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
