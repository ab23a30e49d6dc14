// GetStatus: every job's state, members, recoveries and history.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

absl::StatusOr<int> Membership::WorldSize(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  return it->second->world_size;
}

void Membership::FillGrowing(const Job& job, v1::JobStatus* out) {
  if (job.pending.empty()) return;
  std::string who;
  for (const auto& [worker_id, p] : job.pending) {
    out->add_growing(worker_id);
    absl::StrAppend(&who, who.empty() ? "" : ", ",
                    p.parked.empty() ? absl::StrCat("'", worker_id, "'") : p.parked);
  }
  const int m = job.world_multiple;
  const int growers = static_cast<int>(job.pending.size());
  out->set_growing_note(
      absl::StrCat(who, growers == 1 ? " waits" : " wait", " to grow job '", job.id, "' back from ",
                   job.world_size, " to ", job.WithGrowers(job.world_size), " of ",
                   job.target_world_size, " workers",
                   m > 1 && job.WithGrowers(job.world_size) % m != 0
                       ? absl::StrCat(" once they make whole shard groups of ", m, " (now ",
                                      growers % m, " of ", m, ")")
                       : absl::StrCat(" at the members' next committed snapshot (after step ",
                                      job.grow_mark, ")")));
}

v1::GetStatusResponse Membership::Status(const std::string& job_id) {
  v1::GetStatusResponse response;
  FillStatus(job_id, &response);
  return response;
}

void Membership::FillStatus(const std::string& job_id, v1::GetStatusResponse* response) {
  response->Clear();
  absl::MutexLock lock(&mu_);
  absl::Time now = clock_->Now();
  std::vector<const Job*> jobs;
  for (auto& [id, job] : jobs_) {
    if (job_id.empty() || id == job_id) jobs.push_back(job.get());
  }
  std::sort(jobs.begin(), jobs.end(), [](const Job* a, const Job* b) { return a->id < b->id; });
  for (const Job* job : jobs) {
    v1::JobStatus* out = response->add_jobs();
    out->mutable_members()->Reserve(static_cast<int>(job->members.size()));
    out->set_job_id(job->id);
    out->set_state(job->state);
    out->set_generation(job->generation);
    out->set_world_size(job->world_size);
    out->set_joined(job->formed() ? job->world_size : static_cast<int>(job->pending.size()));
    for (const MemberState& m : job->members) {
      v1::MemberStatus* ms = out->add_members();
      ms->set_rank(m.rank);
      ms->set_worker_id(m.worker_id);
      ms->set_host(m.host);
      // A survivor waiting in the next generation's join barrier is alive,
      // though the abandoned generation it beat in counts it silent.
      const bool rejoined = !job->formed() && !m.left && job->pending.count(m.worker_id) > 0;
      ms->set_alive(m.alive || rejoined);
      ms->set_rejoined(rejoined);
      ms->set_left(m.left);
      ms->set_last_heartbeat_age_ms(
          m.heartbeat_seen
              ? absl::ToInt64Milliseconds(std::max(absl::ZeroDuration(), now - m.last_heartbeat))
              : -1);
      ms->set_step(m.step);
      ms->set_loss(m.loss);
      ms->set_memory_bytes(m.memory_bytes);
      ms->set_collective_seq(m.collective_seq);
      *ms->mutable_last_step() = m.last_step;
      *ms->mutable_telemetry() = m.telemetry;
      // A dead or departed rank has nothing in flight: its last report's
      // collective is not shown as one that goes on (a timer that grows).
      if (!m.alive || m.left) ms->mutable_telemetry()->clear_in_progress();
      ms->set_rejoins(m.rejoins);
    }
    for (const auto& [node, fence] : job->fences) *out->add_fenced_hosts() = fence;
    out->set_snapshot_step(job->CommittedSnapshot());
    for (const v1::RecoveryRecord& r : job->recoveries) *out->add_recoveries() = r;
    for (const v1::OuterStepRecord& o : job->outer_steps) *out->add_outer_steps() = o;
    FillRejoinWait(*job, now, out);
    if (job->formed()) FillGrowing(*job, out);
    *out->mutable_goodput() = job->goodput.Snapshot(now);
    for (const Job::GenerationChange& change : job->history) {
      v1::GenerationChange* h = out->add_history();
      h->set_generation(change.generation);
      h->set_reason(change.reason);
      h->set_unix_ms(absl::ToUnixMillis(change.at));
    }
    if (job->members.empty()) {
      for (const auto& [worker_id, p] : job->pending) {
        v1::MemberStatus* ms = out->add_members();
        ms->set_rank(-1);  // not assigned until the barrier completes
        ms->set_worker_id(worker_id);
        ms->set_host(p.host);
        ms->set_alive(true);
        ms->set_last_heartbeat_age_ms(-1);
      }
    }
  }
}

}  // namespace zeroshard
