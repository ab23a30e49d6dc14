// Each job's goodput ledger (shard_server/goodput/goodput_ledger.h): fed by
// the job's events (created, formed, a verdict, finished: membership.cc,
// joins.cc, deaths.cc, leave.cc) and its beats, saved in the state store's
// goodput table, restored with the job.
#include <algorithm>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {
namespace {

// How often a ledger that changed (beats' reports, samples) is saved between
// phase changes: a restarted server loses at most this much of the ledger's
// detail, and the workers' cumulative ledgers make the running time up.
constexpr absl::Duration kGoodputSaveEvery = absl::Seconds(10);

}  // namespace

GoodputLedger::Phase Membership::GoodputPhase(const Job& job) {
  if (job.state == v1::FINISHED || job.state == v1::FAILED) return GoodputLedger::Phase::kNone;
  if (job.formed()) return GoodputLedger::Phase::kRunning;
  return job.state == v1::JOINING ? GoodputLedger::Phase::kRendezvous
                                  : GoodputLedger::Phase::kReforming;
}

absl::Time Membership::LastSignOfLife(const Job& job, const MemberState& m, absl::Time now) {
  absl::Time last = m.last_heartbeat;
  if (!m.heartbeat_seen && job.restored_at != absl::InfinitePast() &&
      job.members_generation == job.restored_generation) {
    last = job.restored_at;  // its last_heartbeat is the restore's grace, ahead of now
  }
  if (m.stream_closed > m.last_heartbeat) last = m.stream_closed;
  return std::min(last, now);
}

void Membership::SaveGoodput(Job& job, absl::Time now, bool phase_changed) {
  if (phase_changed) job.goodput_changed = true;
  if (state_ == nullptr || !job.goodput_changed) return;
  if (!phase_changed && !job.goodput_save_failing &&
      now - job.goodput_saved_at < kGoodputSaveEvery) {
    return;
  }
  std::string bytes;
  job.goodput.State().SerializeToString(&bytes);
  if (absl::Status s = state_->SaveGoodput(job.id, bytes); !s.ok()) {
    if (!job.goodput_save_failing) {
      log_->Log("state_store_error", {{"job", job.id},
                                      {"change", "goodput ledger"},
                                      {"error", s.ToString()},
                                      {"retry", "every tick"}});
    }
    job.goodput_save_failing = true;
    return;
  }
  job.goodput_save_failing = false;
  job.goodput_changed = false;
  job.goodput_saved_at = now;
}

absl::Status Membership::RestoreGoodput(absl::Time now) {
  absl::StatusOr<std::map<std::string, std::string>> saved = state_->LoadGoodput();
  if (!saved.ok()) return saved.status();
  for (auto& [id, job] : jobs_) {
    job->restored_at = now;
    job->restored_generation = job->members_generation;
    auto it = saved->find(id);
    if (it != saved->end()) {
      v1::GoodputState state;
      absl::StatusOr<GoodputLedger> ledger =
          state.ParseFromString(it->second)
              ? GoodputLedger::FromState(state)
              : absl::DataLossError("goodput state: not a GoodputState message");
      if (ledger.ok()) {
        job->goodput = *std::move(ledger);
      } else {
        // The job runs on; its ledger starts again from here.
        log_->Log("goodput_restore_failed", {{"job", id}, {"error", ledger.status().ToString()}});
      }
    }
    // A job saved by a server from before the ledger, or one that stopped
    // between the job's save and the ledger's: its phase from here on.
    const GoodputLedger::Phase phase = GoodputPhase(*job);
    if (phase != job->goodput.phase() || (phase == GoodputLedger::Phase::kRunning &&
                                          job->goodput.generation() != job->members_generation)) {
      job->goodput.Reconcile(phase, job->members_generation, now);
      job->goodput_changed = true;
    }
  }
  return absl::OkStatus();
}

void Membership::RecordGoodputBeat(Job& job, int64_t generation, int rank,
                                   const v1::HeartbeatRequest& request) {
  bool changed = job.goodput.StepsCompleted(request.step());
  if (request.telemetry().has_time()) {
    changed = job.goodput.Report(generation, rank, request.telemetry().time()) || changed;
  }
  if (changed) job.goodput_changed = true;
}

void Membership::EndGoodputGeneration(Job& job, absl::Time now) {
  const absl::Time evidence = std::min(job.death_evidence, now);
  job.death_evidence = absl::InfiniteFuture();
  if (job.goodput.phase() != GoodputLedger::Phase::kRunning) return;
  job.goodput.GenerationEnded(evidence, now);
  SaveGoodput(job, now, /*phase_changed=*/true);
}

}  // namespace zeroshard
