// shardctl goodput and the goodput series of /metrics against a real
// shard_server: a one-rank job joined and beaten by a Client whose beats
// carry a TimeLedger, read back as a table, as JSON, and from /metrics, then
// again after the server was killed and restarted (the ledger is kept).
#include <cmath>
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

// The reported ledger: known numbers, so that what the server shows of them
// is checked exactly (the JSON carries doubles with 17 digits).
constexpr double kStartup = 0.5;
constexpr double kProductive = 2.0;
constexpr double kModelFlops = 1e12;
constexpr double kBudget = 4e12;

// Error model of the sums: ~16 doubles, each under 1e3 s, added once by the
// server and once here: under 32 x 1e3 x 2^-52 ~ 7e-12 s. 1e-9 s.
constexpr double kEps = 1e-9;

class ShardctlGoodputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("shardctl_goodput");
    cluster_ = std::make_unique<LocalCluster>(
        dir_, std::vector<std::string>{"--metrics_listen=127.0.0.1:0",
                                       "--metrics_port_file=" + dir_ + "/mport",
                                       "--heartbeat_interval_ms=100"});
    ASSERT_TRUE(cluster_->ok());
  }
  std::pair<int, std::string> Shardctl(const std::string& args) {
    return testing::RunCommand(absl::StrCat(testing::RunfilePath("client/shardctl"),
                                            " --server=", cluster_->address(), " ", args, " 2>&1"));
  }
  nlohmann::json GoodputJson() {
    auto [code, out] = Shardctl("goodput --job=gp --json");
    EXPECT_EQ(code, 0) << out;
    return nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  }
  std::string Metrics() {
    const std::string port =
        std::string(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(dir_ + "/mport")));
    return testing::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", port, "/metrics")).second;
  }
  // The value of the /metrics line that starts with `series` ("" if none).
  static std::string Series(const std::string& metrics, const std::string& series) {
    for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
      if (absl::StartsWith(line, series + " ")) return std::string(line.substr(series.size() + 1));
    }
    return "";
  }

  std::string dir_;
  std::unique_ptr<LocalCluster> cluster_;
};

double Badput(const nlohmann::json& g, const std::string& cause) {
  return g["badput_seconds"].contains(cause) ? g["badput_seconds"][cause].get<double>() : -1;
}

double Sum(const nlohmann::json& g) {
  double sum = g["productive_seconds"].get<double>();
  for (const auto& [cause, seconds] : g["badput_seconds"].items()) sum += seconds.get<double>();
  return sum;
}

TEST_F(ShardctlGoodputTest, TheLedgerShowsInShardctlAndMetricsAndOutlivesARestart) {
  ClientOptions options;
  options.server = cluster_->address();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time before_join = absl::Now();
  ASSERT_TRUE((*client)->Join("gp", 1, "w0", "127.0.0.1", absl::Seconds(30)).ok());
  const absl::Time joined = absl::Now();
  (*client)->SetTelemetrySource([](v1::RankTelemetry* t) {
    v1::TimeLedger* l = t->mutable_time();
    l->set_startup(kStartup);
    l->set_productive(kProductive);
    l->set_model_flops(kModelFlops);
    l->set_peak_flop_budget(kBudget);
    l->set_peak_flops(1e12);
    l->set_flops_per_item(6e6);
  });
  (*client)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});

  // The beats' ledger reaches the server, and the running time goes past it.
  nlohmann::json g;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::Time asked = absl::Now();
  while (absl::Now() < deadline) {
    asked = absl::Now();
    g = GoodputJson();
    if (g.is_object() && g["productive_seconds"] == kProductive &&
        g["wall_seconds"].get<double>() > kStartup + kProductive + 0.5) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(g.is_object() && g["productive_seconds"] == kProductive) << g.dump(1);
  const double wall = g["wall_seconds"].get<double>();
  // From the first join (between before_join and joined) to the ask.
  EXPECT_GE(wall, absl::ToDoubleSeconds(asked - joined));
  EXPECT_LE(wall, absl::ToDoubleSeconds(absl::Now() - before_join));
  EXPECT_NEAR(Sum(g), wall, kEps);
  EXPECT_EQ(Badput(g, "startup"), kStartup);
  EXPECT_GE(Badput(g, "rendezvous"), 0);
  EXPECT_NEAR(Badput(g, "in_flight"), wall - Badput(g, "rendezvous") - kStartup - kProductive,
              kEps);
  EXPECT_NEAR(g["goodput"].get<double>(), kProductive / wall, kEps);
  EXPECT_NEAR(g["mfu"].get<double>(), kModelFlops / kBudget, kEps);

  auto [code, table] = Shardctl("goodput --job=gp");
  EXPECT_EQ(code, 0) << table;
  EXPECT_NE(table.find("productive  2.0"), std::string::npos) << table;
  EXPECT_NE(table.find("wall clock"), std::string::npos) << table;
  EXPECT_NE(table.find("MFU 25.0 %"), std::string::npos) << table;
  auto [missing_code, missing] = Shardctl("goodput --job=nope");
  EXPECT_EQ(missing_code, 1);
  EXPECT_NE(missing.find("no job 'nope'"), std::string::npos) << missing;

  const std::string metrics = Metrics();
  EXPECT_EQ(Series(metrics, "zeroshard_job_seconds_total{job=\"gp\",cause=\"productive\"}"), "2")
      << metrics;
  EXPECT_EQ(Series(metrics, "zeroshard_job_seconds_total{job=\"gp\",cause=\"startup\"}"), "0.5");
  EXPECT_NE(Series(metrics, "zeroshard_job_seconds_total{job=\"gp\",cause=\"rendezvous\"}"), "");
  EXPECT_EQ(Series(metrics, "zeroshard_job_mfu_ratio{job=\"gp\"}"), "0.25");
  const std::string ratio = Series(metrics, "zeroshard_job_goodput_ratio{job=\"gp\"}");
  ASSERT_FALSE(ratio.empty()) << metrics;
  EXPECT_GT(std::stod(ratio), 0);
  EXPECT_LT(std::stod(ratio), 1);

  // The job finishes (the ledger is saved: a phase change) and its clock
  // stops: a server killed and restarted shows the same ledger.
  (*client)->StopHeartbeats();
  ASSERT_TRUE((*client)->Leave().ok());
  const nlohmann::json finished = GoodputJson();
  ASSERT_TRUE(finished.is_object());
  cluster_->RestartServer(/*SIGKILL=*/9);
  ASSERT_TRUE(cluster_->ok());
  nlohmann::json restored;
  const absl::Time back = absl::Now() + absl::Seconds(30);
  while (absl::Now() < back && !restored.is_object()) {
    auto [c, out] = Shardctl("goodput --job=gp --json");
    if (c == 0) restored = nlohmann::json::parse(out, nullptr, false);
    if (!restored.is_object()) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(restored.is_object());
  EXPECT_EQ(restored["wall_seconds"], finished["wall_seconds"]);
  EXPECT_EQ(restored["productive_seconds"], kProductive);
  EXPECT_EQ(restored["badput_seconds"], finished["badput_seconds"]);
  EXPECT_GT(Badput(restored, "other"), 0);  // running after the last report, to the leave
  EXPECT_EQ(Badput(restored, "in_flight"), 0);
}

}  // namespace
}  // namespace zeroshard
