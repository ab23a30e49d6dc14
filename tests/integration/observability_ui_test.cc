// What people look at, against a real shard_server and a real 2-worker
// ZeRO-3 job training on loopback: /metrics checked by Prometheus's own
// promtool, shardctl history, shardctl top in a real terminal (tmux), and
// the dashboard rendered by headless Chromium, also for a simulated job of
// 2,048 ranks (summarized, with look-ups). The tools come from Debian
// (tools/install_deps.sh: prometheus, tmux, chromium, curl).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"
#include "tests/testing/simulated_members.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;
using testing::RunCommand;

std::string Tool(const std::string& name) {
  auto [code, path] = RunCommand("command -v " + name);
  if (code != 0) {
    ADD_FAILURE() << name << " is not installed: run tools/install_deps.sh";
    return "";
  }
  return std::string(absl::StripTrailingAsciiWhitespace(path));
}

std::string Shardctl(const LocalCluster& cluster) {
  return absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster.address());
}

// The dashboard page `url` as headless Chromium renders it after `budget_ms`
// of virtual time (its scripts' fetches done): (exit code, DOM).
std::pair<int, std::string> RenderedDom(const std::string& chromium, const std::string& dir,
                                        const std::string& url, int budget_ms = 8000) {
  return RunCommand(absl::StrCat(
      chromium, " --headless --no-sandbox --disable-gpu --user-data-dir=", dir,
      "/chromium --virtual-time-budget=", budget_ms, " --dump-dom '", url, "' 2>/dev/null"));
}

// GET http://127.0.0.1:port/path; (HTTP status, body).
std::pair<int, std::string> Get(int port, const std::string& path, const std::string& file,
                                const std::string& header = "") {
  auto [code, status] = RunCommand(absl::StrCat("curl -s -o ", file, " -w '%{http_code}' ",
                                                header.empty() ? "" : "-H '" + header + "' ",
                                                "'http://127.0.0.1:", port, path, "'"));
  int http = 0;
  if (code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(status), &http))
    return {-1, status};
  return {http, testing::ReadFileOrEmpty(file)};
}

int MetricsPort(const LocalCluster& cluster) {
  std::string port = testing::ReadFileOrEmpty(cluster.dir() + "/mport");
  int value = 0;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(port), &value) ? value : 0;
}

// The line of `table` (status or top) of worker `worker`'s row ("" if none).
std::string RowOf(const std::string& table, const std::string& worker) {
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    if (absl::StrContains(line, absl::StrCat(" ", worker, " "))) return std::string(line);
  }
  return "";
}

// The value of the sample `series` ("name{labels} ") in a /metrics page;
// NaN when absent.
double Sample(const std::string& metrics, const std::string& series) {
  const size_t at = metrics.find(series);
  if (at == std::string::npos) return std::nan("");
  const size_t start = at + series.size();
  double value = 0;
  if (!absl::SimpleAtod(metrics.substr(start, metrics.find('\n', start) - start), &value)) {
    return std::nan("");
  }
  return value;
}

class ObservabilityUiTest : public ::testing::Test {
 protected:
  ObservabilityUiTest()
      : dir_(testing::MakeTempDir("obsui")),
        cluster_(dir_, {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir_ + "/mport"}) {
  }

  // A 2-worker ZeRO-3 MLP job that checkpoints every 10 steps, trained until
  // it has a complete checkpoint and 30 steps, then left training.
  void StartJob() {
    cluster_.StartWorkers(
        "live", 2,
        {"--model=mlp", "--layers=4", "--width=32", "--batch=8", "--stage=3", "--steps=100000",
         "--lr=0.01", "--checkpoint_every=10", "--collective_timeout=120s"});
    const std::string ctl = Shardctl(cluster_);
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          auto [code, out] = RunCommand(ctl + " --job=live status --json");
          if (code != 0) return false;
          nlohmann::json status = nlohmann::json::parse(out, nullptr, false);
          if (status.is_discarded() || status["jobs"].empty()) return false;
          for (const auto& m : status["jobs"][0]["members"]) {
            if (std::stoll(m["step"].get<std::string>()) < 30) return false;
          }
          return RunCommand(ctl + " --job=live checkpoints").second.find("verified") !=
                 std::string::npos;
        },
        absl::Seconds(120)))
        << cluster_.server()->Log() << cluster_.WorkerLog(0);
    // The server's history holds a sample after the 30th step of each rank
    // (it samples twice a second).
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          auto [code, out] = RunCommand(ctl + " --job=live history --json");
          if (code != 0) return false;
          nlohmann::json history = nlohmann::json::parse(out, nullptr, false);
          if (history.is_discarded() || !history.contains("points")) return false;
          bool sampled[2] = {false, false};
          for (const auto& point : history["points"]) {
            // int64 fields are strings in proto JSON.
            const int rank = point.value("rank", -1);
            const int64_t step = std::stoll(point.value("step", std::string("0")));
            if (rank >= 0 && rank < 2 && step >= 30) sampled[rank] = true;
          }
          return sampled[0] && sampled[1];
        },
        absl::Seconds(60)))
        << cluster_.server()->Log();
  }

  std::string dir_;
  LocalCluster cluster_;
};

