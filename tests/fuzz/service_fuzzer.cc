// The server's request handlers without gRPC: every zeroshard.v1 RPC of
// server_fuzzer.cc, called on the handlers of one ShardServer built by
// StartWithoutNetwork (the same Membership, KvStore, PlanService,
// CheckpointService and CoordinatorService, wired as the real server wires
// them), with a FakeClock. No call waits: a handler's reactor is bound to a
// fake gRPC call that records its Finish; a held call (a Join in its barrier,
// a StoreGet or StoreWait) stays held while the input's later records run
// (another join may complete its barrier, a Set its wait, a tick its
// deadline) and is cancelled, as a caller that went away, at the input's end.
// Any sequence of calls gets statuses, never a crash or a sanitizer report,
// and a cancelled held call is always answered.
//
// Input: up to kMaxCalls records (rpc_records.h; "$" as a member token is
// the last join's credentials). Method bytes beyond the RPCs (byte % kOps):
//   kTick          the fake clock moves by the record's first 4 bytes (ms,
//                  little-endian, at most kMaxAdvance) and the server ticks
//                  (deaths, expired joins and waits, diagnosis, history)
//   kAuthenticate  the record's bytes as an "authorization" header's value
//                  (or "key\0value") checked by a server with an admin token
//                  and a token for job "fuzz"; the caller it proves is the
//                  one later heartbeats and uploads act as (at first: admin)
//   kCloseStream   the last heartbeat stream closes (evidence of death)
//   kCancelHeld    every held call's caller goes away now
// The unary handlers run with no bearer token on a server without
// authentication (admin), as in server_fuzzer; the bearer check itself is
// reached through kAuthenticate. Node agents' RPCs are not fuzzed.
//
// ZEROSHARD_FUZZ_WRITE_SEED=DIR writes the seed corpus to DIR and exits;
// ZEROSHARD_FUZZ_TRACE=1 prints each call's outcome (to see what a seed does).
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_callback.h"
#include "proto/zeroshard.grpc.pb.h"
#include "common/checkpoint_format.h"
#include "common/checksum.h"
#include "common/safetensors.h"
#include "shard_server/base/clock.h"
#include "shard_server/auth/job_credentials.h"
#include "shard_server/shard_server.h"
#include "tests/fuzz/rpc_records.h"

namespace {

using namespace zeroshard;  // NOLINT: a test driver
using fuzz::Method;

constexpr int kMaxCalls = 16;
constexpr uint8_t kTick = fuzz::kRpcMethods;
constexpr uint8_t kAuthenticate = fuzz::kRpcMethods + 1;
constexpr uint8_t kCloseStream = fuzz::kRpcMethods + 2;
constexpr uint8_t kCancelHeld = fuzz::kRpcMethods + 3;
constexpr uint8_t kOps = fuzz::kRpcMethods + 4;
// A tick moves the clock at most this far: past every timeout the server
// has (heartbeat 3 s, join 10 min, job_ttl 24 h).
constexpr absl::Duration kMaxAdvance = absl::Hours(25);
// A consolidation is real work on a thread of its own; one that has not
// finished after this long is a hang (a finding).
constexpr absl::Duration kConsolidationHang = absl::Seconds(60);
constexpr char kAdminToken[] = "fuzz-admin-token-0123456789abcdef";

// With ZEROSHARD_FUZZ_TRACE set: "<what>: <status>" on stderr.
void Trace(absl::string_view what, const grpc::Status& status) {
  static const bool on = std::getenv("ZEROSHARD_FUZZ_TRACE") != nullptr;
  if (!on) return;
  std::fprintf(stderr, "  %.*s: %s %s\n", static_cast<int>(what.size()), what.data(),
               status.ok() ? "OK" : absl::StatusCodeToString(
                                        static_cast<absl::StatusCode>(status.error_code())).c_str(),
               status.error_message().c_str());
}

// The end of a unary call as gRPC's callback API sees it: Finish is recorded;
// the driver calls the reactor's OnDone once it is (never inside Finish:
// InternalBindCall replays a Finish under the reactor's own lock).
class FakeUnaryCall final : public grpc::ServerCallbackUnary {
 public:
  explicit FakeUnaryCall(grpc::ServerUnaryReactor* reactor) : reactor_(reactor) {
    BindReactor(reactor);
  }
  void Finish(grpc::Status s) override {
    if (finished_) std::abort();  // a reactor finished twice
    finished_ = true;
    status_ = std::move(s);
  }
  void SendInitialMetadata() override {}
  bool finished() const { return finished_; }
  const grpc::Status& status() const { return status_; }
  grpc::ServerUnaryReactor* unary_reactor() const { return reactor_; }

