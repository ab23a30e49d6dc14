// Two-level collectives (--two_level) on emulated hosts, W = 4 as 2 hosts x 2
// ranks: the workers say they run in two levels, and the job trains to the
// flat ring's parameters within the error model's bound for a change of
// summation order (a host's sum first, then the sum over hosts).
#include <algorithm>
#include <string>

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

}  // namespace
}  // namespace zeroshard::testing
