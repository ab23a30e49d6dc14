// The worker's recovery: which state a generation starts from (agreed by
// every rank: the initial state, peers' in-memory snapshots, the last complete
// checkpoint on disk, or the seed), and what a failure means (a peer died:
// give the generation up and join again; anything else: exit). The decision
// itself is a pure function in worker/recovery/recovery_decision.h; this file
// is the Worker's side of it.
#include <signal.h>

#include <cassert>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/checkpoint_format.h"
#include "common/status_context.h"
#include "worker/checkpoint_loading.h"
#include "worker/comm/client_kv_store.h"
#include "worker/comm/two_level_communicator.h"
#include "worker/recovery/global_batch.h"
#include "worker/recovery/recovery_agreement.h"
#include "worker/recovery/snapshot_restore.h"
#include "worker/worker.h"

namespace zeroshard {

absl::Status Worker::Restore() {
  assert(generation_ != nullptr && generation_->engine != nullptr &&
         "Restore before BootstrapDataPlane");
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  generation_->start_step = 0;
  task_->SetDataCursor(0, 0);
  absl::StatusOr<RecoveryDecision> decision = AgreeOnSource();
  if (!decision.ok()) return Annotate(decision.status(), "recovery: agreeing on the state");
  absl::Status s = decision->source == RecoverySource::kInitial ? RestoreInitialState()
                                                                : RecoverFrom(*decision);
  // Read from files (--resume, --init_from, the last complete step): a
  // refusal of what they hold is the job's, not a peer's or this host's.
  // Peers' snapshots and the seed are not files.
  const bool from_files = decision->source == RecoverySource::kInitial ||
                          decision->source == RecoverySource::kDisk;
  if (!s.ok() && from_files && !abort_->tripped() && IsInputFailure(s)) failed_on_inputs_ = true;
  return s;
}

bool Worker::IsInputFailure(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsDataLoss(s) || absl::IsNotFound(s) ||
         absl::IsFailedPrecondition(s) || absl::IsOutOfRange(s);
}

void Worker::ReportFailure(const absl::Status& failure) {
  if (client_ == nullptr) return;
  if (absl::Status s = client_->Leave(ledger_.Generation(), failure.ToString()); !s.ok()) {
    std::fprintf(stderr,
                 "shard_worker rank %d: telling the server this failure ended the job failed "
                 "(%s); the others find out when they time out\n",
                 rank_, s.ToString().c_str());
  }
}

absl::StatusOr<RecoveryDecision> Worker::AgreeOnSource() {
  ClientKvStore store(client_.get());
  const std::string& root = config_.checkpoint.dir;
  const auto& members = generation_->membership.members;
  const std::string host =
      rank_ < static_cast<int>(members.size()) ? members[rank_].host() : std::string();
  return AgreeOnRecoverySource(
      &store, rank_, world(), HoldingsOf(snapshots_.keeper(), trained_, host), generation_->plan,
      [&] { return root.empty() ? int64_t{-1} : LatestCompleteStep(root, config_.job); },
      config_.data_plane.timeout,
      // Stages 0-2 load every parameter row (ZeroEngine::Initialize).
      /*every_row=*/config_.engine.stage < 3);
}

absl::Status Worker::RecoverFrom(const RecoveryDecision& decision) {
  const std::string source(RecoverySourceName(decision.source));
  if (absl::Status s = LoadRecoverySource(decision); !s.ok()) {
    return Annotate(s, absl::StrCat("recovery from ", source, " (step ", decision.step, ")"));
  }
  Generation& g = *generation_;
  g.start_step = static_cast<int>(decision.step);
  if (timeline_.recovering() || rank_ == 0) {
    timeline_.Restored(g.membership.generation, decision.source, decision.step, world(),
                       absl::Now());
    timeline_.Transferred(decision.transfers);
    if (rank_ == 0) {
      Progress progress;
      progress.step = decision.step;
      progress.snapshot_step = snapshots_.keeper().committed_step();
      progress.recovery = timeline_.record();
      client_->ReportProgress(progress);
    }
  }
  std::fprintf(stderr,
               "shard_worker rank %d: recovery: restored step %lld from %s at world size %d "
               "(generation %lld, %s)\n",
               rank_, static_cast<long long>(decision.step), source.c_str(), world(),
               static_cast<long long>(g.membership.generation), decision.why.c_str());
  return absl::OkStatus();
}

absl::Status Worker::LoadRecoverySource(const RecoveryDecision& decision) {
  switch (decision.source) {
    case RecoverySource::kSnapshot:
      return RestoreFromSnapshots(decision);
    case RecoverySource::kDisk:
      return RestoreFromDisk(decision.step);
    case RecoverySource::kScratch:
      return InitializeFromSeed();
    case RecoverySource::kInitial:
      break;
  }
  return absl::InternalError("a recovery with nothing to recover from");
}

absl::Status Worker::RestoreFromDisk(int64_t step) {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened = CheckpointReader::OpenStep(
      absl::StrCat(config_.checkpoint.dir, "/", CheckpointStepDir(config_.job, step)),
      CheckpointShardFileName(rank_, world()));
  if (!opened.ok()) return opened.status();
  absl::Status s = LoadFrom(opened->get());
  // Saved before data cursors were recorded: by a job whose world size never
  // changed.
  if (s.ok() && (*opened)->data_row() < 0) task_->SetDataCursor(0, 0);
  return s;
}

absl::Status Worker::RestoreFromSnapshots(const RecoveryDecision& decision) {
  absl::StatusOr<SnapshotPieces> pieces =
      GatherSnapshotPieces(decision, rank_, &snapshots_.keeper(),
                           generation_->data_plane->snapshot.get(), config_.data_plane.timeout);
  if (!pieces.ok()) return pieces.status();
  for (const SnapshotTransfer& t : decision.transfers) {
    if (t.to != rank_) continue;
    std::fprintf(stderr,
                 "shard_worker rank %d: recovery: old rank %d's snapshot of step %lld from rank "
                 "%d (%s)\n",
                 rank_, t.old_rank, static_cast<long long>(decision.step), t.from,
                 std::string(TransferKindName(t.kind)).c_str());
  }
  if (pieces->reader == nullptr) return absl::OkStatus();  // a rank with no piece
  const absl::Time start = absl::Now();
  absl::Status loaded = LoadFrom(pieces->reader.get());
  std::fprintf(stderr,
               "shard_worker rank %d: recovery: snapshot blobs moved in %.0f ms (%d received), "
               "loaded in %.0f ms\n",
               rank_, pieces->moved_ms, pieces->received,
               absl::ToDoubleMilliseconds(absl::Now() - start));
  return loaded;
}

absl::Status Worker::InitializeFromSeed() {
  const uint64_t seed = config_.task.seed;
  Model* const m = task_->model();
  return generation_->engine->Initialize(
      [&](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
        m->InitRows(t, begin, end, seed, out);
        return absl::OkStatus();
      });
}

// A fresh job: --resume, --init_from or the seed.
absl::Status Worker::RestoreInitialState() {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      OpenInitialCheckpoint(config_.initial, config_.checkpoint.dir, config_.job, rank_, world());
  if (!reader.ok()) return reader.status();
  if (*reader == nullptr) {
    absl::Status s = InitializeFromSeed();
    return s.ok() ? s : Annotate(s, "initialize");
  }
  absl::Status s = LoadFrom(reader->get());
  // --init_from starts the data at row 0 whatever the file says.
  if (config_.initial.resume == InitialState::Resume::kOff) task_->SetDataCursor(0, 0);
  return s;
}

absl::Status Worker::LoadFrom(CheckpointReader* reader) {
  Generation& g = *generation_;
  absl::StatusOr<LoadedPosition> loaded =
      LoadEngineState(reader, *g.engine, config_.engine, /*log_notes=*/rank_ == 0);
  if (!loaded.ok()) return loaded.status();
  if (loaded->step > 0) g.start_step = static_cast<int>(loaded->step);
  if (loaded->data_row >= 0) task_->SetDataCursor(g.start_step, loaded->data_row);
  if (rank_ == 0) {
    std::fprintf(stderr, "restored %s (step %d)\n", reader->source().c_str(), g.start_step);
  }
  return absl::OkStatus();
}

// ---- Recovery ----

absl::Status Worker::PlanGenerationBatch() {
  Generation& g = *generation_;
  const bool shrunk = world() < config_.world_size;
  if (shrunk) {
    // Ranks that planned different layouts would train other rows and stop
    // matching collectives; a mix of the flag is refused, by name, on every
    // rank alike (each reads every rank's value; ExchangeHostKeys is the
    // generation's one-string-per-rank exchange, used here for the flag).
    ClientKvStore store(client_.get());
    absl::StatusOr<std::vector<std::string>> flags = ExchangeHostKeys(
        &store, rank_, world(), "keep_global_batch", config_.recovery.keep_global_batch ? "1" : "0",
        config_.data_plane.timeout);
    if (!flags.ok()) return Annotate(flags.status(), "--keep_global_batch: exchanging the flag");
    std::vector<std::string> off;
    for (int r = 0; r < world(); ++r) {
      if ((*flags)[r] == "0") off.push_back(absl::StrCat(r));
    }
    if (!off.empty() && off.size() != flags->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--keep_global_batch: rank(s) ", absl::StrJoin(off, ", "),
          " run with --keep_global_batch=false and the others with true, so after the shrink to ",
          world(),
          " ranks they would train different rows and stop matching collectives: give every "
          "worker the same --keep_global_batch"));
    }
  }
  const GlobalBatchPlan plan =
      PlanGlobalBatch(config_.recovery.keep_global_batch, config_.world_size, world(),
                      config_.engine.grad_accum, config_.task.batch);
  g.layout = plan.layout;
  g.global_batch_kept = plan.kept;
  task_->SetBatchLayout(plan.layout);
  if (!plan.note.empty()) {
    std::fprintf(stderr, "shard_worker rank %d: generation %lld at %s\n", rank_,
                 static_cast<long long>(g.membership.generation), plan.note.c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Worker::ConfirmFailure(const absl::Status& failure, bool in_setup) {
  if (abort_->tripped()) return false;
  // A failed collective: a peer died, or is stuck. The server confirms a
  // death by ending the generation. In setup, any failure but this
  // worker's own configuration (INVALID_ARGUMENT) is worth a re-join.
  const bool recoverable = in_setup ? !absl::IsInvalidArgument(failure)
                                    : absl::IsUnavailable(failure) ||
                                          absl::IsDeadlineExceeded(failure) ||
                                          absl::IsAborted(failure) || absl::IsDataLoss(failure);
  if (!recoverable) return failure;
  // Telling the server now lets it declare a silent peer dead within
  // about one heartbeat interval (at once when the peer's heartbeat stream
  // closed) instead of after the whole heartbeat timeout.
  client_->ReportPeerFailure();
  const JoinInfo& m = generation_->membership;
  const absl::Duration wait = m.heartbeat_timeout + 2 * m.heartbeat_interval + absl::Seconds(1);
  if (!abort_->WaitTripped(wait) && client_->SinceHeartbeatAnswer() > m.heartbeat_timeout) {
    // The server cannot be reached from here either: this host is cut off
    // (from its peers and the server), and the server has most likely
    // ended the generation without being able to say so. Re-join like a
    // survivor: a cut that heals within --rejoin_timeout heals.
    abort_->Trip(absl::StrCat(
        "during step ", step_.load(), ": ", failure.message(), ", and the server at ",
        config_.client.server, " has not answered a heartbeat for ",
        absl::FormatDuration(absl::Trunc(client_->SinceHeartbeatAnswer(), absl::Seconds(1))),
        " (this host is cut off?); re-joining within --rejoin_timeout=",
        absl::FormatDuration(config_.recovery.rejoin_timeout)));
  }
  if (!abort_->tripped() && !in_setup) {
    return absl::Status(
        failure.code(),
        absl::StrCat(failure.message(), " (and the server did not end the ", "generation within ",
                     absl::FormatDuration(wait), ", so no peer died: not recovering)"));
  }
  return !abort_->tripped();  // tripped: the server ended it
}

absl::Status Worker::PrepareRecovery(const absl::Status& failure) {
  const absl::Time seen = absl::Now();
  if (generation_ == nullptr || config_.recovery.max_recoveries == 0) return failure;
  // A non-finite step or corrupted replicas stop every rank at the same
  // collective; a peer that exited first makes the server end the
  // generation, which must not turn this rank's stop into a recovery.
  if (IsNonFiniteStop(failure)) return failure;
  // The job's inputs: a re-join would meet them again.
  if (failed_on_inputs_) return failure;
  const bool in_setup = !generation_->training;
  // give_up: the generation stands (no peer died) but its setup failed here.
  absl::StatusOr<bool> give_up = ConfirmFailure(failure, in_setup);
  if (!give_up.ok()) return give_up.status();
  const bool give_up_generation = *give_up;
  const std::string why =
      give_up_generation
          ? absl::StrCat("setting up generation ", generation_->membership.generation, " failed (",
                         failure.message(),
                         ") and no peer died; giving the generation up to join again")
          : abort_->message();
  if (recoveries_ >= config_.recovery.max_recoveries) {
    return absl::AbortedError(absl::StrCat(
        why, "; not recovering: ", recoveries_,
        " recoveries already (--max_recoveries=", config_.recovery.max_recoveries, ")"));
  }
  // Confirmed: the server's abort (at once when it came first), or a setup
  // given up.
  absl::Time verdict = absl::InfinitePast();
  {
    absl::MutexLock lock(&abort_mu_);
    verdict = std::exchange(verdict_, absl::InfinitePast());
  }
  timeline_.FailureSeen(seen, absl::Now(), step_.load(), verdict);
  std::fprintf(stderr, "shard_worker rank %d: %s; recovering (%d of at most %d)\n", rank_,
               why.c_str(), recoveries_ + 1, config_.recovery.max_recoveries);
  EndGeneration();
  // No late command may trip the cleared latch; and a closed heartbeat
  // stream is what lets the server replace this member with its next join.
  client_->StopHeartbeats();
  abort_->Reset();
  // Tests only: ZEROSHARD_TEST_STOP_BEFORE_REJOIN=RANK stops that rank's
  // process (SIGSTOP) on its way to its first re-join, silent, as a stalled
  // host is, until the test continues it (SIGCONT): a survivor held back
  // after the server ended the generation, whatever the machine's speed.
  if (const char* stop = std::getenv("ZEROSHARD_TEST_STOP_BEFORE_REJOIN");
      stop != nullptr && recoveries_ == 0 && std::atoi(stop) == rank_) {
    std::fprintf(stderr, "shard_worker rank %d: stopping before its re-join (test)\n", rank_);
    raise(SIGSTOP);
  }
  ++recoveries_;
  return absl::OkStatus();
}

}  // namespace zeroshard
