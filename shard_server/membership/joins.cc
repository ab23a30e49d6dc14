// Join and CancelJoin: a join is validated, classified against its job
// (JoinKind) and applied, then held until its generation forms
// (membership.cc, FormGeneration).
#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/job_id.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {
namespace {

constexpr size_t kMaxIdLength = 256;

// An address peers reach the worker at (a host name or an IP address): shown
// to people and written to the log, so printable ASCII without spaces.
absl::Status ValidateHost(const std::string& host) {
  if (host.size() > kMaxIdLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("host is ", host.size(), " characters long; at most ", kMaxIdLength));
  }
  for (unsigned char c : host) {
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("host '", absl::CEscape(host),
                       "' has a space, a control character or a non-ASCII byte; expected a "
                       "host name or an IP address"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Membership::ValidateJoinRequest(const v1::JoinRequest& request) const {
  if (absl::Status s = ValidateJobId(request.job_id()); !s.ok()) return s;
  if (absl::Status s = ValidateWorkerId(request.worker_id()); !s.ok()) return s;
  if (request.world_size() < 1 || request.world_size() > options_.max_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", request.world_size(), " is out of range: expected 1..",
                     options_.max_world_size, " (the server's --max_world_size)"));
  }
  if (absl::Status s = ValidateHost(request.host()); !s.ok()) return s;
  if (request.min_world_size() < 0 || request.min_world_size() > request.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_world_size ", request.min_world_size(), " is out of range: expected 0..",
                     request.world_size(), " (the world size; 0: no shrink)"));
  }
  if (request.world_multiple() < 0 || request.world_multiple() > request.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_multiple ", request.world_multiple(), " is out of range: expected 0..",
                     request.world_size(), " (the shard group size; 0: any world size)"));
  }
  if (request.rejoin_grace_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rejoin_grace_ms ", request.rejoin_grace_ms(), " is negative; expected >= 0"));
  }
  if (request.steps_completed() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("steps_completed ", request.steps_completed(),
                                                   " is negative; expected >= 0 (0: none)"));
  }
  if (request.incarnation().size() > kMaxIdLength) {
    return absl::InvalidArgumentError(absl::StrCat("incarnation is ", request.incarnation().size(),
                                                   " characters long; at most ", kMaxIdLength));
  }
  return absl::OkStatus();
}

absl::StatusOr<Membership::JoinKind> Membership::ClassifyJoin(const v1::JoinRequest& request,
                                                              Job* job) {
  absl::StatusOr<JoinKind> kind = ClassifyJoinToJob(request, job);
  if (!kind.ok()) return kind;
  if (static_cast<int>(pending_by_id_.size()) >= options_.max_pending_joins) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds ", pending_by_id_.size(), " pending joins; at most ",
                     options_.max_pending_joins, " (the server's --max_pending_joins)"));
  }
  if (*kind == JoinKind::kNewJob && static_cast<int>(jobs_.size()) >= options_.max_jobs) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds ", jobs_.size(), " jobs; at most ", options_.max_jobs,
                     " (the server's --max_jobs); a job with no live member is forgotten after "
                     "--job_ttl"));
  }
  return kind;
}

absl::StatusOr<Membership::JoinKind> Membership::ClassifyJoinToJob(const v1::JoinRequest& request,
                                                                   Job* job) {
  if (job == nullptr) return JoinKind::kNewJob;
  // The job takes no join until its last change is saved.
  if (absl::Status s = SaveUnsaved(*job); !s.ok()) return s;
  if (absl::Status s = CheckNotFenced(request, *job); !s.ok()) return s;
  if (job->state == v1::FINISHED) return JoinKind::kRestartFinished;
  if (job->state == v1::FAILED) {
    // The process that was a member of the failed run (same incarnation)
    // would fail it again, or wait for peers that will not come: refused.
    // A new process starts the job again.
    const MemberState* was = job->FindMember(request.worker_id());
    if (was != nullptr && !request.incarnation().empty() &&
        was->incarnation == request.incarnation()) {
      return JobFailedError(*job, request.worker_id());
    }
    return JoinKind::kRestartFinished;
  }
  if (absl::Status s = CheckSameJobOptions(request, *job); !s.ok()) return s;
  if (job->formed()) return ClassifyJoinToFormedJob(request, *job);
  if (job->pending.count(request.worker_id()) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("worker '", request.worker_id(),
                                                 "' already has a join pending for job '", job->id,
                                                 "' generation ", job->generation));
  }
  // A shrunk job recovering: a worker id it lost widens the generation that
  // is forming (a recovery is a boundary already).
  if (job->state == v1::DEGRADED && job->FindMember(request.worker_id()) == nullptr &&
      job->world_size < job->target_world_size) {
    return JoinKind::kGrowBack;
  }
  return JoinKind::kJoinForming;
}