TEST_F(ObservabilityUiTest, MetricsOfALiveJobPassPromtoolAndHoldTheSeries) {
  ASSERT_TRUE(cluster_.ok());
  const std::string promtool = Tool("promtool");
  StartJob();
  auto [http, text] = Get(MetricsPort(cluster_), "/metrics", dir_ + "/metrics.txt");
  ASSERT_EQ(http, 200) << text;
  auto [code, out] = RunCommand(promtool + " check metrics < " + dir_ + "/metrics.txt");
  EXPECT_EQ(code, 0) << out;
  for (const char* series :
       {"zeroshard_jobs{state=\"running\"} 1", "zeroshard_members{state=\"alive\"} 2",
        "zeroshard_job_generation{job=\"live\"} 1", "zeroshard_joins_total 2",
        "zeroshard_heartbeats_total ", "zeroshard_rpcs_total{method=\"Join\",code=\"OK\"} 2",
        "zeroshard_rpc_duration_seconds_bucket{method=\"Join\",code=\"OK\",le=\"+Inf\"} 2",
        "zeroshard_kv_operations_total{op=\"set\"} ", "zeroshard_checkpoint_commits_total ",
        "zeroshard_checkpoint_committed_bytes_total ", "zeroshard_consolidated_bytes_total 0",
        "zeroshard_consolidation_seconds_total 0",
        "zeroshard_checkpoints{job=\"live\",state=\"verified\"} ",
        "zeroshard_checkpoints{job=\"live\",state=\"failed\"} 0",
        "zeroshard_rank_step{job=\"live\",rank=\"0\",worker=\"w0\"} ",
        "zeroshard_rank_loss{job=\"live\",rank=\"1\",worker=\"w1\"} ",
        "zeroshard_rank_step_seconds{job=\"live\",rank=\"0\",worker=\"w0\"} ",
        "zeroshard_rank_items_per_second{job=\"live\",rank=\"0\",worker=\"w0\"} ",
        "zeroshard_rank_memory_bytes{job=\"live\",rank=\"0\",worker=\"w0\",category=\"params\"} ",
        "zeroshard_rank_memory_bytes{job=\"live\",rank=\"1\",worker=\"w1\",category="
        "\"optimizer_state\"} ",
        "zeroshard_rank_collective_wait_seconds{job=\"live\",rank=\"0\",worker=\"w0\",op="
        "\"all_gather\"} ",
        "zeroshard_rank_collective_wait_seconds{job=\"live\",rank=\"0\",worker=\"w0\",op="
        "\"reduce\"} ",
        "zeroshard_rank_arrival_lag_seconds{job=\"live\",rank=\"1\",worker=\"w1\"} ",
        "zeroshard_rank_heartbeat_age_seconds{job=\"live\",rank=\"1\",worker=\"w1\"} ",
        "zeroshard_rank_straggler{job=\"live\",rank=\"0\",worker=\"w0\"} 0",
        "zeroshard_rank_hung{job=\"live\",rank=\"1\",worker=\"w1\"} 0",
        "zeroshard_rank_data_plane_sent_bytes_total{job=\"live\",rank=\"0\",worker=\"w0\"} ",
        "zeroshard_rank_comm_bytes_intra_host_total{job=\"live\",rank=\"0\",worker=\"w0\"} ",
        // One host: nothing crosses a network.
        "zeroshard_rank_comm_bytes_inter_host_total{job=\"live\",rank=\"1\",worker=\"w1\"} "
        "0\n"}) {
    EXPECT_NE(text.find(series), std::string::npos) << series;
  }
  // Commits were counted: a number above zero.
  EXPECT_EQ(text.find("zeroshard_checkpoint_commits_total 0\n"), std::string::npos);
}

