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

void Membership::ExpireJoins(Job& job, absl::Time now, Deferred& deferred) {
  for (auto p = job.pending.begin(); p != job.pending.end();) {
    if (p->second.deadline > now) {
      ++p;
      continue;
    }
    int joined = static_cast<int>(job.pending.size());
    pending_by_id_.erase(p->second.id);
    log_->Log("join_timeout", {{"job", job.id}, {"worker", p->first}});
    deferred.push_back([done = std::move(p->second.done), id = job.id, joined, w = job.world_size,
                        gen = job.generation]() {
      done(absl::DeadlineExceededError(absl::StrCat("join of job '", id, "' generation ", gen,
                                                    " timed out: ", joined, " of ", w,
                                                    " workers had joined")));
    });
    p = job.pending.erase(p);
  }
}

}  // namespace zeroshard
