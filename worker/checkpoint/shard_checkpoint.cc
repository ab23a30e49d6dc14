#include "worker/checkpoint/shard_checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/checkpoint_format.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "common/finite_scan.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

absl::Status MakeDirs(const std::string& path) {
  std::string partial;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    partial += std::string(part) + "/";
    if (part.empty()) continue;
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, "cannot create directory", partial);
    }
  }
  return absl::OkStatus();
}

// The manifest of `job`'s step when the step is a complete checkpoint
// already, else "".
std::string CompleteStepManifest(const std::string& root, const std::string& job, int64_t step) {
  const std::string manifest =
      absl::StrCat(root, "/", CheckpointStepDir(job, step), "/", kManifestFileName);
  struct stat st;
  return stat(manifest.c_str(), &st) == 0 ? manifest : "";
}

// A save into a complete step (its manifest exists) must not replace its
// files: the server refuses the commit, but only after the rename, which
// left a "verified" checkpoint whose files no longer match its checksums.
// The same bytes again (a recovery re-ran the steps up to a complete
// checkpoint) are that file already: OK, and nothing is written. Other
// bytes are an earlier run's under the same job id: refused.
absl::Status CheckCompleteStep(const std::string& manifest, const WrittenShard& shard,
                               const ShardIdentity& id) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> existing =
      SafetensorsReader::Open(shard.path);
  if (existing.ok()) {
    auto recorded = (*existing)->metadata().find(ShardMetadataKey::kChecksums);
    if (recorded != (*existing)->metadata().end()) {
      const nlohmann::json sums = nlohmann::json::parse(recorded->second, nullptr, false);
      if (!sums.is_discarded() && sums == nlohmann::json(shard.checksums)) return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", id.step, " of job '", id.job, "' is a complete checkpoint already (", manifest,
      ") with other contents (an earlier run's under this job id, or this run's at another "
      "world size before a recovery): its files are not replaced. To continue an earlier run, "
      "--resume=latest; to start anew, another --job (or move the old checkpoints away)"));
}

// The shape of a piece: the tensor's, with dim 0 cut to the piece's rows.
std::vector<int64_t> PieceShape(const ZeroEngine::PieceView& piece) {
  std::vector<int64_t> shape = piece.tensor->shape;
  if (!shape.empty()) shape[0] = piece.row_end - piece.row_begin;
  return shape;
}

}  // namespace

namespace {

TensorEntry PieceEntry(ShardTensorKind kind, const ZeroEngine::PieceView& piece) {
  return {ShardTensorName(kind, piece.tensor->name, piece.row_begin, piece.row_end), DType::kF32,
          PieceShape(piece)};
}

// `add(kind, values)` for each state the piece has beside its parameters:
// the moments, then DiLoCo's outer anchor and momentum.
template <typename Add>
void ForEachPieceState(const ZeroEngine::PieceView& piece, const Add& add) {
  if (piece.exp_avg != nullptr) {
    add(ShardTensorKind::kExpAvg, piece.exp_avg);
    if (piece.exp_avg_sq != nullptr) add(ShardTensorKind::kExpAvgSq, piece.exp_avg_sq);
  }
  if (piece.outer_anchor != nullptr) add(ShardTensorKind::kOuterAnchor, piece.outer_anchor);
  if (piece.outer_momentum != nullptr) add(ShardTensorKind::kOuterMomentum, piece.outer_momentum);
}

// `id` with the engine's outer step count (DiLoCo).
ShardIdentity WithOuterStep(const ShardIdentity& id, const ZeroEngine& engine) {
  ShardIdentity out = id;
  if (engine.diloco()) out.outer_step = engine.outer_steps();
  return out;
}

}  // namespace

