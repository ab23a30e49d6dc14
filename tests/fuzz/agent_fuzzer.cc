// The node agent's service (agent/host_agent.h) and the server's side of it
// (HostHeartbeat, HostJoin): a HostAgent in the process, its upstream an
// in-process channel to a ShardServer on a FakeClock, the ranks' calls made
// on the agent's unix socket. Any sequence of calls gets statuses,
// never a crash, a hang or a sanitizer report, from the agent and the server.
//
// Input: up to kMaxCalls records (rpc_records.h's format; "$" as a member
// token is the last successful join's credentials, through the agent or
// straight to the server). Method bytes (byte % kOps):
//   kJoin           a JoinRequest through the agent (held at most kHeld)
//   kBeat           a HeartbeatRequest on the agent: on the newest open rank
//                   stream, or a new one (at most kMaxStreams open)
//   kWait           a StoreWaitRequest through the agent (held at most kHeld)
//   kCloseStream    the newest rank stream closes (the agent reports it)
//   kAuthorization  the record's printable bytes as the bearer header of
//                   later calls
//   kServerJoin     a JoinRequest straight to the server (a member for "$")
//   kTick           the server's fake clock moves by the record's first 4
//                   bytes (ms, at most 25 h) and it ticks (deaths, expiries)
//   kHostBeat       a HostHeartbeatRequest straight to the server, on a
//                   stream of its own (each RankBeat's "$" token substituted)
//   kHostJoin       a HostJoinRequest straight to the server
// Every input starts from an empty server (its jobs forgotten by two 25 h
// ticks) and ends with every stream it opened closed.
//
// ZEROSHARD_FUZZ_WRITE_SEED=DIR writes the seed corpus to DIR and exits.
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "agent/host_agent.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/base/clock.h"
#include "shard_server/shard_server.h"
#include "tests/fuzz/rpc_records.h"

