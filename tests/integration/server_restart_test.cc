// A shard server killed in the middle of a training job and started again on
// the same port and state directory costs the job nothing: the data plane
// never needed it, the members' heartbeats re-attach within the restarted
// server's grace, so nobody is declared dead, and every worker finishes and
// leaves (waiting for the server if it is still away) and exits 0.
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

class ServerRestartTest : public ::testing::TestWithParam<int> {};

TEST_P(ServerRestartTest, ATrainingJobOutlivesAKilledAndRestartedServer) {
  const absl::Duration gap = absl::Milliseconds(GetParam());
  testing::LocalCluster cluster(testing::MakeTempDir("server-restart"),
                                {"--heartbeat_interval_ms=1000", "--heartbeat_timeout_ms=3000"});
  ASSERT_TRUE(cluster.ok());
  const std::string job = "outlives";
  cluster.StartWorkers(job, 2,
                       // >= 100 ms a step (--test_step_delay_ms): training outlasts
                       // the longest gap by >= 8 s whatever the machine's speed, and
                       // the test waits rather than computes (2,500 plain steps
                       // took 28 s of CPU and overran on a loaded machine).
                       {"--model=mlp", "--layers=4", "--width=512", "--stage=3", "--steps=150",
                        "--batch=8", "--checkpoint_every=50", "--test_step_delay_ms=100"});
  ClientOptions options;
  options.server = cluster.address();
  options.rpc_timeout = absl::Seconds(2);
  auto observer = Client::Connect(options);
  ASSERT_TRUE(observer.ok());
  // Training has begun: a member reported a step.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto status = (*observer)->GetStatus(job);
        if (!status.ok() || status->jobs_size() != 1) return false;
        for (const auto& m : status->jobs(0).members()) {
          if (m.step() > 0) return true;
        }
        return false;
      },
      absl::Seconds(60)));

  cluster.RestartServer(SIGKILL, gap);
  ASSERT_TRUE(cluster.ok());
  std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ":\n" << cluster.WorkerLog(r);
  }
  auto status = (*observer)->GetStatus(job);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).generation(), 1) << "a member was declared dead";
  EXPECT_EQ(status->jobs(0).state(), v1::FINISHED);

  // Restarted once more after the job finished: the server still shows
  // where each rank stopped and why the generation began (they were in its
  // memory only: step 0 and no history).
  cluster.RestartServer(SIGTERM, absl::ZeroDuration());
  ASSERT_TRUE(cluster.ok());
  absl::StatusOr<v1::GetStatusResponse> after;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        after = (*observer)->GetStatus(job);
        return after.ok();
      },
      absl::Seconds(30)))
      << after.status();
  ASSERT_EQ(after->jobs_size(), 1);
  const v1::JobStatus& finished = after->jobs(0);
  EXPECT_EQ(finished.state(), v1::FINISHED);
  ASSERT_EQ(finished.members_size(), 2);
  for (const v1::MemberStatus& m : finished.members()) {
    EXPECT_TRUE(m.left());
    EXPECT_EQ(m.step(), 150) << "rank " << m.rank();
    EXPECT_GT(m.loss(), 0) << "rank " << m.rank();
  }
  ASSERT_GE(finished.history_size(), 1);
  EXPECT_EQ(finished.history(0).reason(), "job created");
}

// The gaps an independent test found fatal (2 and 3 s), and shorter and
// longer ones.
INSTANTIATE_TEST_SUITE_P(Gaps, ServerRestartTest, ::testing::Values(500, 2000, 5000));

}  // namespace
}  // namespace zeroshard
