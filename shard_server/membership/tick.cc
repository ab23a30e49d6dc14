// The timer's pass over every job (Tick): unsaved changes retried, silent
// members judged (deaths.cc), a shrink or grow back, expired joins answered,
// idle jobs forgotten.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

void Membership::ReadServerLag(absl::Time at, absl::Duration lag) {
  absl::MutexLock lock(&mu_);
  server_lag_.Read(at, lag);
}

void Membership::Tick() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    absl::Time now = clock_->Now();
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      Job& job = *it->second;
      if (!job.unsaved.ok()) SaveUnsaved(job).IgnoreError();
      if (job.resumed_unlisted > 0) FlushResumed(job, now);
      StartOverdueClocks(job, now);
      const bool died = DeclareDeaths(job, now, deferred);
      MaybeShrink(job, now, deferred);
      if (!died) MaybeGrowBack(job, now, deferred);
      ExpireJoins(job, now, deferred);
      if (job.goodput.MaybeSample(now)) job.goodput_changed = true;
      SaveGoodput(job, now, /*phase_changed=*/false);
      if (job.unsaved.ok() && ForgetIfIdle(job, now, deferred)) {
        jobs_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  SyncState(LastCommit()).IgnoreError();
  for (auto& f : deferred) f();
}

std::string Membership::JoinTimeoutMessage(const Job& job, const PendingJoin& p, absl::Time now) {
  if (!job.formed()) {
    return absl::StrCat("join of job '", job.id, "' generation ", job.generation,
                        " timed out: ", job.pending.size(), " of ", job.world_size,
                        " workers had joined");
  }
  // A grower: the job runs without it.
  const int m = job.world_multiple;
  const int growers = static_cast<int>(job.pending.size());
  std::string why =
      m > 1 && job.WithGrowers(job.world_size) % m != 0
          ? absl::StrCat("the ", growers,
                         " waiting to grow it back do not make whole shard groups of ", m, " (",
                         growers % m, " of ", m, ")")
          : "the members committed no snapshot since it came";
  return absl::StrCat(
      "join of job '", job.id, "' as '", p.worker_id, "' timed out after ",
      absl::FormatDuration(absl::Trunc(now - p.joined_at, absl::Seconds(1))),
      " waiting to grow the job back from ", job.world_size, " to ", job.target_world_size,
      " workers: ", why,
      p.parked.empty()
          ? ""
          : absl::StrCat("; it was left out of the shrink to whole groups: ", p.parked),
      ". The job goes on at ", job.world_size,
      " workers without it; start it again (or its group's lost workers) to grow the job back");
}

void Membership::ExpireJoins(Job& job, absl::Time now, Deferred& deferred) {
  bool expired = false;
  for (auto p = job.pending.begin(); p != job.pending.end();) {
    if (p->second.deadline > now) {
      ++p;
      continue;
    }
    expired = true;
    pending_by_id_.erase(p->second.id);
    log_->Log("join_timeout", {{"job", job.id}, {"worker", p->first}});
    deferred.push_back(
        [done = std::move(p->second.done), message = JoinTimeoutMessage(job, p->second, now)]() {
          done(absl::DeadlineExceededError(message));
        });
    p = job.pending.erase(p);
  }
  if (expired && job.pending.empty() && !job.formed() &&
      job.restarted_from != v1::JOB_STATE_UNSPECIFIED) {
    AbandonRestart(job, now);
  }
}

void Membership::AbandonRestart(Job& job, absl::Time now) {
  const v1::JobState ended = std::exchange(job.restarted_from, v1::JOB_STATE_UNSPECIFIED);
  const std::string name = v1::JobState_Name(ended);
  job.state = ended;
  Remember(job, absl::StrCat("restart abandoned (its joins timed out): ", name, " again"));
  job.goodput.Finished(now);
  SaveGoodput(job, now, /*phase_changed=*/true);
  log_->Log("restart_abandoned", {{"job", job.id}, {"state", name}});
  SaveOrMarkUnsaved(job, absl::StrCat("job '", job.id, "' back to ", name,
                                      " after its restart's joins timed out"));
}

}  // namespace zeroshard
