// A complete checkpoint step as the server records it: which model tensors
// exist (in model order), which shard file holds which rows of each, and the
// checksum of every shard tensor. Written as <job>/step-<N>/manifest.json
// once all W ranks committed, and kept in the registry, which is what
// consolidation reads.
//
//   {"format": "zeroshard-manifest-v1", "job": "j", "step": 10,
//    "world_size": 2, "generation": 1, "plan_hash": "...",
//    "created_unix_ms": ..., "optimizer": "adam", "optimizer_step": 10,
//    "optimizer_state": {"exp_avg": true, "exp_avg_sq": true},
//    "outer_state": {"anchor": true, "momentum": true},   (DiLoCo jobs only)
//    "total_bytes": n,
//    "tensors": [{"name": "0.weight", "shape": [32, 16], "dtype": "F32"}, ...],
//    "files": [{"file": "rank-0-of-2.safetensors", "rank": 0,
//               "size_bytes": n, "checksums": {"0.weight:0-16": "<xxh64>", ...}}, ...],
//    "pieces": {"0.weight": [{"file": "rank-0-of-2.safetensors",
//                             "tensor": "0.weight:0-16",
//                             "row_begin": 0, "row_end": 16}, ...], ...}}
//
// File names are relative to the step directory. The optimizer state's
// pieces are the parameter pieces with "optim.exp_avg." / "optim.exp_avg_sq."
// in front of the shard tensor name, in the same file; a DiLoCo job's outer
// state (docs/diloco.md) likewise with "optim.outer_anchor." /
// "optim.outer_momentum.". "outer_state" is absent from other jobs'
// manifests (and from those written before it existed): both false.
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_MANIFEST_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/checkpoint_format.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard {

struct ManifestTensor {
  std::string name;
  std::vector<int64_t> shape;  // empty: 0-d
  std::string dtype = "F32";   // of the shard tensors (training keeps F32)

  int64_t Rows() const;         // dim 0; 1 for 0-d
  int64_t RowElements() const;  // product of dims 1..
};

struct ManifestFile {
  std::string name;  // relative to the step directory: "rank-R-of-W.safetensors"
  int rank = 0;
  int64_t size_bytes = 0;
  std::map<std::string, std::string> checksums;  // shard tensor -> xxh64 hex
};

struct ManifestPiece {
  int file = 0;  // index into CheckpointManifest::files
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

struct CheckpointManifest {
  std::string job;
  int64_t step = 0;
  int world_size = 0;
  int64_t generation = 0;
  std::string plan_hash;
  int64_t created_unix_ms = 0;
  std::string optimizer;
  int64_t optimizer_step = 0;
  bool has_exp_avg = false;     // every piece has its optim.exp_avg.* tensor
  bool has_exp_avg_sq = false;  // every piece has its optim.exp_avg_sq.* tensor
  bool has_outer_anchor = false;    // every piece has its optim.outer_anchor.* tensor
  bool has_outer_momentum = false;  // every piece has its optim.outer_momentum.* tensor
  std::vector<ManifestTensor> tensors;             // model order
  std::vector<ManifestFile> files;                 // by rank
  std::vector<std::vector<ManifestPiece>> pieces;  // per tensor, by row_begin

  int64_t TotalBytes() const;  // sum of the files' sizes
};

// What one rank committed, as the manifest needs it.
struct CommittedShard {
  int rank = 0;
  std::string file;  // relative to the root
  int64_t size_bytes = 0;
  std::map<std::string, std::string> checksums;
  std::string optimizer;
  int64_t optimizer_step = 0;
};

// CommittedShard::checksums as the registry stores them and a shard file's
// __metadata__ "checksums" holds them: a JSON object of tensor -> xxh64 hex.
std::string ChecksumsToJson(const std::map<std::string, std::string>& checksums);
// Adds the entries of such an object to `*out`; false if `text` is anything
// else (not JSON, not an object, a value that is not a string).
bool ChecksumsFromJson(const std::string& text, std::map<std::string, std::string>* out);

// The manifest of a step from the plan of the generation that wrote it and
// one commit per rank (`commits[r].rank == r`). Tensors are in plan order:
// units by their first tensor, tensors in spec order inside a unit (spec
// order unless a unit label reappears later in the spec). INVALID_ARGUMENT if
// a plan piece has no parameter checksum in its rank's commit.
absl::StatusOr<CheckpointManifest> BuildManifest(const std::string& job, int64_t step,
                                                 int64_t generation, const v1::ShardPlan& plan,
                                                 const std::vector<CommittedShard>& commits,
                                                 int64_t created_unix_ms);

std::string ManifestToJson(const CheckpointManifest& manifest);

// Parses and validates: every file name is a plain rank file name, every
// piece names a known file whose checksums include the piece's shard
// tensors, and each tensor's pieces tile [0, rows) in order. DATA_LOSS
// naming what is wrong otherwise (the manifest is the server's own record).
absl::StatusOr<CheckpointManifest> ParseManifestJson(absl::string_view json);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_MANIFEST_H_
