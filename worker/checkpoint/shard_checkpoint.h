// Sharded checkpoints from the worker's side: this rank's pieces copied out
// of the engine (the only pause training takes), written as one safetensors
// file with a checksum per tensor, and read back at any world size.
//
// The file layout, tensor names and metadata keys are those of
// common/checkpoint_format.h, which the server checks them against.
#ifndef ZEROSHARD_WORKER_CHECKPOINT_SHARD_CHECKPOINT_H_
#define ZEROSHARD_WORKER_CHECKPOINT_SHARD_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "common/checkpoint_format.h"
#include "common/safetensors.h"
#include "worker/zero/engine.h"

namespace zeroshard {

struct ShardIdentity {
  std::string job;
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
  int64_t generation = 0;
  std::string plan_hash;
  int64_t data_row = -1;  // the data cursor after `step` (-1: not recorded)
  std::string hf_config;  // the model's config.json ("": none)
  // DiLoCo: the outer steps taken (-1: not a DiLoCo job). SnapshotShard and
  // ViewShard set it from the engine.
  int64_t outer_step = -1;
};

// This rank's state, copied to host buffers: what the writer thread writes.
struct ShardSnapshot {
  ShardIdentity id;
  std::vector<TensorEntry> entries;
  std::vector<std::vector<float>> values;  // per entry
  std::string optimizer;
  int64_t optimizer_step = 0;
  int64_t bytes = 0;  // data bytes
};

// Copies this rank's pieces (and, if `with_optimizer`, the moments the
// optimizer has and a DiLoCo engine's outer anchor and momentum). Runs on
// the training thread: this is the pause.
// `with_replica_peer`: also the next replica's run of the same shard
// (ZeroEngine::ForEachOwnPiece), for in-memory snapshots in HSDP; never for
// checkpoints, where every element is saved once.
absl::StatusOr<ShardSnapshot> SnapshotShard(ZeroEngine& engine, const ShardIdentity& id,
                                            const std::string& optimizer_name, bool with_optimizer,
                                            bool with_replica_peer = false);

// This rank's state as pointers to f32 values, in file order (every
// parameter piece, then the moments and outer state): what
// SerializeShardInto copies from.
struct ShardView {
  ShardIdentity id;
  std::vector<TensorEntry> entries;
  std::vector<const float*> values;  // per entry; not owned
  std::vector<int64_t> elements;     // per entry
  std::string optimizer;
  int64_t optimizer_step = 0;
  int64_t bytes = 0;  // data bytes
  // The values' owner when they are copies (a ShardSnapshot); null when they
  // are the engine's own memory.
  std::shared_ptr<const ShardSnapshot> owner;
};

// The engine's own master values and moments, without a copy. REQUIRES: the
// engine's state lives in host memory (the CPU backend). The pointers stay
// valid and their values unchanged until the engine's next optimizer step
// (ZeroEngine::Step) or Initialize*, which the caller must hold back until
// the last read.
absl::StatusOr<ShardView> ViewShard(ZeroEngine& engine, const ShardIdentity& id,
                                    const std::string& optimizer_name, bool with_optimizer,
                                    bool with_replica_peer = false);
// A view of a snapshot's copies (any backend); keeps `snapshot` alive.
ShardView ViewOf(std::shared_ptr<const ShardSnapshot> snapshot);

// The bytes SerializeShard would make, built in `*out` with one copy of the
// values (each tensor's XXH64 taken as it is copied). `*out`'s buffer is
// reused: no allocation, and no page touched twice, once it has held a shard
// of this size. A value that is NaN or ±Inf (found on the bytes the checksum
// reads) makes it return NonFiniteTensorError (common/finite_scan.h) naming
// the first one; `*out` then holds the complete serialization all the same,
// so that a snapshot's buddy exchange can still run.
absl::Status SerializeShardInto(const ShardView& view, std::string* out);

// The bytes WriteShard would write (checksums included), in memory: an
// in-memory snapshot (worker/recovery). The tensor -> xxh64 hex map in
// *checksums if not null. NonFiniteTensorError for a NaN or ±Inf value.
absl::StatusOr<std::string> SerializeShard(const ShardSnapshot& snapshot,
                                           std::map<std::string, std::string>* checksums = nullptr);

struct WrittenShard {
  std::string relative_path;  // CheckpointShardPath(...)
  std::string path;           // full path
  int64_t size_bytes = 0;
  std::map<std::string, std::string> checksums;  // tensor -> xxh64 hex
};

// Writes the snapshot under `root` (temporary name, fsync, rename, directory
// fsync). Nothing appears at the final name unless every byte is durable.
// A shard holding a NaN or ±Inf value is refused before anything is written
// (NonFiniteTensorError, common/finite_scan.h).
absl::StatusOr<WrittenShard> WriteShard(const ShardSnapshot& snapshot, const std::string& root);
// Writes the view's values where WriteShard would, as durably, straight
// from the memory it points to (the engine's own, for a checkpoint taken
// without a pause: worker/checkpointer.h): each slice is checksummed,
// scanned for NaN/Inf and handed to write(2), and `copied` is notified once
// the kernel holds every value (before the fsync), after which the memory
// may change. NonFiniteTensorError, and no file, for a NaN or ±Inf value.
absl::StatusOr<WrittenShard> WriteShardFromView(const ShardView& view, const std::string& root,
                                                absl::Notification* copied);

// Reads parameters, moments and DiLoCo's outer state by model tensor rows
// from either a step's shard files (<root>/<job>/step-<N>/, any world size)
// or one consolidated safetensors file ("<name>", "optim.exp_avg.<name>",
// "optim.outer_anchor.<name>", ...). Files are opened
// lazily: a rank asking only for its own rows at the saving world size opens
// only its own shard file.
class CheckpointReader {
 public:
  using Kind = ShardTensorKind;
  // `own_file`: the shard file to index first (a rank resuming at the same
  // world size); the others are indexed only if a row is not found in it.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStep(
      const std::string& step_dir, const std::string& own_file = "");
  // One consolidated safetensors file, or a Hugging Face model directory
  // (model.safetensors, or the shards model.safetensors.index.json maps
  // tensors to; GPT-2 names with or without "transformer."). NOT_FOUND for a
  // directory with neither.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenFile(const std::string& path);
  // A step's shard files held in memory (in-memory snapshots), as OpenStep
  // reads them from a directory: `files` are (name, bytes), the first
  // indexed first; the bytes must outlive the reader. `source` names them in
  // messages. `verified`: every tensor's XXH64 was checked already (a
  // snapshot blob on receipt, or as it was made), so reads skip the check.
  struct MemoryFile {
    std::string name;
    absl::string_view bytes;
  };
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenMemory(const std::string& source,
                                                                      std::vector<MemoryFile> files,
                                                                      bool verified);

