// Interoperability: a model trained with ZeRO-3 by real workers, consolidated
// by `shardctl consolidate` over RPC, is loaded with the official safetensors
// library into PyTorch (Debian's python3-torch), which must compute what the
// engine computed.
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace zeroshard {
namespace {

// tests/run.sh passes its venv's python (PyTorch 2 and safetensors from
// PyPI); without it, the same venv at its default place.
std::string Python() {
  const char* python = std::getenv("ZEROSHARD_PYTHON");
  if (python != nullptr && *python) return python;
  const char* home = std::getenv("HOME");
  std::string venv =
      absl::StrCat(home ? home : "/root", "/.cache/zeroshard/venv-torch2/bin/python");
  return access(venv.c_str(), X_OK) == 0 ? venv : "/usr/bin/python3";
}

class InteropTest : public ::testing::Test {
 protected:
  InteropTest() : cluster_(testing::MakeTempDir("interop")) {}

  // Consolidates the latest step of `job` (weights only) to a local file.
  std::string Consolidate(const std::string& job) {
    std::string out = absl::StrCat(cluster_.dir(), "/", job, ".safetensors");
    auto [code, output] = testing::RunCommand(
        absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster_.address(),
                     " consolidate --job=", job, " --step=latest --weights_only --out=", out));
    EXPECT_EQ(code, 0) << output;
    return out;
  }

  void Check(const std::string& script, const std::string& args) {
    auto [code, output] = testing::RunCommand(absl::StrCat(
        Python(), " ", testing::RunfilePath(absl::StrCat("tests/interop/", script)), " ", args));
    EXPECT_EQ(code, 0) << output;
    EXPECT_NE(output.find("OK"), std::string::npos) << output;
    std::fprintf(stderr, "%s", output.c_str());
  }

  testing::LocalCluster cluster_;
};

TEST_F(InteropTest, ConsolidatedMlpLoadsIntoTorchAndComputesTheEngineOutputs) {
  ASSERT_TRUE(cluster_.ok());
  std::string eval = cluster_.dir() + "/mlp-eval.json";
  ASSERT_TRUE(cluster_.Run("mlp", 2,
                           {"--model=mlp", "--layers=3", "--width=24", "--activation=relu",
                            "--steps=3", "--batch=4", "--stage=3", "--lr=0.01",
                            "--checkpoint_at_end", "--eval_out=" + eval}));
  std::string model = Consolidate("mlp");
  Check("check_mlp.py", absl::StrCat(model, " ", eval, " 3 24 relu"));
}

TEST_F(InteropTest, ConsolidatedGptGivesTheEngineLossInAPyTorchGpt2Forward) {
  ASSERT_TRUE(cluster_.ok());
  std::string eval = cluster_.dir() + "/gpt-eval.json";
  ASSERT_TRUE(cluster_.Run("gpt", 2,
                           {"--model=gpt", "--layers=2", "--heads=2", "--d_model=32",
                            "--context=16", "--batch=4", "--steps=3", "--stage=3", "--lr=3e-3",
                            "--checkpoint_at_end", "--eval_out=" + eval}));
  std::string model = Consolidate("gpt");
  Check("check_gpt.py", absl::StrCat(model, " ", eval, " 2 2"));
}

}  // namespace
}  // namespace zeroshard
