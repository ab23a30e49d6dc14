// Leave: a member's clean exit; the job is FINISHED when every member left.
// A leave with a failure (LeaveRequest.failure) makes it FAILED at once.
#include <string>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/assign_telemetry.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

namespace {

// What a leave carries, within the bounds the server keeps (null: nothing).
absl::Status CheckLeaveRequest(const v1::LeaveRequest* final) {
  if (final == nullptr) return absl::OkStatus();
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
        absl::StrCat("LeaveRequest.final_last_step is ", n, " bytes; at most ", kMaxBeatStepBytes,
                     " are kept (a worker sends far less)"));
  }
  if (final->failure().size() > kMaxFailureBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("LeaveRequest.failure is ", final->failure().size(), " bytes; at most ",
                     kMaxFailureBytes, " (a worker cuts its message to that)"));
  }
  return absl::OkStatus();
}

}  // namespace

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

void Membership::AnnounceFailed(Job& job, int64_t previous_generation, Deferred& deferred) {
  log_->Log("job_failed", {{"job", job.id},
                           {"generation", absl::StrCat(previous_generation)},
                           {"why", job.failure}});
  // Every join waiting in it, a grower's or a survivor's re-join, ends now
  // with the reason; the members still in the generation hear of its end in
  // their heartbeats' answers and re-join, which is refused the same way
  // (ClassifyJoinToJob).
  FailPendingJoins(job, JobFailedError(job, ""), deferred);
  AnnounceGeneration(job, previous_generation, absl::StrCat(kJobFailedPrefix, job.failure),
                     deferred);
}

void Membership::MarkFailed(Job& job, const MemberState& m, const std::string& failure) {
  job.failure = absl::StrCat("worker '", m.worker_id, "' (rank ", m.rank, ") failed: ", failure);
  job.state = v1::FAILED;
  job.generation++;
  Remember(job, absl::StrCat(kJobFailedPrefix, job.failure));
}

void Membership::UnmarkFailed(Job& job, int64_t previous_generation) {
  job.generation = previous_generation;
  job.failure.clear();
  job.history.pop_back();
}

absl::Status Membership::JobFailedError(const Job& job, const std::string& worker_id) const {
  return absl::FailedPreconditionError(absl::StrCat(
      "job '", job.id, "' failed: ", job.failure, "; ",
      worker_id.empty() ? std::string("this worker")
                        : absl::StrCat("worker '", worker_id, "'"),
      " was part of that run and does not join it again (fix the cause, then start the job's "
      "workers again: a new start runs the job again)"));
}

absl::Status Membership::Leave(const v1::MemberCredentials& member, const v1::LeaveRequest* final) {
  if (absl::Status s = CheckLeaveRequest(final); !s.ok()) return s;
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
    // A failure of the job's inputs ends the job, whoever is left: a job
    // that ended already stays as it is.
    const bool ended = job.state == v1::FINISHED || job.state == v1::FAILED;
    const bool fails = final != nullptr && !final->failure().empty() && !ended;
    // The last members of a FAILED job leaving do not make it FINISHED.
    const bool all_gone =
        !fails && !ended && live_others == 0 && (job.pending.empty() || job.formed());
    if (all_gone) job.state = v1::FINISHED;
    const int64_t previous_generation = job.generation;
    if (fails) MarkFailed(job, m, final->failure());
    absl::Status saved = SaveChange(job, absl::StrCat("the leave of rank ", m.rank, " of job '",
                                                      job.id, "' could not be saved"));
    if (!saved.ok()) {
      m.left = false;
      m.alive = was_alive;
      job.state = previous_state;
      if (fails) UnmarkFailed(job, previous_generation);
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
    if (all_gone || fails) job.goodput.Finished(now);
    SaveGoodput(job, now, /*phase_changed=*/all_gone || fails);
    log_->Log("leave", {{"job", job.id},
                        {"worker", m.worker_id},
                        {"rank", absl::StrCat(m.rank)},
                        {"generation", absl::StrCat(member.generation())}});
    if (all_gone) AnnounceFinished(job, deferred);
    if (fails) AnnounceFailed(job, previous_generation, deferred);
  }
  absl::Status synced = SyncState(LastCommit());
  for (auto& f : deferred) f();
  return synced;
}

}  // namespace zeroshard
