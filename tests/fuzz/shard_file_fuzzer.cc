// A rank's shard file as the server admits and reads it: the bytes are the
// file at <root>/j/step-1/rank-0-of-1.safetensors, committed with the
// checksums its own __metadata__ claims (so the fuzzer reaches past the
// commit's comparison). Admission (ValidateShardFile) gives a commit or an
// error; an admitted file's manifest is built and every tensor read back and
// checked against its XXH64 (Consolidator::Verify, what the server's
// background verifier runs): OK or DATA_LOSS, never a crash.
//
// ZEROSHARD_FUZZ_WRITE_SEED=PATH writes a valid shard file for the plan used
// here to PATH and exits: how corpus/shard_file_fuzzer/valid_w1 was made.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/checksum.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "common/safetensors.h"
#include "shard_server/checkpoint/checkpoint_consolidator.h"
#include "shard_server/checkpoint/checkpoint_manifest.h"
#include "shard_server/checkpoint/checkpoint_paths.h"
#include "shard_server/checkpoint/shard_file_validator.h"

namespace {

using namespace zeroshard;  // NOLINT: a test driver

constexpr char kJob[] = "j";
constexpr int64_t kStep = 1;

const v1::ShardPlan& ThePlan() {
  static const v1::ShardPlan* plan = [] {
    ModelSpec spec;
    spec.tensors = {{"0.weight", {8, 4}, "F32", "0"},
                    {"0.bias", {8}, "F32", "0"},
                    {"1.weight", {2, 8}, "F32", "1"}};
    absl::StatusOr<ShardPlan> p = Plan(spec, /*world_size=*/1, PlanOptions());
    if (!p.ok()) std::abort();
    return new v1::ShardPlan(ShardPlanToProto(*p));
  }();
  return *plan;
}

// The checkpoint root, removed when the fuzzer exits.
char g_root_dir[] = "/dev/shm/shard_file_fuzzer.XXXXXX";
void RemoveRoot() {
  std::error_code ignored;
  std::filesystem::remove_all(g_root_dir, ignored);
}

const CheckpointRoot& TheRoot() {
  static const CheckpointRoot* root = [] {
    // On tmpfs (every input is written as a file: 6x the executions per
    // second of a disk-backed /tmp), under /tmp where there is no /dev/shm.
    char* dir = g_root_dir;
    if (mkdtemp(dir) == nullptr) {
      std::snprintf(g_root_dir, sizeof(g_root_dir), "/tmp/shard_file_fuzzer.XXXXXX");
      if (mkdtemp(dir) == nullptr) std::abort();
    }
    std::atexit(RemoveRoot);
    absl::StatusOr<CheckpointRoot> r = CheckpointRoot::Open(dir);
    if (!r.ok() || !r->MakeDirs(CheckpointStepDir(kJob, kStep)).ok()) std::abort();
    return new CheckpointRoot(*r);
  }();
  return *root;
}

// Counts nothing, cancels nothing: Verify's progress goes nowhere.
class NoOutput : public ConsolidationOutput {
 public:
  absl::StatusOr<ByteSink*> BeginFile(const std::string&, int64_t) override {
    return absl::UnimplementedError("verification writes nothing");
  }
  absl::Status EndFile() override { return absl::OkStatus(); }
  absl::Status Progress(int64_t, int64_t) override { return absl::OkStatus(); }
};

v1::CommitShardRequest CommitOf(absl::string_view bytes) {
  v1::CommitShardRequest request;
  request.mutable_member()->set_job_id(kJob);
  request.mutable_member()->set_rank(0);
  request.set_step(kStep);
  request.set_file(CheckpointShardPath(kJob, kStep, 0, 1));
  request.set_size_bytes(static_cast<int64_t>(bytes.size()));
  auto reader = SafetensorsReader::OpenBuffer("fuzz", bytes);
  if (!reader.ok()) return request;
  auto it = (*reader)->metadata().find(ShardMetadataKey::kChecksums);
  std::map<std::string, std::string> sums;
  if (it != (*reader)->metadata().end() && ChecksumsFromJson(it->second, &sums)) {
    for (const auto& [tensor, hex] : sums) {
      v1::TensorChecksum* c = request.add_checksums();
      c->set_tensor(tensor);
      c->set_xxh64(hex);
    }
  }
  return request;
}

// A shard file of ThePlan() with every piece, its metadata and checksums.
void WriteSeed(const std::string& path) {
  std::vector<TensorEntry> entries;
  std::string data;
  std::map<std::string, std::string> sums;
  for (const v1::Unit& unit : ThePlan().units()) {
    for (const v1::Piece& p : unit.pieces()) {
      const v1::TensorSpec& t = unit.tensors(p.tensor());
      std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
      int64_t row_elements = 1;
      for (size_t d = 1; d < shape.size(); ++d) row_elements *= shape[d];
      shape[0] = p.row_end() - p.row_begin();
      std::vector<float> values(shape[0] * row_elements, 0.25f);
      const std::string name =
          ShardTensorName(ShardTensorKind::kParams, t.name(), p.row_begin(), p.row_end());
      entries.push_back({name, DType::kF32, shape});
      std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * 4);
      sums[name] = ChecksumToHex(Checksum(bytes));
      data += bytes;
    }
  }
  SafetensorsMetadata meta = {{ShardMetadataKey::kFormat, kShardFormat},
                              {ShardMetadataKey::kJob, kJob},
                              {ShardMetadataKey::kStep, absl::StrCat(kStep)},
                              {ShardMetadataKey::kRank, "0"},
                              {ShardMetadataKey::kWorldSize, "1"},
                              {ShardMetadataKey::kPlanHash, ThePlan().hash()},
                              {ShardMetadataKey::kChecksums, ChecksumsToJson(sums)}};
  auto writer = SafetensorsWriter::Create(path, entries, meta);
  if (!writer.ok() || !(*writer)->Append(data.data(), data.size()).ok() ||
      !(*writer)->Finish().ok()) {
    std::abort();
  }
}

// Writes `bytes` as the shard file, admits it and verifies every tensor.
absl::Status AdmitAndVerify(absl::string_view bytes) {
  const CheckpointRoot& root = TheRoot();
  const std::string file = CheckpointShardPath(kJob, kStep, 0, 1);
  {
    std::ofstream out(root.Join(file), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) std::abort();
  }
  absl::StatusOr<CommittedShard> commit =
      ValidateShardFile(root, CommitOf(bytes), /*world_size=*/1, ThePlan());
  if (!commit.ok()) return commit.status();
  absl::StatusOr<CheckpointManifest> manifest =
      BuildManifest(kJob, kStep, /*generation=*/1, ThePlan(), {*commit}, /*created_unix_ms=*/0);
  if (!manifest.ok()) return manifest.status();
  if (!ParseManifestJson(ManifestToJson(*manifest)).ok()) std::abort();  // ours must read back
  NoOutput output;
  Consolidator consolidator(root, *manifest, ConsolidationOptions());
  return consolidator.Verify(&output).status();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seed = std::getenv("ZEROSHARD_FUZZ_WRITE_SEED")) {
    WriteSeed(seed);
    std::ifstream in(seed, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const absl::Status admitted = AdmitAndVerify(bytes);
    std::fprintf(stderr, "seed %s: %s\n", seed, admitted.ToString().c_str());
    std::exit(admitted.ok() ? 0 : 1);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)AdmitAndVerify(absl::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
