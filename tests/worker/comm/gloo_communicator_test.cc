// Collectives of GlooCommunicator with 2, 3 and 4 ranks as threads of this
// process, bootstrapped through one InMemoryKvStore, bound to 127.0.0.1.
#include "worker/comm/gloo_communicator.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace {

using ::zeroshard::comm_test::CreateCommunicators;
using ::zeroshard::comm_test::DestroyCommunicators;
using ::zeroshard::comm_test::RunThreads;

constexpr absl::Duration kTimeout = absl::Seconds(10);

// Exactly representable in f32 and bf16, so sums in any order are exact.
float ExactValue(int rank, int64_t i) {
  return static_cast<float>((rank + 1) * 0.25 + static_cast<double>(i % 64) * 0.5);
}

// Deterministic pseudo-random value in [-2, 2) for the bf16 tolerance tests.
float NoisyValue(int rank, int64_t i) {
  uint64_t x =
      (static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(i)) * 6364136223846793005ull +
      1442695040888963407ull;
  x ^= x >> 29;
  return static_cast<float>(x % 40000) / 10000.0f - 2.0f;
}

std::vector<uint16_t> ToBF16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = FloatToBF16(values[i]);
  return out;
}

// Tolerance for a bf16 ring reduction of W terms: one rounding (unit
// roundoff 2^-8) per hop on partial sums bounded by sum |x|.
float BF16Tolerance(int world_size, float abs_sum) {
  return world_size * std::ldexp(1.0f, -8) * abs_sum + 1e-6f;
}

// Every collective over both transports: loopback TCP and shared memory.
class GlooCommunicatorTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int W() const { return std::get<0>(GetParam()); }
  bool Shm() const { return std::get<1>(GetParam()); }

  std::vector<std::unique_ptr<HostCommunicator>> Create(const std::string& tag) {
    return CreateCommunicators(&store_, W(), tag, Shm());
  }

  void SetUp() override {
    comms_ = Create("test");
    for (const auto& comm : comms_) ASSERT_NE(comm, nullptr);
  }

  void TearDown() override { DestroyCommunicators(&comms_); }

  InMemoryKvStore store_;
  std::vector<std::unique_ptr<HostCommunicator>> comms_;
};

TEST_P(GlooCommunicatorTest, RankAndWorldSize) {
  for (int r = 0; r < W(); ++r) {
    EXPECT_EQ(comms_[r]->rank(), r);
    EXPECT_EQ(comms_[r]->world_size(), W());
    EXPECT_EQ(comms_[r]->tag(), "test");
  }
}

TEST_P(GlooCommunicatorTest, AllGatherF32) {
  const int64_t count = 1000;
  std::vector<std::vector<float>> out(W(), std::vector<float>(W() * count, -1.0f));
  RunThreads(W(), [&](int r) {
    std::vector<float> in(count);
    for (int64_t i = 0; i < count; ++i) in[i] = NoisyValue(r, i);
    EXPECT_TRUE(comms_[r]->AllGather(in.data(), out[r].data(), count, DType::kF32, kTimeout).ok());
  });
  for (int r = 0; r < W(); ++r) {
    for (int src = 0; src < W(); ++src) {
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(out[r][src * count + i], NoisyValue(src, i)) << "rank " << r << " src " << src;
      }
    }
    EXPECT_EQ(comms_[r]->bytes_sent().all_gather, (W() - 1) * count * 4);
  }
}

