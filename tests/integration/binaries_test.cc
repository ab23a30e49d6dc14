// The shipped binaries as a user runs them: shard_server started as a
// process, queried by gRPC health checks and by shardctl.
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::ChildProcess;

class BinariesTest : public ::testing::Test {
 protected:
  void StartServer(std::vector<std::string> extra = {}) {
    dir_ = testing::MakeTempDir("binaries");
    std::vector<std::string> args = {"--listen=127.0.0.1:0", "--port_file=" + dir_ + "/port",
                                     "--state_dir=" + dir_ + state_};
    args.insert(args.end(), extra.begin(), extra.end());
    server_ = std::make_unique<ChildProcess>(testing::RunfilePath("shard_server/shard_server"),
                                             args, dir_ + "/server.log");
    std::string port;
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          port = testing::ReadFileOrEmpty(dir_ + "/port");
          return !port.empty() && port.back() == '\n';
        },
        absl::Seconds(20)))
        << server_->Log();
    port.pop_back();
    address_ = "127.0.0.1:" + port;
  }

  std::pair<int, std::string> Shardctl(const std::string& args) {
    return testing::RunCommand(absl::StrCat(testing::RunfilePath("client/shardctl"),
                                            " --server=", address_, " ", args));
  }

  std::string dir_;
  std::string state_ = "/state";  // --state_dir, under dir_
  std::string address_;
  std::unique_ptr<ChildProcess> server_;
};

TEST_F(BinariesTest, ServerPrintsListeningAndAnswersHealthChecks) {
  StartServer();
  EXPECT_NE(server_->Log().find("listening on " + address_), std::string::npos) << server_->Log();
  ClientOptions options;
  options.server = address_;
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  EXPECT_TRUE((*client)->HealthCheck().ok());
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(10)), 0) << server_->Log();
}

// As README's tour starts it, on a machine where the state directory's
// parents do not exist yet: they are made, the directory itself private.
TEST_F(BinariesTest, TheStateDirAndItsMissingParentsAreMade) {
  state_ = "/new/parents/state/";
  StartServer();
  const std::string state = dir_ + "/new/parents/state";
  EXPECT_TRUE(testing::WaitFor([&] { return access((state + "/zeroshard.db").c_str(), F_OK) == 0; },
                               absl::Seconds(10)))
      << server_->Log();
  struct stat info {};
  ASSERT_EQ(stat(state.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0700u);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(10)), 0) << server_->Log();
}

// A state directory that cannot be made (a file stands where a parent
// would be): refused at start, saying which flag and what to do.
TEST(StateDirTest, OneThatCannotBeMadeIsRefusedAtStart) {
  const std::string dir = testing::MakeTempDir("state-refused");
  testing::WriteFile(dir + "/file", "not a directory\n");
  auto [code, output] = testing::RunCommand(
      absl::StrCat("timeout 20 ", testing::RunfilePath("shard_server/shard_server"),
                   " --listen=127.0.0.1:0 --state_dir=", dir, "/file/sub/state 2>&1"));
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(code, 124) << "it served instead of refusing: " << output;
  EXPECT_NE(output.find("cannot create --state_dir " + dir + "/file/sub/state"), std::string::npos)
      << output;
  EXPECT_NE(output.find("pass a --state_dir this user can create"), std::string::npos) << output;
  // The file itself as the state directory.
  auto [file_code, file_output] = testing::RunCommand(
      absl::StrCat("timeout 20 ", testing::RunfilePath("shard_server/shard_server"),
                   " --listen=127.0.0.1:0 --state_dir=", dir, "/file 2>&1"));
  EXPECT_NE(file_code, 0) << file_output;
  EXPECT_NE(file_code, 124) << file_output;
  EXPECT_NE(file_output.find("--state_dir " + dir + "/file is not a directory"), std::string::npos)
      << file_output;
}