 private:
  grpc::internal::ServerReactor* reactor() override { return reactor_; }
  void CallOnDone() override {}

  grpc::ServerUnaryReactor* const reactor_;
  bool finished_ = false;
  grpc::Status status_;
};

// A client stream (UploadShard) fed from the driver: Read records where the
// next message goes; the driver fills it and calls OnReadDone.
class FakeReader final : public grpc::ServerCallbackReader<v1::UploadShardRequest> {
 public:
  explicit FakeReader(grpc::ServerReadReactor<v1::UploadShardRequest>* reactor)
      : reactor_(reactor) {
    BindReactor(reactor);
  }
  void Finish(grpc::Status s) override {
    if (finished_) std::abort();
    finished_ = true;
    status_ = std::move(s);
  }
  void SendInitialMetadata() override {}
  void Read(v1::UploadShardRequest* message) override {
    if (read_into_ != nullptr) std::abort();  // two reads outstanding
    read_into_ = message;
  }
  // Hands `message` (null: the client's end of the stream) to the read
  // outstanding; false when none is.
  bool Deliver(const v1::UploadShardRequest* message) {
    v1::UploadShardRequest* into = read_into_;
    if (into == nullptr || finished_) return false;
    read_into_ = nullptr;
    if (message != nullptr) *into = *message;
    reactor_->OnReadDone(message != nullptr);
    return true;
  }
  bool finished() const { return finished_; }
  const grpc::Status& status() const { return status_; }

 private:
  grpc::internal::ServerReactor* reactor() override { return reactor_; }
  void CallOnDone() override {}

  grpc::ServerReadReactor<v1::UploadShardRequest>* const reactor_;
  v1::UploadShardRequest* read_into_ = nullptr;
  bool finished_ = false;
  grpc::Status status_;
};

// A server stream (Consolidate), written by the reactor's producer thread:
// each write is acknowledged by the driver.
class FakeWriter final : public grpc::ServerCallbackWriter<v1::ConsolidateResponse> {
 public:
  explicit FakeWriter(grpc::ServerWriteReactor<v1::ConsolidateResponse>* reactor)
      : reactor_(reactor) {
    BindReactor(reactor);
  }
  void Finish(grpc::Status s) override {
    absl::MutexLock lock(&mu_);
    if (finished_) std::abort();
    finished_ = true;
    status_ = std::move(s);
  }
  void SendInitialMetadata() override {}
  void Write(const v1::ConsolidateResponse*, grpc::WriteOptions) override {
    absl::MutexLock lock(&mu_);
    if (write_pending_) std::abort();  // a write before the last one completed
    write_pending_ = true;
  }
  void WriteAndFinish(const v1::ConsolidateResponse*, grpc::WriteOptions,
                      grpc::Status s) override {
    absl::MutexLock lock(&mu_);
    finished_ = true;
    status_ = std::move(s);
  }
  // Acknowledges writes until the reactor finishes; its status.
  grpc::Status ReadToTheEnd() {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return write_pending_ || finished_;
        };
        if (!mu_.AwaitWithTimeout(absl::Condition(&ready), kConsolidationHang)) std::abort();
        if (finished_) return status_;
        write_pending_ = false;
      }
      reactor_->OnWriteDone(true);
    }
  }

 private:
  grpc::internal::ServerReactor* reactor() override { return reactor_; }
  void CallOnDone() override {}

  grpc::ServerWriteReactor<v1::ConsolidateResponse>* const reactor_;
  absl::Mutex mu_;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// One unary call: what the handler may keep pointers to until it finishes.
