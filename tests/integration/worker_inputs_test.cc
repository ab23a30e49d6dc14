// #44 finding 9 (and the FIFO of finding 10) with real shard_worker
// processes: a worker checks its inputs before it joins. A truncated
// --init_from, a FIFO where a file is read, a config.json whose sizes do
// not fit an int, or a model whose state does not fit the machine: the
// worker exits 2 (a bad configuration) at once, naming the input, and its
// job never forms (before: it joined, then recovered 10 times, blocked for
// ever, trained a model cast to 1 layer, or died of bad_alloc). So are run
// flags whose mistakes used to show after joining.
#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

const std::vector<std::string> kMlp = {"--model=mlp", "--layers=2", "--width=8", "--steps=2",
                                       "--seed=1"};

std::vector<std::string> With(std::vector<std::string> flags,
                              const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

// Whether the server holds job `job` (it would once a worker joined).
bool JobExists(const LocalCluster& cluster, const std::string& job) {
  ClientOptions options;
  options.server = cluster.address();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return true;  // cannot tell: fail the caller's expectation
  absl::StatusOr<v1::GetStatusResponse> status = (*client)->GetStatus(job);
  if (!status.ok()) return status.status().code() != absl::StatusCode::kNotFound;
  return status->jobs_size() > 0;
}

// Starts one worker of `job` with `flags`: it must exit 2 within 60 s (a
// worker blocked on an input is killed then, -1) with `expected` in its log,
// and the job must not exist on the server.
void ExpectRefusedBeforeJoining(LocalCluster& cluster, const std::string& job,
                                const std::vector<std::string>& flags,
                                const std::string& expected) {
  cluster.StartWorkers(job, 1, flags);
  std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(60));
  const std::string log = cluster.WorkerLog(0);
  EXPECT_EQ(codes.at(0), 2) << job << ":\n" << log;
  EXPECT_TRUE(absl::StrContains(log, expected)) << job << ": no '" << expected << "' in:\n" << log;
  EXPECT_FALSE(JobExists(cluster, job)) << job << " joined";
}

// A Hugging Face GPT-2 directory with `config` as its config.json and
// `weights` (if not empty) as its model.safetensors.
std::string HfDirectory(const std::string& dir, const std::string& config) {
  mkdir(dir.c_str(), 0755);
  testing::WriteFile(dir + "/config.json", config);
  return dir;
}

std::string GptConfig(const std::string& n_layer, const std::string& n_head,
                      const std::string& n_embd, const std::string& n_positions) {
  return absl::StrCat(R"({"model_type": "gpt2", "n_layer": )", n_layer, R"(, "n_head": )", n_head,
                      R"(, "n_embd": )", n_embd, R"(, "n_positions": )", n_positions,
                      R"(, "vocab_size": 256})");
}

TEST(WorkerInputsTest, ATruncatedInitFromIsRefusedBeforeJoining) {
  LocalCluster cluster(testing::MakeTempDir("inputs-truncated"));
  ASSERT_TRUE(cluster.ok());
  ASSERT_TRUE(cluster.Run("source", 1, With(kMlp, {"--checkpoint_at_end"})));
  const std::string whole = cluster.dir() + "/model.safetensors";
  auto [code, output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster.address(),
                   " consolidate --job=source --step=latest --out=", whole, " 2>&1"));
  ASSERT_EQ(code, 0) << output;
  const std::string bytes = testing::ReadFileOrEmpty(whole);
  ASSERT_GT(bytes.size(), 200u);
  const std::string truncated = cluster.dir() + "/truncated.safetensors";
  testing::WriteFile(truncated, bytes.substr(0, bytes.size() - 100));
  ExpectRefusedBeforeJoining(cluster, "from-truncated", With(kMlp, {"--init_from=" + truncated}),
                             "truncated");
}

TEST(WorkerInputsTest, AFifoIsRefusedWhereAFileIsRead) {
  LocalCluster cluster(testing::MakeTempDir("inputs-fifo"));
  ASSERT_TRUE(cluster.ok());
  const std::string fifo = cluster.dir() + "/model.safetensors";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ExpectRefusedBeforeJoining(cluster, "fifo-init", With(kMlp, {"--init_from=" + fifo}),
                             "is a FIFO");

  // A Hugging Face directory whose model.safetensors is a FIFO.
  const std::string hf = HfDirectory(cluster.dir() + "/hf", GptConfig("2", "2", "16", "32"));
  ASSERT_EQ(mkfifo((hf + "/model.safetensors").c_str(), 0600), 0);
  ExpectRefusedBeforeJoining(cluster, "fifo-hf", {"--steps=1", "--init_from=" + hf},
                             "not a regular file");

  // A FIFO among --data's token shards.
  const std::string shards = cluster.dir() + "/shards";
  mkdir(shards.c_str(), 0755);
  ASSERT_EQ(mkfifo((shards + "/train_000.bin").c_str(), 0600), 0);
  ExpectRefusedBeforeJoining(cluster, "fifo-data",
                             {"--model=gpt", "--steps=1", "--data=" + shards + "/train_*.bin"},
                             "is a FIFO");
}

