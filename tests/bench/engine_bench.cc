// ZeRO engine benchmark on seed 001's model: 20 × Linear(2000, 2000), no
// activation, batch 20 per rank, Adam, W = 2, on this machine's CPUs with
// Gloo over loopback. Runs a real shard_server and shard_worker processes.
//
//   bazel run -c opt //tests/bench:engine_bench -- [--json_out=FILE] [--steps=N] [--rounds=R]
//   [--shm=false]
//
// Per stage: median step time, model-state bytes beside the ZeRO formula,
// peak bytes, communication bytes per step; stage 3 with prefetch 0 vs 1;
// where rank 0's compute thread spent the step (forward, backward, waiting
// for gathers, waiting for reductions, optimizer). Every configuration runs
// once per round, rounds interleaved, and the step time reported is the
// median over rounds of each run's median: on a shared 2-core machine one
// run can be 30 % off.
#include <algorithm>
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
ABSL_FLAG(int, steps, 8, "Steps per configuration (the first is not timed)");
ABSL_FLAG(int, layers, 20, "Linear layers");
ABSL_FLAG(int, width, 2000, "Width");
ABSL_FLAG(int, batch, 20, "Rows per rank");
ABSL_FLAG(int, world, 2, "Ranks");
ABSL_FLAG(int, rounds, 3, "Runs of every configuration, interleaved");
ABSL_FLAG(bool, shm, true,
          "Workers' --shm: the shared-memory data plane (false: Gloo over loopback TCP)");