struct UnaryCall {
  grpc::CallbackServerContext context;
  std::unique_ptr<google::protobuf::Message> request;
  std::unique_ptr<google::protobuf::Message> response;
  std::unique_ptr<FakeUnaryCall> call;
};

struct Harness {
  FakeClock clock;
  std::string dir;  // the checkpoint root's and the token files' parent
  std::unique_ptr<ShardServer> server;
  // An authenticated server's credentials (admin token, a token file for job
  // "fuzz"): what kAuthenticate checks.
  std::unique_ptr<JobCredentials> credentials;
  v1::MemberCredentials last_member;  // of the last successful Join
  absl::StatusOr<Caller> caller = Caller{/*admin=*/true, ""};
  std::vector<std::unique_ptr<UnaryCall>> held;
  uint64_t next_stream = 1;
  v1::MemberCredentials last_beat;  // the member of the last heartbeat stream
  uint64_t last_stream = 0;
};

// The server's directory (checkpoints, token files), removed at exit.
std::string* g_dir = nullptr;
void RemoveDir() {
  std::error_code ignored;
  std::filesystem::remove_all(*g_dir, ignored);
}

// On tmpfs when there is one: an upload's fsync then costs nothing.
std::string TempDir(const char* name) {
  std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm/" : "/tmp/";
  dir += name;
  dir += ".XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) std::abort();
  g_dir = new std::string(dir);
  std::atexit(RemoveDir);
  return dir;
}

// One server for every input: a server's start costs ~3 ms under ASan (its
// SQLite schemas), more than an input's calls. ForgetJobs empties it between
// inputs.
Harness& TheHarness() {
  static Harness* h = [] {
    auto* harness = new Harness;
    harness->dir = TempDir("service_fuzzer");
    const std::string tokens = harness->dir + "/tokens";
    const std::string root = harness->dir + "/checkpoints";
    if (mkdir(tokens.c_str(), 0700) != 0 || mkdir(root.c_str(), 0700) != 0) std::abort();
    absl::StatusOr<std::string> job_token = CreateJobTokenFile(tokens, "fuzz");
    if (!job_token.ok()) std::abort();
    harness->credentials = std::make_unique<JobCredentials>(kAdminToken, tokens, false);
    ShardServerOptions options;
    options.checkpoint_root = root;
    options.keep_last = 2;  // the root does not grow with every upload the fuzzer completes
    options.clock = &harness->clock;
    options.log_sink = [](const std::string&) {};  // the event log would flood stderr
    absl::StatusOr<std::unique_ptr<ShardServer>> server =
        ShardServer::StartWithoutNetwork(options);
    if (!server.ok()) {
      std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
      std::abort();
    }
    harness->server = *std::move(server);
    return harness;
  }();
  return *h;
}

// What the last input left: every member falls silent and is declared dead,
// then every job is forgotten (job_ttl), with its keys, plans and history.
// So an input starts from the server's empty state (but for the checkpoints
// on disk, which outlive their jobs), and its finding replays alone.
void ForgetJobs(Harness& h) {
  for (int pass = 0; pass < 2; ++pass) {
    h.clock.Advance(kMaxAdvance);
    h.server->Tick();
  }
}

