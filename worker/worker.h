// Worker: one shard_worker process as a sequence of phases over explicit
// state. main (shard_worker.cc) runs them in order:
//
//   OpenDevice          the CUDA device (--backend=nccl); nothing for gloo
//   LoadTask            OpenBLAS threads, the model and its data
//   Join                joins the job (waiting for the rest of it) and starts heartbeats
//   Plan                the generation's shard plan, from the server
//   BootstrapDataPlane  the communicators, through the server's KV store; the engine
//   Restore             the initial parameters: the seed, --init_from or --resume
//   Train               the steps, with checkpoints
//   Report              final evaluation, sample, --eval_out, --summary_out, --report
//   Leave               a clean exit from the job
//
// Each phase returns the error that ends the run, its message the line main
// prints after "shard_worker rank R: ". None exits the process.
//
// State. What the process keeps across job generations — the config, the
// device, the task (model and data), the client and the metrics — is the
// Worker's. What belongs to one generation — the membership, the plan, the
// data plane and the engine — is a Generation, which Join starts and
// EndGeneration tears down, in the order the pointers between them need.
// After EndGeneration, Join → Plan → BootstrapDataPlane → Restore → Train may
// run again (a generation after a peer died resumes from a checkpoint).
//
// Abort. The server ends a generation through the heartbeat stream, on the
// client's heartbeat thread. The handler trips the AbortLatch with what
// shard_worker has always printed ("aborting during step N, in <collective>:
// <reason>", or "heartbeats refused during step N...: <status>") and aborts
// the data plane (Communicator::Abort), so the training thread's blocked
// collective fails now; phases also check the latch between steps. The
// error then travels up to main, which prints the latch's message and exits
// 3. The data plane and the engine are registered with the handler under a
// mutex from creation until just before destruction, so it never aborts
// objects being destroyed.
//
// Recovery (#13, docs/recovery.md). When a generation ends under a worker
// (the server's abort, or a failed collective that the server confirms by
// ending the generation within its heartbeat timeout), PrepareRecovery tears
// the generation down and clears the latch, and main runs Join .. Train again
// in this process (same worker id: same rank when W is unchanged), up to
// --max_recoveries times. Restore then starts with the agreement
// (worker/recovery/recovery_agreement.h): every rank publishes what it holds,
// rank 0 decides the source (worker/recovery/recovery_decision.h: snapshot,
// disk, scratch or initial) and every rank loads from it. The data cursor
// (the global row the next step starts at) travels with the state, so a job
// that shrank goes on from the next untrained row. With --keep_global_batch
// (the default) the survivors of a shrink accumulate the missing ranks'
// micro-batches, so every step keeps the original W's rows, order and loss
// scaling (worker/recovery/global_batch.h; when W' does not divide W x
// --grad_accum some survivors take one micro-batch more than others; with
// the flag off the per-rank batch is kept and the global batch shrinks
// with W).
//
// Goodput (#45, docs/goodput.md). ledger_ partitions this process's wall
// clock from each generation's join answer into causes (worker/time_ledger.h):
// RunStep gives it each finished step with the waits measured inside it,
// the phases between steps name their pauses (AccountAs), and the rest is
// startup/restore before a generation's first step and other after it. The
// generation's first ranks send it in heartbeats, Leave sends it, --report
// writes the process's sum (worker_goodput.cc).
//
// Not thread-safe: one thread runs the phases.
#ifndef ZEROSHARD_WORKER_WORKER_H_
#define ZEROSHARD_WORKER_WORKER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "common/plan/shard_plan.h"
#include "worker/abort_latch.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/checkpointer.h"
#include "worker/data/batch_layout.h"
#include "worker/data_plane.h"
#include "worker/loss_spike.h"
#include "worker/nonfinite_policy.h"
#include "worker/rank_telemetry.h"
#include "worker/recovery/recovery_decision.h"
#include "worker/recovery/recovery_timeline.h"
#include "worker/recovery/snapshot_keeper.h"
#include "worker/run_report.h"
#include "worker/snapshot_schedule.h"
#include "worker/time_ledger.h"
#include "worker/training_task.h"
#include "worker/worker_config.h"
#include "worker/zero/backend.h"
#include "worker/zero/engine.h"

