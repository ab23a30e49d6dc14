// The checkpoint registry, manifest, retention and consolidator on real shard
// files in a temporary directory, written here in the worker's format, with a
// real SQLite state store. No gRPC: the service tests are in
// tests/integration/checkpoint_server_test.cc.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/model_spec.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shard_server/checkpoint/checkpoint_consolidator.h"
#include "shard_server/checkpoint/checkpoint_manifest.h"
#include "shard_server/checkpoint/checkpoint_paths.h"
#include "shard_server/checkpoint/checkpoint_registry.h"
#include "shard_server/base/event_log.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "shard_server/state/state_store.h"
#include "tests/testing/process.h"
#include "tests/testing/state_faults.h"

namespace zeroshard {
namespace {

constexpr char kJob[] = "job-a";
constexpr int kWorld = 2;

// A model with a tensor the plan cuts across ranks, a 0-d tensor and a tensor
// larger than the small read buffer some tests use.
ModelSpec TestSpec() {
  ModelSpec spec;
  spec.tensors = {{"embed.weight", {300, 8}}, {"0.weight", {16, 8}}, {"0.bias", {16}},
                  {"scale", {}},              {"1.weight", {4, 16}}};
  return spec;
}

v1::ShardPlan MakePlan(const ModelSpec& spec, int world) {
  absl::StatusOr<ShardPlan> plan = Plan(spec, world, PlanOptions());
  EXPECT_TRUE(plan.ok()) << plan.status();
  return ShardPlanToProto(*plan);
}

// Element `element` (row-major, whole tensor) of model tensor `tensor` (spec
// index): distinct per kind, tensor and element, and not exact in BF16.
float Value(ShardTensorKind kind, int tensor, int64_t element) {
  uint64_t x = (static_cast<uint64_t>(tensor) * 1000003u + static_cast<uint64_t>(element) * 7919u +
                static_cast<uint64_t>(kind) * 104729u) %
               2003u;
  return (static_cast<float>(x) - 1001.0f) / 997.0f;
}

struct ShardFile {
  std::string relative;
  int64_t size = 0;
  std::map<std::string, std::string> checksums;
};

// Writes rank `rank`'s shard file of `step` as a worker does: its pieces'
// parameters, then (with `optimizer`) both Adam moments and (with `outer`)
// a DiLoCo job's outer anchor and momentum and its outer step 3, checksums
// in the metadata.
ShardFile WriteShard(const std::string& root, const std::string& job, int64_t step, int rank,
                     const v1::ShardPlan& plan, bool optimizer = true, int64_t optimizer_step = 7,
                     bool outer = false) {
  std::map<std::string, int> index;
  for (const v1::Unit& unit : plan.units()) {
    for (const v1::TensorSpec& t : unit.tensors()) index.emplace(t.name(), index.size());
  }
  struct Item {
    TensorEntry entry;
    std::vector<float> values;
  };
  std::vector<Item> items;
  std::vector<ShardTensorKind> kinds = {ShardTensorKind::kParams};
  if (optimizer) kinds.insert(kinds.end(), {ShardTensorKind::kExpAvg, ShardTensorKind::kExpAvgSq});
  if (outer) {
    kinds.insert(kinds.end(), {ShardTensorKind::kOuterAnchor, ShardTensorKind::kOuterMomentum});
  }
  for (ShardTensorKind kind : kinds) {
    for (const v1::Unit& unit : plan.units()) {
      for (const v1::Piece& p : unit.pieces()) {
        if (p.rank() != rank) continue;
        const v1::TensorSpec& spec = unit.tensors(p.tensor());
        std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
        int64_t row_elements = 1;
        for (size_t d = 1; d < shape.size(); ++d) row_elements *= shape[d];
        if (!shape.empty()) shape[0] = p.row_end() - p.row_begin();
        Item item;
        item.entry = {ShardTensorName(kind, spec.name(), p.row_begin(), p.row_end()),
                      DType::kF32, shape};
        for (int64_t e = p.row_begin() * row_elements; e < p.row_end() * row_elements; ++e) {
          item.values.push_back(Value(kind, index[spec.name()], e));
        }
        items.push_back(std::move(item));
      }
    }
  }
  ShardFile out;
  out.relative = CheckpointShardPath(job, step, rank, plan.world_size());
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  std::vector<TensorEntry> entries;
  for (const Item& item : items) {
    std::string hex = ChecksumToHex(Checksum(item.values.data(), item.values.size() * 4));
    checksums[item.entry.name] = hex;
    out.checksums[item.entry.name] = hex;
    entries.push_back(item.entry);
  }
  SafetensorsMetadata metadata = {{"format", "zeroshard-shard-v1"},
                                  {"job", job},
                                  {"step", absl::StrCat(step)},
                                  {"rank", absl::StrCat(rank)},
                                  {"world_size", absl::StrCat(plan.world_size())},
                                  {"generation", "1"},
                                  {"plan_hash", plan.hash()},
                                  {"optimizer", "adam"},
                                  {"optimizer_step", absl::StrCat(optimizer_step)},
                                  {"checksums", checksums.dump()}};
  if (outer) metadata["outer_step"] = "3";
  absl::StatusOr<CheckpointRoot> r = CheckpointRoot::Open(root);
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r->MakeDirs(CheckpointStepDir(job, step)).ok());
  auto writer = SafetensorsWriter::Create(absl::StrCat(root, "/", out.relative), entries, metadata);
  EXPECT_TRUE(writer.ok()) << writer.status();
  for (const Item& item : items) {
    EXPECT_TRUE((*writer)->Append(item.values.data(), item.values.size() * 4).ok());
  }
  EXPECT_TRUE((*writer)->Finish().ok());
  out.size = (*writer)->file_size();
  return out;
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// Collects consolidated files in memory.
class MemoryOutput : public ConsolidationOutput, private ByteSink {
 public:
  absl::StatusOr<ByteSink*> BeginFile(const std::string& name, int64_t size_bytes) override {
    files.emplace_back(name, "");
    sizes.push_back(size_bytes);
    return static_cast<ByteSink*>(this);
  }
  absl::Status EndFile() override {
    EXPECT_EQ(static_cast<int64_t>(files.back().second.size()), sizes.back()) << files.back().first;
    return absl::OkStatus();
  }
  absl::Status Progress(int64_t done, int64_t total) override {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
    return absl::OkStatus();
  }

