#include "shard_server/checkpoint/checkpoint_manifest.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "shard_server/checkpoint/checkpoint_paths.h"

namespace zeroshard {
namespace {

using Json = nlohmann::ordered_json;

std::string BaseName(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("checkpoint manifest: ", what));
}

// An integer JSON value that T holds. nlohmann converts a float (1e43) or an
// unsigned integer past T's range with a bare cast, which is undefined
// behaviour for a float out of range (found by manifest_fuzzer).
template <typename T>
bool FitsInteger(const Json& value) {
  if (value.is_number_unsigned()) {
    return value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  }
  if (!value.is_number_integer()) return false;
  const int64_t v = value.get<int64_t>();
  return v >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
         static_cast<uint64_t>(std::max<int64_t>(v, 0)) <=
             static_cast<uint64_t>(std::numeric_limits<T>::max());
}

// Whether `value` may be read as T: integers must be integers in range.
template <typename T>
bool Representable(const Json& value) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return FitsInteger<T>(value);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (!value.is_array()) return true;  // get<> names the type error
    for (const Json& element : value) {
      if (!FitsInteger<int64_t>(element)) return false;
    }
    return true;
  } else {
    return true;
  }
}

// Reads a required field of `object` as T; false (and `error` set) if it is
// missing or of another type.
template <typename T>
bool Get(const Json& object, const char* key, T* out, absl::Status* error) {
  auto it = object.find(key);
  if (it == object.end()) {
    *error = Corrupt(absl::StrCat("field \"", key, "\" is missing"));
    return false;
  }
  if (!Representable<T>(*it)) {
    *error = Corrupt(absl::StrCat("field \"", key, "\": ", it->dump().substr(0, 64),
                                  " is not an integer of the range this field holds"));
    return false;
  }
  try {
    *out = it->get<T>();
  } catch (const Json::exception& e) {
    *error = Corrupt(absl::StrCat("field \"", key, "\": ", e.what()));
    return false;
  }
  return true;
}

}  // namespace

int64_t ManifestTensor::Rows() const { return shape.empty() ? 1 : shape[0]; }

int64_t ManifestTensor::RowElements() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

int64_t CheckpointManifest::TotalBytes() const {
  int64_t total = 0;
  for (const ManifestFile& f : files) total += f.size_bytes;
  return total;
}

absl::StatusOr<CheckpointManifest> BuildManifest(const std::string& job, int64_t step,
                                                 int64_t generation, const v1::ShardPlan& plan,
                                                 const std::vector<CommittedShard>& commits,
                                                 int64_t created_unix_ms) {
  CheckpointManifest m;
  m.job = job;
  m.step = step;
  m.world_size = plan.world_size();
  m.generation = generation;
  m.plan_hash = plan.hash();
  m.created_unix_ms = created_unix_ms;
  if (static_cast<int>(commits.size()) != m.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("manifest of step ", step, ": ", commits.size(),
                                                   " commits for world size ", m.world_size));
  }
  for (int r = 0; r < m.world_size; ++r) {
    const CommittedShard& c = commits[r];
    if (c.rank != r) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest of step ", step, ": commit ", r, " is of rank ", c.rank));
    }
    m.files.push_back(ManifestFile{BaseName(c.file), r, c.size_bytes, c.checksums});
  }
  m.optimizer = commits.empty() ? "" : commits[0].optimizer;
  m.optimizer_step = commits.empty() ? 0 : commits[0].optimizer_step;

  absl::flat_hash_map<std::string, size_t> index;
  for (const v1::Unit& unit : plan.units()) {
    for (const v1::TensorSpec& t : unit.tensors()) {
      if (!index.emplace(t.name(), m.tensors.size()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan ", plan.hash(), " lists tensor \"", t.name(), "\" twice"));
      }
      m.tensors.push_back(
          ManifestTensor{t.name(), {t.shape().begin(), t.shape().end()}, t.dtype()});
    }
  }
  m.pieces.resize(m.tensors.size());
  m.has_exp_avg = true;
  m.has_exp_avg_sq = true;
  m.has_outer_anchor = true;
  m.has_outer_momentum = true;
  for (const v1::Unit& unit : plan.units()) {
    for (const v1::Piece& p : unit.pieces()) {
      if (p.tensor() < 0 || p.tensor() >= unit.tensors_size() || p.rank() < 0 ||
          p.rank() >= m.world_size) {
        return absl::InvalidArgumentError(absl::StrCat("plan ", plan.hash(), ": a piece of unit \"",
                                                       unit.name(), "\" has tensor ", p.tensor(),
                                                       " rank ", p.rank()));
      }
      const std::string& name = unit.tensors(p.tensor()).name();
      const auto& checksums = m.files[p.rank()].checksums;
      auto has = [&](ShardTensorKind kind) {
        return checksums.count(ShardTensorName(kind, name, p.row_begin(), p.row_end())) > 0;
      };
      if (!has(ShardTensorKind::kParams)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", p.rank(), "'s commit has no tensor \"",
            ShardTensorName(ShardTensorKind::kParams, name, p.row_begin(), p.row_end()), "\""));
      }
      m.has_exp_avg = m.has_exp_avg && has(ShardTensorKind::kExpAvg);
      m.has_exp_avg_sq = m.has_exp_avg_sq && has(ShardTensorKind::kExpAvgSq);
      m.has_outer_anchor = m.has_outer_anchor && has(ShardTensorKind::kOuterAnchor);
      m.has_outer_momentum = m.has_outer_momentum && has(ShardTensorKind::kOuterMomentum);
      m.pieces[index[name]].push_back(ManifestPiece{p.rank(), p.row_begin(), p.row_end()});
    }
  }
  for (auto& pieces : m.pieces) {
    std::sort(pieces.begin(), pieces.end(), [](const ManifestPiece& a, const ManifestPiece& b) {
      return a.row_begin < b.row_begin;
    });
  }
  if (m.tensors.empty()) {
    m.has_exp_avg = m.has_exp_avg_sq = m.has_outer_anchor = m.has_outer_momentum = false;
  }
  return m;
}

