#include "shard_server/checkpoint/checkpoint_consolidator.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

// Checksums are 16 hex digits whatever their value, so a header built with
// this placeholder has the final header's size.
constexpr char kPlaceholderChecksum[] = "0000000000000000";
// Progress is reported after at least this much work, bytes.
constexpr int64_t kProgressEvery = int64_t{32} << 20;

}  // namespace

absl::StatusOr<DType> ParseConsolidationDType(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower.empty() || lower == "f32" || lower == "float32") return DType::kF32;
  if (lower == "bf16" || lower == "bfloat16") return DType::kBF16;
  if (lower == "f16" || lower == "float16") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not an output dtype; expected f32, bf16 or f16"));
}

// ---------------------------------------------------------------------------
// Consolidator

struct Consolidator::OutputTensor {
  std::string name;  // in the output
  ShardTensorKind kind = ShardTensorKind::kParams;
  int model_tensor = 0;  // index into manifest_.tensors
  DType dtype = DType::kF32;
  int64_t shard_bytes = 0;      // F32 bytes read from the shards
  int64_t output_bytes = 0;     // bytes in the output
  uint64_t checksum = 0;        // of the output bytes, from pass 1
  bool checksum_known = false;  // from options_.known_checksums: no pass 1
};

struct Consolidator::OutputFile {
  std::string name;
  std::vector<int> tensors;  // indices into tensors_
  std::vector<TensorEntry> entries;
  int64_t data_bytes = 0;
  int64_t size_bytes = 0;  // header + data
  int64_t header_bytes = 0;
};

// The step's shard files, opened on demand and checked against the
// manifest; at most kMaxOpen stay open (least recently used closed first),
// so a step of thousands of ranks does not run out of file descriptors.
class Consolidator::ShardFiles {
 public:
  ShardFiles(const CheckpointRoot& root, const CheckpointManifest& manifest)
      : root_(root), manifest_(manifest) {}

  std::string RelativePath(int file) const {
    return absl::StrCat(CheckpointStepDir(manifest_.job, manifest_.step), "/",
                        manifest_.files[file].name);
  }

  absl::StatusOr<const SafetensorsReader*> Get(int file) {
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->first == file) {
        open_.splice(open_.begin(), open_, it);
        return open_.front().second.get();
      }
    }
    const std::string relative = RelativePath(file);
    absl::Status inside = root_.CheckInside(relative);
    if (absl::IsNotFound(inside)) {
      return absl::DataLossError(absl::StrCat("shard file ", relative, " of complete step ",
                                              manifest_.step, " is missing"));
    }
    if (!inside.ok()) return inside;
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
        SafetensorsReader::Open(root_.Join(relative));
    if (!reader.ok()) {
      return absl::DataLossError(
          absl::StrCat("shard file ", relative, " cannot be read: ", reader.status().message()));
    }
    if ((*reader)->file_size() != manifest_.files[file].size_bytes) {
      return absl::DataLossError(absl::StrCat("shard file ", relative, " is ",
                                              (*reader)->file_size(), " bytes; the manifest says ",
                                              manifest_.files[file].size_bytes));
    }
    if (open_.size() >= kMaxOpen) open_.pop_back();
    open_.emplace_front(file, *std::move(reader));
    return open_.front().second.get();
  }

 private:
  static constexpr size_t kMaxOpen = 64;
  const CheckpointRoot& root_;
  const CheckpointManifest& manifest_;
  std::list<std::pair<int, std::unique_ptr<SafetensorsReader>>> open_;  // most recent first
};

Consolidator::Consolidator(CheckpointRoot root, const CheckpointManifest& manifest,
                           ConsolidationOptions options)
    : root_(std::move(root)), manifest_(manifest), options_(options) {}

Consolidator::~Consolidator() = default;

