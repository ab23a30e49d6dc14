// The server's request handlers: every zeroshard.v1 RPC, fed through the real
// services (CoordinatorService, Membership, KvStore, PlanService, the
// checkpoint service) of one ShardServer over an in-process channel. Any
// sequence of requests gets statuses, never a crash or a sanitizer report.
//
// Input: up to kMaxCalls records (rpc_records.h; "$" as a member token is the
// last join's credentials). ZEROSHARD_FUZZ_WRITE_SEED=DIR writes the seed corpus
// to DIR and exits. Every call has a 5 ms deadline: held calls (a Join waiting
// for its barrier, a StoreWait) end by it, so this target runs tens of inputs a
// second; service_fuzzer.cc drives the same handlers without gRPC, thousands a
// second, and is the one run long. This one keeps the gRPC layer itself
// (serialization, interceptors, the heartbeat streams' async code) in reach.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/shard_server.h"
#include "tests/fuzz/rpc_records.h"

namespace {

using namespace zeroshard;  // NOLINT: a test driver
using v1::Coordinator;

constexpr int kMaxCalls = 8;
constexpr auto kCallDeadline = std::chrono::milliseconds(5);

struct Harness {
  std::unique_ptr<ShardServer> server;
  std::unique_ptr<Coordinator::Stub> stub;
  v1::MemberCredentials last_member;  // of the last successful Join
};

Harness& TheHarness() {
  static Harness* h = [] {
    char dir[] = "/tmp/server_fuzzer.XXXXXX";
    if (mkdtemp(dir) == nullptr) std::abort();
    ShardServerOptions options;
    options.checkpoint_root = std::string(dir) + "/checkpoints";
    options.log_sink = [](const std::string&) {};  // the event log would flood stderr
    if (mkdir(options.checkpoint_root.c_str(), 0700) != 0) std::abort();
    absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start(options);
    if (!server.ok()) std::abort();
    auto* harness = new Harness;
    harness->server = *std::move(server);
    harness->stub = Coordinator::NewStub(harness->server->InProcessChannel());
    return harness;
  }();
  return *h;
}

template <typename Request>
bool Parse(absl::string_view bytes, Request* request, const Harness& h) {
  return fuzz::ParseRequest(bytes, h.last_member, request);
}

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
}

// Calls a unary method with the request in `bytes`.
template <typename Request, typename Response, typename Method>
void Unary(Harness& h, absl::string_view bytes, Method method, Response* response = nullptr) {
  Request request;
  if (!Parse(bytes, &request, h)) return;
  Response local;
  grpc::ClientContext context;
  SetDeadline(&context);
  (void)((*h.stub).*method)(&context, request, response != nullptr ? response : &local);
}

void Join(Harness& h, absl::string_view bytes) {
  v1::JoinRequest request;
  if (!Parse(bytes, &request, h)) return;
  v1::JoinResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  if (h.stub->Join(&context, request, &response).ok()) {
    h.last_member.set_job_id(request.job_id());
    h.last_member.set_generation(response.generation());
    h.last_member.set_rank(response.rank());
    h.last_member.set_token(response.token());
  }
}

void Heartbeat(Harness& h, absl::string_view bytes) {
  v1::HeartbeatRequest request;
  if (!Parse(bytes, &request, h)) return;
  grpc::ClientContext context;
  SetDeadline(&context);
  auto stream = h.stub->Heartbeat(&context);
  stream->Write(request);
  stream->Write(request);  // a second beat on the same stream
  stream->WritesDone();
  v1::HeartbeatResponse response;
  while (stream->Read(&response)) {
  }
  (void)stream->Finish();
}

void Upload(Harness& h, absl::string_view bytes) {
  v1::UploadShardRequest request;
  if (!Parse(bytes, &request, h)) return;
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::UploadShardResponse response;
  auto stream = h.stub->UploadShard(&context, &response);
  stream->Write(request);
  v1::UploadShardRequest rest;  // the bytes again, as the next chunk
  rest.set_data(request.data());
  stream->Write(rest);
  stream->WritesDone();
  (void)stream->Finish();
}

