// Membership's side of a recovery past --rejoin_grace: shrink, wait for the
// survivors on their way, or fail (the rules: rejoin_wait.h).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"
#include "shard_server/membership/rejoin_wait.h"

namespace zeroshard {

RejoinState Membership::RejoinStateOf(const Job& job, absl::Time now) {
  RejoinState s;
  s.job_id = job.id;
  s.generation = job.generation;
  s.world_size = job.world_size;
  s.min_world_size = job.min_world_size;
  s.rejoin_grace = job.rejoin_grace;
  s.grace_over = job.state == v1::DEGRADED && !job.formed() &&
                 job.degraded_at != absl::InfinitePast() &&
                 now - job.degraded_at >= job.rejoin_grace;
  s.rejoined.reserve(job.pending.size());
  absl::Time first_deadline = absl::InfiniteFuture();
  for (const auto& [worker_id, p] : job.pending) {  // std::map: sorted
    s.rejoined.push_back(worker_id);
    first_deadline = std::min(first_deadline, p.deadline);
  }
  if (first_deadline != absl::InfiniteFuture()) {
    s.deadline_left = std::max(absl::ZeroDuration(), first_deadline - now);
  }
  for (const MemberState& m : job.members) {  // by rank
    if (job.pending.count(m.worker_id) > 0) continue;
    s.missing.push_back({m.worker_id, m.rank, m.alive && !m.left, m.left});
  }
  return s;
}

void Membership::FillRejoinWait(const Job& job, absl::Time now, v1::JobStatus* out) {
  if (job.state != v1::DEGRADED || job.formed()) return;
  RejoinDecision d = DecideRejoin(RejoinStateOf(job, now));
  if (d.action != RejoinAction::kWaitForLive) return;
  for (std::string& id : d.waiting_for) out->add_waiting_for(std::move(id));
  out->set_waiting(std::move(d.message));
}

void Membership::MaybeShrink(Job& job, absl::Time now, Deferred& deferred) {
  if (job.state != v1::DEGRADED || job.formed() || job.min_world_size <= 0 ||
      job.degraded_at == absl::InfinitePast() || now - job.degraded_at < job.rejoin_grace) {
    job.waiting_logged.clear();
    return;
  }
  RejoinDecision d = DecideRejoin(RejoinStateOf(job, now));
  if (d.action == RejoinAction::kWaitForLive) {
    if (d.waiting_for != job.waiting_logged) {  // once per change of whom
      log_->Log("recovery_waiting", {{"job", job.id},
                                     {"generation", absl::StrCat(job.generation)},
                                     {"rejoined", absl::StrCat(job.pending.size())},
                                     {"waiting_for", absl::StrJoin(d.waiting_for, ",")},
                                     {"reason", d.message}});
      job.waiting_logged = std::move(d.waiting_for);
    }
    return;
  }
  const std::vector<std::string> waited = std::move(job.waiting_logged);
  job.waiting_logged.clear();
  // Nobody to tell (a join may still come: a replacement), or formed at the
  // join.
  if (job.pending.empty() || d.action == RejoinAction::kWaitForAll) return;
  const int in = static_cast<int>(job.pending.size());
  if (in >= job.world_size) return;
  if (d.action == RejoinAction::kFail) {
    // The recovery cannot complete: say why to everyone waiting.
    log_->Log("recovery_failed", {{"job", job.id}, {"reason", d.message}});
    FailPendingJoins(job, absl::FailedPreconditionError(d.message), deferred);
    job.degraded_at = absl::InfinitePast();
    return;
  }
  const int previous = job.world_size;
  job.world_size = in;
  std::string reason =
      absl::StrCat("shrunk from ", previous, " to ", in,
                   " workers after --rejoin_grace=", absl::FormatDuration(job.rejoin_grace));
  if (!waited.empty()) {
    absl::StrAppend(&reason, " and ",
                    absl::FormatDuration(absl::Trunc(now - job.degraded_at - job.rejoin_grace,
                                                     absl::Milliseconds(100))),
                    " more for '", absl::StrJoin(waited, "', '"), "'");
  }
  log_->Log("recovery_shrink", {{"job", job.id},
                                {"generation", absl::StrCat(job.generation)},
                                {"from", absl::StrCat(previous)},
                                {"to", absl::StrCat(in)}});
  FormGeneration(job, deferred);
  if (!job.formed()) {
    job.world_size = previous;  // the save failed; the joins got its error
    return;
  }
  Remember(job, reason);
}

}  // namespace zeroshard