// A finished call is done: its reactor's OnDone (a held call frees itself),
// and a join's credentials become the last join's.
void EndCall(Harness& h, UnaryCall& c) {
  Trace(c.request->GetDescriptor()->name(), c.call->status());
  if (c.call->status().ok()) {
    if (auto* join = dynamic_cast<v1::JoinResponse*>(c.response.get())) {
      const auto& request = static_cast<const v1::JoinRequest&>(*c.request);
      h.last_member.set_job_id(request.job_id());
      h.last_member.set_generation(join->generation());
      h.last_member.set_rank(join->rank());
      h.last_member.set_token(join->token());
    }
  }
  c.call->unary_reactor()->OnDone();
}

// Ends the held calls that finished since.
void EndFinished(Harness& h) {
  for (size_t i = 0; i < h.held.size();) {
    if (h.held[i]->call->finished()) {
      std::unique_ptr<UnaryCall> done = std::move(h.held[i]);
      h.held.erase(h.held.begin() + i);
      EndCall(h, *done);
    } else {
      ++i;
    }
  }
}

// Every held call's caller goes away: gRPC's OnCancel, which must answer it.
void CancelHeld(Harness& h) {
  EndFinished(h);
  std::vector<std::unique_ptr<UnaryCall>> held = std::move(h.held);
  h.held.clear();
  for (auto& c : held) {
    if (!c->call->finished()) c->call->unary_reactor()->OnCancel();
  }
  for (auto& c : held) {
    if (!c->call->finished()) {
      std::fprintf(stderr, "a held %s was cancelled and never answered\n",
                   c->request->GetDescriptor()->name().c_str());
      std::abort();
    }
    EndCall(h, *c);
  }
  EndFinished(h);  // answers a cancellation caused (a barrier's other joins)
}

template <typename Request, typename Response>
using UnaryHandler = grpc::ServerUnaryReactor* (CoordinatorService::*)(
    grpc::CallbackServerContext*, const Request*, Response*);

// Calls a unary handler with the request in `bytes`; the call is held when it
// does not finish at once.
template <typename Request, typename Response>
void Unary(Harness& h, absl::string_view bytes, UnaryHandler<Request, Response> handler) {
  auto c = std::make_unique<UnaryCall>();
  c->request = std::make_unique<Request>();
  if (!fuzz::ParseRequest(bytes, h.last_member, c->request.get())) return;
  c->response = std::make_unique<Response>();
  grpc::ServerUnaryReactor* reactor = (h.server->coordinator()->*handler)(
      &c->context, static_cast<const Request*>(c->request.get()),
      static_cast<Response*>(c->response.get()));
  c->call = std::make_unique<FakeUnaryCall>(reactor);
  if (c->call->finished()) {
    EndCall(h, *c);
  } else {
    h.held.push_back(std::move(c));
  }
}

// Two beats on one stream, which stays open (kCloseStream closes it), as
// heartbeat_streams.cc serves them: the caller must be allowed the job.
void Heartbeat(Harness& h, absl::string_view bytes) {
  v1::HeartbeatRequest request;
  if (!fuzz::ParseRequest(bytes, h.last_member, &request)) return;
  if (!h.caller.ok() || !h.caller->MayActOn(request.member().job_id()).ok()) return;
  const uint64_t stream = h.next_stream++;
  for (int beat = 0; beat < 2; ++beat) {
    absl::StatusOr<v1::HeartbeatResponse> answer =
        h.server->membership()->Heartbeat(request, stream);
    Trace("HeartbeatRequest",
          grpc::Status(static_cast<grpc::StatusCode>(answer.status().code()),
                       answer.ok() ? v1::Command_Name(answer->command())
                                   : std::string(answer.status().message())));
    if (!answer.ok()) break;
  }
  h.last_beat = request.member();
  h.last_stream = stream;
}

void CloseStream(Harness& h) {
  if (h.last_stream == 0) return;
  h.server->membership()->HeartbeatStreamClosed(h.last_beat, h.last_stream);
  h.last_stream = 0;
}