absl::Status Consolidator::PlanOutputs() {
  if (options_.dtype != DType::kF32 && options_.dtype != DType::kBF16 &&
      options_.dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("output dtype ", DTypeName(options_.dtype),
                                                   " is not supported; expected F32, BF16, F16"));
  }
  if (options_.max_shard_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_shard_bytes ", options_.max_shard_bytes,
                                                   " is negative; 0 writes one file"));
  }
  if (options_.buffer_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer_bytes ", options_.buffer_bytes, " is below 4096"));
  }
  for (const ManifestTensor& t : manifest_.tensors) {
    if (t.dtype != "F32") {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor \"", t.name, "\" is saved as ", t.dtype, "; consolidation reads F32 shards"));
    }
  }
  const bool optimizer = !options_.weights_only && manifest_.has_exp_avg;
  std::vector<std::pair<ShardTensorKind, DType>> kinds = {
      {ShardTensorKind::kParams, options_.dtype}};
  if (optimizer) kinds.push_back({ShardTensorKind::kExpAvg, DType::kF32});
  if (optimizer && manifest_.has_exp_avg_sq) {
    kinds.push_back({ShardTensorKind::kExpAvgSq, DType::kF32});
  }
  // DiLoCo's outer state is optimizer state too: F32, after the moments.
  if (!options_.weights_only && manifest_.has_outer_anchor) {
    kinds.push_back({ShardTensorKind::kOuterAnchor, DType::kF32});
  }
  if (!options_.weights_only && manifest_.has_outer_momentum) {
    kinds.push_back({ShardTensorKind::kOuterMomentum, DType::kF32});
  }
  for (const auto& [kind, dtype] : kinds) {
    for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
      const ManifestTensor& t = manifest_.tensors[i];
      OutputTensor out;
      out.kind = kind;
      out.name = absl::StrCat(ShardTensorPrefix(kind), t.name);
      out.model_tensor = static_cast<int>(i);
      out.dtype = dtype;
      const int64_t elements = t.Rows() * t.RowElements();
      out.shard_bytes = elements * 4;
      out.output_bytes = elements * DTypeSize(dtype);
      tensors_.push_back(std::move(out));
    }
  }

  GroupIntoFiles();
  CountWork();
  return absl::OkStatus();
}

// Hugging Face shards split between tensors; a tensor larger than the limit
// gets a file of its own. Sharded output also gets the index.
void Consolidator::GroupIntoFiles() {
  std::vector<std::vector<int>> groups(1);
  int64_t group_bytes = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const int64_t bytes = tensors_[i].output_bytes;
    if (options_.max_shard_bytes > 0 && !groups.back().empty() &&
        group_bytes + bytes > options_.max_shard_bytes) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(static_cast<int>(i));
    group_bytes += bytes;
  }
  const bool sharded = options_.max_shard_bytes > 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    OutputFile file;
    file.name = sharded ? absl::StrFormat("model-%05d-of-%05d.safetensors", g + 1, groups.size())
                        : kConsolidatedFileName;
    file.tensors = groups[g];
    for (int i : file.tensors) {
      const OutputTensor& t = tensors_[i];
      file.entries.push_back(TensorEntry{t.name, t.dtype, manifest_.tensors[t.model_tensor].shape});
      file.data_bytes += t.output_bytes;
    }
    files_.push_back(std::move(file));
  }
  if (sharded) {
    nlohmann::ordered_json index;
    int64_t total = 0;
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (const OutputFile& f : files_) {
      total += f.data_bytes;
      for (int i : f.tensors) weight_map[tensors_[i].name] = f.name;
    }
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = std::move(weight_map);
    index_json_ = index.dump(2) + "\n";
  }
}

// Pass 1's work: every tensor whose checksum is not known already.
void Consolidator::CountWork() {
  work_total_ = 0;
  for (OutputTensor& t : tensors_) {
    auto known = options_.known_checksums.find(t.name);
    if (t.dtype == DType::kF32 && known != options_.known_checksums.end()) {
      absl::StatusOr<uint64_t> value = ParseChecksumHex(known->second);
      if (value.ok()) {
        t.checksum = *value;
        t.checksum_known = true;
        continue;
      }
    }
    work_total_ += t.shard_bytes;
  }
  work_total_ += static_cast<int64_t>(index_json_.size());
}

absl::Status Consolidator::Advance(int64_t bytes, ConsolidationOutput* output) {
  work_done_ += bytes;
  if (work_done_ - last_progress_ < kProgressEvery) return absl::OkStatus();
  last_progress_ = work_done_;
  return output->Progress(work_done_, work_total_);
}

