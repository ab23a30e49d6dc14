// #44 findings 3-5 with real processes: a shard_server with an admin token
// and a shard_agent between it and callers on the host's unix socket. The
// agent checks no token itself, so it must share nothing the server has
// not accepted: another job's joins going away withdraw no rank's join
// (finding 3), a wait with a wrong token is not added to the ranks' shared
// wait (finding 4), and a stream with a bogus token is refused at once and
// leaves no thread behind (finding 5).
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

constexpr char kToken[] = "agent-isolation-admin-token-0123456789";

// The threads of process `pid` now (/proc/PID/status), -1 if unreadable.
int Threads(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    int n = 0;
    if (absl::StartsWith(line, "Threads:") && absl::SimpleAtoi(line.substr(8), &n)) return n;
  }
  return -1;
}

// A server with the admin token, and an agent on a unix socket under /tmp
// (a socket path has at most 107 characters: the test's directory is longer).
class AgentFixture {
 public:
  AgentFixture()
      : token_file_(testing::MakeTempDir("agent-isolation-token") + "/token"),
        cluster_((testing::WriteSecretFile(token_file_, kToken),
                  testing::MakeTempDir("agent-isolation")),
                 {"--auth_token_file=" + token_file_}) {
    char dir[] = "/tmp/zs-isolation-XXXXXX";
    EXPECT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/agent.sock";
    if (!cluster_.ok()) return;
    agent_ = std::make_unique<testing::ChildProcess>(
        testing::RunfilePath("agent/shard_agent"),
        std::vector<std::string>{"--server=" + cluster_.address(), "--listen=unix:" + socket_,
                                 "--token_file=" + token_file_},
        cluster_.dir() + "/agent.log");
    started_ =
        testing::WaitFor([&] { return access(socket_.c_str(), F_OK) == 0; }, absl::Seconds(30));
    EXPECT_TRUE(started_) << "shard_agent did not start:\n" << agent_->Log();
    channel_ = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
  }
  ~AgentFixture() {
    agent_.reset();
    std::remove(socket_.c_str());
    rmdir(dir_.c_str());
  }

  bool ok() const { return started_; }
  pid_t agent_pid() const { return agent_->pid(); }
  std::unique_ptr<v1::Coordinator::Stub> ThroughAgent() {
    return v1::Coordinator::NewStub(channel_);
  }
  std::unique_ptr<v1::Coordinator::Stub> Direct() {
    return v1::Coordinator::NewStub(
        grpc::CreateChannel(cluster_.address(), grpc::InsecureChannelCredentials()));
  }

 private:
  std::string token_file_;
  testing::LocalCluster cluster_;
  std::string dir_;
  std::string socket_;
  std::unique_ptr<testing::ChildProcess> agent_;
  std::shared_ptr<grpc::Channel> channel_;
  bool started_ = false;
};

void Prepare(grpc::ClientContext* context, absl::Duration timeout,
             const std::string& token = kToken) {
  context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

v1::JoinRequest JoinOf(const std::string& job, int world, const std::string& worker) {
  v1::JoinRequest join;
  join.set_job_id(job);
  join.set_world_size(world);
  join.set_worker_id(worker);
  join.set_host("127.0.0.1");
  join.set_incarnation(worker + "-1");
  return join;
}

v1::MemberCredentials CredentialsOf(const std::string& job, const v1::JoinResponse& joined) {
  v1::MemberCredentials member;
  member.set_job_id(job);
  member.set_generation(joined.generation());
  member.set_rank(joined.rank());
  member.set_token(joined.token());
  return member;
}

// Joins `world` ranks of `job` through the agent at once; their statuses
// and answers by worker.
struct Joined {
  std::vector<grpc::Status> status;
  std::vector<v1::JoinResponse> response;
};
Joined JoinThroughAgent(AgentFixture& f, const std::string& job, int world) {
  Joined joined;
  joined.status.resize(world);
  joined.response.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      grpc::ClientContext context;
      Prepare(&context, absl::Seconds(30));
      joined.status[r] = f.ThroughAgent()->Join(&context, JoinOf(job, world, absl::StrCat("w", r)),
                                                &joined.response[r]);
    });
  }
  for (std::thread& t : threads) t.join();
  return joined;
}

// Finding 3: a neighbour keeps sending another job's joins with 30 ms
// deadlines through the agent (each goes away inside the 50 ms join
// window); the ranks' own joins, in the same window, form their generation
// and every rank gets its credentials on its first try.
TEST(AgentIsolationTest, AnotherJobsJoinsGoingAwayWithdrawNoRanksJoin) {
  AgentFixture f;
  ASSERT_TRUE(f.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::vector<std::thread> neighbours;
  for (int t = 0; t < 2; ++t) {
    neighbours.emplace_back([&, t] {
      auto stub = f.ThroughAgent();
      for (int i = 0; !stop; ++i) {
        grpc::ClientContext context;
        Prepare(&context, absl::Milliseconds(30));
        v1::JoinResponse ignored;
        stub->Join(&context, JoinOf(absl::StrCat("neighbour-", t, "-", i), 2, "n0"), &ignored);
        ++sent;
      }
    });
  }
  ASSERT_TRUE(testing::WaitFor([&] { return sent >= 10; }, absl::Seconds(30)));
  Joined joined = JoinThroughAgent(f, "ranks", 2);
  stop = true;
  for (std::thread& t : neighbours) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(joined.status[r].ok()) << "w" << r << ": " << joined.status[r].error_code() << " "
                                       << joined.status[r].error_message();
    EXPECT_EQ(joined.response[r].generation(), 1) << "w" << r;
  }
}

