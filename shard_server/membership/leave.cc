// Leave: a member's clean exit; the job is FINISHED when every member left.
#include <string>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/assign_telemetry.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

void Membership::AnnounceFinished(Job& job, Deferred& deferred) {
  log_->Log("job_finished", {{"job", job.id}, {"generation", absl::StrCat(job.generation)}});
  // Growers still waiting (a formed job's pending joins): OUT_OF_RANGE, the
  // job ended before they could be placed in it; the worker exits 0
  // (worker/shard_worker.cc), as its job succeeded.
  for (const auto& [worker_id, p] : job.pending) {
    log_->Log("grow_back_finished", {{"job", job.id}, {"worker", worker_id}});
  }
  FailPendingJoins(
      job,
      absl::OutOfRangeError(absl::StrCat(
          "job '", job.id, "' finished (every member left, generation ", job.generation,
          ") while this worker waited to grow it back: nothing is left for it to do")),
      deferred);
  if (listener_) {
    deferred.push_back(
        [listener = listener_, id = job.id, gen = job.generation]() { listener(id, gen); });
  }
}

absl::Status Membership::Leave(const v1::MemberCredentials& member, const v1::LeaveRequest* final) {
  if (final != nullptr) {
    if (absl::Status s = ValidateTimeLedger(final->final_time(), "LeaveRequest.final_time");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = ValidateOuterSteps(final->outer_steps(), "LeaveRequest.outer_steps");
        !s.ok()) {
      return s;
    }
    if (size_t n = final->final_last_step().ByteSizeLong(); n > kMaxBeatStepBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("LeaveRequest.final_last_step is ", n, " bytes; at most ",
                       kMaxBeatStepBytes, " are kept (a worker sends far less)"));
    }
  }
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Job*> found = FindMemberJob(member, /*allow_stale=*/true);
    if (!found.ok()) return found.status();
    Job& job = **found;
    MemberState& m = job.members[member.rank()];
    if (m.left) return absl::OkStatus();  // idempotent
    if (absl::Status s = SaveUnsaved(job); !s.ok()) return s;
    const bool was_alive = m.alive;
    const v1::JobState previous_state = job.state;
    m.left = true;
    m.alive = false;
    // What status shows of a rank that left: the step it ended at, and no
    // collective in flight whose age would grow for ever.
    if (final != nullptr && final->has_final() && final->final_step() >= m.step) {
      m.step = final->final_step();
      m.loss = final->final_loss();
      if (final->has_final_last_step()) m.last_step = final->final_last_step();
    }
    m.telemetry.clear_in_progress();
    // `job.silence` and `job.undelivered` hold the live members: was `m` the
    // last of them?
    const int live_others =
        job.silence.size() + static_cast<int>(job.undelivered.size()) -
        (job.silence.Contains(m.rank) || job.undelivered.contains(m.rank) ? 1 : 0);
    // A formed job's pending joins are growers (replacements, survivors
    // parked at a shrink to whole shard groups): the job is done without
    // them, and they are told so (below).
    const bool all_gone = live_others == 0 && (job.pending.empty() || job.formed());
    if (all_gone) job.state = v1::FINISHED;
    absl::Status saved = SaveChange(job, absl::StrCat("the leave of rank ", m.rank, " of job '",
                                                      job.id, "' could not be saved"));
    if (!saved.ok()) {
      m.left = false;
      m.alive = was_alive;
      job.state = previous_state;
      return saved;
    }
    job.StopWatching(m.rank);
    const absl::Time now = clock_->Now();
    if (final != nullptr) {
      if (final->outer_steps_size() > 0) RecordOuterSteps(job, final->outer_steps());
      // Its last steps and the time after them, up to its leave.
      if (final->has_final()) job.goodput.StepsCompleted(final->final_step());
      if (final->has_final_time())
        job.goodput.Report(member.generation(), member.rank(), final->final_time());
      job.goodput_changed = true;
    }
    if (all_gone) job.goodput.Finished(now);
    SaveGoodput(job, now, /*phase_changed=*/all_gone);
    log_->Log("leave", {{"job", job.id},
                        {"worker", m.worker_id},
                        {"rank", absl::StrCat(m.rank)},
                        {"generation", absl::StrCat(member.generation())}});
    if (all_gone) AnnounceFinished(job, deferred);
  }
  absl::Status synced = SyncState(LastCommit());
  for (auto& f : deferred) f();
  return synced;
}

}  // namespace zeroshard
