#include "tests/testing/shard_files.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace zeroshard::testing {

// Element `element` of model tensor `tensor` (spec index) for one kind.
float Value(int kind, int tensor, int64_t element) {
  uint64_t x = (static_cast<uint64_t>(tensor) * 1000003u + static_cast<uint64_t>(element) * 7919u +
                static_cast<uint64_t>(kind) * 104729u) %
               2003u;
  return (static_cast<float>(x) - 1001.0f) / 997.0f;
}

absl::StatusOr<ShardFile> WriteShardFile(const std::string& dir, const std::string& job,
                                         const v1::ShardPlan& plan, int64_t step, int rank,
                                         int64_t generation, bool optimizer) {
  std::map<std::string, int> index;
  for (const v1::Unit& unit : plan.units()) {
    for (const v1::TensorSpec& t : unit.tensors()) index.emplace(t.name(), index.size());
  }
  std::vector<TensorEntry> entries;
  std::vector<std::vector<float>> values;
  for (int kind = 0; kind < (optimizer ? 3 : 1); ++kind) {
    for (const v1::Unit& unit : plan.units()) {
      for (const v1::Piece& p : unit.pieces()) {
        if (p.rank() != rank) continue;
        const v1::TensorSpec& spec = unit.tensors(p.tensor());
        std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
        int64_t row_elements = 1;
        for (size_t d = 1; d < shape.size(); ++d) row_elements *= shape[d];
        if (!shape.empty()) shape[0] = p.row_end() - p.row_begin();
        entries.push_back(
            {absl::StrCat(kPrefix[kind], spec.name(), ":", p.row_begin(), "-", p.row_end()),
             DType::kF32, shape});
        values.emplace_back();
        for (int64_t e = p.row_begin() * row_elements; e < p.row_end() * row_elements; ++e) {
          values.back().push_back(Value(kind, index[spec.name()], e));
        }
      }
    }
  }
  ShardFile out;
  out.relative =
      absl::StrCat(job, "/step-", step, "/rank-", rank, "-of-", plan.world_size(), ".safetensors");
  out.path = absl::StrCat(dir, "/", out.relative);
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  for (size_t i = 0; i < entries.size(); ++i) {
    std::string hex = ChecksumToHex(Checksum(values[i].data(), values[i].size() * 4));
    checksums[entries[i].name] = hex;
    out.checksums[entries[i].name] = hex;
  }
  testing::RunCommand(absl::StrCat("mkdir -p ", dir, "/", job, "/step-", step));
  SafetensorsMetadata metadata = {{"format", "zeroshard-shard-v1"},
                                  {"job", job},
                                  {"step", absl::StrCat(step)},
                                  {"rank", absl::StrCat(rank)},
                                  {"world_size", absl::StrCat(plan.world_size())},
                                  {"generation", absl::StrCat(generation)},
                                  {"plan_hash", plan.hash()},
                                  {"optimizer", "adam"},
                                  {"optimizer_step", absl::StrCat(step)},
                                  {"checksums", checksums.dump()}};
  auto writer = SafetensorsWriter::Create(out.path, entries, metadata);
  if (!writer.ok()) return writer.status();
  for (const auto& v : values) {
    if (absl::Status s = (*writer)->Append(v.data(), v.size() * 4); !s.ok()) return s;
  }
  if (absl::Status s = (*writer)->Finish(); !s.ok()) return s;
  out.size = (*writer)->file_size();
  return out;
}

}  // namespace zeroshard::testing
