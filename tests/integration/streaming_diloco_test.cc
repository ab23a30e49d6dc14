// Streaming DiLoCo (--outer_fragments, --outer_delay, --outer_mix;
// docs/diloco.md) with real server and worker processes on loopback, W = 4
// as 2 shard groups of 2, stage 3, the small MLP (3 layers: 3 units of equal
// size):
//  - F = 3 fragments, H = 6 (one fragment every 2 steps), τ = 1: it trains
//    (the loss falls and stays finite); the fragments take turns, each
//    applied one step after it began; each one's outer all-reduce ran on the
//    replica thread and sent a third of the full outer step's bytes (the
//    run's last, on the compute thread); the run's all-reduce bytes are the
//    outer steps' alone;
//  - τ = 2, bf16 and --snapshot_every=H: the snapshot steps are full outer
//    steps (the pending fragment finished first);
//  - --checkpoint_every=H: so are the checkpoint steps, and a run resumes
//    from one (bitwise the uninterrupted one without inner or outer state);
//  - bad streaming flags are refused before joining, naming what to set.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"
#include "tests/testing/small_mlp.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

const testing::SmallMlp kMlp;  // 3 x 32, GELU, lr 0.01, seed 3

class StreamingDiLoCoTest : public ::testing::Test {
 protected:
  StreamingDiLoCoTest() : cluster_(testing::MakeTempDir("streaming_diloco")) {}
  LocalCluster cluster_;
};

std::vector<std::string> Streaming(int steps, const std::vector<std::string>& more) {
  std::vector<std::string> flags = {"--stage=3",     "--batch=4",       "--shard_group_size=2",
                                    "--sync=diloco", "--outer_every=6", "--outer_fragments=3"};
  flags.insert(flags.end(), more.begin(), more.end());
  return kMlp.Flags(steps, flags);
}

// One outer step's record: (after_step, fragment, began_after_step).
struct Turn {
  int after, fragment, began;
  bool operator==(const Turn& o) const {
    return after == o.after && fragment == o.fragment && began == o.began;
  }
};
std::ostream& operator<<(std::ostream& out, const Turn& t) {
  return out << "{after " << t.after << ", fragment " << t.fragment << ", began " << t.began << "}";
}

std::vector<Turn> Turns(const nlohmann::json& report) {
  std::vector<Turn> turns;
  for (const nlohmann::json& o : report["outer_steps"]) {
    turns.push_back(
        {o["after_step"].get<int>(), o["fragment"].get<int>(), o["began_after_step"].get<int>()});
  }
  return turns;
}

TEST_F(StreamingDiLoCoTest, FragmentsTakeTurnsOverlappedAndSendAThirdEach) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 12;
  ASSERT_TRUE(cluster_.Run("stream", 4, Streaming(kSteps, {"--outer_delay=1"})));
  for (int rank : {0, 3}) {
    const nlohmann::json report = cluster_.Report("stream", rank);
    const std::vector<double> losses = report["losses"];
    ASSERT_EQ(losses.size(), kSteps);
    for (double loss : losses) EXPECT_TRUE(std::isfinite(loss));
    EXPECT_LT(losses.back(), losses.front());
    // One fragment every H / F = 2 steps, applied τ = 1 step later; after
    // the last step the full outer step (-1) that leaves one model.
    const std::vector<Turn> expected = {{3, 0, 2}, {5, 1, 4},   {7, 2, 6},
                                        {9, 0, 8}, {11, 1, 10}, {12, -1, 12}};
    ASSERT_EQ(Turns(report), expected) << "rank " << rank;
    const nlohmann::json& steps = report["outer_steps"];
    for (const nlohmann::json& o : steps)
      std::printf("rank %d outer step %s\n", rank, o.dump().c_str());
    std::printf("rank %d loss %g -> %g\n", rank, losses.front(), losses.back());
    const int64_t full = steps[5]["bytes_sent"].get<int64_t>();
    EXPECT_FALSE(steps[5]["on_replica_thread"].get<bool>()) << "the full step is blocking";
    int64_t outer_bytes = full;
    for (int i = 0; i < 5; ++i) {
      const nlohmann::json& o = steps[i];
      // Overlapped: the all-reduce ran on the replica thread, not the
      // compute thread that went on with the next step.
      EXPECT_TRUE(o["on_replica_thread"].get<bool>()) << i;
      EXPECT_TRUE(std::isfinite(o["outer_grad_norm"].get<double>())) << i;
      EXPECT_GT(o["outer_grad_norm"].get<double>(), 0.0) << i;
      EXPECT_GE(o["all_reduce_ms"].get<double>(), 0.0) << i;
      // One unit of three equal ones: exactly a third of the full step's
      // all-reduces (the same per-unit all-reduce, one of the three).
      EXPECT_EQ(3 * o["bytes_sent"].get<int64_t>(), full) << i;
      outer_bytes += o["bytes_sent"].get<int64_t>();
    }
    // Stage 3's only all-reduces are the replicas' outer ones.
    EXPECT_EQ(report["comm_bytes"]["all_reduce"].get<int64_t>(), outer_bytes) << rank;
  }
  EXPECT_NE(
      cluster_.WorkerLog(0).find("outer step 1 after step 3 (fragment 0, begun after step 2)"),
      std::string::npos);
}

