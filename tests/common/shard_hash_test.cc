// ShardHasher (common/shard_hash.h): XXH3-64 on either code path, streamed
// or not, is the reference XXH3-64 of the bytes, so replicas on CPUs with and
// without AVX2 agree.
#include "common/shard_hash.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

std::vector<unsigned char> Bytes(size_t n) {
  std::vector<unsigned char> bytes(n);
  uint32_t x = 12345;
  for (auto& b : bytes) {
    x = x * 1664525 + 1013904223;  // any fixed sequence
    b = static_cast<unsigned char>(x >> 24);
  }
  return bytes;
}

// Sizes around XXH3's internal boundaries (16, 128, 240 bytes; 1 KiB
// stripes and its 256-byte internal buffer) and a shard-sized one.
const size_t kSizes[] = {0, 1, 16, 17, 128, 129, 240, 241, 1024, 4097, 1 << 20};

TEST(ShardHashTest, StreamedInPiecesIsTheReferenceXxh3) {
  for (size_t n : kSizes) {
    const std::vector<unsigned char> bytes = Bytes(n);
    ShardHasher hasher;
    // Uneven pieces: 0, 7, 300, ... bytes.
    size_t at = 0;
    for (size_t piece = 0; at < n; piece = piece * 3 + 7) {
      const size_t take = std::min(piece, n - at);
      hasher.Update(bytes.data() + at, take);
      at += take;
    }
    EXPECT_EQ(hasher.Digest(), XXH3_64bits(bytes.data(), n)) << n << " bytes";
  }
}

TEST(ShardHashTest, BothCodePathsAgree) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no AVX2 on this CPU";
  for (size_t n : kSizes) {
    const std::vector<unsigned char> bytes = Bytes(n);
    void* base = shard_hash_internal::CreateBase();
    void* avx2 = shard_hash_internal::CreateAvx2();
    shard_hash_internal::UpdateBase(base, bytes.data(), n);
    shard_hash_internal::UpdateAvx2(avx2, bytes.data(), n);
    EXPECT_EQ(shard_hash_internal::DigestBase(base), shard_hash_internal::DigestAvx2(avx2))
        << n << " bytes";
    shard_hash_internal::FreeBase(base);
    shard_hash_internal::FreeAvx2(avx2);
  }
  EXPECT_TRUE(ShardHashUsesAvx2());
}

}  // namespace
}  // namespace zeroshard
