// scale_bench's two halves (scale_bench.cc): the parent, which starts the
// server (or etcd and three servers), the simulating processes and the
// faults, and measures; and a simulating child (scale_bench_child.cc), whose
// simulated node agents join and beat. They share the flags (defined in
// scale_bench.cc), the job's names and the child's status reports.
#ifndef ZEROSHARD_TESTS_BENCH_SCALE_BENCH_H_
#define ZEROSHARD_TESTS_BENCH_SCALE_BENCH_H_

#include <sched.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

ABSL_DECLARE_FLAG(int, hosts);
ABSL_DECLARE_FLAG(int, ranks_per_host);
ABSL_DECLARE_FLAG(int, heartbeat_timeout_ms);
ABSL_DECLARE_FLAG(int, heartbeat_interval_ms);
ABSL_DECLARE_FLAG(int, connections_per_process);
ABSL_DECLARE_FLAG(std::string, telemetry);
ABSL_DECLARE_FLAG(bool, same_member);
ABSL_DECLARE_FLAG(int, child);
ABSL_DECLARE_FLAG(std::string, dir);
ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(int, first_host);
ABSL_DECLARE_FLAG(int, host_count);
ABSL_DECLARE_FLAG(std::string, simulator_cpus);
ABSL_DECLARE_FLAG(int, simulator_nice);

namespace zeroshard {
namespace scale_bench {

inline constexpr char kJob[] = "scale";

// The heartbeat interval the server advertises and the agents keep.
absl::Duration Interval();
std::string WorkerId(int host, int slot);
int64_t NowUs();

// What a child reports per join round (round 0: the first join; each
// generation change starts the next).
struct Round {
  int joined = 0;
  int64_t joined_last_us = 0;
  int aborted = 0;  // hosts told of the generation change that ended the round
  int64_t aborted_last_us = 0;
  int join_errors = 0;
  std::string first_join_error;
};

// A taskset-style list ("0", "0-3,8") as a CPU set; an error names the part.
absl::StatusOr<cpu_set_t> ParseCpuList(const std::string& list);
// Puts every thread of `pid` on `list` (threads made later inherit it from
// the thread that makes them). Empty list: nothing to do.
absl::Status PinProcess(pid_t pid, const std::string& list);

// A simulating process (--child): its hosts join and beat until the parent
// stops it; reports go to --dir's status file.
int RunChild();

}  // namespace scale_bench
}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_BENCH_SCALE_BENCH_H_