  std::vector<std::pair<std::string, std::string>> files;
  std::vector<int64_t> sizes;
  int64_t last_done = 0;
  int64_t last_total = 0;

 private:
  absl::Status Write(const void* data, size_t size) override {
    files.back().second.append(static_cast<const char*>(data), size);
    return absl::OkStatus();
  }
};

class CheckpointRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("checkpoint_registry");
    root_ = dir_ + "/root";
    spec_ = TestSpec();
    plan_ = MakePlan(spec_, kWorld);
    plans_[{kJob, 1}] = plan_;
    Reopen(/*keep_last=*/0);
  }

  void Reopen(int keep_last) {
    registry_.reset();
    state_.reset();
    auto state = StateStore::Open(dir_ + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    state_ = *std::move(state);
    auto registry = CheckpointRegistry::Open(
        {root_, keep_last}, state_.get(), &log_,
        [this](const std::string& job, int64_t generation) -> absl::StatusOr<v1::ShardPlan> {
          auto it = plans_.find({job, generation});
          if (it == plans_.end()) return absl::NotFoundError("no plan");
          return it->second;
        });
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = *std::move(registry);
  }

  v1::CommitShardRequest Request(const ShardFile& f, int rank, int64_t step,
                                 int64_t generation = 1) {
    v1::CommitShardRequest request;
    request.mutable_member()->set_job_id(kJob);
    request.mutable_member()->set_generation(generation);
    request.mutable_member()->set_rank(rank);
    request.mutable_member()->set_token("token");
    request.set_step(step);
    request.set_file(f.relative);
    request.set_size_bytes(f.size);
    for (const auto& [tensor, hex] : f.checksums) {
      v1::TensorChecksum* c = request.add_checksums();
      c->set_tensor(tensor);
      c->set_xxh64(hex);
    }
    return request;
  }

  absl::StatusOr<v1::CommitShardResponse> Commit(const v1::CommitShardRequest& request) {
    return registry_->Commit(request, kWorld);
  }

  // Writes and commits every rank of `step`.
  void CompleteStep(int64_t step, bool optimizer = true, bool outer = false) {
    for (int r = 0; r < kWorld; ++r) {
      ShardFile f = WriteShard(root_, kJob, step, r, plan_, optimizer, 7, outer);
      auto response = Commit(Request(f, r, step));
      ASSERT_TRUE(response.ok()) << response.status();
      EXPECT_EQ(response->step_complete(), r == kWorld - 1);
    }
  }

  std::string StepDir(int64_t step) const {
    return absl::StrCat(root_, "/", CheckpointStepDir(kJob, step));
  }

  const v1::CheckpointInfo* Find(const v1::ListCheckpointsResponse& list, int64_t step) {
    for (const auto& c : list.checkpoints()) {
      if (c.step() == step) return &c;
    }
    return nullptr;
  }

  bool Logged(absl::string_view event) {
    absl::MutexLock lock(&mu_);
    for (const std::string& line : lines_) {
      if (absl::StrContains(line, absl::StrCat("event=", event, " "))) return true;
    }
    return false;
  }

  std::string dir_;
  std::string root_;
  ModelSpec spec_;
  v1::ShardPlan plan_;
  std::map<std::pair<std::string, int64_t>, v1::ShardPlan> plans_;
  absl::Mutex mu_;
  std::vector<std::string> lines_;
  EventLog log_{[this](const std::string& line) {
    absl::MutexLock lock(&mu_);
    lines_.push_back(line);
  }};
  std::unique_ptr<StateStore> state_;
  std::unique_ptr<CheckpointRegistry> registry_;
};

TEST_F(CheckpointRegistryTest, TheTestPlanCutsATensorAcrossRanks) {
  bool cut = false;
  for (const v1::Unit& unit : plan_.units()) {
    std::map<int, std::set<int>> ranks;
    for (const v1::Piece& p : unit.pieces()) ranks[p.tensor()].insert(p.rank());
    for (const auto& [tensor, r] : ranks) cut = cut || r.size() > 1;
  }
  EXPECT_TRUE(cut) << "the merge tests need a tensor split over ranks";
}

TEST_F(CheckpointRegistryTest, StepCompletesOnlyWhenEveryRankCommitted) {
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  ShardFile f1 = WriteShard(root_, kJob, 10, 1, plan_);
  auto first = Commit(Request(f0, 0, 10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->step_complete());
  EXPECT_EQ(first->committed(), 1);
  EXPECT_FALSE(Exists(StepDir(10) + "/manifest.json"));
  auto list = registry_->List(kJob);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_FALSE(list->checkpoints(0).complete());
  EXPECT_EQ(list->checkpoints(0).committed(), 1);
  EXPECT_TRUE(list->checkpoints(0).manifest().empty());

  auto second = Commit(Request(f1, 1, 10));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->step_complete());
  EXPECT_EQ(second->committed(), 2);
  EXPECT_TRUE(Logged("checkpoint_complete"));

  list = registry_->List(kJob);
  ASSERT_TRUE(list.ok());
  const v1::CheckpointInfo& info = list->checkpoints(0);
  EXPECT_TRUE(info.complete());
  EXPECT_EQ(info.world_size(), kWorld);
  EXPECT_EQ(info.total_bytes(), f0.size + f1.size);
  EXPECT_EQ(info.manifest(), "job-a/step-10/manifest.json");
  EXPECT_EQ(info.plan_hash(), plan_.hash());
  EXPECT_GT(info.created_unix_ms(), 0);
}

TEST_F(CheckpointRegistryTest, ManifestListsTensorsInModelOrderAndPiecesThatTile) {
  CompleteStep(10);
  auto text = ReadFileToString(StepDir(10) + "/manifest.json");
  ASSERT_TRUE(text.ok()) << text.status();
  auto manifest = ParseManifestJson(*text);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->step, 10);
  EXPECT_EQ(manifest->world_size, kWorld);
  EXPECT_EQ(manifest->plan_hash, plan_.hash());
  EXPECT_TRUE(manifest->has_exp_avg);
  EXPECT_TRUE(manifest->has_exp_avg_sq);
  EXPECT_FALSE(manifest->has_outer_anchor);  // not a DiLoCo job's: no "outer_state"
  EXPECT_FALSE(nlohmann::json::parse(*text).contains("outer_state"));
  EXPECT_EQ(manifest->optimizer, "adam");
  EXPECT_EQ(manifest->optimizer_step, 7);
  ASSERT_EQ(manifest->tensors.size(), spec_.tensors.size());
  for (size_t i = 0; i < spec_.tensors.size(); ++i) {
    EXPECT_EQ(manifest->tensors[i].name, spec_.tensors[i].name);
    EXPECT_EQ(manifest->tensors[i].shape, spec_.tensors[i].shape);
    EXPECT_EQ(manifest->tensors[i].dtype, "F32");
    int64_t next = 0;
    for (const ManifestPiece& p : manifest->pieces[i]) {
      EXPECT_EQ(p.row_begin, next);
      next = p.row_end;
    }
    EXPECT_EQ(next, manifest->tensors[i].Rows());
  }
  ASSERT_EQ(manifest->files.size(), 2u);
  EXPECT_EQ(manifest->files[1].name, "rank-1-of-2.safetensors");
  // The raw JSON names each piece's file and shard tensor.
  nlohmann::json j = nlohmann::json::parse(*text);
  EXPECT_EQ(j["pieces"]["scale"][0]["tensor"], "scale:0-1");
  EXPECT_EQ(j["tensors"][3]["shape"], nlohmann::json::array());
  // The temporary file is gone.
  auto entries = testing::RunCommand("ls -a " + StepDir(10));
  EXPECT_FALSE(absl::StrContains(entries.second, ".tmp")) << entries.second;
}

