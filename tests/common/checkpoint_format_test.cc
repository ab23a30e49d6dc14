// The checkpoint format's names: every shard tensor name parses back to what
// made it, and nothing but the canonical form parses.
#include "common/checkpoint_format.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(CheckpointFormatTest, EveryShardTensorNameParsesBackToWhatMadeIt) {
  const std::vector<ShardTensorKind> kinds = {
      ShardTensorKind::kParams, ShardTensorKind::kExpAvg, ShardTensorKind::kExpAvgSq,
      ShardTensorKind::kOuterAnchor, ShardTensorKind::kOuterMomentum};
  // Names with dots, digits and colons of their own (the row range is after
  // the last colon); rows from 0 to beyond 2^32.
  const std::vector<std::string> tensors = {"w", "h.0.attn.c_attn.weight", "a:b", "optim", "0"};
  const std::vector<std::pair<int64_t, int64_t>> rows = {
      {0, 1}, {3, 17}, {0, int64_t{1} << 33}, {(int64_t{1} << 40) - 1, int64_t{1} << 40}};
  for (ShardTensorKind kind : kinds) {
    for (const std::string& tensor : tensors) {
      for (const auto& [begin, end] : rows) {
        const std::string name = ShardTensorName(kind, tensor, begin, end);
        ParsedShardTensorName parsed;
        ASSERT_TRUE(ParseShardTensorName(name, &parsed)) << name;
        EXPECT_EQ(parsed.kind, kind) << name;
        EXPECT_EQ(parsed.tensor, tensor) << name;
        EXPECT_EQ(parsed.row_begin, begin) << name;
        EXPECT_EQ(parsed.row_end, end) << name;
        EXPECT_EQ(ShardTensorName(parsed.kind, parsed.tensor, parsed.row_begin, parsed.row_end),
                  name);
      }
    }
  }
}

TEST(CheckpointFormatTest, TheOptimizerPrefixesAreTheDocumentedOnes) {
  EXPECT_EQ(ShardTensorName(ShardTensorKind::kParams, "w", 0, 4), "w:0-4");
  EXPECT_EQ(ShardTensorName(ShardTensorKind::kExpAvg, "w", 0, 4), "optim.exp_avg.w:0-4");
  EXPECT_EQ(ShardTensorName(ShardTensorKind::kExpAvgSq, "w", 0, 4), "optim.exp_avg_sq.w:0-4");
  // DiLoCo's outer state (docs/diloco.md).
  EXPECT_EQ(ShardTensorName(ShardTensorKind::kOuterAnchor, "w", 0, 4), "optim.outer_anchor.w:0-4");
  EXPECT_EQ(ShardTensorName(ShardTensorKind::kOuterMomentum, "w", 0, 4),
            "optim.outer_momentum.w:0-4");
  // "optim.exp_avg." is a prefix of "optim.exp_avg_sq.": the longer one wins.
  ParsedShardTensorName parsed;
  ASSERT_TRUE(ParseShardTensorName("optim.exp_avg_sq.w:0-4", &parsed));
  EXPECT_EQ(parsed.kind, ShardTensorKind::kExpAvgSq);
  EXPECT_EQ(parsed.tensor, "w");
}

TEST(CheckpointFormatTest, OnlyTheCanonicalFormParsesAndAFailureLeavesTheOutputAlone) {
  for (const char* name :
       {"w", "w:", ":0-4", "w:0", "w:4-4", "w:5-4", "w:-1-4", "w:+0-4", "w: 0-4", "w:0-4 ",
        "w:00-4", "w:0-4x", "w:0--4", "optim.exp_avg.:0-4", "optim.outer_anchor.:0-4"}) {
    ParsedShardTensorName parsed;
    parsed.tensor = "untouched";
    EXPECT_FALSE(ParseShardTensorName(name, &parsed)) << name;
    EXPECT_EQ(parsed.tensor, "untouched") << name;
  }
}

TEST(CheckpointFormatTest, PathsFollowTheLayout) {
  EXPECT_EQ(CheckpointStepDir("job", 10), "job/step-10");
  EXPECT_EQ(CheckpointShardFileName(1, 4), "rank-1-of-4.safetensors");
  EXPECT_EQ(CheckpointShardPath("job", 10, 1, 4), "job/step-10/rank-1-of-4.safetensors");
  EXPECT_EQ(CheckpointManifestPath("job", 10), std::string("job/step-10/") + kManifestFileName);
  EXPECT_EQ(ConsolidatedDir("job", 10), "job/consolidated/step-10");
}

// Listing a directory: only the names CheckpointStepDir and
// CheckpointShardFileName make parse, and they parse back to what made them.
TEST(CheckpointFormatTest, StepAndShardNamesParseBackAndNothingElseDoes) {
  int64_t step = -1;
  EXPECT_TRUE(ParseCheckpointStepDirName("step-0", &step));
  EXPECT_EQ(step, 0);
  EXPECT_TRUE(ParseCheckpointStepDirName("step-1200", &step));
  EXPECT_EQ(step, 1200);
  for (const char* name : {"step-", "step-07", "step-+7", "step--7", "step-7x", "step- 7",
                           "consolidated", "step-7.tmp-12", "Step-7"}) {
    step = -1;
    EXPECT_FALSE(ParseCheckpointStepDirName(name, &step)) << name;
    EXPECT_EQ(step, -1) << name;
  }
  int rank = -1, world = -1;
  EXPECT_TRUE(ParseCheckpointShardFileName(CheckpointShardFileName(3, 4), &rank, &world));
  EXPECT_EQ(rank, 3);
  EXPECT_EQ(world, 4);
  for (const char* name : {"rank-4-of-4.safetensors", "rank-01-of-4.safetensors",
                           "rank-1-of-4.safetensors.tmp-9", "rank-1-4.safetensors",
                           "rank--1-of-4.safetensors", "rank-1-of-.safetensors",
                           "rank-1-of-99999999999.safetensors", "model.safetensors"}) {
    rank = world = -1;
    EXPECT_FALSE(ParseCheckpointShardFileName(name, &rank, &world)) << name;
    EXPECT_EQ(rank, -1) << name;
  }
}

}  // namespace
}  // namespace zeroshard