TEST_F(ObservabilityUiTest, HistoryOfALiveJobSurvivesAServerRestart) {
  ASSERT_TRUE(cluster_.ok());
  StartJob();
  const std::string ctl = Shardctl(cluster_);
  auto count_rows = [&](int rank) {
    auto [code, csv] = RunCommand(ctl + " --job=live history --csv");
    EXPECT_EQ(code, 0) << csv;
    int rows = 0;
    for (absl::string_view line : absl::StrSplit(csv, '\n')) {
      rows += absl::StartsWith(line, absl::StrCat(rank, ","));
    }
    return rows;
  };
  EXPECT_GE(count_rows(0), 1);
  EXPECT_GE(count_rows(1), 1);
  auto [code, json] = RunCommand(ctl + " --job=live history --json");
  ASSERT_EQ(code, 0) << json;
  nlohmann::json parsed = nlohmann::json::parse(json);
  ASSERT_FALSE(parsed["points"].empty());
  EXPECT_GT(parsed["points"][0]["loss"].get<double>(), 0);
  const int before = count_rows(0);
  cluster_.RestartServer();
  ASSERT_TRUE(cluster_.ok());
  EXPECT_GE(count_rows(0), before);
  EXPECT_NE(RunCommand(ctl + " --job=nosuchjob history").first, 0);
}

TEST_F(ObservabilityUiTest, TopShowsOneRowPerRankInATerminalAndQuitsOnQ) {
  ASSERT_TRUE(cluster_.ok());
  const std::string tmux = Tool("tmux");
  StartJob();
  const std::string session = absl::StrCat("zstop", getpid());
  // A socket path fits in 108 bytes; the test's temporary directory may not.
  const std::string socket_path = absl::StrCat("/tmp/", session, ".sock");
  const std::string socket = "-S " + socket_path;
  auto [code, out] = RunCommand(absl::StrCat(tmux, " ", socket, " new-session -d -s ", session,
                                             " -x 160 -y 40 '", Shardctl(cluster_), " top'"));
  ASSERT_EQ(code, 0) << out;
  std::string screen;
  const bool rows = testing::WaitFor(
      [&] {
        screen =
            RunCommand(absl::StrCat(tmux, " ", socket, " capture-pane -p -t ", session)).second;
        return screen.find("job live") != std::string::npos &&
               screen.find(" w0 ") != std::string::npos && screen.find(" w1 ") != std::string::npos;
      },
      absl::Seconds(20));
  EXPECT_TRUE(rows) << screen;
  EXPECT_NE(screen.find("RUNNING"), std::string::npos) << screen;
  EXPECT_NE(screen.find("latest checkpoint step"), std::string::npos) << screen;
  RunCommand(absl::StrCat(tmux, " ", socket, " send-keys -t ", session, " q"));
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        return RunCommand(absl::StrCat(tmux, " ", socket, " has-session -t ", session)).first != 0;
      },
      absl::Seconds(10)));
  RunCommand(absl::StrCat(tmux, " ", socket, " kill-server"));
  std::remove(socket_path.c_str());
  // Not a terminal: plain text, no escape sequences.
  auto [plain_code, plain] = RunCommand(Shardctl(cluster_) + " top --top_iterations=2 | cat");
  EXPECT_EQ(plain_code, 0) << plain;
  EXPECT_EQ(plain.find('\033'), std::string::npos);
  EXPECT_NE(plain.find(" w1 "), std::string::npos) << plain;
}