namespace zeroshard {

class Checkpointer;

// One job generation, as the phases build it.
struct Generation {
  JoinInfo membership;                    // Join
  ShardPlan plan;                         // Plan
  std::unique_ptr<DataPlane> data_plane;  // BootstrapDataPlane
  DataPlaneOptions plane_options;         // what data_plane was connected with
  std::unique_ptr<ZeroEngine> engine;     // BootstrapDataPlane; uses data_plane
  int start_step = 0;                     // Restore: the first step Train runs
  // BootstrapDataPlane: which micro-batches each rank trains a step
  // (worker/data/batch_layout.h): W x --grad_accum of its own, or a shrunk
  // generation's share of the original W's under --keep_global_batch.
  BatchLayout layout;
  bool global_batch_kept = true;  // the step is the original world size's
  // Train began. Before it, the generation is being set up (the data plane,
  // the agreement on the state, the snapshot transfers): a failure there is
  // always recovered from by joining again (PrepareRecovery).
  bool training = false;
};

class Worker {
 public:
  // `abort` outlives the Worker.
  Worker(WorkerConfig config, AbortLatch* abort);
  // Ends the generation and stops heartbeats; does not Leave.
  ~Worker();

  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // ---- Before joining ----
  // --backend=nccl: opens the CUDA device (FAILED_PRECONDITION when there is
  // none, naming --backend=gloo as the way out). The engine and the MLP then
  // live on it.
  absl::Status OpenDevice();
  // Sets the OpenBLAS threads and makes the model with its data ("model:
  // ..." when the task's flags or data are wrong).
  absl::Status LoadTask();

  // ---- One job generation ----
  // Connects (once) and joins; starts a Generation and the heartbeats.
  absl::Status Join();
  // REQUIRES: Join.
  absl::Status Plan();
  // Connects the data plane and creates the engine. REQUIRES: Plan.
  absl::Status BootstrapDataPlane();
  // Fills the engine from the seed, --init_from or --resume, and sets the
  // step Train starts at. REQUIRES: BootstrapDataPlane.
  absl::Status Restore();
  // Trains to --steps, checkpointing as asked; waits for the last
  // checkpoint's commit. REQUIRES: Restore.
  absl::Status Train();
  // The job's line (rank 0), or this rank's (the others), as training starts.
  void LogTrainingStart(const Generation& g) const;
  // The training loop's checkpointer while it trains (null after): heartbeats carry its
  // pending commits.
  void SetCheckpointer(Checkpointer* checkpointer) ABSL_LOCKS_EXCLUDED(abort_mu_);
  // Aborts and drops the generation's engine and data plane (and the
  // generation). Idempotent.
  void EndGeneration();

  // ---- After training ----
  // Collective (every rank runs it). REQUIRES: Train.
  absl::Status Report();
  // Stops heartbeats and leaves the job. REQUIRES: Join.
  absl::Status Leave();
  // Why the last checkpoint failed though training completed (a full disk,
  // or the step abandoned by another rank); OK when it did not. Train then
  // succeeds, so the worker reports and leaves like its peers (none waits
  // for it as for a dead rank: #44 finding 8), and exits 1 with this after.
  const absl::Status& last_checkpoint_failure() const { return last_checkpoint_failure_; }
  // Whether the generation's setup failed on the job's inputs (Restore: the
  // checkpoint read refused the model's shapes, a damaged or missing
  // shard): every worker in this one's place would fail the same way, so it
  // does not recover; ReportFailure ends the job for its peers.
  bool failed_on_inputs() const { return failed_on_inputs_; }
  // Leaves the job with `failure` (LeaveRequest.failure): the server fails
  // the job and tells the other members. Best effort: a server that cannot be
  // reached is said so on stderr. REQUIRES: Join.
  void ReportFailure(const absl::Status& failure);

  // ---- Recovery ----
  // After `failure` ended a phase between Join and Train: OK when the worker
  // should go around again (the generation is torn down, heartbeats stopped,
  // the latch cleared); otherwise the error that ends the process. A failure
  // while the generation is set up (before Train) is recovered from even
  // when no peer died: the worker gives the generation up and joins again,
  // which starts a new one for every member (a stray connection, a peer's
  // trouble, a generation that moved on are no reason to end the job).
  // --max_recoveries bounds both.
  absl::Status PrepareRecovery(const absl::Status& failure);

  // This member's rank; -1 before Join.
  int rank() const { return rank_; }