TEST_P(GlooCommunicatorTest, AllGatherBF16AndInPlace) {
  const int64_t count = 333;  // odd byte counts per half-chunk
  std::vector<std::vector<uint16_t>> out(W(), std::vector<uint16_t>(W() * count, 0));
  RunThreads(W(), [&](int r) {
    // In place: the input already sits at this rank's slot of the output.
    for (int64_t i = 0; i < count; ++i) out[r][r * count + i] = FloatToBF16(NoisyValue(r, i));
    EXPECT_TRUE(
        comms_[r]
            ->AllGather(out[r].data() + r * count, out[r].data(), count, DType::kBF16, kTimeout)
            .ok());
  });
  for (int r = 0; r < W(); ++r) {
    for (int src = 0; src < W(); ++src) {
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(out[r][src * count + i], FloatToBF16(NoisyValue(src, i)));
      }
    }
    EXPECT_EQ(comms_[r]->bytes_sent().all_gather, (W() - 1) * count * 2);
  }
}

TEST_P(GlooCommunicatorTest, ReduceScatterF32SumAndAverage) {
  const int64_t count = 777;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    std::vector<std::vector<float>> out(W(), std::vector<float>(count, -1.0f));
    RunThreads(W(), [&](int r) {
      std::vector<float> in(W() * count);
      for (int64_t i = 0; i < W() * count; ++i) in[i] = ExactValue(r, i);
      EXPECT_TRUE(comms_[r]
                      ->ReduceScatter(in.data(), out[r].data(), count, DType::kF32, op, kTimeout)
                      .ok());
    });
    for (int r = 0; r < W(); ++r) {
      for (int64_t i = 0; i < count; ++i) {
        float sum = 0;
        for (int src = 0; src < W(); ++src) sum += ExactValue(src, r * count + i);
        const float expected = op == ReduceOp::kSum ? sum : sum / W();
        ASSERT_EQ(out[r][i], expected) << "rank " << r << " element " << i;
      }
    }
  }
  for (int r = 0; r < W(); ++r) {
    EXPECT_EQ(comms_[r]->bytes_sent().reduce_scatter, 2 * (W() - 1) * count * 4);
  }
}

TEST_P(GlooCommunicatorTest, ReduceScatterBF16WithinToleranceOfF32) {
  const int64_t count = 500;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    std::vector<std::vector<uint16_t>> out(W(), std::vector<uint16_t>(count, 0));
    RunThreads(W(), [&](int r) {
      std::vector<float> in(W() * count);
      for (int64_t i = 0; i < W() * count; ++i) in[i] = NoisyValue(r, i);
      std::vector<uint16_t> in_bf16 = ToBF16(in);
      EXPECT_TRUE(
          comms_[r]
              ->ReduceScatter(in_bf16.data(), out[r].data(), count, DType::kBF16, op, kTimeout)
              .ok());
    });
    for (int r = 0; r < W(); ++r) {
      for (int64_t i = 0; i < count; ++i) {
        float sum = 0, abs_sum = 0;
        for (int src = 0; src < W(); ++src) {
          const float x = BF16ToFloat(FloatToBF16(NoisyValue(src, r * count + i)));
          sum += x;
          abs_sum += std::fabs(x);
        }
        const float divisor = op == ReduceOp::kSum ? 1.0f : static_cast<float>(W());
        ASSERT_NEAR(BF16ToFloat(out[r][i]), sum / divisor, BF16Tolerance(W(), abs_sum) / divisor)
            << "rank " << r << " element " << i;
      }
    }
  }
  for (int r = 0; r < W(); ++r) {
    EXPECT_EQ(comms_[r]->bytes_sent().reduce_scatter, 2 * (W() - 1) * count * 2);
  }
}

TEST_P(GlooCommunicatorTest, ReduceScatterInPlace) {
  const int64_t count = 64;
  std::vector<std::vector<float>> buf(W(), std::vector<float>(W() * count));
  RunThreads(W(), [&](int r) {
    for (int64_t i = 0; i < W() * count; ++i) buf[r][i] = ExactValue(r, i);
    float* own = buf[r].data() + r * count;
    EXPECT_TRUE(
        comms_[r]
            ->ReduceScatter(buf[r].data(), own, count, DType::kF32, ReduceOp::kSum, kTimeout)
            .ok());
  });
  for (int r = 0; r < W(); ++r) {
    for (int64_t i = 0; i < count; ++i) {
      float sum = 0;
      for (int src = 0; src < W(); ++src) sum += ExactValue(src, r * count + i);
      ASSERT_EQ(buf[r][r * count + i], sum);
    }
  }
}

