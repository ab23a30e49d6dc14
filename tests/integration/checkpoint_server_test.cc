// Checkpoints over real gRPC on loopback: an in-process ShardServer with a
// state directory and a checkpoint root, two members joined with the Client
// and planned with PlanShards. The test writes each rank's shard file as a
// worker does, commits it, and consolidates through the client to local
// files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/file_util.h"
#include "common/plan/plan_codec.h"
#include "common/safetensors.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shard_server/shard_server.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"
#include "tests/testing/shard_files.h"

namespace zeroshard {
namespace {

constexpr char kJob[] = "ckpt";
constexpr int kWorld = 2;

v1::ModelSpec TestSpec() {
  v1::ModelSpec spec;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    v1::TensorSpec* t = spec.add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_dtype("F32");
  };
  add("0.weight", {64, 16});
  add("0.bias", {64});
  add("1.weight", {8, 64});
  add("1.bias", {8});
  add("temperature", {});
  return spec;
}

using testing::kPrefix;
using testing::ShardFile;
using testing::Value;
enum Kind { kParams = 0, kExpAvg = 1, kExpAvgSq = 2 };

// Rank `rank`'s shard file of `step` in the worker's format, under `dir`.
ShardFile WriteShard(const std::string& dir, const v1::ShardPlan& plan, int64_t step, int rank,
                     int64_t generation, bool optimizer = true) {
  absl::StatusOr<ShardFile> file =
      testing::WriteShardFile(dir, kJob, plan, step, rank, generation, optimizer);
  EXPECT_TRUE(file.ok()) << file.status();
  return file.ok() ? *std::move(file) : ShardFile();
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// `ls -A`; "" for a missing directory.
std::string Listing(const std::string& dir) {
  if (!Exists(dir)) return "";
  return testing::RunCommand("ls -A " + dir).second;
}

class CheckpointServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("checkpoint_server");
    root_ = dir_ + "/checkpoints";
    out_ = dir_ + "/out";
    ASSERT_EQ(mkdir(out_.c_str(), 0755), 0);
  }

  ShardServerOptions Options(int keep_last = 0) {
    ShardServerOptions o;
    o.listen = "127.0.0.1:0";
    o.state_dir = dir_ + "/state";
    o.checkpoint_root = root_;
    o.keep_last = keep_last;
    o.membership.heartbeat_interval = absl::Milliseconds(100);
    o.membership.heartbeat_timeout = absl::Seconds(60);
    o.membership.join_timeout = absl::Seconds(30);
    o.log_sink = [this](const std::string& line) {
      absl::MutexLock lock(&mu_);
      log_.push_back(line);
    };
    return o;
  }