std::string ManifestToJson(const CheckpointManifest& m) {
  Json j = Json::object();
  j["format"] = kManifestFormat;
  j["job"] = m.job;
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  j["generation"] = m.generation;
  j["plan_hash"] = m.plan_hash;
  j["created_unix_ms"] = m.created_unix_ms;
  j["optimizer"] = m.optimizer;
  j["optimizer_step"] = m.optimizer_step;
  j["optimizer_state"] = {{"exp_avg", m.has_exp_avg}, {"exp_avg_sq", m.has_exp_avg_sq}};
  if (m.has_outer_anchor || m.has_outer_momentum) {  // DiLoCo only: other manifests as before
    j["outer_state"] = {{"anchor", m.has_outer_anchor}, {"momentum", m.has_outer_momentum}};
  }
  j["total_bytes"] = m.TotalBytes();
  Json tensors = Json::array();
  for (const ManifestTensor& t : m.tensors) {
    tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}});
  }
  j["tensors"] = std::move(tensors);
  Json files = Json::array();
  for (const ManifestFile& f : m.files) {
    Json checksums = Json::object();
    for (const auto& [tensor, hex] : f.checksums) checksums[tensor] = hex;
    files.push_back({{"file", f.name},
                     {"rank", f.rank},
                     {"size_bytes", f.size_bytes},
                     {"checksums", std::move(checksums)}});
  }
  j["files"] = std::move(files);
  Json pieces = Json::object();
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    Json list = Json::array();
    for (const ManifestPiece& p : m.pieces[t]) {
      list.push_back({{"file", m.files[p.file].name},
                      {"tensor", ShardTensorName(ShardTensorKind::kParams, m.tensors[t].name,
                                                 p.row_begin, p.row_end)},
                      {"row_begin", p.row_begin},
                      {"row_end", p.row_end}});
    }
    pieces[m.tensors[t].name] = std::move(list);
  }
  j["pieces"] = std::move(pieces);
  return j.dump(1) + "\n";
}