// All-reduce bytes of rank r: everything but its own chunk in the
// reduce-scatter half, everything but chunk r+1 in the all-gather half.
int64_t AllReduceBytes(int rank, int world_size, int64_t count, int element_size) {
  auto chunk = [&](int c) { return count / world_size + (c < count % world_size ? 1 : 0); };
  return (2 * count - chunk(rank) - chunk((rank + 1) % world_size)) * element_size;
}

TEST_P(GlooCommunicatorTest, AllReduceF32AnyCount) {
  std::vector<int64_t> expected_bytes(W(), 0);
  // Divisible, not divisible, fewer elements than ranks.
  for (int64_t count : {int64_t{W()} * 100, int64_t{W()} * 100 + 1, int64_t{1001}, int64_t{1}}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
      std::vector<std::vector<float>> buf(W(), std::vector<float>(count));
      RunThreads(W(), [&](int r) {
        for (int64_t i = 0; i < count; ++i) buf[r][i] = ExactValue(r, i);
        EXPECT_TRUE(comms_[r]->AllReduce(buf[r].data(), count, DType::kF32, op, kTimeout).ok());
      });
      for (int r = 0; r < W(); ++r) {
        for (int64_t i = 0; i < count; ++i) {
          float sum = 0;
          for (int src = 0; src < W(); ++src) sum += ExactValue(src, i);
          const float expected = op == ReduceOp::kSum ? sum : sum / W();
          ASSERT_EQ(buf[r][i], expected) << "count " << count << " rank " << r << " elem " << i;
        }
        expected_bytes[r] += AllReduceBytes(r, W(), count, 4);
      }
    }
  }
  for (int r = 0; r < W(); ++r) {
    EXPECT_EQ(comms_[r]->bytes_sent().all_reduce, expected_bytes[r]) << "rank " << r;
  }
}

TEST_P(GlooCommunicatorTest, AllReduceBF16WithinToleranceOfF32) {
  std::vector<int64_t> expected_bytes(W(), 0);
  for (int64_t count : {int64_t{W()} * 64, int64_t{W()} * 64 + W() - 1}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
      std::vector<std::vector<uint16_t>> buf(W());
      RunThreads(W(), [&](int r) {
        std::vector<float> in(count);
        for (int64_t i = 0; i < count; ++i) in[i] = NoisyValue(r, i);
        buf[r] = ToBF16(in);
        EXPECT_TRUE(comms_[r]->AllReduce(buf[r].data(), count, DType::kBF16, op, kTimeout).ok());
      });
      for (int64_t i = 0; i < count; ++i) {
        float sum = 0, abs_sum = 0;
        for (int src = 0; src < W(); ++src) {
          const float x = BF16ToFloat(FloatToBF16(NoisyValue(src, i)));
          sum += x;
          abs_sum += std::fabs(x);
        }
        const float divisor = op == ReduceOp::kSum ? 1.0f : static_cast<float>(W());
        ASSERT_NEAR(BF16ToFloat(buf[0][i]), sum / divisor, BF16Tolerance(W(), abs_sum) / divisor);
        // Every rank ends with the same bits.
        for (int r = 1; r < W(); ++r) ASSERT_EQ(buf[r][i], buf[0][i]);
      }
      for (int r = 0; r < W(); ++r) expected_bytes[r] += AllReduceBytes(r, W(), count, 2);
    }
  }
  for (int r = 0; r < W(); ++r) {
    EXPECT_EQ(comms_[r]->bytes_sent().all_reduce, expected_bytes[r]) << "rank " << r;
  }
}

