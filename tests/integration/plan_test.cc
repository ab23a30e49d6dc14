// Shard plans as jobs and people get them: PlanShards over real gRPC on
// loopback (an in-process ShardServer, real clients), and the shardctl binary
// run as a process for `spec` and `plan`.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/model_spec.h"
#include "common/model_zoo.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "common/table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shard_server/shard_server.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
// Keeps keys in document order, so the test sees the order scripts see.
using Json = nlohmann::ordered_json;

// A long heartbeat timeout: these tests never beat, and a slow machine must
// not declare their members dead.
ShardServerOptions ServerOptions(const std::string& state_dir = "") {
  ShardServerOptions o;
  o.listen = "127.0.0.1:0";
  o.state_dir = state_dir;
  o.membership.heartbeat_interval = absl::Milliseconds(100);
  o.membership.heartbeat_timeout = absl::Seconds(60);
  o.membership.join_timeout = absl::Seconds(30);
  o.log_sink = [](const std::string&) {};
  return o;
}

std::unique_ptr<ShardServer> StartServer(const ShardServerOptions& options) {
  auto server = ShardServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<Client> Connect(const ShardServer& server) {
  ClientOptions o;
  o.server = server.address();
  o.rpc_timeout = absl::Seconds(10);
  auto client = Client::Connect(o);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// Joins `world` clients concurrently (a join waits for the whole job).
std::vector<std::unique_ptr<Client>> JoinAll(const ShardServer& server, const std::string& job,
                                             int world) {
  std::vector<std::unique_ptr<Client>> clients(world);
  std::vector<absl::Status> statuses(world);
  std::vector<std::thread> threads;
  for (int i = 0; i < world; ++i) {
    clients[i] = Connect(server);
    threads.emplace_back([&, i] {
      statuses[i] = clients[i]
                        ->Join(job, world, absl::StrCat("w", i), "127.0.0.1", absl::Seconds(20))
                        .status();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < world; ++i) EXPECT_TRUE(statuses[i].ok()) << statuses[i];
  return clients;
}

ModelSpec SmallGpt2() { return *Gpt2Spec(/*layers=*/2, /*d_model=*/64, /*heads=*/4, 500, 128); }

v1::TensorSpec* AddTensor(v1::ModelSpec* spec, const std::string& name, std::vector<int64_t> shape,
                          const std::string& dtype = "F32") {
  v1::TensorSpec* tensor = spec->add_tensors();
  tensor->set_name(name);
  for (int64_t dim : shape) tensor->add_shape(dim);
  tensor->set_dtype(dtype);
  return tensor;
}

TEST(PlanShardsTest, MembersOfAGenerationShareOneStoredPlanThatSurvivesARestart) {
  ShardServerOptions options = ServerOptions(testing::MakeTempDir("plan-restart"));
  auto server = StartServer(options);
  ASSERT_NE(server, nullptr);
  // The same port after the restart, so the members' channels find it again.
  options.listen = server->address();
  constexpr int kWorld = 3;
  auto clients = JoinAll(*server, "planned", kWorld);
  const ModelSpec spec = SmallGpt2();
  const ModelSpec other = *MlpSpec(2, 64, "relu");
  const PlanOptions defaults;

  std::vector<absl::StatusOr<ShardPlan>> plans(kWorld);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorld; ++i) {
    threads.emplace_back([&, i] { plans[i] = clients[i]->PlanShards(spec, defaults, kWorld); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kWorld; ++i) {
    ASSERT_TRUE(plans[i].ok()) << plans[i].status();
    EXPECT_EQ(plans[i]->hash, plans[0]->hash);
    EXPECT_EQ(ShardPlanToProto(*plans[i]).SerializeAsString(),
              ShardPlanToProto(*plans[0]).SerializeAsString());
  }
  EXPECT_EQ(plans[0]->world_size, kWorld);
  // It is the planner's plan of the job's world size, and status shows it.
  absl::StatusOr<ShardPlan> local = Plan(SmallGpt2(), kWorld, PlanOptions());
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(plans[0]->hash, local->hash);
  absl::StatusOr<v1::GetStatusResponse> status = clients[0]->GetStatus("planned");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->jobs(0).plan_hash(), local->hash);

  // Another spec, or the same spec with other options, in the same generation.
  absl::StatusOr<ShardPlan> refused = clients[1]->PlanShards(other, defaults, kWorld);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr(local->hash));
  PlanOptions smaller_units;
  smaller_units.max_unit_bytes = 1 << 16;
  EXPECT_EQ(clients[2]->PlanShards(spec, smaller_units, kWorld).status().code(),
            absl::StatusCode::kFailedPrecondition);

  server->Shutdown();
  server.reset();
  server = StartServer(options);
  ASSERT_NE(server, nullptr);
  // Refused first: had the restarted server lost the plan, this call would
  // have become the generation's plan.
  refused = clients[2]->PlanShards(other, defaults, kWorld);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  for (int i = 0; i < kWorld; ++i) {
    absl::StatusOr<ShardPlan> again = clients[i]->PlanShards(spec, defaults, kWorld);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(ShardPlanToProto(*again).SerializeAsString(),
              ShardPlanToProto(*plans[0]).SerializeAsString());
  }
  status = clients[0]->GetStatus("planned");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->jobs(0).plan_hash(), local->hash);
}

struct InvalidCase {
  std::string what;
  v1::ModelSpec spec;
  int world_size = 4;
  std::vector<std::string> message_parts;  // each must appear in the error
};

std::vector<InvalidCase> InvalidCases() {
  std::vector<InvalidCase> cases;
  auto add = [&](std::string what, std::vector<std::string> parts) -> v1::ModelSpec* {
    cases.push_back({std::move(what), {}, 4, std::move(parts)});
    return &cases.back().spec;
  };
  {
    v1::ModelSpec* s = add("empty name", {"tensor 1", "empty name"});
    AddTensor(s, "fine", {4});
    AddTensor(s, "", {4});
  }
  {
    v1::ModelSpec* s = add("duplicate name", {"\"dup.weight\"", "duplicate"});
    AddTensor(s, "dup.weight", {4, 4});
    AddTensor(s, "other", {4});
    AddTensor(s, "dup.weight", {8});
  }
  AddTensor(add("zero dimension", {"\"zero.weight\"", "= 0"}), "zero.weight", {4, 0});
  AddTensor(add("negative dimension", {"\"neg.weight\"", "-3"}), "neg.weight", {-3, 4});
  AddTensor(add("element count overflow", {"\"huge\"", "4294967296", "overflows int64"}), "huge",
            {int64_t{1} << 32, int64_t{1} << 32});
  AddTensor(add("unknown dtype", {"\"q.weight\"", "\"F8\""}), "q.weight", {4, 4}, "F8");
  AddTensor(add("world size 0", {"world size 0"}), "w", {4});
  cases.back().world_size = 0;
  AddTensor(add("world size 131073", {"world size 131073", "131072"}), "w", {4});
  cases.back().world_size = kMaxWorldSize + 1;
  return cases;
}

TEST(PlanShardsTest, InvalidSpecsAreRefusedNamingTheTensorAndTheServerStaysUp) {
  auto server = StartServer(ServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = Connect(*server);  // never joins: one-off plans
  for (const InvalidCase& c : InvalidCases()) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<ShardPlan> plan =
        client->PlanShards(ModelSpecFromProto(c.spec), {}, c.world_size);
    ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    for (const std::string& part : c.message_parts) {
      EXPECT_THAT(std::string(plan.status().message()), HasSubstr(part));
    }
    EXPECT_TRUE(client->HealthCheck().ok());
  }

  // A member's refused spec stores nothing: the generation's first valid
  // spec still becomes its plan.
  auto members = JoinAll(*server, "typo", 2);
  const InvalidCase duplicate = InvalidCases()[1];
  EXPECT_EQ(members[0]->PlanShards(ModelSpecFromProto(duplicate.spec), {}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ShardPlan> plan = members[1]->PlanShards(SmallGpt2(), {}, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->world_size, 2);
  EXPECT_TRUE(client->HealthCheck().ok());
}

// ---- shardctl ----

struct Output {
  int code = 0;
  std::string out;  // stdout
  std::string err;  // stderr
};

class ShardctlPlanTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("shardctl-plan"); }

  // Runs shardctl with `args`, keeping stdout (what scripts parse) apart
  // from stderr (messages).
  Output Shardctl(const std::string& args) {
    const std::string err_path = absl::StrCat(dir_, "/stderr.", runs_++);
    auto [code, out] = testing::RunCommand(absl::StrCat(
        "{ ", testing::RunfilePath("client/shardctl"), " ", args, " 2>", err_path, "; }"));
    return {code, out, testing::ReadFileOrEmpty(err_path)};
  }

  std::string WriteSpec(const std::string& name, const std::string& json) {
    std::string path = absl::StrCat(dir_, "/", name);
    testing::WriteFile(path, json);
    return path;
  }

  std::string dir_;
  int runs_ = 0;
};

int64_t Elements(const Json& shape) {
  int64_t n = 1;
  for (const auto& dim : shape) n *= dim.get<int64_t>();
  return n;
}

TEST_F(ShardctlPlanTest, SpecPrintsPyTorchNamesForTheMlp) {
  Output mlp = Shardctl("spec --model=mlp --layers=3 --width=2000 --activation=relu");
  ASSERT_EQ(mlp.code, 0) << mlp.err;
  Json spec = Json::parse(mlp.out);
  const std::vector<std::string> names = {"0.weight", "0.bias",   "2.weight",
                                          "2.bias",   "4.weight", "4.bias"};
  ASSERT_EQ(spec["tensors"].size(), names.size()) << mlp.out;
  for (size_t i = 0; i < names.size(); ++i) {
    const Json& t = spec["tensors"][i];
    EXPECT_EQ(t["name"], names[i]);
    EXPECT_EQ(t["dtype"], "F32");
    EXPECT_EQ(t["unit"], names[i].substr(0, 1));
    EXPECT_EQ(t["shape"], i % 2 == 0 ? Json({2000, 2000}) : Json({2000}));
  }
  // Without an activation the Linears are modules 0, 1, 2.
  Output plain = Shardctl("spec --model=mlp --layers=2 --width=8");
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_EQ(Json::parse(plain.out)["tensors"][2]["name"], "1.weight");

  Output wrong = Shardctl("spec --model=mlp --layers=2 --width=8 --heads=4");
  EXPECT_NE(wrong.code, 0);
  EXPECT_THAT(wrong.err, HasSubstr("--heads"));
  EXPECT_EQ(wrong.out, "");
}

TEST_F(ShardctlPlanTest, SpecPrintsHuggingFaceGpt2WithItsParameterCount) {
  Output gpt2 = Shardctl(
      "spec --model=gpt2 --layers=12 --d_model=768 --heads=12 --vocab=50257 --context=1024");
  ASSERT_EQ(gpt2.code, 0) << gpt2.err;
  Json spec = Json::parse(gpt2.out);
  int64_t parameters = 0;
  for (const auto& t : spec["tensors"]) parameters += Elements(t["shape"]);
  EXPECT_EQ(parameters, 124439808);
  ASSERT_EQ(spec["tensors"].size(), 2 + 12 * 12 + 2);
  EXPECT_EQ(spec["tensors"][0]["name"], "transformer.wte.weight");
  EXPECT_EQ(spec["tensors"][0]["shape"], Json({50257, 768}));
  EXPECT_EQ(spec["tensors"][1]["name"], "transformer.wpe.weight");
  EXPECT_EQ(spec["tensors"][1]["shape"], Json({1024, 768}));
  // Conv1D weights are [in, out].
  EXPECT_EQ(spec["tensors"][4]["name"], "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(spec["tensors"][4]["shape"], Json({768, 2304}));
  EXPECT_EQ(spec["tensors"][4]["unit"], "h.0");
  EXPECT_EQ(spec["tensors"].back()["name"], "transformer.ln_f.bias");

  Output missing = Shardctl("spec --model=gpt2 --layers=12 --d_model=768");
  EXPECT_NE(missing.code, 0);
  EXPECT_THAT(missing.err, HasSubstr("--heads, --vocab, --context"));
}

// The model zoo is the only list of each model's tensors: what `shardctl
// spec` prints for a model's flags is what shard_worker sends for the same
// flags (the plan of either, and so its hash, covers every tensor's name,
// shape, dtype and unit).
TEST_F(ShardctlPlanTest, SpecThatShardctlPrintsIsTheSpecTheWorkerTrains) {
  struct Case {
    std::string shardctl;  // spec flags
    std::vector<std::string> worker;
  };
  const std::vector<Case> cases = {
      {"--model=mlp --layers=3 --width=16 --activation=relu",
       {"--model=mlp", "--layers=3", "--width=16", "--activation=relu"}},
      {"--model=mlp --layers=2 --width=8", {"--model=mlp", "--layers=2", "--width=8"}},
      // The worker's GPT reads bytes: a vocabulary of 256.
      {"--model=gpt2 --layers=2 --d_model=32 --heads=4 --vocab=256 --context=16",
       {"--model=gpt", "--layers=2", "--d_model=32", "--heads=4", "--context=16"}},
  };
  testing::LocalCluster cluster(dir_);
  ASSERT_TRUE(cluster.ok());
  int job = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.shardctl);
    Output printed = Shardctl(absl::StrCat("spec ", c.shardctl));
    ASSERT_EQ(printed.code, 0) << printed.err;
    absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(printed.out);
    ASSERT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<ShardPlan> expected = Plan(*spec, 1, PlanOptions());
    ASSERT_TRUE(expected.ok()) << expected.status();

    const std::string name = absl::StrCat("spec-", job++);
    std::vector<std::string> flags = c.worker;
    flags.push_back("--steps=1");
    flags.push_back("--batch=2");
    ASSERT_TRUE(cluster.Run(name, 1, flags));
    EXPECT_EQ(cluster.Report(name, 0)["plan_hash"], expected->hash);
  }
}

TEST_F(ShardctlPlanTest, LocalAndServerPlansAgreeAndReportPaddingAndMemory) {
  auto server = StartServer(ServerOptions());
  ASSERT_NE(server, nullptr);
  const std::string remote = absl::StrCat("--server=", server->address());
  Output spec_output = Shardctl(
      "spec --model=gpt2 --layers=12 --d_model=768 --heads=12 --vocab=50257 --context=1024");
  ASSERT_EQ(spec_output.code, 0) << spec_output.err;
  const std::string spec_path = WriteSpec("gpt2.json", spec_output.out);
  const std::string plan_args = absl::StrCat("plan --spec=", spec_path, " --world=8");

  Output local = Shardctl(absl::StrCat(plan_args, " --local --json"));
  ASSERT_EQ(local.code, 0) << local.err;
  Output served = Shardctl(absl::StrCat(remote, " ", plan_args, " --json"));
  ASSERT_EQ(served.code, 0) << served.err;
  Json plan = Json::parse(local.out);
  EXPECT_EQ(Json::parse(served.out)["plan_hash"], plan["plan_hash"]);
  EXPECT_EQ(served.out, local.out);
  std::vector<std::string> keys;
  for (auto it = plan.begin(); it != plan.end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(keys, std::vector<std::string>({"world_size", "shard_group_size", "plan_hash",
                                            "padding_overhead", "units", "memory_estimate"}));
  EXPECT_EQ(plan["world_size"], 8);
  EXPECT_EQ(plan["shard_group_size"], 8);  // no --shard_group_size: one group of all ranks

  // padding_overhead = (sum over units of W * chunk_elements) / (sum of tensor
  // elements) - 1, and the pieces cover every element once.
  std::map<std::string, int64_t> row_elements;
  int64_t parameters = 0;
  const Json spec = Json::parse(spec_output.out);
  for (const auto& t : spec["tensors"]) {
    const int64_t n = Elements(t["shape"]);
    parameters += n;
    row_elements[t["name"].get<std::string>()] = n / t["shape"][0].get<int64_t>();
  }
  double allocated = 0;
  int64_t covered = 0;
  for (const auto& unit : plan["units"]) {
    allocated += 8.0 * unit["chunk_elements"].get<int64_t>();
    for (const auto& p : unit["pieces"]) {
      covered += (p["row_end"].get<int64_t>() - p["row_begin"].get<int64_t>()) *
                 row_elements.at(p["tensor"].get<std::string>());
    }
  }
  EXPECT_EQ(covered, parameters);
  EXPECT_NEAR(plan["padding_overhead"].get<double>(), allocated / parameters - 1, 1e-12);
  EXPECT_LT(plan["padding_overhead"].get<double>(), 0.01);
  const Json& estimate = plan["memory_estimate"];
  EXPECT_EQ(estimate["parameters"], parameters);
  ASSERT_EQ(estimate["stages"].size(), 4);

  // For people: the same plan, and one row per stage with the estimate's
  // totals, the --stage one marked.
  Output table = Shardctl(absl::StrCat(plan_args, " --local --stage=1"));
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_EQ(Shardctl(absl::StrCat(remote, " ", plan_args, " --stage=1")).out, table.out);
  EXPECT_THAT(table.out, HasSubstr(plan["plan_hash"].get<std::string>()));
  EXPECT_THAT(table.out, HasSubstr("124,439,808"));
  EXPECT_THAT(table.out, HasSubstr("h.11"));
  std::vector<std::string> lines = absl::StrSplit(table.out, '\n');
  for (int stage = 0; stage < 4; ++stage) {
    const std::string prefix = absl::StrCat(stage, stage == 1 ? " *" : "", "  ");
    const std::string total = HumanBytes(estimate["stages"][stage]["total_bytes"].get<int64_t>());
    bool found = false;
    for (const std::string& line : lines) {
      found = found || (line.rfind(prefix, 0) == 0 && line.find(total) != std::string::npos);
    }
    EXPECT_TRUE(found) << "no row \"" << prefix << "... " << total << "\" in\n" << table.out;
  }
}

TEST_F(ShardctlPlanTest, RefusedSpecsExitNonZeroWithTheReasonOnStderr) {
  auto server = StartServer(ServerOptions());
  ASSERT_NE(server, nullptr);
  const std::string duplicate = WriteSpec(
      "dup.json",
      R"({"tensors":[{"name":"a.weight","shape":[4,4]},{"name":"a.weight","shape":[4]}]})");
  for (const std::string& where :
       {std::string("--local"), absl::StrCat("--server=", server->address())}) {
    SCOPED_TRACE(where);
    Output refused = Shardctl(absl::StrCat("plan --spec=", duplicate, " --world=2 ", where));
    EXPECT_NE(refused.code, 0);
    EXPECT_THAT(refused.err, HasSubstr("\"a.weight\""));
    EXPECT_THAT(refused.err, HasSubstr("INVALID_ARGUMENT"));
    EXPECT_EQ(refused.out, "");
  }
  EXPECT_TRUE(Connect(*server)->HealthCheck().ok());

  const std::string broken = WriteSpec("broken.json", R"({"tensors":[{"name":)");
  Output unparsed = Shardctl(absl::StrCat("plan --spec=", broken, " --world=2 --local"));
  EXPECT_NE(unparsed.code, 0);
  EXPECT_THAT(unparsed.err, HasSubstr(broken));
  EXPECT_THAT(unparsed.err, HasSubstr("not valid JSON"));

  Output absent = Shardctl(absl::StrCat("plan --spec=", dir_, "/absent.json --world=2 --local"));
  EXPECT_NE(absent.code, 0);
  EXPECT_THAT(absent.err, HasSubstr("absent.json"));
  EXPECT_THAT(absent.err, Not(HasSubstr("INVALID_ARGUMENT")));
}

}  // namespace
}  // namespace zeroshard