 private:
  // ---- Shard groups (worker_groups.cc) ----
  // --shard_group_size's G for this generation (0: none); with 'host', the
  // ranks per host, agreed through the KV store.
  absl::StatusOr<int> ShardGroupSize();
  // --secondary_shard_group_size's H (hpZ) for this generation (0: off),
  // checked against the world size and the shard groups of G ranks.
  absl::StatusOr<int> SecondaryGroupSize(int shard_group_size);
  // The ranks per host, agreed through the KV store under `key`;
  // FAILED_PRECONDITION naming `flag` when a host's ranks are not consecutive.
  absl::StatusOr<int> ConsecutiveRanksPerHost(const char* flag, const char* key);
  // The heartbeat thread's handler: every command but CONTINUE ends the
  // generation.
  void OnServerCommand(const absl::StatusOr<v1::HeartbeatResponse>& reply)
      ABSL_LOCKS_EXCLUDED(abort_mu_);
  // ABORTED with the latch's message once the server ended the generation.
  absl::Status CheckNotAborted() const;
  // Registers the generation's data plane and engine with the heartbeat
  // handler (null: unregisters). A data plane registered after the abort is
  // aborted at once.
  void ExposeToAbort(DataPlane* data_plane, const ZeroEngine* engine)
      ABSL_LOCKS_EXCLUDED(abort_mu_);