absl::Status Membership::CheckSameJobOptions(const v1::JoinRequest& request, const Job& job) const {
  const absl::Duration grace = absl::Milliseconds(request.rejoin_grace_ms());
  if (request.world_size() != job.target_world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("world_size ", request.world_size(), " differs from job '", job.id,
                     "' world_size ", job.target_world_size, " (generation ", job.generation,
                     "); every worker of a job must pass the same world size"));
  }
  if (job.recovery_options_known &&
      (request.min_world_size() != job.min_world_size || grace != job.rejoin_grace)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", request.worker_id(), "' joins with --min_world_size=", request.min_world_size(),
        " --rejoin_grace=", absl::FormatDuration(grace), " but job '", job.id,
        "' runs with --min_world_size=", job.min_world_size,
        " --rejoin_grace=", absl::FormatDuration(job.rejoin_grace),
        "; every worker of a job must pass the same values"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Membership::JoinKind> Membership::ClassifyJoinToFormedJob(
    const v1::JoinRequest& request, const Job& job) const {
  const MemberState* member = job.FindMember(request.worker_id());
  if (member == nullptr) {
    if (job.pending.count(request.worker_id()) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("worker '", request.worker_id(),
                                                   "' already waits to grow job '", job.id,
                                                   "' back at its next snapshot"));
    }
    // A shrunk job takes missing workers back, up to the world size it was
    // started with.
    if (job.world_size + static_cast<int>(job.pending.size()) < job.target_world_size) {
      return JoinKind::kGrowBack;
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", job.id, "' already has all ", job.world_size, " members in generation ",
        job.generation,
        job.pending.empty() ? ""
                            : absl::StrCat(" and ", job.pending.size(), " waiting to grow back"),
        " (started with ", job.target_world_size, "); worker '", request.worker_id(),
        "' cannot join"));
  }
  if (!member->alive || member->left) return JoinKind::kRejoin;
  // A join with the id of a live member replaces it only once that member
  // is gone from the server's view: its heartbeat stream closed after its
  // last beat (a killed process's closes at once), or it missed a beat (no
  // beat for 1.5 heartbeat intervals: members beat every interval, so plain
  // "one interval" would catch a beating member between two beats). A
  // beating member is never evicted, so holding the server's token is not
  // enough to end a job by joining with its ids.
  const absl::Time now = clock_->Now();
  const absl::Duration missed_beat = options_.heartbeat_interval * 1.5;
  const bool gone =
      member->stream_closed > member->last_heartbeat || now - member->last_heartbeat >= missed_beat;
  if (!request.incarnation().empty() && !member->incarnation.empty() && gone) {
    // Another process with the member's id (it was restarted), or the
    // member's own process giving its generation up (its data plane could
    // not be set up): the member in the generation is gone.
    return JoinKind::kReplaceRestartedProcess;
  }
  return absl::AlreadyExistsError(absl::StrCat(
      "worker '", request.worker_id(), "' is already a live member of job '", job.id, "' (rank ",
      member->rank, ", generation ", job.generation, ", last heartbeat ",
      Ms(std::max(absl::ZeroDuration(), now - member->last_heartbeat)),  // restored: in the future
      " ms ago on an open stream); it can join again once its heartbeat stream closes, it is "
      "silent for ",
      Ms(missed_beat), " ms, it has left, or it was declared dead (no heartbeat for ",
      Ms(options_.heartbeat_timeout), " ms)"));
}

