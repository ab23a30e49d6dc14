// TwoLevelCommunicator with ranks as threads of one process, "hosts" made by
// giving ranks different host keys: every collective gives what the flat
// definition says, and the bytes that cross hosts are (H - 1) / H of the
// buffer per host.
#include "worker/comm/two_level_communicator.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace {

using comm_test::RunThreads;

constexpr absl::Duration kTimeout = absl::Seconds(20);

std::vector<std::unique_ptr<TwoLevelCommunicator>> CreateAll(
    KeyValueStore* store, const std::vector<std::string>& host_keys, const std::string& tag,
    bool shared_memory) {
  const int w = static_cast<int>(host_keys.size());
  std::vector<std::unique_ptr<TwoLevelCommunicator>> comms(w);
  RunThreads(w, [&](int rank) {
    TwoLevelCommunicator::Options options;
    options.host.hostname = "127.0.0.1";
    options.host.connect_timeout = absl::Seconds(10);
    options.host.shared_memory = shared_memory;
    options.host.shm_slot_bytes = 4096 * w;
    options.host_key = host_keys[rank];
    std::string why_not;
    auto comm = TwoLevelCommunicator::Create(store, rank, w, tag, options, &why_not);
    ASSERT_TRUE(comm.ok()) << comm.status();
    ASSERT_NE(*comm, nullptr) << why_not;
    EXPECT_EQ((*comm)->transport_note().find("shared memory") != std::string::npos, shared_memory)
        << (*comm)->transport_note();
    comms[rank] = *std::move(comm);
  });
  return comms;
}

void DestroyAll(std::vector<std::unique_ptr<TwoLevelCommunicator>>* comms) {
  RunThreads(static_cast<int>(comms->size()), [comms](int i) { (*comms)[i].reset(); });
}

// Small integers: every sum and average below is exact in f32 and bf16, so
// any order of additions gives the same bits.
float Value(int rank, int64_t i) { return static_cast<float>((rank * 7 + i) % 13 - 6); }

TEST(HostLayoutTest, NumbersHostsByTheirFirstRankAndRanksWithinAHost) {
  auto layout = HostLayout::Of({"b", "a", "b", "a"});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->hosts, 2);
  EXPECT_EQ(layout->local_size, 2);
  EXPECT_EQ(layout->host_of, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(layout->local_of, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(layout->ranks_on, (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
}

TEST(HostLayoutTest, RefusesHostsWithDifferentRankCounts) {
  auto layout = HostLayout::Of({"a", "a", "a", "b"});
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(layout.status().message().find("(3, 1)"), std::string::npos) << layout.status();
}

TEST(SplitByRailTest, PacksEachRailsBlocksInOrder) {
  // Hosts {0, 1} and {2, 3}: rail 0 = ranks 0, 2; rail 1 = ranks 1, 3.
  auto layout = HostLayout::Of({"a", "a", "b", "b"});
  ASSERT_TRUE(layout.ok());
  // Rank r owns [10r, 10r + 10) at shard offset 0, and rank 2 a second block.
  std::vector<ShardBlock> blocks = {{0, 0, 0, 10}, {1, 0, 10, 10}, {2, 0, 20, 10},
                                    {3, 0, 30, 10}, {2, 10, 40, 5}};
  RailLayouts r2 = SplitByRail(blocks, *layout, 2);
  EXPECT_EQ(r2.rail_elements, 25);  // blocks of ranks 0 and 2
  ASSERT_EQ(r2.inter.size(), 3u);
  EXPECT_EQ(r2.inter[0].rank, 0);  // rank 0 is host 0
  EXPECT_EQ(r2.inter[1].rank, 1);  // rank 2 is host 1
  EXPECT_EQ(r2.inter[2].full_offset, 20);  // third in rail 0
  EXPECT_EQ(r2.inter[2].shard_offset, 10);
  ASSERT_EQ(r2.intra.size(), 5u);
  EXPECT_EQ(r2.intra[3].rank, 1);          // rank 3 is local 1
  EXPECT_EQ(r2.intra[3].shard_offset, 10);  // second in rail 1
  EXPECT_EQ(r2.intra[3].full_offset, 30);
}

class TwoLevelTest : public ::testing::TestWithParam<std::tuple<bool, DType>> {};

TEST_P(TwoLevelTest, EveryCollectiveEqualsItsDefinition) {
  const auto [shared_memory, dtype] = GetParam();
  // Interleaved on purpose: ranks 0, 2 on one host, 1, 3 on the other.
  const std::vector<std::string> keys = {"hostA", "hostB", "hostA", "hostB"};
  const int w = 4;
  InMemoryKvStore store;
  auto comms = CreateAll(&store, keys, "t", shared_memory);
  ASSERT_EQ(comms.size(), 4u);
  // An uneven block layout: rank r holds blocks of sizes r + 3 and 11 - r,
  // placed in a permuted order in the full buffer.
  std::vector<ShardBlock> blocks;
  int64_t full = 0;
  for (int r : {2, 0, 3, 1}) {
    blocks.push_back({r, 0, full, r + 3});
    full += r + 3;
  }
  for (int r : {1, 3, 0, 2}) {
    blocks.push_back({r, r + 3, full, 11 - r});
    full += 11 - r;
  }
  const int64_t shard = 14;  // (r + 3) + (11 - r)
  const size_t esize = DTypeSize(dtype);
  auto encode = [&](const std::vector<float>& v) {
    std::vector<uint8_t> out(v.size() * esize);
    for (size_t i = 0; i < v.size(); ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(out.data() + 4 * i, &v[i], 4);
      } else {
        const uint16_t b = FloatToBF16(v[i]);
        std::memcpy(out.data() + 2 * i, &b, 2);
      }
    }
    return out;
  };
  auto decode = [&](const std::vector<uint8_t>& bytes) {
    std::vector<float> v(bytes.size() / esize);
    for (size_t i = 0; i < v.size(); ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(&v[i], bytes.data() + 4 * i, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * i, 2);
        v[i] = BF16ToFloat(b);
      }
    }
    return v;
  };
  RunThreads(w, [&](int rank) {
    TwoLevelCommunicator& comm = *comms[rank];
    // AllGatherBlocks: full[b.full_offset + i] = rank b.rank's shard[b.shard_offset + i].
    std::vector<float> mine(shard);
    for (int64_t i = 0; i < shard; ++i) mine[i] = Value(rank, i);
    std::vector<uint8_t> in = encode(mine), out(full * esize);
    ASSERT_TRUE(comm.AllGatherBlocks(in.data(), out.data(), blocks, dtype, kTimeout).ok());
    std::vector<float> gathered = decode(out);
    for (const ShardBlock& b : blocks) {
      for (int64_t i = 0; i < b.count; ++i) {
        ASSERT_EQ(gathered[b.full_offset + i], Value(b.rank, b.shard_offset + i))
            << "all_gather, block of rank " << b.rank << " element " << i;
      }
    }
    // ReduceScatterBlocks, sum and average.
    std::vector<float> whole(full);
    for (int64_t i = 0; i < full; ++i) whole[i] = Value(rank, i);
    std::vector<uint8_t> rs_in = encode(whole);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
      std::vector<uint8_t> rs_out(shard * esize, 0);
      ASSERT_TRUE(
          comm.ReduceScatterBlocks(rs_in.data(), rs_out.data(), blocks, dtype, op, kTimeout).ok());
      std::vector<float> reduced = decode(rs_out);
      for (const ShardBlock& b : blocks) {
        if (b.rank != rank) continue;
        for (int64_t i = 0; i < b.count; ++i) {
          float sum = 0;
          for (int r = 0; r < w; ++r) sum += Value(r, b.full_offset + i);
          const float want = op == ReduceOp::kSum ? sum : sum / w;
          ASSERT_EQ(reduced[b.shard_offset + i], want) << "reduce_scatter element " << i;
        }
      }
    }
    // AllReduce (an odd count), Broadcast, Barrier.
    const int64_t count = 1001;
    std::vector<float> values(count);
    for (int64_t i = 0; i < count; ++i) values[i] = Value(rank, i);
    std::vector<uint8_t> ar = encode(values);
    ASSERT_TRUE(comm.AllReduce(ar.data(), count, dtype, ReduceOp::kSum, kTimeout).ok());
    std::vector<float> summed = decode(ar);
    for (int64_t i = 0; i < count; ++i) {
      float sum = 0;
      for (int r = 0; r < w; ++r) sum += Value(r, i);
      ASSERT_EQ(summed[i], sum) << "all_reduce element " << i;
    }
    std::vector<uint8_t> bc = encode(values);
    ASSERT_TRUE(comm.Broadcast(bc.data(), count, dtype, 3, kTimeout).ok());
    std::vector<float> got = decode(bc);
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], Value(3, i));
    ASSERT_TRUE(comm.Barrier(kTimeout).ok());
    EXPECT_TRUE(comm.health().ok());
  });
  DestroyAll(&comms);
}