// The request with the first half of its data, then the rest as the next
// chunk, then the end of the stream, as the caller kAuthenticate proved last.
void Upload(Harness& h, absl::string_view bytes) {
  v1::UploadShardRequest first;
  if (!fuzz::ParseRequest(bytes, h.last_member, &first)) return;
  v1::UploadShardRequest rest;
  const size_t half = first.data().size() / 2;
  rest.set_data(first.data().substr(half));
  first.mutable_data()->resize(half);
  grpc::CallbackServerContext context;
  v1::UploadShardResponse response;
  grpc::ServerReadReactor<v1::UploadShardRequest>* reactor =
      h.server->checkpoints()->UploadShard(&context, h.caller, &response);
  FakeReader reader(reactor);
  for (const v1::UploadShardRequest* message : {&first, &rest}) {
    if (!reader.Deliver(message)) break;
  }
  reader.Deliver(nullptr);
  if (!reader.finished()) std::abort();  // the stream ended and no answer came
  Trace("UploadShardRequest", reader.status());
  reactor->OnDone();
}

void Consolidate(Harness& h, absl::string_view bytes) {
  v1::ConsolidateRequest request;
  if (!fuzz::ParseRequest(bytes, h.last_member, &request)) return;
  grpc::CallbackServerContext context;
  grpc::ServerWriteReactor<v1::ConsolidateResponse>* reactor =
      h.server->coordinator()->Consolidate(&context, &request);
  FakeWriter writer(reactor);
  Trace("ConsolidateRequest", writer.ReadToTheEnd());
  reactor->OnDone();  // joins the producer thread
}

void Tick(Harness& h, absl::string_view bytes) {
  uint32_t ms = 0;
  std::memcpy(&ms, bytes.data(), std::min(bytes.size(), sizeof(ms)));
  h.clock.Advance(std::min(absl::Milliseconds(ms), kMaxAdvance));
  h.server->Tick();
}

// `bytes` as the authorization header's value, or "key\0value".
void Authenticate(Harness& h, absl::string_view bytes) {
  std::string key = "authorization";
  std::string value(bytes);
  if (size_t nul = value.find('\0'); nul != std::string::npos) {
    key = value.substr(0, nul);
    value = value.substr(nul + 1);
  }
  ClientMetadata metadata;
  metadata.emplace(grpc::string_ref(key), grpc::string_ref(value));
  h.caller = h.credentials->Identify(metadata);
  (void)h.credentials->Authorize(metadata, "fuzz");
}

void Call(Harness& h, uint8_t method, absl::string_view bytes) {
  using S = CoordinatorService;
  switch (method % kOps) {
    case fuzz::kJoin:
      return Unary(h, bytes, &S::Join);
    case fuzz::kHeartbeat:
      return Heartbeat(h, bytes);
    case fuzz::kLeave:
      return Unary(h, bytes, &S::Leave);
    case fuzz::kStoreSet:
      return Unary<v1::StoreSetRequest, v1::StoreSetResponse>(h, bytes, &S::StoreSet);
    case fuzz::kStoreGet:
      return Unary(h, bytes, &S::StoreGet);
    case fuzz::kStoreAdd:
      return Unary(h, bytes, &S::StoreAdd);
    case fuzz::kStoreWait:
      return Unary<v1::StoreWaitRequest, v1::StoreWaitResponse>(h, bytes, &S::StoreWait);
    case fuzz::kStoreCompareSet:
      return Unary<v1::StoreCompareSetRequest, v1::StoreCompareSetResponse>(h, bytes,
                                                                          &S::StoreCompareSet);
    case fuzz::kStoreDelete:
      return Unary(h, bytes, &S::StoreDelete);
    case fuzz::kStoreCheck:
      return Unary<v1::StoreCheckRequest, v1::StoreCheckResponse>(h, bytes, &S::StoreCheck);
    case fuzz::kStoreNumKeys:
      return Unary(h, bytes, &S::StoreNumKeys);
    case fuzz::kGetStatus:
      return Unary(h, bytes, &S::GetStatus);
    case fuzz::kPlanShards:
      return Unary(h, bytes, &S::PlanShards);
    case fuzz::kCommitShard:
      return Unary(h, bytes, &S::CommitShard);
    case fuzz::kUploadShard:
      return Upload(h, bytes);
    case fuzz::kListCheckpoints:
      return Unary(h, bytes, &S::ListCheckpoints);
    case fuzz::kConsolidate:
      return Consolidate(h, bytes);
    case fuzz::kGetHistory:
      return Unary(h, bytes, &S::GetHistory);
    case kTick:
      return Tick(h, bytes);
    case kAuthenticate:
      return Authenticate(h, bytes);
    case kCloseStream:
      return CloseStream(h);
    default:
      return CancelHeld(h);
  }
}

