// Heartbeats: a member's beat recorded and answered (CONTINUE, or abort for
// a new generation), member checks, closed heartbeat streams (evidence for
// the failure detector) and join answers that could not be delivered.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "shard_server/membership/assign_telemetry.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

absl::Status Membership::CheckMember(const v1::MemberCredentials& member) {
  int64_t commit = 0;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Job*> job = FindMemberJob(member, /*allow_stale=*/false);
    if (!job.ok()) return job.status();
    if (absl::Status s = SaveUnsaved(**job); !s.ok()) return s;
    const MemberState& m = (*job)->members[member.rank()];
    if (m.left) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", m.rank, " of job '", (*job)->id, "' has left; join again"));
    }
    commit = (*job)->commit;
  }
  return SyncState(commit);
}

absl::StatusOr<v1::HeartbeatResponse> Membership::Heartbeat(const v1::HeartbeatRequest& request,
                                                            uint64_t stream) {
  int64_t commit = 0;
  absl::StatusOr<v1::HeartbeatResponse> response;
  {
    absl::MutexLock lock(&mu_);
    response = RecordHeartbeat(request, request.member(), stream, &commit);
  }
  if (absl::Status s = SyncState(commit); !s.ok() && response.ok()) return s;
  return response;
}

std::vector<absl::StatusOr<v1::HeartbeatResponse>> Membership::Heartbeats(
    const std::vector<StreamBeat>& beats) {
  std::vector<absl::StatusOr<v1::HeartbeatResponse>> responses;
  responses.reserve(beats.size());
  int64_t commit = 0;  // the state store's sequence: the latest covers every job's
  {
    absl::MutexLock lock(&mu_);
    for (const StreamBeat& beat : beats) {
      int64_t job_commit = 0;
      const v1::MemberCredentials& member =
          beat.member != nullptr ? *beat.member : beat.request->member();
      responses.push_back(RecordHeartbeat(*beat.request, member, beat.stream, &job_commit));
      commit = std::max(commit, job_commit);
    }
  }
  if (absl::Status s = SyncState(commit); !s.ok()) {
    for (absl::StatusOr<v1::HeartbeatResponse>& response : responses) {
      if (response.ok()) response = s;
    }
  }
  return responses;
}

absl::StatusOr<v1::HeartbeatResponse> Membership::RecordHeartbeat(
    const v1::HeartbeatRequest& request, const v1::MemberCredentials& member, uint64_t stream,
    int64_t* commit) {
  // What the beat would make the job keep is bounded before anything of it is.
  if (absl::Status s = ValidateBeatPayload(request); !s.ok()) return s;
  absl::StatusOr<Job*> found = FindMemberJob(member, /*allow_stale=*/true);
  if (!found.ok()) return found.status();
  Job& job = **found;
  MemberState& m = job.members[member.rank()];
  if (m.left) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", m.rank, " of job '", job.id, "' has left; join again"));
  }
  const absl::Time now = clock_->Now();
  if (m.heartbeat_seen && now - m.last_heartbeat > 2 * options_.heartbeat_interval) {
    // A member back from a silence (its network, or the server's): the time
    // its heartbeats took to resume shows here.
    LogResumed(job, m, now - m.last_heartbeat, now);
  }
  if (job.formed() && member.generation() == job.generation &&
      request.collective_seq() > m.collective_seq) {
    job.data_plane_advanced = now;
  }
  m.last_heartbeat = now;
  if (m.alive) job.silence.MoveToBack(m.rank);
  // Both are empty in a steady job: skip the hash probes then.
  if (!job.undelivered.empty()) job.undelivered.erase(m.rank);  // a beat starts the clock
  if (!job.closed_streams.empty()) job.closed_streams.erase(m.rank);
  m.beating_stream = stream;
  m.heartbeat_seen = true;
  m.step = request.step();
  m.loss = request.loss();
  m.memory_bytes = request.memory_bytes();
  m.collective_seq = request.collective_seq();
  m.last_step = request.last_step();
  m.snapshot_step = request.snapshot_step();
  if (request.peer_failure() && job.formed() && member.generation() == job.generation &&
      job.suspect_generation != job.generation) {
    job.suspect_generation = job.generation;
    log_->Log("peer_failure_reported", {{"job", job.id},
                                        {"worker", m.worker_id},
                                        {"rank", absl::StrCat(m.rank)},
                                        {"generation", absl::StrCat(job.generation)}});
  }
  if (request.has_recovery()) RecordRecovery(job, request.recovery());
  if (request.outer_steps_size() > 0) RecordOuterSteps(job, request.outer_steps());
  AssignTelemetry(request.telemetry(), &m.telemetry);
  RecordGoodputBeat(job, member.generation(), member.rank(), request);
  // The beat above counts (the member is alive); the answer waits for the
  // job's unsaved change, which may be what the member must hear.
  if (absl::Status s = SaveUnsaved(job); !s.ok()) return s;
  v1::HeartbeatResponse response;
  response.set_generation(job.generation);
  if (job.formed() && m.alive) {
    response.set_command(v1::CONTINUE);
  } else {
    response.set_command(v1::ABORT_GENERATION_CHANGED);
    response.set_reason(absl::StrCat("job '", job.id, "' moved from generation ",
                                     member.generation(), " to ", job.generation,
                                     ": abort collectives and join again"));
    // When it was decided: every rank's recovery is measured from it.
    if (!job.history.empty() && job.history.back().generation == job.generation) {
      response.set_verdict_unix_ms(absl::ToUnixMillis(job.history.back().at));
    }
  }
  *commit = job.commit;
  return response;
}