// Numbers a manifest's integer fields cannot hold are refused by name, not
// cast (manifest_fuzzer: a float of 1e43 read as int64 was undefined
// behaviour).
TEST_F(CheckpointRegistryTest, AManifestIntegerOutOfRangeOrFractionalIsRefusedNamingTheField) {
  CompleteStep(10);
  auto text = ReadFileToString(StepDir(10) + "/manifest.json");
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::ordered_json good = nlohmann::ordered_json::parse(*text);
  const std::vector<std::pair<std::string, nlohmann::ordered_json>> bad = {
      {"created_unix_ms", 1.79565e+43},
      {"step", 2.5},
      {"step", uint64_t{18446744073709551615u}},
      {"world_size", int64_t{1} << 40},  // an int field
  };
  for (const auto& [field, value] : bad) {
    nlohmann::ordered_json j = good;
    j[field] = value;
    absl::StatusOr<CheckpointManifest> parsed = ParseManifestJson(j.dump());
    ASSERT_FALSE(parsed.ok()) << field << " = " << value.dump();
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_TRUE(absl::StrContains(parsed.status().message(), field)) << parsed.status();
  }
  nlohmann::ordered_json shape = good;
  shape["tensors"][0]["shape"][0] = 1e30;
  absl::StatusOr<CheckpointManifest> parsed = ParseManifestJson(shape.dump());
  ASSERT_FALSE(parsed.ok());
  EXPECT_TRUE(absl::StrContains(parsed.status().message(), "shape")) << parsed.status();
  EXPECT_TRUE(ParseManifestJson(good.dump()).ok());
}

TEST_F(CheckpointRegistryTest, RecommittingTheSameFileIsHarmlessButACompleteStepIsFrozen) {
  CompleteStep(10);
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);  // identical bytes
  auto again = Commit(Request(f0, 0, 10));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->step_complete());
  EXPECT_EQ(again->committed(), 2);
  ShardFile changed = WriteShard(root_, kJob, 10, 0, plan_, /*optimizer=*/false);
  absl::Status s = Commit(Request(changed, 0, 10)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "already complete")) << s;
  EXPECT_TRUE(absl::IsFailedPrecondition(registry_->CheckWritable(kJob, 10)));
  EXPECT_TRUE(registry_->CheckWritable(kJob, 11).ok());
}

TEST_F(CheckpointRegistryTest, PathsOtherThanTheMembersOwnShardFileAreRefused) {
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  struct Case {
    std::string file;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"job-a/step-10/rank-1-of-2.safetensors", absl::StatusCode::kInvalidArgument},
      {"job-a/step-11/rank-0-of-2.safetensors", absl::StatusCode::kInvalidArgument},
      {"job-a/step-10/../step-10/rank-0-of-2.safetensors", absl::StatusCode::kInvalidArgument},
      {"../outside/rank-0-of-2.safetensors", absl::StatusCode::kInvalidArgument},
      {root_ + "/job-a/step-10/rank-0-of-2.safetensors", absl::StatusCode::kInvalidArgument},
      {"other-job/step-10/rank-0-of-2.safetensors", absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    v1::CommitShardRequest request = Request(f0, 0, 10);
    request.set_file(c.file);
    absl::Status s = Commit(request).status();
    EXPECT_EQ(s.code(), c.code) << c.file << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.file)) << s << " should name " << c.file;
  }
  EXPECT_TRUE(Logged("checkpoint_commit_refused"));
}

