// Live diagnosis from the ranks' heartbeat telemetry: the rank that has not
// entered a collective its peers wait in (a hang, named long before the
// collective timeout), ranks that disagree on the collective schedule, and
// ranks that reach each step's first collective late (stragglers).
//
// Hang. Every rank issues each stream's collectives (all-gathers; reductions)
// in the same order and reports how many it entered and the collective it
// has been in longest (RankTelemetry). When ranks have waited in collective
// #N of a stream for at least `hang_report` and some ranks have entered
// fewer than N of that stream and not advanced for `hang_report`, those
// ranks are named:
//   rank 2 (host/2) has not entered all_gather #5123 (unit h.7) for 12.0 s;
//   ranks 0,1,3 are waiting in it
// When a rank that has not entered it is itself waiting in a collective the
// waiters have not entered (or ranks are in different collectives at the
// same number), the ranks disagree on the schedule, and that is said instead.
//
// Straggler. A rank whose median lag at the step's first collective over the
// last 20 steps (measured by the ranks, RankTelemetry) exceeds
// max(straggler_fraction × its step time, straggler_floor).
//
// Times are the server's clock against the ranks' start times (one clock
// on one host; NTP-level skew between hosts is far below hang_report).
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_TELEMETRY_ANALYZER_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_TELEMETRY_ANALYZER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/base/clock.h"
#include "shard_server/base/event_log.h"

namespace zeroshard {

struct TelemetryOptions {
  absl::Duration hang_report = absl::Seconds(10);  // --hang_report_ms
  double straggler_fraction = 0.2;
  absl::Duration straggler_floor = absl::Milliseconds(50);
};

// "0-3,5,7,8": sorted ranks with runs of three or more folded, at most
// `max_runs` runs ("... and N more").
std::string FormatRanks(std::vector<int> ranks, int max_runs = 8);

// Thread-safe. Analyze is called by the server's timer; Annotate by the
// status, metrics and dashboard paths.
class TelemetryAnalyzer {
 public:
  // `log` may be null. Not owned.
  TelemetryAnalyzer(Clock* clock, EventLog* log, TelemetryOptions options);

  // Updates the diagnoses from every job's members (Membership::Status of
  // every job). A diagnosis that appears or clears is logged.
  void Analyze(const v1::GetStatusResponse& status);

  // Adds the current diagnoses and the members' straggler/hung flags to the
  // jobs in `status`.
  void Annotate(v1::GetStatusResponse* status) const;

  // Pure: the diagnoses of one job's members at `now` given when each
  // rank's progress last changed (indexed by rank; beyond its end: now).
  // For tests.
  static std::vector<v1::Diagnosis> Diagnose(const v1::JobStatus& job,
                                             const std::vector<absl::Time>& progressed_at,
                                             absl::Time now, const TelemetryOptions& options);

 private:
  struct RankProgress {
    int64_t gathers = -1;
    int64_t reductions = -1;
    absl::Time since;
  };
  struct JobState {
    int64_t generation = 0;
    std::vector<RankProgress> ranks;  // by rank
    std::vector<v1::Diagnosis> diagnoses;
  };

  Clock* const clock_;
  EventLog* const log_;
  const TelemetryOptions options_;
  // "diagnosis_cleared" for each of `diagnoses`, which ended because `why`.
  void LogCleared(const std::string& job, const std::vector<v1::Diagnosis>& diagnoses,
                  const std::string& why);

  mutable absl::Mutex mu_;
  std::map<std::string, JobState> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_TELEMETRY_ANALYZER_H_
