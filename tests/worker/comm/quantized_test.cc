// The int8 and int4 block quantizations and the quantized collectives
// (quantized.h):
// the per-element error bound holds, zeros are exact, non-finite blocks come
// back NaN, and all-gather, reduce-scatter and all-reduce over TCP (W = 3),
// shared memory (W = 3) and two levels (W = 4 on 2 hosts) equal an f64
// reference within the bound.
//
// Error model (stated in quantized.h): one quantization of a block with
// max-abs m errs by at most m / 254 per element, plus the f32 roundings of
// the ratio 127 / m, the scale and the product: 4 u m, u = 2^-24, i.e.
// m / 254 * (1 + 1016 u). A
// reduction quantizes each rank's contribution once: |error| <= sum over
// ranks r of m_r / 254 * (1 + 508 u), plus the f32 sum of W terms
// (W u * sum |x_r|), divided by W for an average (exact for W = 4, one more
// rounding, u, otherwise). Stochastic rounding errs by less than a whole
// quantum, m / 127 * (1 + 1016 u): twice the bound, and unbiased.
#include "worker/comm/quantized.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/comm/two_level_communicator.h"

namespace zeroshard {
namespace {

using comm_test::RunThreads;

constexpr absl::Duration kTimeout = absl::Seconds(20);
constexpr double kU = 1.0 / (1 << 24);
constexpr double kQuantRelSlack = 1 + 1016 * kU;

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// max|x| over the quantization block holding element i of x.
double BlockMax(const std::vector<float>& x, int64_t i) {
  const int64_t begin = i / kInt8Block * kInt8Block;
  const int64_t end = std::min<int64_t>(x.size(), begin + kInt8Block);
  double m = 0;
  for (int64_t k = begin; k < end; ++k) m = std::max(m, std::fabs(double{x[k]}));
  return m;
}

// Half quanta a rounding may err by: 1 to nearest, 2 stochastically.
double HalfQuanta(Int8Rounding rounding) { return rounding.stochastic ? 2 : 1; }

std::vector<float> RoundTrip(const std::vector<float>& x, Int8Rounding rounding = {}) {
  const int64_t n = x.size();
  std::vector<char> packed(Int8PackedBytes(n));
  QuantizeInt8(x.data(), n, packed.data(), rounding);
  std::vector<float> out(n);
  DequantizeInt8(packed.data(), n, 0, n, out.data());
  return out;
}

TEST(QuantizeInt8Test, PackedBytesAreScalesThenValuesInWords) {
  EXPECT_EQ(Int8PackedBytes(0), 0);
  EXPECT_EQ(Int8PackedBytes(1), 8);  // 4 (scale) + 1, to a word
  EXPECT_EQ(Int8PackedBytes(256), 260);
  EXPECT_EQ(Int8PackedBytes(257), 4 * 2 + 260);
}

TEST(QuantizeInt8Test, ErrorIsAtMostTheBlockMaxOver254) {
  // Blocks of very different magnitudes, and a partial last block.
  std::vector<float> x = Random(5 * 256 + 37, 1);
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
    x[i] *= std::pow(10.0f, static_cast<float>(i / 256) - 2);
  }
  const std::vector<float> y = RoundTrip(x);
  for (size_t i = 0; i < x.size(); ++i) {
    const double bound = BlockMax(x, i) / 254 * kQuantRelSlack;
    ASSERT_LE(std::fabs(double{y[i]} - x[i]), bound) << "element " << i << " x " << x[i];
  }
  // The block max itself is exact (q = ±127).
  EXPECT_EQ(RoundTrip({3.5f, -1.0f})[0], 3.5f);
}

TEST(QuantizeInt8Test, ZerosAreExact) {
  std::vector<float> x(600, 0.0f);
  x[300] = 1.0f;  // the second block is not zero; the first and third are
  const std::vector<float> y = RoundTrip(x);
  for (size_t i = 0; i < x.size(); ++i) {
    if (i / 256 != 1) {
      EXPECT_EQ(y[i], 0.0f) << i;
    }
  }
  EXPECT_EQ(y[300], 1.0f);
  EXPECT_EQ(y[301], 0.0f);  // zero in a non-zero block: q = 0
}

TEST(QuantizeInt8Test, ANonFiniteValueMakesItsWholeBlockNaNAndOnlyIt) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = Random(3 * 256, 2);
    x[256 + 5] = bad;
    const std::vector<float> y = RoundTrip(x);
    for (size_t i = 256; i < 512; ++i) EXPECT_TRUE(std::isnan(y[i])) << i;
    for (size_t i : {size_t{0}, size_t{255}, size_t{512}, size_t{767}}) {
      EXPECT_TRUE(std::isfinite(y[i])) << i;
    }
  }
}