absl::StatusOr<ShardSnapshot> SnapshotShard(ZeroEngine& engine, const ShardIdentity& id,
                                            const std::string& optimizer_name, bool with_optimizer,
                                            bool with_replica_peer) {
  ShardSnapshot snap;
  snap.id = WithOuterStep(id, engine);
  snap.optimizer = optimizer_name;
  snap.optimizer_step = engine.optimizer_step();
  // Moments after all parameters, so a weights-only reader finds the
  // parameters at the front of the file. They are copied during the visit:
  // on a device backend the visit's host copies are gone after it.
  std::vector<TensorEntry> moment_entries;
  std::vector<std::vector<float>> moment_values;
  absl::Status s = engine.ForEachOwnPiece(
      [&](const ZeroEngine::PieceView& piece) {
        snap.entries.push_back(PieceEntry(ShardTensorKind::kParams, piece));
        snap.values.emplace_back(piece.params, piece.params + piece.elements);
        if (!with_optimizer) return absl::OkStatus();
        ForEachPieceState(piece, [&](ShardTensorKind kind, const float* values) {
          moment_entries.push_back(PieceEntry(kind, piece));
          moment_values.emplace_back(values, values + piece.elements);
        });
        return absl::OkStatus();
      },
      with_replica_peer);
  if (!s.ok()) return s;
  for (size_t i = 0; i < moment_entries.size(); ++i) {
    snap.entries.push_back(std::move(moment_entries[i]));
    snap.values.push_back(std::move(moment_values[i]));
  }
  for (const auto& v : snap.values) snap.bytes += v.size() * sizeof(float);
  return snap;
}

absl::StatusOr<ShardView> ViewShard(ZeroEngine& engine, const ShardIdentity& id,
                                    const std::string& optimizer_name, bool with_optimizer,
                                    bool with_replica_peer) {
  ShardView view;
  view.id = WithOuterStep(id, engine);
  view.optimizer = optimizer_name;
  view.optimizer_step = engine.optimizer_step();
  auto add = [](ShardView* v, TensorEntry entry, const float* values, int64_t elements) {
    v->entries.push_back(std::move(entry));
    v->values.push_back(values);
    v->elements.push_back(elements);
    v->bytes += elements * static_cast<int64_t>(sizeof(float));
  };
  ShardView moments;  // appended after every parameter, as SnapshotShard does
  absl::Status s = engine.ForEachOwnPiece(
      [&](const ZeroEngine::PieceView& piece) {
        add(&view, PieceEntry(ShardTensorKind::kParams, piece), piece.params, piece.elements);
        if (!with_optimizer) return absl::OkStatus();
        ForEachPieceState(piece, [&](ShardTensorKind kind, const float* values) {
          add(&moments, PieceEntry(kind, piece), values, piece.elements);
        });
        return absl::OkStatus();
      },
      with_replica_peer);
  if (!s.ok()) return s;
  for (size_t i = 0; i < moments.entries.size(); ++i) {
    add(&view, std::move(moments.entries[i]), moments.values[i], moments.elements[i]);
  }
  return view;
}

ShardView ViewOf(std::shared_ptr<const ShardSnapshot> snapshot) {
  ShardView view;
  view.id = snapshot->id;
  view.entries = snapshot->entries;
  for (const auto& v : snapshot->values) {
    view.values.push_back(v.data());
    view.elements.push_back(static_cast<int64_t>(v.size()));
  }
  view.optimizer = snapshot->optimizer;
  view.optimizer_step = snapshot->optimizer_step;
  view.bytes = snapshot->bytes;
  view.owner = std::move(snapshot);
  return view;
}