  void StartServer(ShardServerOptions options) {
    members_.clear();
    server_.reset();
    auto server = ShardServer::Start(std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ctl_ = Connect();
  }

  std::unique_ptr<Client> Connect() {
    ClientOptions o;
    o.server = server_->address();
    o.rpc_timeout = absl::Seconds(20);
    auto client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  }

  // Joins kWorld members and plans the test spec; members_ by rank.
  void JoinAndPlan(const v1::ModelSpec& spec = TestSpec()) {
    std::vector<std::unique_ptr<Client>> clients(kWorld);
    std::vector<std::thread> threads;
    for (int i = 0; i < kWorld; ++i) {
      clients[i] = Connect();
      threads.emplace_back([&, i] {
        auto info =
            clients[i]->Join(kJob, kWorld, absl::StrCat("w", i), "127.0.0.1", absl::Seconds(20));
        EXPECT_TRUE(info.ok()) << info.status();
      });
    }
    for (auto& t : threads) t.join();
    members_.clear();
    members_.resize(kWorld);
    for (auto& c : clients) members_[c->info().rank] = std::move(c);
    for (auto& m : members_) {
      auto plan = m->PlanShards(ModelSpecFromProto(spec), PlanOptions(), kWorld);
      ASSERT_TRUE(plan.ok()) << plan.status();
      plan_ = ShardPlanToProto(*plan);
    }
  }

  ShardFile Write(int64_t step, int rank, bool optimizer = true) {
    return WriteShard(root_, plan_, step, rank, members_[rank]->info().generation, optimizer);
  }

  absl::StatusOr<v1::CommitShardResponse> Commit(const ShardFile& f, int64_t step, int rank) {
    return members_[rank]->CommitShard(step, f.relative, f.size, f.checksums);
  }

  void CompleteStep(int64_t step, bool optimizer = true) {
    for (int r = 0; r < kWorld; ++r) {
      auto response = Commit(Write(step, r, optimizer), step, r);
      ASSERT_TRUE(response.ok()) << response.status();
      EXPECT_EQ(response->step_complete(), r == kWorld - 1);
    }
  }

  absl::StatusOr<v1::ConsolidateSummary> Consolidate(int64_t step, const std::string& out,
                                                     bool weights_only = false,
                                                     const std::string& dtype = "",
                                                     int64_t max_shard_bytes = 0) {
    v1::ConsolidateRequest request;
    request.set_job_id(kJob);
    request.set_step(step);
    request.set_weights_only(weights_only);
    request.set_dtype(dtype);
    request.set_max_shard_bytes(max_shard_bytes);
    return ctl_->Consolidate(request, out);
  }

  // Every element of output tensor `name` equals the pieces' values.
  void ExpectTensor(const SafetensorsReader& reader, const std::string& name, int kind, int tensor,
                    DType dtype) {
    const TensorInfo* info = reader.Find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dtype, dtype);
    const v1::ModelSpec model = TestSpec();
    const v1::TensorSpec& spec = model.tensors(tensor);
    EXPECT_EQ(info->shape, std::vector<int64_t>(spec.shape().begin(), spec.shape().end()));
    std::vector<char> bytes(info->Bytes());
    ASSERT_TRUE(reader.ReadBytes(name, 0, info->Bytes(), bytes.data()).ok());
    for (int64_t e = 0; e < info->Elements(); ++e) {
      if (dtype == DType::kF32) {
        float got;
        std::memcpy(&got, bytes.data() + 4 * e, 4);
        ASSERT_EQ(got, Value(kind, tensor, e)) << name << "[" << e << "]";
      } else {
        uint16_t got;
        std::memcpy(&got, bytes.data() + 2 * e, 2);
        ASSERT_EQ(got, FloatToBF16(Value(kind, tensor, e))) << name << "[" << e << "]";
      }
    }
    nlohmann::json sums = nlohmann::json::parse(reader.metadata().at("checksums"));
    EXPECT_EQ(sums[name], ChecksumToHex(Checksum(bytes.data(), bytes.size()))) << name;
  }

  bool Logged(absl::string_view event) {
    absl::MutexLock lock(&mu_);
    for (const auto& line : log_) {
      if (absl::StrContains(line, absl::StrCat("event=", event, " "))) return true;
    }
    return false;
  }

  std::string dir_, root_, out_;
  absl::Mutex mu_;
  std::vector<std::string> log_;
  std::unique_ptr<ShardServer> server_;
  std::unique_ptr<Client> ctl_;
  std::vector<std::unique_ptr<Client>> members_;
  v1::ShardPlan plan_;
};

TEST_F(CheckpointServerTest, AStepIsCompleteOnlyAfterBothCommitsAndIsListed) {
  StartServer(Options());
  JoinAndPlan();
  ShardFile f0 = Write(10, 0), f1 = Write(10, 1);
  auto first = Commit(f0, 10, 0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->step_complete());
  EXPECT_FALSE(Exists(root_ + "/ckpt/step-10/manifest.json"));
  auto list = ctl_->ListCheckpoints(kJob);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_FALSE(list->checkpoints(0).complete());

  auto second = Commit(f1, 10, 1);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->step_complete());
  EXPECT_TRUE(Exists(root_ + "/ckpt/step-10/manifest.json"));
  list = ctl_->ListCheckpoints("");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 1);
  const v1::CheckpointInfo& info = list->checkpoints(0);
  EXPECT_EQ(info.job_id(), kJob);
  EXPECT_EQ(info.step(), 10);
  EXPECT_TRUE(info.complete());
  EXPECT_EQ(info.committed(), 2);
  EXPECT_EQ(info.world_size(), 2);
  EXPECT_EQ(info.total_bytes(), f0.size + f1.size);
  EXPECT_EQ(info.manifest(), "ckpt/step-10/manifest.json");
  EXPECT_EQ(info.plan_hash(), plan_.hash());
  EXPECT_TRUE(Logged("checkpoint_commit"));
  EXPECT_TRUE(Logged("checkpoint_complete"));
}

