// The sharded-checkpoint format, defined once: what the worker writes and
// reads back and what the server's manifest, paths and registry check.
//
//   <root>/<job>/step-<N>/rank-<R>-of-<W>.safetensors   a rank's shard file
//   <root>/<job>/step-<N>/manifest.json                 written last, by the server
//   <root>/<job>/consolidated/step-<N>/                 Consolidate(on_server)
//
// A shard file holds tensors "<name>:<a>-<b>" (rows [a, b) of model tensor
// <name>, F32) and, with the optimizer state, the same names behind
// "optim.exp_avg." / "optim.exp_avg_sq."; a DiLoCo job's (--sync=diloco,
// docs/diloco.md) also behind "optim.outer_anchor." (the parameters of the
// last outer step) and, with outer momentum, "optim.outer_momentum." (the
// outer Nesterov SGD's buffer). Its __metadata__ has the keys of
// ShardMetadataKey below; "checksums" is a JSON object mapping every tensor
// of the file to the XXH64 hex of its bytes.
#ifndef ZEROSHARD_COMMON_CHECKPOINT_FORMAT_H_
#define ZEROSHARD_COMMON_CHECKPOINT_FORMAT_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace zeroshard {

inline constexpr char kShardFormat[] = "zeroshard-shard-v1";        // metadata "format"
inline constexpr char kManifestFormat[] = "zeroshard-manifest-v1";  // manifest "format"
inline constexpr char kManifestFileName[] = "manifest.json";
inline constexpr char kExpAvgPrefix[] = "optim.exp_avg.";
inline constexpr char kExpAvgSqPrefix[] = "optim.exp_avg_sq.";
inline constexpr char kOuterAnchorPrefix[] = "optim.outer_anchor.";
inline constexpr char kOuterMomentumPrefix[] = "optim.outer_momentum.";

// __metadata__ keys of a shard file (all values are strings). A consolidated
// file uses kFormat ("pt"), kJob, kStep, kOptimizer, kOptimizerStep and
// kChecksums with the same meaning.
struct ShardMetadataKey {
  static constexpr char kFormat[] = "format";
  static constexpr char kJob[] = "job";
  static constexpr char kStep[] = "step";
  static constexpr char kRank[] = "rank";
  static constexpr char kWorldSize[] = "world_size";
  static constexpr char kGeneration[] = "generation";
  static constexpr char kPlanHash[] = "plan_hash";
  static constexpr char kOptimizer[] = "optimizer";
  static constexpr char kOptimizerStep[] = "optimizer_step";
  static constexpr char kChecksums[] = "checksums";
  // The global data row the next step starts at (written since #13; a file
  // without it was saved by a job whose world size never changed).
  static constexpr char kDataRow[] = "data_row";
  // The model's Hugging Face config.json text (GPT-2 jobs), which
  // `consolidate --format=hf` writes beside the weights.
  static constexpr char kHfConfig[] = "hf_config";
  // DiLoCo: the outer steps taken when the shard was saved (absent: not a
  // DiLoCo job's). A consolidated file with the outer state has it too.
  static constexpr char kOuterStep[] = "outer_step";
};

// "<job>/step-<N>"
std::string CheckpointStepDir(absl::string_view job, int64_t step);
// The names' inverses, for whoever lists a directory: the step of a step
// directory's name ("step-<N>", N >= 0), and the rank and world size of a
// shard file's name ("rank-<R>-of-<W>.safetensors", 0 <= R < W); false for
// any other name (a temporary file, "consolidated", a stranger's).
bool ParseCheckpointStepDirName(absl::string_view name, int64_t* step);
bool ParseCheckpointShardFileName(absl::string_view name, int* rank, int* world_size);
// "rank-<R>-of-<W>.safetensors"
std::string CheckpointShardFileName(int rank, int world_size);
// "<job>/step-<N>/rank-<R>-of-<W>.safetensors"
std::string CheckpointShardPath(absl::string_view job, int64_t step, int rank, int world_size);
// "<job>/step-<N>/manifest.json"
std::string CheckpointManifestPath(absl::string_view job, int64_t step);
// "<job>/consolidated/step-<N>"
std::string ConsolidatedDir(absl::string_view job, int64_t step);

// What a shard tensor holds.
enum class ShardTensorKind { kParams, kExpAvg, kExpAvgSq, kOuterAnchor, kOuterMomentum };

// "" for parameters, else the kind's prefix ("optim.exp_avg.", ...).
absl::string_view ShardTensorPrefix(ShardTensorKind kind);

// "<prefix><name>:<row_begin>-<row_end>".
std::string ShardTensorName(ShardTensorKind kind, absl::string_view tensor, int64_t row_begin,
                            int64_t row_end);

struct ParsedShardTensorName {
  ShardTensorKind kind = ShardTensorKind::kParams;
  std::string tensor;  // the model tensor
  int64_t row_begin = 0;
  int64_t row_end = 0;
};
// Inverse of ShardTensorName; false unless the name has exactly that form
// with 0 <= row_begin < row_end.
bool ParseShardTensorName(absl::string_view name, ParsedShardTensorName* out);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_CHECKPOINT_FORMAT_H_
