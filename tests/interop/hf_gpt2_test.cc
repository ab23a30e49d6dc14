// GPT-2 for real: Hugging Face checkpoints in and out and llm.c token shards,
// checked with `transformers` from PyPI (tests/run.sh's venv) by
// hf_gpt2.py, whose header holds the error model of the comparisons.
//
// Also the refusals: bad token shards and a config.json that disagrees with
// the flags each end the worker with one clear error, before it joins, and
// nothing is written.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace zeroshard {
namespace {

// tests/run.sh passes its venv's python; without it, the venv's default place.
std::string Python() {
  const char* python = std::getenv("ZEROSHARD_PYTHON");
  if (python != nullptr && *python) return python;
  const char* home = std::getenv("HOME");
  std::string venv =
      absl::StrCat(home ? home : "/root", "/.cache/zeroshard/venv-torch2/bin/python");
  return access(venv.c_str(), X_OK) == 0 ? venv : "/usr/bin/python3";
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// An llm.c shard: header (magic, version, count), then uint16 tokens.
std::string ShardBytes(int32_t magic, int32_t count, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = 1;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return bytes;
}

class HfGpt2Test : public ::testing::Test {
 protected:
  HfGpt2Test() : cluster_(testing::MakeTempDir("hf_gpt2")) {}

  std::string Path(const std::string& name) const { return cluster_.dir() + "/" + name; }

  void Python(const std::string& args) {
    auto [code, output] = testing::RunCommand(
        absl::StrCat(zeroshard::Python(), " ", testing::RunfilePath("tests/interop/hf_gpt2.py"),
                     " ", args, " 2>&1"));
    std::fprintf(stderr, "%s", output.c_str());
    EXPECT_EQ(code, 0) << output;
    EXPECT_TRUE(absl::StrContains(output, "OK") || absl::StartsWith(args, "make")) << output;
  }

  void ConsolidateHf(const std::string& job, const std::string& out) {
    auto [code, output] = testing::RunCommand(
        absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster_.address(),
                     " consolidate --job=", job, " --step=latest --format=hf --out=", out));
    EXPECT_EQ(code, 0) << output;
  }

  // Runs one worker of `job` that must fail before joining; its exit code
  // and its log.
  std::pair<int, std::string> RunFailing(const std::string& job,
                                         const std::vector<std::string>& flags) {
    cluster_.StartWorkers(job, 1, flags);
    std::vector<int> codes = cluster_.WaitWorkers(absl::Seconds(60));
    return {codes[0], cluster_.WorkerLog(0)};
  }

  // The files a failed run must not have written.
  void ExpectNothingWritten(const std::string& job) {
    EXPECT_FALSE(Exists(Path(job + "-summary.json")));
    EXPECT_FALSE(Exists(Path(job + "-eval.json")));
    EXPECT_FALSE(Exists(Path(job + "-0.json")));  // the report
    EXPECT_FALSE(Exists(cluster_.checkpoint_root() + "/" + job));
  }

  std::vector<std::string> OutputFlags(const std::string& job) const {
    return {"--summary_out=" + Path(job + "-summary.json"), "--eval_out=" + Path(job + "-eval.json"),
            "--checkpoint_at_end"};
  }

  testing::LocalCluster cluster_;
};

// The issue's "Done when": a Hugging Face GPT-2 in, unchanged through a
// 0-step run and back out; 5 AdamW steps as PyTorch takes them; the result
// loads with from_pretrained and gives the workers' validation loss.
TEST_F(HfGpt2Test, HuggingFaceGpt2RoundTripsAndTrainsAsPyTorchDoes) {
  ASSERT_TRUE(cluster_.ok());
  Python("make " + cluster_.dir());
  const std::vector<std::string> common = {
      "--init_from=" + Path("hf"), "--data=" + Path("train_*.bin"),
      "--val_data=" + Path("val_000.bin"), "--batch=2", "--stage=3", "--optimizer=adamw",
      "--lr=1e-3", "--checkpoint_at_end"};

  std::vector<std::string> zero = common;
  zero.push_back("--steps=0");
  ASSERT_TRUE(cluster_.Run("zero", 2, zero, absl::Seconds(300)));
  ConsolidateHf("zero", Path("out0"));
  Python(absl::StrCat("same ", Path("hf"), " ", Path("out0")));

  std::vector<std::string> five = common;
  five.push_back("--steps=5");
  five.push_back("--eval_out=" + Path("eval.json"));
  ASSERT_TRUE(cluster_.Run("five", 2, five, absl::Seconds(300)));
  ConsolidateHf("five", Path("out5"));
  // World 2, batch 2, context 256 (the config's n_positions), 5 steps.
  Python(absl::StrCat("train ", Path("hf"), " ", Path("out5"), " ", Path("eval.json"), " '",
                      Path("train_*.bin"), "' 2 2 256 5 1e-3"));
}

TEST_F(HfGpt2Test, EachBadShardIsOneErrorNamingTheFileAndNothingIsWritten) {
  ASSERT_TRUE(cluster_.ok());
  testing::WriteFile(Path("val.bin"), ShardBytes(20240520, 300, std::vector<uint16_t>(300, 7)));
  std::vector<uint16_t> tokens(300, 5);
  tokens[100] = 300;  // >= --vocab=256
  struct Case {
    std::string name;
    std::string bytes;
    std::string message;
  };
  const std::string good = ShardBytes(20240520, 300, std::vector<uint16_t>(300, 1));
  const std::vector<Case> cases = {
      {"magic", ShardBytes(12345, 300, tokens), "wrong magic 12345"},
      {"truncated", good.substr(0, good.size() - 10), "(truncated)"},
      {"vocab", ShardBytes(20240520, 300, tokens), "token 300 at byte offset 1224"},
      {"empty", "", "the file is empty"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string shard = Path(c.name + ".bin");
    testing::WriteFile(shard, c.bytes);
    std::vector<std::string> flags = {"--model=gpt", "--layers=1", "--heads=2", "--d_model=16",
                                      "--context=16", "--vocab=256", "--steps=2",
                                      "--data=" + shard, "--val_data=" + Path("val.bin")};
    for (const std::string& f : OutputFlags(c.name)) flags.push_back(f);
    auto [code, log] = RunFailing(c.name, flags);
    EXPECT_EQ(code, 2) << log;  // a bad input, before joining: launchers do not retry it
    EXPECT_TRUE(absl::StrContains(log, shard)) << log;
    EXPECT_TRUE(absl::StrContains(log, c.message)) << log;
    // One error line: the one that says what is wrong.
    int errors = 0;
    for (absl::string_view line : absl::StrSplit(log, '\n')) {
      errors += absl::StartsWith(line, "shard_worker");
    }
    EXPECT_EQ(errors, 1) << log;
    ExpectNothingWritten(c.name);
  }
}

TEST_F(HfGpt2Test, AConfigThatDisagreesWithTheFlagsIsOneErrorBeforeJoining) {
  ASSERT_TRUE(cluster_.ok());
  mkdir(Path("hf").c_str(), 0755);
  testing::WriteFile(Path("hf/config.json"),
                     R"({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 128,
                         "n_positions": 256, "vocab_size": 50257})");
  std::vector<std::string> flags = {"--init_from=" + Path("hf"), "--heads=8", "--steps=1"};
  for (const std::string& f : OutputFlags("disagree")) flags.push_back(f);
  auto [code, log] = RunFailing("disagree", flags);
  EXPECT_EQ(code, 2) << log;  // a bad flag: found before joining
  EXPECT_TRUE(absl::StrContains(log, "--heads=8 disagrees with --init_from=" + Path("hf") +
                                         ": its config.json has n_head 4"))
      << log;
  ExpectNothingWritten("disagree");
}

}  // namespace
}  // namespace zeroshard