TEST_F(CheckpointServerTest, ConsolidationStreamsTheMergedModelWithOptimizerState) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  const std::string out = out_ + "/model.safetensors";
  auto summary = Consolidate(-1, out);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->step(), 10);
  ASSERT_EQ(summary->files_size(), 1);
  EXPECT_EQ(summary->files(0), out);
  auto reader = SafetensorsReader::Open(out);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(summary->total_bytes(), (*reader)->file_size());
  const v1::ModelSpec spec = TestSpec();
  ASSERT_EQ((*reader)->tensors().size(), 3u * spec.tensors_size());
  for (int t = 0; t < spec.tensors_size(); ++t) {
    EXPECT_EQ((*reader)->tensors()[t].name, spec.tensors(t).name()) << "model order";
    for (int kind = 0; kind < 3; ++kind) {
      ExpectTensor(**reader, kPrefix[kind] + spec.tensors(t).name(), kind, t, DType::kF32);
    }
  }
  EXPECT_EQ((*reader)->metadata().at("format"), "pt");
  EXPECT_EQ((*reader)->metadata().at("step"), "10");
  EXPECT_EQ((*reader)->metadata().at("optimizer_step"), "10");
  EXPECT_EQ(Listing(out_), "model.safetensors\n") << "no temporary file left";
  EXPECT_TRUE(Logged("consolidate_done"));
}

TEST_F(CheckpointServerTest, WeightsOnlyBF16Consolidation) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  // --out names a directory: the file goes inside.
  auto summary = Consolidate(10, out_, /*weights_only=*/true, "bf16");
  ASSERT_TRUE(summary.ok()) << summary.status();
  auto reader = SafetensorsReader::Open(out_ + "/model.safetensors");
  ASSERT_TRUE(reader.ok()) << reader.status();
  const v1::ModelSpec spec = TestSpec();
  ASSERT_EQ((*reader)->tensors().size(), static_cast<size_t>(spec.tensors_size()));
  for (int t = 0; t < spec.tensors_size(); ++t) {
    ExpectTensor(**reader, spec.tensors(t).name(), kParams, t, DType::kBF16);
  }
  EXPECT_EQ((*reader)->metadata().count("optimizer_step"), 0u);
}

TEST_F(CheckpointServerTest, HuggingFaceShardedOutputWithIndex) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  const std::string dir = out_ + "/hf";
  auto summary = Consolidate(10, dir, /*weights_only=*/true, "", /*max_shard_bytes=*/2048);
  ASSERT_TRUE(summary.ok()) << summary.status();
  // 0.weight (4096 bytes) and 1.weight (2048) fill files of their own.
  ASSERT_GE(summary->files_size(), 3);
  EXPECT_EQ(summary->files(summary->files_size() - 1), dir + "/model.safetensors.index.json");
  auto index_text = ReadFileToString(dir + "/model.safetensors.index.json");
  ASSERT_TRUE(index_text.ok());
  nlohmann::json index = nlohmann::json::parse(*index_text);
  const v1::ModelSpec spec = TestSpec();
  int64_t total = 0;
  for (int t = 0; t < spec.tensors_size(); ++t) {
    const std::string& name = spec.tensors(t).name();
    ASSERT_TRUE(index["weight_map"].contains(name)) << name;
    std::string file = index["weight_map"][name];
    EXPECT_TRUE(absl::StartsWith(file, "model-0000")) << file;
    auto reader = SafetensorsReader::Open(dir + "/" + file);
    ASSERT_TRUE(reader.ok()) << reader.status();
    ExpectTensor(**reader, name, kParams, t, DType::kF32);
    total += (*reader)->Find(name)->Bytes();
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(index["weight_map"].size(), static_cast<size_t>(spec.tensors_size()));
}

TEST_F(CheckpointServerTest, AFlippedByteIsDataLossNamingFileAndTensorAndLeavesNoOutput) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  // Verified first: the consolidations below skip their verification pass
  // and meet the flipped byte while streaming.
  server_->checkpoint_verifier()->WaitIdle();
  EXPECT_TRUE(Logged("checkpoint_verified"));
  const std::string shard = root_ + "/ckpt/step-10/rank-1-of-2.safetensors";
  auto reader = SafetensorsReader::Open(shard);
  ASSERT_TRUE(reader.ok());
  const TensorInfo victim = (*reader)->tensors().back();
  reader->reset();
  int fd = open(shard.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char byte;
  ASSERT_EQ(pread(fd, &byte, 1, victim.end - 1), 1);
  byte = static_cast<char>(byte ^ 0x01);
  ASSERT_EQ(pwrite(fd, &byte, 1, victim.end - 1), 1);
  close(fd);
  for (int64_t max_shard_bytes : {int64_t{0}, int64_t{2048}}) {
    const std::string out = max_shard_bytes ? out_ + "/hf" : out_ + "/model.safetensors";
    absl::Status s = Consolidate(10, out, false, "", max_shard_bytes).status();
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "ckpt/step-10/rank-1-of-2.safetensors")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), victim.name)) << s;
    EXPECT_FALSE(Exists(out_ + "/model.safetensors"));
    EXPECT_EQ(Listing(out_ + "/hf"), "");
  }
  // On the server too: nothing under consolidated/.
  v1::ConsolidateRequest request;
  request.set_job_id(kJob);
  request.set_step(10);
  request.set_on_server(true);
  EXPECT_TRUE(absl::IsDataLoss(ctl_->Consolidate(request, "").status()));
  EXPECT_EQ(Listing(root_ + "/ckpt/consolidated"), "");
  EXPECT_TRUE(Logged("consolidate_failed"));
}