namespace {

// The header's metadata, with the tensors' checksums (hex, in entry order).
SafetensorsMetadata ShardMetadata(const ShardIdentity& id, const std::string& optimizer,
                                  int64_t optimizer_step, const std::vector<TensorEntry>& entries,
                                  const std::vector<std::string>& hex) {
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  for (size_t i = 0; i < entries.size(); ++i) checksums[entries[i].name] = hex[i];
  SafetensorsMetadata metadata = {
      {ShardMetadataKey::kFormat, kShardFormat},
      {ShardMetadataKey::kJob, id.job},
      {ShardMetadataKey::kStep, absl::StrCat(id.step)},
      {ShardMetadataKey::kRank, absl::StrCat(id.rank)},
      {ShardMetadataKey::kWorldSize, absl::StrCat(id.world_size)},
      {ShardMetadataKey::kGeneration, absl::StrCat(id.generation)},
      {ShardMetadataKey::kPlanHash, id.plan_hash},
      {ShardMetadataKey::kOptimizer, optimizer},
      {ShardMetadataKey::kOptimizerStep, absl::StrCat(optimizer_step)},
      {ShardMetadataKey::kChecksums, checksums.dump()},
  };
  if (id.data_row >= 0) metadata[ShardMetadataKey::kDataRow] = absl::StrCat(id.data_row);
  if (!id.hf_config.empty()) metadata[ShardMetadataKey::kHfConfig] = id.hf_config;
  if (id.outer_step >= 0) metadata[ShardMetadataKey::kOuterStep] = absl::StrCat(id.outer_step);
  return metadata;
}

// Checksums and the scan for non-finite values read the bytes in slices
// that stay in the cache between the two.
constexpr int64_t kSlice = int64_t{1} << 20;  // bytes

// Where a shard is from, for its errors.
std::string ShardName(const ShardIdentity& id) {
  return absl::StrCat("shard of job ", id.job, " step ", id.step, " rank ", id.rank);
}

// The first non-finite value met in a shard's tensors.
struct NonFinite {
  int tensor = -1;  // entry index; -1: none
  int64_t element = 0;
  float value = 0;
};

// Hashes `bytes` at `data` into `hasher` and records the first non-finite
// f32 value (entry `tensor`) in `found`, slice by slice.
void HashAndScan(const char* data, int64_t bytes, int tensor, Hasher* hasher, NonFinite* found) {
  for (int64_t done = 0; done < bytes; done += kSlice) {
    const int64_t n = std::min(kSlice, bytes - done);
    hasher->Update(data + done, n);
    if (found->tensor >= 0) continue;
    const int64_t at = FirstNonFiniteF32(data + done, n / 4);
    if (at >= 0) {
      found->tensor = tensor;
      found->element = done / 4 + at;
      std::memcpy(&found->value, data + done + at * 4, 4);
    }
  }
}

absl::Status Refusal(const ShardIdentity& id, const std::vector<TensorEntry>& entries,
                     const NonFinite& found) {
  return NonFiniteTensorError(ShardName(id), entries[found.tensor].name, found.element,
                              found.value);
}

// The snapshot's metadata, with the checksums computed (XXH64 runs at memory
// speed); refused (NonFiniteTensorError) when a value is NaN or ±Inf.
absl::StatusOr<SafetensorsMetadata> ShardMetadata(
    const ShardSnapshot& snap, std::map<std::string, std::string>* checksums_out) {
  std::vector<std::string> hex;
  NonFinite found;
  for (size_t i = 0; i < snap.entries.size(); ++i) {
    Hasher hasher;
    HashAndScan(reinterpret_cast<const char*>(snap.values[i].data()),
                static_cast<int64_t>(snap.values[i].size() * sizeof(float)), static_cast<int>(i),
                &hasher, &found);
    if (found.tensor >= 0) return Refusal(snap.id, snap.entries, found);
    hex.push_back(ChecksumToHex(hasher.Digest()));
    if (checksums_out != nullptr) (*checksums_out)[snap.entries[i].name] = hex.back();
  }
  return ShardMetadata(snap.id, snap.optimizer, snap.optimizer_step, snap.entries, hex);
}

}  // namespace