TEST_P(GlooCommunicatorTest, BroadcastFromEveryRoot) {
  const int64_t count = 300;
  int ceil_log2 = 0;
  while ((1 << ceil_log2) < W()) ++ceil_log2;
  int64_t total_bytes = 0;
  for (int root = 0; root < W(); ++root) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int esize = dtype == DType::kF32 ? 4 : 2;
      std::vector<CollectiveBytes> before(W());
      for (int r = 0; r < W(); ++r) before[r] = comms_[r]->bytes_sent();
      std::vector<std::vector<char>> buf(W(), std::vector<char>(count * esize));
      RunThreads(W(), [&](int r) {
        for (size_t b = 0; b < buf[r].size(); ++b) buf[r][b] = static_cast<char>(b * 7 + r * 13);
        EXPECT_TRUE(comms_[r]->Broadcast(buf[r].data(), count, dtype, root, kTimeout).ok());
      });
      // The root's data is what everybody holds.
      std::vector<char> expected(count * esize);
      for (size_t b = 0; b < expected.size(); ++b) {
        expected[b] = static_cast<char>(b * 7 + root * 13);
      }
      int64_t sent = 0;
      for (int r = 0; r < W(); ++r) {
        ASSERT_EQ(buf[r], expected) << "rank " << r << " root " << root;
        const int64_t delta = comms_[r]->bytes_sent().broadcast - before[r].broadcast;
        if (r == root) {
          EXPECT_EQ(delta, ceil_log2 * count * esize);
        }
        sent += delta;
      }
      // A tree: every rank but the root receives the buffer exactly once.
      EXPECT_EQ(sent, (W() - 1) * count * esize);
      total_bytes += sent;
    }
  }
  EXPECT_GT(total_bytes, 0);
}

TEST_P(GlooCommunicatorTest, BarrierWaitsForEveryRank) {
  std::atomic<int> arrived{0};
  std::vector<int> seen(W(), -1);
  RunThreads(W(), [&](int r) {
    // The last rank arrives once every other rank is inside the barrier;
    // nobody may leave before it arrived.
    if (r == W() - 1) {
      for (int other = 0; other < W() - 1; ++other) {
        ASSERT_TRUE(comms_[other]->AwaitCollectiveInFlight(kTimeout)) << "rank " << other;
      }
    }
    arrived.fetch_add(1);
    EXPECT_TRUE(comms_[r]->Barrier(kTimeout).ok());
    seen[r] = arrived.load();
  });
  for (int r = 0; r < W(); ++r) EXPECT_EQ(seen[r], W()) << "rank " << r;
}

TEST_P(GlooCommunicatorTest, RejectsBadArguments) {
  HostCommunicator& comm = *comms_[0];
  float x[4] = {};
  EXPECT_EQ(comm.AllGather(x, x, -1, DType::kF32, kTimeout).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm.AllReduce(x, 1, DType::kF16, ReduceOp::kSum, kTimeout).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm.Broadcast(x, 1, DType::kF32, W(), kTimeout).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm.Barrier(absl::ZeroDuration()).code(), absl::StatusCode::kInvalidArgument);
  // Zero elements: nothing to do, no communication.
  EXPECT_TRUE(comm.AllReduce(x, 0, DType::kF32, ReduceOp::kSum, kTimeout).ok());
  // Rejected arguments do not break the communicator.
  EXPECT_TRUE(comm.health().ok());
}

// An irregular block layout over a full buffer of `full` elements: blocks of
// uneven sizes, rank r taking every W-th block (the last rank taking none
// when W > 2), shards with gaps, empty blocks, and full-buffer gaps that no
// block covers.
std::vector<ShardBlock> IrregularBlocks(int world, int64_t* full) {
  std::vector<ShardBlock> blocks;
  std::vector<int64_t> shard_at(world, 3);  // shards start with 3 padding elements
  int64_t at = 0;
  const int owners = world > 2 ? world - 1 : world;
  for (int i = 0; i < 11; ++i) {
    const int rank = i % owners;
    const int64_t count = i == 4 ? 0 : 17 + 29 * i;
    blocks.push_back(ShardBlock{rank, shard_at[rank], at, count});
    shard_at[rank] += count + 2;  // a gap between pieces in the shard
    at += count + (i % 3 == 0 ? 5 : 0);  // and sometimes in the full buffer
  }
  *full = at;
  return blocks;
}

