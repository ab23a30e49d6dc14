// The Worker's side of the goodput ledger (#45, docs/goodput.md "On the
// worker"): the waits a step measures, the peak FLOP/s, the report's
// "goodput". The partition itself is worker/time_ledger.h.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>

#include "absl/time/clock.h"
#include "common/fault_messages.h"
#include "worker/checkpointer.h"
#include "worker/model/parallel.h"
#include "worker/model/peak_flops.h"
#include "worker/worker.h"

namespace zeroshard {
namespace {

// How long the peak measurement runs: ~200 GEMMs of 512^3 at 100 GFLOP/s,
// enough for a best call on a busy machine, short beside a job's startup.
constexpr absl::Duration kPeakBudget = absl::Milliseconds(200);

}  // namespace

void Worker::WaitForCopies(StepTiming* timing) {
  const absl::Time start = absl::Now();
  snapshots_.WaitCopied();
  const absl::Time copied = absl::Now();
  timing->snapshot_wait = absl::ToDoubleSeconds(copied - start);
  // A checkpoint's copy of the state the update is about to change. Set
  // and cleared by Train, on this thread: no lock is held while waiting.
  Checkpointer* checkpointer = nullptr;
  {
    absl::MutexLock lock(&abort_mu_);
    checkpointer = checkpointer_;
  }
  if (checkpointer == nullptr) return;
  checkpointer->WaitCopied();
  timing->checkpoint_wait = absl::ToDoubleSeconds(absl::Now() - copied);
}

Progress Worker::StepProgress(int step, const StepStats& stats, double ms,
                              double items_per_second) {
  const ZeroEngine& e = *generation_->engine;
  Progress progress{step + 1, stats.verdict.mean_loss, e.memory().total(), e.collective_seq()};
  progress.last_step.set_step_ms(ms);
  progress.last_step.set_items_per_second(items_per_second);
  progress.last_step.set_gather_wait_ms(stats.times.gather_wait_ms);
  progress.last_step.set_reduce_wait_ms(stats.times.reduce_wait_ms);
  progress.last_step.set_skipped_steps(nonfinite_.skipped_total());
  progress.last_step.set_rewinds(static_cast<int64_t>(metrics_.rewinds.size()));
  progress.last_step.set_loss_spikes(loss_spikes_);
  progress.last_step.set_replica_mismatches(replica_mismatches_);
  progress.last_step.set_corruptions(corruptions_named_);
  progress.last_step.set_corrupted_rank(last_corrupted_rank_);
  progress.snapshot_step = snapshots_.keeper().committed_step();
  if (rank_ == 0) progress.recovery = timeline_.record();
  metrics_.snapshot_bytes_peak = snapshots_.keeper().peak_bytes();
  progress.memory_bytes += snapshots_.keeper().bytes();
  {
    absl::MutexLock lock(&abort_mu_);
    if (checkpointer_ != nullptr) {
      metrics_.checkpoint_staging_bytes =
          std::max(metrics_.checkpoint_staging_bytes, checkpointer_->staging_bytes());
      progress.memory_bytes += checkpointer_->staging_bytes();
    }
  }
  return progress;
}

void Worker::NoteFirstStep(int step) {
  std::optional<RecoveryReport> record = timeline_.FirstStepDone(absl::Now());
  if (!record.has_value()) return;
  const BatchLayout& layout = generation_->layout;
  record->grad_accum = layout.DataMicroBatches(rank_);
  record->micro_batches_per_step = layout.MicroBatches();
  record->global_batch_kept = generation_->global_batch_kept;
  metrics_.recoveries.push_back(*std::move(record));
  std::fprintf(
      stderr, "%s\n",
      RecoveredLine(rank_, step + 1, timeline_.record().first_step_ms(), timeline_.measured_from())
          .c_str());
}

double Worker::PeakFlops() {
  if (config_.peak_flops > 0) {
    peak_source_ = "flag";
    return config_.peak_flops;
  }
  // A GPU's peak is not its host's GEMM; measuring it would need cuBLAS
  // here. Unknown: no MFU (--peak_flops gives it).
  if (device_ != nullptr) return 0;
  peak_source_ = "measured";
  return MeasureGemmFlops(kPeakBudget);
}

void Worker::SayPeakOnce() {
  if (rank_ != 0 || said_peak_) return;
  said_peak_ = true;
  const double peak = ledger_.Generation().peak_flops();
  if (peak_source_ == "measured") {
    std::fprintf(stderr,
                 "rank 0: peak %.3g GFLOP/s for MFU, measured once (f32 GEMM 512^3, %d threads, "
                 "%s; --peak_flops sets it)\n",
                 peak / 1e9, ComputeThreads(), absl::FormatDuration(kPeakBudget).c_str());
  } else if (peak_source_ == "unknown") {
    std::fprintf(stderr, "rank 0: peak FLOP/s unknown on this device: no MFU (--peak_flops)\n");
  }
}

GoodputSummary Worker::GoodputReport() const {
  GoodputSummary out;
  out.ledger = ledger_.Process();
  out.between_generations_seconds = ledger_.between_generations();
  out.join_answer = ledger_.first_join_answer();
  out.accounted_until = ledger_.cursor();
  out.written = absl::Now();
  out.peak_flops_source = peak_source_;
  return out;
}

}  // namespace zeroshard
