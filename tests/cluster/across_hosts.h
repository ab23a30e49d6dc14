// The fixture of the tests across emulated hosts: three hosts, the shard
// server alone on host 0 and W = 4 workers as 2 hosts x 2 ranks (w0, w1 on
// host 1; w2, w3 on host 2), an MLP at ZeRO stage 3 on synthetic data, and
// what the tests compare: final parameters against an uninterrupted run's,
// exit codes, the server's events.
#ifndef ZEROSHARD_TESTS_CLUSTER_ACROSS_HOSTS_H_
#define ZEROSHARD_TESTS_CLUSTER_ACROSS_HOSTS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/cluster.h"
#include "tests/testing/params.h"

namespace zeroshard::testing {

class AcrossHostsTest : public ::testing::Test {
 protected:
  static constexpr int kServerHost = 0;
  static constexpr int kLayers = 3;
  static constexpr int kWidth = 24;

  // Makes the hosts and starts the server with `server_flags` (heartbeats
  // every 300 ms, dead after 1.5 s, unless overridden). False (the test
  // failed, saying why) when namespaces cannot be made.
  bool StartCluster(const std::vector<std::string>& server_flags = {});
  // The workers' flags: the model and recovery settings, then `extra`.
  std::vector<std::string> Flags(const std::vector<std::string>& extra) const;
  // `steps` steps that recover: snapshots every 10 steps, collectives time
  // out after 8 s, 100 ms a step (faults land mid-run); then `extra`.
  static std::vector<std::string> Recoverable(int steps, const std::vector<std::string>& extra);
  // An uninterrupted run of `steps` (job "reference"): its final parameters.
  Params Reference(int steps);
  // The final checkpoint of `job` (--checkpoint_at_end).
  Params Final(const std::string& job, int steps) const;
  // Rank 0 printed "step N/"; the latest such N (0: none yet).
  bool WaitForStep(int step, absl::Duration timeout = absl::Seconds(60));
  int LatestStep() const;
  // The first `event` of each worker in the server's log at or after
  // `since`, by worker id.
  std::map<std::string, absl::Time> ServerEvents(const std::string& event, absl::Time since) const;
  // Every worker of the last start exited 0 (logs printed otherwise).
  bool AllExitZero(absl::Duration timeout);
  void ExpectEqual(const Params& got, const Params& want, const std::string& what) const;

  std::unique_ptr<EmulatedHosts> hosts_;
  std::unique_ptr<LocalCluster> cluster_;
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_CLUSTER_ACROSS_HOSTS_H_
