// A shard server that crashes and comes back on the same port and state
// directory does not cost a running job anything: its members' heartbeats
// re-attach well within the restarted server's heartbeat grace (one timeout),
// whatever the gap, so nobody is declared dead and the generation stays.
#include <signal.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

std::unique_ptr<Client> Connect(const std::string& address) {
  ClientOptions options;
  options.server = address;
  options.rpc_timeout = absl::Seconds(5);
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// The member's status as the server has it (nullopt while unreachable).
std::optional<v1::JobStatus> Job(Client* observer, const std::string& job) {
  auto status = observer->GetStatus(job);
  if (!status.ok() || status->jobs_size() != 1) return std::nullopt;
  return status->jobs(0);
}

class ReconnectTest : public ::testing::TestWithParam<int> {};

TEST_P(ReconnectTest, HeartbeatsReattachWithinTheGraceAfterACrashAndRestart) {
  const absl::Duration gap = absl::Milliseconds(GetParam());
  testing::LocalCluster cluster(testing::MakeTempDir("reconnect"),
                                {"--heartbeat_interval_ms=1000", "--heartbeat_timeout_ms=3000"});
  ASSERT_TRUE(cluster.ok());
  const std::string job = "reconnect";
  std::unique_ptr<Client> member = Connect(cluster.address());
  auto joined = member->Join(job, 1, "w0", "127.0.0.1", absl::Seconds(20));
  ASSERT_TRUE(joined.ok()) << joined.status();
  std::atomic<bool> told{false};
  member->StartHeartbeats([&told](absl::StatusOr<v1::HeartbeatResponse>) { told = true; });
  member->ReportProgress(Progress{7, 0.5, 0, 0});
  std::unique_ptr<Client> observer = Connect(cluster.address());
  auto beat_with_step_7 = [&] {
    std::optional<v1::JobStatus> status = Job(observer.get(), job);
    return status.has_value() && status->members_size() == 1 && status->members(0).step() == 7;
  };
  ASSERT_TRUE(testing::WaitFor(beat_with_step_7, absl::Seconds(20)));

  cluster.RestartServer(SIGKILL, gap);
  ASSERT_TRUE(cluster.ok());
  const absl::Time restarted = absl::Now();
  // The restored member has no step until a heartbeat brings it again.
  ASSERT_TRUE(testing::WaitFor(beat_with_step_7, absl::Seconds(20)))
      << "no heartbeat reached the restarted server";
  std::fprintf(stderr, "gap %d ms: heartbeat back %.0f ms after the restart\n", GetParam(),
               absl::ToDoubleMilliseconds(absl::Now() - restarted));
  std::optional<v1::JobStatus> status = Job(observer.get(), job);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->generation(), joined->generation) << "the member was declared dead";
  EXPECT_TRUE(status->members(0).alive());
  EXPECT_FALSE(told.load()) << "the member was told to abort";
  member->StopHeartbeats();
  EXPECT_TRUE(member->Leave().ok());
}

// The gaps an independent test found fatal (2 and 3 s), and shorter and
// longer ones.
INSTANTIATE_TEST_SUITE_P(Gaps, ReconnectTest, ::testing::Values(500, 2000, 3000, 5000));

}  // namespace
}  // namespace zeroshard