// A port past 65535 (gRPC would serve on it modulo 65536, somewhere else):
// refused, saying the form expected.
TEST(ListenTest, APortOutOfRangeIsRefused) {
  const std::string dir = testing::MakeTempDir("listen-range");
  auto [code, output] = testing::RunCommand(
      absl::StrCat("timeout 20 ", testing::RunfilePath("shard_server/shard_server"),
                   " --listen=127.0.0.1:99999 --state_dir=", dir, "/state 2>&1"));
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(code, 124) << "it served: " << output;
  EXPECT_NE(output.find("--listen=127.0.0.1:99999: port '99999' is not a port number"),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("listening on"), std::string::npos) << output;
}

// The node agent's socket directory is made as `mkdir -p` would (docs/scale.md
// listens on /run/zeroshard/agent.sock, which a fresh host lacks); a path
// whose directory cannot be made is refused naming the flag.
TEST(AgentListenTest, TheSocketsDirectoryIsMadeAndOneThatCannotBeIsRefused) {
  // Under /tmp: a unix socket path has at most 107 characters.
  char tmpl[] = "/tmp/zs-agent-dir-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  absl::Cleanup remove = [&dir] { testing::RunCommand("rm -rf " + dir); };
  const std::string agent = testing::RunfilePath("agent/shard_agent");
  const std::string socket = dir + "/run/zeroshard/agent.sock";
  // Started, waited for until its socket exists (at most 20 s), stopped.
  auto [code, output] = testing::RunCommand(absl::StrCat(
      "timeout 30 sh -c '", agent, " --server=127.0.0.1:9 --listen=unix:", socket,
      " & pid=$!; i=0; while [ ! -S ", socket, " ] && kill -0 $pid && [ $i -lt 200 ]; do "
      "sleep 0.1; "
      "i=$((i+1)); done; [ -S ", socket, " ] && echo SOCKET; kill $pid; wait $pid' 2>&1"));
  EXPECT_NE(output.find("SOCKET"), std::string::npos) << output;
  EXPECT_NE(output.find("listening on unix:" + socket), std::string::npos) << output;

  testing::WriteFile(dir + "/a-file", "not a directory\n");
  auto [refused_code, refused] = testing::RunCommand(
      absl::StrCat("timeout 20 ", agent, " --server=127.0.0.1:9 --listen=unix:", dir,
                   "/a-file/agent.sock 2>&1"));
  EXPECT_NE(refused_code, 0) << refused;
  EXPECT_NE(refused_code, 124) << "it served: " << refused;
  EXPECT_NE(refused.find("--listen=unix:" + dir + "/a-file/agent.sock: cannot create the "
                         "socket's directory"),
            std::string::npos)
      << refused;
}

// `shardctl top` for a script: a last read that failed exits 1 with its
// error on stderr (it exited 0), as `status` does.
TEST_F(BinariesTest, ShardctlTopExitsNonZeroWhenItsLastReadFailed) {
  StartServer();
  auto [code, output] = Shardctl("top --top_iterations=1 --job=nope 2>&1");
  EXPECT_EQ(code, 1) << output;
  EXPECT_NE(output.find("shardctl: NOT_FOUND"), std::string::npos) << output;
  auto [fine_code, fine] = Shardctl("top --top_iterations=1 2>&1");
  EXPECT_EQ(fine_code, 0) << fine;
}