absl::StatusOr<Membership::Job*> Membership::ApplyJoin(JoinKind kind,
                                                       const v1::JoinRequest& request, Job* job,
                                                       absl::Time now, Deferred& deferred) {
  switch (kind) {
    case JoinKind::kNewJob:
      return CreateJob(request);
    case JoinKind::kJoinForming:
      return job;
    case JoinKind::kRestartFinished: {
      const v1::JobState ended = job->state;
      absl::Status s = StartGeneration(
          *job, request.world_size(), v1::JOINING,
          ended == v1::FAILED ? "job restarted after failing" : "job restarted after finishing",
          deferred);
      if (!s.ok()) return s;
      job->restarted_from = ended;
      job->target_world_size = request.world_size();
      job->recovery_options_known = false;
      job->goodput.Started(now);  // the wall clock goes on from here
      SaveGoodput(*job, now, /*phase_changed=*/true);
      return job;
    }
    case JoinKind::kReplaceRestartedProcess: {
      absl::Status s =
          ReplaceRestartedMember(*job, request.worker_id(), request.incarnation(), now, deferred);
      if (!s.ok()) return s;
      return job;
    }
    case JoinKind::kRejoin: {
      absl::Status s =
          StartGeneration(*job, job->world_size, v1::DEGRADED,
                          absl::StrCat("worker '", request.worker_id(), "' re-joined"), deferred);
      if (!s.ok()) return s;
      return job;
    }
    case JoinKind::kGrowBack:
      if (job->formed()) {
        // The wait for the members' next snapshot starts when the growers
        // can grow the job: the first of them, or (whole shard groups) the
        // one that completes a group; growers of a group not yet whole
        // (one whose partner is still to come) could not grow it before.
        const int m = job->world_multiple;
        const bool could_grow =
            !job->pending.empty() && (m <= 1 || job->WithGrowers(job->world_size) % m == 0);
        if (!could_grow) {
          job->grow_since = now;
          job->grow_mark = job->CommittedSnapshot();
        }
        log_->Log("grow_back_waiting",
                  {{"job", job->id},
                   {"worker", request.worker_id()},
                   {"world_size", absl::StrCat(job->world_size, "/", job->target_world_size)},
                   {"after_snapshot", absl::StrCat(job->grow_mark)}});
      } else {
        ++job->world_size;
        log_->Log("grow_back",
                  {{"job", job->id},
                   {"worker", request.worker_id()},
                   {"generation", absl::StrCat(job->generation)},
                   {"world_size", absl::StrCat(job->world_size, "/", job->target_world_size)}});
      }
      return job;
  }
  return absl::InternalError("unknown join kind");
}

absl::StatusOr<Membership::Job*> Membership::CreateJob(const v1::JoinRequest& request) {
  auto created = std::make_unique<Job>();
  created->id = request.job_id();
  created->world_size = request.world_size();
  // Above any generation its checkpoints recorded: a job id used again after
  // it was forgotten never repeats a generation.
  created->generation =
      1 + std::max<int64_t>(0, generation_floor_ ? generation_floor_(created->id) : 0);
  created->state = v1::JOINING;
  created->target_world_size = request.world_size();
  Remember(*created, "job created");  // saved with it
  if (absl::Status s =
          SaveChange(*created, absl::StrCat("job '", created->id, "' could not be created"));
      !s.ok()) {
    return s;
  }
  Job* job = created.get();
  const absl::Time now = clock_->Now();
  job->goodput.Started(now);
  SaveGoodput(*job, now, /*phase_changed=*/true);
  jobs_[job->id] = std::move(created);
  log_->Log("job_created", {{"job", job->id}, {"world_size", absl::StrCat(job->world_size)}});
  return job;
}

absl::Status Membership::ReplaceRestartedMember(Job& job, const std::string& worker_id,
                                                const std::string& incarnation, absl::Time now,
                                                Deferred& deferred) {
  MemberState* member = job.FindMember(worker_id);
  assert(member != nullptr && member->alive && !member->left);
  const bool restarted = member->incarnation != incarnation;
  const absl::Time evidence = job.death_evidence;
  job.death_evidence = std::min(evidence, LastSignOfLife(job, *member, now));
  member->alive = false;
  log_->Log("member_dead",
            {{"job", job.id},
             {"worker", member->worker_id},
             {"rank", absl::StrCat(member->rank)},
             {"generation", absl::StrCat(job.members_generation)},
             {"reason", restarted ? "restarted (a join from a new incarnation)"
                                  : "gave its generation up (its own process joined again)"}});
  absl::Status s =
      StartGeneration(job, job.world_size, v1::DEGRADED,
                      absl::StrCat("worker '", worker_id, "' (rank ", member->rank, ") ",
                                   restarted ? "restarted" : "joined again (its setup failed)"),
                      deferred);
  if (!s.ok()) {
    member->alive = true;  // nothing changed
    job.death_evidence = evidence;
    return s;
  }
  job.StopWatching(member->rank);
  job.degraded_at = now;
  return absl::OkStatus();
}

