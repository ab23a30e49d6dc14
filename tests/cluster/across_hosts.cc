#include "tests/cluster/across_hosts.h"

#include <cstdio>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/model_zoo.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {

bool AcrossHostsTest::StartCluster(const std::vector<std::string>& server_flags) {
  absl::StatusOr<std::unique_ptr<EmulatedHosts>> hosts = EmulatedHosts::Create(3);
  if (!hosts.ok()) {
    // Never a silent skip: CI runs as root and must run these tests.
    ADD_FAILURE() << hosts.status();
    return false;
  }
  hosts_ = *std::move(hosts);
  std::vector<std::string> flags = {"--heartbeat_interval_ms=300", "--heartbeat_timeout_ms=1500"};
  flags.insert(flags.end(), server_flags.begin(), server_flags.end());
  cluster_ = std::make_unique<LocalCluster>(MakeTempDir("across-hosts"), flags,
                                            HostLayout{hosts_.get(), kServerHost, {1, 1, 2, 2}});
  return cluster_->ok();
}

std::vector<std::string> AcrossHostsTest::Flags(const std::vector<std::string>& extra) const {
  std::vector<std::string> flags = {"--model=mlp",
                                    absl::StrCat("--layers=", kLayers),
                                    absl::StrCat("--width=", kWidth),
                                    "--activation=relu",
                                    "--lr=0.01",
                                    "--seed=9",
                                    "--stage=3",
                                    "--batch=4",
                                    "--collective_timeout=20s",
                                    "--checkpoint_at_end",
                                    "--rejoin_timeout=60s",
                                    "--join_timeout_s=60"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

std::vector<std::string> AcrossHostsTest::Recoverable(int steps,
                                                      const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {absl::StrCat("--steps=", steps), "--snapshot_every=10",
                                    "--collective_timeout=8s", "--test_step_delay_ms=100"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

Params AcrossHostsTest::Reference(int steps) {
  EXPECT_TRUE(cluster_->Run("reference", 4, Flags({absl::StrCat("--steps=", steps)})));
  return Final("reference", steps);
}

Params AcrossHostsTest::Final(const std::string& job, int steps) const {
  return LoadCheckpointParams(cluster_->checkpoint_root(), job, steps,
                              *MlpSpec(kLayers, kWidth, "relu"));
}

bool AcrossHostsTest::WaitForStep(int step, absl::Duration timeout) {
  return WaitFor([&] { return LatestStep() >= step; }, timeout);
}

int AcrossHostsTest::LatestStep() const {
  const std::string log = cluster_->WorkerLog(0);
  const size_t at = log.rfind("step ");
  if (at == std::string::npos) return 0;
  int step = 0;
  const size_t slash = log.find('/', at);
  if (slash == std::string::npos || !absl::SimpleAtoi(log.substr(at + 5, slash - at - 5), &step)) {
    return 0;
  }
  return step;
}

std::map<std::string, absl::Time> AcrossHostsTest::ServerEvents(const std::string& event,
                                                                absl::Time since) const {
  std::map<std::string, absl::Time> first;
  std::istringstream lines(cluster_->server()->Log());
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find(" event=" + event + " ") == std::string::npos) continue;
    absl::Time at;
    std::string worker;
    for (absl::string_view field : absl::StrSplit(line, ' ')) {
      if (absl::ConsumePrefix(&field, "ts=")) {
        std::string error;
        absl::ParseTime("%Y-%m-%dT%H:%M:%E3SZ", field, absl::UTCTimeZone(), &at, &error);
      } else if (absl::ConsumePrefix(&field, "worker=")) {
        worker = std::string(field);
      }
    }
    if (at >= since && first.count(worker) == 0) first[worker] = at;
  }
  return first;
}

bool AcrossHostsTest::AllExitZero(absl::Duration timeout) {
  std::vector<int> codes = cluster_->WaitWorkers(timeout);
  bool ok = true;
  for (size_t r = 0; r < codes.size(); ++r) {
    if (codes[r] == 0) continue;
    ok = false;
    std::fprintf(stderr, "worker %zu exited %d:\n%s\n", r, codes[r],
                 cluster_->WorkerLog(r).c_str());
  }
  if (!ok) std::fprintf(stderr, "server:\n%s\n", cluster_->server()->Log().c_str());
  return ok;
}

void AcrossHostsTest::ExpectEqual(const Params& got, const Params& want,
                                  const std::string& what) const {
  ASSERT_FALSE(got.empty()) << what << ": no final checkpoint";
  EXPECT_TRUE(got == want) << what << ": not bitwise equal to the uninterrupted run (max relative "
                           << "difference " << MaxRelativeDifference(got, want) << ")";
}

}  // namespace zeroshard::testing