void Consolidate(Harness& h, absl::string_view bytes) {
  v1::ConsolidateRequest request;
  if (!Parse(bytes, &request, h)) return;
  grpc::ClientContext context;
  SetDeadline(&context);
  auto stream = h.stub->Consolidate(&context, request);
  v1::ConsolidateResponse response;
  while (stream->Read(&response)) {
  }
  (void)stream->Finish();
}

void Call(Harness& h, uint8_t method, absl::string_view bytes) {
  switch (method % 19) {
    case 0:
      return Join(h, bytes);
    case 1:
      return Heartbeat(h, bytes);
    case 2:
      return Unary<v1::LeaveRequest, v1::LeaveResponse>(h, bytes, &Coordinator::Stub::Leave);
    case 3:
      return Unary<v1::StoreSetRequest, v1::StoreSetResponse>(h, bytes,
                                                              &Coordinator::Stub::StoreSet);
    case 4:
      return Unary<v1::StoreGetRequest, v1::StoreGetResponse>(h, bytes,
                                                              &Coordinator::Stub::StoreGet);
    case 5:
      return Unary<v1::StoreAddRequest, v1::StoreAddResponse>(h, bytes,
                                                              &Coordinator::Stub::StoreAdd);
    case 6:
      return Unary<v1::StoreWaitRequest, v1::StoreWaitResponse>(h, bytes,
                                                                &Coordinator::Stub::StoreWait);
    case 7:
      return Unary<v1::StoreCompareSetRequest, v1::StoreCompareSetResponse>(
          h, bytes, &Coordinator::Stub::StoreCompareSet);
    case 8:
      return Unary<v1::StoreDeleteRequest, v1::StoreDeleteResponse>(
          h, bytes, &Coordinator::Stub::StoreDelete);
    case 9:
      return Unary<v1::StoreCheckRequest, v1::StoreCheckResponse>(h, bytes,
                                                                  &Coordinator::Stub::StoreCheck);
    case 10:
      return Unary<v1::StoreNumKeysRequest, v1::StoreNumKeysResponse>(
          h, bytes, &Coordinator::Stub::StoreNumKeys);
    case 11:
      return Unary<v1::GetStatusRequest, v1::GetStatusResponse>(h, bytes,
                                                                &Coordinator::Stub::GetStatus);
    case 12:
      return Unary<v1::PlanShardsRequest, v1::PlanShardsResponse>(h, bytes,
                                                                  &Coordinator::Stub::PlanShards);
    case 13:
      return Unary<v1::CommitShardRequest, v1::CommitShardResponse>(
          h, bytes, &Coordinator::Stub::CommitShard);
    case 14:
      return Upload(h, bytes);
    case 15:
      return Unary<v1::ListCheckpointsRequest, v1::ListCheckpointsResponse>(
          h, bytes, &Coordinator::Stub::ListCheckpoints);
    case 16:
      return Consolidate(h, bytes);
    case 17:
      return Unary<v1::GetHistoryRequest, v1::GetHistoryResponse>(h, bytes,
                                                                  &Coordinator::Stub::GetHistory);
    default:
      return Unary<v1::StoreSetRequest, v1::StoreSetResponse>(h, bytes,
                                                              &Coordinator::Stub::StoreSet);
  }
}

void RunInput(const uint8_t* data, size_t size);

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("ZEROSHARD_FUZZ_WRITE_SEED")) {
    fuzz::WriteSeeds(dir, fuzz::ServerSeeds());
    std::ifstream in(std::string(dir) + "/member_life", std::ios::binary);
    const std::string life((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    RunInput(reinterpret_cast<const uint8_t*>(life.data()), life.size());
    const bool joined = !TheHarness().last_member.token().empty();
    std::fprintf(stderr, "seeds in %s; member_life %s\n", dir, joined ? "joined" : "did NOT join");
    std::exit(joined ? 0 : 1);
  }
  return 0;
}

namespace {

void RunInput(const uint8_t* data, size_t size) {
  Harness& h = TheHarness();
  fuzz::ForEachRecord(data, size, kMaxCalls,
                      [&h](uint8_t method, absl::string_view bytes) { Call(h, method, bytes); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  RunInput(data, size);
  return 0;
}
