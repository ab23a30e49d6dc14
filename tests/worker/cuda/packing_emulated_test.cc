// The packed layouts' kernels (worker/cuda/packing.cu: PackRuns, UnpackRuns,
// UnpackRunsRaw, UnpackRunsThrough) on the CPU under the thread-per-CUDA-
// thread emulation, against the host backend's Pack, Unpack and UnpackRaw
// (worker/zero/backend.cc, a Convert, Zero or Copy per run): bit for bit,
// f32 and bf16, layouts from the planner's kind (pieces out of flat order,
// several ranks, padding), with NaN, infinities and bf16 rounding ties in
// the data; elements in no block stay as they were.
#include <cuda_runtime.h>  // the emulation's (tests/worker/cuda/emulation)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/worker/cuda/packing.cu.inc"
#include "worker/zero/backend.h"
#include "worker/zero/packed_layout.h"

namespace zeroshard {
namespace {

// W ranks; each rank's chunk holds a shuffled run of the flat elements cut
// into pieces, then padding up to the chunk. Some flat elements are in no
// block (a hole at `hole`).
struct Case {
  int world;
  int64_t chunk;
  std::vector<ShardBlock> blocks;
  int64_t full;
};

Case MakeCase(int world, int64_t per_rank, int pieces, uint32_t seed) {
  std::mt19937 rng(seed);
  Case c{world, per_rank + 3, {}, 0};
  int64_t flat = 0;
  for (int r = 0; r < world; ++r) {
    // Cut [flat, flat + per_rank) into `pieces`, placed in the chunk in a
    // shuffled order.
    std::vector<int64_t> cuts = {0, per_rank};
    for (int k = 1; k < pieces; ++k) cuts.push_back(1 + rng() % (per_rank - 1));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<std::pair<int64_t, int64_t>> parts;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) parts.push_back({cuts[k], cuts[k + 1] - cuts[k]});
    std::shuffle(parts.begin(), parts.end(), rng);
    int64_t at = 0;
    for (auto [begin, count] : parts) {
      c.blocks.push_back(ShardBlock{r, at, flat + begin, count});
      at += count;
    }
    flat += per_rank + 1;  // one flat element in no block after each rank's
  }
  c.full = flat;
  return c;
}

std::vector<float> Data(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  if (n > 3) {
    v[0] = std::numeric_limits<float>::quiet_NaN();
    v[1] = -std::numeric_limits<float>::infinity();
    uint32_t tie = 0x3f808000u;  // 1 + 2^-8: halfway between two bf16 values
    std::memcpy(&v[2], &tie, sizeof(tie));
  }
  return v;
}

std::vector<uint8_t> Bytes(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

TEST(PackingEmulatedTest, KernelsEqualTheHostBackendBitForBit) {
  struct Shape {
    int world;
    int64_t per_rank;
    int pieces;
  };
  for (Shape shape : {Shape{1, 40, 5}, Shape{3, 37, 4}, Shape{2, 300, 12}, Shape{4, 9, 1}}) {
    Case c = MakeCase(shape.world, shape.per_rank, shape.pieces, 17 + shape.world);
    auto layout = MakePackedLayout(c.blocks, c.world, c.chunk);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const int64_t n = layout->packed_elements();
    const auto* runs = reinterpret_cast<const int64_t*>(layout->runs.data());
    const int64_t num_runs = static_cast<int64_t>(layout->runs.size());
    const std::vector<float> full = Data(c.full, 5);
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const std::string label =
          absl::StrCat("world ", c.world, " per rank ", shape.per_rank, " ", DTypeName(dtype));
      const size_t bytes = n * DTypeSize(dtype);
      std::vector<uint8_t> host(bytes, 0xab), device(bytes, 0xcd);
      CpuBackend()->Pack(*layout, full.data(), host.data(), dtype);
      ASSERT_TRUE(
          gpu::PackRuns(device.data(), dtype, full.data(), runs, num_runs, n, nullptr).ok());
      EXPECT_EQ(device, host) << label;
      // Unpack into buffers that hold a marker where no block writes.
      std::vector<float> host_full(c.full, 42.0f), device_full(c.full, 42.0f);
      CpuBackend()->Unpack(*layout, host.data(), dtype, host_full.data());
      ASSERT_TRUE(
          gpu::UnpackRuns(device_full.data(), device.data(), dtype, runs, num_runs, n, nullptr)
              .ok());
      EXPECT_EQ(Bytes(device_full.data(), c.full * 4), Bytes(host_full.data(), c.full * 4))
          << label;
      int untouched = 0;
      for (float v : device_full) untouched += v == 42.0f;
      EXPECT_EQ(untouched, c.world) << label;  // the one hole after each rank's elements
      // UnpackRaw: the packed bits as they are, into a buffer of `dtype`
      // holding 42 where no block writes; widened, what Unpack stored.
      std::vector<uint8_t> raw_host(c.full * DTypeSize(dtype));
      {
        std::vector<float> marker(c.full, 42.0f);
        CpuBackend()->Convert(marker.data(), DType::kF32, raw_host.data(), dtype, c.full);
      }
      std::vector<uint8_t> raw_device = raw_host;
      CpuBackend()->UnpackRaw(*layout, host.data(), dtype, raw_host.data());
      ASSERT_TRUE(
          gpu::UnpackRunsRaw(raw_device.data(), device.data(), dtype, runs, num_runs, n, nullptr)
              .ok());
      EXPECT_EQ(raw_device, raw_host) << label;
      std::vector<float> widened(c.full);
      CpuBackend()->Convert(raw_host.data(), dtype, widened.data(), DType::kF32, c.full);
      EXPECT_EQ(Bytes(widened.data(), c.full * 4), Bytes(host_full.data(), c.full * 4)) << label;
    }
  }
}

// UnpackRunsThrough (the group-of-one gather's one pass) stores what the
// host's two steps store: the packed f32 values converted to bf16, then
// unpacked; through f32, UnpackRuns's bits.
TEST(PackingEmulatedTest, UnpackThroughEqualsConvertThenUnpack) {
  for (int world : {1, 3}) {
    Case c = MakeCase(world, 53, 6, 29 + world);
    auto layout = MakePackedLayout(c.blocks, c.world, c.chunk);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const int64_t n = layout->packed_elements();
    const auto* runs = reinterpret_cast<const int64_t*>(layout->runs.data());
    const int64_t num_runs = static_cast<int64_t>(layout->runs.size());
    const std::vector<float> packed = Data(n, 11);  // NaN, -inf and a bf16 tie among them
    for (DType through : {DType::kF32, DType::kBF16}) {
      const std::string label = absl::StrCat("world ", world, " through ", DTypeName(through));
      std::vector<uint8_t> narrowed(n * DTypeSize(through));
      CpuBackend()->Convert(packed.data(), DType::kF32, narrowed.data(), through, n);
      std::vector<float> host_full(c.full, 42.0f), device_full(c.full, 42.0f);
      CpuBackend()->Unpack(*layout, narrowed.data(), through, host_full.data());
      ASSERT_TRUE(gpu::UnpackRunsThrough(device_full.data(), packed.data(), through, runs, num_runs,
                                         n, nullptr)
                      .ok());
      EXPECT_EQ(Bytes(device_full.data(), c.full * 4), Bytes(host_full.data(), c.full * 4))
          << label;
      int untouched = 0;
      for (float v : device_full) untouched += v == 42.0f;
      EXPECT_EQ(untouched, c.world) << label;
    }
  }
  // The host backend has no one-pass form: the engine converts, then
  // unpacks.
  std::vector<float> none(1);
  EXPECT_FALSE(CpuBackend()->UnpackThrough(PackedLayout{}, none.data(), DType::kBF16, none.data()));
}

TEST(PackingEmulatedTest, BadArgumentsAreRefused) {
  const int64_t runs[2] = {0, 0};
  float a[4] = {}, b[4] = {};
  EXPECT_FALSE(gpu::PackRuns(a, DType::kF32, b, runs, 1, -1, nullptr).ok());
  EXPECT_FALSE(gpu::PackRuns(a, DType::kF32, nullptr, runs, 1, 4, nullptr).ok());
  EXPECT_FALSE(gpu::PackRuns(a, DType::kF32, b, runs, 0, 4, nullptr).ok());
  EXPECT_FALSE(gpu::UnpackRuns(a, b, DType::kI8, runs, 1, 4, nullptr).ok());
  EXPECT_TRUE(gpu::UnpackRuns(a, b, DType::kF32, nullptr, 0, 0, nullptr).ok());  // nothing to do
  EXPECT_FALSE(gpu::UnpackRunsThrough(a, b, DType::kI8, runs, 1, 4, nullptr).ok());
  EXPECT_FALSE(gpu::UnpackRunsThrough(a, nullptr, DType::kBF16, runs, 1, 4, nullptr).ok());
}

}  // namespace
}  // namespace zeroshard