INSTANTIATE_TEST_SUITE_P(Transports, TwoLevelTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(DType::kF32, DType::kBF16)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param) ? "shm" : "tcp", "_",
                                               DTypeName(std::get<1>(info.param)));
                         });

TEST(TwoLevelBytesTest, EachHostSendsHalfTheBufferAcrossWithTwoHosts) {
  // 2 hosts x 2 ranks, equal chunks of n elements (f32): the rail's ring
  // reduce-scatter over H = 2 sends (H - 1) / H of the rail buffer (2n
  // elements) per rank, so n elements; per host 2n = (H - 1) / H of the 4n
  // buffer. The flat ring over W = 4 sends 3n per rank, and its cross-host
  // links carry 3n each.
  InMemoryKvStore store;
  auto comms = CreateAll(&store, {"a", "a", "b", "b"}, "bytes", /*shared_memory=*/true);
  const int64_t n = 1000;
  RunThreads(4, [&](int rank) {
    std::vector<float> full(4 * n, 1.0f), shard(n);
    ASSERT_TRUE(comms[rank]
                    ->ReduceScatter(full.data(), shard.data(), n, DType::kF32, ReduceOp::kSum,
                                    kTimeout)
                    .ok());
    EXPECT_EQ(shard[0], 4.0f);
    EXPECT_EQ(comms[rank]->inter_host_bytes_sent().reduce_scatter, n * 4);
  });
  DestroyAll(&comms);
}

TEST(TwoLevelCreateTest, OneHostOrOneRankPerHostIsLeftToTheFlatCommunicator) {
  for (const std::vector<std::string>& keys :
       {std::vector<std::string>{"a", "a", "a"}, std::vector<std::string>{"a", "b", "c"},
        std::vector<std::string>{"a", "a", "b"}}) {
    InMemoryKvStore store;
    const int w = static_cast<int>(keys.size());
    std::vector<std::string> why(w);
    RunThreads(w, [&](int rank) {
      TwoLevelCommunicator::Options options;
      options.host_key = keys[rank];
      options.host.connect_timeout = absl::Seconds(10);
      auto comm = TwoLevelCommunicator::Create(&store, rank, w, "c", options, &why[rank]);
      ASSERT_TRUE(comm.ok()) << comm.status();
      EXPECT_EQ(*comm, nullptr);
    });
    EXPECT_FALSE(why[0].empty());
    for (const std::string& w0 : why) EXPECT_EQ(w0, why[0]) << "every rank agrees";
  }
}

}  // namespace
}  // namespace zeroshard
