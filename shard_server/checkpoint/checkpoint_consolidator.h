// Consolidation: a complete step's shard files merged into safetensors that
// PyTorch and Hugging Face load: one "model.safetensors", or Hugging Face
// shards "model-00001-of-0000N.safetensors" plus "model.safetensors.index.json".
//
// Tensors are named as the model names them, in manifest order; with the
// optimizer state, "optim.exp_avg.<name>" and "optim.exp_avg_sq.<name>"
// follow all parameters. Parameters may be converted to BF16 or F16; the
// optimizer state stays F32 (Adam's second moment underflows in F16 and a
// resumed job needs the exact moments). A DiLoCo job's outer state follows
// as "optim.outer_anchor.<name>" and "optim.outer_momentum.<name>" (F32,
// docs/diloco.md) unless weights_only. __metadata__: format "pt", job, step,
// and "checksums" (JSON: tensor -> XXH64 hex of its bytes in this file); with
// the optimizer state also optimizer and optimizer_step, with the outer state
// outer_step.
//
// The merge is plain range copies: every piece of a tensor is a contiguous
// run of rows, read with pread into one fixed buffer, so memory stays at
// about buffer_bytes (+ half of it to convert) whatever the model size.
//
// Two passes, because safetensors puts the checksums in the header, before
// the data: pass 1 reads every piece it merges, checks each shard tensor's
// XXH64 against the manifest and computes the output checksums; pass 2 reads
// again (from the page cache, usually), checks every piece again (so a file
// changed in between is caught; the output bytes are a function of the
// verified pieces) and writes. A corrupt shard therefore fails in pass 1 with
// DATA_LOSS naming the file and the tensor, before any output byte exists.
// Pass 1 is skipped for tensors whose F32 checksums an earlier Verify()
// recorded (the server verifies every step once, in the background, right
// after it completes: CheckpointVerifier). When streaming F32, pass 2 reads
// straight into the outgoing message (ConsolidationOutput::NextBuffer)
// instead of the buffer.
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_CONSOLIDATOR_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_CONSOLIDATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/file_util.h"
#include "common/safetensors.h"
#include "shard_server/checkpoint/checkpoint_manifest.h"
#include "shard_server/checkpoint/checkpoint_paths.h"

namespace zeroshard {

inline constexpr char kConsolidatedFileName[] = "model.safetensors";
inline constexpr char kConsolidatedIndexName[] = "model.safetensors.index.json";

struct ConsolidationOptions {
  bool weights_only = false;       // leave out the optimizer state
  DType dtype = DType::kF32;       // of the parameters: F32, BF16 or F16
  int64_t max_shard_bytes = 0;     // 0: one file; else Hugging Face shards of tensor data
  int64_t buffer_bytes = 4 << 20;  // the read buffer, bytes
  // FAILED_PRECONDITION before any output when the shard files record no
  // Hugging Face config (a job of a model without one, or an older worker).
  bool require_hf_config = false;
  // Output tensor name -> XXH64 hex of its F32 bytes, from an earlier
  // Verify() of the same step: pass 1 skips these tensors when they are
  // written as F32 (pass 2 still checks every piece it copies).
  std::map<std::string, std::string> known_checksums;
};

// "" / "f32" / "bf16" / "f16" (also the safetensors names) -> DType.
// INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<DType> ParseConsolidationDType(const std::string& name);

// Where consolidated files go (an RPC stream, a directory).
class ConsolidationOutput {
 public:
  virtual ~ConsolidationOutput() = default;
  // Starts file `name` (a plain file name) of exactly `size_bytes`; its bytes
  // follow through the returned sink, valid until EndFile().
  virtual absl::StatusOr<ByteSink*> BeginFile(const std::string& name, int64_t size_bytes) = 0;
  virtual absl::Status EndFile() = 0;
  // Work done so far of the total, in bytes: pass 1's reads, then pass 2's
  // writes. Called every few tens of MiB and at the end of each pass.
  virtual absl::Status Progress(int64_t done, int64_t total) = 0;
  // Polled between buffers: true stops the consolidation with CANCELLED.
  virtual bool Cancelled() { return false; }

  // Optional in-place writing, which saves copying F32 data through the
  // sink: room for the next bytes of the current file (*size > 0 bytes at
  // the returned pointer), of which CommitBuffer(used) makes the first
  // `used` bytes part of the file. Null: not supported, use the sink.
  virtual char* NextBuffer(size_t* size) { return nullptr; }
  virtual absl::Status CommitBuffer(size_t used) { return absl::OkStatus(); }
};

struct ConsolidationResult {
  std::vector<std::string> files;  // names, in the order written (the index last)
  int64_t total_bytes = 0;         // of all files
  double verify_seconds = 0;       // pass 1
  double write_seconds = 0;        // pass 2
  double read_seconds = 0;         // of pass 2: reading and checking shard bytes
  // The model's config.json as the first shard file records it ("": none);
  // also in every output file's __metadata__ as "hf_config".
  std::string hf_config;
};

class Consolidator {
 public:
  // `manifest` is of a complete step under `root` (the caller keeps it
  // pinned against retention while Run() runs).
  Consolidator(CheckpointRoot root, const CheckpointManifest& manifest,
               ConsolidationOptions options);
  ~Consolidator();

