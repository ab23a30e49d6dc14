// A shrink to whole shard groups (docs/recovery.md, "Grow back"; issue #49's
// "Elastic outer steps") with real server and worker processes on loopback:
// W = 4 as 2 shard groups of 2 (--sync=diloco with H = 5, and HSDP every
// step), --min_world_size=2, --rejoin_grace=1s. Rank 3 alone is killed. Its
// group's survivor (w2) cannot make a generation of 3 (no plan of groups of
// 2 covers it), so the server forms W = 2 with the whole group (w0, w1) and
// parks w2: it waits, as a grower, while w0 and w1 train on. The killed
// worker is started again with its id, completes w2's group, and the job
// grows back to 4 at the members' next snapshot; every rank exits 0 with
// finite losses. Before this, every rank failed "shard_group_size 2 does not
// divide the world size 3" and exited 1.
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"
#include "tests/testing/small_mlp.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

const testing::SmallMlp kMlp;  // 3 x 32, GELU, lr 0.01, seed 3

constexpr int kSteps = 150;
constexpr int kEvery = 5;  // H, and the snapshot interval

// The parameter: --sync (diloco or every_step, HSDP).
class GroupShrinkTest : public ::testing::TestWithParam<std::string> {
 protected:
  // The recovery tests' heartbeats: a killed worker is declared dead in
  // well under a second.
  GroupShrinkTest()
      : cluster_(testing::MakeTempDir("group-shrink"),
                 {"--heartbeat_interval_ms=300", "--heartbeat_timeout_ms=1500"}) {}

  static std::vector<std::string> Flags() {
    std::vector<std::string> flags = {
        "--stage=3", "--batch=4", "--shard_group_size=2", absl::StrCat("--sync=", GetParam()),
        absl::StrCat("--snapshot_every=", kEvery), "--collective_timeout=20s",
        "--rejoin_timeout=120s", "--join_timeout_s=120", "--min_world_size=2", "--rejoin_grace=1s",
        // At least 30 ms a step (the arithmetic is unchanged): the kill, the
        // shrink and the grow back all land before the last step.
        "--test_step_delay_ms=30"};
    if (GetParam() == "diloco") flags.push_back(absl::StrCat("--outer_every=", kEvery));
    return kMlp.Flags(kSteps, flags);
  }

  std::unique_ptr<Client> Observer() {
    ClientOptions options;
    options.server = cluster_.address();
    options.rpc_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<Client>> observer = Client::Connect(options);
    EXPECT_TRUE(observer.ok()) << observer.status();
    return observer.ok() ? *std::move(observer) : nullptr;
  }

  // Waits until the job's status satisfies `ready` (*last: the last status
  // read); false at the deadline.
  bool WaitForStatus(Client* observer, const std::function<bool(const v1::JobStatus&)>& ready,
                     v1::JobStatus* last, absl::Duration timeout = absl::Seconds(90)) {
    return testing::WaitFor(
        [&] {
          absl::StatusOr<v1::GetStatusResponse> status = observer->GetStatus("shrink");
          if (!status.ok() || status->jobs_size() != 1) return false;
          *last = status->jobs(0);
          return ready(*last);
        },
        timeout);
  }

  std::string Logs() {
    std::string logs;
    for (int r = 0; r < 4; ++r) absl::StrAppend(&logs, "worker ", r, ":\n", cluster_.WorkerLog(r));
    return absl::StrCat(logs, "\nserver:\n", cluster_.server()->Log());
  }

  LocalCluster cluster_;
};

