// XXH3-64's streaming API compiled with -mavx2 (common/BUILD). Everything
// xxhash defines here is static (XXH_INLINE_ALL), so no AVX2 code can be
// merged into a function the baseline path calls.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/shard_hash.h"

namespace zeroshard::shard_hash_internal {

void* CreateAvx2() {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  return state;
}
void UpdateAvx2(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
uint64_t DigestAvx2(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}
void FreeAvx2(void* state) { XXH3_freeState(static_cast<XXH3_state_t*>(state)); }

}  // namespace zeroshard::shard_hash_internal
