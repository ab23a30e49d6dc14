// ZeroEngine's checks of its own state (engine.h, "Integrity"): the
// checksum replicas compare, and the test-only corruption that shows it.
#include <cassert>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shard_hash.h"
#include "worker/zero/engine.h"

namespace zeroshard {

absl::Status ZeroEngine::HashMasterShard(int unit, ShardHasher* hasher) {
  const TrackedBuffer& master = MasterShard(unit);
  if (backend_->host_accessible()) {
    hasher->Update(master.data(), static_cast<size_t>(master.bytes()));
    return absl::OkStatus();
  }
  // Device memory: through the host staging buffer planned at Create (the
  // step hashes every unit right after its update).
  assert(static_cast<int64_t>(hash_staging_.size()) >= master.bytes());
  if (absl::Status s = backend_->CopyToHost(hash_staging_.data(), master.data(), master.bytes());
      !s.ok()) {
    return s;
  }
  hasher->Update(hash_staging_.data(), static_cast<size_t>(master.bytes()));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ZeroEngine::MasterShardChecksum() {
  if (!stage_.state_sharded) {
    return absl::FailedPreconditionError(
        "a master shard checksum needs sharded optimizer state (stages 1-3)");
  }
  ShardHasher hasher;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (absl::Status s = HashMasterShard(static_cast<int>(u), &hasher); !s.ok()) return s;
  }
  return hasher.Digest();
}

absl::StatusOr<std::vector<float>> ZeroEngine::CopyMasterShard() {
  if (!stage_.state_sharded) {
    return absl::FailedPreconditionError("a master shard copy needs sharded optimizer state");
  }
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  std::vector<float> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const TrackedBuffer& master = MasterShard(static_cast<int>(u));
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(master.bytes()) / sizeof(float));
    if (absl::Status s = backend_->CopyToHost(out.data() + at, master.data(), master.bytes());
        !s.ok()) {
      return s;
    }
  }
  return out;
}

absl::Status ZeroEngine::CorruptMasterForTesting(int bit) {
  if (!stage_.state_sharded || units_.empty() || units_[0].own_segments.empty() ||
      !backend_->host_accessible()) {
    return absl::FailedPreconditionError(
        "--testing_corrupt needs sharded optimizer state (stages 1-3) in host memory");
  }
  // The first element of this rank's first piece: a parameter, not padding.
  const Segment& piece = units_[0].segments[units_[0].own_segments[0]];
  float* value = MasterShard(0).f32() + piece.chunk_offset;
  uint32_t bits;
  std::memcpy(&bits, value, sizeof(bits));
  // The lowest exponent bit (23): the value doubles or halves, stays finite,
  // and training goes on with it (what a flipped bit in memory looks like
  // when nothing overflows). The highest (30) of a value below 2 in
  // magnitude multiplies it by 2^128: a loss spike.
  bits ^= uint32_t{1} << bit;
  std::memcpy(value, &bits, sizeof(bits));
  MarkSecondaryStale(0);  // hpZ: the slice no longer matches
  return absl::OkStatus();
}

}  // namespace zeroshard