TEST_P(GroupShrinkTest, OneRankOfAGroupKilledShrinksToTheWholeGroupAndGrowsBack) {
  ASSERT_TRUE(cluster_.ok());
  cluster_.StartWorkers("shrink", 4, Flags());
  std::unique_ptr<Client> observer = Observer();
  ASSERT_NE(observer, nullptr);
  v1::JobStatus job;
  ASSERT_TRUE(WaitForStatus(
      observer.get(), [](const v1::JobStatus& j) { return j.snapshot_step() >= 2 * kEvery; }, &job))
      << Logs();
  const int64_t at_kill = job.snapshot_step();
  ASSERT_LT(at_kill, kSteps / 2) << "the run is too fast for the test's kill";
  cluster_.worker(3)->Signal(SIGKILL);

  // W = 2 with w0 and w1; w2 waits to grow the job back.
  ASSERT_TRUE(WaitForStatus(
      observer.get(),
      [](const v1::JobStatus& j) {
        return j.state() == v1::RUNNING && j.world_size() == 2 && j.growing_size() == 1;
      },
      &job))
      << job.DebugString() << Logs();
  const int64_t shrunk_generation = job.generation();
  EXPECT_EQ(job.growing(0), "w2");
  ASSERT_EQ(job.members_size(), 2);
  EXPECT_EQ(job.members(0).worker_id(), "w0");
  EXPECT_EQ(job.members(1).worker_id(), "w1");
  EXPECT_NE(job.growing_note().find("'w2' (rank 2: its shard group, ranks 2-3, lost 'w3') waits "
                                    "to grow job 'shrink' back from 2 to 3 of 4 workers once "
                                    "they make whole shard groups of 2"),
            std::string::npos)
      << job.growing_note();
  EXPECT_NE(job.history(job.history_size() - 1).reason().find("whole shard groups of 2 only"),
            std::string::npos)
      << job.DebugString();
  // Training goes on at W = 2: the members commit a snapshot past the one
  // seen before the kill (the reports' restored steps below say it exactly).
  ASSERT_TRUE(WaitForStatus(
      observer.get(),
      [&](const v1::JobStatus& j) {
        return j.generation() == shrunk_generation && j.snapshot_step() > at_kill;
      },
      &job))
      << job.DebugString() << Logs();
  EXPECT_EQ(job.growing_size(), 1) << "w2 must still wait: its group is not whole";

  // The launcher's restart of the killed worker: its group is whole again,
  // and the job grows back to 4.
  cluster_.RestartWorker(3);
  ASSERT_TRUE(WaitForStatus(
      observer.get(),
      [&](const v1::JobStatus& j) {
        return j.generation() > shrunk_generation && j.world_size() == 4;
      },
      &job))
      << job.DebugString() << Logs();
  std::vector<int> codes = cluster_.WaitWorkers(absl::Seconds(180));
  for (int r = 0; r < 4; ++r) ASSERT_EQ(codes[r], 0) << "worker " << r << ":\n" << Logs();

  const std::string server_log = cluster_.server()->Log();
  EXPECT_NE(server_log.find("parked=w2"), std::string::npos) << server_log;
  // Every rank's report (by its rank in the last generation: w0..w3 in
  // order): finite losses to the last step, and the ranks of the shrink
  // went through both recoveries.
  for (int r = 0; r < 4; ++r) {
    const nlohmann::json report = cluster_.Report("shrink", r);
    ASSERT_TRUE(report.is_object()) << "rank " << r;
    const std::vector<double> losses = report["losses"];
    ASSERT_FALSE(losses.empty()) << report.dump();
    for (double loss : losses) ASSERT_TRUE(std::isfinite(loss)) << report.dump();
  }
  const nlohmann::json report = cluster_.Report("shrink", 0);
  ASSERT_GE(report["recoveries"].size(), 2u) << report.dump();
  EXPECT_EQ(report["recoveries"][0]["world_size"], 2) << report.dump();
  EXPECT_EQ(report["recoveries"].back()["world_size"], 4) << report.dump();
  // The grow back restored a snapshot the W = 2 generation took: it trained.
  const int shrunk_restored = report["recoveries"][0]["restored_step"].get<int>();
  const int grown_restored = report["recoveries"].back()["restored_step"].get<int>();
  EXPECT_GT(grown_restored, shrunk_restored) << report.dump();
  // w2 (rank 2 at the end) went through a recovery: parked, then grown back.
  const nlohmann::json w2 = cluster_.Report("shrink", 2);
  EXPECT_GE(w2["recoveries"].size(), 1u) << w2.dump();
  std::fprintf(stderr,
               "--sync=%s: killed rank 3 after snapshot step %lld; shrunk to 2 in generation "
               "%lld (restored step %d), grown back to 4 (restored step %d); rank 0's "
               "recoveries: %s\n",
               GetParam().c_str(), static_cast<long long>(at_kill),
               static_cast<long long>(shrunk_generation), shrunk_restored, grown_restored,
               report["recoveries"].dump().c_str());
}

INSTANTIATE_TEST_SUITE_P(Sync, GroupShrinkTest, ::testing::Values("diloco", "every_step"));

}  // namespace
}  // namespace zeroshard