namespace {

using namespace zeroshard;  // NOLINT: a test driver

enum Op : uint8_t {
  kJoin = 0,
  kBeat,
  kWait,
  kCloseStream,
  kAuthorization,
  kServerJoin,
  kTick,
  kHostBeat,
  kHostJoin,
  kOps,
};
constexpr int kMaxCalls = 12;
constexpr int kMaxStreams = 4;
// A held join or wait is given up after this (the agent then withdraws it).
constexpr auto kHeld = std::chrono::milliseconds(3);
// A beat is answered at once by the server; one that is not is a finding.
constexpr auto kBeatAnswer = std::chrono::seconds(30);
constexpr absl::Duration kMaxAdvance = absl::Hours(25);

using RankStream = grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>;

struct OpenStream {
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<RankStream> stream;
};

struct Harness {
  FakeClock clock;
  std::unique_ptr<ShardServer> server;
  std::unique_ptr<HostAgent> agent;
  std::unique_ptr<v1::Coordinator::Stub> via_agent;
  std::unique_ptr<v1::Coordinator::Stub> to_server;
  std::unique_ptr<v1::HostAgent::Stub> host_to_server;
  v1::MemberCredentials last_member;
  std::string authorization;  // "" : none
  std::vector<OpenStream> streams;
};

// The agent's socket directory, removed at exit.
std::string* g_dir = nullptr;
void RemoveDir() {
  std::error_code ignored;
  std::filesystem::remove_all(*g_dir, ignored);
}

Harness& TheHarness() {
  static Harness* h = [] {
    auto* harness = new Harness;
    ShardServerOptions options;
    options.clock = &harness->clock;
    options.log_sink = [](const std::string&) {};  // the event log would flood stderr
    absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start(options);
    if (!server.ok()) {
      std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
      std::abort();
    }
    harness->server = *std::move(server);
    HostAgentOptions agent;
    agent.server_channel = harness->server->InProcessChannel();
    agent.node = "agent-fuzzer boot-1";
    agent.batch_window = absl::ZeroDuration();
    agent.join_window = absl::ZeroDuration();
    // The ranks reach it on a unix socket, as they do on a host: gRPC's
    // in-process transport keeps both ends of a rank stream the agent ends
    // with an error (~20 KB each, growing without bound over an input's
    // refused beats), which a socket does not.
    char dir[] = "/tmp/agent_fuzzer.XXXXXX";
    if (mkdtemp(dir) == nullptr) std::abort();
    g_dir = new std::string(dir);
    std::atexit(RemoveDir);
    agent.listen = std::string("unix:") + dir + "/agent.sock";
    absl::StatusOr<std::unique_ptr<HostAgent>> started = HostAgent::Start(agent);
    if (!started.ok()) {
      std::fprintf(stderr, "%s\n", started.status().ToString().c_str());
      std::abort();
    }
    harness->agent = *std::move(started);
    harness->via_agent = v1::Coordinator::NewStub(
        grpc::CreateChannel(harness->agent->address(), grpc::InsecureChannelCredentials()));
    harness->to_server = v1::Coordinator::NewStub(harness->server->InProcessChannel());
    harness->host_to_server = v1::HostAgent::NewStub(harness->server->InProcessChannel());
    return harness;
  }();
  return *h;
}

void Prepare(const Harness& h, grpc::ClientContext* context, std::chrono::milliseconds timeout) {
  if (!h.authorization.empty()) context->AddMetadata("authorization", h.authorization);
  context->set_deadline(std::chrono::system_clock::now() + timeout);
}

void Remember(Harness& h, const v1::JoinRequest& join, const v1::JoinResponse& joined) {
  h.last_member.set_job_id(join.job_id());
  h.last_member.set_generation(joined.generation());
  h.last_member.set_rank(joined.rank());
  h.last_member.set_token(joined.token());
}

void Join(Harness& h, absl::string_view bytes, v1::Coordinator::Stub* stub) {
  v1::JoinRequest join;
  if (!fuzz::ParseRequest(bytes, h.last_member, &join)) return;
  grpc::ClientContext context;
  // A job of one forms at once (a finding if it does not within 30 s);
  // larger ones are held until given up.
  Prepare(h, &context,
          join.world_size() == 1
              ? std::chrono::duration_cast<std::chrono::milliseconds>(kBeatAnswer)
              : kHeld);
  v1::JoinResponse joined;
  grpc::Status s = stub->Join(&context, join, &joined);
  if (std::getenv("ZEROSHARD_FUZZ_TRACE") != nullptr) {
    std::fprintf(stderr, "  join %s: %d %s\n", join.job_id().c_str(), s.error_code(),
                 s.error_message().c_str());
  }
  if (s.ok()) Remember(h, join, joined);
}

void CloseNewest(Harness& h) {
  if (h.streams.empty()) return;
  OpenStream open = std::move(h.streams.back());
  h.streams.pop_back();
  open.stream->WritesDone();
  open.context->TryCancel();
  open.stream->Finish();
}

void Beat(Harness& h, absl::string_view bytes) {
  v1::HeartbeatRequest beat;
  if (!fuzz::ParseRequest(bytes, h.last_member, &beat)) return;
  if (h.streams.empty() || (h.streams.size() < kMaxStreams && beat.step() % 2 == 1)) {
    OpenStream open;
    open.context = std::make_unique<grpc::ClientContext>();
    Prepare(h, open.context.get(),
            std::chrono::duration_cast<std::chrono::milliseconds>(kBeatAnswer * 4));
    open.stream = h.via_agent->Heartbeat(open.context.get());
    h.streams.push_back(std::move(open));
  }
  OpenStream& open = h.streams.back();
  v1::HeartbeatResponse answer;
  if (!open.stream->Write(beat) || !open.stream->Read(&answer)) {
    // Refused or broken: the stream is over, with the agent's status.
    // Half-closed first, as every client library does: gRPC's in-process
    // transport keeps both ends of a call the client never half-closes
    // (~20 KB a call), which a real connection does not.
    OpenStream gone = std::move(h.streams.back());
    h.streams.pop_back();
    gone.stream->WritesDone();
    grpc::Status s = gone.stream->Finish();
    gone.context->TryCancel();
    if (std::getenv("ZEROSHARD_FUZZ_TRACE") != nullptr) {
      std::fprintf(stderr, "  beat: %d %s\n", s.error_code(), s.error_message().c_str());
    }
  }
}

void Wait(Harness& h, absl::string_view bytes) {
  v1::StoreWaitRequest wait;
  if (!fuzz::ParseRequest(bytes, h.last_member, &wait)) return;
  grpc::ClientContext context;
  Prepare(h, &context, kHeld);
  v1::StoreWaitResponse response;
  (void)h.via_agent->StoreWait(&context, wait, &response);
}

void Tick(Harness& h, absl::string_view bytes) {
  uint32_t ms = 0;
  std::memcpy(&ms, bytes.data(), std::min(bytes.size(), sizeof(ms)));
  h.clock.Advance(std::min(absl::Milliseconds(ms), kMaxAdvance));
  h.server->Tick();
}

void HostBeat(Harness& h, absl::string_view bytes) {
  v1::HostHeartbeatRequest request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return;
  for (v1::RankBeat& beat : *request.mutable_beats()) {
    if (beat.beat().member().token() == "$") *beat.mutable_beat()->mutable_member() = h.last_member;
  }
  grpc::ClientContext context;
  Prepare(h, &context, std::chrono::duration_cast<std::chrono::milliseconds>(kBeatAnswer));
  auto stream = h.host_to_server->HostHeartbeat(&context);
  v1::HostHeartbeatResponse response;
  if (stream->Write(request)) (void)stream->Read(&response);
  stream->WritesDone();
  context.TryCancel();
  stream->Finish();
}

void HostJoin(Harness& h, absl::string_view bytes) {
  v1::HostJoinRequest request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return;
  grpc::ClientContext context;
  Prepare(h, &context, kHeld);
  auto reader = h.host_to_server->HostJoin(&context, request);
  v1::HostJoinResponse answers;
  while (reader->Read(&answers)) {
  }
  reader->Finish();
}

void Call(Harness& h, uint8_t method, absl::string_view bytes) {
  switch (method % kOps) {
    case kJoin:
      return Join(h, bytes, h.via_agent.get());
    case kBeat:
      return Beat(h, bytes);
    case kWait:
      return Wait(h, bytes);
    case kCloseStream:
      return CloseNewest(h);
    case kAuthorization:
      // A header value gRPC lets a client send: printable ASCII (a client
      // library asserts on any other before the agent could see it).
      h.authorization.clear();
      for (char c : bytes.substr(0, 256)) {
        if (c >= 0x20 && c < 0x7f) h.authorization.push_back(c);
      }
      return;
    case kServerJoin:
      return Join(h, bytes, h.to_server.get());
    case kTick:
      return Tick(h, bytes);
    case kHostBeat:
      return HostBeat(h, bytes);
    default:
      return HostJoin(h, bytes);
  }
}

void RunInput(const uint8_t* data, size_t size) {
  Harness& h = TheHarness();
  for (int pass = 0; pass < 2; ++pass) {  // the last input's jobs are forgotten
    h.clock.Advance(kMaxAdvance);
    h.server->Tick();
  }
  h.last_member.Clear();
  h.authorization.clear();
  fuzz::ForEachRecord(data, size, kMaxCalls,
                      [&h](uint8_t method, absl::string_view bytes) { Call(h, method, bytes); });
  while (!h.streams.empty()) CloseNewest(h);
}

std::string U32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

std::vector<std::pair<std::string, std::string>> Seeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  v1::JoinRequest join;
  join.set_job_id("fuzz");
  join.set_world_size(1);
  join.set_worker_id("w0");
  join.set_host("127.0.0.1");
  join.set_incarnation("w0-1");
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = fuzz::LastJoin();
  beat.set_step(1);
  beat.set_loss(2.5);
  v1::StoreWaitRequest wait;
  *wait.mutable_member() = fuzz::LastJoin();
  wait.add_keys("k");
  wait.set_timeout_ms(1);