absl::Status SerializeShardInto(const ShardView& view, std::string* out) {
  // The header holds the checksums, which are known only after the copy; but
  // every checksum is 16 hex digits, so a header with placeholders has the
  // final header's length and says where the data goes.
  std::vector<std::string> hex(view.entries.size(), std::string(16, '0'));
  std::vector<std::pair<int64_t, int64_t>> offsets;
  int64_t file_size = 0;
  absl::StatusOr<std::string> header = BuildSafetensorsHeader(
      view.entries, ShardMetadata(view.id, view.optimizer, view.optimizer_step, view.entries, hex),
      &offsets, &file_size);
  if (!header.ok()) return header.status();
  // Same size: nothing moves, nothing is written twice.
  if (static_cast<int64_t>(out->size()) != file_size) out->resize(file_size);
  char* data = out->data() + header->size();
  // Copy, checksum and scan in slices that stay in the cache between them.
  NonFinite found;
  for (size_t i = 0; i < view.entries.size(); ++i) {
    const int64_t bytes = view.elements[i] * static_cast<int64_t>(sizeof(float));
    if (offsets[i].second - offsets[i].first != bytes) {
      return absl::InternalError(absl::StrCat("shard tensor ", view.entries[i].name, ": ", bytes,
                                              " bytes of values for a ",
                                              offsets[i].second - offsets[i].first, "-byte entry"));
    }
    const char* from = reinterpret_cast<const char*>(view.values[i]);
    char* to = data + offsets[i].first;
    Hasher hasher;
    for (int64_t done = 0; done < bytes; done += kSlice) {
      const int64_t n = std::min(kSlice, bytes - done);
      std::memcpy(to + done, from + done, n);
      // The slice just copied is in the cache: hash and scan it there.
      NonFinite in_slice;
      HashAndScan(to + done, n, static_cast<int>(i), &hasher, &in_slice);
      if (found.tensor < 0 && in_slice.tensor >= 0) {
        found = in_slice;
        found.element += done / 4;
      }
    }
    hex[i] = ChecksumToHex(hasher.Digest());
  }
  absl::StatusOr<std::string> final_header = BuildSafetensorsHeader(
      view.entries, ShardMetadata(view.id, view.optimizer, view.optimizer_step, view.entries, hex),
      nullptr);
  if (!final_header.ok()) return final_header.status();
  if (final_header->size() != header->size()) {
    return absl::InternalError(
        absl::StrCat("shard header changed size with its checksums: ", header->size(), " -> ",
                     final_header->size(), " bytes"));
  }
  std::memcpy(out->data(), final_header->data(), final_header->size());
  // Refused, but whole: a snapshot still completes its buddy exchange.
  if (found.tensor >= 0) return Refusal(view.id, view.entries, found);
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeShard(const ShardSnapshot& snap,
                                           std::map<std::string, std::string>* checksums) {
  absl::StatusOr<SafetensorsMetadata> metadata = ShardMetadata(snap, checksums);
  if (!metadata.ok()) return metadata.status();
  std::string bytes;
  StringSink sink(&bytes);
  auto writer = SafetensorsWriter::CreateToSink(&sink, snap.entries, *metadata);
  if (!writer.ok()) return writer.status();
  for (const auto& v : snap.values) {
    if (absl::Status s = (*writer)->Append(v.data(), v.size() * sizeof(float)); !s.ok()) return s;
  }
  if (absl::Status s = (*writer)->Finish(); !s.ok()) return s;
  return bytes;
}

absl::StatusOr<WrittenShard> WriteShard(const ShardSnapshot& snap, const std::string& root) {
  WrittenShard out;
  // The header carries the checksums, so they are computed first (XXH64 runs
  // at memory speed; the write is what takes time), and a shard holding a
  // non-finite value is refused before anything is written.
  absl::StatusOr<SafetensorsMetadata> metadata = ShardMetadata(snap, &out.checksums);
  if (!metadata.ok()) return metadata.status();
  out.relative_path =
      CheckpointShardPath(snap.id.job, snap.id.step, snap.id.rank, snap.id.world_size);
  out.path = absl::StrCat(root, "/", out.relative_path);
  if (const std::string manifest = CompleteStepManifest(root, snap.id.job, snap.id.step);
      !manifest.empty()) {
    if (absl::Status s = CheckCompleteStep(manifest, out, snap.id); !s.ok()) return s;
    struct stat st;
    out.size_bytes = stat(out.path.c_str(), &st) == 0 ? st.st_size : 0;
    return out;  // those bytes, there already
  }
  if (absl::Status s =
          MakeDirs(absl::StrCat(root, "/", CheckpointStepDir(snap.id.job, snap.id.step)));
      !s.ok()) {
    return s;
  }
  auto writer = SafetensorsWriter::Create(out.path, snap.entries, *metadata);
  if (!writer.ok()) return writer.status();
  for (const auto& v : snap.values) {
    if (absl::Status s = (*writer)->Append(v.data(), v.size() * sizeof(float)); !s.ok()) return s;
  }
  if (absl::Status s = (*writer)->Finish(); !s.ok()) return s;
  out.size_bytes = (*writer)->file_size();
  return out;
}

absl::StatusOr<WrittenShard> WriteShardFromView(const ShardView& view, const std::string& root,
                                                absl::Notification* copied) {
  // Notified on every return: the caller's training thread waits for it.
  struct NotifyOnReturn {
    absl::Notification* n;
    ~NotifyOnReturn() {
      if (!n->HasBeenNotified()) n->Notify();
    }
  } notify{copied};
  const ShardIdentity& id = view.id;
  WrittenShard out;
  out.relative_path = CheckpointShardPath(id.job, id.step, id.rank, id.world_size);
  out.path = absl::StrCat(root, "/", out.relative_path);
  if (absl::Status s = MakeDirs(absl::StrCat(root, "/", CheckpointStepDir(id.job, id.step)));
      !s.ok()) {
    return s;
  }
  // As SerializeShardInto: a header with placeholder checksums has the final
  // header's length; the final one overwrites it once the data is hashed.
  std::vector<std::string> hex(view.entries.size(), std::string(16, '0'));
  std::vector<std::pair<int64_t, int64_t>> offsets;
  int64_t file_size = 0;
  absl::StatusOr<std::string> header = BuildSafetensorsHeader(
      view.entries, ShardMetadata(id, view.optimizer, view.optimizer_step, view.entries, hex),
      &offsets, &file_size);
  if (!header.ok()) return header.status();
  // Through the page cache, as WriteShard: the server reads the file back
  // right after the commit (its background verification).
  absl::StatusOr<std::unique_ptr<AtomicFile>> file = AtomicFile::Create(out.path);
  if (!file.ok()) return file.status();
  if (absl::Status s = (*file)->Write(header->data(), header->size()); !s.ok()) return s;
  NonFinite found;
  for (size_t i = 0; i < view.entries.size(); ++i) {
    const int64_t bytes = view.elements[i] * static_cast<int64_t>(sizeof(float));
    if (offsets[i].second - offsets[i].first != bytes) {
      return absl::InternalError(absl::StrCat("shard tensor ", view.entries[i].name, ": ", bytes,
                                              " bytes of values for a ",
                                              offsets[i].second - offsets[i].first, "-byte entry"));
    }
    const char* from = reinterpret_cast<const char*>(view.values[i]);
    Hasher hasher;
    for (int64_t done = 0; done < bytes; done += kSlice) {
      const int64_t n = std::min(kSlice, bytes - done);
      // Hashed and scanned while in the cache, then copied by the kernel.
      NonFinite in_slice;
      HashAndScan(from + done, n, static_cast<int>(i), &hasher, &in_slice);
      if (found.tensor < 0 && in_slice.tensor >= 0) {
        found = in_slice;
        found.element += done / 4;
      }
      if (absl::Status s = (*file)->Write(from + done, n); !s.ok()) return s;
    }
    hex[i] = ChecksumToHex(hasher.Digest());
    out.checksums[view.entries[i].name] = hex[i];
  }
  copied->Notify();  // the kernel holds every value: the engine may change them
  if (found.tensor >= 0) return Refusal(id, view.entries, found);  // the file goes unpublished
  absl::StatusOr<std::string> final_header = BuildSafetensorsHeader(
      view.entries, ShardMetadata(id, view.optimizer, view.optimizer_step, view.entries, hex),
      nullptr);
  if (!final_header.ok()) return final_header.status();
  if (final_header->size() != header->size()) {
    return absl::InternalError(
        absl::StrCat("shard header changed size with its checksums: ", header->size(), " -> ",
                     final_header->size(), " bytes"));
  }
  if (absl::Status s = (*file)->Overwrite(0, final_header->data(), final_header->size()); !s.ok()) {
    return s;
  }
  if (const std::string manifest = CompleteStepManifest(root, id.job, id.step);
      !manifest.empty()) {
    out.size_bytes = file_size;
    if (absl::Status s = CheckCompleteStep(manifest, out, id); !s.ok()) return s;
    return out;  // the temporary file goes: those bytes are there already
  }
  if (absl::Status s = (*file)->Commit(); !s.ok()) return s;
  out.size_bytes = file_size;
  return out;
}

// ---- Reading ----

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::OpenStep(
    const std::string& step_dir, const std::string& own_file) {
  auto reader = std::unique_ptr<CheckpointReader>(new CheckpointReader());
  reader->source_ = step_dir;
  DIR* dir = opendir(step_dir.c_str());
  if (dir == nullptr) return ErrnoStatus(errno, "cannot open checkpoint directory", step_dir);
  std::vector<std::string> names;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    int rank = 0, world_size = 0;
    if (ParseCheckpointShardFileName(name, &rank, &world_size)) {
      names.push_back(name);
    }
  }
  closedir(dir);
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat("no shard files (rank-*.safetensors) in ", step_dir));
  }
  std::sort(names.begin(), names.end());
  // The own file first, so that it is indexed before any other.
  if (!own_file.empty()) {
    auto it = std::find(names.begin(), names.end(), own_file);
    if (it != names.end()) std::rotate(names.begin(), it, it + 1);
  }
  for (const auto& n : names) reader->paths_.push_back(absl::StrCat(step_dir, "/", n));
  reader->readers_.resize(names.size());
  reader->indexed_.assign(names.size(), false);
  if (absl::Status s = reader->IndexFile(0); !s.ok()) return s;
  return reader;
}