TEST_P(GlooCommunicatorTest, AllGatherBlocksMovesEveryBlockIntoPlace) {
  int64_t full = 0;
  const std::vector<ShardBlock> blocks = IrregularBlocks(W(), &full);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const int esize = DTypeSize(dtype);
    std::vector<std::vector<char>> out(W(), std::vector<char>(full * esize, 0x5a));
    RunThreads(W(), [&](int r) {
      // Rank r's shard holds the values every rank expects, at its offsets.
      std::vector<float> shard(4096, NAN);
      for (const ShardBlock& b : blocks) {
        if (b.rank != r) continue;
        for (int64_t i = 0; i < b.count; ++i) shard[b.shard_offset + i] = ExactValue(r, b.full_offset + i);
      }
      std::vector<uint16_t> narrow = ToBF16(shard);
      const void* in = dtype == DType::kF32 ? static_cast<const void*>(shard.data()) : narrow.data();
      absl::Status s = comms_[r]->AllGatherBlocks(in, out[r].data(), blocks, dtype, kTimeout);
      EXPECT_TRUE(s.ok()) << s;
    });
    std::vector<bool> covered(full, false);
    for (const ShardBlock& b : blocks) {
      for (int64_t i = 0; i < b.count; ++i) covered[b.full_offset + i] = true;
    }
    for (int r = 0; r < W(); ++r) {
      for (const ShardBlock& b : blocks) {
        for (int64_t i = 0; i < b.count; ++i) {
          const char* at = out[r].data() + (b.full_offset + i) * esize;
          float value;
          if (dtype == DType::kF32) {
            std::memcpy(&value, at, 4);
          } else {
            uint16_t bits;
            std::memcpy(&bits, at, 2);
            value = BF16ToFloat(bits);
          }
          ASSERT_EQ(value, ExactValue(b.rank, b.full_offset + i))
              << DTypeName(dtype) << " rank " << r << " element " << b.full_offset + i;
        }
      }
      for (int64_t i = 0; i < full; ++i) {
        if (covered[i]) continue;
        for (int k = 0; k < esize; ++k) {
          ASSERT_EQ(out[r][i * esize + k], 0x5a) << "gap element " << i << " was written";
        }
      }
    }
  }
}

