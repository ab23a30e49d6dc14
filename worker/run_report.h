// What a finished run says about itself: rank 0's summary (--summary_out:
// JSON, and the same as a table on stderr) and the per-run report
// (--report: JSON, rank 0's or every rank's).
#ifndef ZEROSHARD_WORKER_RUN_REPORT_H_
#define ZEROSHARD_WORKER_RUN_REPORT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/goodput.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data_plane_description.h"
#include "worker/model/kernel_profile.h"
#include "worker/recovery/recovery_timeline.h"
#include "worker/training_task.h"
#include "worker/worker_config.h"
#include "worker/zero/engine.h"

namespace zeroshard {

// What a re-run after a rewind showed: the step is bad again (its data or
// the model), or it is not (the first run's fault was transient).
enum class RewindCause { kNotRerun, kData, kTransient };

// A rewind to an in-memory snapshot (worker/worker_rewind.cc), as the
// report's "rewinds" lists it.
struct RewindRecord {
  int64_t bad_step = 0;  // 1-based: the step whose verdict was bad
  int64_t to_step = 0;   // the snapshot's step
  std::string why;
  RewindCause cause = RewindCause::kNotRerun;
  // The rank the replica check found corrupted (-1: none named).
  int corrupted_rank = -1;
};

// One outer step of --sync=diloco (docs/diloco.md): after which step, its
// number in the run (ceil(after_step / H)), the groups that took part and the
// generation that ran it, the bytes this rank sent for it (not in the per-step comm_bytes_*
// figures), its wall time, the outer gradient's norm and (bf16 / int8 / int4 outer
// dtype) this rank's residual's norm. The report's "outer_steps".
// Streaming DiLoCo (--outer_fragments, engine.h's OuterStats): the fragment
// (-1: every unit), the step after which its outer all-reduce began (its
// result is applied after `after_step`), whether that all-reduce ran on the
// replica thread, its time there and the compute thread's wait for it.
struct OuterStepRecord {
  int64_t after_step = 0;
  int64_t outer_step = 0;
  int64_t bytes_sent = 0;
  double ms = 0;
  double outer_grad_norm = 0;
  double residual_norm = 0;
  int fragment = -1;
  int64_t began_after_step = 0;
  bool on_replica_thread = false;
  double all_reduce_ms = 0;
  double wait_ms = 0;
  int groups = 0;          // the shard groups that took part (their mean)
  int64_t generation = 0;  // the job generation that ran it
  // --outer_timeout (docs/diloco.md, "Elastic outer steps"): bit g for each
  // group the quorum let in (0: every group, no quorum); whether this rank's
  // group took part (false: it was late, and skipped the step); whether it
  // was caught up first (it had missed one); the present groups that had.
  uint64_t present_groups = 0;
  bool took_part = true;
  bool caught_up = false;
  int stale_groups = 0;
};

// Where a process's time went, by cause, and its MFU (the worker's
// GoodputReport; docs/goodput.md); the report's "goodput".
struct GoodputSummary {
  // The process's ledger over all its generations, from its first join
  // answer up to accounted_until.
  v1::TimeLedger ledger;
  // Between generations: a failed one's end to the next join answer.
  double between_generations_seconds = 0;
  absl::Time join_answer;
  absl::Time accounted_until;
  absl::Time written;             // when the report was made
  std::string peak_flops_source;  // "flag", "measured" or "unknown"
};

// What the training loop measured, step by step, on this rank.
struct RunMetrics {
  std::vector<double> losses;  // the step's loss, averaged over ranks
  // Steps dropped for a non-finite loss or gradient norm, 1-based as the
  // log numbers them ("step 4/8": 4)
  // (--on_nonfinite=skip); their losses entries hold that loss (NaN, Inf).
  std::vector<int64_t> skipped_steps;
  // Wall time of each --replica_check_every hash, taken inside the step's
  // optimizer update (StepTimes::replica_hash_ms), and of the standalone
  // check after the last step (hash + 8-byte all-gather).
  std::vector<double> replica_hash_ms;
  std::vector<double> replica_check_ms;
  // Every rewind to an in-memory snapshot (worker/worker_rewind.cc): the
  // bad step, the snapshot's step, why, and what the re-run showed.
  std::vector<RewindRecord> rewinds;
  // --sync=diloco: every outer step (Worker::MaybeOuterStep).
  std::vector<OuterStepRecord> outer_steps;
  std::vector<double> step_ms;  // wall time of each step
  // CPU time of the whole process (every thread) in each step: on a busy
  // machine, steadier than the wall time.
  std::vector<double> step_cpu_ms;
  std::vector<StepTimes> step_times;
  KernelTimes kernel_ms{};          // the model's kernels over the training steps, summed
  double items_per_second_sum = 0;  // tokens or rows per second of each step, summed
  std::vector<double> val_losses;   // every evaluation's
  Evaluation last_eval;
  std::vector<double> checkpoint_pause_ms;  // the training thread's pause per checkpoint
  // Per committed checkpoint: ms from its Save to its commit (restorable).
  std::vector<double> checkpoint_commit_ms;
  // Checkpoints abandoned while training went on (Checkpointer::failures).
  std::vector<std::string> checkpoint_failures;
  // Bytes this rank sent during the training steps (gather and reduce
  // communicators together; evaluation and sampling not counted).
  CollectiveBytes training_bytes;
  // hpZ: the part of training_bytes.all_gather the backward's gathers from
  // the secondary shards sent (inside the secondary groups).
  int64_t secondary_gather_bytes = 0;
  // The same bytes, each step's, by where they went (DataPlane::BytesByHost):
  // to ranks on this host, or across the network.
  std::vector<int64_t> step_bytes_intra_host;
  std::vector<int64_t> step_bytes_inter_host;
  std::string sample;  // --sample's generated text
  // Fault tolerance (#13): the training thread's pause for each in-memory
  // snapshot (the boundary's commit and launch, plus any wait for the
  // background copy before the next optimizer step), the host
  // bytes snapshots held (own + buddy's; peak), and every recovery this
  // process went through (`recoveries`).
  std::vector<double> snapshot_pause_ms;
  // Background times of each completed snapshot: the copy out of the engine
  // (with the tensors' checksums), and the whole transfer (copy, buddy swap,
  // verification); the snapshots skipped because a transfer was still in
  // flight.
  std::vector<double> snapshot_copy_ms;
  std::vector<double> snapshot_transfer_ms;
  int snapshots_skipped = 0;
  // Boundaries at which the previous transfer was still in flight and the
  // snapshot waited for it (their waits are in snapshot_pause_ms; one
  // longer than the bound skips, as above).
  int snapshots_waited = 0;
  // Snapshots this rank refused to keep for a NaN or Inf value
  // (SnapshotKeeper::TakeRefusals): their messages.
  std::vector<std::string> snapshot_refusals;
  // Snapshots taken without a buddy copy: in HSDP with R >= 2 the replica
  // peer's run is in the rank's own blob (SnapshotSchedule).
  int snapshots_from_replicas = 0;
  int64_t snapshot_bytes_peak = 0;
  int64_t checkpoint_staging_bytes = 0;  // --checkpoint_staging's buffer, at its largest
  int64_t first_join_unix_ms = 0;  // when the process first asked to join (ms since the epoch)
  int64_t snapshot_committed_step = -1;
  std::vector<RecoveryReport> recoveries;