  std::string life;  // a rank's life through the agent
  fuzz::AddRecord(kJoin, join, &life);
  fuzz::AddRecord(kBeat, beat, &life);
  beat.set_step(2);
  fuzz::AddRecord(kBeat, beat, &life);
  fuzz::AddRecord(kWait, wait, &life);
  fuzz::AddRawRecord(kCloseStream, "", &life);
  fuzz::AddRawRecord(kTick, U32(5000), &life);
  seeds.emplace_back("rank_life", life);

  std::string pair;  // a job of two, one rank joined straight to the server
  join.set_job_id("pair");
  join.set_world_size(2);
  fuzz::AddRecord(kServerJoin, join, &pair);
  join.set_worker_id("w1");
  fuzz::AddRecord(kJoin, join, &pair);
  beat.set_step(1);
  fuzz::AddRecord(kBeat, beat, &pair);
  fuzz::AddRecord(kWait, wait, &pair);
  seeds.emplace_back("pair", pair);

  std::string tokens;  // wrong bearer tokens and credentials
  fuzz::AddRawRecord(kAuthorization, "Bearer not-a-token", &tokens);
  join.set_job_id("solo");
  join.set_world_size(1);
  fuzz::AddRecord(kJoin, join, &tokens);
  v1::HeartbeatRequest forged;
  forged.mutable_member()->set_job_id("solo");
  forged.mutable_member()->set_generation(1);
  forged.mutable_member()->set_token("forged");
  forged.set_step(1);
  fuzz::AddRecord(kBeat, forged, &tokens);
  seeds.emplace_back("tokens", tokens);

  std::string host;  // the server's side of an agent
  join.set_job_id("host");
  fuzz::AddRecord(kServerJoin, join, &host);
  v1::HostHeartbeatRequest host_beat;
  host_beat.set_node("fuzz-host boot-1");
  v1::RankBeat* rank = host_beat.add_beats();
  rank->set_local_stream(7);
  *rank->mutable_beat()->mutable_member() = fuzz::LastJoin();
  rank = host_beat.add_beats();
  rank->set_local_stream(7);
  rank->set_same_member(true);
  v1::RankStreamClosed* closed = host_beat.add_closed();
  closed->set_local_stream(7);
  fuzz::AddRecord(kHostBeat, host_beat, &host);
  v1::HostJoinRequest host_join;
  host_join.set_node("fuzz-host boot-1");
  join.set_job_id("hosted");
  join.set_world_size(2);
  *host_join.add_joins() = join;
  join.set_worker_id("w0");
  *host_join.add_joins() = join;
  fuzz::AddRecord(kHostJoin, host_join, &host);
  seeds.emplace_back("host_side", host);
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  if (const char* dir = std::getenv("ZEROSHARD_FUZZ_WRITE_SEED")) {
    const std::vector<std::pair<std::string, std::string>> seeds = Seeds();
    fuzz::WriteSeeds(dir, seeds);
    // The rank's life must join through the agent, or the seeds are weak.
    const std::string& life = seeds.front().second;
    RunInput(reinterpret_cast<const uint8_t*>(life.data()), life.size());
    const bool joined = !TheHarness().last_member.token().empty();
    std::fprintf(stderr, "seeds in %s; rank_life %s\n", dir, joined ? "joined" : "did NOT join");
    std::exit(joined ? 0 : 1);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  RunInput(data, size);
  return 0;
}