TEST_F(CheckpointServerTest, OnServerConsolidationWritesUnderTheRoot) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  v1::ConsolidateRequest request;
  request.set_job_id(kJob);
  request.set_step(-1);
  request.set_on_server(true);
  auto summary = ctl_->Consolidate(request, "");
  ASSERT_TRUE(summary.ok()) << summary.status();
  ASSERT_EQ(summary->files_size(), 1);
  EXPECT_EQ(summary->files(0), "ckpt/consolidated/step-10/model.safetensors");
  auto reader = SafetensorsReader::Open(root_ + "/" + summary->files(0));
  ASSERT_TRUE(reader.ok()) << reader.status();
  ExpectTensor(**reader, "0.weight", kParams, 0, DType::kF32);
  EXPECT_EQ(Listing(root_ + "/ckpt/consolidated"), "step-10\n");
}

TEST_F(CheckpointServerTest, PathsLeadingOutOfTheRootAreRefused) {
  StartServer(Options());
  JoinAndPlan();
  ShardFile f0 = Write(10, 0);
  const std::string outside = dir_ + "/outside";
  ShardFile real = WriteShard(outside, plan_, 10, 0, members_[0]->info().generation);
  struct Case {
    std::string file;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"ckpt/step-10/../../outside/ckpt/step-10/rank-0-of-2.safetensors",
       absl::StatusCode::kInvalidArgument},
      {real.path, absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    absl::Status s = members_[0]->CommitShard(10, c.file, f0.size, f0.checksums).status();
    EXPECT_EQ(s.code(), c.code) << c.file << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.file)) << s;
  }
  // A symlink under the right name, leading out.
  ASSERT_EQ(unlink(f0.path.c_str()), 0);
  ASSERT_EQ(symlink(real.path.c_str(), f0.path.c_str()), 0);
  absl::Status s = Commit(real, 10, 0).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "outside the checkpoint root")) << s;
  // The job directory itself a symlink leading out: refused for uploads too.
  ASSERT_EQ(rename((root_ + "/ckpt").c_str(), (dir_ + "/moved").c_str()), 0);
  ASSERT_EQ(symlink((dir_ + "/moved").c_str(), (root_ + "/ckpt").c_str()), 0);
  s = members_[0]->UploadShard(11, "ckpt/step-11/rank-0-of-2.safetensors", real.path).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_FALSE(Exists(dir_ + "/moved/step-11"));
}

TEST_F(CheckpointServerTest, AStaleMemberCannotCommit) {
  StartServer(Options());
  JoinAndPlan();
  ShardFile f0 = Write(10, 0);
  v1::CommitShardRequest request;
  *request.mutable_member() = members_[0]->credentials();
  request.mutable_member()->set_token("forged");
  request.set_step(10);
  request.set_file(f0.relative);
  request.set_size_bytes(f0.size);
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(10));
  v1::CommitShardResponse response;
  absl::Status s = FromGrpcStatus(
      testing::NewCoordinatorStub(server_->address())->CommitShard(&context, request, &response));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
}

TEST_F(CheckpointServerTest, AServerRestartedBetweenCommitAndConsolidationStillConsolidates) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  members_.clear();
  ctl_.reset();
  server_.reset();
  StartServer(Options());
  auto list = ctl_->ListCheckpoints(kJob);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_TRUE(list->checkpoints(0).complete());
  auto summary = Consolidate(-1, out_ + "/model.safetensors");
  ASSERT_TRUE(summary.ok()) << summary.status();
  auto reader = SafetensorsReader::Open(out_ + "/model.safetensors");
  ASSERT_TRUE(reader.ok());
  ExpectTensor(**reader, "1.weight", kParams, 2, DType::kF32);
}