// Finding 4: the ranks wait for a key through the agent (one shared call);
// a caller that knows the job and generation but not a rank's token waits
// for the same key. Its wait is not added to the ranks' call: the server
// refuses it at once, every time, and the ranks wake when the key is set.
TEST(AgentIsolationTest, AWaitWithAWrongTokenIsRefusedAndSharesNothing) {
  AgentFixture f;
  ASSERT_TRUE(f.ok());
  Joined joined = JoinThroughAgent(f, "waits", 2);
  std::vector<v1::MemberCredentials> ranks;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(joined.status[r].ok()) << joined.status[r].error_message();
    ranks.push_back(CredentialsOf("waits", joined.response[r]));
  }
  std::vector<grpc::Status> woke(2);
  std::vector<std::thread> waiters;
  for (int r = 0; r < 2; ++r) {
    waiters.emplace_back([&, r] {
      grpc::ClientContext context;
      Prepare(&context, absl::Seconds(90));
      v1::StoreWaitRequest request;
      *request.mutable_member() = ranks[r];
      request.add_keys("boot");
      request.set_timeout_ms(60000);
      v1::StoreWaitResponse response;
      woke[r] = f.ThroughAgent()->StoreWait(&context, request, &response);
    });
  }
  v1::MemberCredentials forged = ranks[0];
  forged.set_token("not-the-token");
  // Twenty tries 100 ms apart: the ranks' waits reach the agent within the
  // first few (their threads start meanwhile); each try must be refused,
  // whenever it comes.
  for (int i = 0; i < 20; ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(100));
    grpc::ClientContext context;
    Prepare(&context, absl::Seconds(5));
    v1::StoreWaitRequest request;
    *request.mutable_member() = forged;
    request.add_keys("boot");
    request.set_timeout_ms(3000);
    v1::StoreWaitResponse response;
    grpc::Status s = f.ThroughAgent()->StoreWait(&context, request, &response);
    ASSERT_FALSE(s.ok()) << "try " << i << ": a wrong token's wait was answered OK";
    ASSERT_TRUE(absl::StrContains(s.error_message(), "wrong token"))
        << "try " << i << ": " << s.error_code() << " " << s.error_message();
  }
  grpc::ClientContext context;
  Prepare(&context, absl::Seconds(30));
  v1::StoreSetRequest set;
  *set.mutable_member() = ranks[1];
  set.set_key("boot");
  set.set_value("address");
  v1::StoreSetResponse set_response;
  ASSERT_TRUE(f.Direct()->StoreSet(&context, set, &set_response).ok());
  for (std::thread& t : waiters) t.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(woke[r].ok()) << "rank " << r << ": " << woke[r].error_message();
}

// Finding 5: 100 heartbeat streams through the agent, each with a bogus
// bearer token of its own: each is refused UNAUTHENTICATED at once (not
// held to its deadline), and once they are gone the agent holds no thread
// for them. Twice: the first round grows gRPC's own thread pools.
TEST(AgentIsolationTest, BogusTokensAreRefusedAtOnceAndLeaveNoThreads) {
  AgentFixture f;
  ASSERT_TRUE(f.ok());
  constexpr int kStreams = 100;
  auto round = [&](int n) {
    std::vector<grpc::Status> ends(kStreams);
    std::vector<std::thread> threads;
    for (int i = 0; i < kStreams; ++i) {
      threads.emplace_back([&, i] {
        auto stub = f.ThroughAgent();
        grpc::ClientContext context;
        Prepare(&context, absl::Seconds(30),
                absl::StrCat("bogus-token-", n, "-", i, "-0123456789"));
        auto stream = stub->Heartbeat(&context);
        v1::HeartbeatRequest beat;
        beat.mutable_member()->set_job_id("any");
        stream->Write(beat);
        v1::HeartbeatResponse response;
        while (stream->Read(&response)) {
        }
        ends[i] = stream->Finish();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < kStreams; ++i) {
      EXPECT_EQ(ends[i].error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << "round " << n << " stream " << i << ": " << ends[i].error_message();
    }
  };
  round(1);
  // The first round's threads are gone (one writer per token before).
  const int after_first = Threads(f.agent_pid());
  ASSERT_GT(after_first, 0);
  round(2);
  const bool settled = testing::WaitFor([&] { return Threads(f.agent_pid()) <= after_first + 10; },
                                        absl::Seconds(30));
  EXPECT_TRUE(settled) << Threads(f.agent_pid()) << " threads after the second round, "
                       << after_first << " after the first";
}

}  // namespace
}  // namespace zeroshard
