// Membership's side of a recovery past --rejoin_grace: shrink, wait for the
// survivors on their way, or fail (the rules: rejoin_wait.h).
#include <algorithm>
#include <map>
#include <string>
#include <tuple>
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
  s.world_multiple = job.world_multiple;
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

std::map<std::string, Membership::PendingJoin> Membership::ParkBrokenGroups(Job& job, int form_size,
                                                                            std::string* why) {
  // Shard groups are blocks of m consecutive ranks (common/plan/shard_groups.h):
  // old rank r was in group r / m of the last formed generation.
  const int m = std::max(1, job.world_multiple);
  std::map<int, int> rejoined_of_group;
  for (const auto& [worker_id, p] : job.pending) {
    if (const MemberState* old = job.FindMember(worker_id)) ++rejoined_of_group[old->rank / m];
  }
  // Kept first: whole old groups (their ranks map simply), then survivors of
  // broken groups, by old rank; then growers (no old rank), by worker id.
  std::vector<std::tuple<int, int, std::string>> order;
  for (const auto& [worker_id, p] : job.pending) {
    const MemberState* old = job.FindMember(worker_id);
    if (old == nullptr) {
      order.emplace_back(2, 0, worker_id);
    } else {
      order.emplace_back(rejoined_of_group[old->rank / m] == m ? 0 : 1, old->rank, worker_id);
    }
  }
  std::sort(order.begin(), order.end());
  std::map<std::string, PendingJoin> parked;
  std::string who;
  for (size_t i = static_cast<size_t>(form_size); i < order.size(); ++i) {
    const std::string& worker_id = std::get<2>(order[i]);
    PendingJoin& p = job.pending[worker_id];
    if (const MemberState* old = job.FindMember(worker_id)) {
      const int first = old->rank / m * m;
      std::string lost;
      for (int r = first; r < first + m && r < static_cast<int>(job.members.size()); ++r) {
        const std::string& id = job.members[r].worker_id;
        if (job.pending.count(id) == 0) absl::StrAppend(&lost, lost.empty() ? "'" : ", '", id, "'");
      }
      p.parked = absl::StrCat("'", worker_id, "' (rank ", old->rank, ": its shard group, ranks ",
                              first, "-", first + m - 1, ", lost ", lost, ")");
    } else {
      p.parked = absl::StrCat("'", worker_id, "' (growing the job back)");
    }
    absl::StrAppend(&who, who.empty() ? "" : ", ", p.parked);
  }
  for (size_t i = static_cast<size_t>(form_size); i < order.size(); ++i) {
    parked.insert(job.pending.extract(std::get<2>(order[i])));
  }
  *why = absl::StrCat("whole shard groups of ", m, " only: ", who,
                      parked.size() == 1 ? " waits" : " wait", " to grow the job back when ",
                      parked.size() == 1 ? "its group is" : "their groups are", " whole again");
  return parked;
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
  // Nobody to tell (a join may still come: a replacement), or formed at the join.
  if (job.pending.empty() || d.action == RejoinAction::kWaitForAll) return;
  if (d.action == RejoinAction::kFail) {
    // The recovery cannot complete: say why to everyone waiting.
    log_->Log("recovery_failed", {{"job", job.id}, {"reason", d.message}});
    FailPendingJoins(job, absl::FailedPreconditionError(d.message), deferred);
    job.degraded_at = absl::InfinitePast();
    return;
  }
  const int in = static_cast<int>(job.pending.size());
  if (d.form_size >= job.world_size) return;
  const int previous = job.world_size;
  std::string reason =
      absl::StrCat("shrunk from ", previous, " to ", d.form_size,
                   " workers after --rejoin_grace=", absl::FormatDuration(job.rejoin_grace));
  if (!waited.empty()) {
    absl::StrAppend(&reason, " and ",
                    absl::FormatDuration(absl::Trunc(now - job.degraded_at - job.rejoin_grace,
                                                     absl::Milliseconds(100))),
                    " more for '", absl::StrJoin(waited, "', '"), "'");
  }
  // Whole shard groups: the re-joined beyond form_size wait aside while the
  // generation forms, then as growers of it (MaybeGrowBack takes them back
  // once they make whole groups again: a replacement of their lost peer).
  std::map<std::string, PendingJoin> parked;
  if (d.form_size < in) {
    std::string why;
    parked = ParkBrokenGroups(job, d.form_size, &why);
    absl::StrAppend(&reason, "; ", why);
  }
  std::vector<std::string> parked_ids;
  for (const auto& [worker_id, p] : parked) parked_ids.push_back(worker_id);
  log_->Log("recovery_shrink", {{"job", job.id},
                                {"generation", absl::StrCat(job.generation)},
                                {"from", absl::StrCat(previous)},
                                {"to", absl::StrCat(d.form_size)},
                                {"parked", absl::StrJoin(parked_ids, ",")}});
  job.world_size = d.form_size;
  Remember(job, reason);  // saved with the formed generation
  FormGeneration(job, deferred);
  // Back: growers of the formed generation, or (the save failed) re-joins of
  // the forming one, which the next tick decides on again.
  job.pending.merge(parked);
  if (!job.formed()) {
    job.world_size = previous;  // the save failed; the joins got its error
    job.history.pop_back();
    return;
  }
  if (parked_ids.empty()) return;
  job.grow_since = now;
  job.grow_mark = job.CommittedSnapshot();
  for (const std::string& worker_id : parked_ids) {
    log_->Log("grow_back_waiting",
              {{"job", job.id},
               {"worker", worker_id},
               {"world_size", absl::StrCat(job.world_size, "/", job.target_world_size)},
               {"after_snapshot", absl::StrCat(job.grow_mark)},
               {"parked", job.pending[worker_id].parked}});
  }
}

}  // namespace zeroshard