// A job that finished reads the same in status and top: every rank left (not
// dead), at the step the job ended at (a rank's last heartbeat may predate
// its last steps: the leave carries them), with no collective in flight.
TEST_F(ObservabilityUiTest, AFinishedJobShowsItsLastStepAndRanksThatLeftEverywhere) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 37;  // not a multiple of anything the heartbeats align with
  ASSERT_TRUE(cluster_.Run("done", 2,
                           {"--model=mlp", "--layers=2", "--width=16", "--batch=8", "--stage=3",
                            absl::StrCat("--steps=", kSteps)}))
      << cluster_.WorkerLog(0);
  const std::string ctl = Shardctl(cluster_);
  auto [code, out] = RunCommand(ctl + " --job=done status --json");
  ASSERT_EQ(code, 0) << out;
  nlohmann::json status = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(status.is_discarded()) << out;
  ASSERT_EQ(status["jobs"].size(), 1u) << out;
  EXPECT_EQ(status["jobs"][0].value("state", ""), "FINISHED") << out;
  for (const auto& m : status["jobs"][0]["members"]) {
    EXPECT_TRUE(m.value("left", false)) << m.dump();
    EXPECT_EQ(m.value("step", std::string("0")), absl::StrCat(kSteps)) << m.dump();
    EXPECT_FALSE(m.contains("telemetry") && m["telemetry"].contains("in_progress")) << m.dump();
  }
  auto [top_code, top] = RunCommand(ctl + " --job=done top --top_iterations=1 | cat");
  EXPECT_EQ(top_code, 0) << top;
  EXPECT_EQ(top.find("DEAD"), std::string::npos) << top;
  for (const char* worker : {"w0", "w1"}) {
    const std::string row = RowOf(top, worker);
    EXPECT_NE(row.find("LEFT"), std::string::npos) << top;
    EXPECT_NE(row.find(absl::StrCat(" ", kSteps, " ")), std::string::npos) << top;
    EXPECT_EQ(row.find("all_gather"), std::string::npos) << top;
  }
  // /metrics: left (not alive, not dead), the final step, nothing in flight.
  auto [http, metrics] = Get(MetricsPort(cluster_), "/metrics", dir_ + "/done-metrics.txt");
  ASSERT_EQ(http, 200) << metrics;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string labels =
        absl::StrCat("{job=\"done\",rank=\"", rank, "\",worker=\"w", rank, "\"} ");
    EXPECT_EQ(Sample(metrics, "zeroshard_rank_left" + labels), 1) << metrics;
    EXPECT_EQ(Sample(metrics, "zeroshard_rank_alive" + labels), 0) << metrics;
    EXPECT_EQ(Sample(metrics, "zeroshard_rank_step" + labels), kSteps) << metrics;
    EXPECT_EQ(Sample(metrics, "zeroshard_rank_in_collective_seconds" + labels), -1) << metrics;
  }
}

