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
#include "common/checksum.h"
#include "common/finite_scan.h"
#include "common/safetensors.h"
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
  EXPECT_EQ((*blob)->description.step, 10);
  EXPECT_EQ((*blob)->description.data_row, 1000);
  EXPECT_EQ((*blob)->description.pieces.size(), 2u);  // parameters only
  EXPECT_EQ((*blob)->description.bytes, static_cast<int64_t>(bytes.size()));
  EXPECT_EQ((*blob)->description.xxh64, sum);
  EXPECT_TRUE((*blob)->description.received);

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

// A blob of one F32 tensor "w:0-2" (two rows of one element) with `metadata`,
// its header's XXH64 right: only what the header says is wrong.
std::string BlobWith(const SafetensorsMetadata& metadata) {
  std::vector<std::pair<int64_t, int64_t>> offsets;
  absl::StatusOr<std::string> header =
      BuildSafetensorsHeader({{"w:0-2", DType::kF32, {2, 1}}}, metadata, &offsets);
  EXPECT_TRUE(header.ok()) << header.status();
  const float data[2] = {1.0f, 2.0f};
  return *header + std::string(reinterpret_cast<const char*>(data), sizeof(data));
}

SafetensorsMetadata GoodMetadata() {
  const float data[2] = {1.0f, 2.0f};
  return {{ShardMetadataKey::kStep, "7"},
          {ShardMetadataKey::kRank, "1"},
          {ShardMetadataKey::kWorldSize, "2"},
          {ShardMetadataKey::kDataRow, "40"},
          {ShardMetadataKey::kPlanHash, "plan"},
          {ShardMetadataKey::kChecksums,
           absl::StrCat("{\"w:0-2\": \"", ChecksumToHex(Checksum(data, sizeof(data))), "\"}")}};
}

// What BlobFromBytes says of a blob whose header XXH64 matches.
absl::Status Parse(const std::string& bytes) {
  return BlobFromBytes(bytes, BlobChecksum(bytes)).status();
}

TEST(BlobFromBytesTest, NamesTheBlobAndWhatIsWrongInItsHeader) {
  absl::StatusOr<std::shared_ptr<SnapshotBlob>> good =
      BlobFromBytes(BlobWith(GoodMetadata()), BlobChecksum(BlobWith(GoodMetadata())));
  ASSERT_TRUE(good.ok()) << good.status();
  const BlobDescription& d = (*good)->description;
  EXPECT_EQ(d.step, 7);
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.data_row, 40);
  EXPECT_EQ(d.plan_hash, "plan");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0].tensor, "w");
  EXPECT_EQ(d.pieces[0].row_end, 2);

  struct Case {
    const char* what;
    std::string bytes;
    const char* says;
  };
  SafetensorsMetadata no_row = GoodMetadata(), bad_step = GoodMetadata(), no_sums = GoodMetadata(),
                      other_sums = GoodMetadata();
  no_row.erase(ShardMetadataKey::kDataRow);
  bad_step[ShardMetadataKey::kStep] = "seven";
  no_sums.erase(ShardMetadataKey::kChecksums);
  other_sums[ShardMetadataKey::kChecksums] = "{\"v:0-2\": \"0000000000000000\"}";
  std::string not_json = BlobWith(GoodMetadata());
  not_json[8] = 'x';  // the header's opening brace
  std::string truncated = BlobWith(GoodMetadata());
  truncated.pop_back();  // the data ends before the tensor does
  const Case cases[] = {
      {"no data_row", BlobWith(no_row), "no \"data_row\""},
      {"step not a number", BlobWith(bad_step), "\"step\" is \"seven\", not an integer"},
      {"no checksums", BlobWith(no_sums), "\"checksums\" is missing"},
      {"another tensor's checksum", BlobWith(other_sums), "tensor w:0-2 has no recorded checksum"},
      {"header not JSON", not_json, "snapshot blob of "},
      {"short data", truncated, "snapshot blob of "},
  };
  for (const Case& c : cases) {
    const absl::Status status = Parse(c.bytes);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << c.what << ": " << status;
    EXPECT_NE(status.message().find(c.says), std::string::npos) << c.what << ": " << status;
  }
  // Once the metadata is read, the blob is named by its step and saver.
  EXPECT_NE(Parse(BlobWith(other_sums)).message().find("snapshot blob of step 7 (rank 1 of 2)"),
            std::string::npos);
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
  EXPECT_EQ(held[0]->description.step, 50);
  EXPECT_EQ(held[1]->description.step, 60);
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
  EXPECT_EQ(held[0]->description.step, 10);
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
      EXPECT_FALSE(blob->description.step == 20 && blob->description.rank == 1)
          << "rank " << rank << " keeps rank 1's refused step 20";
    }
  }
  EXPECT_EQ(keepers[1].TakeRefusals().size(), 1u);
  EXPECT_TRUE(keepers[0].TakeRefusals().empty());
}

}  // namespace
}  // namespace zeroshard
