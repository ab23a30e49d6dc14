// What crosses the node boundary, measured on emulated hosts (needs root):
// W = 4 as 2 hosts x 2 ranks (--ranks_per_host=1: W = 2, a rank per host;
// the server on a third host), seed 001's MLP
// shape at ZeRO stage 3, with today's flat data plane, with two-level
// collectives (--two_level) and with hybrid sharding in host groups
// (--shard_group_size=host: "hsdp"), at each link rate, in interleaved
// rounds.
// "crossing/host/step" is what each worker host's eth0 sent (its kernel's
// tx_bytes: every byte that left the host, heartbeats and bootstrap
// included) over the run, divided by the steps; "counted" is what the
// workers' reports say their data plane sent across hosts (host 1's ranks,
// mean over steps).
//
//   bazel run -c opt //tests/bench:multihost_bench -- [--rates=0,1000000000]
//       [--steps=20] [--rounds=2] [--layers=8] [--width=1024] [--batch=8]
//       [--modes=flat,two-level,hsdp] [--ranks_per_host=2] [--json_out=FILE]
//
// The int8 modes (flat-int8, two-level-int8: --gather_dtype=int8
// --reduce_dtype=int8; hsdp-int8: --reduce_dtype=int8, whose gathers stay
// inside the host) quantize what travels (worker/comm/quantized.h).
// The hpZ modes (hpz, two-level-hpz, hpz-int8: flat, two-level and
// flat-int8 with --secondary_shard_group_size=host) gather the backward's
// parameters from the host's secondary shards (engine.h, hpZ).
// The DiLoCo modes (diloco, diloco-bf16, diloco-int8, diloco-int4: hsdp
// with --sync=diloco and that --outer_dtype, docs/diloco.md; diloco-int8
// also reduces its groups' gradients in int8, inside the host, as the other
// -int8 modes; diloco-int4's stay f32) cross the link only at their outer steps,
// every --outer_every=H steps: their step time is the median step plus the
// outer steps' time spread over the steps, their counted bytes include the
// outer steps', and they run at least 2H steps.
// "peak RSS/rank" is the largest VmHWM over the ranks (the reports'
// peak_rss_bytes).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/bench/multihost_torch.h"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/cluster.h"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/process.h"

ABSL_FLAG(std::string, rates, "0,1000000000", "Link rates to run, bits/s each way (0: none)");
ABSL_FLAG(int, steps, 20, "Steps per run");
ABSL_FLAG(int, rounds, 2, "Runs of every configuration, interleaved");
ABSL_FLAG(std::string, model, "mlp",
          "mlp (--layers x Linear(--width, --width), GELU, --batch rows per rank) or gpt "
          "(gpt_bench's GPT: 6 blocks, d_model 384, 6 heads, context 128, vocab 256, 4 "
          "sequences per rank)");
ABSL_FLAG(int, layers, 8, "MLP layers");
ABSL_FLAG(int, width, 1024, "MLP width");
ABSL_FLAG(int, batch, 8, "Rows per rank");
ABSL_FLAG(std::string, modes, "flat,two-level,hsdp",
          "Modes to run: flat, two-level (--two_level), hsdp (--shard_group_size=host), "
          "hsdp-serial (hsdp, the replicas' all-reduce on the reduce thread: "
          "--replica_thread=false), hsdp-check (hsdp with --replica_check_every=1), hsdp-bf16 (and "
          "--reduce_dtype=bf16), flat-int8, two-level-int8 (--gather_dtype=int8 "
          "--reduce_dtype=int8), hsdp-int8 (--reduce_dtype=int8), hpz, two-level-hpz, hpz-int8 "
          "(flat, two-level, flat-int8 with --secondary_shard_group_size=host), diloco, "
          "diloco-bf16, diloco-int8, diloco-int4 (hsdp with --sync=diloco --outer_every=H and "
          "that --outer_dtype); PyTorch 2 beside "
          "them: fsdp2 (fully_shard), "
          "fsdp2-hsdp (fully_shard on a 2-D DeviceMesh: shard in a host, replicate across)");