namespace {

// The files of a Hugging Face model directory: model.safetensors.index.json's
// weight_map (tensor -> file; files in sorted order), or model.safetensors.
absl::Status ListHuggingFaceFiles(const std::string& dir, std::vector<std::string>* paths,
                                  std::map<std::string, int>* file_of) {
  const std::string index_path = absl::StrCat(dir, "/model.safetensors.index.json");
  absl::StatusOr<std::string> index = ReadFileToString(index_path);
  if (absl::IsNotFound(index.status())) {
    const std::string single = absl::StrCat(dir, "/model.safetensors");
    struct stat st;
    if (stat(single.c_str(), &st) != 0) {
      return absl::NotFoundError(
          absl::StrCat(dir, " holds neither model.safetensors nor model.safetensors.index.json"));
    }
    paths->push_back(single);
    return absl::OkStatus();
  }
  if (!index.ok()) return index.status();
  nlohmann::json j = nlohmann::json::parse(*index, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": expected a JSON object with a \"weight_map\" object"));
  }
  std::map<std::string, int> file_index;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": the file of tensor '", tensor, "' is not a plain file name"));
    }
    file_index.emplace(file.get<std::string>(), 0);
  }
  for (auto& [file, index_of_file] : file_index) {
    index_of_file = static_cast<int>(paths->size());
    paths->push_back(absl::StrCat(dir, "/", file));
  }
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    (*file_of)[tensor] = file_index[file.get<std::string>()];
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::OpenFile(
    const std::string& path) {
  auto reader = std::unique_ptr<CheckpointReader>(new CheckpointReader());
  reader->source_ = path;
  reader->consolidated_ = true;
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    if (absl::Status s = ListHuggingFaceFiles(path, &reader->paths_, &reader->file_of_); !s.ok()) {
      return s;
    }
  } else {
    reader->paths_.push_back(path);
  }
  reader->readers_.resize(reader->paths_.size());
  reader->indexed_.assign(reader->paths_.size(), true);
  auto file = reader->File(0);
  if (!file.ok()) return file.status();
  for (const TensorInfo& t : (*file)->tensors()) {
    for (ShardTensorKind kind : {ShardTensorKind::kExpAvg, ShardTensorKind::kOuterAnchor,
                                 ShardTensorKind::kOuterMomentum}) {
      if (absl::StartsWith(t.name, ShardTensorPrefix(kind))) reader->NoteKind(kind);
    }
  }
  reader->ReadPosition((*file)->metadata());
  return reader;
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::OpenMemory(
    const std::string& source, std::vector<MemoryFile> files, bool verified) {
  if (files.empty()) return absl::NotFoundError(absl::StrCat("no shard files in ", source));
  auto reader = std::unique_ptr<CheckpointReader>(new CheckpointReader());
  reader->source_ = source;
  reader->checksums_verified_ = verified;
  for (const MemoryFile& f : files) {
    reader->paths_.push_back(absl::StrCat(source, "/", f.name));
    reader->buffers_.push_back(f.bytes);
  }
  reader->readers_.resize(files.size());
  reader->indexed_.assign(files.size(), false);
  if (absl::Status s = reader->IndexFile(0); !s.ok()) return s;
  return reader;
}