absl::StatusOr<const SafetensorsReader*> Consolidator::OpenPiece(const ManifestPiece& piece,
                                                                 const std::string& shard_tensor,
                                                                 int64_t bytes) {
  absl::StatusOr<const SafetensorsReader*> reader = shards_->Get(piece.file);
  if (!reader.ok()) return reader.status();
  const std::string file = shards_->RelativePath(piece.file);
  const TensorInfo* info = (*reader)->Find(shard_tensor);
  if (info == nullptr) {
    return absl::DataLossError(absl::StrCat("shard file ", file, " has no tensor \"", shard_tensor,
                                            "\" (the manifest lists it)"));
  }
  if (info->dtype != DType::kF32 || info->Bytes() != bytes) {
    return absl::DataLossError(absl::StrCat("shard file ", file, " tensor \"", shard_tensor,
                                            "\" is ", DTypeName(info->dtype), " of ", info->Bytes(),
                                            " bytes; expected F32 of ", bytes));
  }
  return reader;
}

const char* Consolidator::Convert(DType dtype, int64_t n, int64_t* out_bytes) {
  if (dtype == DType::kF32) {
    *out_bytes = n;
    return buffer_.data();
  }
  const int64_t count = n / 4;
  uint16_t* dst = reinterpret_cast<uint16_t*>(converted_.data());
  for (int64_t i = 0; i < count; ++i) {
    float value;
    std::memcpy(&value, buffer_.data() + 4 * i, 4);
    dst[i] = dtype == DType::kBF16 ? FloatToBF16(value) : FloatToF16(value);
  }
  *out_bytes = count * 2;
  return converted_.data();
}

absl::Status Consolidator::CopyTensor(const OutputTensor& tensor, ByteSink* sink,
                                      uint64_t* output_hash, ConsolidationOutput* output) {
  const ManifestTensor& model = manifest_.tensors[tensor.model_tensor];
  const int64_t row_bytes = model.RowElements() * 4;
  // Whole F32 elements per read, so a conversion never splits one.
  const int64_t chunk = static_cast<int64_t>(buffer_.size()) / 8 * 8;
  // The output's checksum is wanted in pass 1 only (pass 2 re-verifies each
  // piece, and the output is a function of the pieces). An F32 tensor in one
  // piece has its piece's checksum: no second hash.
  const std::vector<ManifestPiece>& pieces = manifest_.pieces[tensor.model_tensor];
  const bool hash_output =
      output_hash != nullptr && !(tensor.dtype == DType::kF32 && pieces.size() == 1);
  Hasher out_hash;
  uint64_t last_piece_hash = Checksum(nullptr, 0);
  for (const ManifestPiece& piece : pieces) {
    const std::string shard_tensor =
        ShardTensorName(tensor.kind, model.name, piece.row_begin, piece.row_end);
    const int64_t bytes = (piece.row_end - piece.row_begin) * row_bytes;
    absl::StatusOr<const SafetensorsReader*> reader = OpenPiece(piece, shard_tensor, bytes);
    if (!reader.ok()) return reader.status();
    const std::string file = shards_->RelativePath(piece.file);
    Hasher shard_hash;
    auto read = [&](int64_t offset, int64_t n, char* into) -> absl::Status {
      const absl::Time start = sink != nullptr ? absl::Now() : absl::InfinitePast();
      absl::Cleanup timed = [&] {
        if (sink != nullptr) read_time_ += absl::Now() - start;
      };
      if (absl::Status s = (*reader)->ReadBytes(shard_tensor, offset, n, into); !s.ok()) {
        return absl::DataLossError(
            absl::StrCat("shard file ", file, " tensor \"", shard_tensor, "\": ", s.message()));
      }
      shard_hash.Update(into, static_cast<size_t>(n));
      return absl::OkStatus();
    };
    for (int64_t offset = 0; offset < bytes;) {
      if (output->Cancelled()) return absl::CancelledError("consolidation cancelled");
      size_t room = 0;
      char* in_place =
          sink != nullptr && tensor.dtype == DType::kF32 ? output->NextBuffer(&room) : nullptr;
      if (in_place != nullptr) {
        // F32 out: the shard bytes are the output bytes, read straight into
        // the output's buffer.
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(room), bytes - offset);
        if (absl::Status s = read(offset, n, in_place); !s.ok()) return s;
        if (absl::Status s = output->CommitBuffer(static_cast<size_t>(n)); !s.ok()) return s;
        written_ += n;
        if (absl::Status s = Advance(n, output); !s.ok()) return s;
        offset += n;
        continue;
      }
      const int64_t n = std::min(chunk, bytes - offset);
      if (absl::Status s = read(offset, n, buffer_.data()); !s.ok()) return s;
      int64_t out_bytes = n;
      const char* out = Convert(tensor.dtype, n, &out_bytes);
      if (hash_output) out_hash.Update(out, static_cast<size_t>(out_bytes));
      if (sink != nullptr) {
        if (absl::Status s = sink->Write(out, static_cast<size_t>(out_bytes)); !s.ok()) return s;
        written_ += out_bytes;
      }
      if (absl::Status s = Advance(sink == nullptr ? n : out_bytes, output); !s.ok()) return s;
      offset += n;
    }
    const std::string& expected = manifest_.files[piece.file].checksums.at(shard_tensor);
    last_piece_hash = shard_hash.Digest();
    const std::string actual = ChecksumToHex(last_piece_hash);
    if (actual != absl::AsciiStrToLower(expected)) {
      return absl::DataLossError(absl::StrCat("checksum mismatch in shard file ", file,
                                              " tensor \"", shard_tensor, "\": the manifest has ",
                                              expected, ", the bytes hash to ", actual));
    }
  }
  if (output_hash != nullptr) *output_hash = hash_output ? out_hash.Digest() : last_piece_hash;
  return absl::OkStatus();
}