TEST(QuantizeInt8Test, HugeAndTinyValuesKeepTheBound) {
  std::vector<float> x = {3e38f, -1e38f, 1.0f, 1e-30f, -2e-38f, 1e-39f};
  const std::vector<float> y = RoundTrip(x);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_LE(std::fabs(double{y[i]} - x[i]), 3e38 / 254 * kQuantRelSlack) << i;
  }
  std::vector<float> tiny = {1e-30f, -3e-31f, 0.0f};
  const std::vector<float> t = RoundTrip(tiny);
  for (size_t i = 0; i < tiny.size(); ++i) {
    EXPECT_LE(std::fabs(double{t[i]} - tiny[i]), 1e-30 / 254 * kQuantRelSlack) << i;
  }
}

TEST(QuantizeInt8Test, StochasticRoundingErrsLessThanOneQuantum) {
  std::vector<float> x = Random(5 * 256 + 37, 3);
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
    x[i] *= std::pow(10.0f, static_cast<float>(i / 256) - 2);
  }
  const std::vector<float> y = RoundTrip(x, {true, 7});
  int off_nearest = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double bound = BlockMax(x, i) / 127 * kQuantRelSlack;
    ASSERT_LE(std::fabs(double{y[i]} - x[i]), bound) << "element " << i << " x " << x[i];
    off_nearest += std::fabs(double{y[i]} - x[i]) > BlockMax(x, i) / 254 * kQuantRelSlack;
  }
  EXPECT_GT(off_nearest, 0) << "some values must round away from the nearest quantum";
  // Block maxima stay exact, zeros stay zero.
  EXPECT_EQ(RoundTrip({3.5f, 0.0f, -1.0f}, {true, 7})[0], 3.5f);
  EXPECT_EQ(RoundTrip({3.5f, 0.0f, -1.0f}, {true, 7})[1], 0.0f);
}

TEST(QuantizeInt8Test, TheSameSeedGivesTheSameBitsAndAnotherSeedOthers) {
  const std::vector<float> x = Random(1000, 4);
  EXPECT_EQ(RoundTrip(x, {true, 11}), RoundTrip(x, {true, 11}));
  EXPECT_NE(RoundTrip(x, {true, 11}), RoundTrip(x, {true, 12}));
}

// Why reductions round stochastically: in a block whose largest value is 1
// (quantum 1/127), a gradient of 1e-3 (0.127 quanta) rounds to 0 to
// nearest, every time; stochastically it comes back as 1/127 with
// probability 0.127 and so is 1e-3 on average. Over n = 4096 seeds the mean
// of a Bernoulli(p) times 1/127 has standard deviation
// sqrt(p (1 - p) / n) / 127 = 6.5e-5; the check allows 6 of them.
TEST(QuantizeInt8Test, StochasticRoundingKeepsValuesBelowHalfAQuantumOnAverage) {
  const std::vector<float> x = {1.0f, 1e-3f, -1e-3f, 2.5e-3f};
  EXPECT_EQ(RoundTrip(x)[1], 0.0f);
  EXPECT_EQ(RoundTrip(x)[2], 0.0f);
  constexpr int kSeeds = 4096;
  std::vector<double> mean(x.size(), 0.0);
  for (int seed = 0; seed < kSeeds; ++seed) {
    const std::vector<float> y = RoundTrip(x, {true, static_cast<uint64_t>(seed)});
    for (size_t i = 0; i < x.size(); ++i) mean[i] += double{y[i]} / kSeeds;
  }
  for (size_t i = 1; i < x.size(); ++i) {
    const double p = std::fabs(x[i]) * 127;
    const double sigma = std::sqrt(p * (1 - p) / kSeeds) / 127;
    EXPECT_NEAR(mean[i], x[i], 6 * sigma) << "element " << i;
  }
}

