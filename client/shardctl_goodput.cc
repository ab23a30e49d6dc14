// shardctl goodput --job=ID [--json]: where the job's wall-clock time went,
// by cause, from the server's ledger (docs/goodput.md): a table for people,
// or JSON with wall_seconds, productive_seconds, badput_seconds {cause:
// seconds}, goodput and mfu (-1: not known yet).
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/shardctl_commands.h"
#include "common/table.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

std::string Share(double seconds, double wall) {
  return wall > 0 ? absl::StrFormat("%.1f %%", 100 * seconds / wall) : "-";
}

std::string Flops(double flops) {
  if (flops >= 1e12) return absl::StrFormat("%.1f TFLOP", flops / 1e12);
  if (flops >= 1e9) return absl::StrFormat("%.1f GFLOP", flops / 1e9);
  return absl::StrFormat("%.3g FLOP", flops);
}

void PrintGoodput(const std::string& job, const v1::Goodput& g) {
  const double wall = g.wall_seconds();
  // The productive time first, then the causes of badput, the largest first
  // (those without time are left out: --json lists every one).
  std::vector<std::pair<std::string, double>> badput(g.badput_seconds().begin(),
                                                     g.badput_seconds().end());
  std::sort(badput.begin(), badput.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  Table table({"CAUSE", "SECONDS", "SHARE"});
  table.AddRow({"productive", absl::StrFormat("%.1f", g.productive_seconds()),
                Share(g.productive_seconds(), wall)});
  for (const auto& [cause, seconds] : badput) {
    if (seconds <= 0) continue;
    table.AddRow({cause, absl::StrFormat("%.1f", seconds), Share(seconds, wall)});
  }
  table.AddRow({"wall clock", absl::StrFormat("%.1f", wall), wall > 0 ? "100.0 %" : "-"});
  std::printf("%s goodput\n%s", job.c_str(), table.ToString().c_str());
  std::printf("goodput %s", Share(g.productive_seconds(), wall).c_str());
  if (g.mfu() < 0) {
    std::printf(", MFU not known yet (no productive step with a FLOP count reported)\n");
  } else {
    std::printf(", MFU %.1f %% (peak %s/s per rank, %s per item)\n", 100 * g.mfu(),
                Flops(g.peak_flops()).c_str(), Flops(g.flops_per_item()).c_str());
  }
  const auto in_flight = g.badput_seconds().find("in_flight");
  if (in_flight != g.badput_seconds().end() && in_flight->second > 0) {
    std::printf("in_flight: the running generation's time its workers have not reported yet\n");
  }
}

}  // namespace

int GoodputCommand() {
  const std::string job = absl::GetFlag(FLAGS_job);
  if (job.empty()) {
    std::fprintf(stderr, "shardctl goodput: --job=ID is required (shardctl status lists jobs)\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  // The ledger only: a large job's members are summed up, not listed.
  v1::GetStatusRequest request;
  request.set_job_id(job);
  request.set_max_members(1);
  request.set_worst_ranks(1);
  request.set_worst_hosts(1);
  absl::StatusOr<v1::GetStatusResponse> status = (*client)->GetStatus(request);
  if (!status.ok()) return Fail(status.status());
  const v1::JobStatus* found = nullptr;
  for (const v1::JobStatus& j : status->jobs()) {
    if (j.job_id() == job) found = &j;
  }
  if (found == nullptr) return Fail(absl::NotFoundError(absl::StrCat("no job '", job, "'")));
  const v1::Goodput& g = found->goodput();
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json badput = nlohmann::json::object();
    for (const auto& [cause, seconds] : g.badput_seconds()) badput[cause] = seconds;
    const nlohmann::json out = {{"job", job},
                                {"wall_seconds", g.wall_seconds()},
                                {"productive_seconds", g.productive_seconds()},
                                {"badput_seconds", badput},
                                {"goodput", g.goodput()},
                                {"mfu", g.mfu()},
                                {"peak_flops", g.peak_flops()},
                                {"flops_per_item", g.flops_per_item()}};
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }
  PrintGoodput(job, g);
  return 0;
}

}  // namespace zeroshard