  // Rows [row_begin, row_end) of `tensor` as f32; NOT_FOUND naming the tensor
  // and the checkpoint when a row is missing. Every file tensor read from is
  // first checked, whole and once, against the XXH64 its file's "checksums"
  // metadata records (shard files and consolidated files have them; a file
  // without, e.g. one written by PyTorch, is taken as it is): DATA_LOSS
  // naming the file and tensor on a mismatch, so a damaged checkpoint is
  // never loaded.
  absl::Status ReadRows(Kind kind, const TensorSpec& tensor, int64_t row_begin, int64_t row_end,
                        float* out);
  // Adam's moments or SGD's momentum (optim.exp_avg.*).
  bool has_optimizer_state() const { return has_optimizer_; }
  // DiLoCo's outer state (as the first file indexed has it): the anchor, the
  // outer momentum, and the outer steps taken (-1: not recorded).
  bool has_outer_anchor() const { return has_outer_anchor_; }
  bool has_outer_momentum() const { return has_outer_momentum_; }
  int64_t outer_step() const { return outer_step_; }
  // The optimizer's step count and the training step saved (-1 if unknown).
  int64_t optimizer_step() const { return optimizer_step_; }
  int64_t step() const { return step_; }
  // The data cursor recorded with the step (-1: not recorded).
  int64_t data_row() const { return data_row_; }
  const std::string& source() const { return source_; }

 private:
  struct Piece {
    int file = 0;
    std::string shard_tensor;
    int64_t row_begin = 0, row_end = 0;
  };
  absl::StatusOr<SafetensorsReader*> File(int index);
  absl::Status IndexFile(int index);
  absl::Status IndexAll();
  absl::Status ReadConsolidatedRows(Kind kind, const TensorSpec& tensor, int64_t row_begin,
                                    int64_t row_end, float* out);
  absl::Status Verify(int index, const std::string& tensor);

  std::string source_;
  std::vector<std::string> paths_;
  std::vector<absl::string_view> buffers_;                   // OpenMemory: each file's bytes
  bool checksums_verified_ = false;                          // OpenMemory(verified = true)
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;  // lazily opened
  std::vector<bool> indexed_;
  // (kind, model tensor) -> pieces, by row_begin
  std::map<std::pair<int, std::string>, std::vector<Piece>> pieces_;
  std::set<std::pair<int, std::string>> verified_;  // (file, tensor) checked
  bool consolidated_ = false;
  // Consolidated sets of several files (a Hugging Face index): tensor ->
  // index into paths_. Empty: every tensor is in paths_[0].
  std::map<std::string, int> file_of_;
  // The tensors seen (IndexFile, OpenFile): a kind's prefix, or a shard
  // tensor's parsed kind.
  void NoteKind(ShardTensorKind kind);
  // A file's __metadata__ numbers: optimizer_step, step, data_row, outer_step.
  void ReadPosition(const SafetensorsMetadata& meta);
  bool has_optimizer_ = false;
  bool has_outer_anchor_ = false;
  bool has_outer_momentum_ = false;
  int64_t outer_step_ = -1;
  int64_t optimizer_step_ = -1;
  int64_t step_ = -1;
  int64_t data_row_ = -1;
};

// The highest step under <root>/<job>/ that has a manifest.json (-1: none).
int64_t LatestCompleteStep(const std::string& root, const std::string& job);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CHECKPOINT_SHARD_CHECKPOINT_H_