// ---- Int4 ----
//
// Error model (quantized.h): one int4 quantization of a block of 64 with
// max-abs m errs by at most half its quantum m / 7, m / 14, plus the f32
// roundings of the ratio 7 / m, the scale and the product (4 u m):
// m / 14 * (1 + 56 u).
constexpr double kInt4RelSlack = 1 + 56 * kU;

double Int4BlockMax(const std::vector<float>& x, int64_t i) {
  const int64_t begin = i / kInt4Block * kInt4Block;
  const int64_t end = std::min<int64_t>(x.size(), begin + kInt4Block);
  double m = 0;
  for (int64_t k = begin; k < end; ++k) m = std::max(m, std::fabs(double{x[k]}));
  return m;
}

std::vector<float> Int4RoundTrip(const std::vector<float>& x) {
  const int64_t n = x.size();
  std::vector<char> packed(Int4PackedBytes(n));
  QuantizeInt4(x.data(), n, packed.data());
  std::vector<float> out(n);
  DequantizeInt4(packed.data(), n, 0, n, out.data());
  return out;
}

TEST(QuantizeInt4Test, PackedBytesAreScalesThenNibblesInWords) {
  EXPECT_EQ(Int4PackedBytes(0), 0);
  EXPECT_EQ(Int4PackedBytes(1), 8);     // 4 (scale) + 1 byte, to a word
  EXPECT_EQ(Int4PackedBytes(3), 8);     // 4 + 2
  EXPECT_EQ(Int4PackedBytes(64), 36);   // 4 + 32: 9/64 of f32's 256
  EXPECT_EQ(Int4PackedBytes(65), 44);   // 8 + 33, to a word
  EXPECT_EQ(Int4PackedBytes(128), 72);  // 8 + 64
}

// Five values of a block whose max is 7: scale 1, q = x. Element 2i is byte
// i's low nibble, 2i + 1 its high one, two's complement; the odd n's last
// high nibble and the word's padding are 0.
TEST(QuantizeInt4Test, OddCountsPackTwoNibblesAByteAndZeroTheRest) {
  const std::vector<float> x = {7.0f, -7.0f, 3.0f, 0.0f, -1.0f};
  std::vector<unsigned char> packed(Int4PackedBytes(5), 0xAB);
  ASSERT_EQ(packed.size(), 8u);
  QuantizeInt4(x.data(), 5, packed.data());
  float scale = 0;
  std::memcpy(&scale, packed.data(), 4);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(packed[4], 0x97);  // 7, then -7 = 0b1001
  EXPECT_EQ(packed[5], 0x03);  // 3, then 0
  EXPECT_EQ(packed[6], 0x0F);  // -1 = 0b1111, then the odd tail's 0
  EXPECT_EQ(packed[7], 0x00);  // padding
  EXPECT_EQ(Int4RoundTrip(x), x);
}

TEST(QuantizeInt4Test, ErrorIsAtMostTheBlockMaxOver14) {
  // Blocks of very different magnitudes, a block of zeros, and odd tails:
  // whole blocks, a partial one, one element.
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{65}, int64_t{7 * 64 + 37}}) {
    std::vector<float> x = Random(n, 1 + n);
    for (int64_t i = 0; i < n; ++i) x[i] *= std::pow(10.0f, static_cast<float>(i / 64 % 5) - 2);
    if (n > 3 * 64) std::fill(x.begin() + 2 * 64, x.begin() + 3 * 64, 0.0f);
    const std::vector<float> y = Int4RoundTrip(x);
    for (int64_t i = 0; i < n; ++i) {
      const double bound = Int4BlockMax(x, i) / 14 * kInt4RelSlack;
      ASSERT_LE(std::fabs(double{y[i]} - x[i]), bound) << "n " << n << " element " << i;
      if (x[i] == 0) {
        ASSERT_EQ(y[i], 0.0f) << "zeros are exact: n " << n << " element " << i;
      }
    }
  }
  // The block max itself is exact (q = ±7).
  EXPECT_EQ(Int4RoundTrip({3.5f, -1.0f})[0], 3.5f);
}