// config.json sizes beyond an int (cast to 1 and 2 before, and trained), a
// context of 2^40, and models whose state does not fit any machine (joined,
// then bad_alloc before): each refused with the key or the estimate.
TEST(WorkerInputsTest, ConfigSizesAreCheckedBeforeAnyCastAndTheModelAgainstTheMachine) {
  LocalCluster cluster(testing::MakeTempDir("inputs-config"));
  ASSERT_TRUE(cluster.ok());
  struct Case {
    std::string job;
    std::string config;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"layers-2-32", GptConfig("4294967297", "2", "16", "32"), "\"n_layer\" is 4294967297"},
      {"heads-2-32", GptConfig("2", "4294967298", "16", "32"), "\"n_head\" is 4294967298"},
      {"positions-2-40", GptConfig("2", "2", "16", "1099511627776"), "\"n_positions\""},
      {"embd-2-20", GptConfig("12", "16", "1048576", "1024"), "more than this machine's"},
      {"layers-10-6", GptConfig("1000000", "12", "768", "1024"), "more than this machine's"},
  };
  for (const Case& c : cases) {
    const std::string hf = HfDirectory(cluster.dir() + "/" + c.job, c.config);
    ExpectRefusedBeforeJoining(cluster, c.job, {"--steps=1", "--init_from=" + hf}, c.expected);
  }
}

// Flags whose mistake used to show only after joining: a negative learning
// rate (the job joined, failed its first step and went into recovery), a
// shard group that does not divide the world (no output at all while the
// job waited), a checkpoint directory a file stands in the way of (trained
// to the first checkpoint, then failed). Each is refused before joining,
// naming the flag.
TEST(WorkerInputsTest, RunFlagsAreCheckedBeforeJoining) {
  LocalCluster cluster(testing::MakeTempDir("inputs-flags"));
  ASSERT_TRUE(cluster.ok());
  ExpectRefusedBeforeJoining(cluster, "negative-lr", With(kMlp, {"--lr=-1"}),
                             "--lr=-1: expected a finite learning rate >= 0");
  ExpectRefusedBeforeJoining(cluster, "groups-of-3",
                             With(kMlp, {"--world_size=4", "--stage=3", "--shard_group_size=3"}),
                             "--shard_group_size=3 does not divide --world_size=4");
  testing::WriteFile(cluster.dir() + "/a-file", "not a directory\n");
  const std::string blocked = cluster.dir() + "/a-file/checkpoints";
  ExpectRefusedBeforeJoining(
      cluster, "blocked-checkpoints",
      With(kMlp, {"--checkpoint_every=1", "--checkpoint_dir=" + blocked}),
      "--checkpoint_dir=" + blocked + ": cannot make it a directory");
  // A typo in --task (an MLP ignored it and joined; a GPT exited 1 after
  // joining, which launchers retry), and a vocabulary the GPT refuses when
  // it builds the model (exit 1 before).
  ExpectRefusedBeforeJoining(cluster, "task-typo", With(kMlp, {"--task=additon"}),
                             "--task=additon is unknown: expected addition or reversed-addition");
  ExpectRefusedBeforeJoining(
      cluster, "small-vocab",
      {"--model=gpt", "--layers=1", "--heads=2", "--d_model=8", "--context=8", "--vocab=100"},
      "--vocab=100: byte data needs a vocabulary of at least 256");
}

// A join that times out says why, in the server's words: it answers before
// the caller's gRPC deadline (a tenth of the time left), which cancelled
// the call first and left a bare "Deadline Exceeded".
TEST(WorkerInputsTest, AJoinThatTimesOutSaysHowManyHadJoined) {
  LocalCluster cluster(testing::MakeTempDir("inputs-join-timeout"));
  ASSERT_TRUE(cluster.ok());
  cluster.StartWorkers("lonely", 1, With(kMlp, {"--world_size=2", "--join_timeout_s=2"}));
  std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(60));
  const std::string log = cluster.WorkerLog(0);
  EXPECT_EQ(codes.at(0), 1) << log;
  EXPECT_TRUE(absl::StrContains(log, "timed out: 1 of 2 workers had joined")) << log;
}

}  // namespace
}  // namespace zeroshard
