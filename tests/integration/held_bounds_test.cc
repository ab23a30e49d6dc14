// #44 with a real shard_server process: what a caller's heartbeats make the
// server hold is bounded. Recovery records and telemetry strings beyond
// their bounds are refused, naming the field, and a job's status stays
// small however many records its rank 0 sends (finding 1); beats an agent's
// stream carries that the server refuses leave nothing behind, and one such
// stream carries at most 4,096 rank streams (finding 2); a one-off plan,
// which any token may ask, is bounded in size and computed one at a time
// (finding 6).
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

// A member of a one-member job `job`, joined straight to the server.
v1::MemberCredentials JoinAlone(const LocalCluster& cluster, const std::string& job) {
  ClientOptions options;
  options.server = cluster.address();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return {};
  absl::StatusOr<JoinInfo> info = (*client)->Join(job, 1, "w0", "127.0.0.1", absl::Seconds(30));
  EXPECT_TRUE(info.ok()) << info.status();
  return (*client)->credentials();
}

// One beat on a fresh Heartbeat stream: OK with the answer, or the status
// the server ended the stream with.
grpc::Status BeatOnce(const std::string& address, const v1::HeartbeatRequest& beat) {
  auto stub = testing::NewCoordinatorStub(address);
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(30));
  auto stream = stub->Heartbeat(&context);
  v1::HeartbeatResponse response;
  if (stream->Write(beat) && stream->Read(&response)) {
    stream->WritesDone();
    context.TryCancel();
    stream->Finish();
    return grpc::Status::OK;
  }
  return stream->Finish();
}

TEST(BeatPayloadTest, OversizedRecordsAndUnitNamesAreRefusedAndTheJobsStatusStaysSmall) {
  LocalCluster cluster(testing::MakeTempDir("beat-payload"));
  ASSERT_TRUE(cluster.ok());
  const v1::MemberCredentials member = JoinAlone(cluster, "records");
  ASSERT_FALSE(member.token().empty());

  // The attack's beats: a 4 MiB record source, a 1 MiB unit name, 1 MiB of
  // fields the server does not know inside the telemetry.
  v1::HeartbeatRequest big_source;
  *big_source.mutable_member() = member;
  big_source.mutable_recovery()->set_generation(1);
  big_source.mutable_recovery()->set_source(std::string(4 << 20, 's'));
  v1::HeartbeatRequest big_unit;
  *big_unit.mutable_member() = member;
  big_unit.mutable_telemetry()->mutable_in_progress()->set_unit(std::string(1 << 20, 'u'));
  v1::HeartbeatRequest unknown;
  *unknown.mutable_member() = member;
  unknown.mutable_telemetry()
      ->GetReflection()
      ->MutableUnknownFields(unknown.mutable_telemetry())
      ->AddLengthDelimited(999, std::string(1 << 20, 'x'));
  const std::vector<std::pair<const v1::HeartbeatRequest*, std::string>> refused = {
      {&big_source, "recovery.source"},
      {&big_unit, "telemetry.in_progress.unit"},
      {&unknown, "HeartbeatRequest.telemetry is"}};
  for (const auto& [beat, field] : refused) {
    grpc::Status s = BeatOnce(cluster.address(), *beat);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field << ": " << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), field)) << s.error_message();
  }

  // The largest legal beats, each with a record of a new generation: the job
  // keeps the last 32 records, and its status is a few kB.
  auto stub = testing::NewCoordinatorStub(cluster.address());
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(60));
  auto stream = stub->Heartbeat(&context);
  for (int g = 1; g <= 100; ++g) {
    v1::HeartbeatRequest beat;
    *beat.mutable_member() = member;
    v1::RecoveryRecord* r = beat.mutable_recovery();
    r->set_generation(g);
    r->set_source(std::string(32, 's'));
    r->set_phase(std::string(32, 'p'));
    beat.mutable_telemetry()->mutable_in_progress()->set_unit(std::string(256, 'u'));
    v1::HeartbeatResponse response;
    ASSERT_TRUE(stream->Write(beat) && stream->Read(&response)) << "beat " << g << " refused";
  }
  auto status_stub = testing::NewCoordinatorStub(cluster.address());
  grpc::ClientContext status_context;
  testing::PrepareContext(&status_context, absl::Seconds(30));
  v1::GetStatusRequest request;
  request.set_job_id("records");
  v1::GetStatusResponse status;
  grpc::Status got = status_stub->GetStatus(&status_context, request, &status);
  ASSERT_TRUE(got.ok()) << got.error_message();
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).recoveries_size(), 32);
  EXPECT_EQ(status.jobs(0).recoveries(31).generation(), 100);
  // 32 records of at most 256 bytes, one member's telemetry of at most
  // 1 kB, and the job's own few hundred bytes.
  EXPECT_LT(status.ByteSizeLong(), 32u * 256 + 1024 + 4096);
  context.TryCancel();
  stream->Finish();
}