namespace zeroshard {
namespace {

struct Result {
  std::string blas_kernel;  // the workers' OpenBLAS kernel (their run report)
  double step_ms = 0;
  std::vector<double> round_ms;  // each round's median step time
  nlohmann::json breakdown;      // of the median round
  int64_t model_state = 0;
  int64_t formula = 0;
  int64_t peak = 0;
  int64_t comm_per_step = 0;
};

int Main() {
  const int steps = absl::GetFlag(FLAGS_steps);
  const int world = absl::GetFlag(FLAGS_world);
  testing::LocalCluster cluster(testing::MakeTempDir("engine-bench"));
  if (!cluster.ok()) return 1;
  auto run = [&](int stage, int prefetch) -> Result {
    std::string job = absl::StrCat("stage", stage, "-prefetch", prefetch);
    std::vector<std::string> flags = {"--model=mlp",
                                      absl::StrCat("--layers=", absl::GetFlag(FLAGS_layers)),
                                      absl::StrCat("--width=", absl::GetFlag(FLAGS_width)),
                                      "--activation=none",
                                      absl::StrCat("--batch=", absl::GetFlag(FLAGS_batch)),
                                      absl::StrCat("--steps=", steps),
                                      absl::StrCat("--stage=", stage),
                                      absl::StrCat("--prefetch=", prefetch),
                                      "--optimizer=adam",
                                      "--lr=1e-4",
                                      "--threads=1",
                                      "--collective_timeout=300s",
                                      absl::StrCat("--shm=", absl::GetFlag(FLAGS_shm)),
                                      absl::StrCat("--snapshot_every=", absl::GetFlag(FLAGS_snapshot_every))};
    Result r;
    if (!cluster.Run(job, world, flags, absl::Minutes(20))) {
      std::fprintf(stderr, "run %s failed\n", job.c_str());
      return r;
    }
    nlohmann::json report = cluster.Report(job, 0);
    r.blas_kernel = report["compute"]["blas_kernel"];
    r.step_ms = report["step_time_ms_median"];
    r.breakdown = report["step_breakdown_ms"];
    r.model_state = report["memory"]["model_state_bytes"];
    r.peak = report["memory"]["peak_bytes"];
    int64_t psi = report["parameters"], shard = report["shard_elements"];
    const int64_t formula[] = {16 * psi, 8 * psi + 8 * shard, 4 * psi + 12 * shard, 16 * shard};
    r.formula = formula[stage];
    int64_t comm = 0;
    for (auto& [name, bytes] : report["comm_bytes"].items()) comm += bytes.get<int64_t>();
    r.comm_per_step = comm / steps;
    std::fprintf(stderr, "%s: %.1f ms/step\n", job.c_str(), r.step_ms);
    return r;
  };

  // Every configuration once per round; then the median round of each.
  const std::vector<std::pair<int, int>> configs = {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {3, 0}};
  std::vector<std::vector<Result>> runs(configs.size());
  for (int round = 0; round < std::max(1, absl::GetFlag(FLAGS_rounds)); ++round) {
    for (size_t c = 0; c < configs.size(); ++c) {
      runs[c].push_back(run(configs[c].first, configs[c].second));
    }
  }
  std::vector<Result> results;
  for (auto& config_runs : runs) {
    std::sort(config_runs.begin(), config_runs.end(),
              [](const Result& a, const Result& b) { return a.step_ms < b.step_ms; });
    Result median = config_runs[config_runs.size() / 2];
    for (const Result& r : config_runs) median.round_ms.push_back(r.step_ms);
    results.push_back(median);
  }
  auto range = [](const Result& r) {
    return absl::StrFormat("%.0f-%.0f", r.round_ms.front(), r.round_ms.back());
  };
  auto ms = [](const Result& r, const char* key) {
    return r.breakdown.contains(key) ? absl::StrFormat("%.0f", r.breakdown[key].get<double>())
                                     : std::string("-");
  };

  nlohmann::ordered_json json;
  const BenchMachine machine = DescribeBenchMachine(results[0].blas_kernel);
  std::printf("%s\n", machine.Line().c_str());
  json["machine"] = machine.Json();
  Table table({"STAGE", "PREFETCH", "STEP ms", "RANGE", "FWD", "BWD", "GATHER WAIT", "REDUCE WAIT",
               "OPTIM", "MODEL STATE", "FORMULA", "PEAK", "COMM/STEP"});
  Result stage0;
  for (int stage = 0; stage <= 3; ++stage) {
    Result r = results[stage];
    if (stage == 0) stage0 = r;
    json["stages"][absl::StrCat(stage)] = {{"step_ms", r.step_ms},
                                           {"model_state_bytes", r.model_state},
                                           {"formula_bytes", r.formula},
                                           {"peak_bytes", r.peak},
                                           {"comm_bytes_per_step", r.comm_per_step},
                                           {"step_ms_rounds", r.round_ms},
                                           {"breakdown_ms", r.breakdown}};
    table.AddRow({absl::StrCat(stage), stage == 3 ? "1" : "-", absl::StrFormat("%.1f", r.step_ms),
                  range(r), ms(r, "forward"), ms(r, "backward"), ms(r, "gather_wait"),
                  ms(r, "reduce_wait"), ms(r, "optimizer"), HumanBytes(r.model_state),
                  HumanBytes(r.formula), HumanBytes(r.peak), HumanBytes(r.comm_per_step)});
    if (stage == 3) {
      json["stage3_vs_stage0_step_time"] = r.step_ms / stage0.step_ms;
      json["stage3_vs_stage0_comm"] = double(r.comm_per_step) / stage0.comm_per_step;
    }
  }
  const Result& no_prefetch = results[4];
  json["stage3_prefetch0"] = {{"step_ms", no_prefetch.step_ms},
                              {"peak_bytes", no_prefetch.peak},
                              {"step_ms_rounds", no_prefetch.round_ms},
                              {"breakdown_ms", no_prefetch.breakdown}};
  table.AddRow({"3", "0", absl::StrFormat("%.1f", no_prefetch.step_ms), range(no_prefetch),
                ms(no_prefetch, "forward"), ms(no_prefetch, "backward"),
                ms(no_prefetch, "gather_wait"), ms(no_prefetch, "reduce_wait"),
                ms(no_prefetch, "optimizer"), HumanBytes(no_prefetch.model_state),
                HumanBytes(no_prefetch.formula), HumanBytes(no_prefetch.peak),
                HumanBytes(no_prefetch.comm_per_step)});
  std::printf("%s", table.ToString().c_str());
  std::printf("stage 3 / stage 0 step time: %.3f (target <= 1.05); comm: %.3f (expected ~1.5)\n",
              json["stage3_vs_stage0_step_time"].get<double>(),
              json["stage3_vs_stage0_comm"].get<double>());
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
