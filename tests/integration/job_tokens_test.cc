// Per-job credentials (#29 item 2) with real processes: a shard_server with an
// admin token and job tokens issued by `shardctl job create`, shard_worker
// processes and shardctl. A job token joins, beats, uses the KV store and
// commits checkpoints of its own job; it cannot join, read or consolidate
// another job, and another job's status is hidden from it.
#include <sys/stat.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

constexpr char kAdminToken[] = "admin-token-0123456789abcdef\n";

std::pair<int, std::string> Shardctl(const std::string& address, const std::string& token_file,
                                     const std::string& args) {
  return testing::RunCommand(absl::StrCat(testing::RunfilePath("client/shardctl"),
                                          " --server=", address, " --token_file=", token_file, " ",
                                          args, " 2>&1"));
}

class JobTokensTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("job-tokens");
    admin_ = dir_ + "/admin.token";
    testing::WriteSecretFile(admin_, kAdminToken);
    tokens_ = dir_ + "/job-tokens";
    ASSERT_EQ(mkdir(tokens_.c_str(), 0700), 0);
    for (const char* job : {"alpha", "beta"}) {
      auto [code, output] = testing::RunCommand(
          absl::StrCat(testing::RunfilePath("client/shardctl"), " job create --job=", job,
                       " --job_tokens_dir=", tokens_, " 2>&1"));
      ASSERT_EQ(code, 0) << output;
    }
  }
  std::string TokenOf(const std::string& job) const { return tokens_ + "/" + job + ".token"; }

  std::string dir_, admin_, tokens_;
};

const std::vector<std::string> kSmallJob = {"--model=mlp", "--layers=2", "--width=8",
                                            "--steps=4",   "--seed=1",   "--checkpoint_at_end"};

std::vector<std::string> With(std::vector<std::string> flags, const std::string& more) {
  flags.push_back(more);
  return flags;
}

TEST_F(JobTokensTest, AJobTokenActsOnItsOwnJobAndCannotJoinReadOrConsolidateAnother) {
  LocalCluster cluster(dir_ + "/cluster",
                       {"--auth_token_file=" + admin_, "--job_tokens_dir=" + tokens_});
  ASSERT_TRUE(cluster.ok());

  // Beta's token joining alpha is refused at once: it takes no rank of alpha.
  cluster.StartWorkers("alpha", 2, With(kSmallJob, "--token_file=" + TokenOf("beta")));
  std::vector<int> intruders = cluster.WaitWorkers(absl::Seconds(60));
  ASSERT_EQ(intruders.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(intruders[rank], 0);
    EXPECT_NE(cluster.WorkerLog(rank).find("PERMISSION_DENIED"), std::string::npos)
        << cluster.WorkerLog(rank);
  }
  // Alpha's own token: joins, beats, bootstraps Gloo through the KV store,
  // commits a checkpoint, in one generation.
  ASSERT_TRUE(cluster.Run("alpha", 2, With(kSmallJob, "--token_file=" + TokenOf("alpha"))));
  ASSERT_TRUE(cluster.Run("beta", 1, With(kSmallJob, "--token_file=" + TokenOf("beta"))));

  auto [admin_code, admin_status] = Shardctl(cluster.address(), admin_, "status --json");
  ASSERT_EQ(admin_code, 0) << admin_status;
  EXPECT_NE(admin_status.find("\"alpha\""), std::string::npos) << admin_status;
  EXPECT_NE(admin_status.find("\"beta\""), std::string::npos) << admin_status;
  auto [alpha_code, alpha_status] =
      Shardctl(cluster.address(), admin_, "status --job=alpha --json");
  ASSERT_EQ(alpha_code, 0) << alpha_status;
  EXPECT_EQ(nlohmann::json::parse(alpha_status)["jobs"][0]["generation"], "1") << alpha_status;

  // Beta's token: its own job only.
  const std::string beta = TokenOf("beta");
  auto [beta_code, beta_status] = Shardctl(cluster.address(), beta, "status --json");
  ASSERT_EQ(beta_code, 0) << beta_status;
  EXPECT_NE(beta_status.find("\"beta\""), std::string::npos) << beta_status;
  EXPECT_EQ(beta_status.find("alpha"), std::string::npos) << "alpha shown to beta: " << beta_status;
  auto [hidden_code, hidden] = Shardctl(cluster.address(), beta, "status --job=alpha");
  EXPECT_NE(hidden_code, 0) << hidden;
  EXPECT_NE(hidden.find("no job 'alpha'"), std::string::npos) << hidden;
  for (const std::string& command :
       {std::string("checkpoints --job=alpha"), std::string("history --job=alpha"),
        absl::StrCat("consolidate --job=alpha --step=latest --out=", dir_,
                     "/stolen.safetensors")}) {
    auto [code, output] = Shardctl(cluster.address(), beta, command);
    EXPECT_NE(code, 0) << command << ": " << output;
    EXPECT_NE(output.find("cannot act on job 'alpha'"), std::string::npos)
        << command << ": " << output;
  }
  struct stat st;
  EXPECT_NE(stat((dir_ + "/stolen.safetensors").c_str(), &st), 0);
  auto [own_code, own] = Shardctl(cluster.address(), beta, "checkpoints --job=beta");
  EXPECT_EQ(own_code, 0) << own;
  // A fence on a machine (docs/numerics.md) is lifted by an operator only:
  // not by a job's own token, even for its own job.
  auto [unfence_code, unfence] =
      Shardctl(cluster.address(), beta, "unfence --job=beta --host=somehost");
  EXPECT_NE(unfence_code, 0) << unfence;
  EXPECT_NE(unfence.find("PERMISSION_DENIED"), std::string::npos) << unfence;
  EXPECT_NE(unfence.find("needs the admin token"), std::string::npos) << unfence;
  auto [admin_unfence_code, admin_unfence] =
      Shardctl(cluster.address(), admin_, "unfence --job=beta --host=somehost");
  EXPECT_EQ(admin_unfence_code, 1) << admin_unfence;  // admitted: no such fence
  EXPECT_NE(admin_unfence.find("job 'beta' has no fence on 'somehost'"), std::string::npos)
      << admin_unfence;

  // A token that is neither the admin's nor a job's is refused everything.
  const std::string stranger = dir_ + "/stranger.token";
  testing::WriteSecretFile(stranger, "not-a-token-of-this-server-42\n");
  auto [stranger_code, stranger_output] = Shardctl(cluster.address(), stranger, "status");
  EXPECT_NE(stranger_code, 0) << stranger_output;
  EXPECT_NE(stranger_output.find("UNAUTHENTICATED"), std::string::npos) << stranger_output;
}

