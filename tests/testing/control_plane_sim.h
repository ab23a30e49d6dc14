// What the control-plane benchmarks share: a shard_server process to measure,
// its CPU time and memory from /proc, and the heartbeat a training rank sends.
#ifndef ZEROSHARD_TESTS_TESTING_CONTROL_PLANE_SIM_H_
#define ZEROSHARD_TESTS_TESTING_CONTROL_PLANE_SIM_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "proto/zeroshard.pb.h"
#include "tests/testing/process.h"
#include "tests/testing/simulated_members.h"

namespace zeroshard::testing {

struct ServerProcess {
  RemovedAtExit dir_owner;  // declared first: goes after the process is killed
  std::unique_ptr<ChildProcess> process;
  std::string address;  // 127.0.0.1:PORT
  std::string dir;      // its log (server.log) and port file; removed with this
};

// Starts `binary` on 127.0.0.1 (a free port) with `extra` flags; exits the
// benchmark with the server's log when it does not come up within 20 s.
ServerProcess StartServerProcess(const std::string& binary, const std::vector<std::string>& extra);

// The process's resident memory in bytes (VmRSS); -1 if unreadable.
int64_t RssBytes(pid_t pid);
// CPU seconds (user + system) the process has used; -1 if unreadable.
double CpuSeconds(pid_t pid);

// FillTelemetry (a training rank's beat) is tests/testing/simulated_members.h's.

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_CONTROL_PLANE_SIM_H_