  // INVALID_ARGUMENT for bad options; DATA_LOSS naming the shard file and
  // tensor for a missing, resized or corrupt piece; output errors as they
  // come. On error the output may hold a partial file: the output discards
  // what it got.
  absl::StatusOr<ConsolidationResult> Run(ConsolidationOutput* output);

  // Pass 1 alone, over the parameters and the optimizer state as F32
  // (whatever the options say): checks every shard tensor against the
  // manifest and returns output tensor name -> XXH64 hex of its F32 bytes,
  // what `known_checksums` takes. `output` only gets Progress/Cancelled.
  absl::StatusOr<std::map<std::string, std::string>> Verify(ConsolidationOutput* output);

 private:
  struct OutputTensor;
  struct OutputFile;
  class ShardFiles;

  absl::Status PlanOutputs();
  void GroupIntoFiles();
  void CountWork();
  // The shard file holding `piece`, once its tensor `shard_tensor` is found
  // as F32 of `bytes` (DATA_LOSS naming the file otherwise).
  absl::StatusOr<const SafetensorsReader*> OpenPiece(const ManifestPiece& piece,
                                                     const std::string& shard_tensor,
                                                     int64_t bytes);
  // The first `n` bytes of buffer_ (F32) as `dtype`: buffer_ itself, or
  // converted_ (*out_bytes: their size).
  const char* Convert(DType dtype, int64_t n, int64_t* out_bytes);
  // An output file's metadata: its tensors' checksums (placeholders while
  // pass 1 has not computed them), the job, step, optimizer and HF config.
  SafetensorsMetadata FileMetadata(const OutputFile& f, bool placeholder) const;
  absl::Status WriteOutputFile(const OutputFile& f, ConsolidationOutput* output);
  // Streams the bytes of `tensor` (converted) to `sink` (null: nowhere),
  // checking every shard tensor read; `output_hash` (if not null) gets the
  // XXH64 of the output bytes.
  absl::Status CopyTensor(const OutputTensor& tensor, ByteSink* sink, uint64_t* output_hash,
                          ConsolidationOutput* output);
  absl::Status Advance(int64_t bytes, ConsolidationOutput* output);

  const CheckpointRoot root_;
  const CheckpointManifest& manifest_;
  ConsolidationOptions options_;
  std::vector<OutputTensor> tensors_;
  std::vector<OutputFile> files_;
  std::string index_json_;  // sharded output only
  std::string hf_config_;   // from the first shard file, once Run read it
  std::string outer_step_;  // likewise (DiLoCo with outer state; "": none)
  std::unique_ptr<ShardFiles> shards_;
  std::vector<char> buffer_;     // options_.buffer_bytes: shard bytes as read
  std::vector<char> converted_;  // half of that: BF16/F16 output
  int64_t written_ = 0;          // bytes of the current output file (pass 2)
  int64_t work_done_ = 0;
  int64_t work_total_ = 0;
  int64_t last_progress_ = 0;
  absl::Duration read_time_;  // pass 2: in reads and checksums
};

// Writes consolidated files into directory `relative_dir` under the root,
// all or nothing: files go to a temporary sibling directory (each through an
// AtomicFile, so fsynced), which takes the place of `relative_dir` on
// Commit() (an atomic exchange when `relative_dir` already exists, then the
// old one is removed). Dropping an uncommitted output removes the temporary
// directory.
class DirectoryOutput : public ConsolidationOutput, private ByteSink {
 public:
  using ProgressFn = std::function<absl::Status(int64_t done, int64_t total)>;
  using CancelledFn = std::function<bool()>;

  static absl::StatusOr<std::unique_ptr<DirectoryOutput>> Create(CheckpointRoot root,
                                                                 std::string relative_dir,
                                                                 ProgressFn progress = nullptr,
                                                                 CancelledFn cancelled = nullptr);
  ~DirectoryOutput() override;

  absl::StatusOr<ByteSink*> BeginFile(const std::string& name, int64_t size_bytes) override;
  absl::Status EndFile() override;
  absl::Status Progress(int64_t done, int64_t total) override;
  bool Cancelled() override { return cancelled_ && cancelled_(); }

  // Moves the files into place. REQUIRES: every BeginFile was ended.
  absl::Status Commit();

 private:
  DirectoryOutput(CheckpointRoot root, std::string relative_dir, std::string temp_relative,
                  ProgressFn progress, CancelledFn cancelled)
      : root_(std::move(root)),
        relative_dir_(std::move(relative_dir)),
        temp_relative_(std::move(temp_relative)),
        progress_(std::move(progress)),
        cancelled_(std::move(cancelled)) {}

  const CheckpointRoot root_;
  const std::string relative_dir_;
  const std::string temp_relative_;
  ProgressFn progress_;
  CancelledFn cancelled_;
  absl::Status Write(const void* data, size_t size) override;  // into current_

  std::unique_ptr<AtomicFile> current_;  // in the temporary directory
  int64_t current_size_ = 0;             // bytes announced by BeginFile
  int64_t written_ = 0;                  // bytes written to current_
  bool committed_ = false;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_CONSOLIDATOR_H_