namespace {

// The manifest's scalar fields: format, job, step, world size, generation,
// plan, times and optimizer.
absl::Status ParseManifestFields(const Json& j, CheckpointManifest* m) {
  absl::Status error;
  std::string format;
  if (!Get(j, "format", &format, &error)) return error;
  if (format != kManifestFormat) {
    return Corrupt(absl::StrCat("format is \"", format, "\"; expected ", kManifestFormat));
  }
  Json optimizer_state;
  if (!Get(j, "job", &m->job, &error) || !Get(j, "step", &m->step, &error) ||
      !Get(j, "world_size", &m->world_size, &error) ||
      !Get(j, "generation", &m->generation, &error) ||
      !Get(j, "plan_hash", &m->plan_hash, &error) ||
      !Get(j, "created_unix_ms", &m->created_unix_ms, &error) ||
      !Get(j, "optimizer", &m->optimizer, &error) ||
      !Get(j, "optimizer_step", &m->optimizer_step, &error) ||
      !Get(j, "optimizer_state", &optimizer_state, &error) ||
      !Get(optimizer_state, "exp_avg", &m->has_exp_avg, &error) ||
      !Get(optimizer_state, "exp_avg_sq", &m->has_exp_avg_sq, &error)) {
    return error;
  }
  // Optional: DiLoCo jobs' manifests only.
  if (j.contains("outer_state")) {
    Json outer_state;
    if (!Get(j, "outer_state", &outer_state, &error) ||
        !Get(outer_state, "anchor", &m->has_outer_anchor, &error) ||
        !Get(outer_state, "momentum", &m->has_outer_momentum, &error)) {
      return error;
    }
  }
  if (m->world_size < 1) return Corrupt(absl::StrCat("world_size is ", m->world_size));
  return absl::OkStatus();
}

// "files": one plain rank file per rank, in rank order, with its checksums;
// *file_index maps each name to its rank.
absl::Status ParseManifestFiles(const Json& j, CheckpointManifest* m,
                                absl::flat_hash_map<std::string, int>* file_index) {
  absl::Status error;
  Json files;
  if (!Get(j, "files", &files, &error)) return error;
  if (!files.is_array() || static_cast<int>(files.size()) != m->world_size) {
    return Corrupt(absl::StrCat("\"files\" should list ", m->world_size, " files"));
  }
  for (const Json& f : files) {
    ManifestFile file;
    Json checksums;
    if (!Get(f, "file", &file.name, &error) || !Get(f, "rank", &file.rank, &error) ||
        !Get(f, "size_bytes", &file.size_bytes, &error) ||
        !Get(f, "checksums", &checksums, &error)) {
      return error;
    }
    const int expected_rank = static_cast<int>(m->files.size());
    if (file.rank != expected_rank ||
        file.name != CheckpointShardFileName(expected_rank, m->world_size)) {
      return Corrupt(absl::StrCat("file ", expected_rank, " is \"", file.name, "\" of rank ",
                                  file.rank, "; expected ",
                                  CheckpointShardFileName(expected_rank, m->world_size)));
    }
    if (!checksums.is_object()) return Corrupt(absl::StrCat(file.name, ": checksums"));
    for (auto it = checksums.begin(); it != checksums.end(); ++it) {
      if (!it.value().is_string()) return Corrupt(absl::StrCat(file.name, ": checksums"));
      file.checksums[it.key()] = it.value().get<std::string>();
    }
    (*file_index)[file.name] = expected_rank;
    m->files.push_back(std::move(file));
  }
  return absl::OkStatus();
}

// The pieces of `tensor` (the JSON array `list`): each names a known file
// whose checksums include the piece's shard tensors (and their moments when
// the manifest has them), and together they tile rows [0, Rows()) in order.
absl::StatusOr<std::vector<ManifestPiece>> ParseTensorPieces(
    const ManifestTensor& tensor, const Json& list, const CheckpointManifest& m,
    const absl::flat_hash_map<std::string, int>& file_index) {
  absl::Status error;
  std::vector<ManifestPiece> tensor_pieces;
  int64_t next_row = 0;
  for (const Json& p : list) {
    std::string file_name, shard_tensor;
    ManifestPiece piece;
    if (!Get(p, "file", &file_name, &error) || !Get(p, "tensor", &shard_tensor, &error) ||
        !Get(p, "row_begin", &piece.row_begin, &error) ||
        !Get(p, "row_end", &piece.row_end, &error)) {
      return error;
    }
    auto f = file_index.find(file_name);
    if (f == file_index.end()) {
      return Corrupt(
          absl::StrCat("a piece of \"", tensor.name, "\" names unknown file \"", file_name, "\""));
    }
    piece.file = f->second;
    if (piece.row_begin != next_row || piece.row_end <= piece.row_begin ||
        piece.row_end > tensor.Rows()) {
      return Corrupt(absl::StrCat("pieces of \"", tensor.name, "\" do not tile rows [0, ",
                                  tensor.Rows(), "): [", piece.row_begin, ", ", piece.row_end,
                                  ") after row ", next_row));
    }
    next_row = piece.row_end;
    const auto& checksums = m.files[piece.file].checksums;
    for (ShardTensorKind kind :
         {ShardTensorKind::kParams, ShardTensorKind::kExpAvg, ShardTensorKind::kExpAvgSq,
          ShardTensorKind::kOuterAnchor, ShardTensorKind::kOuterMomentum}) {
      if (kind == ShardTensorKind::kExpAvg && !m.has_exp_avg) continue;
      if (kind == ShardTensorKind::kExpAvgSq && !m.has_exp_avg_sq) continue;
      if (kind == ShardTensorKind::kOuterAnchor && !m.has_outer_anchor) continue;
      if (kind == ShardTensorKind::kOuterMomentum && !m.has_outer_momentum) continue;
      std::string name = ShardTensorName(kind, tensor.name, piece.row_begin, piece.row_end);
      if (kind == ShardTensorKind::kParams && name != shard_tensor) {
        return Corrupt(absl::StrCat("piece \"", shard_tensor, "\" of \"", tensor.name,
                                    "\" should be named \"", name, "\""));
      }
      if (checksums.count(name) == 0) {
        return Corrupt(absl::StrCat("file ", file_name, " has no checksum for \"", name, "\""));
      }
    }
    tensor_pieces.push_back(piece);
  }
  if (next_row != tensor.Rows()) {
    return Corrupt(absl::StrCat("pieces of \"", tensor.name, "\" cover rows [0, ", next_row,
                                ") of ", tensor.Rows()));
  }
  return tensor_pieces;
}

}  // namespace