absl::StatusOr<SafetensorsReader*> CheckpointReader::File(int index) {
  if (readers_[index] == nullptr) {
    auto opened = buffers_.empty() ? SafetensorsReader::Open(paths_[index])
                                   : SafetensorsReader::OpenBuffer(paths_[index], buffers_[index]);
    if (!opened.ok()) return opened.status();
    readers_[index] = std::move(*opened);
  }
  return readers_[index].get();
}

absl::Status CheckpointReader::IndexFile(int index) {
  if (indexed_[index]) return absl::OkStatus();
  auto file = File(index);
  if (!file.ok()) return file.status();
  for (const TensorInfo& t : (*file)->tensors()) {
    ParsedShardTensorName parsed;
    if (!ParseShardTensorName(t.name, &parsed)) {
      return absl::InvalidArgumentError(absl::StrCat(
          paths_[index], ": tensor '", t.name, "' is not named <tensor>:<row_begin>-<row_end>"));
    }
    NoteKind(parsed.kind);
    Piece piece;
    piece.file = index;
    piece.shard_tensor = t.name;
    piece.row_begin = parsed.row_begin;
    piece.row_end = parsed.row_end;
    auto& list = pieces_[{static_cast<int>(parsed.kind), parsed.tensor}];
    list.push_back(piece);
    std::sort(list.begin(), list.end(),
              [](const Piece& a, const Piece& b) { return a.row_begin < b.row_begin; });
  }
  ReadPosition((*file)->metadata());
  indexed_[index] = true;
  return absl::OkStatus();
}

