// The timer's pass over every job (Tick): unsaved changes retried, silent
// members judged (deaths.cc), a shrink or grow back, expired joins answered,
// idle jobs forgotten.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/failure_detector.h"
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
      bool died = false;
      bool changed = false;
      std::string dead;  // who, for the generation's history
      StartOverdueClocks(job, now);
      // Who is dead: shard_server/membership/failure_detector.h has the rules.
      const bool suspect = job.formed() && job.suspect_generation == job.generation;
      // Only those that may be dead: every other live member is alive
      // (failure_detector.h, JudgeMembers).
      const std::vector<MemberState*> live = MembersToJudge(job, now);
      const std::vector<const MemberState*> judged(live.begin(), live.end());
      std::vector<MemberSignals> signals;
      signals.reserve(live.size());
      for (const MemberState* m : live) {
        signals.push_back(
            {m->last_heartbeat, m->stream_closed, server_lag_.AllowanceSince(m->last_heartbeat)});
      }
      const JobSignals job_signals{
          suspect, job.formed() ? job.data_plane_advanced : absl::InfinitePast(), job.formed(),
          job.silence.size() > 0 ? job.members[job.silence.Newest()].last_heartbeat
                                 : absl::InfinitePast()};
      const std::vector<MemberVerdict> verdicts =
          JudgeMembers(signals, job_signals, now, detector_options_);
      LogDoubts(job, judged, verdicts);
      for (size_t i = 0; i < live.size(); ++i) {
        if (verdicts[i].verdict != Verdict::kDead) continue;
        MemberState& m = *live[i];
        const absl::Duration silent = now - m.last_heartbeat;
        m.alive = false;
        StopWatching(job, m.rank);
        changed = true;
        absl::StrAppend(&dead, dead.empty() ? "" : ", ", "worker '", m.worker_id, "' (rank ",
                        m.rank, ")");
        log_->Log("member_dead", {{"job", job.id},
                                  {"worker", m.worker_id},
                                  {"rank", absl::StrCat(m.rank)},
                                  {"generation", absl::StrCat(job.members_generation)},
                                  {"silent_ms", Ms(silent)},
                                  {"why", verdicts[i].why}});
        died = died || job.formed();
      }
      // A death stands whatever the disk says: applied now, saved when it can be.
      if (died) {
        const int64_t old = job.generation;
        job.world_size = WithGrowers(job, job.world_size);
        job.generation++;
        job.state = v1::DEGRADED;
        job.degraded_at = now;
        AnnounceGeneration(job, old, absl::StrCat(dead, " stopped heartbeating"), deferred);
        SaveOrMarkUnsaved(job, absl::StrCat("generation ", job.generation, " after a death"));
      } else if (changed) {
        // Survivors of an abandoned generation went silent.
        SaveOrMarkUnsaved(job, "members of an abandoned generation went silent");
      }
      MaybeShrink(job, now, deferred);
      if (!died) MaybeGrowBack(job, now, deferred);
      for (auto p = job.pending.begin(); p != job.pending.end();) {
        if (p->second.deadline > now) {
          ++p;
          continue;
        }
        int joined = static_cast<int>(job.pending.size());
        pending_by_id_.erase(p->second.id);
        log_->Log("join_timeout", {{"job", job.id}, {"worker", p->first}});
        deferred.push_back([done = std::move(p->second.done), id = job.id, joined,
                            w = job.world_size, gen = job.generation]() {
          done(absl::DeadlineExceededError(absl::StrCat("join of job '", id, "' generation ", gen,
                                                        " timed out: ", joined, " of ", w,
                                                        " workers had joined")));
        });
        p = job.pending.erase(p);
      }
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

}  // namespace zeroshard