SafetensorsMetadata Consolidator::FileMetadata(const OutputFile& f, bool placeholder) const {
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  for (int i : f.tensors) {
    checksums[tensors_[i].name] =
        placeholder ? kPlaceholderChecksum : ChecksumToHex(tensors_[i].checksum);
  }
  SafetensorsMetadata metadata = {{ShardMetadataKey::kFormat, "pt"},
                                  {ShardMetadataKey::kJob, manifest_.job},
                                  {ShardMetadataKey::kStep, absl::StrCat(manifest_.step)},
                                  {ShardMetadataKey::kChecksums, checksums.dump()}};
  if (!options_.weights_only && manifest_.has_exp_avg) {
    metadata[ShardMetadataKey::kOptimizer] = manifest_.optimizer;
    metadata[ShardMetadataKey::kOptimizerStep] = absl::StrCat(manifest_.optimizer_step);
  }
  if (!options_.weights_only && !outer_step_.empty()) {
    metadata[ShardMetadataKey::kOuterStep] = outer_step_;
  }
  if (!hf_config_.empty()) metadata[ShardMetadataKey::kHfConfig] = hf_config_;
  return metadata;
}

// The header with the final checksums, then the tensors in entry order:
// exactly the layout BuildSafetensorsHeader computed.
absl::Status Consolidator::WriteOutputFile(const OutputFile& f, ConsolidationOutput* output) {
  int64_t size = 0;
  absl::StatusOr<std::string> header =
      BuildSafetensorsHeader(f.entries, FileMetadata(f, false), nullptr, &size);
  if (!header.ok()) return header.status();
  if (size != f.size_bytes) {
    return absl::InternalError(absl::StrCat("header of ", f.name, " changed size"));
  }
  absl::StatusOr<ByteSink*> sink = output->BeginFile(f.name, f.size_bytes);
  if (!sink.ok()) return sink.status();
  if (absl::Status s = (*sink)->Write(header->data(), header->size()); !s.ok()) return s;
  written_ = static_cast<int64_t>(header->size());
  if (absl::Status s = Advance(f.header_bytes, output); !s.ok()) return s;
  for (int i : f.tensors) {
    if (absl::Status s = CopyTensor(tensors_[i], *sink, nullptr, output); !s.ok()) return s;
  }
  if (written_ != f.size_bytes) {
    return absl::InternalError(
        absl::StrCat(f.name, ": ", written_, " bytes written of ", f.size_bytes));
  }
  return output->EndFile();
}