  // Train's parts: one optimizer step (its micro-batches); an evaluation
  // after `completed_steps`.
  absl::Status RunStep(int step);
  // RunStep's passes: this rank's micro-batches of the step (the batch
  // layout's), then padding passes up to the step's count. Adds the time
  // spent waiting for batches to `data_wait` (seconds).
  absl::Status RunMicroBatches(ZeroEngine& e, int step, double* data_wait);
  // ---- Goodput (worker_goodput.cc) ----
  // Before the update: waits for the snapshot's and the checkpoint's copies
  // of the state it changes, their times into `timing`.
  void WaitForCopies(StepTiming* timing) ABSL_LOCKS_EXCLUDED(abort_mu_);
  // The step's report to the server, after `timeline_` saw it.
  Progress StepProgress(int step, const StepStats& stats, double ms, double items_per_second);
  // The first step after a recovery: its record, and the line saying so.
  void NoteFirstStep(int step);
  // This rank's peak FLOP/s: --peak_flops, else measured (CPU), else 0.
  double PeakFlops();
  // rank 0, once: where the peak came from.
  void SayPeakOnce();
  // --report's "goodput": the process's ledger, its MFU and its checks.
  GoodputSummary GoodputReport() const;
  // The step's verdict (StepStats::verdict): a replica mismatch or a
  // non-finite step stops the run or, under --on_nonfinite=skip, is counted.
  absl::Status ActOnVerdict(int step, const StepStats& stats);
  // After `completed` steps (`first`: the generation's first step): the
  // integrity checks, then the evaluation, checkpoint and snapshot due.
  absl::Status AfterStep(int completed, bool first, Checkpointer* checkpointer);
  // After `completed` steps: --testing_corrupt's bit flip, then
  // --replica_check_every's comparison of the replicas (replica_check.h).
  absl::Status CheckIntegrity(int completed);
  // --test_step_delay_ms on this rank before `step` (its ranks and until).
  bool TestStepDelayed(int step) const;
  // --sync=diloco: the outer step after `completed` steps when one is due
  // (outer_sync_config.h's OuterStepAfter), recorded in the run report.
  absl::Status MaybeOuterStep(int completed);
  // Streaming DiLoCo (worker_outer_stream.cc): after `completed` steps, the
  // pending fragment finished when due, the next one begun, or a full outer
  // step (outer_sync_config.h's FullOuterStepAfter); each finished one
  // recorded (its mean outer gradient norm over the ranks: a collective).
  absl::Status StreamOuterStep(int completed);
  // Every outer step's record (worker_outer_elastic.cc): in the run report,
  // and from rank 0 to the server and the log. `present`: the quorum's
  // groups (0: every group, no quorum); `took_part`: false when this rank's
  // group was left out.
  absl::Status RecordOuterStep(int completed, const OuterStats& outer, uint64_t present = 0,
                               bool took_part = true);
  void ReportOuterStep(const OuterStepRecord& record, const OuterStats& outer);
  // --outer_timeout (worker_outer_elastic.cc): whether it is on; the outer
  // step after `completed` over the groups its quorum lets in (or skipped,
  // this group being late); the quorum (a mask of groups; this group's
  // leader decides with the others through the KV store, the members read
  // the decision); the communicator over the present groups (null: alone).
  bool ElasticOuter() const;
  absl::Status ElasticOuterStep(int completed);
  absl::StatusOr<uint64_t> OuterQuorum(int completed);
  absl::StatusOr<Communicator*> PresentGroupsComm(uint64_t present);
  // PrepareRecovery's part before the server's abort: for a failure this
  // rank saw first (a collective's, or the generation's setup), whether it is
  // one to recover from, waiting for the server to end the generation (its
  // abort), or, when the server is out of reach, tripping the latch itself (a
  // cut-off host re-joins like a survivor). True: the generation stands and
  // its setup failed (give it up); false: the server ended it; an error:
  // not a failure to recover from.
  absl::StatusOr<bool> ConfirmFailure(const absl::Status& failure, bool in_setup);
  // ---- Rewinds (worker_rewind.cc; docs/numerics.md) ----
  // A bad step (a loss spike, a non-finite step under --loss_spike_zscore,
  // a replica mismatch) asks every rank, alike, to rewind to the last
  // committed in-memory snapshot: ActOnVerdict sets rewind_, Train calls
  // Rewind. Each returns OK having done it, or the stop that ends the run.
  struct RewindRequest {
    int64_t bad_step = 0;  // 0-based: the step whose verdict was bad
    int64_t to_step = 0;   // the snapshot's step (steps completed)
    std::string why;       // for people and --report
  };
  // Collective: the latest snapshot step at most `limit` that is complete
  // on every rank (its own blob and its buddy's copy, or its replica run)
  // and whose own blob from this generation's plan every rank still holds
  // (-1: no rewind possible). Waits for the transfer in flight first.
  absl::StatusOr<int64_t> AgreeOnRewindTarget(int64_t limit);
  // ActOnVerdict's parts for the bad cases.
  absl::Status OnReplicaMismatch(int step, const StepVerdict& verdict);
  absl::Status OnBadStep(int step, const StepVerdict& verdict, bool* handled);
  // After a rewind for a replica mismatch, the re-run's check at the same
  // step agreed: names the rank(s) whose hash changed, reports to the server,
  // and evicts a host whose rank was corrupted twice.
  absl::Status NameCorruptedRanks(int step);
  // Asks the server to evict `rank`'s machine (fence it, its members dead):
  // what happened, in words, for the stop line of the ranks there.
  std::string AskToEvict(int rank, int step);
  // Collective, in the re-run after a mismatch rewind, at the state the
  // mismatch was found in (`completed` steps): how far each rank's first-run
  // shard was from the re-run's (PendingMismatch::deviations).
  absl::Status CompareWithFirstRun(int completed);
  // Collective: loads the snapshot of rewind_->to_step on every rank (its own
  // blob), and with --replica_check_every checks the replicas agree on it.
  // The step Train runs next.
  absl::StatusOr<int> Rewind();
  // --replica_check_every: FAILED_PRECONDITION when the job at its full
  // size has no replicas (shard groups by host, every rank on one); a
  // shrunk job's checks pause instead (said on rank 0).
  absl::Status CheckReplicasExist(const ZeroEngine& e);
  // The hosts of this generation's members, by rank.
  std::vector<std::string> MemberHosts() const;
  absl::Status Evaluate(int completed_steps);
  // The generation's world size (smaller than --world_size after a shrink).
  int world() const { return generation_->membership.world_size; }
  // Restore's parts. A generation with state (a recovery) agrees on its
  // source (worker/recovery/) and loads from it; a fresh job starts from
  // --resume, --init_from or the seed. LoadFrom fills the engine from a
  // reader (parameters, moments, step, data cursor).
  absl::StatusOr<RecoveryDecision> AgreeOnSource();
  // Sets the generation's batch layout (worker/recovery/global_batch.h); in a
  // shrunk generation the members first agree on --keep_global_batch
  // through the KV store (INVALID_ARGUMENT naming them when they differ).
  absl::Status PlanGenerationBatch();
  absl::Status RecoverFrom(const RecoveryDecision& decision);
  absl::Status LoadRecoverySource(const RecoveryDecision& decision);
  absl::Status RestoreFromSnapshots(const RecoveryDecision& decision);
  absl::Status RestoreFromDisk(int64_t step);
  absl::Status RestoreInitialState();
  // Codes of a refusal of what a checkpoint holds (Restore).
  static bool IsInputFailure(const absl::Status& s);
  absl::Status InitializeFromSeed();
  absl::Status LoadFrom(CheckpointReader* reader);
  // The global data row of training step `step` under the current world.
  int64_t DataRow(int64_t step) const;
  // This rank's shard after `completed` steps, as checkpoints and snapshots
  // name it.
  // The step after `completed` at which a checkpoint is due (0: none).
  int64_t NextCheckpointStep(int completed, const CheckpointConfig& checkpoints) const;
  ShardIdentity IdentityAt(int completed) const;