void CheckpointReader::NoteKind(ShardTensorKind kind) {
  switch (kind) {
    case ShardTensorKind::kExpAvg:
    case ShardTensorKind::kExpAvgSq:
      has_optimizer_ = true;
      break;
    case ShardTensorKind::kOuterAnchor:
      has_outer_anchor_ = true;
      break;
    case ShardTensorKind::kOuterMomentum:
      has_outer_momentum_ = true;
      break;
    case ShardTensorKind::kParams:
      break;
  }
}

void CheckpointReader::ReadPosition(const SafetensorsMetadata& meta) {
  for (auto [key, field] : {std::pair{ShardMetadataKey::kOptimizerStep, &optimizer_step_},
                            std::pair{ShardMetadataKey::kStep, &step_},
                            std::pair{ShardMetadataKey::kDataRow, &data_row_},
                            std::pair{ShardMetadataKey::kOuterStep, &outer_step_}}) {
    int64_t value = 0;
    auto it = meta.find(key);
    if (it != meta.end() && absl::SimpleAtoi(it->second, &value)) *field = value;
  }
}

absl::Status CheckpointReader::Verify(int index, const std::string& tensor) {
  if (checksums_verified_ || verified_.count({index, tensor})) return absl::OkStatus();
  auto file = File(index);
  if (!file.ok()) return file.status();
  const SafetensorsMetadata& meta = (*file)->metadata();
  auto recorded = meta.find(ShardMetadataKey::kChecksums);
  if (recorded == meta.end()) {  // not one of ours: nothing to check against
    verified_.insert({index, tensor});
    return absl::OkStatus();
  }
  nlohmann::json checksums = nlohmann::json::parse(recorded->second, nullptr, false);
  if (!checksums.is_object() || !checksums.contains(tensor) || !checksums[tensor].is_string()) {
    return absl::DataLossError(
        absl::StrCat(paths_[index], ": no checksum recorded for tensor '", tensor, "'"));
  }
  const TensorInfo* info = (*file)->Find(tensor);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(paths_[index], " has no tensor '", tensor, "'"));
  }
  Hasher hasher;
  std::vector<char> buffer(std::min<int64_t>(info->Bytes(), int64_t{4} << 20));
  for (int64_t at = 0; at < info->Bytes();) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(buffer.size()), info->Bytes() - at);
    if (absl::Status s = (*file)->ReadBytes(tensor, at, n, buffer.data()); !s.ok()) return s;
    hasher.Update(buffer.data(), static_cast<size_t>(n));
    at += n;
  }
  const std::string actual = ChecksumToHex(hasher.Digest());
  if (actual != checksums[tensor].get<std::string>()) {
    return absl::DataLossError(absl::StrCat(
        paths_[index], ": tensor '", tensor, "' does not match its recorded checksum (",
        checksums[tensor].get<std::string>(), " recorded, ", actual,
        " read): the checkpoint is damaged; resume from another step"));
  }
  verified_.insert({index, tensor});
  return absl::OkStatus();
}

