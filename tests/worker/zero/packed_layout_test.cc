// MakePackedLayout (worker/zero/packed_layout.h) and the host backend's Pack
// and Unpack over it (Backend's defaults: a Convert or Zero per run).
#include "worker/zero/packed_layout.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "worker/zero/backend.h"

namespace zeroshard {
namespace {

std::vector<std::pair<int64_t, int64_t>> Runs(const PackedLayout& l) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const PackedRun& r : l.runs) out.push_back({r.packed_begin, r.full_offset});
  return out;
}

using Pairs = std::vector<std::pair<int64_t, int64_t>>;

// One rank whose pieces are in another order than the flat layout (the
// planner takes tensors largest first): a run per piece that does not
// continue the previous one, and the chunk's alignment padding at the end.
TEST(PackedLayoutTest, OneRankWithPiecesOutOfFlatOrder) {
  // flat: a [0,4) b [4,10) c [10,12); chunk order: b, a, c; chunk 16.
  std::vector<ShardBlock> blocks = {{0, 0, 4, 6}, {0, 6, 0, 4}, {0, 10, 10, 2}};
  auto l = MakePackedLayout(blocks, 1, 16);
  ASSERT_TRUE(l.ok()) << l.status();
  // a ends at flat 4 where b begins, but a comes after b in the chunk; c
  // follows a in the chunk but not in the flat layout.
  EXPECT_EQ(Runs(*l), (Pairs{{0, 4}, {6, 0}, {10, 10}, {12, -1}}));
  EXPECT_EQ(l->full_elements, 12);
  EXPECT_EQ(l->packed_elements(), 16);
}

TEST(PackedLayoutTest, BlocksThatContinueEachOtherAreOneRun) {
  // Rank 0: flat [0,5) then [5,8); rank 1: flat [8,12) with a gap of one
  // packed element before it and padding after; chunk 8.
  std::vector<ShardBlock> blocks = {{0, 0, 0, 5}, {1, 1, 8, 4}, {0, 5, 5, 3}, {1, 0, 99, 0}};
  auto l = MakePackedLayout(blocks, 2, 8);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(Runs(*l), (Pairs{{0, 0}, {8, -1}, {9, 8}, {13, -1}}));
  EXPECT_EQ(l->RunLength(0), 8);
  EXPECT_EQ(l->RunLength(1), 1);
  EXPECT_EQ(l->RunLength(2), 4);
  EXPECT_EQ(l->RunLength(3), 3);
  EXPECT_EQ(l->full_elements, 12);
}

TEST(PackedLayoutTest, BadLayoutsAreRefusedNamingTheBlock) {
  auto past = MakePackedLayout({{0, 0, 0, 4}, {1, 2, 4, 3}}, 2, 4);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("block 1"), std::string::npos) << past.status();
  EXPECT_NE(past.status().message().find("past its chunk of 4"), std::string::npos);
  auto overlap = MakePackedLayout({{0, 0, 0, 3}, {0, 2, 3, 2}}, 1, 4);
  ASSERT_FALSE(overlap.ok());
  EXPECT_NE(overlap.status().message().find("overlaps"), std::string::npos) << overlap.status();
  auto rank = MakePackedLayout({{2, 0, 0, 1}}, 2, 4);
  ASSERT_FALSE(rank.ok());
  EXPECT_NE(rank.status().message().find("rank 2"), std::string::npos) << rank.status();
  EXPECT_FALSE(MakePackedLayout({}, 0, 4).ok());
  // Nothing to move: no runs.
  auto empty = MakePackedLayout({}, 2, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->runs.empty());
}

// Pack then Unpack gives back every covered element (bf16: rounded to
// nearest even once), leaves the uncovered ones alone, and packs zeros
// into padding.
TEST(PackedLayoutTest, HostPackAndUnpackRoundTrip) {
  std::vector<ShardBlock> blocks = {{0, 0, 4, 6}, {0, 6, 0, 4}, {1, 1, 10, 3}, {1, 4, 14, 2}};
  auto l = MakePackedLayout(blocks, 2, 12);
  ASSERT_TRUE(l.ok()) << l.status();
  std::vector<float> full(17);
  for (size_t i = 0; i < full.size(); ++i) full[i] = 1.0f + 1.0f / (3.0f + i);
  full[13] = 0;  // in no block
  Backend* cpu = CpuBackend();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::vector<uint32_t> packed(24, 0xdeadbeefu);  // room for 24 f32
    cpu->Pack(*l, full.data(), packed.data(), dtype);
    std::vector<float> back(17, -7.0f);
    cpu->Unpack(*l, packed.data(), dtype, back.data());
    for (int64_t i = 0; i < 17; ++i) {
      const bool covered = i != 13 && i != 16;
      const float expect = dtype == DType::kF32 ? full[i] : BF16ToFloat(FloatToBF16(full[i]));
      if (covered) {
        EXPECT_EQ(back[i], expect) << DTypeName(dtype) << " element " << i;
      } else {
        EXPECT_EQ(back[i], -7.0f) << DTypeName(dtype) << " element " << i;
      }
    }
    // Padding: rank 0's [10, 12), rank 1's [0, 1) and [6, 12).
    for (int64_t p : {10, 11, 12, 18, 19, 20, 21, 22, 23}) {
      const float v = dtype == DType::kF32 ? reinterpret_cast<const float*>(packed.data())[p]
                                           : BF16ToFloat(reinterpret_cast<const uint16_t*>(
                                                 packed.data())[p]);
      EXPECT_EQ(v, 0.0f) << DTypeName(dtype) << " packed " << p;
    }
  }
}

}  // namespace
}  // namespace zeroshard
