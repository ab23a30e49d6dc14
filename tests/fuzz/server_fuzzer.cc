// The server's request handlers: every zeroshard.v1 RPC, fed through the real
// services (CoordinatorService, Membership, KvStore, PlanService, the
// checkpoint service) of one ShardServer over an in-process channel. Any
// sequence of requests gets statuses, never a crash or a sanitizer report.
//
// Input: up to kMaxCalls records of [method byte][size: u16 little-endian]
// [size bytes: the serialized request].
// ZEROSHARD_FUZZ_WRITE_SEED=DIR writes the seed corpus to DIR and exits. A request whose MemberCredentials
// token is "$" gets the credentials of the last successful Join instead, so
// the fuzzer reaches what lies behind authentication (heartbeats, the KV
// store, checkpoints of a live member). Every call has a 5 ms deadline:
// held calls (a Join waiting for its barrier, a StoreWait) end by it.
#include <cstdint>
#include <cstdlib>
#include <sys/stat.h>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/shard_server.h"

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

// "$" as the token: the last join's credentials.
void FillCredentials(google::protobuf::Message* request, const v1::MemberCredentials& member) {
  const google::protobuf::FieldDescriptor* field =
      request->GetDescriptor()->FindFieldByName("member");
  if (field == nullptr || field->message_type() != v1::MemberCredentials::descriptor()) return;
  auto* credentials = static_cast<v1::MemberCredentials*>(
      request->GetReflection()->MutableMessage(request, field));
  if (credentials->token() == "$") *credentials = member;
}

template <typename Request>
bool Parse(absl::string_view bytes, Request* request, const Harness& h) {
  if (!request->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return false;
  FillCredentials(request, h.last_member);
  return true;
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
    case 0: return Join(h, bytes);
    case 1: return Heartbeat(h, bytes);
    case 2: return Unary<v1::LeaveRequest, v1::LeaveResponse>(h, bytes, &Coordinator::Stub::Leave);
    case 3: return Unary<v1::StoreSetRequest, v1::StoreSetResponse>(h, bytes, &Coordinator::Stub::StoreSet);
    case 4: return Unary<v1::StoreGetRequest, v1::StoreGetResponse>(h, bytes, &Coordinator::Stub::StoreGet);
    case 5: return Unary<v1::StoreAddRequest, v1::StoreAddResponse>(h, bytes, &Coordinator::Stub::StoreAdd);
    case 6: return Unary<v1::StoreWaitRequest, v1::StoreWaitResponse>(h, bytes, &Coordinator::Stub::StoreWait);
    case 7: return Unary<v1::StoreCompareSetRequest, v1::StoreCompareSetResponse>(h, bytes, &Coordinator::Stub::StoreCompareSet);
    case 8: return Unary<v1::StoreDeleteRequest, v1::StoreDeleteResponse>(h, bytes, &Coordinator::Stub::StoreDelete);
    case 9: return Unary<v1::StoreCheckRequest, v1::StoreCheckResponse>(h, bytes, &Coordinator::Stub::StoreCheck);
    case 10: return Unary<v1::StoreNumKeysRequest, v1::StoreNumKeysResponse>(h, bytes, &Coordinator::Stub::StoreNumKeys);
    case 11: return Unary<v1::GetStatusRequest, v1::GetStatusResponse>(h, bytes, &Coordinator::Stub::GetStatus);
    case 12: return Unary<v1::PlanShardsRequest, v1::PlanShardsResponse>(h, bytes, &Coordinator::Stub::PlanShards);
    case 13: return Unary<v1::CommitShardRequest, v1::CommitShardResponse>(h, bytes, &Coordinator::Stub::CommitShard);
    case 14: return Upload(h, bytes);
    case 15: return Unary<v1::ListCheckpointsRequest, v1::ListCheckpointsResponse>(h, bytes, &Coordinator::Stub::ListCheckpoints);
    case 16: return Consolidate(h, bytes);
    case 17: return Unary<v1::GetHistoryRequest, v1::GetHistoryResponse>(h, bytes, &Coordinator::Stub::GetHistory);
    default: return Unary<v1::StoreSetRequest, v1::StoreSetResponse>(h, bytes, &Coordinator::Stub::StoreSet);
  }
}