// A rank stuck in a collective, and then a dead rank, read the same in
// status, top and /metrics. Heartbeats every 3 s: a view that computed the
// age as its own time minus the collective's start (what used to be shown)
// would count up between reports; the rank's own measure at its report
// stays put until the next one, and every view shows that one number.
TEST(ObservabilityStateTest, AStuckRankAndADeadOneReadTheSameInStatusTopAndMetrics) {
  const std::string dir = testing::MakeTempDir("obsstate");
  LocalCluster cluster(dir,
                       {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/mport",
                        "--heartbeat_interval_ms=3000", "--heartbeat_timeout_ms=30000"});
  ASSERT_TRUE(cluster.ok());
  // w1 stops before its 30th all-gather (a few steps in): w0 waits in it.
  cluster.StartWorkers("stuck", 2,
                       {"--model=mlp", "--layers=4", "--width=32", "--batch=8", "--stage=3",
                        "--steps=100000", "--collective_timeout=300s"},
                       {{1, {"--test_stall_before_gather=30"}}});
  const std::string ctl = Shardctl(cluster) + " --job=stuck";
  auto status_json = [&]() -> nlohmann::json {
    auto [code, out] = RunCommand(ctl + " status --json");
    nlohmann::json status = nlohmann::json::parse(out, nullptr, false);
    if (code != 0 || status.is_discarded() || status["jobs"].empty()) return nullptr;
    return status["jobs"][0];
  };
  // Rank `rank`'s member entry of a status (null: absent).
  auto member = [](const nlohmann::json& job, int rank) -> nlohmann::json {
    if (job.is_null()) return nullptr;
    for (const auto& m : job["members"]) {
      if (m.value("rank", 0) == rank) return m;
    }
    return nullptr;
  };
  // One report seen by all views: status, then shardctl status, top and
  // /metrics, then status again with the same report (the same age).
  std::string text, top, metrics;
  nlohmann::json first;
  const bool seen = testing::WaitFor(
      [&] {
        first = member(status_json(), 0);
        if (first.is_null() || !first.contains("telemetry") ||
            !first["telemetry"].contains("in_progress")) {
          return false;
        }
        text = RunCommand(ctl + " status").second;
        top = RunCommand(ctl + " top --top_iterations=1 | cat").second;
        metrics = Get(MetricsPort(cluster), "/metrics", dir + "/metrics.txt").second;
        nlohmann::json second = member(status_json(), 0);
        return !second.is_null() && second.contains("telemetry") &&
               second["telemetry"].value("in_progress", nlohmann::json()) ==
                   first["telemetry"]["in_progress"] &&
               std::stoll(first["telemetry"]["in_progress"].value("age_ms", std::string("0"))) >=
                   1000;
      },
      absl::Seconds(90));
  ASSERT_TRUE(seen) << first.dump() << cluster.server()->Log() << cluster.WorkerLog(1);
  const nlohmann::json& c = first["telemetry"]["in_progress"];
  EXPECT_EQ(c.value("op", ""), "ALL_GATHER") << c.dump();
  EXPECT_EQ(c.value("seq", std::string()), "30") << c.dump();
  const int64_t age_ms = std::stoll(c.value("age_ms", std::string("0")));
  // Its own age when reported: no later than the report, which is no later
  // than now (one clock: every process is on this machine).
  EXPECT_LE(std::stoll(c.value("started_unix_ms", std::string("0"))) + age_ms,
            absl::ToUnixMillis(absl::Now()));
  const std::string shown =
      absl::StrFormat("all_gather #30 %s %.1fs", c.value("unit", ""), age_ms / 1000.0);
  EXPECT_NE(RowOf(text, "w0").find(shown), std::string::npos) << shown << "\n" << text;
  EXPECT_NE(RowOf(top, "w0").find(shown), std::string::npos) << shown << "\n" << top;
  const std::string w0 = "{job=\"stuck\",rank=\"0\",worker=\"w0\"} ";
  const std::string w1 = "{job=\"stuck\",rank=\"1\",worker=\"w1\"} ";
  EXPECT_DOUBLE_EQ(Sample(metrics, "zeroshard_rank_in_collective_seconds" + w0), age_ms / 1e3)
      << metrics;
  // w1 is alive and stopped before that gather (a reduction of its may be
  // in flight: not checked).
  EXPECT_EQ(RowOf(text, "w1").find("all_gather #30"), std::string::npos) << text;
  EXPECT_EQ(Sample(metrics, "zeroshard_rank_alive" + w1), 1) << metrics;
  EXPECT_EQ(Sample(metrics, "zeroshard_rank_left" + w1), 0) << metrics;
  // The next reports: the stuck rank's age grows with them.
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        nlohmann::json later = member(status_json(), 0);
        return !later.is_null() && later.contains("telemetry") &&
               std::stoll(later["telemetry"]
                              .value("in_progress", nlohmann::json::object())
                              .value("age_ms", std::string("0"))) >= age_ms + 2000;
      },
      absl::Seconds(30)));

  // w1 killed: dead, not left, in every view, with nothing in flight.
  cluster.worker(1)->Signal(SIGKILL);
  nlohmann::json dead;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        dead = member(status_json(), 1);
        return !dead.is_null() && !dead.value("alive", true);
      },
      absl::Seconds(60)))
      << cluster.server()->Log();
  EXPECT_FALSE(dead.value("left", false)) << dead.dump();
  EXPECT_FALSE(dead.contains("telemetry") && dead["telemetry"].contains("in_progress"));
  text = RunCommand(ctl + " status").second;
  top = RunCommand(ctl + " top --top_iterations=1 | cat").second;
  metrics = Get(MetricsPort(cluster), "/metrics", dir + "/metrics2.txt").second;
  EXPECT_NE(RowOf(text, "w1").find(" dead "), std::string::npos) << text;
  EXPECT_NE(RowOf(top, "w1").find("DEAD"), std::string::npos) << top;
  EXPECT_EQ(RowOf(top, "w1").find("LEFT"), std::string::npos) << top;
  EXPECT_EQ(Sample(metrics, "zeroshard_rank_alive" + w1), 0) << metrics;
  EXPECT_EQ(Sample(metrics, "zeroshard_rank_left" + w1), 0) << metrics;
  EXPECT_EQ(Sample(metrics, "zeroshard_rank_in_collective_seconds" + w1), -1) << metrics;
}

