// The lines printed during faults (#51 item 7): what they say in each case.
#include "common/fault_messages.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

bool Has(const std::string& line, const std::string& what) {
  return line.find(what) != std::string::npos;
}

TEST(ServerSilenceLineTest, ARankThatStepsSaysTrainingGoesOn) {
  const std::string line =
      ServerSilenceLine({"j", 2, "10.0.0.1:7070", absl::Milliseconds(12400), 37});
  EXPECT_TRUE(Has(line,
                  "job 'j' rank 2: the server at 10.0.0.1:7070 has not answered a "
                  "heartbeat for 12s"))
      << line;
  EXPECT_TRUE(Has(line, "training goes on here (37 steps since its last answer)")) << line;
  EXPECT_FALSE(Has(line, "stopped")) << line;
  EXPECT_TRUE(Has(ServerSilenceLine({"j", 2, "s", absl::Seconds(5), 1}), "(1 step since"));
}

TEST(ServerSilenceLineTest, AStuckRankSaysItIsStoppedNotTraining) {
  const std::string line = ServerSilenceLine({"j", 0, "s:1", absl::Seconds(30), 0});
  EXPECT_TRUE(Has(line, "no step has completed here since: this rank is stopped")) << line;
  EXPECT_FALSE(Has(line, "training goes on")) << line;
}

TEST(RecoveredLineTest, SaysWhichEventTheTimeCountsFrom) {
  const std::string verdict = RecoveredLine(3, 120, 1834.4, RecoveryClock::kVerdict);
  EXPECT_EQ(verdict,
            "shard_worker rank 3: recovery: training again at step 120, 1834 ms after the "
            "server's verdict on the failure (the same instant on every rank)");
  const std::string own = RecoveredLine(3, 120, 12.0, RecoveryClock::kSeen);
  EXPECT_TRUE(Has(own, "12 ms after this rank saw the failure (no verdict time from the server"))
      << own;
  EXPECT_TRUE(
      Has(RecoveredLine(1, 5, 40, RecoveryClock::kJoined), "40 ms after this replacement joined"));
}

TEST(LeaderSeenLineTest, NamesTheLeaderOfNowAndTheOneBefore) {
  EXPECT_EQ(LeaderSeenLine("/zs", "10.0.0.2:7070", "10.0.0.1:7070"),
            "following 10.0.0.2:7070, the leader of /zs now (before: 10.0.0.1:7070)");
  EXPECT_EQ(LeaderSeenLine("/zs", "10.0.0.2:7070", ""),
            "following 10.0.0.2:7070, the leader of /zs now");
  EXPECT_EQ(LeaderSeenLine("/zs", "", "10.0.0.1:7070"),
            "no server leads /zs now (before: 10.0.0.1:7070); an election is under way");
}

}  // namespace
}  // namespace zeroshard
