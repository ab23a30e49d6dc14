#define XXH_INLINE_ALL
#include "common/shard_hash.h"

#include <xxhash.h>

namespace zeroshard {
namespace shard_hash_internal {

void* CreateBase() {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  return state;
}
void UpdateBase(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
uint64_t DigestBase(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}
void FreeBase(void* state) { XXH3_freeState(static_cast<XXH3_state_t*>(state)); }

}  // namespace shard_hash_internal

bool ShardHashUsesAvx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

ShardHasher::ShardHasher()
    : avx2_(ShardHashUsesAvx2()),
      state_(avx2_ ? shard_hash_internal::CreateAvx2() : shard_hash_internal::CreateBase()) {}

ShardHasher::~ShardHasher() {
  if (avx2_) {
    shard_hash_internal::FreeAvx2(state_);
  } else {
    shard_hash_internal::FreeBase(state_);
  }
}

void ShardHasher::Update(const void* data, size_t size) {
  if (avx2_) {
    shard_hash_internal::UpdateAvx2(state_, data, size);
  } else {
    shard_hash_internal::UpdateBase(state_, data, size);
  }
}

uint64_t ShardHasher::Digest() const {
  return avx2_ ? shard_hash_internal::DigestAvx2(state_) : shard_hash_internal::DigestBase(state_);
}

}  // namespace zeroshard