TEST_F(CheckpointRegistryTest, ASymlinkLeadingOutOfTheRootIsRefused) {
  // A valid shard file outside the root, linked in under the right name.
  const std::string outside = dir_ + "/outside";
  ShardFile real = WriteShard(outside, kJob, 10, 0, plan_);
  ASSERT_TRUE(CheckpointRoot::Open(root_)->MakeDirs(CheckpointStepDir(kJob, 10)).ok());
  ASSERT_EQ(symlink((outside + "/" + real.relative).c_str(),
                    (root_ + "/" + real.relative).c_str()),
            0);
  absl::Status s = Commit(Request(real, 0, 10)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "outside the checkpoint root")) << s;
}

TEST_F(CheckpointRegistryTest, AMissingOrTruncatedFileNeverCompletesTheStep) {
  CompleteStep(10);
  ShardFile f0 = WriteShard(root_, kJob, 20, 0, plan_);
  ASSERT_TRUE(Commit(Request(f0, 0, 20)).ok());
  ShardFile f1 = WriteShard(root_, kJob, 20, 1, plan_);
  const std::string path = root_ + "/" + f1.relative;
  // Cut mid-write: the commit's size is the full one.
  ASSERT_EQ(truncate(path.c_str(), f1.size - 100), 0);
  absl::Status s = Commit(Request(f1, 1, 20)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "bytes; the commit says")) << s;
  // Even claiming the short size: it is no valid shard.
  ShardFile short_file = f1;
  short_file.size = f1.size - 100;
  s = Commit(Request(short_file, 1, 20)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  ASSERT_EQ(unlink(path.c_str()), 0);
  s = Commit(Request(f1, 1, 20)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "does not exist")) << s;

  auto list = registry_->List(kJob);
  ASSERT_TRUE(list.ok());
  EXPECT_FALSE(Find(*list, 20)->complete());
  EXPECT_EQ(Find(*list, 20)->committed(), 1);
  EXPECT_FALSE(Exists(StepDir(20) + "/manifest.json"));
  auto latest = registry_->Acquire(kJob, -1);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ((*latest)->manifest().step, 10) << "the previous complete step stays latest";
}

TEST_F(CheckpointRegistryTest, ChecksumsOrMetadataThatDisagreeWithTheFileAreRefused) {
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  v1::CommitShardRequest request = Request(f0, 0, 10);
  request.mutable_checksums(0)->set_xxh64("0123456789abcdef");
  absl::Status s = Commit(request).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), request.checksums(0).tensor())) << s;

  request = Request(f0, 0, 10);
  request.mutable_checksums(0)->set_xxh64("not hex");
  EXPECT_TRUE(absl::IsInvalidArgument(Commit(request).status()));

  request = Request(f0, 0, 10);
  request.mutable_checksums()->RemoveLast();
  EXPECT_TRUE(absl::IsFailedPrecondition(Commit(request).status()));

  // A file of step 10 presented as step 11.
  ASSERT_TRUE(CheckpointRoot::Open(root_)->MakeDirs(CheckpointStepDir(kJob, 11)).ok());
  ASSERT_EQ(rename((root_ + "/" + f0.relative).c_str(),
                   (root_ + "/" + CheckpointShardPath(kJob, 11, 0, kWorld)).c_str()),
            0);
  ShardFile moved = f0;
  moved.relative = CheckpointShardPath(kJob, 11, 0, kWorld);
  s = Commit(Request(moved, 0, 11)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "__metadata__ step is \"10\"")) << s;
}

TEST_F(CheckpointRegistryTest, AFileOfAnotherPlanIsRefused) {
  ModelSpec other = spec_;
  other.tensors[0].shape = {302, 8};
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, MakePlan(other, kWorld));
  absl::Status s = Commit(Request(f0, 0, 10)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "plan_hash")) << s;
}

TEST_F(CheckpointRegistryTest, ACommitWithoutAPlanIsRefused) {
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  absl::Status s = Commit(Request(f0, 0, 10, /*generation=*/5)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "PlanShards")) << s;
}