TEST_F(JobTokensTest, ARemovedTokenFileIsRevokedWithoutARestart) {
  LocalCluster cluster(dir_ + "/cluster",
                       {"--auth_token_file=" + admin_, "--job_tokens_dir=" + tokens_});
  ASSERT_TRUE(cluster.ok());
  const std::string kept = dir_ + "/beta-kept.token";
  ASSERT_EQ(rename(TokenOf("beta").c_str(), kept.c_str()), 0);
  auto [code, output] = Shardctl(cluster.address(), kept, "status");
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(output.find("UNAUTHENTICATED"), std::string::npos) << output;
  // Issued again: a new token, which works at once; the old one stays revoked.
  auto [create_code, create_output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " job create --job=beta",
                   " --job_tokens_dir=", tokens_, " 2>&1"));
  ASSERT_EQ(create_code, 0) << create_output;
  // (Authenticated: beta has not joined yet, so its status is "no job".)
  auto [new_code, new_output] = Shardctl(cluster.address(), TokenOf("beta"), "status");
  EXPECT_NE(new_output.find("no job 'beta'"), std::string::npos) << new_output;
  auto [old_code, old_output] = Shardctl(cluster.address(), kept, "status");
  EXPECT_NE(old_output.find("UNAUTHENTICATED"), std::string::npos) << old_output;
  // A second `job create` for a job that has a token never replaces it.
  auto [again_code, again_output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " job create --job=beta",
                   " --job_tokens_dir=", tokens_, " 2>&1"));
  EXPECT_NE(again_code, 0) << again_output;
  EXPECT_NE(again_output.find("has a token already"), std::string::npos) << again_output;
}

// #44 finding 10: a job token revoked (its file removed) while a member's
// heartbeat stream carries it ends that stream (UNAUTHENTICATED) within
// about a second, instead of being answered for ever.
TEST_F(JobTokensTest, ARevokedJobTokensOpenHeartbeatStreamIsEnded) {
  LocalCluster cluster(dir_ + "/cluster",
                       {"--auth_token_file=" + admin_, "--job_tokens_dir=" + tokens_});
  ASSERT_TRUE(cluster.ok());
  const std::string token(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(TokenOf("alpha"))));
  ClientOptions options;
  options.server = cluster.address();
  options.token = token;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Join("alpha", 1, "w0", "127.0.0.1", absl::Seconds(30)).ok());
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = (*client)->credentials();

  auto stub = testing::NewCoordinatorStub(cluster.address());
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(60), token);
  auto stream = stub->Heartbeat(&context);
  v1::HeartbeatResponse response;
  ASSERT_TRUE(stream->Write(beat) && stream->Read(&response));
  ASSERT_EQ(std::remove(TokenOf("alpha").c_str()), 0);
  // A beat every 100 ms (a member beats every second) until the server ends
  // the stream, for at most 20 s.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  bool answered = true;
  while (answered && absl::Now() < deadline) {
    answered = stream->Write(beat) && stream->Read(&response);
    if (answered) absl::SleepFor(absl::Milliseconds(100));
  }
  if (answered) {
    context.TryCancel();
    stream->Finish();
    FAIL() << "the revoked token's stream was still answered after 20 s";
  }
  grpc::Status ended = stream->Finish();  // the server's status: the stream is over
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAUTHENTICATED) << ended.error_message();
}

}  // namespace
}  // namespace zeroshard