TEST(QuantizeInt4Test, ARangeDequantizesAsTheWholeAndAddsOntoAnAccumulator) {
  const int64_t n = 3 * 64 + 11;
  const std::vector<float> x = Random(n, 5);
  std::vector<char> packed(Int4PackedBytes(n));
  QuantizeInt4(x.data(), n, packed.data());
  std::vector<float> whole(n);
  DequantizeInt4(packed.data(), n, 0, n, whole.data());
  // From an odd element across a block boundary to the tail.
  const int64_t begin = 61, count = n - 61;
  std::vector<float> part(count), acc(count, 0.25f);
  DequantizeInt4(packed.data(), n, begin, count, part.data());
  AddDequantizedInt4(packed.data(), n, begin, count, acc.data());
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_EQ(part[i], whole[begin + i]) << i;
    ASSERT_EQ(acc[i], 0.25f + whole[begin + i]) << i;  // one f32 sum, the same as here
  }
}

TEST(QuantizeInt4Test, ANonFiniteValueMakesItsWholeBlockNaNAndOnlyIt) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = Random(3 * 64 + 5, 2);
    x[64 + 5] = bad;
    const std::vector<float> y = Int4RoundTrip(x);
    for (size_t i = 64; i < 128; ++i) EXPECT_TRUE(std::isnan(y[i])) << i;
    for (size_t i : {size_t{0}, size_t{63}, size_t{128}, size_t{3 * 64 + 4}}) {
      EXPECT_TRUE(std::isfinite(y[i])) << i;
    }
  }
}

TEST(QuantizeInt4Test, HugeAndTinyValuesKeepTheBound) {
  // 3e38: the scale is finite; 1e-39: 7 / m overflows f32 (the double path).
  for (const std::vector<float>& x :
       {std::vector<float>{3e38f, -1e38f, 1.0f, -2e-38f}, std::vector<float>{1e-39f, -3e-40f, 0.0f},
        std::vector<float>{1e-30f, -3e-31f, 0.0f}}) {
    const std::vector<float> y = Int4RoundTrip(x);
    for (size_t i = 0; i < x.size(); ++i) {
      // Subnormal scales and products round to the subnormal spacing 2^-149
      // (absolute error 2^-150, not relative): the scale's, times |q| <= 7,
      // and the product's, 8 * 2^-150 = 2^-147 on top of the relative bound.
      const double bound = Int4BlockMax(x, i) / 14 * kInt4RelSlack + std::ldexp(1.0, -147);
      EXPECT_LE(std::fabs(double{y[i]} - x[i]), bound) << i << " of a block with max " << x[0];
    }
  }
}

// ---- Collectives ----

enum class Transport { kTcp, kShm, kTwoLevel };

std::vector<std::unique_ptr<Communicator>> Connect(Transport transport, int w,
                                                   KeyValueStore* store) {
  std::vector<std::unique_ptr<Communicator>> comms(w);
  if (transport != Transport::kTwoLevel) {
    auto host = comm_test::CreateCommunicators(store, w, "q", transport == Transport::kShm);
    for (int r = 0; r < w; ++r) comms[r] = std::move(host[r]);
    return comms;
  }
  RunThreads(w, [&](int rank) {
    TwoLevelCommunicator::Options options;
    options.host.hostname = "127.0.0.1";
    options.host.connect_timeout = absl::Seconds(10);
    options.host.shm_slot_bytes = 4096 * w;
    options.host_key = rank % 2 == 0 ? "hostA" : "hostB";
    std::string why_not;
    auto comm = TwoLevelCommunicator::Create(store, rank, w, "q", options, &why_not);
    ASSERT_TRUE(comm.ok()) << comm.status();
    ASSERT_NE(*comm, nullptr) << why_not;
    comms[rank] = *std::move(comm);
  });
  return comms;
}

class QuantizedCollectiveTest : public ::testing::TestWithParam<std::pair<Transport, int>> {
 protected:
  void SetUp() override {
    w_ = GetParam().second;
    comms_ = Connect(GetParam().first, w_, &store_);
    ASSERT_EQ(static_cast<int>(comms_.size()), w_);
    for (const auto& c : comms_) ASSERT_NE(c, nullptr);
  }
  void TearDown() override {
    RunThreads(w_, [this](int r) { comms_[r].reset(); });
  }
  // An uneven layout over 3 blocks per rank crossing quantization blocks:
  // rank r holds counts 300 + 7r, 5 and 260 - r (at most 583 elements),
  // in a different rank order each round in the full buffer.
  std::vector<ShardBlock> Layout(int64_t* full_elements) const {
    std::vector<ShardBlock> blocks;
    int64_t full = 0;
    std::vector<int64_t> at(w_, 0);
    for (int round = 0; round < 3; ++round) {
      for (int k = 0; k < w_; ++k) {
        const int r = round == 0 ? k : round == 1 ? w_ - 1 - k : (k + 1) % w_;
        const int64_t count = round == 0 ? 300 + 7 * r : round == 1 ? 5 : 260 - r;
        blocks.push_back({r, at[r], full, count});
        at[r] += count;
        full += count;
      }
    }
    *full_elements = full;
    return blocks;
  }