// τ = 2 = H / F: a fragment is finished just before the next begins. The
// snapshot steps (every H) are full outer steps, the pending fragment
// finished first, so each in-memory snapshot holds one model; bf16 keeps
// its residual through the fragments.
TEST_F(StreamingDiLoCoTest, SnapshotStepsAreFullOuterSteps) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 12;
  ASSERT_TRUE(cluster_.Run(
      "snap", 4,
      Streaming(kSteps, {"--outer_delay=2", "--outer_dtype=bf16", "--snapshot_every=6"})));
  const nlohmann::json report = cluster_.Report("snap", 0);
  const std::vector<Turn> expected = {{4, 0, 2},  {6, 1, 4},   {6, -1, 6},
                                      {10, 0, 8}, {12, 1, 10}, {12, -1, 12}};
  ASSERT_EQ(Turns(report), expected);
  for (const nlohmann::json& o : report["outer_steps"]) {
    EXPECT_GT(o["residual_norm"].get<double>(), 0.0) << o.dump();
  }
  const std::vector<double> losses = report["losses"];
  for (double loss : losses) EXPECT_TRUE(std::isfinite(loss));
}

// A checkpoint at a full outer step resumes a streaming run: the rotation
// is the same function of the step, no fragment is pending there, and
// without state on either side (inner SGD, outer momentum 0: the outer
// state is not in checkpoints yet) the resumed run is bitwise the
// uninterrupted one.
TEST_F(StreamingDiLoCoTest, ACheckpointAtAFullOuterStepResumesTheRun) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 12;
  const std::vector<std::string> more = {"--optimizer=sgd", "--outer_momentum=0", "--outer_delay=1",
                                         "--checkpoint_every=6"};
  ASSERT_TRUE(cluster_.Run("uninterrupted", 4, Streaming(kSteps, more)));
  // The checkpoint step 6 is a full outer step, in place of fragment 2's.
  const std::vector<Turn> whole = {{3, 0, 2}, {5, 1, 4},   {6, -1, 6},
                                   {9, 0, 8}, {11, 1, 10}, {12, -1, 12}};
  EXPECT_EQ(Turns(cluster_.Report("uninterrupted", 0)), whole);
  ASSERT_TRUE(cluster_.Run("resumed", 4, Streaming(6, more)));
  std::vector<std::string> resume = more;
  resume.push_back("--resume=latest");
  ASSERT_TRUE(cluster_.Run("resumed", 4, Streaming(kSteps, resume)));
  const testing::Params uninterrupted =
      kMlp.Load(cluster_.checkpoint_root(), "uninterrupted", kSteps);
  EXPECT_EQ(kMlp.Load(cluster_.checkpoint_root(), "resumed", kSteps), uninterrupted);
  EXPECT_NE(kMlp.Load(cluster_.checkpoint_root(), "resumed", 6), uninterrupted);
  const std::vector<Turn> expected = {{9, 0, 8}, {11, 1, 10}, {12, -1, 12}};
  EXPECT_EQ(Turns(cluster_.Report("resumed", 0)), expected);
}

// Bad streaming flags are refused before the worker joins (exit 2), naming
// the flag and what to set.
TEST(StreamingDiLoCoFlagsTest, BadFlagsAreRefusedNamingWhatToSet) {
  struct Case {
    std::vector<std::string> flags;
    std::string expected;
  };
  const std::vector<std::string> diloco = {"--sync=diloco", "--shard_group_size=2",
                                           "--outer_every=6"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), diloco.begin(), diloco.end());
    return more;
  };
  const std::vector<Case> cases = {
      {with({"--outer_fragments=4"}),
       "--outer_fragments=4 with --outer_every=6: expected F >= 1 dividing --outer_every"},
      {with({"--outer_fragments=0"}), "--outer_fragments=0 with --outer_every=6: expected F >= 1"},
      {with({"--outer_fragments=3", "--outer_delay=3"}),
       "--outer_delay=3 with --outer_every=6 --outer_fragments=3: a fragment's outer step is "
       "applied before the next one begins: expected 0 to H / F = 2"},
      {with({"--outer_fragments=3", "--outer_delay=-1"}), "--outer_delay=-1 with"},
      {with({"--outer_fragments=3", "--outer_mix=1.5"}),
       "--outer_mix=1.5: expected a share in [0, 1]"},
      {with({"--outer_fragments=3", "--snapshot_every=4"}), "use 0 or a multiple of --outer_every"},
      {with({"--outer_fragments=3", "--loss_spike_zscore=6"}),
       "only where --snapshot_every says (each one a full outer step): pass --snapshot_every=6"},
      {{"--shard_group_size=2", "--outer_fragments=2"},
       "--outer_fragments sets DiLoCo's outer step: it needs --sync=diloco"},
      {{"--shard_group_size=2", "--outer_mix=0"},
       "--outer_mix sets DiLoCo's outer step: it needs --sync=diloco"},
  };
  const std::string worker = testing::RunfilePath("worker/shard_worker");
  for (const Case& c : cases) {
    const std::string command =
        absl::StrCat(worker, " --job=flags --world_size=4 --server=127.0.0.1:1 ",
                     absl::StrJoin(c.flags, " "), " 2>&1");
    auto [code, output] = testing::RunCommand(command);
    EXPECT_EQ(code, 2) << command << "\n" << output;
    EXPECT_TRUE(absl::StrContains(output, c.expected))
        << command << ": no '" << c.expected << "' in\n"
        << output;
  }
}

}  // namespace
}  // namespace zeroshard
