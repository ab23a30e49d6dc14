// A 64-bit hash of bytes compared inside one job: HSDP replicas' master
// shards (--replica_check_every, docs/numerics.md). XXH3-64, with the AVX2
// code path where the CPU has it (chosen once, at run time; the digest is
// the same on every path, so ranks on different CPUs agree). About 4x
// XXH64's speed on data in the cache (47 against 10.7 GB/s on this VM's
// EPYC), and the check hashes every rank's shard in the step.
//
// Not the checkpoint checksum: files and other tools verify XXH64
// (common/checksum.h).
#ifndef ZEROSHARD_COMMON_SHARD_HASH_H_
#define ZEROSHARD_COMMON_SHARD_HASH_H_

#include <cstddef>
#include <cstdint>

namespace zeroshard {

// Streaming: Update() over consecutive pieces gives the digest of their
// concatenation. Not thread-safe.
class ShardHasher {
 public:
  ShardHasher();
  ~ShardHasher();
  ShardHasher(const ShardHasher&) = delete;
  ShardHasher& operator=(const ShardHasher&) = delete;

  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  bool avx2_;
  void* state_;  // XXH3_state_t of the chosen path; owned
};

// Whether ShardHasher runs the AVX2 path on this CPU.
bool ShardHashUsesAvx2();

namespace shard_hash_internal {
// One code path of XXH3-64's streaming API (shard_hash.cc: the baseline
// build; shard_hash_avx2.cc: compiled with -mavx2, called only when the CPU
// has AVX2).
void* CreateBase();
void UpdateBase(void* state, const void* data, size_t size);
uint64_t DigestBase(const void* state);
void FreeBase(void* state);
void* CreateAvx2();
void UpdateAvx2(void* state, const void* data, size_t size);
uint64_t DigestAvx2(const void* state);
void FreeAvx2(void* state);
}  // namespace shard_hash_internal

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_SHARD_HASH_H_