ABSL_FLAG(int, ranks_per_host, 2,
          "Ranks on each of the 2 worker hosts: 2 (W = 4) or 1 (W = 2; a rank per host, so on a "
          "machine of few cores each rank computes on its own core)");
ABSL_FLAG(int, outer_every, 50,
          "DiLoCo modes: H, inner steps per outer step; they run max(--steps, 2H) steps rounded "
          "up to a multiple of H");
ABSL_FLAG(std::string, torch_python, "",
          "Python with torch 2.x for the fsdp2 modes (default: $ZEROSHARD_PYTHON, else "
          "~/.cache/zeroshard/venv-torch2/bin/python)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard::testing {
namespace {

struct Result {
  int64_t rate = 0;
  std::string mode;
  int round = 0;
  double step_ms = 0;  // rank 0's median step
  // hsdp-check: rank 0's median --replica_check_every=1 check (hash and
  // 8-byte all-gather), outside step_ms (it runs after the step).
  double check_ms = 0;
  double hash_ms = 0;         // its hash (the rest: the all-gather and its wait)
  double crossing_bytes = 0;  // per worker host per step
  double counted_bytes = 0;   // the reports' inter-host bytes, host 1 per step
  double peak_rss = 0;        // the largest rank's, bytes
  std::string transport;
  std::string blas_kernel;
};

int64_t TxBytes(EmulatedHosts& hosts, int k) {
  auto [code, out] = hosts.Run(k, "cat /sys/class/net/eth0/statistics/tx_bytes");
  int64_t bytes = -1;
  if (code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(out), &bytes)) {
    std::fprintf(stderr, "multihost_bench: reading host %d's tx_bytes: %s\n", k, out.c_str());
    return -1;
  }
  return bytes;
}

// The model both sides train (--model and its shape flags).
TorchShape Shape() {
  TorchShape shape;
  shape.model = absl::GetFlag(FLAGS_model);
  shape.steps = absl::GetFlag(FLAGS_steps);
  if (shape.model == "gpt") {
    shape.layers = 6;
    shape.batch = 4;
  } else {
    shape.layers = absl::GetFlag(FLAGS_layers);
    shape.width = absl::GetFlag(FLAGS_width);
    shape.batch = absl::GetFlag(FLAGS_batch);
  }
  return shape;
}

// shard_worker's flags for that model.
std::vector<std::string> ModelFlags(const TorchShape& shape) {
  std::vector<std::string> flags = {absl::StrCat("--model=", shape.model),
                                    absl::StrCat("--layers=", shape.layers),
                                    absl::StrCat("--batch=", shape.batch)};
  if (shape.model == "gpt") {
    flags.insert(flags.end(),
                 {absl::StrCat("--d_model=", shape.d_model), absl::StrCat("--heads=", shape.heads),
                  absl::StrCat("--context=", shape.context)});
  } else {
    flags.insert(flags.end(), {absl::StrCat("--width=", shape.width), "--activation=gelu"});
  }
  return flags;
}

int RanksPerHost() { return absl::GetFlag(FLAGS_ranks_per_host); }
int World() { return 2 * RanksPerHost(); }

// Each rank's host: ranks 0..R-1 on host 1, R..2R-1 on host 2.
std::vector<int> RankHosts() {
  std::vector<int> hosts;
  for (int r = 0; r < World(); ++r) hosts.push_back(1 + r / RanksPerHost());
  return hosts;
}

// Rows (mlp) or tokens (gpt) per second over the ranks.
double ItemsPerSecond(const TorchShape& shape, double step_ms) {
  const double per_step =
      static_cast<double>(World()) * shape.batch * (shape.model == "gpt" ? shape.context : 1);
  return step_ms > 0 ? per_step / (step_ms / 1e3) : 0;
}

std::string TorchPython() {
  if (!absl::GetFlag(FLAGS_torch_python).empty()) return absl::GetFlag(FLAGS_torch_python);
  if (const char* p = std::getenv("ZEROSHARD_PYTHON"); p != nullptr && *p != '\0') return p;
  const char* home = std::getenv("HOME");
  return absl::StrCat(home == nullptr ? "/root" : home, "/.cache/zeroshard/venv-torch2/bin/python");
}

// One PyTorch job of the same shape on the same hosts (RankHosts()).
bool RunTorchOne(EmulatedHosts& hosts, const std::string& mode, int64_t rate, int round,
                 Result* r) {
  static int next_port = 29611;  // a fresh port per run: the last one may linger in TIME_WAIT
  const TorchShape shape = Shape();
  const int64_t before[2] = {TxBytes(hosts, 1), TxBytes(hosts, 2)};
  absl::StatusOr<TorchRun> run = RunTorchPeers(hosts, RankHosts(), mode, shape, TorchPython(),
                                               next_port++, MakeTempDir("multihost-torch"));
  if (!run.ok()) {
    std::fprintf(stderr, "multihost_bench: %s\n", run.status().ToString().c_str());
    return false;
  }
  const int64_t after[2] = {TxBytes(hosts, 1), TxBytes(hosts, 2)};
  r->rate = rate;
  r->mode = mode;
  r->round = round;
  r->step_ms = run->step_ms;
  r->crossing_bytes = (after[0] - before[0] + after[1] - before[1]) / 2.0 / shape.steps;
  r->counted_bytes = 0;  // PyTorch does not count them
  for (int64_t rss : run->peak_rss) r->peak_rss = std::max<double>(r->peak_rss, rss);
  r->transport = "torch gloo";
  r->blas_kernel = run->blas_kernel;
  return true;
}

bool RunOne(EmulatedHosts& hosts, LocalCluster& cluster, const std::string& mode, int64_t rate,
            int round, Result* r) {
  if (IsTorchMode(mode)) return RunTorchOne(hosts, mode, rate, round, r);
  const bool diloco = absl::StartsWith(mode, "diloco");
  const int every = absl::GetFlag(FLAGS_outer_every);
  const int steps =
      diloco ? (std::max(absl::GetFlag(FLAGS_steps), 2 * every) + every - 1) / every * every
             : absl::GetFlag(FLAGS_steps);
  const TorchShape shape = Shape();
  std::vector<std::string> flags = ModelFlags(shape);
  // One validation batch: the crossing bytes are divided by the steps.
  flags.insert(flags.end(), {"--stage=3", "--threads=1", "--lr=0.01", "--seed=9", "--val_batches=1",
                             absl::StrCat("--steps=", steps), "--collective_timeout=120s"});
  if (absl::StartsWith(mode, "two-level")) flags.push_back("--two_level");
  if (absl::StartsWith(mode, "hsdp") || diloco) flags.push_back("--shard_group_size=host");
  if (diloco) {
    flags.insert(flags.end(), {"--sync=diloco", absl::StrCat("--outer_every=", every)});
    if (mode == "diloco-bf16") flags.push_back("--outer_dtype=bf16");
    if (mode == "diloco-int8") flags.push_back("--outer_dtype=int8");
    if (mode == "diloco-int4") flags.push_back("--outer_dtype=int4");
  }
  if (mode == "hsdp-serial") flags.push_back("--replica_thread=false");
  if (mode == "hsdp-check") flags.push_back("--replica_check_every=1");
  if (mode == "hsdp-bf16") flags.push_back("--reduce_dtype=bf16");
  if (absl::EndsWith(mode, "-int8")) flags.push_back("--reduce_dtype=int8");
  if (mode == "flat-int8" || mode == "two-level-int8" || mode == "hpz-int8") {
    flags.push_back("--gather_dtype=int8");
  }
  if (absl::StrContains(mode, "hpz")) flags.push_back("--secondary_shard_group_size=host");
  const int64_t before[2] = {TxBytes(hosts, 1), TxBytes(hosts, 2)};
  const std::string job = absl::StrCat(mode, "-", rate, "-", round);
  if (!cluster.Run(job, World(), flags, absl::Seconds(600))) return false;
  const int64_t after[2] = {TxBytes(hosts, 1), TxBytes(hosts, 2)};
  const nlohmann::json report = cluster.Report(job, 0);
  r->rate = rate;
  r->mode = mode;
  r->round = round;
  // DiLoCo: the outer steps' time (outside the steps) spread over them.
  double outer_ms = 0;
  for (const auto& o : report["outer_steps"]) outer_ms += o["ms"].get<double>();
  r->step_ms = report["step_time_ms_median"].get<double>() + outer_ms / steps;
  r->check_ms = report.value("replica_check_ms_median", 0.0);
  r->hash_ms = report.value("replica_hash_ms_median", 0.0);
  r->crossing_bytes = (after[0] - before[0] + after[1] - before[1]) / 2.0 / steps;
  for (int rank = 0; rank < RanksPerHost(); ++rank) {  // host 1's
    const nlohmann::json rank_report = cluster.Report(job, rank);
    for (const auto& b : rank_report["comm_bytes_inter_host"]) {
      r->counted_bytes += b.get<double>() / steps;
    }
    for (const auto& o : rank_report["outer_steps"]) {  // the replicas cross the link
      r->counted_bytes += o["bytes_sent"].get<double>() / steps;
    }
  }
  for (int rank = 0; rank < World(); ++rank) {
    r->peak_rss = std::max(r->peak_rss, cluster.Report(job, rank)["peak_rss_bytes"].get<double>());
  }
  r->transport = report["data_plane"]["gather"]["transport"];
  r->blas_kernel = report["compute"]["blas_kernel"];
  return true;
}

int Main() {
  std::vector<int64_t> rates;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_rates), ',')) {
    int64_t rate = 0;
    if (!absl::SimpleAtoi(s, &rate) || rate < 0) {
      std::fprintf(stderr, "--rates: '%s' is not a rate in bits/s\n", std::string(s).c_str());
      return 2;
    }
    rates.push_back(rate);
  }
  if (absl::GetFlag(FLAGS_model) != "mlp" && absl::GetFlag(FLAGS_model) != "gpt") {
    std::fprintf(stderr, "--model: '%s' is not mlp or gpt\n", absl::GetFlag(FLAGS_model).c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_outer_every) < 1) {
    std::fprintf(stderr, "--outer_every: %d; expected H >= 1 (inner steps per outer step)\n",
                 absl::GetFlag(FLAGS_outer_every));
    return 2;
  }
  if (RanksPerHost() != 1 && RanksPerHost() != 2) {
    std::fprintf(stderr, "--ranks_per_host: %d; expected 1 or 2\n", RanksPerHost());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<EmulatedHosts>> hosts = EmulatedHosts::Create(3);
  if (!hosts.ok()) {
    std::fprintf(stderr, "multihost_bench: %s\n", hosts.status().ToString().c_str());
    return 1;
  }
  LocalCluster cluster(MakeTempDir("multihost-bench"), {},
                       HostLayout{hosts->get(), 0, RankHosts()});
  if (!cluster.ok()) return 1;
  const std::vector<std::string> modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  for (const std::string& mode : modes) {
    static const char* const kOurs[] = {
        "flat",           "two-level",   "hsdp",        "hsdp-bf16",     "flat-int8", "hsdp-int8",
        "two-level-int8", "hsdp-serial", "hpz",         "two-level-hpz", "hpz-int8",  "hsdp-check",
        "diloco",         "diloco-bf16", "diloco-int8", "diloco-int4"};
    if (std::find(std::begin(kOurs), std::end(kOurs), mode) == std::end(kOurs) &&
        !IsTorchMode(mode)) {
      std::fprintf(
          stderr,
          "--modes: '%s' is not flat, two-level, hsdp, hsdp-serial, hsdp-check, hsdp-bf16, "
          "flat-int8, two-level-int8, hsdp-int8, hpz, two-level-hpz, hpz-int8, diloco, "
          "diloco-bf16, diloco-int8, diloco-int4, fsdp2 or "
          "fsdp2-hsdp\n",
          mode.c_str());
      return 2;
    }
  }
  std::vector<Result> results;
  for (int64_t rate : rates) {
    for (int k : {1, 2}) {
      if (absl::Status s = (*hosts)->RateLimit(k, rate); !s.ok()) {
        std::fprintf(stderr, "multihost_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
      for (const std::string& mode : modes) {
        Result r;
        // Wall time of the whole run (start, steps, validation, exit): what
        // sizes a bench invocation (docs/multihost.md).
        const auto started = std::chrono::steady_clock::now();
        if (!RunOne(**hosts, cluster, mode, rate, round, &r)) return 1;
        const double run_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        std::fprintf(
            stderr,
            "%s at %lld bit/s, round %d: %.0f ms/step, %s crossing/host/step (run %.0f s)\n",
            mode.c_str(), static_cast<long long>(rate), round, r.step_ms,
            HumanBytes(r.crossing_bytes).c_str(), run_s);
        if (r.hash_ms > 0) {
          std::fprintf(stderr,
                       "%s: replica check: hash %.3f ms per checked step (%.2f %% of the step, "
                       "inside it); the 8-byte exchange rides the step's verdict all-gather; "
                       "the standalone check after the last step %.3f ms\n",
                       mode.c_str(), r.hash_ms, 100 * r.hash_ms / r.step_ms, r.check_ms);
        }
        results.push_back(r);
      }
    }
  }
  std::string our_kernel;
  for (const Result& r : results) {
    if (!IsTorchMode(r.mode)) our_kernel = r.blas_kernel;
  }
  const BenchMachine machine = DescribeBenchMachine(our_kernel);
  std::printf("%s\n", machine.Line().c_str());
  std::printf("2 worker hosts x %d rank(s) (W = %d)\n", RanksPerHost(), World());
  for (const Result& r : results) {
    if (!IsTorchMode(r.mode)) continue;
    std::printf("PyTorch modes: %s\n", r.blas_kernel.c_str());
    break;
  }
  const TorchShape shape = Shape();
  Table table({"LINK", "MODE", "TRANSPORT", "STEP ms (median of rounds)",
               shape.model == "gpt" ? "TOKENS/s" : "ROWS/s", "CROSSING/HOST/STEP", "COUNTED",
               "PEAK RSS/RANK"});
  nlohmann::json json = {{"machine", machine.Line()},
                         {"model", shape.model},
                         {"ranks_per_host", RanksPerHost()},
                         {"results", nlohmann::json::array()}};
  for (int64_t rate : rates) {
    for (const std::string& mode : modes) {
      std::vector<double> ms, bytes, counted, rss;
      std::string transport;
      for (const Result& r : results) {
        if (r.rate != rate || r.mode != mode) continue;
        ms.push_back(r.step_ms);
        bytes.push_back(r.crossing_bytes);
        counted.push_back(r.counted_bytes);
        rss.push_back(r.peak_rss);
        transport = r.transport;
        json["results"].push_back({{"rate_bits_per_s", r.rate},
                                   {"mode", r.mode},
                                   {"round", r.round},
                                   {"step_ms", r.step_ms},
                                   {"replica_check_ms", r.check_ms},
                                   {"replica_hash_ms", r.hash_ms},
                                   {"items_per_second", ItemsPerSecond(shape, r.step_ms)},
                                   {"crossing_bytes_per_host_per_step", r.crossing_bytes},
                                   {"counted_inter_host_bytes_per_step", r.counted_bytes},
                                   {"peak_rss_bytes_per_rank", r.peak_rss},
                                   {"transport", r.transport}});
      }
      if (ms.empty()) continue;
      std::sort(ms.begin(), ms.end());
      std::sort(bytes.begin(), bytes.end());
      std::sort(counted.begin(), counted.end());
      table.AddRow({rate == 0 ? "unlimited" : absl::StrFormat("%.0f Mbit/s", rate / 1e6), mode,
                    transport,
                    absl::StrFormat("%.0f (%.0f-%.0f)", ms[ms.size() / 2], ms.front(), ms.back()),
                    absl::StrFormat("%.0f", ItemsPerSecond(shape, ms[ms.size() / 2])),
                    HumanBytes(bytes[bytes.size() / 2]), HumanBytes(counted[counted.size() / 2]),
                    HumanBytes(*std::max_element(rss.begin(), rss.end()))});
    }
  }
  std::printf("%s", table.ToString().c_str());
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::testing::Main();
}