  const WorkerConfig config_;
  AbortLatch* const abort_;

  // Process state.
  std::unique_ptr<Backend> device_;  // --backend=nccl; null: the CPU
  // config_'s, with the device filled in by OpenDevice.
  TaskOptions task_options_;
  EngineOptions engine_options_;
  std::unique_ptr<TrainingTask> task_;
  std::unique_ptr<Client> client_;
  RunMetrics metrics_;
  NonFinitePolicy nonfinite_{config_.numerics};  // process-wide: counts survive recoveries
  LossSpikeDetector spikes_{config_.loss_spike_zscore};
  std::optional<RewindRequest> rewind_;  // asked for by the last verdict
  int64_t spike_rewound_step_ = -1;      // the bad step the last spike rewind was for
  // The last step (steps completed) whose replica hashes agreed: a snapshot
  // no later than it holds state the replicas vouched for.
  int64_t last_verified_step_ = -1;
  // A replica mismatch rewound for: the check's step (0-based, the step whose
  // verdict compared; also the steps completed in the state it hashed), the
  // sets that differed, this rank's master shard then (when in one of them),
  // and, once the re-run reached that state again, every rank's largest
  // difference from it (-1: not in a set).
  struct PendingMismatch {
    int64_t step = -1;
    std::vector<ReplicaMismatch> sets;
    std::vector<float> shard;
    std::vector<double> deviations;
  };
  std::optional<PendingMismatch> mismatch_;
  std::map<int, int> corruptions_;  // by rank: corruptions named on it
  int64_t loss_spikes_ = 0;         // reported in heartbeats
  int64_t replica_mismatches_ = 0;
  std::string last_corruption_;    // the last line naming a corrupted rank
  int64_t corruptions_named_ = 0;  // reported in heartbeats
  int last_corrupted_rank_ = 0;
  double params_sum_ = 0;                 // Report
  absl::Status last_checkpoint_failure_;  // Train
  bool failed_on_inputs_ = false;         // Restore
  int rank_ = -1;
  // The step being trained, for the abort message (the heartbeat thread
  // reads it).
  std::atomic<int64_t> step_{0};
  ArrivalLag arrival_lag_;  // this generation's
  // --outer_timeout: whether the last outer step's quorum had every group
  // (evaluations and snapshots, which every group runs, happen only then).
  bool outer_quorum_full_ = true;
  // --outer_timeout: this rank's group took part in the last outer step
  // (outer_quorum.h, QuorumCall::up_to_date). A generation starts from a
  // snapshot every group holds.
  bool outer_group_current_ = true;

  // The current generation; null outside Join .. EndGeneration.
  std::unique_ptr<Generation> generation_;

  // Recovery state (process-wide).
  SnapshotSchedule snapshots_{config_.engine.optimizer, config_.data_plane.timeout,
                              config_.recovery.snapshot_buddy_always, &metrics_};
  int buddy_shift_ = 1;
  int recoveries_ = 0;
  bool trained_ = false;        // completed a step in some generation
  std::set<size_t> corrupted_;  // the --testing_corrupt entries that fired
  RecoveryTimeline timeline_;
  WorkerTimeLedger ledger_;  // thread-safe: the heartbeat thread reads it
  // Where ledger_'s peak FLOP/s came from: "flag", "measured", "unknown".
  std::string peak_source_ = "unknown";
  bool said_peak_ = false;

  // What the heartbeat handler may touch.
  mutable absl::Mutex abort_mu_;
  DataPlane* abortable_data_plane_ ABSL_GUARDED_BY(abort_mu_) = nullptr;
  // The training loop's, while it trains: its pending commits in heartbeats.
  Checkpointer* checkpointer_ ABSL_GUARDED_BY(abort_mu_) = nullptr;
  const ZeroEngine* abortable_engine_ ABSL_GUARDED_BY(abort_mu_) = nullptr;
  // The server's verdict time of the abort that ended this generation
  // (InfinitePast: none came with a time): recovery is measured from it.
  absl::Time verdict_ ABSL_GUARDED_BY(abort_mu_) = absl::InfinitePast();
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_WORKER_H_