uint64_t Membership::AddPendingJoin(Job& job, const v1::JoinRequest& request, absl::Time deadline,
                                    absl::Time now, ClockStart clock, JoinDone done,
                                    Deferred& deferred) {
  if (!job.recovery_options_known) {
    job.recovery_options_known = true;
    job.min_world_size = request.min_world_size();
    job.rejoin_grace = absl::Milliseconds(request.rejoin_grace_ms());
  }
  job.world_multiple = std::max(job.world_multiple, request.world_multiple());
  if (job.goodput.StepsCompleted(request.steps_completed())) job.goodput_changed = true;
  const uint64_t id = next_join_id_++;
  PendingJoin& p = job.pending[request.worker_id()];
  p.id = id;
  p.worker_id = request.worker_id();
  p.host = request.host();
  p.incarnation = request.incarnation();
  p.node = request.node();
  p.skip_member_table = request.skip_member_table();
  p.clock = clock;
  p.deadline = std::min(deadline, now + options_.join_timeout);
  p.joined_at = now;
  p.done = std::move(done);
  pending_by_id_[id] = PendingPlace{job.id, request.worker_id()};
  log_->Log("join", {{"job", job.id},
                     {"worker", request.worker_id()},
                     {"host", request.host()},
                     {"generation", absl::StrCat(job.generation)},
                     {"joined", absl::StrCat(job.pending.size(), "/", job.world_size)}});
  // A formed job's pending joins are growers: they wait for MaybeGrowBack.
  // A world size of part of a shard group (growers widened it) forms after
  // --rejoin_grace with whole groups only (MaybeShrink); a job that never
  // shrinks has none.
  const int m = job.world_multiple;
  const bool whole = m <= 1 || job.world_size % m == 0 || job.min_world_size <= 0;
  if (!job.formed() && whole && static_cast<int>(job.pending.size()) == job.world_size) {
    FormGeneration(job, deferred);
  }
  return id;
}

uint64_t Membership::Join(const v1::JoinRequest& request, absl::Time deadline, JoinDone done,
                          ClockStart clock) {
  if (absl::Status invalid = ValidateJoinRequest(request); !invalid.ok()) {
    done(invalid);
    return 0;
  }
  Deferred deferred;
  absl::StatusOr<uint64_t> id;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    auto it = jobs_.find(request.job_id());
    Job* job = it == jobs_.end() ? nullptr : it->second.get();
    absl::StatusOr<JoinKind> kind = ClassifyJoin(request, job);
    absl::StatusOr<Job*> joined =
        kind.ok() ? ApplyJoin(*kind, request, job, now, deferred) : kind.status();
    id = joined.ok()
             ? AddPendingJoin(**joined, request, deadline, now, clock, std::move(done), deferred)
             : absl::StatusOr<uint64_t>(joined.status());
  }
  // Answers go out below: what they tell is durable first. (A failed sync is
  // logged; the answers stand, as the change stands in memory and in the file.)
  SyncState(LastCommit()).IgnoreError();
  for (auto& f : deferred) f();
  if (!id.ok()) {
    done(id.status());
    return 0;
  }
  return *id;
}

void Membership::CancelJoin(uint64_t join_id) {
  JoinDone done;
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_by_id_.find(join_id);
    if (it == pending_by_id_.end()) return;
    Job& job = *jobs_[it->second.job_id];
    auto p = job.pending.find(it->second.worker_id);
    pending_by_id_.erase(it);
    if (p != job.pending.end() && p->second.id == join_id) {
      log_->Log("join_cancelled", {{"job", job.id}, {"worker", p->first}});
      done = std::move(p->second.done);
      job.pending.erase(p);
    }
    // A job that never formed is gone with its last pending join.
    if (job.members.empty() && ForgetIfIdle(job, clock_->Now(), deferred)) {
      const std::string job_id = job.id;  // `job` goes with the erase
      jobs_.erase(job_id);
    }
  }
  SyncState(LastCommit()).IgnoreError();
  for (auto& f : deferred) f();
  if (done) done(absl::CancelledError("join cancelled by the caller"));
}

}  // namespace zeroshard