TEST_P(GlooCommunicatorTest, ReduceScatterBlocksReducesEachRanksBlocks) {
  int64_t full = 0;
  const std::vector<ShardBlock> blocks = IrregularBlocks(W(), &full);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    std::vector<std::vector<float>> shard(W(), std::vector<float>(4096, -7.0f));
    RunThreads(W(), [&](int r) {
      std::vector<float> in(full);
      for (int64_t i = 0; i < full; ++i) in[i] = ExactValue(r, i);
      absl::Status s = comms_[r]->ReduceScatterBlocks(in.data(), shard[r].data(), blocks,
                                                      DType::kF32, op, kTimeout);
      EXPECT_TRUE(s.ok()) << s;
    });
    for (int r = 0; r < W(); ++r) {
      std::vector<bool> written(4096, false);
      for (const ShardBlock& b : blocks) {
        if (b.rank != r) continue;
        for (int64_t i = 0; i < b.count; ++i) {
          float sum = 0;
          for (int src = 0; src < W(); ++src) sum += ExactValue(src, b.full_offset + i);
          const float expected = op == ReduceOp::kSum ? sum : sum / W();
          ASSERT_EQ(shard[r][b.shard_offset + i], expected)
              << "rank " << r << " full element " << b.full_offset + i;
          written[b.shard_offset + i] = true;
        }
      }
      for (int64_t i = 0; i < 4096; ++i) {
        if (!written[i]) {
          ASSERT_EQ(shard[r][i], -7.0f) << "rank " << r << " padding " << i;
        }
      }
    }
  }
  // bf16 against the f32 result, within the ring's rounding.
  std::vector<std::vector<float>> result(W(), std::vector<float>(4096, 0.0f));
  RunThreads(W(), [&](int r) {
    std::vector<float> in(full);
    for (int64_t i = 0; i < full; ++i) in[i] = NoisyValue(r, i);
    std::vector<uint16_t> narrow = ToBF16(in), out(4096, 0);
    absl::Status s = comms_[r]->ReduceScatterBlocks(narrow.data(), out.data(), blocks,
                                                    DType::kBF16, ReduceOp::kSum, kTimeout);
    EXPECT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < 4096; ++i) result[r][i] = BF16ToFloat(out[i]);
  });
  for (const ShardBlock& b : blocks) {
    for (int64_t i = 0; i < b.count; ++i) {
      float sum = 0, abs_sum = 0;
      for (int src = 0; src < W(); ++src) {
        const float v = BF16ToFloat(FloatToBF16(NoisyValue(src, b.full_offset + i)));
        sum += v;
        abs_sum += std::fabs(v);
      }
      ASSERT_NEAR(result[b.rank][b.shard_offset + i], sum, BF16Tolerance(W(), abs_sum));
    }
  }
}

