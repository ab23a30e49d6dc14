#include "common/fault_messages.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace zeroshard {

std::string ServerSilenceLine(const ServerSilence& s) {
  const std::string silent = absl::FormatDuration(absl::Trunc(s.silent, absl::Seconds(1)));
  std::string line = absl::StrCat(
      "job '", s.job, "' rank ", s.rank, ": the server at ", s.server,
      " has not answered a heartbeat for ", silent,
      " (this host cannot reach it: cut off, or a partition between it and the server); ");
  if (s.steps_since > 0) {
    absl::StrAppend(&line, "training goes on here (", s.steps_since,
                    s.steps_since == 1 ? " step" : " steps",
                    " since its last answer), and what needs the server - checkpoint commits, "
                    "recovery, leaving - waits for it");
  } else {
    absl::StrAppend(&line,
                    "no step has completed here since: this rank is stopped (in a "
                    "collective whose peers are cut off too, or in work that needs the "
                    "server)");
  }
  return line;
}

std::string RecoveredLine(int rank, int64_t step, double ms, RecoveryClock clock) {
  const char* since =
      clock == RecoveryClock::kVerdict
          ? "the server's verdict on the failure (the same instant on every rank)"
      : clock == RecoveryClock::kSeen
          ? "this rank saw the failure (no verdict time from the server: its own give-up)"
          : "this replacement joined";
  return absl::StrFormat(
      "shard_worker rank %d: recovery: training again at step %d, %.0f ms after %s", rank, step, ms,
      since);
}

std::string LeaderSeenLine(const std::string& prefix, const std::string& leader,
                           const std::string& before) {
  if (leader.empty()) {
    return absl::StrCat("no server leads ", prefix, " now",
                        before.empty() ? "" : absl::StrCat(" (before: ", before, ")"),
                        "; an election is under way");
  }
  return absl::StrCat("following ", leader, ", the leader of ", prefix, " now",
                      before.empty() ? "" : absl::StrCat(" (before: ", before, ")"));
}

}  // namespace zeroshard
