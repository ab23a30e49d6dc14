// Admission of one rank's shard file: before CheckpointRegistry::Commit
// records a commit, the file it names must be what the checkpoint format
// (common/checkpoint_format.h) and the generation's shard plan say it is.
//
// This reads the file's header only (a stat and the safetensors header); the
// tensors' bytes are read back later, once the whole step is complete, by
// CheckpointVerifier (checkpoint_verifier.h) — "validate" is about a file
// being admitted, "verify" about a complete step's data.
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_SHARD_FILE_VALIDATOR_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_SHARD_FILE_VALIDATOR_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/checkpoint/checkpoint_manifest.h"
#include "shard_server/checkpoint/checkpoint_paths.h"

namespace zeroshard {

// The commit of `request` (rank request.member().rank() of `world_size`,
// under `plan`) for the file request.file() below `root`, when the file:
//  - exists below the root as a regular file of request.size_bytes() bytes;
//  - is a readable safetensors file whose __metadata__ names this format,
//    job, step, rank, world size and plan hash;
//  - carries the same checksums as the commit, tensor for tensor;
//  - holds exactly this rank's pieces of the plan (F32, the piece's rows),
//    optionally with their optimizer moments.
// FAILED_PRECONDITION naming the file and what differs otherwise
// (INVALID_ARGUMENT for a malformed commit: a bad or repeated checksum).
// REQUIRES: ValidateRelativePath(request.file()) is OK.
absl::StatusOr<CommittedShard> ValidateShardFile(const CheckpointRoot& root,
                                                 const v1::CommitShardRequest& request,
                                                 int world_size, const v1::ShardPlan& plan);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_SHARD_FILE_VALIDATOR_H_
