#include "tests/bench/multihost_torch.h"

#include <algorithm>
#include <csignal>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

// The JSON line peer.py --rank prints last, or a discarded value.
nlohmann::json LastJsonLine(const std::string& log) {
  std::vector<std::string> lines = absl::StrSplit(log, '\n', absl::SkipWhitespace());
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (it->empty() || (*it)[0] != '{') continue;
    nlohmann::json j = nlohmann::json::parse(*it, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) return j;
  }
  return nlohmann::json(nlohmann::json::value_t::discarded);
}

std::vector<std::string> PeerArgs(const std::string& python, const std::string& mode,
                                  const TorchShape& shape, int world, int rank,
                                  const std::string& master) {
  return {// Gloo picks the interface the hostname resolves to unless told.
          "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1", python,
          RunfilePath("tests/bench/peers/peer.py"), absl::StrCat("--model=", shape.model),
          mode == "fsdp2-hsdp" ? "--mode=fsdp2_hsdp" : "--mode=fsdp2",
          absl::StrCat("--shard_group_size=", world / 2), "--activation=gelu",
          absl::StrCat("--layers=", shape.layers), absl::StrCat("--width=", shape.width),
          absl::StrCat("--d_model=", shape.d_model), absl::StrCat("--heads=", shape.heads),
          absl::StrCat("--context=", shape.context),
          absl::StrCat("--batch=", shape.batch), absl::StrCat("--steps=", shape.steps),
          "--threads=1", absl::StrCat("--world=", world), absl::StrCat("--rank=", rank),
          absl::StrCat("--master=", master)};
}

}  // namespace

bool IsTorchMode(const std::string& mode) { return mode == "fsdp2" || mode == "fsdp2-hsdp"; }

absl::StatusOr<TorchRun> RunTorchPeers(EmulatedHosts& hosts, const std::vector<int>& rank_hosts,
                                       const std::string& mode, const TorchShape& shape,
                                       const std::string& python, int master_port,
                                       const std::string& log_dir) {
  const int world = static_cast<int>(rank_hosts.size());
  const std::string master = absl::StrCat(hosts.address(rank_hosts[0]), ":", master_port);
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(hosts.Start(rank_hosts[r], "/usr/bin/env",
                                PeerArgs(python, mode, shape, world, r, master),
                                absl::StrCat(log_dir, "/", mode, "-", master_port, "-", r, ".log")));
  }
  TorchRun run;
  std::vector<std::vector<double>> steps(world);
  for (int r = 0; r < world; ++r) {
    const int code = ranks[r]->Wait(absl::Minutes(10));
    const nlohmann::json result = LastJsonLine(ranks[r]->Log());
    if (code != 0 || result.is_discarded() || !result.contains("step_s")) {
      for (auto& p : ranks) p->Signal(SIGKILL);
      return absl::InternalError(absl::StrCat("PyTorch rank ", r, " (", mode, ") exited ", code,
                                              "; its log:\n", ranks[r]->Log()));
    }
    steps[r] = result["step_s"].get<std::vector<double>>();
    run.peak_rss.push_back(result["peak_rss_bytes"].get<int64_t>());
    run.blas_kernel = result["blas_kernel"].get<std::string>();
  }
  // A step ends when its slowest rank ends it.
  std::vector<double> slowest(steps[0].size(), 0.0);
  for (const auto& s : steps) {
    for (size_t i = 0; i < slowest.size() && i < s.size(); ++i) {
      slowest[i] = std::max(slowest[i], s[i]);
    }
  }
  if (slowest.empty()) return absl::InternalError("PyTorch ranks timed no step (--steps < 2?)");
  std::sort(slowest.begin(), slowest.end());
  run.step_ms = slowest[slowest.size() / 2] * 1e3;
  return run;
}

}  // namespace zeroshard::testing
