#include "shard_server/checkpoint/shard_file_validator.h"

#include <errno.h>
#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "common/model_spec.h"
#include "common/safetensors.h"

namespace zeroshard {
namespace {

using Checksums = std::map<std::string, std::string>;  // tensor -> xxh64 hex

absl::Status NotAsCommitted(const std::string& file, absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat("'", file, "': ", what));
}

// The file is below the root, regular, and as long as the commit says.
absl::Status CheckFileOnDisk(const CheckpointRoot& root, const v1::CommitShardRequest& request) {
  const std::string& file = request.file();
  absl::Status inside = root.CheckInside(file);
  if (absl::IsNotFound(inside)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot commit '", file, "': ", inside.message(),
                     "; write it (or UploadShard it) before committing"));
  }
  if (!inside.ok()) return inside;
  const std::string path = root.Join(file);
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", file, "' is not a regular file"));
  }
  if (st.st_size != request.size_bytes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", file, "' is ", st.st_size, " bytes; the commit says ",
                     request.size_bytes(), " (not completely written?)"));
  }
  return absl::OkStatus();
}

std::string MetadataValue(const SafetensorsMetadata& meta, const std::string& key) {
  auto it = meta.find(key);
  return it == meta.end() ? std::string("<missing>") : it->second;
}

// The __metadata__ names this format, job, step, rank, world size and plan.
absl::Status CheckShardMetadata(const SafetensorsMetadata& meta,
                                const v1::CommitShardRequest& request, int world_size,
                                const v1::ShardPlan& plan) {
  const v1::MemberCredentials& member = request.member();
  const std::pair<std::string, std::string> expected_meta[] = {
      {ShardMetadataKey::kFormat, kShardFormat},
      {ShardMetadataKey::kJob, member.job_id()},
      {ShardMetadataKey::kStep, absl::StrCat(request.step())},
      {ShardMetadataKey::kRank, absl::StrCat(member.rank())},
      {ShardMetadataKey::kWorldSize, absl::StrCat(world_size)},
      {ShardMetadataKey::kPlanHash, plan.hash()},
  };
  for (const auto& [key, expected] : expected_meta) {
    const std::string value = MetadataValue(meta, key);
    if (value != expected) {
      return NotAsCommitted(request.file(), absl::StrCat("__metadata__ ", key, " is \"", value,
                                                         "\"; expected \"", expected, "\""));
    }
  }
  return absl::OkStatus();
}

// The commit's checksums in canonical hex; INVALID_ARGUMENT for a bad or
// repeated one.
absl::StatusOr<Checksums> ChecksumsOfCommit(const v1::CommitShardRequest& request) {
  Checksums sums;
  for (const v1::TensorChecksum& c : request.checksums()) {
    absl::StatusOr<uint64_t> value = ParseChecksumHex(c.xxh64());
    if (!value.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checksum of tensor \"", c.tensor(), "\": ", value.status().message()));
    }
    if (!sums.emplace(c.tensor(), ChecksumToHex(*value)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("the commit lists tensor \"", c.tensor(), "\" twice"));
    }
  }
  return sums;
}

// The file's __metadata__ checksums, hex in lower case.
absl::StatusOr<Checksums> ChecksumsOfTheFile(const SafetensorsMetadata& meta,
                                             const std::string& file) {
  Checksums file_sums;
  if (!ChecksumsFromJson(MetadataValue(meta, ShardMetadataKey::kChecksums), &file_sums)) {
    return NotAsCommitted(file,
                          "__metadata__ checksums is not a JSON object of tensor -> "
                          "xxh64 hex");
  }
  for (auto& [tensor, hex] : file_sums) hex = absl::AsciiStrToLower(hex);
  return file_sums;
}

// The commit's checksums are the file's own, tensor for tensor.
absl::Status CheckChecksumsMatch(const Checksums& file_sums, const Checksums& sums,
                                 const std::string& file) {
  for (const auto& [tensor, hex] : sums) {
    auto it = file_sums.find(tensor);
    if (it == file_sums.end()) {
      return NotAsCommitted(
          file, absl::StrCat("the commit has a checksum for \"", tensor, "\", the file does not"));
    }
    if (it->second != hex) {
      return NotAsCommitted(
          file, absl::StrCat("checksum of \"", tensor, "\" is ", hex, " in the commit but ",
                             it->second, " in the file's metadata"));
    }
  }
  for (const auto& [tensor, hex] : file_sums) {
    if (sums.count(tensor) == 0) {
      return NotAsCommitted(
          file, absl::StrCat("the file has a checksum for \"", tensor, "\", the commit does not"));
    }
  }
  return absl::OkStatus();
}

// A piece of the plan this rank must hold, by its parameter tensor's name.
struct ExpectedPiece {
  const v1::TensorSpec* spec;
  int64_t rows;
  bool seen;
};
using ExpectedPieces = absl::flat_hash_map<std::string, ExpectedPiece>;