TEST_F(ObservabilityUiTest, HeadlessChromiumRendersTheJobItsRanksAndPlots) {
  ASSERT_TRUE(cluster_.ok());
  const std::string chromium = Tool("chromium");
  StartJob();
  const std::string url = absl::StrCat("http://127.0.0.1:", MetricsPort(cluster_), "/#live");
  auto [code, dom] = RenderedDom(chromium, dir_, url);
  ASSERT_EQ(code, 0) << dom;
  EXPECT_NE(dom.find("Job live"), std::string::npos) << dom;
  EXPECT_NE(dom.find("class=\"member\" data-rank=\"0\""), std::string::npos) << dom;
  EXPECT_NE(dom.find("class=\"member\" data-rank=\"1\""), std::string::npos) << dom;
  // The loss plot has both ranks' polylines and its data points.
  const size_t plot = dom.find("data-field=\"loss\"");
  ASSERT_NE(plot, std::string::npos) << dom;
  const size_t points = dom.find("data-points=\"", plot);
  ASSERT_NE(points, std::string::npos);
  EXPECT_GE(std::stoi(dom.substr(points + 13)), 2) << dom.substr(plot, 300);
  EXPECT_NE(dom.find("<polyline", plot), std::string::npos);
  EXPECT_NE(dom.find("verified"), std::string::npos) << "the checkpoints table";
}

// #43: a job whose steps are skipped (--on_nonfinite=skip; a learning rate
// of 1e39 makes every step after the first non-finite) shows the count on the
// dashboard, as shardctl status and /metrics do.
TEST_F(ObservabilityUiTest, HeadlessChromiumShowsSkippedSteps) {
  ASSERT_TRUE(cluster_.ok());
  const std::string chromium = Tool("chromium");
  cluster_.StartWorkers("skips", 1,
                        {"--model=mlp", "--layers=2", "--width=16", "--batch=4", "--steps=100000",
                         "--lr=1e39", "--on_nonfinite=skip", "--max_skipped_steps=1000000"});
  const std::string ctl = Shardctl(cluster_);
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        return RunCommand(ctl + " --job=skips status").second.find("skipped steps:") !=
               std::string::npos;
      },
      absl::Seconds(60)))
      << cluster_.server()->Log() << cluster_.WorkerLog(0);
  const std::string url = absl::StrCat("http://127.0.0.1:", MetricsPort(cluster_), "/#skips");
  auto [code, dom] = RenderedDom(chromium, dir_, url);
  ASSERT_EQ(code, 0) << dom;
  const size_t banner = dom.find("id=\"integrity\"");
  ASSERT_NE(banner, std::string::npos) << dom;
  EXPECT_NE(dom.find("Numerical integrity: skipped steps: ", banner), std::string::npos)
      << dom.substr(banner, 300);
}