TEST_F(CheckpointServerTest, UploadedShardsCommitLikeSharedFilesystemOnes) {
  StartServer(Options());
  JoinAndPlan();
  const std::string staging = dir_ + "/staging";
  for (int r = 0; r < kWorld; ++r) {
    ShardFile f = WriteShard(staging, plan_, 10, r, members_[r]->info().generation);
    auto size = members_[r]->UploadShard(10, f.relative, f.path);
    ASSERT_TRUE(size.ok()) << size.status();
    EXPECT_EQ(*size, f.size);
    auto response = Commit(f, 10, r);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->step_complete(), r == kWorld - 1);
  }
  EXPECT_EQ(Listing(root_ + "/ckpt/step-10"),
            "manifest.json\nrank-0-of-2.safetensors\nrank-1-of-2.safetensors\n");
  EXPECT_TRUE(Logged("checkpoint_upload"));
  ASSERT_TRUE(Consolidate(10, out_).ok());
  // A complete step's files cannot be uploaded again.
  ShardFile f = WriteShard(staging, plan_, 10, 0, members_[0]->info().generation);
  EXPECT_TRUE(
      absl::IsFailedPrecondition(members_[0]->UploadShard(10, f.relative, f.path).status()));
}

TEST_F(CheckpointServerTest, AShortUploadKeepsNothing) {
  StartServer(Options());
  JoinAndPlan();
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(10));
  v1::UploadShardResponse response;
  auto stub = testing::NewCoordinatorStub(server_->address());
  auto stream = stub->UploadShard(&context, &response);
  v1::UploadShardRequest first;
  *first.mutable_member() = members_[0]->credentials();
  first.set_step(10);
  first.set_file("ckpt/step-10/rank-0-of-2.safetensors");
  first.set_size_bytes(1000);
  first.set_data(std::string(100, 'x'));
  ASSERT_TRUE(stream->Write(first));
  stream->WritesDone();
  absl::Status s = FromGrpcStatus(stream->Finish());
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "100 of 1000")) << s;
  EXPECT_EQ(Listing(root_ + "/ckpt/step-10"), "") << "no file, no temporary file";
}

TEST_F(CheckpointServerTest, ARankWithAMissingOrCutFileNeverCompletesTheStep) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  ASSERT_TRUE(Commit(Write(20, 0), 20, 0).ok());
  ShardFile f1 = Write(20, 1);
  ASSERT_EQ(truncate(f1.path.c_str(), f1.size / 2), 0);
  absl::Status s = Commit(f1, 20, 1).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  ASSERT_EQ(unlink(f1.path.c_str()), 0);
  s = Commit(f1, 20, 1).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  auto list = ctl_->ListCheckpoints(kJob);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_FALSE(list->checkpoints(1).complete());
  EXPECT_FALSE(Exists(root_ + "/ckpt/step-20/manifest.json"));
  auto summary = Consolidate(-1, out_);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->step(), 10) << "the previous complete step stays the latest";
  s = Consolidate(20, out_ + "/x.safetensors").status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
}

TEST_F(CheckpointServerTest, ACorruptStepIsReportedByTheVerifierAndKeepsOlderSteps) {
  StartServer(Options(/*keep_last=*/1));
  JoinAndPlan();
  CompleteStep(10);
  // Rank 1's data corrupted after its header (and checksums) were written:
  // the commit, which does not read the data, accepts it.
  ASSERT_TRUE(Commit(Write(20, 0), 20, 0).ok());
  ShardFile f1 = Write(20, 1);
  int fd = open(f1.path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char byte = 0x7f;
  ASSERT_EQ(pwrite(fd, &byte, 1, f1.size - 3), 1);
  close(fd);
  auto response = Commit(f1, 20, 1);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(response->step_complete());
  server_->checkpoint_verifier()->WaitIdle();
  EXPECT_TRUE(Logged("checkpoint_verify_failed"));
  {
    absl::MutexLock lock(&mu_);
    bool named = false;
    for (const auto& line : log_) {
      named = named || (absl::StrContains(line, "checkpoint_verify_failed") &&
                        absl::StrContains(line, "rank-1-of-2.safetensors"));
    }
    EXPECT_TRUE(named);
  }
  EXPECT_TRUE(Exists(root_ + "/ckpt/step-10/manifest.json"))
      << "retention waits for a verified newer step";
  // Listed as failed, with the reason; "latest" is the newest intact step.
  auto list = ctl_->ListCheckpoints("ckpt");
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_EQ(list->checkpoints(0).verification(), "verified");
  EXPECT_EQ(list->checkpoints(1).step(), 20);
  EXPECT_EQ(list->checkpoints(1).verification(), "failed");
  EXPECT_NE(list->checkpoints(1).verification_error().find("rank-1-of-2.safetensors"),
            std::string::npos)
      << list->checkpoints(1).verification_error();
  auto summary = Consolidate(-1, out_ + "/latest-intact.safetensors");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->step(), 10);
}