ExpectedPieces PiecesOfRank(const v1::ShardPlan& plan, int rank) {
  ExpectedPieces expected;
  for (const v1::Unit& unit : plan.units()) {
    for (const v1::Piece& p : unit.pieces()) {
      if (p.rank() != rank || p.tensor() < 0 || p.tensor() >= unit.tensors_size()) continue;
      const v1::TensorSpec& spec = unit.tensors(p.tensor());
      expected[ShardTensorName(ShardTensorKind::kParams, spec.name(), p.row_begin(), p.row_end())] =
          {&spec, p.row_end() - p.row_begin(), false};
    }
  }
  return expected;
}

// The expected piece that file tensor `name` belongs to (a parameter piece,
// or one of its moments); end() if none. Sets *params_name to the piece's
// parameter name.
ExpectedPieces::iterator FindPiece(ExpectedPieces& expected, const std::string& name,
                                   std::string* params_name) {
  // A parameter piece by its full name first: a model tensor may itself be
  // called "optim.exp_avg.<...>".
  *params_name = name;
  auto it = expected.find(name);
  if (it != expected.end()) return it;
  ParsedShardTensorName parsed;
  if (!ParseShardTensorName(name, &parsed) || parsed.kind == ShardTensorKind::kParams) return it;
  *params_name =
      ShardTensorName(ShardTensorKind::kParams, parsed.tensor, parsed.row_begin, parsed.row_end);
  return expected.find(*params_name);
}

// The file holds exactly this rank's pieces of the plan, each F32 with the
// piece's rows, each with a checksum.
absl::Status CheckPiecesOfThePlan(const SafetensorsReader& reader, const std::string& file,
                                  int rank, const v1::ShardPlan& plan, const Checksums& sums) {
  ExpectedPieces expected = PiecesOfRank(plan, rank);
  for (const TensorInfo& t : reader.tensors()) {
    if (sums.count(t.name) == 0) {
      return NotAsCommitted(file, absl::StrCat("tensor \"", t.name, "\" has no checksum"));
    }
    std::string params_name;
    auto it = FindPiece(expected, t.name, &params_name);
    if (it == expected.end()) {
      return NotAsCommitted(file, absl::StrCat("tensor \"", t.name, "\" is not a piece of rank ",
                                               rank, " in plan ", plan.hash()));
    }
    std::vector<int64_t> shape(it->second.spec->shape().begin(), it->second.spec->shape().end());
    if (!shape.empty()) shape[0] = it->second.rows;
    if (t.dtype != DType::kF32 || t.shape != shape) {
      return NotAsCommitted(
          file, absl::StrCat("tensor \"", t.name, "\" is ", DTypeName(t.dtype), " ",
                             ShapeString(t.shape), "; expected F32 ", ShapeString(shape)));
    }
    if (params_name == t.name) it->second.seen = true;
  }
  for (const auto& [name, e] : expected) {
    if (!e.seen) {
      return NotAsCommitted(file,
                            absl::StrCat("piece \"", name, "\" of rank ", rank, " is missing"));
    }
  }
  if (sums.size() != reader.tensors().size()) {
    return NotAsCommitted(
        file, absl::StrCat(sums.size(), " checksums for ", reader.tensors().size(), " tensors"));
  }
  return absl::OkStatus();
}

// The optimizer and its step count from the __metadata__ (absent: "" and 0).
absl::Status ReadOptimizer(const SafetensorsMetadata& meta, const std::string& file,
                           CommittedShard* shard) {
  auto optimizer = meta.find(ShardMetadataKey::kOptimizer);
  if (optimizer != meta.end()) shard->optimizer = optimizer->second;
  auto optimizer_step = meta.find(ShardMetadataKey::kOptimizerStep);
  if (optimizer_step != meta.end() &&
      !absl::SimpleAtoi(optimizer_step->second, &shard->optimizer_step)) {
    return NotAsCommitted(file, absl::StrCat("__metadata__ optimizer_step \"",
                                             optimizer_step->second, "\" is not an integer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CommittedShard> ValidateShardFile(const CheckpointRoot& root,
                                                 const v1::CommitShardRequest& request,
                                                 int world_size, const v1::ShardPlan& plan) {
  const std::string& file = request.file();
  if (absl::Status s = CheckFileOnDisk(root, request); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::Open(root.Join(file));
  if (!reader.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", file, "' is not a readable safetensors shard: ", reader.status().message()));
  }
  const SafetensorsMetadata& meta = (*reader)->metadata();
  if (absl::Status s = CheckShardMetadata(meta, request, world_size, plan); !s.ok()) return s;
  absl::StatusOr<Checksums> file_sums = ChecksumsOfTheFile(meta, file);
  if (!file_sums.ok()) return file_sums.status();
  absl::StatusOr<Checksums> sums = ChecksumsOfCommit(request);
  if (!sums.ok()) return sums.status();
  if (absl::Status s = CheckChecksumsMatch(*file_sums, *sums, file); !s.ok()) return s;
  const int rank = request.member().rank();
  if (absl::Status s = CheckPiecesOfThePlan(**reader, file, rank, plan, *sums); !s.ok()) return s;

  CommittedShard shard;
  shard.rank = rank;
  shard.file = file;
  shard.size_bytes = request.size_bytes();
  shard.checksums = *std::move(sums);
  if (absl::Status s = ReadOptimizer(meta, file, &shard); !s.ok()) return s;
  return shard;
}

}  // namespace zeroshard
