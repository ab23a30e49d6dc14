// Two-level collectives (--two_level) on emulated hosts, W = 4 as 2 hosts x 2
// ranks: the workers say they run in two levels, and the job trains to the
// flat ring's parameters within the error model's bound for a change of
// summation order (a host's sum first, then the sum over hosts).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"

namespace zeroshard::testing {
namespace {

using TwoLevelTest = AcrossHostsTest;

constexpr int kSteps = 10;

TEST_F(TwoLevelTest, TrainsToTheFlatRingsParametersWithinTheErrorModel) {
  ASSERT_TRUE(StartCluster());
  // GELU: the error model assumes no unit sits within rounding of a kink.
  const std::vector<std::string> common = {absl::StrCat("--steps=", kSteps), "--activation=gelu"};
  std::vector<std::string> two_level = common;
  two_level.push_back("--two_level");
  ASSERT_TRUE(cluster_->Run("flat", 4, Flags(common)));
  ASSERT_TRUE(cluster_->Run("two-level", 4, Flags(two_level)));
  for (int r = 0; r < 4; ++r) {
    const std::string log = cluster_->WorkerLog(r);
    if (r == 0) {
      EXPECT_NE(log.find("data plane (gather): two levels, 2 hosts x 2 ranks"), std::string::npos)
          << log;
    }
  }
  const Params flat = Final("flat", kSteps);
  const Params got = Final("two-level", kSteps);
  ASSERT_FALSE(flat.empty());
  ASSERT_FALSE(got.empty());
  TrainingErrorModel m;
  m.layers = kLayers;
  m.sum_length = std::max(kWidth, 4 * 4);  // width, or 4 ranks x batch 4 rows
  m.steps = kSteps;
  m.lr = 0.01;
  m.param_scale = SmallestTensorScale(flat);
  ExpectWithinBound(MaxRelativeDifference(got, flat), AdamRelativeParamBound(m),
                    "two levels against the flat ring");
}

// The bytes a host's ranks (`ranks`) sent across hosts over the whole run,
// from the run report's per-step counts. The whole run, not one step: a
// step's count depends on how many of the next step's gathers its prefetch
// had issued when it ended (timing), but every gather is counted once in all.
int64_t HostBytesOverTheRun(const LocalCluster& cluster, const std::string& job,
                            const std::vector<int>& ranks) {
  int64_t sum = 0;
  for (int r : ranks) {
    const nlohmann::json report = cluster.Report(job, r);  // outlives the loop over its array
    for (const auto& bytes : report["comm_bytes_inter_host"]) sum += bytes.get<int64_t>();
  }
  return sum;
}

TEST_F(TwoLevelTest, TheReportCountsTheBytesThatCrossHosts) {
  ASSERT_TRUE(StartCluster());
  // Wide enough that the plan's padding (64-element chunks) and the step's
  // small collectives (loss, gradient norm: the same on both) are small: at
  // width 256 they took the ratio below from 0.625 to 0.696.
  const std::vector<std::string> common = {"--steps=3", "--width=512"};
  std::vector<std::string> two_level = common;
  two_level.push_back("--two_level");
  ASSERT_TRUE(cluster_->Run("flat", 4, Flags(common)));
  ASSERT_TRUE(cluster_->Run("two-level", 4, Flags(two_level)));
  // The flat ring 0 -> 1 -> 2 -> 3 -> 0 over TCP: ranks 0 and 2 send to a
  // rank on their host, ranks 1 and 3 across.
  for (int r = 0; r < 4; ++r) {
    const nlohmann::json report = cluster_->Report("flat", r);
    ASSERT_EQ(report["comm_bytes_inter_host"].size(), 3u) << report.dump();
    const bool crosses = r % 2 == 1;
    for (int step = 0; step < 3; ++step) {
      const int64_t intra = report["comm_bytes_intra_host"][step];
      const int64_t inter = report["comm_bytes_inter_host"][step];
      EXPECT_GT(crosses ? inter : intra, 0) << "rank " << r << " step " << step;
      EXPECT_EQ(crosses ? intra : inter, 0) << "rank " << r << " step " << step;
    }
  }
  // Two levels: every rank sends inside its host (shared memory) and along
  // its rail; each host sends (H - 1)/H = 1/2 of a buffer across, where the
  // flat ring sends (W - 1)/W = 3/4 over host 1's link (rank 1): about 2/3
  // of it.
  for (int r = 0; r < 4; ++r) {
    const nlohmann::json report = cluster_->Report("two-level", r);
    EXPECT_GT(report["comm_bytes_per_step"]["intra_host"].get<int64_t>(), 0) << r;
    EXPECT_GT(report["comm_bytes_per_step"]["inter_host"].get<int64_t>(), 0) << r;
  }
  const int64_t flat_crossing = HostBytesOverTheRun(*cluster_, "flat", {0, 1});
  const int64_t two_level_crossing = HostBytesOverTheRun(*cluster_, "two-level", {0, 1});
  std::printf("bytes crossing host 1's link over the run: flat %lld, two levels %lld (%.3fx)\n",
              static_cast<long long>(flat_crossing), static_cast<long long>(two_level_crossing),
              static_cast<double>(two_level_crossing) / flat_crossing);
  ASSERT_GT(flat_crossing, 0);
  EXPECT_GT(two_level_crossing, 0);
  // 2/3 in theory, but the reports' counts move by up to ~10 % between
  // runs with the timing of the prefetch (0.62-0.75 seen in repeated runs
  // at this size), so this test checks only that two levels cross clearly
  // fewer bytes (< 0.9x). The issue's <= 0.7 is measured where it is exact:
  // tests/bench/multihost_bench, by each host's kernel counters (0.67).
  EXPECT_LE(two_level_crossing, 0.9 * flat_crossing)
      << two_level_crossing << " bytes against the flat ring's " << flat_crossing;
}

}  // namespace
}  // namespace zeroshard::testing