absl::Status CheckpointReader::IndexAll() {
  for (size_t i = 0; i < paths_.size(); ++i) {
    if (absl::Status s = IndexFile(static_cast<int>(i)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// ReadRows from a consolidated (Hugging Face) file.
absl::Status CheckpointReader::ReadConsolidatedRows(Kind kind, const TensorSpec& tensor,
                                                    int64_t row_begin, int64_t row_end,
                                                    float* out) {
  // Hugging Face's own GPT-2 files are saved from GPT2Model: the names
  // may lack the "transformer." in front.
  std::vector<std::string> names = {absl::StrCat(ShardTensorPrefix(kind), tensor.name)};
  if (kind == Kind::kParams && absl::StartsWith(tensor.name, "transformer.")) {
    names.push_back(tensor.name.substr(std::strlen("transformer.")));
  }
  std::string name = names[0];
  int index = 0;
  const TensorInfo* info = nullptr;
  for (const std::string& candidate : names) {
    auto in = file_of_.find(candidate);
    if (!file_of_.empty() && in == file_of_.end()) continue;
    index = in == file_of_.end() ? 0 : in->second;
    auto file = File(index);
    if (!file.ok()) return file.status();
    info = (*file)->Find(candidate);
    if (info != nullptr) {
      name = candidate;
      break;
    }
  }
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(paths_[index], " has no tensor '", tensor.name,
                                            "' (shape ", ShapeString(tensor.shape),
                                            "); is it a checkpoint of this model?"));
  }
  if (info->shape != tensor.shape && !(info->shape.empty() && tensor.shape.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat(paths_[index], ": tensor '", name, "' is ", ShapeString(info->shape),
                     ", but the model's is ", ShapeString(tensor.shape)));
  }
  if (absl::Status s = Verify(index, name); !s.ok()) return s;
  auto file = File(index);
  if (!file.ok()) return file.status();
  return (*file)->ReadRowsAsF32(name, row_begin, row_end, out);
}

absl::Status CheckpointReader::ReadRows(Kind kind, const TensorSpec& tensor, int64_t row_begin,
                                        int64_t row_end, float* out) {
  if (consolidated_) return ReadConsolidatedRows(kind, tensor, row_begin, row_end, out);
  const int64_t row_elements = tensor.RowElements();
  int64_t row = row_begin;
  bool indexed_all = false;
  while (row < row_end) {
    auto it = pieces_.find({static_cast<int>(kind), tensor.name});
    const Piece* found = nullptr;
    if (it != pieces_.end()) {
      for (const Piece& p : it->second) {
        if (p.row_begin <= row && row < p.row_end) found = &p;
      }
    }
    if (found == nullptr) {
      if (!indexed_all) {
        if (absl::Status s = IndexAll(); !s.ok()) return s;
        indexed_all = true;
        continue;
      }
      return absl::NotFoundError(absl::StrCat("checkpoint ", source_, " has no row ", row,
                                              " of tensor '", tensor.name, "'"));
    }
    int64_t end = std::min(row_end, found->row_end);
    if (absl::Status s = Verify(found->file, found->shard_tensor); !s.ok()) return s;
    auto file = File(found->file);
    if (!file.ok()) return file.status();
    // A piece's rows must be the model's rows: a checkpoint of another shape
    // would otherwise write past `out` (sized by the model's tensor).
    const TensorInfo* info = (*file)->Find(found->shard_tensor);
    if (info == nullptr || info->RowElements() != row_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat(paths_[found->file], ": tensor '", found->shard_tensor, "' has rows of ",
                       info == nullptr ? 0 : info->RowElements(), " elements, but the model's '",
                       tensor.name, "' (shape ", ShapeString(tensor.shape), ") has ", row_elements,
                       "; is it a checkpoint of this model?"));
    }
    absl::Status s =
        (*file)->ReadRowsAsF32(found->shard_tensor, row - found->row_begin, end - found->row_begin,
                               out + (row - row_begin) * row_elements);
    if (!s.ok()) return s;
    row = end;
  }
  return absl::OkStatus();
}

int64_t LatestCompleteStep(const std::string& root, const std::string& job) {
  std::string job_dir = absl::StrCat(root, "/", job);
  DIR* dir = opendir(job_dir.c_str());
  if (dir == nullptr) return -1;
  int64_t latest = -1;
  while (dirent* entry = readdir(dir)) {
    int64_t step = 0;
    if (!ParseCheckpointStepDirName(entry->d_name, &step)) continue;
    struct stat st;
    std::string manifest = absl::StrCat(root, "/", CheckpointManifestPath(job, step));
    if (stat(manifest.c_str(), &st) == 0) latest = std::max(latest, step);
  }
  closedir(dir);
  return latest;
}

}  // namespace zeroshard
