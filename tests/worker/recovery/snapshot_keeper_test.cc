// SnapshotKeeper on one rank (no buddy): the copy into reused buffers, the
// wait before the optimizer step, the commit, and the blob's checks.
#include "worker/recovery/snapshot_keeper.h"

#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint_format.h"
#include "gtest/gtest.h"
#include "worker/checkpoint/shard_checkpoint.h"

namespace zeroshard {
namespace {

// A two-piece shard with Adam moments: the file order SnapshotShard uses.
std::shared_ptr<ShardSnapshot> MakeSnapshot(int64_t step, float fill) {
  auto snap = std::make_shared<ShardSnapshot>();
  snap->id = {"job", step, /*rank=*/0, /*world_size=*/1, /*generation=*/0, "plan", 100 * step};
  snap->optimizer = "adam";
  snap->optimizer_step = step;
  const std::vector<std::pair<ShardTensorKind, std::string>> tensors = {
      {ShardTensorKind::kParams, "a"}, {ShardTensorKind::kParams, "b"},
      {ShardTensorKind::kExpAvg, "a"}, {ShardTensorKind::kExpAvgSq, "a"},
      {ShardTensorKind::kExpAvg, "b"}, {ShardTensorKind::kExpAvgSq, "b"}};
  float v = fill;
  for (const auto& [kind, name] : tensors) {
    snap->entries.push_back({ShardTensorName(kind, name, 0, 3), DType::kF32, {3, 5}});
    std::vector<float> values(15);
    for (float& x : values) x = (v += 0.25f);
    snap->bytes += 15 * sizeof(float);
    snap->values.push_back(std::move(values));
  }
  return snap;
}

TEST(SerializeShardIntoTest, MakesTheBytesSerializeShardMakes) {
  std::shared_ptr<ShardSnapshot> snap = MakeSnapshot(7, 1.0f);
  absl::StatusOr<std::string> want = SerializeShard(*snap);
  ASSERT_TRUE(want.ok()) << want.status();
  std::string got;
  ASSERT_TRUE(SerializeShardInto(ViewOf(snap), &got).ok());
  EXPECT_EQ(got, *want);
}

TEST(SerializeShardIntoTest, ReusesTheBufferOfTheSameSize) {
  std::string out;
  ASSERT_TRUE(SerializeShardInto(ViewOf(MakeSnapshot(10, 1.0f)), &out).ok());
  const char* buffer = out.data();
  std::shared_ptr<ShardSnapshot> next = MakeSnapshot(20, 2.0f);
  ASSERT_TRUE(SerializeShardInto(ViewOf(next), &out).ok());
  EXPECT_EQ(out.data(), buffer);
  EXPECT_EQ(out, *SerializeShard(*next));
}

TEST(BlobFromBytesTest, ChecksTheHeaderAndEveryTensor) {
  std::string bytes;
  ASSERT_TRUE(SerializeShardInto(ViewOf(MakeSnapshot(10, 1.0f)), &bytes).ok());
  const uint64_t sum = BlobChecksum(bytes);
  absl::StatusOr<std::shared_ptr<SnapshotBlob>> blob = BlobFromBytes(bytes, sum);
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_EQ((*blob)->step, 10);
  EXPECT_EQ((*blob)->data_row, 1000);
  EXPECT_EQ((*blob)->pieces.size(), 2u);  // parameters only

  std::string data_flipped = bytes;
  data_flipped[data_flipped.size() - 3] ^= 0x10;  // inside the last tensor
  absl::StatusOr<std::shared_ptr<SnapshotBlob>> bad = BlobFromBytes(data_flipped, sum);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_NE(bad.status().message().find("XXH64"), std::string::npos) << bad.status();

  std::string header_flipped = bytes;
  header_flipped[20] ^= 0x01;
  EXPECT_EQ(BlobFromBytes(header_flipped, sum).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(BlobFromBytes("short", sum).status().code(), absl::StatusCode::kDataLoss);
}

TEST(SnapshotKeeperTest, ReserveCountsAsInFlightUntilItsBuffersAreTouched) {
  SnapshotKeeper keeper;
  keeper.Reserve(int64_t{64} << 20, 2);
  EXPECT_TRUE(keeper.in_flight());  // set before the background task runs
  ASSERT_TRUE(keeper.Wait().ok());
  EXPECT_FALSE(keeper.in_flight());
  EXPECT_GE(keeper.bytes(), int64_t{128} << 20);
}

TEST(SnapshotKeeperTest, SnapshotsAloneCompleteAndCommitWithoutGrowing) {
  SnapshotKeeper keeper;
  const int64_t blob_bytes = [] {
    std::string b;
    EXPECT_TRUE(SerializeShardInto(ViewOf(MakeSnapshot(10, 1.0f)), &b).ok());
    return static_cast<int64_t>(b.size());
  }();
  keeper.Reserve(blob_bytes + 4096, 2);
  int64_t bytes_after_two = 0;
  for (int64_t step = 10; step <= 60; step += 10) {
    // The boundary: commit what is complete, then start the next one.
    ASSERT_TRUE(keeper.Wait().ok());  // the Reserve, the first time
    ASSERT_FALSE(keeper.in_flight());
    keeper.Commit(keeper.complete_step());
    ASSERT_TRUE(keeper.Start(ViewOf(MakeSnapshot(step, step)), nullptr, 1, absl::Seconds(5)).ok());
    keeper.WaitCopied();
    ASSERT_TRUE(keeper.Wait().ok());
    EXPECT_EQ(keeper.complete_step(), step);
    if (step == 20) bytes_after_two = keeper.bytes();
    if (step > 20) {
      EXPECT_EQ(keeper.bytes(), bytes_after_two) << "step " << step;
    }
  }
  // Two steps held at most: the committed one and the newest.
  EXPECT_EQ(keeper.committed_step(), 50);
  std::vector<std::shared_ptr<const SnapshotBlob>> held = keeper.Holdings();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0]->step, 50);
  EXPECT_EQ(held[1]->step, 60);
  EXPECT_EQ(keeper.peak_bytes(), bytes_after_two);
  EXPECT_GE(keeper.bytes(), 2 * blob_bytes);
}

}  // namespace
}  // namespace zeroshard