TEST_P(GlooCommunicatorTest, BlockCollectivesRejectBadLayouts) {
  HostCommunicator& comm = *comms_[0];
  float x[16] = {};
  std::vector<ShardBlock> bad_rank = {{W(), 0, 0, 4}};
  absl::Status s = comm.AllGatherBlocks(x, x, bad_rank, DType::kF32, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block 0 belongs to rank"), std::string::npos) << s;
  std::vector<ShardBlock> negative = {{0, 0, 0, 4}, {1, -2, 4, 4}};
  s = comm.ReduceScatterBlocks(x, x, negative, DType::kF32, ReduceOp::kSum, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block 1"), std::string::npos) << s;
  EXPECT_TRUE(comm.health().ok());
}

// One thread per rank runs gathers on a "gather" communicator while another
// runs all-reduces on a "reduce" communicator, at the same time.
TEST_P(GlooCommunicatorTest, TwoTagsConcurrently) {
  auto gather = Create("gather");
  auto reduce = Create("reduce");
  for (int r = 0; r < W(); ++r) {
    ASSERT_NE(gather[r], nullptr);
    ASSERT_NE(reduce[r], nullptr);
  }
  const int kIterations = 20;
  const int64_t count = 2048;
  RunThreads(2 * W(), [&](int thread) {
    const int r = thread / 2;
    if (thread % 2 == 0) {
      std::vector<float> in(count), out(W() * count);
      for (int it = 0; it < kIterations; ++it) {
        for (int64_t i = 0; i < count; ++i) in[i] = ExactValue(r, i + it);
        ASSERT_TRUE(gather[r]->AllGather(in.data(), out.data(), count, DType::kF32, kTimeout).ok());
        for (int src = 0; src < W(); ++src) {
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(out[src * count + i], ExactValue(src, i + it));
          }
        }
      }
    } else {
      std::vector<float> buf(count + 1);
      for (int it = 0; it < kIterations; ++it) {
        for (int64_t i = 0; i < count + 1; ++i) buf[i] = ExactValue(r, i * it);
        ASSERT_TRUE(reduce[r]
                        ->AllReduce(buf.data(), count + 1, DType::kF32, ReduceOp::kSum, kTimeout)
                        .ok());
        for (int64_t i = 0; i < count + 1; ++i) {
          float sum = 0;
          for (int src = 0; src < W(); ++src) sum += ExactValue(src, i * it);
          ASSERT_EQ(buf[i], sum);
        }
      }
    }
  });
  for (int r = 0; r < W(); ++r) {
    EXPECT_EQ(gather[r]->bytes_sent().all_gather, kIterations * (W() - 1) * count * 4);
    EXPECT_EQ(gather[r]->bytes_sent().all_reduce, 0);
    EXPECT_EQ(reduce[r]->bytes_sent().all_reduce,
              kIterations * AllReduceBytes(r, W(), count + 1, 4));
    EXPECT_EQ(reduce[r]->bytes_sent().all_gather, 0);
  }
  DestroyCommunicators(&gather);
  DestroyCommunicators(&reduce);
}

// Large buffers: many rounds through the shared-memory slots (and long
// rings over TCP), with blocks that straddle round boundaries.
TEST_P(GlooCommunicatorTest, LargeBuffersAcrossManyRounds) {
  const int64_t count = 50001;  // per rank; not a multiple of any slot
  std::vector<ShardBlock> blocks;
  int64_t at = 0;
  for (int r = 0; r < W(); ++r) {
    // Three blocks per rank of uneven sizes, interleaved in the full buffer.
    const int64_t sizes[3] = {count / 7, count / 2, count - count / 7 - count / 2};
    for (int k = 0, shard_at = 0; k < 3; ++k) {
      blocks.push_back({r, shard_at, at, sizes[k]});
      shard_at += sizes[k];
      at += sizes[k];
    }
  }
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(7));
  const int64_t full = at;
  std::vector<std::vector<float>> gathered(W(), std::vector<float>(full));
  std::vector<std::vector<float>> reduced(W(), std::vector<float>(count));
  std::vector<std::vector<float>> all(W(), std::vector<float>(full));
  RunThreads(W(), [&](int r) {
    std::vector<float> shard(count);
    for (const ShardBlock& b : blocks) {
      if (b.rank != r) continue;
      for (int64_t i = 0; i < b.count; ++i) shard[b.shard_offset + i] = ExactValue(r, b.full_offset + i);
    }
    absl::Status s = comms_[r]->AllGatherBlocks(shard.data(), gathered[r].data(), blocks,
                                                DType::kF32, kTimeout);
    ASSERT_TRUE(s.ok()) << s;
    std::vector<float> in(full);
    for (int64_t i = 0; i < full; ++i) in[i] = ExactValue(r, i);
    s = comms_[r]->ReduceScatterBlocks(in.data(), reduced[r].data(), blocks, DType::kF32,
                                       ReduceOp::kSum, kTimeout);
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < full; ++i) all[r][i] = ExactValue(r, i);
    s = comms_[r]->AllReduce(all[r].data(), full, DType::kF32, ReduceOp::kAverage, kTimeout);
    ASSERT_TRUE(s.ok()) << s;
  });
  for (int r = 0; r < W(); ++r) {
    for (const ShardBlock& b : blocks) {
      for (int64_t i = 0; i < b.count; ++i) {
        ASSERT_EQ(gathered[r][b.full_offset + i], ExactValue(b.rank, b.full_offset + i))
            << "rank " << r << " element " << b.full_offset + i;
        if (b.rank != r) continue;
        float sum = 0;
        for (int src = 0; src < W(); ++src) sum += ExactValue(src, b.full_offset + i);
        ASSERT_EQ(reduced[r][b.shard_offset + i], sum) << "rank " << r;
      }
    }
    for (int64_t i = 0; i < full; i += 97) {
      float sum = 0;
      for (int src = 0; src < W(); ++src) sum += ExactValue(src, i);
      ASSERT_FLOAT_EQ(all[r][i], sum / W()) << "rank " << r << " element " << i;
    }
  }
}