// An agent's HostHeartbeat stream, by hand.
class AgentStream {
 public:
  explicit AgentStream(const std::string& address)
      : stub_(v1::HostAgent::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    stream_ = stub_->HostHeartbeat(&context_);
  }
  ~AgentStream() { Close(); }

  // A message of one beat per local stream in [first, first + n), each with
  // `member`; the server's answers.
  v1::HostHeartbeatResponse Beat(uint64_t first, int n, const v1::MemberCredentials& member) {
    v1::HostHeartbeatRequest request;
    request.set_node("held-bounds-host boot-1");
    for (int i = 0; i < n; ++i) {
      v1::RankBeat* beat = request.add_beats();
      beat->set_local_stream(first + i);
      *beat->mutable_beat()->mutable_member() = member;
    }
    v1::HostHeartbeatResponse response;
    EXPECT_TRUE(stream_->Write(request));
    EXPECT_TRUE(stream_->Read(&response));
    return response;
  }
  void Close() {
    if (stream_ == nullptr) return;
    context_.TryCancel();
    stream_->Finish();
    stream_.reset();
  }

 private:
  std::unique_ptr<v1::HostAgent::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>>
      stream_;
};

// The server's "agent_stream_closed" lines' rank_streams values, in order.
std::vector<std::string> ClosedAgentStreams(LocalCluster& cluster) {
  std::vector<std::string> counts;
  const std::string log = cluster.server()->Log();
  for (size_t at = log.find("event=agent_stream_closed"); at != std::string::npos;
       at = log.find("event=agent_stream_closed", at + 1)) {
    const size_t end = log.find('\n', at);
    const std::string line = log.substr(at, end == std::string::npos ? end : end - at);
    const size_t count = line.find("rank_streams=");
    counts.push_back(count == std::string::npos ? "?" : line.substr(count + 13));
  }
  return counts;
}

// Finding 2: 200,000 beats on as many local streams, each with a wrong
// token for a job that does not exist, then one accepted: the stream holds
// one rank stream, and closing it closes that one (the server's log says
// how many it carried; 200,001 before).
TEST(AgentStreamBoundsTest, RefusedBeatsLeaveNothingHeldOnTheAgentsStream) {
  LocalCluster cluster(testing::MakeTempDir("agent-refused"));
  ASSERT_TRUE(cluster.ok());
  const v1::MemberCredentials member = JoinAlone(cluster, "real");
  ASSERT_FALSE(member.token().empty());
  v1::MemberCredentials forged;
  forged.set_job_id("no-such-job");
  forged.set_generation(1);
  forged.set_token("not-a-token");
  AgentStream stream(cluster.address());
  constexpr int kMessages = 10;
  constexpr int kBeats = 20000;
  for (int m = 0; m < kMessages; ++m) {
    v1::HostHeartbeatResponse r =
        stream.Beat(1000 + static_cast<uint64_t>(m) * kBeats, kBeats, forged);
    ASSERT_EQ(r.answers_size(), kBeats);
    // Within a message, the first 4,096 new rank streams are judged (and
    // refused); the rest are over the stream's bound. The next message
    // finds the table empty again.
    for (int i = 0; i < kBeats; ++i) {
      ASSERT_EQ(r.answers(i).error_code(),
                i < 4096 ? grpc::StatusCode::NOT_FOUND : grpc::StatusCode::RESOURCE_EXHAUSTED)
          << "message " << m << " beat " << i << ": " << r.answers(i).error_message();
    }
  }
  v1::HostHeartbeatResponse ok = stream.Beat(1, 1, member);
  ASSERT_EQ(ok.answers(0).error_code(), 0) << ok.answers(0).error_message();
  // A refused beat on the accepted rank's own local stream keeps it.
  ASSERT_NE(stream.Beat(1, 1, forged).answers(0).error_code(), 0);
  stream.Close();
  ASSERT_TRUE(
      testing::WaitFor([&] { return !ClosedAgentStreams(cluster).empty(); }, absl::Seconds(20)))
      << "the server never logged the agent's stream closing";
  EXPECT_EQ(ClosedAgentStreams(cluster), std::vector<std::string>{"1"});
}

