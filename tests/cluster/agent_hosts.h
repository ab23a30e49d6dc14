// A job on emulated hosts through real node agents (issue #31): one
// shard_agent on each worker host, every worker beating and joining through
// its host's agent (--agent=unix:PATH). agent_test and agent_recovery_test
// run the direct-stream recovery scenarios this way.
#ifndef ZEROSHARD_TESTS_CLUSTER_AGENT_HOSTS_H_
#define ZEROSHARD_TESTS_CLUSTER_AGENT_HOSTS_H_

#include <stdlib.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {

class AgentHostsTest : public AcrossHostsTest {
 protected:
  // Under /tmp: a unix socket's path has at most 107 characters, and test
  // directories under Bazel's output base are longer.
  std::string Socket(int host) {
    if (socket_dir_.empty()) {
      char dir[] = "/tmp/zs-agents-XXXXXX";
      EXPECT_NE(mkdtemp(dir), nullptr);
      socket_dir_ = dir;
    }
    return absl::StrCat(socket_dir_, "/agent-", host, ".sock");
  }

  // One shard_agent on each worker host; false when one did not come up.
  bool StartAgents() {
    for (int host : {1, 2}) {
      agents_.push_back(hosts_->Start(
          host, RunfilePath("agent/shard_agent"),
          {"--server=" + cluster_->address(), "--listen=unix:" + Socket(host)},
          absl::StrCat(cluster_->dir(), "/agent-", host, ".log")));
      if (!WaitFor([&] { return FileExists(Socket(host)) || !agents_.back()->running(); },
                   absl::Seconds(20)) ||
          !agents_.back()->running()) {
        ADD_FAILURE() << "shard_agent on host " << host << " did not start:\n"
                      << agents_.back()->Log();
        return false;
      }
    }
    return true;
  }

  // --agent for each worker: its host's agent (w0, w1 on host 1; w2, w3 on 2).
  std::map<int, std::vector<std::string>> AgentFlags() {
    std::map<int, std::vector<std::string>> flags;
    for (int r = 0; r < 4; ++r) flags[r] = {"--agent=unix:" + Socket(r < 2 ? 1 : 2)};
    return flags;
  }

  // Both agents held a stream to the server and no worker went around its
  // agent (a worker with no agent answering beats straight to the server).
  void ExpectEveryRankWentThroughItsAgent() {
    const std::string server_log = cluster_->server()->Log();
    for (const char* host : {"host1", "host2"}) {
      EXPECT_NE(server_log.find(absl::StrCat("event=agent_stream_opened node=\"", host, " ")),
                std::string::npos)
          << server_log;
    }
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(cluster_->WorkerLog(r).find("no node agent answers"), std::string::npos)
          << "rank " << r << " went around its agent:\n"
          << cluster_->WorkerLog(r);
    }
  }

  static bool FileExists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

  std::string socket_dir_;
  std::vector<std::unique_ptr<ChildProcess>> agents_;
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_CLUSTER_AGENT_HOSTS_H_