TEST_F(CheckpointRegistryTest, ANewerGenerationRestartsAnIncompleteStep) {
  plans_[{kJob, 2}] = plan_;
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  ASSERT_TRUE(Commit(Request(f0, 0, 10, /*generation=*/1)).ok());
  auto r = Commit(Request(f0, 0, 10, /*generation=*/2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->committed(), 1) << "generation 1's commit was dropped, not counted";
  EXPECT_TRUE(Logged("checkpoint_step_restarted"));
  ShardFile f1 = WriteShard(root_, kJob, 10, 1, plan_);
  r = Commit(Request(f1, 1, 10, /*generation=*/2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->step_complete());
}

// A rank that could not save its piece (a full disk) abandons the step for
// every rank: the piece already committed is removed, later commits and
// uploads of the step are ABORTED naming the failure, the step never
// completes, and the list says why; a newer generation may save it again.
TEST_F(CheckpointRegistryTest, AFailedRankAbandonsTheStepForEveryRank) {
  CompleteStep(5);
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  ASSERT_TRUE(Commit(Request(f0, 0, 10)).ok());
  v1::CommitShardRequest failed;
  *failed.mutable_member() = Request(f0, 1, 10).member();
  failed.set_step(10);
  failed.set_failure("write x: No space left on device");
  failed.set_retry_step(15);
  ASSERT_TRUE(Commit(failed).ok());
  ASSERT_TRUE(Commit(failed).ok()) << "reporting the same failure again is harmless";
  EXPECT_TRUE(Logged("checkpoint_step_failed"));
  EXPECT_FALSE(Exists(root_ + "/" + f0.relative)) << "the committed piece was not removed";

  ShardFile f1 = WriteShard(root_, kJob, 10, 1, plan_);
  absl::Status late = Commit(Request(f1, 1, 10)).status();
  EXPECT_TRUE(absl::IsAborted(late)) << late;
  EXPECT_TRUE(absl::StrContains(late.message(), "No space left on device")) << late;
  EXPECT_TRUE(absl::IsAborted(registry_->CheckWritable(kJob, 10, /*writer_generation=*/1)));

  auto list = registry_->List(kJob);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_TRUE(list->checkpoints(0).complete());
  const v1::CheckpointInfo& info = list->checkpoints(1);
  EXPECT_EQ(info.step(), 10);
  EXPECT_FALSE(info.complete());
  EXPECT_EQ(info.failure(),
            "checkpoint step 10 failed on rank 1: write x: No space left on device; retrying at "
            "step 15");
  auto latest = registry_->Acquire(kJob, -1);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ((*latest)->manifest().step, 5) << "the previous step stays the latest";
  latest->reset();

  // A later generation (after a recovery) saves step 10 afresh.
  plans_[{kJob, 2}] = plan_;
  EXPECT_TRUE(registry_->CheckWritable(kJob, 10, /*writer_generation=*/2).ok());
  f0 = WriteShard(root_, kJob, 10, 0, plan_);
  ASSERT_TRUE(Commit(Request(f0, 0, 10, 2)).ok());
  auto r = Commit(Request(f1, 1, 10, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->step_complete());
}

// A state store that cannot save (its disk full): a commit and an
// abandonment fail, and the log says so, naming the step (nothing said why
// the checkpoints stopped).
TEST_F(CheckpointRegistryTest, CommitsThatCannotBeSavedAreLogged) {
  ASSERT_TRUE(testing::RefuseCheckpointSaves(dir_ + "/state.db").ok());
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  absl::StatusOr<v1::CommitShardResponse> committed = Commit(Request(f0, 0, 10));
  ASSERT_FALSE(committed.ok());
  EXPECT_NE(committed.status().message().find(testing::kRefusedSaveError), std::string::npos)
      << committed.status();
  EXPECT_TRUE(Logged("checkpoint_commit_refused"));
  v1::CommitShardRequest failed;
  *failed.mutable_member() = Request(f0, 1, 10).member();
  failed.set_step(10);
  failed.set_failure("write x: No space left on device");
  EXPECT_FALSE(Commit(failed).ok());
  EXPECT_TRUE(Logged("checkpoint_step_failed"));
}

TEST_F(CheckpointRegistryTest, KeepLastDeletesOlderCompleteStepsButNeverANewerIncompleteOne) {
  Reopen(/*keep_last=*/1);
  CompleteStep(10);
  CompleteStep(20);
  EXPECT_FALSE(Exists(StepDir(10))) << "step 10 is beyond keep_last=1";
  EXPECT_TRUE(Exists(StepDir(20) + "/manifest.json"));
  EXPECT_TRUE(Logged("checkpoint_deleted"));
  // Step 30 is being written (one rank so far) when step 25 completes.
  ShardFile f30 = WriteShard(root_, kJob, 30, 0, plan_);
  ASSERT_TRUE(Commit(Request(f30, 0, 30)).ok());
  CompleteStep(25);
  EXPECT_FALSE(Exists(StepDir(20)));
  EXPECT_TRUE(Exists(StepDir(25) + "/manifest.json"));
  EXPECT_TRUE(Exists(root_ + "/" + f30.relative));
  auto list = registry_->List(kJob);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_EQ(list->checkpoints(0).step(), 25);
  EXPECT_TRUE(list->checkpoints(0).complete());
  EXPECT_EQ(list->checkpoints(1).step(), 30);
  EXPECT_FALSE(list->checkpoints(1).complete());
}

TEST_F(CheckpointRegistryTest, WithVerificationRetentionWaitsForVerifiedSteps) {
  Reopen(/*keep_last=*/1);
  std::vector<int64_t> completed;
  registry_->SetCompletionListener(
      [&](const std::string&, int64_t step) { completed.push_back(step); });
  CompleteStep(10);
  ASSERT_TRUE(registry_->RecordVerified(kJob, 10, {}).ok());
  CompleteStep(20);
  EXPECT_EQ(completed, (std::vector<int64_t>{10, 20}));
  EXPECT_TRUE(Exists(StepDir(10) + "/manifest.json")) << "step 20 is not verified yet";
  ASSERT_TRUE(registry_->RecordVerified(kJob, 20, {{"x", "0123456789abcdef"}}).ok());
  EXPECT_FALSE(Exists(StepDir(10)));
  auto pinned = registry_->Acquire(kJob, 20);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ((*pinned)->verified_checksums().at("x"), "0123456789abcdef");
  pinned->reset();
  // A restarted registry hands unverified complete steps to the listener.
  CompleteStep(30);
  completed.clear();
  Reopen(/*keep_last=*/1);
  registry_->SetCompletionListener(
      [&](const std::string&, int64_t step) { completed.push_back(step); });
  EXPECT_EQ(completed, (std::vector<int64_t>{30}));
  EXPECT_TRUE(Exists(StepDir(20) + "/manifest.json"));
}

TEST_F(CheckpointRegistryTest, AStepBeingConsolidatedIsDeletedOnlyAfterwards) {
  Reopen(/*keep_last=*/1);
  CompleteStep(10);
  auto pinned = registry_->Acquire(kJob, 10);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  CompleteStep(20);
  EXPECT_TRUE(Exists(StepDir(10) + "/manifest.json")) << "pinned by a consolidation";
  EXPECT_TRUE(Logged("checkpoint_retention_deferred"));
  pinned->reset();
  EXPECT_FALSE(Exists(StepDir(10)));
  EXPECT_TRUE(Exists(StepDir(20)));
}

TEST_F(CheckpointRegistryTest, AcquireFindsTheLatestCompleteStepAndRefusesOthers) {
  EXPECT_TRUE(absl::IsNotFound(registry_->Acquire(kJob, -1).status()));
  CompleteStep(10);
  CompleteStep(20);
  ShardFile f = WriteShard(root_, kJob, 30, 0, plan_);
  ASSERT_TRUE(Commit(Request(f, 0, 30)).ok());
  auto latest = registry_->Acquire(kJob, -1);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ((*latest)->manifest().step, 20);
  absl::Status s = registry_->Acquire(kJob, 30).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "1 of 2 ranks")) << s;
  EXPECT_TRUE(absl::IsNotFound(registry_->Acquire(kJob, 15).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(registry_->Acquire("../x", 10).status()));
}

TEST_F(CheckpointRegistryTest, TheRegistrySurvivesARestartAndFinishesAnInterruptedCompletion) {
  CompleteStep(10);
  for (int r = 0; r < kWorld; ++r) {
    ShardFile f = WriteShard(root_, kJob, 20, r, plan_);
    ASSERT_TRUE(Commit(Request(f, r, 20)).ok());
  }
  // As if the server died after the last commit was recorded, before the
  // manifest: the step is incomplete and has no manifest.
  ASSERT_TRUE(state_
                  ->Transaction([](StateStore::Connection& db) {
                    return db.Execute("interrupt the completion",
                                      "UPDATE checkpoint_steps SET complete = 0, manifest = '' "
                                      "WHERE step = 20");
                  })
                  .ok());
  ASSERT_EQ(unlink((StepDir(20) + "/manifest.json").c_str()), 0);
  Reopen(0);
  EXPECT_TRUE(Logged("checkpoint_recovered"));
  auto list = registry_->List("");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_TRUE(list->checkpoints(0).complete());
  EXPECT_TRUE(list->checkpoints(1).complete());
  EXPECT_TRUE(Exists(StepDir(20) + "/manifest.json"));
}

// ---- Consolidation ----

class ConsolidatorTest : public CheckpointRegistryTest {
 protected:
  absl::StatusOr<ConsolidationResult> Consolidate(int64_t step, ConsolidationOptions options,
                                                  MemoryOutput* output) {
    auto pinned = registry_->Acquire(kJob, step);
    if (!pinned.ok()) return pinned.status();
    auto root = CheckpointRoot::Open(root_);
    Consolidator consolidator(*root, (*pinned)->manifest(), options);
    return consolidator.Run(output);
  }

  // Opens an output file (written to disk for the reader).
  std::unique_ptr<SafetensorsReader> OpenOutput(const std::string& name,
                                                const std::string& bytes) {
    std::string path = absl::StrCat(dir_, "/out-", name);
    testing::WriteFile(path, bytes);
    auto reader = SafetensorsReader::Open(path);
    EXPECT_TRUE(reader.ok()) << reader.status();
    return reader.ok() ? *std::move(reader) : nullptr;
  }

  // Every element of output tensor `name` equals the worker's value.
  void ExpectValues(const SafetensorsReader& reader, const std::string& name,
                    ShardTensorKind kind, int tensor, DType dtype) {
    const TensorInfo* info = reader.Find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dtype, dtype) << name;
    EXPECT_EQ(info->shape, spec_.tensors[tensor].shape) << name;
    std::string bytes(info->Bytes(), '\0');
    ASSERT_TRUE(reader.ReadBytes(name, 0, info->Bytes(), bytes.data()).ok());
    for (int64_t e = 0; e < info->Elements(); ++e) {
      const float expected = Value(kind, tensor, e);
      if (dtype == DType::kF32) {
        float got;
        std::memcpy(&got, bytes.data() + 4 * e, 4);
        ASSERT_EQ(got, expected) << name << " element " << e;
      } else {
        uint16_t got;
        std::memcpy(&got, bytes.data() + 2 * e, 2);
        uint16_t want = dtype == DType::kBF16 ? FloatToBF16(expected) : FloatToF16(expected);
        ASSERT_EQ(got, want) << name << " element " << e;
      }
    }
    // The metadata's checksum is of exactly these bytes.
    nlohmann::json sums = nlohmann::json::parse(reader.metadata().at("checksums"));
    EXPECT_EQ(sums[name], ChecksumToHex(Checksum(bytes))) << name;
  }
};

TEST_F(ConsolidatorTest, OneFileHoldsTheMergedModelThenTheOptimizerState) {
  CompleteStep(10);
  MemoryOutput out;
  ConsolidationOptions options;
  options.buffer_bytes = 4096;  // smaller than embed.weight: reads in several pieces
  auto result = Consolidate(10, options, &out);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(out.files.size(), 1u);
  EXPECT_EQ(out.files[0].first, "model.safetensors");
  EXPECT_EQ(result->total_bytes, static_cast<int64_t>(out.files[0].second.size()));
  EXPECT_EQ(out.last_done, out.last_total);
  auto reader = OpenOutput("model.safetensors", out.files[0].second);
  ASSERT_NE(reader, nullptr);
  std::vector<std::string> expected_names;
  for (const char* prefix : {"", "optim.exp_avg.", "optim.exp_avg_sq."}) {
    for (const TensorSpec& t : spec_.tensors) expected_names.push_back(prefix + t.name);
  }
  EXPECT_EQ(reader->names(), expected_names);
  for (size_t t = 0; t < spec_.tensors.size(); ++t) {
    const std::string& name = spec_.tensors[t].name;
    ExpectValues(*reader, name, ShardTensorKind::kParams, t, DType::kF32);
    ExpectValues(*reader, "optim.exp_avg." + name, ShardTensorKind::kExpAvg, t, DType::kF32);
    ExpectValues(*reader, "optim.exp_avg_sq." + name, ShardTensorKind::kExpAvgSq, t,
                 DType::kF32);
  }
  EXPECT_EQ(reader->metadata().at("format"), "pt");
  EXPECT_EQ(reader->metadata().at("step"), "10");
  EXPECT_EQ(reader->metadata().at("optimizer_step"), "7");
}

// A DiLoCo job's step (docs/diloco.md): the server accepts the outer
// state's pieces, the manifest records them, and consolidation writes them
// after the moments, F32, with the outer step count; weights_only leaves
// them out.
TEST_F(ConsolidatorTest, ADiLoCoStepConsolidatesItsOuterStateAfterTheMoments) {
  CompleteStep(10, /*optimizer=*/true, /*outer=*/true);
  auto text = ReadFileToString(StepDir(10) + "/manifest.json");
  ASSERT_TRUE(text.ok()) << text.status();
  auto manifest = ParseManifestJson(*text);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_TRUE(manifest->has_outer_anchor);
  EXPECT_TRUE(manifest->has_outer_momentum);
  MemoryOutput out;
  auto result = Consolidate(10, ConsolidationOptions(), &out);
  ASSERT_TRUE(result.ok()) << result.status();
  auto reader = OpenOutput("model.safetensors", out.files[0].second);
  ASSERT_NE(reader, nullptr);
  std::vector<std::string> expected_names;
  for (const char* prefix : {"", "optim.exp_avg.", "optim.exp_avg_sq.", "optim.outer_anchor.",
                             "optim.outer_momentum."}) {
    for (const TensorSpec& t : spec_.tensors) expected_names.push_back(prefix + t.name);
  }
  EXPECT_EQ(reader->names(), expected_names);
  for (size_t t = 0; t < spec_.tensors.size(); ++t) {
    const std::string& name = spec_.tensors[t].name;
    ExpectValues(*reader, "optim.outer_anchor." + name, ShardTensorKind::kOuterAnchor, t,
                 DType::kF32);
    ExpectValues(*reader, "optim.outer_momentum." + name, ShardTensorKind::kOuterMomentum, t,
                 DType::kF32);
  }
  EXPECT_EQ(reader->metadata().at("outer_step"), "3");
  MemoryOutput weights;
  ConsolidationOptions weights_only;
  weights_only.weights_only = true;
  ASSERT_TRUE(Consolidate(10, weights_only, &weights).ok());
  auto plain = OpenOutput("weights.safetensors", weights.files[0].second);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->tensors().size(), spec_.tensors.size());
  EXPECT_EQ(plain->metadata().count("outer_step"), 0u);
}