// One record of the input format.
void AddRecord(int method, const google::protobuf::Message& request, std::string* out) {
  const std::string bytes = request.SerializeAsString();
  out->push_back(static_cast<char>(method));
  out->push_back(static_cast<char>(bytes.size() & 0xff));
  out->push_back(static_cast<char>(bytes.size() >> 8));
  *out += bytes;
}

v1::MemberCredentials LastJoin() {
  v1::MemberCredentials member;
  member.set_token("$");
  return member;
}

// Seeds: a member's life (join, beat, KV, plan, commit, leave) and the calls
// that need no member.
void WriteSeeds(const std::string& dir) {
  std::string life;
  v1::JoinRequest join;
  join.set_job_id("fuzz");
  join.set_world_size(1);
  join.set_worker_id("w0");
  join.set_host("127.0.0.1");
  AddRecord(0, join, &life);
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = LastJoin();
  beat.set_step(3);
  beat.set_loss(1.5);
  AddRecord(1, beat, &life);
  v1::StoreSetRequest set;
  *set.mutable_member() = LastJoin();
  set.set_key("k");
  set.set_value("v");
  AddRecord(3, set, &life);
  v1::StoreWaitRequest wait;
  *wait.mutable_member() = LastJoin();
  wait.add_keys("k");
  wait.add_keys("absent");
  wait.set_timeout_ms(5);
  AddRecord(6, wait, &life);
  v1::PlanShardsRequest plan;
  *plan.mutable_member() = LastJoin();
  plan.set_world_size(1);
  v1::TensorSpec* t = plan.mutable_spec()->add_tensors();
  t->set_name("0.weight");
  t->add_shape(8);
  t->add_shape(4);
  t->set_dtype("F32");
  AddRecord(12, plan, &life);
  v1::CommitShardRequest commit;
  *commit.mutable_member() = LastJoin();
  commit.set_step(1);
  commit.set_file("fuzz/step-1/rank-0-of-1.safetensors");
  commit.set_size_bytes(8);
  AddRecord(13, commit, &life);
  v1::LeaveRequest leave;
  *leave.mutable_member() = LastJoin();
  AddRecord(2, leave, &life);

  std::string anonymous;
  v1::GetStatusRequest status;
  AddRecord(11, status, &anonymous);
  plan.clear_member();
  plan.set_world_size(4);
  AddRecord(12, plan, &anonymous);
  v1::ListCheckpointsRequest list;
  list.set_job_id("fuzz");
  AddRecord(15, list, &anonymous);
  v1::ConsolidateRequest consolidate;
  AddRecord(16, consolidate, &anonymous);

  std::string upload;
  AddRecord(0, join, &upload);
  v1::UploadShardRequest chunk;
  *chunk.mutable_member() = LastJoin();
  chunk.set_step(1);
  chunk.set_file("fuzz/step-1/rank-0-of-1.safetensors");
  chunk.set_size_bytes(8);
  chunk.set_data("abcd");
  AddRecord(14, chunk, &upload);
  AddRecord(13, commit, &upload);

  for (const auto& [name, bytes] : {std::pair<std::string, std::string>{"member_life", life},
                                    {"anonymous_calls", anonymous},
                                    {"upload_and_commit", upload}}) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
  }
}

void RunInput(const uint8_t* data, size_t size);

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("ZEROSHARD_FUZZ_WRITE_SEED")) {
    WriteSeeds(dir);
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
  size_t at = 0;
  for (int calls = 0; calls < kMaxCalls && at + 3 <= size; ++calls) {
    const uint8_t method = data[at];
    const size_t length = std::min<size_t>(data[at + 1] | (data[at + 2] << 8), size - at - 3);
    Call(h, method, absl::string_view(reinterpret_cast<const char*>(data + at + 3), length));
    at += 3 + length;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  RunInput(data, size);
  return 0;
}