void RunInput(const uint8_t* data, size_t size) {
  Harness& h = TheHarness();
  ForgetJobs(h);
  Trace("jobs left from the last input",
        grpc::Status(grpc::StatusCode::OK,
                     std::to_string(h.server->membership()->Status("").jobs_size())));
  h.caller = Caller{/*admin=*/true, ""};
  h.last_member.Clear();
  h.last_stream = 0;
  fuzz::ForEachRecord(data, size, kMaxCalls, [&h](uint8_t method, absl::string_view bytes) {
    Call(h, method, bytes);
    EndFinished(h);
  });
  CancelHeld(h);
  CloseStream(h);
}

std::string U32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

// Beyond server_fuzzer's seeds: a two-member job formed by two held joins,
// a wait answered by a set and one expired by a tick, a member declared dead
// by its closed stream, a job token's caller, and an upload, commit and
// consolidation of a whole checkpoint.
std::vector<std::pair<std::string, std::string>> MoreSeeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  std::string pair;
  v1::JoinRequest join;
  join.set_job_id("pair");
  join.set_world_size(2);
  join.set_worker_id("w0");
  join.set_host("127.0.0.1");
  fuzz::AddRecord(fuzz::kJoin, join, &pair);
  join.set_worker_id("w1");
  fuzz::AddRecord(fuzz::kJoin, join, &pair);
  v1::StoreWaitRequest wait;
  *wait.mutable_member() = fuzz::LastJoin();
  wait.add_keys("k");
  wait.set_timeout_ms(1000);
  fuzz::AddRecord(fuzz::kStoreWait, wait, &pair);
  v1::StoreSetRequest set;
  *set.mutable_member() = fuzz::LastJoin();
  set.set_key("k");
  set.set_value("v");
  fuzz::AddRecord(fuzz::kStoreSet, set, &pair);
  wait.clear_keys();
  wait.add_keys("never");
  fuzz::AddRecord(fuzz::kStoreWait, wait, &pair);
  fuzz::AddRawRecord(kTick, U32(2000), &pair);
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = fuzz::LastJoin();
  beat.set_step(1);
  fuzz::AddRecord(fuzz::kHeartbeat, beat, &pair);
  fuzz::AddRawRecord(kCloseStream, "", &pair);
  fuzz::AddRawRecord(kTick, U32(100), &pair);
  v1::GetStatusRequest status;
  status.set_job_id("pair");
  fuzz::AddRecord(fuzz::kGetStatus, status, &pair);
  seeds.emplace_back("pair_formed_and_broken", pair);

  std::string token;
  fuzz::AddRawRecord(kAuthenticate, "Bearer wrong", &token);
  join.set_job_id("fuzz");
  join.set_world_size(1);
  join.set_worker_id("w0");
  fuzz::AddRecord(fuzz::kJoin, join, &token);
  fuzz::AddRecord(fuzz::kHeartbeat, beat, &token);
  fuzz::AddRawRecord(kAuthenticate, std::string("authorization\0Bearer ", 21) + kAdminToken,
                     &token);
  fuzz::AddRecord(fuzz::kHeartbeat, beat, &token);
  fuzz::AddRawRecord(kTick, U32(25 * 3600 * 1000), &token);
  seeds.emplace_back("callers_and_job_ttl", token);

  // A one-rank job's whole checkpoint: the plan and shard file of
  // shard_file_fuzzer's seed (read from the repository: run from its root),
  // uploaded, committed, listed and consolidated.
  std::string checkpoint;
  join.set_job_id("j");  // the job the shard file names
  fuzz::AddRecord(fuzz::kJoin, join, &checkpoint);
  v1::PlanShardsRequest plan;
  *plan.mutable_member() = fuzz::LastJoin();
  plan.set_world_size(1);
  for (const auto& [name, shape, unit] :
       {std::tuple<const char*, std::vector<int64_t>, const char*>{"0.weight", {8, 4}, "0"},
        {"0.bias", {8}, "0"},
        {"1.weight", {2, 8}, "1"}}) {
    v1::TensorSpec* t = plan.mutable_spec()->add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_dtype("F32");
    t->set_unit(unit);
  }
  fuzz::AddRecord(fuzz::kPlanShards, plan, &checkpoint);
  std::ifstream in("tests/fuzz/corpus/shard_file_fuzzer/valid_w1.safetensors", std::ios::binary);
  const std::string shard((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (shard.empty()) std::abort();
  v1::UploadShardRequest chunk;
  *chunk.mutable_member() = fuzz::LastJoin();
  chunk.set_step(1);
  chunk.set_file("j/step-1/rank-0-of-1.safetensors");
  chunk.set_size_bytes(static_cast<int64_t>(shard.size()));
  chunk.set_data(shard);
  fuzz::AddRecord(fuzz::kUploadShard, chunk, &checkpoint);
  v1::CommitShardRequest commit;
  *commit.mutable_member() = fuzz::LastJoin();
  commit.set_step(1);
  commit.set_file(chunk.file());
  commit.set_size_bytes(chunk.size_bytes());
  // The checksums the file's metadata claims, as a worker commits them.
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::OpenBuffer("seed", shard);
  if (!reader.ok()) std::abort();
  std::map<std::string, std::string> sums;
  auto claimed = (*reader)->metadata().find(ShardMetadataKey::kChecksums);
  if (claimed == (*reader)->metadata().end() || !ChecksumsFromJson(claimed->second, &sums)) {
    std::abort();
  }
  for (const auto& [tensor, hex] : sums) {
    v1::TensorChecksum* c = commit.add_checksums();
    c->set_tensor(tensor);
    c->set_xxh64(hex);
  }
  fuzz::AddRecord(fuzz::kCommitShard, commit, &checkpoint);
  v1::ListCheckpointsRequest list;
  list.set_job_id("j");
  fuzz::AddRecord(fuzz::kListCheckpoints, list, &checkpoint);
  v1::ConsolidateRequest consolidate;
  consolidate.set_job_id("j");
  consolidate.set_step(1);
  fuzz::AddRecord(fuzz::kConsolidate, consolidate, &checkpoint);
  seeds.emplace_back("checkpoint_upload_commit_consolidate", checkpoint);
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Strings that are not UTF-8 are refused with a log line each: most inputs.
  google::protobuf::SetLogHandler(nullptr);
  if (const char* dir = std::getenv("ZEROSHARD_FUZZ_WRITE_SEED")) {
    std::vector<std::pair<std::string, std::string>> seeds = fuzz::ServerSeeds();
    for (auto& seed : MoreSeeds()) seeds.push_back(std::move(seed));
    fuzz::WriteSeeds(dir, seeds);
    // The member's life must get past authentication, or the seeds are weak.
    const std::string& life = seeds.front().second;
    RunInput(reinterpret_cast<const uint8_t*>(life.data()), life.size());
    const bool joined = !TheHarness().last_member.token().empty();
    std::fprintf(stderr, "seeds in %s; member_life %s\n", dir, joined ? "joined" : "did NOT join");
    std::exit(joined ? 0 : 1);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  RunInput(data, size);
  return 0;
}