absl::StatusOr<CheckpointManifest> ParseManifestJson(absl::string_view text) {
  Json j;
  try {
    j = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return Corrupt(absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return Corrupt("not a JSON object");
  CheckpointManifest m;
  if (absl::Status s = ParseManifestFields(j, &m); !s.ok()) return s;
  absl::flat_hash_map<std::string, int> file_index;
  if (absl::Status s = ParseManifestFiles(j, &m, &file_index); !s.ok()) return s;

  absl::Status error;
  Json tensors, pieces;
  if (!Get(j, "tensors", &tensors, &error) || !Get(j, "pieces", &pieces, &error)) return error;
  if (!tensors.is_array() || !pieces.is_object()) return Corrupt("tensors / pieces");
  for (const Json& t : tensors) {
    ManifestTensor tensor;
    if (!Get(t, "name", &tensor.name, &error) || !Get(t, "shape", &tensor.shape, &error) ||
        !Get(t, "dtype", &tensor.dtype, &error)) {
      return error;
    }
    for (int64_t d : tensor.shape) {
      if (d < 0) return Corrupt(absl::StrCat("tensor \"", tensor.name, "\" has a negative dim"));
    }
    auto list = pieces.find(tensor.name);
    if (list == pieces.end() || !list->is_array()) {
      return Corrupt(absl::StrCat("tensor \"", tensor.name, "\" has no pieces"));
    }
    absl::StatusOr<std::vector<ManifestPiece>> tensor_pieces =
        ParseTensorPieces(tensor, *list, m, file_index);
    if (!tensor_pieces.ok()) return tensor_pieces.status();
    m.tensors.push_back(std::move(tensor));
    m.pieces.push_back(*std::move(tensor_pieces));
  }
  return m;
}

std::string ChecksumsToJson(const std::map<std::string, std::string>& checksums) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [tensor, hex] : checksums) j[tensor] = hex;
  return j.dump();
}

bool ChecksumsFromJson(const std::string& text, std::map<std::string, std::string>* out) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it.value().is_string()) return false;
    (*out)[it.key()] = it.value().get<std::string>();
  }
  return true;
}

}  // namespace zeroshard