TEST_F(ConsolidatorTest, WeightsOnlyInBF16AndF16) {
  CompleteStep(10);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    MemoryOutput out;
    ConsolidationOptions options;
    options.weights_only = true;
    options.dtype = dtype;
    auto result = Consolidate(10, options, &out);
    ASSERT_TRUE(result.ok()) << result.status();
    auto reader = OpenOutput("model.safetensors", out.files[0].second);
    ASSERT_NE(reader, nullptr);
    EXPECT_EQ(reader->tensors().size(), spec_.tensors.size());
    EXPECT_EQ(reader->metadata().count("optimizer_step"), 0u);
    for (size_t t = 0; t < spec_.tensors.size(); ++t) {
      ExpectValues(*reader, spec_.tensors[t].name, ShardTensorKind::kParams, t, dtype);
    }
  }
}

TEST_F(ConsolidatorTest, AStepSavedWithoutOptimizerStateHasOnlyWeights) {
  CompleteStep(10, /*optimizer=*/false);
  MemoryOutput out;
  ASSERT_TRUE(Consolidate(10, ConsolidationOptions(), &out).ok());
  auto reader = OpenOutput("model.safetensors", out.files[0].second);
  EXPECT_EQ(reader->tensors().size(), spec_.tensors.size());
}

TEST_F(ConsolidatorTest, HuggingFaceShardsSplitBetweenTensorsWithAnIndex) {
  CompleteStep(10);
  MemoryOutput out;
  ConsolidationOptions options;
  options.max_shard_bytes = 600;  // embed.weight (9600 bytes) alone; the small ones together
  auto result = Consolidate(10, options, &out);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_GE(out.files.size(), 4u);
  const int shards = static_cast<int>(out.files.size()) - 1;
  EXPECT_EQ(out.files.back().first, "model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(out.files.back().second);
  int64_t total = 0;
  std::map<std::string, std::string> seen;
  for (int i = 0; i < shards; ++i) {
    const auto& [name, bytes] = out.files[i];
    EXPECT_EQ(name, absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards));
    auto reader = OpenOutput(name, bytes);
    ASSERT_NE(reader, nullptr);
    int64_t data = 0;
    for (const TensorInfo& t : reader->tensors()) {
      data += t.Bytes();
      seen[t.name] = name;
      EXPECT_EQ(index["weight_map"][t.name], name) << t.name;
    }
    EXPECT_TRUE(data <= 600 || reader->tensors().size() == 1) << name << " holds " << data;
    total += data;
    EXPECT_EQ(reader->metadata().at("format"), "pt");
  }
  EXPECT_EQ(seen.size(), 3 * spec_.tensors.size());
  EXPECT_EQ(index["weight_map"].size(), seen.size());
  EXPECT_EQ(index["metadata"]["total_size"], total);
}