TEST_F(CheckpointServerTest, KeepLastOneDeletesOlderStepsButNotTheLatest) {
  StartServer(Options(/*keep_last=*/1));
  JoinAndPlan();
  CompleteStep(10);
  CompleteStep(20);
  server_->checkpoint_verifier()->WaitIdle();  // retention follows verification
  EXPECT_FALSE(Exists(root_ + "/ckpt/step-10"));
  EXPECT_TRUE(Exists(root_ + "/ckpt/step-20/manifest.json"));
  ASSERT_TRUE(Commit(Write(30, 0), 30, 0).ok());  // being written
  auto list = ctl_->ListCheckpoints(kJob);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_EQ(list->checkpoints(0).step(), 20);
  EXPECT_EQ(list->checkpoints(1).step(), 30);
  EXPECT_TRUE(Logged("checkpoint_deleted"));
}

TEST_F(CheckpointServerTest, WithoutACheckpointRootTheRpcsSaySo) {
  ShardServerOptions options = Options();
  options.checkpoint_root.clear();
  StartServer(options);
  auto list = ctl_->ListCheckpoints("");
  EXPECT_TRUE(absl::IsFailedPrecondition(list.status())) << list.status();
  EXPECT_TRUE(absl::StrContains(list.status().message(), "no checkpoint root"));
  absl::Status s = Consolidate(-1, out_ + "/m.safetensors").status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "no checkpoint root")) << s;
}

TEST_F(CheckpointServerTest, ConsolidateRefusesBadRequests) {
  StartServer(Options());
  JoinAndPlan();
  CompleteStep(10);
  EXPECT_TRUE(absl::IsInvalidArgument(Consolidate(10, out_ + "/a", false, "int8").status()));
  EXPECT_TRUE(absl::IsNotFound(Consolidate(11, out_ + "/a").status()));
  v1::ConsolidateRequest request;
  request.set_job_id("../etc");
  request.set_step(-1);
  EXPECT_TRUE(absl::IsInvalidArgument(ctl_->Consolidate(request, out_ + "/a").status()));
  EXPECT_EQ(Listing(out_), "");
}

// An UploadShard stream driven by hand on its own channel: the first
// message (which the server checks) now, the rest when the test says.
class RawUpload {
 public:
  RawUpload(const std::string& address, const v1::MemberCredentials& member, int64_t step,
            const std::string& file, std::string bytes)
      : stub_(testing::NewCoordinatorStub(address)), bytes_(std::move(bytes)) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    stream_ = stub_->UploadShard(&context_, &response_);
    v1::UploadShardRequest first;
    *first.mutable_member() = member;
    first.set_step(step);
    first.set_file(file);
    first.set_size_bytes(static_cast<int64_t>(bytes_.size()));
    first.set_data(bytes_.substr(0, bytes_.size() / 2));
    EXPECT_TRUE(stream_->Write(first));
  }

  // Sends the second half and ends the stream; the server's answer.
  absl::Status Finish() {
    v1::UploadShardRequest rest;
    rest.set_data(bytes_.substr(bytes_.size() / 2));
    stream_->Write(rest);
    stream_->WritesDone();
    return FromGrpcStatus(stream_->Finish());
  }

 private:
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::string bytes_;
  grpc::ClientContext context_;
  v1::UploadShardResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::UploadShardRequest>> stream_;
};

// True once the server has admitted an upload into `dir` (its temporary
// file exists), within a 20-second deadline.
bool WaitForTemporaryFile(const std::string& dir) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    if (absl::StrContains(Listing(dir), ".tmp")) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

std::string FileBytes(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileToString(path);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : "";
}

TEST_F(CheckpointServerTest, AnUploadThatEndsAfterItsStepCompletedReplacesNothing) {
  StartServer(Options());
  JoinAndPlan();
  const std::string step_dir = root_ + "/ckpt/step-10";
  const std::string rank0 = step_dir + "/rank-0-of-2.safetensors";
  // Rank 0's upload begins while step 10 is incomplete...
  RawUpload late(server_->address(), members_[0]->credentials(), 10,
                 "ckpt/step-10/rank-0-of-2.safetensors", std::string(4096, 'z'));
  ASSERT_TRUE(WaitForTemporaryFile(step_dir));
  // ...the step completes through the shared filesystem meanwhile...
  CompleteStep(10);
  const std::string complete = FileBytes(rank0);
  // ...and the upload's end finds it complete: refused, its temporary file gone.
  absl::Status s = late.Finish();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "already complete")) << s;
  EXPECT_EQ(FileBytes(rank0), complete);
  EXPECT_EQ(Listing(step_dir), "manifest.json\nrank-0-of-2.safetensors\nrank-1-of-2.safetensors\n");
  auto list = ctl_->ListCheckpoints(kJob);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_TRUE(list->checkpoints(0).complete());
  EXPECT_TRUE(Consolidate(10, out_).ok());
}

