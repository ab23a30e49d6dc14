// GPT benchmark: tokens/s and per-rank memory for ZeRO stages 0-3 at W = 2
// and 4 on a ~10M-parameter GPT (6 layers, d_model 384, 6 heads, context
// 128, bytes), with real shard_server / shard_worker processes on loopback.
//
//   bazel run //tests/bench:gpt_bench -- [--json_out=FILE] [--steps=N] [--threads=T]
//                                          [--worlds=1,2]
//
// The JSON has each run's kernel breakdown (matmul, attention, ...: the
// run report's kernel_breakdown_ms) beside its step time and CPU time.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/cluster.h"

ABSL_FLAG(int, snapshot_every, 0,
          "Workers' --snapshot_every (0: no in-memory recovery snapshots, like the peer "
          "benchmark; their cost is measured by recovery_bench)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(int, steps, 4, "Steps per configuration");
ABSL_FLAG(int, layers, 6, "Blocks");
ABSL_FLAG(int, d_model, 384, "Embedding width");
ABSL_FLAG(int, heads, 6, "Heads");
ABSL_FLAG(int, context, 128, "Sequence length");
ABSL_FLAG(int, batch, 4, "Sequences per rank per step");
ABSL_FLAG(int, threads, 1, "Workers' --threads (compute threads per rank)");
ABSL_FLAG(std::vector<std::string>, worlds, std::vector<std::string>({"2", "4"}),
          "World sizes to run");

namespace zeroshard {
namespace {

int Main() {
  testing::LocalCluster cluster(testing::MakeTempDir("gpt-bench"));
  if (!cluster.ok()) return 1;
  nlohmann::ordered_json json;
  std::string blas_kernel;  // the workers' (their run report)
  Table table({"W", "STAGE", "TOKENS/s", "STEP ms", "CPU ms/RANK", "MODEL STATE/RANK", "PEAK/RANK",
               "PARAMS"});
  for (const std::string& world_text : absl::GetFlag(FLAGS_worlds)) {
    const int world = std::stoi(world_text);
    for (int stage = 0; stage <= 3; ++stage) {
      std::string job = absl::StrCat("gpt-w", world, "-s", stage);
      std::vector<std::string> flags = {"--model=gpt",
                                        absl::StrCat("--layers=", absl::GetFlag(FLAGS_layers)),
                                        absl::StrCat("--d_model=", absl::GetFlag(FLAGS_d_model)),
                                        absl::StrCat("--heads=", absl::GetFlag(FLAGS_heads)),
                                        absl::StrCat("--context=", absl::GetFlag(FLAGS_context)),
                                        absl::StrCat("--batch=", absl::GetFlag(FLAGS_batch)),
                                        absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
                                        absl::StrCat("--stage=", stage),
                                        "--lr=3e-4",
                                        absl::StrCat("--threads=", absl::GetFlag(FLAGS_threads)),
                                        "--collective_timeout=600s",
                                        absl::StrCat("--snapshot_every=", absl::GetFlag(FLAGS_snapshot_every))};
      if (!cluster.Run(job, world, flags, absl::Minutes(30))) return 1;
      nlohmann::json report = cluster.Report(job, 0);
      blas_kernel = report["compute"]["blas_kernel"];
      double tokens = report["items_per_second"];
      double step_ms = report["step_time_ms_median"];
      double cpu_ms = report.value("step_cpu_ms_median", 0.0);
      int64_t state = report["memory"]["model_state_bytes"];
      int64_t peak = report["memory"]["peak_bytes"];
      int64_t params = report["parameters"];
      json[absl::StrCat(world)][absl::StrCat(stage)] = {
          {"tokens_per_second", tokens}, {"step_ms", step_ms},
          {"step_cpu_ms", cpu_ms},       {"kernel_breakdown_ms", report["kernel_breakdown_ms"]},
          {"model_state_bytes", state},  {"peak_bytes", peak},
          {"parameters", params}};
      table.AddRow({absl::StrCat(world), absl::StrCat(stage), absl::StrFormat("%.0f", tokens),
                    absl::StrFormat("%.0f", step_ms), absl::StrFormat("%.0f", cpu_ms),
                    HumanBytes(state), HumanBytes(peak), absl::StrFormat("%.1fM", params / 1e6)});
      std::fprintf(stderr, "%s: %.0f tokens/s\n", job.c_str(), tokens);
    }
  }
  const BenchMachine machine = DescribeBenchMachine(blas_kernel);
  std::printf("%s\n%s", machine.Line().c_str(), table.ToString().c_str());
  json["machine"] = machine.Json();
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