TEST_F(ConsolidatorTest, AFlippedByteIsDataLossNamingTheFileAndTensorBeforeAnyOutput) {
  CompleteStep(10);
  // Flip one byte inside rank 1's first tensor.
  ShardFile f1 = WriteShard(root_, kJob, 10, 1, plan_);
  const std::string path = root_ + "/" + f1.relative;
  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok());
  const TensorInfo victim = (*reader)->tensors()[0];
  reader->reset();
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char byte;
  ASSERT_EQ(pread(fd, &byte, 1, victim.begin + 1), 1);
  byte ^= 0x10;
  ASSERT_EQ(pwrite(fd, &byte, 1, victim.begin + 1), 1);
  close(fd);

  MemoryOutput out;
  absl::Status s = Consolidate(10, ConsolidationOptions(), &out).status();
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "job-a/step-10/rank-1-of-2.safetensors")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), victim.name)) << s;
  EXPECT_TRUE(out.files.empty()) << "detected in the verification pass";
}

TEST_F(ConsolidatorTest, VerifiedChecksumsLetConsolidationSkipItsVerificationPass) {
  CompleteStep(10);
  auto pinned = registry_->Acquire(kJob, 10);
  ASSERT_TRUE(pinned.ok());
  auto root = CheckpointRoot::Open(root_);
  MemoryOutput ignored;
  auto verified = Consolidator(*root, (*pinned)->manifest(), ConsolidationOptions())
                      .Verify(&ignored);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_EQ(verified->size(), 3 * spec_.tensors.size());
  EXPECT_TRUE(ignored.files.empty());

  MemoryOutput cold, warm;
  ASSERT_TRUE(
      Consolidator(*root, (*pinned)->manifest(), ConsolidationOptions()).Run(&cold).ok());
  ConsolidationOptions options;
  options.known_checksums = *verified;
  auto result = Consolidator(*root, (*pinned)->manifest(), options).Run(&warm);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(warm.files, cold.files) << "the same bytes, header checksums included";
  EXPECT_LT(warm.last_total, cold.last_total) << "no verification pass";
  auto reader = OpenOutput("model.safetensors", cold.files[0].second);
  nlohmann::json sums = nlohmann::json::parse(reader->metadata().at("checksums"));
  for (const auto& [name, hex] : *verified) EXPECT_EQ(sums[name], hex) << name;

  // Corruption after verification is still caught, while writing.
  ShardFile f0 = WriteShard(root_, kJob, 10, 0, plan_);
  const std::string path = root_ + "/" + f0.relative;
  auto shard = SafetensorsReader::Open(path);
  const TensorInfo victim = (*shard)->tensors().back();
  shard->reset();
  int fd = open(path.c_str(), O_RDWR);
  char byte = 0x55;
  ASSERT_EQ(pwrite(fd, &byte, 1, victim.end - 2), 1);
  close(fd);
  MemoryOutput late;
  absl::Status s = Consolidator(*root, (*pinned)->manifest(), options).Run(&late).status();
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), victim.name)) << s;
}

