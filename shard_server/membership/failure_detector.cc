#include "shard_server/membership/failure_detector.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// Rule 0's evidence: the stream of the member's latest beat closed soon after
// that beat, and the member has not re-opened it within the reconnect wait.
bool ClosedByItsEnd(const MemberSignals& m, absl::Time now, const FailureDetectorOptions& options) {
  const absl::Duration window = std::min(options.heartbeat_interval * 1.5, kAbruptCloseCap);
  const absl::Duration reopen = std::max(kClosedStreamReopenWait, options.heartbeat_interval * 2);
  return m.stream_closed > m.last_heartbeat && m.stream_closed - m.last_heartbeat <= window &&
         now - m.stream_closed > reopen;
}

// What the job as a whole shows at `now` (rules 3 and 4), for JudgeSilence.
struct JobEvidence {
  absl::Time last_heard;  // the last beat heard from anyone in the job
  bool nobody_beats = false;
  bool job_falls_silent = false;
  bool peers_see_them = false;
};

// Rules 0 and 1: the member is dead whatever its silence (its stream closed
// by its end; a peer's collective failed and it is silent or its stream
// closed). nullopt: JudgeSilence decides.
std::optional<MemberVerdict> DeadAtOnce(const MemberSignals& m, const JobSignals& job,
                                        absl::Time now, const FailureDetectorOptions& options) {
  const absl::Duration silent = now - m.last_heartbeat;
  if (job.formed && ClosedByItsEnd(m, now, options)) {
    return MemberVerdict{
        Verdict::kDead,
        absl::StrCat("heartbeat stream closed by its end ",
                     absl::ToInt64Milliseconds(m.stream_closed - m.last_heartbeat),
                     " ms after its last beat and not re-opened for ",
                     absl::ToInt64Milliseconds(now - m.stream_closed), " ms: the process is gone")};
  }
  if (job.peer_failure_reported) {
    if (m.stream_closed > m.last_heartbeat && now - m.stream_closed > kReopenGrace) {
      return MemberVerdict{Verdict::kDead,
                           "heartbeat stream closed after a peer's collective failed"};
    }
    if (silent > options.heartbeat_interval * 1.5) {
      return MemberVerdict{Verdict::kDead,
                           "silent 1.5 heartbeat intervals after a peer's collective failed"};
    }
  }
  return std::nullopt;
}

// Rules 2 to 5 on a member that DeadAtOnce did not decide: alive within the
// timeout, else seen by its peers, held for the server's lag, held for the
// server's suspected isolation, or dead.
MemberVerdict JudgeSilence(const MemberSignals& m, const JobSignals& job,
                           const JobEvidence& evidence, absl::Time now,
                           const FailureDetectorOptions& options) {
  const absl::Duration silent = now - m.last_heartbeat;
  if (silent <= options.heartbeat_timeout) return {Verdict::kAlive, ""};
  if (evidence.peers_see_them && !job.peer_failure_reported) {
    return {Verdict::kSeenByPeers,
            absl::StrCat("silent ", absl::ToInt64Milliseconds(silent),
                         " ms, but its peers' collectives advanced ",
                         absl::ToInt64Milliseconds(now - job.data_plane_advanced),
                         " ms ago: it lost the server, not its peers")};
  }
  if (const absl::Duration lag_allowance = ServerLagAllowance(m.server_lag, options);
      lag_allowance > absl::ZeroDuration() && silent <= options.heartbeat_timeout + lag_allowance) {
    return {Verdict::kServerBehind,
            absl::StrCat("silent ", absl::ToInt64Milliseconds(silent),
                         " ms, and the server's call queues were up to ",
                         absl::ToInt64Milliseconds(m.server_lag),
                         " ms behind since its last beat: its answer or next beat may have "
                         "waited in them; waiting up to --isolation_grace=",
                         absl::FormatDuration(options.isolation_grace))};
  }
  if ((evidence.nobody_beats || evidence.job_falls_silent) &&
      options.isolation_grace > absl::ZeroDuration() &&
      now - evidence.last_heard <= options.heartbeat_timeout + options.isolation_grace) {
    return {Verdict::kIsolationSuspected,
            absl::StrCat("every member of the job has been silent for ",
                         absl::ToInt64Milliseconds(now - evidence.last_heard),
                         " ms: the server's own network is the likelier cause; waiting up to "
                         "--isolation_grace=",
                         absl::FormatDuration(options.isolation_grace))};
  }
  return {Verdict::kDead, evidence.nobody_beats && options.isolation_grace > absl::ZeroDuration()
                              ? absl::StrCat("heartbeat timeout (every member silent past "
                                             "--isolation_grace=",
                                             absl::FormatDuration(options.isolation_grace), ")")
                              : "heartbeat timeout"};
}

}  // namespace