TEST_F(CheckpointServerTest, AnUploadFencedOutByANewGenerationReplacesNothing) {
  ShardServerOptions options = Options();
  options.membership.heartbeat_timeout = absl::Seconds(2);
  StartServer(std::move(options));
  JoinAndPlan();
  const std::string step_dir = root_ + "/ckpt/step-10";
  const std::string rank0 = step_dir + "/rank-0-of-2.safetensors";
  const v1::MemberCredentials old_member = members_[0]->credentials();
  RawUpload fenced(server_->address(), old_member, 10, "ckpt/step-10/rank-0-of-2.safetensors",
                   std::string(4096, 'z'));
  ASSERT_TRUE(WaitForTemporaryFile(step_dir));
  // Generation 1 never heartbeats: both members are declared dead and the
  // generation is bumped.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  int64_t generation = old_member.generation();
  while (generation == old_member.generation() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    auto status = ctl_->GetStatus(kJob);
    ASSERT_TRUE(status.ok()) << status.status();
    if (status->jobs_size() == 1) generation = status->jobs(0).generation();
  }
  ASSERT_GT(generation, old_member.generation()) << "no generation bump within 20 s";
  // Generation 2 forms, beats, and completes step 10.
  JoinAndPlan();
  for (auto& m : members_) m->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});
  ASSERT_GT(members_[0]->info().generation, old_member.generation());
  CompleteStep(10);
  const std::string complete = FileBytes(rank0);
  // The fenced-out writer's upload ends now: refused, nothing replaced.
  absl::Status s = fenced.Finish();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(FileBytes(rank0), complete);
  EXPECT_EQ(Listing(step_dir), "manifest.json\nrank-0-of-2.safetensors\nrank-1-of-2.safetensors\n");
  EXPECT_TRUE(Consolidate(10, out_).ok());
  for (auto& m : members_) m->StopHeartbeats();
}

TEST_F(CheckpointServerTest, UploadsPastTheirBytesInFlightAreRefusedUntilOneEnds) {
  // Rank 0's 4,096-byte upload is in flight; rank 1's would take the job to
  // 8,192 bytes, past the job's bound of 6,000 (and then, with the job's bound
  // lifted, past the server's).
  for (const bool job_bound : {true, false}) {
    SCOPED_TRACE(job_bound ? "per job" : "in total");
    // A server of its own each time: its own state and checkpoint root.
    const std::string run = dir_ + (job_bound ? "/per-job" : "/in-total");
    ASSERT_EQ(mkdir(run.c_str(), 0755), 0);
    root_ = run + "/checkpoints";
    ShardServerOptions options = Options();
    options.state_dir = run + "/state";
    options.checkpoint_service.max_upload_job_bytes = job_bound ? 6000 : int64_t{1} << 40;
    options.checkpoint_service.max_upload_total_bytes = job_bound ? int64_t{1} << 40 : 6000;
    StartServer(std::move(options));
    JoinAndPlan();
    const std::string step_dir = root_ + "/ckpt/step-10";
    RawUpload first(server_->address(), members_[0]->credentials(), 10,
                    "ckpt/step-10/rank-0-of-2.safetensors", std::string(4096, 'a'));
    ASSERT_TRUE(WaitForTemporaryFile(step_dir));
    const std::string second_path = dir_ + "/rank-1-upload";
    testing::WriteFile(second_path, std::string(4096, 'b'));
    absl::Status refused =
        members_[1]->UploadShard(10, "ckpt/step-10/rank-1-of-2.safetensors", second_path).status();
    EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
    for (const char* part :
         {"job 'ckpt'", "8192 bytes", "6000",
          job_bound ? "--checkpoint_upload_max_job_bytes" : "--checkpoint_upload_max_total_bytes"}) {
      EXPECT_TRUE(absl::StrContains(refused.message(), part)) << part << " in " << refused;
    }
    EXPECT_FALSE(Exists(step_dir + "/rank-1-of-2.safetensors"));
    // The first ends (published), which frees its bytes: the second goes through.
    ASSERT_TRUE(first.Finish().ok());
    absl::StatusOr<int64_t> sent =
        members_[1]->UploadShard(10, "ckpt/step-10/rank-1-of-2.safetensors", second_path);
    ASSERT_TRUE(sent.ok()) << sent.status();
    EXPECT_EQ(*sent, 4096);
    EXPECT_EQ(FileBytes(step_dir + "/rank-1-of-2.safetensors"), std::string(4096, 'b'));
  }
}