// bf16 over many rounds, with rank 0 holding nothing (a plan can leave a
// rank without pieces of a small unit).
TEST_P(GlooCommunicatorTest, Bf16AcrossManyRoundsWithAnEmptyRank) {
  const int64_t count = 30001;
  std::vector<ShardBlock> blocks;
  int64_t at = 0;
  for (int r = 1; r < W(); ++r) {
    blocks.push_back({r, 0, at, count});
    at += count;
  }
  const int64_t full = at;
  std::vector<std::vector<float>> gathered(W(), std::vector<float>(full));
  std::vector<std::vector<float>> reduced(W(), std::vector<float>(count, -3.0f));
  RunThreads(W(), [&](int r) {
    std::vector<uint16_t> shard(count, 0);
    if (r > 0) {
      for (int64_t i = 0; i < count; ++i) shard[i] = FloatToBF16(ExactValue(r, (r - 1) * count + i));
    }
    std::vector<uint16_t> out(full, 0);
    absl::Status s = comms_[r]->AllGatherBlocks(shard.data(), out.data(), blocks, DType::kBF16,
                                                kTimeout);
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < full; ++i) gathered[r][i] = BF16ToFloat(out[i]);
    std::vector<uint16_t> in(full);
    for (int64_t i = 0; i < full; ++i) in[i] = FloatToBF16(ExactValue(r, i));
    std::vector<uint16_t> mine(count, FloatToBF16(-3.0f));
    s = comms_[r]->ReduceScatterBlocks(in.data(), mine.data(), blocks, DType::kBF16,
                                       ReduceOp::kSum, kTimeout);
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < count; ++i) reduced[r][i] = BF16ToFloat(mine[i]);
  });
  for (int r = 0; r < W(); ++r) {
    for (const ShardBlock& b : blocks) {
      for (int64_t i = 0; i < b.count; i += 7) {
        ASSERT_EQ(gathered[r][b.full_offset + i],
                  BF16ToFloat(FloatToBF16(ExactValue(b.rank, b.full_offset + i))));
        if (b.rank != r) continue;
        float sum = 0, abs_sum = 0;
        for (int src = 0; src < W(); ++src) {
          const float v = BF16ToFloat(FloatToBF16(ExactValue(src, b.full_offset + i)));
          sum += v;
          abs_sum += std::fabs(v);
        }
        // The TCP ring rounds at every hop; shared memory once.
        ASSERT_NEAR(reduced[r][i], sum, BF16Tolerance(W(), abs_sum)) << "rank " << r << " " << i;
      }
    }
  }
  // Rank 0 had nothing to receive: its (unused) output is untouched.
  EXPECT_EQ(reduced[0][0], -3.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, GlooCommunicatorTest,
    ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
      return absl::StrCat("W", std::get<0>(info.param), std::get<1>(info.param) ? "_shm" : "_tcp");
    });

TEST(GlooCommunicatorSingleRankTest, EverythingIsLocal) {
  InMemoryKvStore store;
  auto comm = GlooCommunicator::Create(&store, 0, 1, "solo");
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> in = {1, 2, 3}, out(3);
  EXPECT_TRUE((*comm)->AllGather(in.data(), out.data(), 3, DType::kF32, kTimeout).ok());
  EXPECT_EQ(out, in);
  out.assign(3, 0);
  EXPECT_TRUE(
      (*comm)
          ->ReduceScatter(in.data(), out.data(), 3, DType::kF32, ReduceOp::kAverage, kTimeout)
          .ok());
  EXPECT_EQ(out, in);
  EXPECT_TRUE((*comm)->AllReduce(in.data(), 3, DType::kF32, ReduceOp::kSum, kTimeout).ok());
  EXPECT_EQ(in, (std::vector<float>{1, 2, 3}));
  EXPECT_TRUE((*comm)->Broadcast(in.data(), 3, DType::kF32, 0, kTimeout).ok());
  EXPECT_TRUE((*comm)->Barrier(kTimeout).ok());
  EXPECT_EQ((*comm)->bytes_sent().all_gather, 0);
}

}  // namespace
}  // namespace zeroshard