// The dashboard's "Where the time went" (#45): the goodput headline, the
// stacked bars between the ledger's samples and its legend by cause, read
// from headless Chromium's DOM once the server has accounted a few seconds.
TEST_F(ObservabilityUiTest, HeadlessChromiumShowsWhereTheTimeWent) {
  ASSERT_TRUE(cluster_.ok());
  const std::string chromium = Tool("chromium");
  cluster_.StartWorkers("timed", 2,
                        {"--model=mlp", "--layers=2", "--width=16", "--batch=4", "--steps=100000",
                         "--test_step_delay_ms=20", "--peak_flops=1e10"});
  const std::string ctl = Shardctl(cluster_);
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto [code, out] = RunCommand(ctl + " --job=timed goodput --json");
        const nlohmann::json g = nlohmann::json::parse(out, nullptr, false);
        return code == 0 && g.is_object() && g.value("wall_seconds", 0.0) >= 3 &&
               g.value("productive_seconds", 0.0) > 0;
      },
      absl::Seconds(60)))
      << cluster_.server()->Log() << cluster_.WorkerLog(0);
  const std::string url = absl::StrCat("http://127.0.0.1:", MetricsPort(cluster_), "/#timed");
  auto [code, dom] = RenderedDom(chromium, dir_, url);
  ASSERT_EQ(code, 0) << dom;
  const size_t view = dom.find("id=\"goodput\"");
  ASSERT_NE(view, std::string::npos) << dom;
  EXPECT_NE(dom.find("Goodput ", view), std::string::npos) << dom.substr(view, 400);
  EXPECT_NE(dom.find("MFU ", view), std::string::npos) << dom.substr(view, 400);
  const size_t bars = dom.find("id=\"goodput-bars\"", view);
  ASSERT_NE(bars, std::string::npos) << dom.substr(view, 400);
  EXPECT_EQ(dom.find("data-bars=\"0\"", bars), std::string::npos) << dom.substr(bars, 300);
  EXPECT_NE(dom.find("<rect", bars), std::string::npos) << dom.substr(bars, 300);
  EXPECT_NE(dom.find("data-cause=\"productive\"", bars), std::string::npos)
      << dom.substr(bars, 600);
}

// The number of times `what` occurs in `text`.
int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The table element with id `id` in `dom` ("" when absent).
std::string TableOf(const std::string& dom, const std::string& id) {
  const size_t start = dom.find(absl::StrCat("<table id=\"", id, "\""));
  if (start == std::string::npos) return "";
  return dom.substr(start, dom.find("</table>", start) - start);
}

// A job of 2,048 simulated ranks, 8 to a host (issue #31: the dashboard of a
// 100,000-rank job): the page shows its counts, worst hosts, histograms and
// worst 32 ranks, not 2,048 rows, and finds any rank or host on request.
// The heartbeat timeout is long: the one rank that is not alive is the one
// that left, whatever the machine's load.
TEST(ObservabilityLargeJobTest, HeadlessChromiumSummarizesALargeJobAndLooksUpRanksAndHosts) {
  const std::string dir = testing::MakeTempDir("obsbig");
  LocalCluster cluster(dir,
                       {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/mport",
                        "--heartbeat_timeout_ms=600000"});
  ASSERT_TRUE(cluster.ok());
  const std::string chromium = Tool("chromium");
  constexpr int kWorld = 2048, kRanksPerHost = 8, kLeaving = 1234;
  auto stubs = testing::MakeStubs(cluster.address(), 4);
  testing::Joined joined =
      testing::JoinAll(stubs, "big", kWorld, /*member_table=*/false, kRanksPerHost);
  ASSERT_EQ(joined.failures, 0);
  int leaver = -1;
  for (int i = 0; i < kWorld; ++i) leaver = joined.responses[i].rank() == kLeaving ? i : leaver;
  ASSERT_GE(leaver, 0);
  const std::string leaver_host = absl::StrFormat("node%05d", leaver / kRanksPerHost);
  // Every other rank beats once a second with a step's telemetry; rank 1234
  // leaves, the worst rank (and its host the worst host).
  std::atomic<bool> stop{false};
  std::atomic<int64_t> replies{0};
  absl::BlockingCounter finished(kWorld - 1);
  std::vector<std::unique_ptr<testing::Beater>> beaters;
  for (int i = 0; i < kWorld; ++i) {
    if (i == leaver) continue;
    beaters.push_back(std::make_unique<testing::Beater>(
        stubs[i % stubs.size()].get(), testing::Credentials("big", joined.responses[i]), "step",
        &stop, &replies, &finished, absl::Seconds(1)));
  }
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::LeaveRequest request;
    *request.mutable_member() = testing::Credentials("big", joined.responses[leaver]);
    v1::LeaveResponse response;
    ASSERT_TRUE(stubs[0]->Leave(&context, request, &response).ok());
  }
  // Every member beat (the histograms count the ranks the server heard).
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        for (const auto& b : beaters) {
          if (b->replies() == 0) return false;
        }
        return true;
      },
      absl::Seconds(60)));
  auto render = [&](const std::string& hash) {
    auto [code, dom] = RenderedDom(
        chromium, dir, absl::StrCat("http://127.0.0.1:", MetricsPort(cluster), "/#", hash), 3000);
    EXPECT_EQ(code, 0) << dom;
    return dom;
  };

  // The job with rank 77 looked up: the summary, and the one rank.
  const std::string dom = render("big&rank=77");
  EXPECT_NE(dom.find("2048 ranks on 256 hosts: 2047 alive, 0 stragglers, 0 hung"),
            std::string::npos)
      << dom.substr(0, 4000);
  const std::string worst = TableOf(dom, "members");
  EXPECT_EQ(Count(worst, "class=\"member\""), 32) << "the worst 32 ranks, not 2,048 rows";
  EXPECT_NE(worst.find("class=\"member\" data-rank=\"1234\""), std::string::npos) << worst;
  EXPECT_EQ(worst.find("data-rank="), worst.find("data-rank=\"1234\""))
      << "the rank that left is listed first";
  const std::string hosts = TableOf(dom, "hosts");
  EXPECT_EQ(Count(hosts, "<tr class=\"host"), 16) << hosts;
  EXPECT_NE(hosts.find(absl::StrCat("data-host=\"", leaver_host, "\"")), std::string::npos)
      << hosts;
  EXPECT_NE(dom.find("data-name=\"heartbeat_age_seconds\" data-count=\"2047\""), std::string::npos);
  EXPECT_NE(dom.find("data-name=\"step_seconds\" data-count=\"2047\""), std::string::npos);
  const std::string rank = TableOf(dom, "lookup");
  EXPECT_EQ(Count(rank, "class=\"member\""), 1) << rank;
  EXPECT_NE(rank.find("data-rank=\"77\""), std::string::npos) << rank;
  EXPECT_EQ(Count(dom, "class=\"member\""), 32 + 1) << "no other rank rows on the page";

  // A host's ranks on request.
  const std::string host = TableOf(render("big&host=node00100"), "lookup");
  EXPECT_EQ(Count(host, "class=\"member\""), kRanksPerHost) << host;
  EXPECT_EQ(Count(host, "node00100/"), kRanksPerHost) << host;

  stop = true;
  finished.Wait();
}