TEST_F(CheckpointServerTest, AConsolidationWhoseReaderStallsIsCancelledAndFreesItsSlot) {
  ShardServerOptions options = Options();
  options.checkpoint_service.max_consolidations = 1;
  options.checkpoint_service.stall_timeout = absl::Seconds(1);
  StartServer(std::move(options));
  // 48 MiB with the optimizer state: more than gRPC buffers for a reader
  // that stops reading.
  v1::ModelSpec big;
  for (int i = 0; i < 4; ++i) {
    v1::TensorSpec* t = big.add_tensors();
    t->set_name(absl::StrCat(i, ".weight"));
    t->add_shape(1024);
    t->add_shape(1024);
    t->set_dtype("F32");
  }
  JoinAndPlan(big);
  CompleteStep(10);

  // A caller that takes the first message and then reads nothing more.
  auto stub = testing::NewCoordinatorStub(server_->address());
  grpc::ClientContext stalled;
  stalled.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  v1::ConsolidateRequest request;
  request.set_job_id(kJob);
  request.set_step(10);
  auto reader = stub->Consolidate(&stalled, request);
  v1::ConsolidateResponse first;
  ASSERT_TRUE(reader->Read(&first));

  // Its slot is the only one; within the stall timeout it is freed and a
  // consolidation that reads runs to the end.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Status s;
  do {
    s = Consolidate(10, out_).status();
    if (s.ok()) break;
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < deadline);
  EXPECT_TRUE(s.ok()) << "the stalled consolidation still holds its slot: " << s;
  EXPECT_TRUE(Logged("consolidate_failed"));
  stalled.TryCancel();
  v1::ConsolidateResponse rest;
  while (reader->Read(&rest)) {
  }
  EXPECT_FALSE(reader->Finish().ok());
}

// Sets the modification time of `path` (not following a link) `age` ago.
void Age(const std::string& path, absl::Duration age) {
  const int64_t when = absl::ToUnixSeconds(absl::Now() - age);
  struct timespec times[2] = {{when, 0}, {when, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW), 0) << path;
}

TEST_F(CheckpointServerTest, AStartingServerRemovesWhatACrashLeftAndNothingElse) {
  const std::string job = root_ + "/ckpt";
  ASSERT_EQ(testing::RunCommand(absl::StrCat("mkdir -p ", job, "/step-3 ", job, "/step-4 ", job,
                                             "/step-5 ", job, "/consolidated/step-3 ", job,
                                             "/consolidated/.step-3.tmp-0123456789abcdef ", dir_,
                                             "/outside"))
                .first,
            0);
  const std::string stale_upload = job + "/step-3/rank-0-of-2.safetensors.tmp-00000000deadbeef";
  const std::string shard = job + "/step-3/rank-1-of-2.safetensors";
  const std::string fresh_upload = job + "/step-5/rank-0-of-2.safetensors.tmp-0000000012345678";
  const std::string output = job + "/consolidated/step-3/model.safetensors";
  const std::string stale_output =
      job + "/consolidated/.step-3.tmp-0123456789abcdef/model.safetensors";
  const std::string outside = dir_ + "/outside/keep.tmp-0123456789abcdef";
  for (const std::string& f : {stale_upload, shard, fresh_upload, output, stale_output, outside}) {
    testing::WriteFile(f, "bytes");
  }
  // A link named like a temporary file, into a directory outside the root.
  const std::string link = job + "/step-3/link.tmp-00000000cafef00d";
  ASSERT_EQ(symlink(outside.c_str(), link.c_str()), 0);
  for (const std::string& p :
       {stale_upload, shard, output, stale_output, outside, link, job + "/step-3", job + "/step-4",
        job + "/consolidated/.step-3.tmp-0123456789abcdef"}) {
    Age(p, absl::Hours(1));
  }

  StartServer(Options());
  EXPECT_FALSE(Exists(stale_upload));
  EXPECT_FALSE(Exists(stale_output));
  EXPECT_FALSE(Exists(job + "/consolidated/.step-3.tmp-0123456789abcdef"));
  EXPECT_FALSE(Exists(job + "/step-4")) << "an empty step directory";
  EXPECT_TRUE(Exists(shard));
  EXPECT_TRUE(Exists(output));
  EXPECT_TRUE(Exists(fresh_upload)) << "a worker may be writing it now";
  EXPECT_TRUE(Exists(link));
  EXPECT_TRUE(Exists(outside));
  EXPECT_TRUE(Logged("checkpoint_leftovers_removed"));
}

}  // namespace
}  // namespace zeroshard