absl::StatusOr<ConsolidationResult> Consolidator::Run(ConsolidationOutput* output) {
  if (absl::Status s = PlanOutputs(); !s.ok()) return s;
  shards_ = std::make_unique<ShardFiles>(root_, manifest_);
  buffer_.resize(static_cast<size_t>(options_.buffer_bytes));
  if (options_.dtype != DType::kF32) converted_.resize(buffer_.size() / 2);

  ConsolidationResult result;
  if (!manifest_.files.empty()) {
    absl::StatusOr<const SafetensorsReader*> first = shards_->Get(0);
    if (!first.ok()) return first.status();
    auto hf_config = (*first)->metadata().find(ShardMetadataKey::kHfConfig);
    if (hf_config != (*first)->metadata().end()) result.hf_config = hf_config->second;
    // Every rank saves the same outer step count (the outer steps are the
    // job's collectives).
    auto outer_step = (*first)->metadata().find(ShardMetadataKey::kOuterStep);
    if (outer_step != (*first)->metadata().end() &&
        (manifest_.has_outer_anchor || manifest_.has_outer_momentum)) {
      outer_step_ = outer_step->second;
    }
  }
  if (options_.require_hf_config && result.hf_config.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", manifest_.step, " of job ", manifest_.job,
        " records no Hugging Face model config (hf_config): only GPT jobs saved by this version "
        "of shard_worker have one; consolidate it without --format=hf"));
  }
  hf_config_ = result.hf_config;
  for (OutputFile& f : files_) {
    absl::StatusOr<std::string> header =
        BuildSafetensorsHeader(f.entries, FileMetadata(f, true), nullptr, &f.size_bytes);
    if (!header.ok()) return header.status();
    f.header_bytes = static_cast<int64_t>(header->size());
    work_total_ += f.size_bytes;
  }

  // Pass 1: verify and checksum.
  const absl::Time verify_start = absl::Now();
  for (OutputTensor& t : tensors_) {
    if (t.checksum_known) continue;
    if (absl::Status s = CopyTensor(t, nullptr, &t.checksum, output); !s.ok()) return s;
  }
  if (absl::Status s = output->Progress(work_done_, work_total_); !s.ok()) return s;

  // Pass 2: write.
  const absl::Time write_start = absl::Now();
  result.verify_seconds = absl::ToDoubleSeconds(write_start - verify_start);
  for (const OutputFile& f : files_) {
    if (absl::Status s = WriteOutputFile(f, output); !s.ok()) return s;
    result.files.push_back(f.name);
    result.total_bytes += f.size_bytes;
  }
  if (!index_json_.empty()) {
    const int64_t size = static_cast<int64_t>(index_json_.size());
    absl::StatusOr<ByteSink*> sink = output->BeginFile(kConsolidatedIndexName, size);
    if (!sink.ok()) return sink.status();
    if (absl::Status s = (*sink)->Write(index_json_.data(), index_json_.size()); !s.ok()) {
      return s;
    }
    if (absl::Status s = output->EndFile(); !s.ok()) return s;
    work_done_ += size;
    result.files.push_back(kConsolidatedIndexName);
    result.total_bytes += size;
  }
  if (absl::Status s = output->Progress(work_done_, work_total_); !s.ok()) return s;
  result.write_seconds = absl::ToDoubleSeconds(absl::Now() - write_start);
  result.read_seconds = absl::ToDoubleSeconds(read_time_);
  return result;
}

absl::StatusOr<std::map<std::string, std::string>> Consolidator::Verify(
    ConsolidationOutput* output) {
  options_.dtype = DType::kF32;
  options_.weights_only = false;
  options_.max_shard_bytes = 0;
  options_.known_checksums.clear();
  if (absl::Status s = PlanOutputs(); !s.ok()) return s;
  shards_ = std::make_unique<ShardFiles>(root_, manifest_);
  buffer_.resize(static_cast<size_t>(options_.buffer_bytes));
  work_total_ -= static_cast<int64_t>(index_json_.size());
  std::map<std::string, std::string> checksums;
  for (OutputTensor& t : tensors_) {
    if (absl::Status s = CopyTensor(t, nullptr, &t.checksum, output); !s.ok()) return s;
    checksums[t.name] = ChecksumToHex(t.checksum);
  }
  if (absl::Status s = output->Progress(work_done_, work_total_); !s.ok()) return s;
  return checksums;
}

// ---------------------------------------------------------------------------
// DirectoryOutput