TEST(ObservabilityTokenTest, ATokenProtectedServerRefusesMetricsWithoutIt) {
  const std::string dir = testing::MakeTempDir("obstoken");
  testing::WriteSecretFile(dir + "/token", "s3cret-token-0123456789\n");
  LocalCluster cluster(dir,
                       {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/mport",
                        "--auth_token_file=" + dir + "/token"});
  ASSERT_TRUE(cluster.ok());
  const int port = MetricsPort(cluster);
  EXPECT_EQ(Get(port, "/metrics", dir + "/a").first, 401);
  EXPECT_EQ(Get(port, "/metrics", dir + "/b", "Authorization: Bearer wrong").first, 401);
  EXPECT_EQ(Get(port, "/api/status", dir + "/c").first, 401);
  auto [http, text] =
      Get(port, "/metrics", dir + "/d", "Authorization: Bearer s3cret-token-0123456789");
  EXPECT_EQ(http, 200);
  EXPECT_NE(text.find("zeroshard_jobs{state=\"running\"} 0"), std::string::npos) << text;
  // The page itself holds no data.
  EXPECT_EQ(Get(port, "/", dir + "/e").first, 200);
  EXPECT_EQ(Get(port, "/nothing", dir + "/f").first, 404);
  // A bad query gets a 400 that names the value and what was expected.
  const std::string bearer = "Authorization: Bearer s3cret-token-0123456789";
  const std::pair<const char*, const char*> bad[] = {
      {"/api/status?rank=1,x", "/api/status?rank=1,x: expected ranks >= 0, comma-separated"},
      {"/api/history?job=j&rank=-2", "/api/history?rank=-2: expected ranks >= 0, comma-separated"},
      {"/api/history", "/api/history needs ?job=ID"},
      {"/api/status?worst_ranks=many", "/api/status?worst_ranks=many: expected a count >= 0"},
      {"/metrics?rank=3", "/metrics?rank=3: expected a rank >= 0 and ?job=ID"}};
  for (const auto& [path, why] : bad) {
    auto [code, body] = Get(port, path, dir + "/bad", bearer);
    EXPECT_EQ(code, 400) << path;
    EXPECT_NE(body.find(why), std::string::npos) << path << ": " << body;
  }
}

}  // namespace
}  // namespace zeroshard