void Membership::RecordRecovery(Job& job, const v1::RecoveryRecord& r) {
  bool fresh = job.recoveries.empty() || job.recoveries.back().generation() != r.generation() ||
               job.recoveries.back().phase() != r.phase();
  if (fresh) {
    if (!job.recoveries.empty() && job.recoveries.back().generation() == r.generation()) {
      job.recoveries.back() = r;
    } else {
      job.recoveries.push_back(r);
      while (job.recoveries.size() > 32) job.recoveries.pop_front();
    }
    log_->Log(absl::StrCat("recovery_", r.phase()),
              {{"job", job.id},
               {"generation", absl::StrCat(r.generation())},
               {"source", r.source()},
               {"restored_step", absl::StrCat(r.restored_step())},
               {"failed_step", absl::StrCat(r.failed_step())},
               {"world_size", absl::StrCat(r.world_size())},
               {"rejoin_ms", absl::StrFormat("%.0f", r.rejoin_ms())},
               {"restore_ms", absl::StrFormat("%.0f", r.restore_ms())},
               {"first_step_ms", absl::StrFormat("%.0f", r.first_step_ms())}});
  }
}

// The lines of one job's second that are written one per member: enough to
// name every rank of a host or two that came back, or of a test's job.
constexpr int kResumedListed = 64;

void Membership::LogResumed(Job& job, const MemberState& m, absl::Duration silent, absl::Time now) {
  FlushResumed(job, now);
  if (job.resumed_listed < kResumedListed) {
    ++job.resumed_listed;
    log_->Log("heartbeat_resumed", {{"job", job.id},
                                    {"worker", m.worker_id},
                                    {"rank", absl::StrCat(m.rank)},
                                    {"alive", m.alive ? "true" : "false"},
                                    {"silent_ms", Ms(silent)}});
    return;
  }
  ++job.resumed_unlisted;
  job.resumed_unlisted_longest = std::max(job.resumed_unlisted_longest, silent);
}

void Membership::FlushResumed(Job& job, absl::Time now) {
  if (now - job.resumed_window < absl::Seconds(1)) return;
  if (job.resumed_unlisted > 0) {
    log_->Log("heartbeats_resumed_unlisted",
              {{"job", job.id},
               {"members", absl::StrCat(job.resumed_unlisted)},
               {"longest_silent_ms", Ms(job.resumed_unlisted_longest)},
               {"listed", absl::StrCat(job.resumed_listed)}});
  }
  job.resumed_window = now;
  job.resumed_listed = 0;
  job.resumed_unlisted = 0;
  job.resumed_unlisted_longest = absl::ZeroDuration();
}

void Membership::HeartbeatStreamClosed(const v1::MemberCredentials& member, uint64_t stream) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Job*> found = FindMemberJob(member, /*allow_stale=*/false);
  if (!found.ok()) return;
  MemberState& m = (*found)->members[member.rank()];
  // A connection the member already replaced (its network was out, and the
  // server's keepalive or a RST closes the old one late) says nothing.
  if (stream != m.beating_stream) return;
  m.stream_closed = clock_->Now();
  (*found)->closed_streams.insert(m.rank);
}

void Membership::AnswersUndeliverable(const std::vector<UndeliveredAnswer>& answers) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (const UndeliveredAnswer& answer : answers) {
    auto it = jobs_.find(answer.job_id);
    if (it == jobs_.end()) continue;
    Job& job = *it->second;
    if (job.members_generation != answer.generation || answer.rank < 0 ||
        answer.rank >= static_cast<int>(job.members.size())) {
      continue;  // an answer of an older generation: its clock is moot
    }
    job.StartClock(answer.rank, now);
  }
}

}  // namespace zeroshard