absl::StatusOr<std::unique_ptr<DirectoryOutput>> DirectoryOutput::Create(CheckpointRoot root,
                                                                         std::string relative_dir,
                                                                         ProgressFn progress,
                                                                         CancelledFn cancelled) {
  if (absl::Status s = ValidateRelativePath(relative_dir); !s.ok()) return s;
  const size_t slash = relative_dir.rfind('/');
  const std::string parent = slash == std::string::npos ? "" : relative_dir.substr(0, slash);
  const std::string base = relative_dir.substr(slash == std::string::npos ? 0 : slash + 1);
  if (!parent.empty()) {
    if (absl::Status s = root.MakeDirs(parent); !s.ok()) return s;
  }
  absl::BitGen gen;
  const std::string temp = absl::StrCat(parent, parent.empty() ? "" : "/", ".", base, ".tmp-",
                                        absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen)));
  if (mkdir(root.Join(temp).c_str(), 0755) != 0) {
    return ErrnoStatus(errno, "cannot create directory", root.Join(temp));
  }
  return std::unique_ptr<DirectoryOutput>(new DirectoryOutput(
      std::move(root), std::move(relative_dir), temp, std::move(progress), std::move(cancelled)));
}

DirectoryOutput::~DirectoryOutput() {
  current_.reset();  // removes its temporary file
  if (!committed_) root_.RemoveDir(temp_relative_).IgnoreError();
}

absl::StatusOr<ByteSink*> DirectoryOutput::BeginFile(const std::string& name, int64_t size_bytes) {
  if (current_ != nullptr) return absl::FailedPreconditionError("BeginFile before EndFile");
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') {
    return absl::InvalidArgumentError(absl::StrCat("output file name \"", name, "\""));
  }
  // O_DIRECT: the consolidated file is not read back here, so it goes to
  // disk without filling the server's page cache (and without the copy).
  AtomicFileOptions direct;
  direct.direct = true;
  absl::StatusOr<std::unique_ptr<AtomicFile>> file =
      AtomicFile::Create(root_.Join(absl::StrCat(temp_relative_, "/", name)), direct);
  if (!file.ok()) return file.status();
  current_ = *std::move(file);
  current_size_ = size_bytes;
  written_ = 0;
  return static_cast<ByteSink*>(this);
}

absl::Status DirectoryOutput::Write(const void* data, size_t size) {
  if (current_ == nullptr) return absl::FailedPreconditionError("write outside a file");
  if (written_ + static_cast<int64_t>(size) > current_size_) {
    return absl::InternalError(
        absl::StrCat(current_->path(), ": more bytes than announced (", current_size_, ")"));
  }
  written_ += static_cast<int64_t>(size);
  return current_->Write(data, size);
}

absl::Status DirectoryOutput::EndFile() {
  if (current_ == nullptr) return absl::FailedPreconditionError("EndFile without BeginFile");
  std::unique_ptr<AtomicFile> file = std::move(current_);
  if (written_ != current_size_) {
    return absl::InternalError(
        absl::StrCat(file->path(), ": ", written_, " of ", current_size_, " bytes written"));
  }
  return file->Commit();
}

absl::Status DirectoryOutput::Progress(int64_t done, int64_t total) {
  return progress_ ? progress_(done, total) : absl::OkStatus();
}

absl::Status DirectoryOutput::Commit() {
  if (current_ != nullptr) return absl::FailedPreconditionError("Commit inside a file");
  const std::string temp = root_.Join(temp_relative_);
  const std::string target = root_.Join(relative_dir_);
  if (absl::Status s = FsyncDirectory(temp); !s.ok()) return s;
  struct stat st;
  if (lstat(target.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoStatus(errno, "cannot stat", target);
    if (rename(temp.c_str(), target.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrCat("cannot rename ", temp, " to"), target);
    }
  } else if (renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    // The old output now sits at the temporary name.
    root_.RemoveDir(temp_relative_).IgnoreError();
  } else {
    // A filesystem without RENAME_EXCHANGE: the old output goes first.
    if (absl::Status s = root_.RemoveDir(relative_dir_); !s.ok()) return s;
    if (rename(temp.c_str(), target.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrCat("cannot rename ", temp, " to"), target);
    }
  }
  committed_ = true;
  return FsyncDirectory(target.substr(0, target.rfind('/')));
}

}  // namespace zeroshard
