// What the views of a large job cost the server (issue #31: `/metrics` of a
// 100,000-rank job <= 20 MB and <= 1 s; status and the dashboard without
// every rank): a job of W members, 8 to a host, each having sent a ZeRO-3
// rank's beat (full telemetry), in-process on a fake clock as
// heartbeat_path_bench does, so that the figures are this thread's CPU time
// and sizes, not a starved machine's gRPC (control_plane_bench measures the
// same through real streams and HTTP). For each W, medians of 5:
//   status pass   Membership::Status + the analyzer's annotations: what every
//                 view below starts from
//   /metrics      MetricsExposition of the default view (a large job's worst
//                 32 ranks, its hosts and histograms), and of ?all=1
//   GetStatus     the whole reply (shardctl status --all), and the summary
//                 shardctl and the dashboard ask for (max_members 64), with
//                 its JSON (/api/status?max_members=64)
//
//   bazel run //tests/bench:views_bench -- [--members=4096,32768,100000] [--json_out=FILE]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/rank_rows.h"
#include "common/table.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "shard_server/base/clock.h"
#include "shard_server/membership/membership.h"
#include "shard_server/base/event_log.h"
#include "shard_server/observability/rank_views.h"
#include "shard_server/observability/server_metrics.h"
#include "shard_server/observability/telemetry_analyzer.h"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/simulated_members.h"

ABSL_FLAG(std::string, members, "4096,32768,100000", "Job sizes, comma-separated");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

constexpr int kRanksPerHost = 8;
constexpr int kRepeats = 5;

// This thread's CPU time in seconds.
double ThreadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// The median CPU seconds of `kRepeats` calls of `work`, each after an
// untimed call of `prepare`.
double MedianCpuSeconds(const std::function<void()>& work,
                        const std::function<void()>& prepare = [] {}) {
  std::vector<double> seconds;
  for (int i = 0; i < kRepeats; ++i) {
    prepare();
    const double start = ThreadCpuSeconds();
    work();
    seconds.push_back(ThreadCpuSeconds() - start);
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

struct ViewCost {
  double seconds = 0;  // CPU, median
  int64_t bytes = 0;
};

struct Views {
  ViewCost status_pass;
  ViewCost metrics, metrics_all;
  ViewCost status_whole, status_summary, summary_json;
};

Views Measure(int members) {
  FakeClock clock;
  EventLog log([](const std::string&) {});
  MembershipOptions options;
  options.max_world_size = std::max(options.max_world_size, members);
  options.heartbeat_timeout = absl::Hours(1);
  Membership membership(&clock, &log, nullptr, options);
  TelemetryAnalyzer analyzer(&clock, &log, {});
  const std::string job = "bench";
  std::vector<v1::JoinResponse> joined(members);
  for (int i = 0; i < members; ++i) {
    v1::JoinRequest r;
    r.set_job_id(job);
    r.set_world_size(members);
    r.set_worker_id(absl::StrFormat("node%05d/%d", i / kRanksPerHost, i % kRanksPerHost));
    r.set_host(absl::StrFormat("node%05d", i / kRanksPerHost));
    r.set_skip_member_table(true);
    membership.Join(r, clock.Now() + absl::Hours(1),
                    [&joined, i](absl::StatusOr<v1::JoinResponse> j) { joined[i] = *j; });
  }
  for (const v1::JoinResponse& j : joined) {
    v1::HeartbeatRequest beat;
    *beat.mutable_member() = testing::Credentials(job, j);
    testing::FillTelemetry("full", &beat);
    beat.set_step(100);
    if (!membership.Heartbeat(beat).ok()) std::abort();
  }
  clock.Advance(absl::Milliseconds(500));
  analyzer.Analyze(membership.Status(""));

  Views v;
  v1::GetStatusResponse status;
  v.status_pass.seconds = MedianCpuSeconds([&] {
    status = membership.Status("");
    analyzer.Annotate(&status);
  });
  ServerMetrics server;
  std::string page;
  v.metrics.seconds =
      MedianCpuSeconds([&] { page = MetricsExposition(server, status, {}, MetricsView()); });
  v.metrics.bytes = page.size();
  MetricsView all;
  all.all_ranks = true;
  v.metrics_all.seconds =
      MedianCpuSeconds([&] { page = MetricsExposition(server, status, {}, all); });
  v.metrics_all.bytes = page.size();
  std::string wire;
  v.status_whole.seconds = MedianCpuSeconds([&] { status.SerializeToString(&wire); });
  v.status_whole.bytes = wire.size();
  const v1::GetStatusRequest request = StatusRequest(job, -1, "", /*all=*/false);
  v1::GetStatusResponse summary;
  // The server summarizes the status pass's own reply in place; the copy
  // here stands for a fresh pass and is not timed.
  v.status_summary.seconds = MedianCpuSeconds(
      [&] {
        SummarizeLargeJobs(request, &summary);
        summary.SerializeToString(&wire);
      },
      [&] { summary = status; });
  v.status_summary.bytes = wire.size();
  std::string json;
  v.summary_json.seconds = MedianCpuSeconds([&] {
    json.clear();
    (void)google::protobuf::util::MessageToJsonString(summary, &json);
  });
  v.summary_json.bytes = json.size();
  return v;
}

std::string Cell(const ViewCost& c) {
  return absl::StrFormat("%.1f ms, %.3f MB", c.seconds * 1e3, c.bytes / 1e6);
}

nlohmann::json Json(const ViewCost& c) {
  return {{"cpu_seconds", c.seconds}, {"bytes", c.bytes}};
}

int Main() {
  const BenchMachine machine = DescribeBenchMachine("");
  std::printf("%s\n", machine.Line().c_str());
  nlohmann::ordered_json result;
  result["machine"] = machine.Json();
  Table table({"RANKS", "STATUS PASS", "/metrics", "/metrics?all=1", "GetStatus whole",
               "GetStatus summary", "its JSON"});
  for (absl::string_view size : absl::StrSplit(absl::GetFlag(FLAGS_members), ',')) {
    int members = 0;
    if (!absl::SimpleAtoi(size, &members) || members <= 0) {
      std::fprintf(stderr, "--members: '%s' is not a positive count\n", std::string(size).c_str());
      return 2;
    }
    const Views v = Measure(members);
    result["members"][absl::StrCat(members)] = {
        {"status_pass", Json(v.status_pass)},       {"metrics", Json(v.metrics)},
        {"metrics_all", Json(v.metrics_all)},       {"get_status_whole", Json(v.status_whole)},
        {"get_status_summary", Json(v.status_summary)}, {"summary_json", Json(v.summary_json)}};
    table.AddRow({absl::StrCat(members), absl::StrFormat("%.1f ms", v.status_pass.seconds * 1e3),
                  Cell(v.metrics), Cell(v.metrics_all), Cell(v.status_whole),
                  Cell(v.status_summary), Cell(v.summary_json)});
  }
  std::printf(
      "server CPU (this thread, median of %d) and bytes per view, 8 ranks a host; a scrape or "
      "status costs the status pass plus its column:\n%s",
      kRepeats, table.ToString().c_str());
  return WriteBenchJson(result, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