TEST_F(ConsolidatorTest, AMissingShardFileIsDataLoss) {
  CompleteStep(10);
  ASSERT_EQ(unlink((StepDir(10) + "/rank-0-of-2.safetensors").c_str()), 0);
  MemoryOutput out;
  absl::Status s = Consolidate(10, ConsolidationOptions(), &out).status();
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank-0-of-2.safetensors")) << s;
}

TEST_F(ConsolidatorTest, DirectoryOutputAppearsWholeOrNotAtAll) {
  CompleteStep(10);
  auto root = CheckpointRoot::Open(root_);
  const std::string dir = ConsolidatedDir(kJob, 10);
  auto pinned = registry_->Acquire(kJob, 10);
  ASSERT_TRUE(pinned.ok());
  {
    auto output = DirectoryOutput::Create(*root, dir);
    ASSERT_TRUE(output.ok()) << output.status();
    Consolidator consolidator(*root, (*pinned)->manifest(), ConsolidationOptions());
    ASSERT_TRUE(consolidator.Run(output->get()).ok());
    EXPECT_FALSE(Exists(root->Join(dir))) << "nothing before Commit";
    ASSERT_TRUE((*output)->Commit().ok());
  }
  EXPECT_TRUE(Exists(root->Join(dir + "/model.safetensors")));
  // A second run replaces it; an abandoned one leaves nothing behind.
  {
    auto output = DirectoryOutput::Create(*root, dir);
    ASSERT_TRUE(output.ok());
    ConsolidationOptions options;
    options.max_shard_bytes = 1000;
    Consolidator consolidator(*root, (*pinned)->manifest(), options);
    ASSERT_TRUE(consolidator.Run(output->get()).ok());
    ASSERT_TRUE((*output)->Commit().ok());
  }
  EXPECT_FALSE(Exists(root->Join(dir + "/model.safetensors")));
  EXPECT_TRUE(Exists(root->Join(dir + "/model.safetensors.index.json")));
  {
    auto output = DirectoryOutput::Create(*root, dir);
    ASSERT_TRUE(output.ok());
    Consolidator consolidator(*root, (*pinned)->manifest(), ConsolidationOptions());
    ASSERT_TRUE(consolidator.Run(output->get()).ok());
    // Dropped without Commit.
  }
  auto listing = testing::RunCommand("ls -a " + root->Join(kJob + std::string("/consolidated")));
  EXPECT_EQ(listing.second, ".\n..\nstep-10\n");
}

}  // namespace
}  // namespace zeroshard