TEST_F(BinariesTest, SixtyFourJoinsAreListedByShardctlStatusJson) {
  StartServer();
  auto stub = testing::NewCoordinatorStub(address_);
  constexpr int kWorld = 64;
  std::vector<std::thread> threads;
  std::vector<grpc::Status> statuses(kWorld);
  std::vector<v1::JoinResponse> responses(kWorld);
  for (int i = 0; i < kWorld; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      testing::PrepareContext(&context, absl::Seconds(30));
      v1::JoinRequest request;
      request.set_job_id("status-job");
      request.set_world_size(kWorld);
      request.set_worker_id(absl::StrFormat("host%02d/0", i));
      request.set_host(absl::StrFormat("host%02d", i));
      statuses[i] = stub->Join(&context, request, &responses[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kWorld; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_EQ(responses[i].rank(), i);
  }

  auto [code, output] = Shardctl("status --json");
  ASSERT_EQ(code, 0) << output;
  nlohmann::json status = nlohmann::json::parse(output);
  ASSERT_EQ(status["jobs"].size(), 1u);
  const auto& job = status["jobs"][0];
  EXPECT_EQ(job["job_id"], "status-job");
  EXPECT_EQ(job["state"], "RUNNING");
  EXPECT_EQ(job["world_size"], kWorld);
  ASSERT_EQ(job["members"].size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(job["members"][r]["rank"], r);
    EXPECT_EQ(job["members"][r]["worker_id"], absl::StrFormat("host%02d/0", r));
    EXPECT_EQ(job["members"][r]["alive"], true);
  }

  auto [table_code, table] = Shardctl("status");
  ASSERT_EQ(table_code, 0) << table;
  EXPECT_NE(table.find("JOB"), std::string::npos);
  EXPECT_NE(table.find("status-job"), std::string::npos);
  EXPECT_NE(table.find("host63/0"), std::string::npos);
}

// Lines of `text` that contain `needle`.
int CountLines(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// A job of more than 64 ranks is summarized by the server (issue #31:
// 100,000 ranks are not 100,000 rows, nor a 20 MB reply per refresh): its
// worst 32 ranks, worst hosts and histograms; --rank=R, --host=H and --all
// reach every rank, and --json is the same view (--all --json: whole).
TEST_F(BinariesTest, ShardctlSummarizesAJobOfMoreThanSixtyFourRanks) {
  StartServer();
  auto stub = testing::NewCoordinatorStub(address_);
  constexpr int kWorld = 100;
  std::vector<std::thread> threads;
  std::vector<grpc::Status> statuses(kWorld);
  std::vector<v1::JoinResponse> responses(kWorld);
  for (int i = 0; i < kWorld; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      testing::PrepareContext(&context, absl::Seconds(30));
      v1::JoinRequest request;
      request.set_job_id("big-job");
      request.set_world_size(kWorld);
      request.set_worker_id(absl::StrFormat("host%02d/0", i));
      request.set_host(absl::StrFormat("host%02d", i));
      statuses[i] = stub->Join(&context, request, &responses[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kWorld; ++i) ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
  // Rank 73 leaves: the worst rank, listed although 32 healthier ranks
  // have lower numbers.
  int leaver = -1;
  for (int i = 0; i < kWorld; ++i) leaver = responses[i].rank() == 73 ? i : leaver;
  ASSERT_GE(leaver, 0);
  {
    grpc::ClientContext context;
    testing::PrepareContext(&context, absl::Seconds(10));
    v1::LeaveRequest request;
    v1::MemberCredentials* m = request.mutable_member();
    m->set_job_id("big-job");
    m->set_generation(responses[leaver].generation());
    m->set_rank(73);
    m->set_token(responses[leaver].token());
    v1::LeaveResponse response;
    ASSERT_TRUE(stub->Leave(&context, request, &response).ok());
  }
  const std::string leaver_worker = absl::StrFormat("host%02d/0", leaver);

  auto [code, summary] = Shardctl("status --job=big-job");
  ASSERT_EQ(code, 0) << summary;
  EXPECT_NE(summary.find("worst 32 of 100 ranks"), std::string::npos) << summary;
  EXPECT_NE(summary.find("worst 16 of 100 hosts"), std::string::npos) << summary;
  EXPECT_NE(summary.find("heartbeat age over ranks:"), std::string::npos) << summary;
  EXPECT_EQ(CountLines(summary, "/0 "), 32) << summary;  // one row per listed rank
  EXPECT_NE(summary.find(leaver_worker), std::string::npos) << summary;

  auto [one_code, one] = Shardctl("status --job=big-job --rank=57");
  ASSERT_EQ(one_code, 0) << one;
  EXPECT_EQ(CountLines(one, "/0 "), 1) << one;
  EXPECT_NE(one.find("rank 57 of 100"), std::string::npos) << one;

  auto [host_code, host] = Shardctl("status --job=big-job --host=host07");
  ASSERT_EQ(host_code, 0) << host;
  EXPECT_EQ(CountLines(host, "host07/0 "), 1) << host;
  EXPECT_EQ(CountLines(host, "/0 "), 1) << host;
  EXPECT_NE(host.find("host host07: 1 of 100 ranks"), std::string::npos) << host;

  auto [all_code, all] = Shardctl("status --job=big-job --all");
  ASSERT_EQ(all_code, 0) << all;
  EXPECT_EQ(CountLines(all, "/0 "), kWorld) << all;

  auto [json_code, json] = Shardctl("status --job=big-job --json");
  ASSERT_EQ(json_code, 0) << json;
  const nlohmann::json summarized = nlohmann::json::parse(json)["jobs"][0];
  EXPECT_EQ(summarized["members"].size(), 32u) << json;
  EXPECT_EQ(summarized["summary"]["ranks"], kWorld) << json;
  EXPECT_EQ(summarized["summary"]["alive"], kWorld - 1) << json;
  EXPECT_EQ(summarized["members"][0]["worker_id"], leaver_worker) << "the worst rank first";

  auto [whole_code, whole] = Shardctl("status --job=big-job --all --json");
  ASSERT_EQ(whole_code, 0) << whole;
  EXPECT_EQ(nlohmann::json::parse(whole)["jobs"][0]["members"].size(),
            static_cast<size_t>(kWorld));

  auto [top_code, top] = Shardctl("top --job=big-job --top_iterations=1");
  ASSERT_EQ(top_code, 0) << top;
  EXPECT_NE(top.find("worst 32 of 100 ranks"), std::string::npos) << top;
  EXPECT_EQ(CountLines(top, "/0 "), 32) << top;
  EXPECT_NE(top.find(leaver_worker), std::string::npos) << top;
}

TEST_F(BinariesTest, ShardctlReportsAWrongTokenAndExitsNonZero) {
  std::string token_dir = testing::MakeTempDir("token");
  testing::WriteSecretFile(token_dir + "/server", "right-token-0123456789\n");
  testing::WriteSecretFile(token_dir + "/client", "wrong-token-0123456789\n");
  StartServer({"--auth_token_file=" + token_dir + "/server"});
  auto [code, output] = Shardctl("--token_file=" + token_dir + "/client status");
  EXPECT_NE(code, 0);
  EXPECT_NE(output.find("UNAUTHENTICATED"), std::string::npos) << output;
  auto [ok_code, ok_output] = Shardctl("--token_file=" + token_dir + "/server status");
  EXPECT_EQ(ok_code, 0) << ok_output;
}

TEST_F(BinariesTest, ServerRefusesBadFlagsWithAMessage) {
  std::string dir = testing::MakeTempDir("badflags");
  ChildProcess bad(testing::RunfilePath("shard_server/shard_server"),
                   {"--listen=127.0.0.1:0", "--heartbeat_timeout_ms=10",
                    "--heartbeat_interval_ms=1000"},
                   dir + "/log");
  EXPECT_NE(bad.Wait(absl::Seconds(10)), 0);
  EXPECT_NE(bad.Log().find("--heartbeat_timeout_ms"), std::string::npos) << bad.Log();

  ChildProcess no_port(testing::RunfilePath("shard_server/shard_server"),
                       {"--listen=256.1.1.1:99999", "--insecure"}, dir + "/log2");
  EXPECT_NE(no_port.Wait(absl::Seconds(10)), 0);
  EXPECT_NE(no_port.Log().find("port '99999' is not a port number"), std::string::npos)
      << no_port.Log();

  ChildProcess no_host(testing::RunfilePath("shard_server/shard_server"),
                       {"--listen=256.1.1.1:7070", "--insecure"}, dir + "/log3");
  EXPECT_NE(no_host.Wait(absl::Seconds(10)), 0);
  EXPECT_NE(no_host.Log().find("cannot listen"), std::string::npos) << no_host.Log();
}

// shardctl's flag mistakes are refused before the server is asked (exit 2,
// or 1 for consolidate's, which has always used 1), naming the flag; a
// server that does not answer gets a hint of what to do.
TEST_F(BinariesTest, ShardctlSaysWhichFlagIsWrongAndWhatToDo) {
  StartServer();
  struct Case {
    std::string args;
    int code;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"history --job=j --rank=-7", 2, "--rank=-7: expected a rank (0 or more)"},
      {"status --rank=-2", 2, "--rank=-2: expected a rank"},
      {"top --top_interval=-1s --top_iterations=1", 2, "expected a positive interval"},
      {"spec --model=mlp --layers=2 --width=99999999999", 1,
       "cannot be planned: tensor 0 (\"0.weight\"): shape [99999999999, 99999999999] overflows"},
      {"consolidate --job=j --step=1 --out=" + dir_ + "/no/such/dir/m.safetensors", 1,
       "its directory " + dir_ + "/no/such/dir does not exist"},
  };
  for (const Case& c : cases) {
    auto [code, output] = Shardctl(c.args + " 2>&1");
    EXPECT_EQ(code, c.code) << c.args << ": " << output;
    EXPECT_NE(output.find(c.expected), std::string::npos) << c.args << ": " << output;
  }
  // A new directory with a trailing slash (docs/gpt2.md's --format=hf
  // --out=gpt2-trained/): it goes in dir_, which exists, so the server is
  // asked (this one has no checkpoint root, and says so).
  auto [dir_code, dir_output] =
      Shardctl("consolidate --job=j --step=1 --format=hf --out=" + dir_ + "/new-model-dir/ 2>&1");
  EXPECT_EQ(dir_output.find("does not exist; create it"), std::string::npos) << dir_output;
  EXPECT_NE(dir_output.find("this server has no checkpoint root"), std::string::npos)
      << dir_output;
  auto [code, output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=127.0.0.1:1 status 2>&1"));
  EXPECT_EQ(code, 1) << output;
  EXPECT_NE(output.find("no answer from a shard_server at --server=127.0.0.1:1: start one there"),
            std::string::npos)
      << output;
}

TEST_F(BinariesTest, NcclBackendWithoutAGpuExitsBeforeJoiningAndPointsToGloo) {
  // No server is listening at this address: the worker must fail before joining.
  auto [code, output] = testing::RunCommand(absl::StrCat(
      testing::RunfilePath("worker/shard_worker"),
      " --server=127.0.0.1:1 --job=gpu --world_size=2 --backend=nccl --join_timeout_s=1"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_NE(output.find("--backend=gloo runs on CPUs"), std::string::npos) << output;
  EXPECT_TRUE(output.find("no CUDA device") != std::string::npos ||
              output.find("without CUDA") != std::string::npos)
      << output;
  EXPECT_EQ(output.find("join"), std::string::npos) << output;
}

TEST_F(BinariesTest, AnUnknownBlasKernelIsRefusedBeforeJoining) {
  auto [code, output] = testing::RunCommand(absl::StrCat(
      testing::RunfilePath("worker/shard_worker"),
      " --server=127.0.0.1:1 --job=blas --world_size=1 --blas_kernel=Pentium5 --join_timeout_s=1"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_NE(output.find("--blas_kernel=Pentium5: expected auto, openblas or"), std::string::npos)
      << output;
  EXPECT_EQ(output.find("join"), std::string::npos) << output;
}

TEST_F(BinariesTest, NcclBackendWithTheGptWithoutAGpuExitsBeforeJoining) {
  // The GPT is not refused by the flags any more: by the missing device.
  auto [code, output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("worker/shard_worker"),
                   " --server=127.0.0.1:1 --job=gpu --world_size=1 --backend=nccl --model=gpt"
                   " --join_timeout_s=1"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_NE(output.find("--backend=gloo runs on CPUs"), std::string::npos) << output;
  EXPECT_EQ(output.find("no device GPT"), std::string::npos) << output;
  EXPECT_EQ(output.find("join"), std::string::npos) << output;
}

TEST_F(BinariesTest, ShardctlSaysWhenTheCommandIsUnknown) {
  StartServer();
  auto [code, output] = Shardctl("frobnicate");
  EXPECT_EQ(code, 2);
  EXPECT_NE(output.find("unknown command 'frobnicate'"), std::string::npos) << output;
}

}  // namespace
}  // namespace zeroshard