absl::Duration ServerLagAllowance(absl::Duration server_lag,
                                  const FailureDetectorOptions& options) {
  if (server_lag <= options.heartbeat_interval / 2 ||
      options.isolation_grace <= absl::ZeroDuration()) {
    return absl::ZeroDuration();
  }
  return std::min(server_lag, options.isolation_grace);
}

void ServerLag::Read(absl::Time at, absl::Duration lag) {
  // A member silent longer than timeout + grace is dead whatever the lag.
  const absl::Duration longest = options_.heartbeat_timeout + options_.isolation_grace;
  const size_t before = readings_.size();
  while (!readings_.empty() && at - readings_.front().first > longest) readings_.pop_front();
  const absl::Duration allowance = ServerLagAllowance(lag, options_);
  if (allowance > absl::ZeroDuration()) readings_.emplace_back(at, allowance);
  if (readings_.size() == before && allowance == absl::ZeroDuration()) return;
  // The steps: the suffix maxima of the readings, from the newest back.
  steps_.clear();
  for (auto it = readings_.rbegin(); it != readings_.rend(); ++it) {
    if (steps_.empty() || it->second > steps_.back().second) steps_.push_back(*it);
  }
  std::reverse(steps_.begin(), steps_.end());
}

std::vector<std::pair<absl::Time, absl::Duration>>::const_iterator ServerLag::StepOf(
    absl::Time last_beat) const {
  return std::lower_bound(steps_.begin(), steps_.end(), last_beat,
                          [](const std::pair<absl::Time, absl::Duration>& step, absl::Time t) {
                            return step.first < t;
                          });
}

absl::Duration ServerLag::AllowanceSince(absl::Time last_beat) const {
  auto it = StepOf(last_beat);
  return it == steps_.end() ? absl::ZeroDuration() : it->second;
}

absl::Time ServerLag::StepEnd(absl::Time last_beat) const {
  auto it = StepOf(last_beat);
  return it == steps_.end() ? absl::InfiniteFuture() : it->first;
}

bool ServerLag::LaterMayBeDead(absl::Time last_beat, absl::Time now, absl::Duration timeout) const {
  auto it = StepOf(last_beat);
  if (it == steps_.end()) return true;  // no allowance: anyone later is judged as usual
  // A later step begins where the one before it ends; its earliest member is
  // silent since just after that, and dead past timeout + the step's
  // allowance.
  for (auto next = it + 1; next != steps_.end(); ++next) {
    if (now - (next - 1)->first > timeout + next->second) return true;
  }
  return now - steps_.back().first > timeout;  // after the last step: no allowance
}

std::vector<MemberVerdict> JudgeMembers(const std::vector<MemberSignals>& members,
                                        const JobSignals& job, absl::Time now,
                                        const FailureDetectorOptions& options) {
  // The last beat the server heard from anyone in the job (rule 4).
  absl::Time last_heard = job.last_heard;
  for (const MemberSignals& m : members) last_heard = std::max(last_heard, m.last_heartbeat);
  if (job.joins_held) last_heard = now;  // workers in held joins reach the server now
  JobEvidence evidence;
  evidence.last_heard = last_heard;
  evidence.nobody_beats = now - last_heard > options.heartbeat_timeout;
  // The job falling silent as a whole: nobody beat for 1.5 intervals (a
  // member that beats is never that late: its next beat follows the answer
  // to its last by one interval). Rule 3's evidence dates from the last beat
  // that showed the data plane advancing, which under steps slower than an
  // interval comes before the last beat heard; without this, a server cut off
  // from everyone declared the earliest-silent members dead in that gap
  // (between their timeout by rule 3's clock and everyone's by rule 4's),
  // when every member had in fact stopped reaching it.
  evidence.job_falls_silent = now - last_heard > options.heartbeat_interval * 1.5;
  evidence.peers_see_them = now - job.data_plane_advanced <= options.heartbeat_timeout;
  std::vector<MemberVerdict> verdicts;
  verdicts.reserve(members.size());
  for (const MemberSignals& m : members) {
    std::optional<MemberVerdict> dead = DeadAtOnce(m, job, now, options);
    verdicts.push_back(dead.has_value() ? *std::move(dead)
                                        : JudgeSilence(m, job, evidence, now, options));
  }
  return verdicts;
}

}  // namespace zeroshard