  // The collectives against an f64 reference, with this rounding.
  void ExpectReduceScatterWithinTheBound(Int8Rounding rounding);
  void ExpectAllReduceWithinTheBound(Int8Rounding rounding);

  int w_ = 0;
  InMemoryKvStore store_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

TEST_P(QuantizedCollectiveTest, AllGatherIsEachShardQuantizedOnce) {
  int64_t full = 0;
  const std::vector<ShardBlock> blocks = Layout(&full);
  const int64_t shard_elements = 600;  // >= every rank's extent
  std::vector<std::vector<float>> shards(w_), out(w_, std::vector<float>(full, -1.0f));
  for (int r = 0; r < w_; ++r) shards[r] = Random(shard_elements, 10 + r, 1.0f + r);
  RunThreads(w_, [&](int r) {
    ASSERT_TRUE(
        QuantizedAllGatherBlocks(comms_[r].get(), shards[r].data(), out[r].data(), blocks, kTimeout)
            .ok());
  });
  for (const ShardBlock& b : blocks) {
    for (int64_t i = 0; i < b.count; ++i) {
      const double want = shards[b.rank][b.shard_offset + i];
      const double bound = BlockMax(shards[b.rank], b.shard_offset + i) / 254 * kQuantRelSlack;
      for (int r = 0; r < w_; ++r) {
        const float got = out[r][b.full_offset + i];
        ASSERT_LE(std::fabs(got - want), bound) << "rank " << r << " block of " << b.rank;
        ASSERT_EQ(got, out[0][b.full_offset + i]) << "every rank sees the same values";
      }
    }
  }
}

TEST_P(QuantizedCollectiveTest, ReduceScatterAveragesWithinOneQuantizationPerRank) {
  for (Int8Rounding rounding : {Int8Rounding{}, Int8Rounding{true, 5}}) {
    SCOPED_TRACE(rounding.stochastic ? "stochastic" : "nearest");
    ExpectReduceScatterWithinTheBound(rounding);
  }
}

void QuantizedCollectiveTest::ExpectReduceScatterWithinTheBound(Int8Rounding rounding) {
  int64_t full = 0;
  const std::vector<ShardBlock> blocks = Layout(&full);
  std::vector<std::vector<float>> in(w_), shard(w_, std::vector<float>(600, 7.0f));
  for (int r = 0; r < w_; ++r) in[r] = Random(full, 20 + r, 1.0f + r);
  RunThreads(w_, [&](int r) {
    ASSERT_TRUE(QuantizedReduceScatterBlocks(comms_[r].get(), in[r].data(), shard[r].data(), blocks,
                                             ReduceOp::kAverage, kTimeout, rounding)
                    .ok());
  });
  std::vector<bool> written(600);
  for (const ShardBlock& b : blocks) {
    for (int64_t i = 0; i < b.count; ++i) {
      double sum = 0, bound = 0, abs_sum = 0;
      for (int r = 0; r < w_; ++r) {
        const double x = in[r][b.full_offset + i];
        sum += x;
        abs_sum += std::fabs(x);
        // The contribution was quantized in r's packing for b.rank: its
        // quantization block is that of b.rank's shard, which holds this
        // rank's elements of every block of b.rank; bound by the max over
        // every block of the layout owned by b.rank.
        double m = 0;
        for (const ShardBlock& o : blocks) {
          if (o.rank != b.rank) continue;
          const int64_t lo =
              std::max(o.shard_offset, (b.shard_offset + i) / kInt8Block * kInt8Block);
          const int64_t hi = std::min(o.shard_offset + o.count,
                                      (b.shard_offset + i) / kInt8Block * kInt8Block + kInt8Block);
          for (int64_t k = lo; k < hi; ++k) {
            m = std::max(m, std::fabs(double{in[r][o.full_offset + k - o.shard_offset]}));
          }
        }
        bound += m / 254 * HalfQuanta(rounding) * kQuantRelSlack;
      }
      bound = (bound + w_ * kU * abs_sum) / w_ * (1 + kU);
      const float got = shard[b.rank][b.shard_offset + i];
      ASSERT_LE(std::fabs(got - sum / w_), bound) << "rank " << b.rank << " at " << i;
    }
  }
  // Elements of no block are left alone.
  for (int r = 0; r < w_; ++r) EXPECT_EQ(shard[r][599], 7.0f);
}

TEST_P(QuantizedCollectiveTest, AllReduceLeavesEveryRankTheSameBitsWithinTheBound) {
  for (Int8Rounding rounding : {Int8Rounding{}, Int8Rounding{true, 5}}) {
    SCOPED_TRACE(rounding.stochastic ? "stochastic" : "nearest");
    ExpectAllReduceWithinTheBound(rounding);
  }
}

void QuantizedCollectiveTest::ExpectAllReduceWithinTheBound(Int8Rounding rounding) {
  const int64_t n = 1000;
  std::vector<std::vector<float>> buf(w_);
  for (int r = 0; r < w_; ++r) buf[r] = Random(n, 30 + r, 1.0f + r);
  const std::vector<std::vector<float>> in = buf;
  RunThreads(w_, [&](int r) {
    ASSERT_TRUE(
        QuantizedAllReduce(comms_[r].get(), buf[r].data(), n, ReduceOp::kSum, kTimeout, rounding)
            .ok());
  });
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0, bound = 0, abs_sum = 0;
    for (int r = 0; r < w_; ++r) {
      sum += in[r][i];
      abs_sum += std::fabs(in[r][i]);
      bound += BlockMax(in[r], i) / 254 * HalfQuanta(rounding) * kQuantRelSlack;
    }
    bound += w_ * kU * abs_sum;
    for (int r = 0; r < w_; ++r) {
      ASSERT_EQ(buf[r][i], buf[0][i]) << "replicas must stay equal";
    }
    ASSERT_LE(std::fabs(buf[0][i] - sum), bound) << i;
  }
}

