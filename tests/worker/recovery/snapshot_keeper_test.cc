// SnapshotKeeper on one rank (no buddy): the copy into reused buffers, the
// wait before the optimizer step, the commit, and the blob's checks; and
// the refusal of non-finite shards, alone and between two buddies; and a
// checkpoint written straight from that memory (WriteShardFromView).
#include "worker/recovery/snapshot_keeper.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/checkpoint_format.h"
#include "common/finite_scan.h"
#include "gtest/gtest.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/comm/in_memory_kv_store.h"

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

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A checkpoint written straight from the engine's memory (no pause) is the
// file WriteShard writes from a copy, byte for byte, with the same checksums.
TEST(WriteShardFromViewTest, WritesTheFileWriteShardWrites) {
  const std::string root = ::testing::TempDir() + "/from-view";
  std::shared_ptr<ShardSnapshot> snap = MakeSnapshot(7, 1.0f);
  absl::StatusOr<WrittenShard> want = WriteShard(*snap, root + "/copy");
  ASSERT_TRUE(want.ok()) << want.status();
  absl::Notification copied;
  absl::StatusOr<WrittenShard> got = WriteShardFromView(ViewOf(snap), root + "/view", &copied);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(copied.HasBeenNotified());
  EXPECT_EQ(got->relative_path, want->relative_path);
  EXPECT_EQ(got->size_bytes, want->size_bytes);
  EXPECT_EQ(got->checksums, want->checksums);
  EXPECT_EQ(ReadWhole(got->path), ReadWhole(want->path));
}

// A NaN is refused and leaves no file; the copy is said done all the same
// (the training thread waits for it).
TEST(WriteShardFromViewTest, RefusesANaNAndLeavesNoFile) {
  const std::string root = ::testing::TempDir() + "/from-view-nan";
  std::shared_ptr<ShardSnapshot> snap = MakeSnapshot(8, 1.0f);
  snap->values[3][4] = std::nanf("");
  absl::Notification copied;
  absl::StatusOr<WrittenShard> got = WriteShardFromView(ViewOf(snap), root, &copied);
  EXPECT_TRUE(IsNonFiniteTensorError(got.status())) << got.status();
  EXPECT_TRUE(copied.HasBeenNotified());
  EXPECT_EQ(ReadWhole(root + "/" + CheckpointShardPath("job", 8, 0, 1)), "");
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

// Nothing non-finite is kept (docs/numerics.md): the bytes the checksum
// reads are scanned on the way.
TEST(SerializeShardIntoTest, RefusesANaNNamingItsTensorYetSerializesTheWholeShard) {
  std::shared_ptr<ShardSnapshot> snap = MakeSnapshot(10, 1.0f);
  snap->values[3][7] = NAN;
  snap->values[4][2] = INFINITY;  // a later one: the first is named
  std::string out;
  const absl::Status s = SerializeShardInto(ViewOf(snap), &out);
  EXPECT_TRUE(IsNonFiniteTensorError(s)) << s;
  EXPECT_NE(s.message().find(absl::StrCat("shard of job job step 10 rank 0: tensor ",
                                          snap->entries[3].name, " holds nan at element 7")),
            std::string::npos)
      << s;
  // Whole and valid all the same: the buddy exchange sends it.
  EXPECT_TRUE(BlobFromBytes(out, BlobChecksum(out)).ok());
  EXPECT_TRUE(IsNonFiniteTensorError(SerializeShard(*snap).status()));
}

TEST(WriteShardTest, RefusesAnInfBeforeWritingAnything) {
  std::shared_ptr<ShardSnapshot> snap = MakeSnapshot(10, 1.0f);
  snap->values[0][14] = -INFINITY;
  const std::string root = ::testing::TempDir() + "/write_shard_inf";
  absl::StatusOr<WrittenShard> written = WriteShard(*snap, root);
  EXPECT_TRUE(IsNonFiniteTensorError(written.status())) << written.status();
  struct stat st;
  EXPECT_NE(stat(root.c_str(), &st), 0) << "nothing, not even the step directory, is created";
}

TEST(SnapshotKeeperTest, ARefusedSnapshotNeverCompletesAndTheCommittedOneStays) {
  SnapshotKeeper keeper;
  ASSERT_TRUE(keeper.Start(ViewOf(MakeSnapshot(10, 1.0f)), nullptr, 1, absl::Seconds(5)).ok());
  ASSERT_TRUE(keeper.Wait().ok());
  keeper.Commit(keeper.complete_step());
  std::shared_ptr<ShardSnapshot> bad = MakeSnapshot(20, 2.0f);
  bad->values[1][0] = NAN;
  ASSERT_TRUE(keeper.Start(ViewOf(bad), nullptr, 1, absl::Seconds(5)).ok());
  EXPECT_TRUE(keeper.Wait().ok()) << "a refusal does not fail training: the step's verdict does";
  EXPECT_EQ(keeper.complete_step(), 10);
  keeper.Commit(keeper.complete_step());
  EXPECT_EQ(keeper.committed_step(), 10);
  std::vector<std::shared_ptr<const SnapshotBlob>> held = keeper.Holdings();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0]->step, 10);
  const std::vector<std::string> refusals = keeper.TakeRefusals();
  ASSERT_EQ(refusals.size(), 1u);
  EXPECT_NE(refusals[0].find("step 20 rank 0"), std::string::npos) << refusals[0];
  EXPECT_TRUE(keeper.TakeRefusals().empty());
}

// Two ranks swapping with each other; rank 1's step-20 shard holds a NaN.
// Neither keeps it (rank 0 not its copy, rank 1 not its own), the step
// completes nowhere, and the exchange still ends on both sides.
TEST(SnapshotKeeperTest, ABuddyRefusalLeavesTheStepIncompleteOnBothRanks) {
  InMemoryKvStore store;
  SnapshotKeeper keepers[2];
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto comm = GlooCommunicator::Create(&store, rank, 2, "snapshot");
      ASSERT_TRUE(comm.ok()) << comm.status();
      SnapshotKeeper& keeper = keepers[rank];
      for (int64_t step : {10, 20}) {
        std::shared_ptr<ShardSnapshot> snap = MakeSnapshot(step, rank + 1.0f);
        snap->id.rank = rank;
        snap->id.world_size = 2;
        if (rank == 1 && step == 20) snap->values[5][3] = NAN;
        ASSERT_TRUE(keeper.Start(ViewOf(snap), comm->get(), 1, absl::Seconds(20)).ok());
        ASSERT_TRUE(keeper.Wait().ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(keepers[rank].complete_step(), 10) << "rank " << rank;
    for (const auto& blob : keepers[rank].Holdings()) {
      EXPECT_FALSE(blob->step == 20 && blob->rank == 1)
          << "rank " << rank << " keeps rank 1's refused step 20";
    }
  }
  EXPECT_EQ(keepers[1].TakeRefusals().size(), 1u);
  EXPECT_TRUE(keepers[0].TakeRefusals().empty());
}

}  // namespace
}  // namespace zeroshard
