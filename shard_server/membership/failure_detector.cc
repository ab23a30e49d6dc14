#include "shard_server/membership/failure_detector.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// Rule 0's evidence: the stream of the member's latest beat closed soon after
// that beat, and the member has not re-opened it within the reconnect wait.
bool ClosedByItsEnd(const MemberSignals& m, absl::Time now,
                    const FailureDetectorOptions& options) {
  const absl::Duration window = std::min(options.heartbeat_interval * 1.5, kAbruptCloseCap);
  const absl::Duration reopen = std::max(kClosedStreamReopenWait, options.heartbeat_interval * 2);
  return m.stream_closed > m.last_heartbeat && m.stream_closed - m.last_heartbeat <= window &&
         now - m.stream_closed > reopen;
}

}  // namespace

absl::Duration ServerLagAllowance(absl::Duration server_lag, const FailureDetectorOptions& options) {
  if (server_lag <= options.heartbeat_interval / 2 || options.isolation_grace <= absl::ZeroDuration()) {
    return absl::ZeroDuration();
  }
  return std::min(server_lag, options.isolation_grace);
}

absl::Duration WorstLagInForce(std::deque<std::pair<absl::Time, absl::Duration>>* readings,
                               absl::Time now, const FailureDetectorOptions& options) {
  const absl::Duration base = options.heartbeat_timeout + options.heartbeat_interval;
  const absl::Duration longest = base + std::max(options.isolation_grace, absl::ZeroDuration());
  while (!readings->empty() && now - readings->front().first > longest) readings->pop_front();
  absl::Duration worst = absl::ZeroDuration();
  for (const auto& [at, lag] : *readings) {
    if (now - at <= base + lag) worst = std::max(worst, lag);
  }
  return worst;
}

std::vector<MemberVerdict> JudgeMembers(const std::vector<MemberSignals>& members,
                                        const JobSignals& job, absl::Time now,
                                        const FailureDetectorOptions& options) {
  // The last beat the server heard from anyone in the job (rule 4).
  absl::Time last_heard = job.last_heard;
  for (const MemberSignals& m : members) last_heard = std::max(last_heard, m.last_heartbeat);
  const bool nobody_beats = now - last_heard > options.heartbeat_timeout;
  // The job falling silent as a whole: nobody beat for 1.5 intervals (a
  // member that beats is never that late: its next beat follows the answer
  // to its last by one interval). Rule 3's evidence dates from the last beat
  // that showed the data plane advancing, which under steps slower than an
  // interval comes before the last beat heard; without this, a server cut off
  // from everyone declared the earliest-silent members dead in that gap
  // (between their timeout by rule 3's clock and everyone's by rule 4's),
  // when every member had in fact stopped reaching it.
  const bool job_falls_silent = now - last_heard > options.heartbeat_interval * 1.5;
  const bool peers_see_them = now - job.data_plane_advanced <= options.heartbeat_timeout;
  const absl::Duration lag_allowance = ServerLagAllowance(job.server_lag, options);

  std::vector<MemberVerdict> verdicts;
  verdicts.reserve(members.size());
  for (const MemberSignals& m : members) {
    const absl::Duration silent = now - m.last_heartbeat;
    if (job.formed && ClosedByItsEnd(m, now, options)) {
      verdicts.push_back(
          {Verdict::kDead,
           absl::StrCat("heartbeat stream closed by its end ",
                        absl::ToInt64Milliseconds(m.stream_closed - m.last_heartbeat),
                        " ms after its last beat and not re-opened for ",
                        absl::ToInt64Milliseconds(now - m.stream_closed),
                        " ms: the process is gone")});
      continue;
    }
    if (job.peer_failure_reported) {
      if (m.stream_closed > m.last_heartbeat && now - m.stream_closed > kReopenGrace) {
        verdicts.push_back(
            {Verdict::kDead, "heartbeat stream closed after a peer's collective failed"});
        continue;
      }
      if (silent > options.heartbeat_interval * 1.5) {
        verdicts.push_back(
            {Verdict::kDead, "silent 1.5 heartbeat intervals after a peer's collective failed"});
        continue;
      }
    }
    if (silent <= options.heartbeat_timeout) {
      verdicts.push_back({Verdict::kAlive, ""});
    } else if (peers_see_them && !job.peer_failure_reported) {
      verdicts.push_back({Verdict::kSeenByPeers,
                          absl::StrCat("silent ", absl::ToInt64Milliseconds(silent),
                                       " ms, but its peers' collectives advanced ",
                                       absl::ToInt64Milliseconds(now - job.data_plane_advanced),
                                       " ms ago: it lost the server, not its peers")});
    } else if (lag_allowance > absl::ZeroDuration() &&
               silent <= options.heartbeat_timeout + lag_allowance) {
      verdicts.push_back(
          {Verdict::kServerBehind,
           absl::StrCat("silent ", absl::ToInt64Milliseconds(silent),
                        " ms while the server's call queues are ",
                        absl::ToInt64Milliseconds(job.server_lag),
                        " ms behind: its beats may be waiting in them; waiting up to "
                        "--isolation_grace=",
                        absl::FormatDuration(options.isolation_grace))});
    } else if ((nobody_beats || job_falls_silent) &&
               options.isolation_grace > absl::ZeroDuration() &&
               now - last_heard <= options.heartbeat_timeout + options.isolation_grace) {
      verdicts.push_back(
          {Verdict::kIsolationSuspected,
           absl::StrCat("every member of the job has been silent for ",
                        absl::ToInt64Milliseconds(now - last_heard),
                        " ms: the server's own network is the likelier cause; waiting up to "
                        "--isolation_grace=",
                        absl::FormatDuration(options.isolation_grace))});
    } else {
      verdicts.push_back(
          {Verdict::kDead, nobody_beats && options.isolation_grace > absl::ZeroDuration()
                               ? absl::StrCat("heartbeat timeout (every member silent past "
                                              "--isolation_grace=",
                                              absl::FormatDuration(options.isolation_grace), ")")
                               : "heartbeat timeout"});
    }
  }
  return verdicts;
}

}  // namespace zeroshard