// int4's all-reduce: every rank ends with the same bits, and they are
// exactly the f32 sum, in rank order, of each rank's dequantized buffer
// (the one quantization each buffer gets), divided by W for an average:
// no tolerance, the same operations in the same order. An odd count with a
// partial last block.
TEST_P(QuantizedCollectiveTest, Int4AllReduceIsTheRankOrderSumOfTheDequantizedBuffers) {
  const int64_t n = 1001;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    std::vector<std::vector<float>> buf(w_);
    for (int r = 0; r < w_; ++r) buf[r] = Random(n, 40 + r, 1.0f + r);
    std::vector<float> want(n, 0.0f);
    for (int r = 0; r < w_; ++r) {
      const std::vector<float> wire = Int4RoundTrip(buf[r]);
      for (int64_t i = 0; i < n; ++i) want[i] = r == 0 ? wire[i] : want[i] + wire[i];
    }
    if (op == ReduceOp::kAverage) {
      for (float& v : want) v /= static_cast<float>(w_);
    }
    RunThreads(w_, [&](int r) {
      ASSERT_TRUE(QuantizedAllReduceInt4(comms_[r].get(), buf[r].data(), n, op, kTimeout).ok());
    });
    for (int r = 0; r < w_; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(buf[r][i], want[i]) << "rank " << r << " element " << i;
      }
    }
  }
}

std::string TransportName(const ::testing::TestParamInfo<std::pair<Transport, int>>& info) {
  static const char* const kNames[] = {"Tcp", "Shm", "TwoLevel"};
  return kNames[static_cast<int>(info.param.first)] + std::to_string(info.param.second);
}

INSTANTIATE_TEST_SUITE_P(Transports, QuantizedCollectiveTest,
                         ::testing::Values(std::make_pair(Transport::kTcp, 3),
                                           std::make_pair(Transport::kShm, 3),
                                           std::make_pair(Transport::kTwoLevel, 4)),
                         TransportName);

}  // namespace
}  // namespace zeroshard