  // One training step: its loss (mean over ranks), wall and CPU time (ms),
  // the engine's times and the kernels' times during it.
  void RecordStep(double loss, double ms, double cpu_ms, const StepTimes& times,
                  const KernelTimes& kernels_before, const KernelTimes& kernels_after);
};

// Everything the summary and the report are made of. The pointers are not
// owned and must outlive the calls below.
struct FinishedRun {
  const WorkerConfig* config = nullptr;
  int rank = 0;
  std::string model;  // TrainingTask::Describe()
  const ZeroEngine* engine = nullptr;
  const RunMetrics* metrics = nullptr;
  std::string plan_hash;
  DataPlaneDescription data_plane;  // DataPlane::description
  double params_sum = 0;            // over the whole model
  // DiLoCo runs: this rank's f32 master shard, summed in order.
  std::optional<double> master_shard_sum;
  // By rank.
  std::vector<double> model_state_bytes;
  std::vector<double> peak_bytes;
  GoodputSummary goodput;
};

// CPU time this process has used (all threads), in milliseconds.
double ProcessCpuMs();

// Median of `values`; 0 when empty.
double Median(std::vector<double> values);

// Writes the summary JSON to `path` and prints it as a table to stderr.
// INTERNAL naming the file when it cannot be written ("cannot write
// --summary_out <path>").
absl::Status WriteSummary(const FinishedRun& run, const std::string& path);

// Writes the report JSON to `path`: the run's losses, timings, memory,
// traffic and model shape. INTERNAL naming the file when it cannot be
// written ("cannot write --report <path>").
absl::Status WriteReport(const FinishedRun& run, const std::string& path);

// Writes --eval_out's `record` (one JSON line) to `path`; INTERNAL naming the
// file when it cannot be written.
absl::Status WriteEvalOut(const std::string& record, const std::string& path);

// What --summary_out (rank 0) and --report (rank 0, or every rank when the
// path has "{rank}") ask of `run`.
absl::Status WriteRunOutputs(const FinishedRun& run);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RUN_REPORT_H_
