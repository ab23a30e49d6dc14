// The state store: jobs restored at start, each change saved before anyone
// hears of it, a death saved when it can be, commits synced outside the lock.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

absl::Time Membership::RestoredBeat(absl::Time now) const {
  // A silence is counted from the last beat: one that lies in the future
  // by restore_grace - heartbeat_timeout gives the member restore_grace.
  return now + std::max(absl::ZeroDuration(), options_.restore_grace - options_.heartbeat_timeout);
}

absl::Status Membership::Restore() {
  if (state_ == nullptr) return absl::OkStatus();
  absl::StatusOr<std::vector<StoredJob>> stored = state_->LoadJobs();
  if (!stored.ok()) return stored.status();
  absl::MutexLock lock(&mu_);
  absl::Time now = clock_->Now();
  for (StoredJob& s : *stored) {
    auto job = std::make_unique<Job>();
    job->id = s.job_id;
    job->world_size = s.world_size;
    // A job that shrank keeps its workers' --world_size as its target, so
    // their re-joins and replacements are still accepted.
    job->target_world_size = s.target_world_size > 0 ? s.target_world_size : s.world_size;
    job->generation = s.generation;
    job->members_generation = s.members_generation;
    job->state = static_cast<v1::JobState>(s.state);
    if (job->state == v1::DEGRADED) job->degraded_at = now;
    for (StoredMember& sm : s.members) {
      MemberState m;
      m.rank = sm.rank;
      m.worker_id = std::move(sm.worker_id);
      m.host = std::move(sm.host);
      m.token = std::move(sm.token);
      m.left = sm.left;
      m.node = std::move(sm.node);
      m.alive = !sm.dead && !sm.left;
      m.step = sm.step;  // where it ended; a live member's next beat says
      m.loss = sm.loss;
      // Written by this server's Persist: a row that does not parse (none
      // should) leaves the telemetry empty rather than the job unloaded.
      if (!m.last_step.ParseFromString(sm.last_step)) m.last_step.Clear();
      m.last_heartbeat = RestoredBeat(now);  // restore_grace to beat again
      job->members.push_back(std::move(m));
    }
    for (const StoredFence& f : s.fences) {
      v1::FencedHost& fence = job->fences[f.node];
      fence.set_node(f.node);
      fence.set_reason(f.reason);
      fence.set_rank(f.rank);
      fence.set_step(f.step);
      fence.set_unix_ms(f.unix_ms);
    }
    for (StoredGenerationChange& h : s.history) {
      job->history.push_back(
          {h.seq, h.generation, std::move(h.reason), absl::FromUnixMillis(h.unix_ms)});
    }
    job->IndexMembers();
    job->RebuildSilenceOrder();
    log_->Log("job_restored", {{"job", job->id},
                               {"generation", absl::StrCat(job->generation)},
                               {"state", v1::JobState_Name(job->state)},
                               {"members", absl::StrCat(job->members.size())}});
    jobs_[job->id] = std::move(job);
  }
  return RestoreGoodput(now);
}

void Membership::StartGrace() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (auto& [id, job] : jobs_) {
    for (MemberState& m : job->members) {
      if (m.alive && !m.left) m.last_heartbeat = RestoredBeat(now);
    }
    job->RebuildSilenceOrder();
  }
}

absl::Status Membership::Persist(const Job& job) {
  if (state_ == nullptr) return absl::OkStatus();
  StoredJob s;
  s.job_id = job.id;
  s.world_size = job.world_size;
  s.target_world_size = job.target_world_size;
  s.generation = job.generation;
  s.members_generation = job.members_generation;
  s.state = job.state;
  for (const MemberState& m : job.members) {
    // Where a member that ended stopped (it changes no more): what status
    // shows of a finished job after a restart, its counts of skipped steps
    // and rewinds included. A live member's changes with every beat, and
    // is not saved.
    const bool ended = !m.alive || m.left;
    s.members.push_back({m.rank, m.worker_id, m.host, m.token, m.left, !m.alive && !m.left, m.node,
                         ended ? m.step : 0, ended ? m.loss : 0,
                         ended ? m.last_step.SerializeAsString() : std::string()});
  }
  for (const Job::GenerationChange& h : job.history) {
    s.history.push_back({h.seq, h.generation, absl::ToUnixMillis(h.at), h.reason});
  }
  for (const auto& [node, f] : job.fences) {
    s.fences.push_back({node, f.reason(), f.rank(), f.step(), f.unix_ms()});
  }
  absl::Status saved = state_->SaveJob(s);
  if (saved.ok()) job.commit = state_->LastCommit();
  return saved;
}

absl::Status Membership::SyncState(int64_t commit) {
  if (state_ == nullptr || commit == 0) return absl::OkStatus();
  absl::Status synced = state_->Sync(commit);
  if (!synced.ok()) log_->Log("state_store_error", {{"error", synced.ToString()}});
  return synced;
}

absl::Status Membership::SaveChange(const Job& job, absl::string_view failure) {
  absl::Status saved = Persist(job);
  if (saved.ok()) return saved;
  absl::Status error(saved.code(), absl::StrCat(failure, ": ", saved.message()));
  log_->Log("state_store_error", {{"job", job.id}, {"error", error.ToString()}});
  return error;
}

void Membership::SaveOrMarkUnsaved(Job& job, absl::string_view change) {
  absl::Status saved = Persist(job);
  if (!saved.ok() && job.unsaved.ok()) {
    // Logged once: the retries on every tick would repeat it 20 times a second.
    log_->Log("state_store_error", {{"job", job.id},
                                    {"change", std::string(change)},
                                    {"error", saved.ToString()},
                                    {"retry", "every tick, and before the job's member calls"}});
  } else if (saved.ok() && !job.unsaved.ok()) {
    log_->Log("state_saved", {{"job", job.id}, {"generation", absl::StrCat(job.generation)}});
  }
  job.unsaved = saved;
}

absl::Status Membership::SaveUnsaved(Job& job) {
  if (job.unsaved.ok()) return absl::OkStatus();
  SaveOrMarkUnsaved(job, "retry");
  if (job.unsaved.ok()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("job '", job.id, "' has a membership change (generation ", job.generation,
                   ") that the server could not save: ", job.unsaved.message(),
                   "; the job's calls are refused until it is saved (retried every tick)"));
}

}  // namespace zeroshard