// One agent stream carries at most 4,096 rank streams; the next is refused
// naming the bound, and a closed one makes room.
TEST(AgentStreamBoundsTest, AnAgentsStreamCarriesAtMost4096RankStreams) {
  LocalCluster cluster(testing::MakeTempDir("agent-bound"));
  ASSERT_TRUE(cluster.ok());
  const v1::MemberCredentials member = JoinAlone(cluster, "many");
  ASSERT_FALSE(member.token().empty());
  AgentStream stream(cluster.address());
  v1::HostHeartbeatResponse r = stream.Beat(1, 4097, member);
  ASSERT_EQ(r.answers_size(), 4097);
  for (int i = 0; i < 4096; ++i) {
    ASSERT_EQ(r.answers(i).error_code(), 0) << i << ": " << r.answers(i).error_message();
  }
  EXPECT_EQ(r.answers(4096).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(r.answers(4096).error_message(), "4096"))
      << r.answers(4096).error_message();
}

// A one-off plan request (no member) of `tensors` tensors of 256 x 64 f32
// over `world` ranks.
v1::PlanShardsRequest OneOffPlan(int tensors, int world, int64_t rows = 256, int64_t cols = 64) {
  v1::PlanShardsRequest request;
  request.set_world_size(world);
  for (int i = 0; i < tensors; ++i) {
    v1::TensorSpec* t = request.mutable_spec()->add_tensors();
    t->set_name(absl::StrCat("layer", i / 8, ".t", i % 8));
    t->add_shape(rows);
    t->add_shape(cols);
    t->set_dtype("F32");
  }
  return request;
}

grpc::Status Plan(const LocalCluster& cluster, const v1::PlanShardsRequest& request,
                  v1::PlanShardsResponse* response) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateCustomChannel(cluster.address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(120));
  return stub->PlanShards(&context, request, response);
}

// The attack's one-off plan (20,000 tensors at 131,072 ranks: an 81 MB
// answer, +540 MB held while computing) is refused before any of it is
// computed, naming the bound and shardctl plan --local. The largest one
// allowed (2^21 pieces: 16 tensors of their own unit and 262,144 rows over
// 131,072 ranks in shard groups of 2, every rank holding a piece of each)
// is answered; three of them at once are computed one at a time, the
// others refused RESOURCE_EXHAUSTED, and the server's peak memory grows by
// what one plan costs.
TEST(OneOffPlanTest, AOneOffPlanIsBoundedAndComputedOneAtATime) {
  LocalCluster cluster(testing::MakeTempDir("one-off-plan"));
  ASSERT_TRUE(cluster.ok());
  v1::PlanShardsResponse response;
  grpc::Status refused = Plan(cluster, OneOffPlan(20000, 131072), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "shardctl plan --local"))
      << refused.error_message();

  v1::PlanShardsRequest largest = OneOffPlan(16, 131072, 262144, 4);
  for (v1::TensorSpec& t : *largest.mutable_spec()->mutable_tensors()) t.set_unit(t.name());
  largest.mutable_options()->set_shard_group_size(2);
  const int64_t before = testing::ProcStatusBytes(cluster.server()->pid(), "VmRSS");
  std::vector<grpc::Status> statuses(3);
  std::vector<int64_t> pieces(3, 0);
  std::vector<std::thread> askers;
  for (int i = 0; i < 3; ++i) {
    askers.emplace_back([&, i] {
      v1::PlanShardsResponse r;
      statuses[i] = Plan(cluster, largest, &r);
      for (const v1::Unit& u : r.plan().units()) pieces[i] += u.pieces_size();
    });
  }
  for (std::thread& t : askers) t.join();
  const int64_t peak = testing::ProcStatusBytes(cluster.server()->pid(), "VmHWM");
  int answered = 0;
  for (int i = 0; i < 3; ++i) {
    if (statuses[i].ok()) {
      ++answered;
      EXPECT_EQ(pieces[i], int64_t{1} << 21);
    } else {
      EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << statuses[i].error_message();
    }
  }
  EXPECT_GE(answered, 1);
  // Error model of the server's memory per piece: one plan being computed
  // (the planner's 32-byte pieces in vectors that grow by doubling: <= 64 B;
  // the proto piece and its pointer: ~48 B; the serialized answer and
  // gRPC's copy: ~2 x 18 B) and the previous plan's answer still being sent
  // (<= 100 B): under 256 B a piece; 64 MiB for gRPC's own buffers. Three
  // plans computed at once hold ~3 x 130 B a piece (measured), over it.
  const int64_t bound = (int64_t{1} << 21) * 256 + (int64_t{64} << 20);
  EXPECT_LT(peak - before, bound) << "RSS " << before << " before, peak " << peak;
  std::fprintf(stderr, "3 largest one-off plans (%d answered): RSS %lld before, peak %lld\n",
               answered, static_cast<long long>(before), static_cast<long long>(peak));
}

}  // namespace
}  // namespace zeroshard
