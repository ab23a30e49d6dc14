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
  std::optional<nlohmann::json> record = timeline_.FirstStepDone(absl::Now());
  if (!record.has_value()) return;
  const BatchLayout& layout = generation_->layout;
  (*record)["grad_accum"] = layout.DataMicroBatches(rank_);     // this rank's, a step
  (*record)["micro_batches_per_step"] = layout.MicroBatches();  // all ranks
  (*record)["global_batch_kept"] = generation_->global_batch_kept;
  metrics_.recoveries.push_back(*record);
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

nlohmann::ordered_json Worker::GoodputReport() const {
  const v1::TimeLedger t = ledger_.Process();
  nlohmann::ordered_json seconds;
  seconds["startup"] = t.startup();
  seconds["restore"] = t.restore();
  seconds["productive"] = t.productive();
  seconds["data_wait"] = t.data_wait();
  seconds["checkpoint_pause"] = t.checkpoint_pause();
  seconds["snapshot_pause"] = t.snapshot_pause();
  seconds["lost_work"] = t.lost_work();
  seconds["stall"] = t.stall();
  seconds["straggler"] = t.straggler();
  seconds["evaluation"] = t.evaluation();
  seconds["other"] = t.other();
  double accounted = 0;
  for (const auto& s : seconds) accounted += s.get<double>();
  const absl::Time now = absl::Now();
  const absl::Time first = ledger_.first_join_answer();
  const double wall = absl::ToDoubleSeconds(now - first);
  nlohmann::ordered_json out;
  // This process's, over all its generations, from its first join answer
  // to this report: the causes plus the time between generations (a failed
  // one's end to the next join answer) cover it up to accounted_until.
  out["seconds"] = seconds;
  out["accounted_seconds"] = accounted;
  out["between_generations_seconds"] = ledger_.between_generations();
  out["wall_seconds"] = wall;
  out["join_answer_unix_us"] = absl::ToUnixMicros(first);
  out["accounted_until_unix_us"] = absl::ToUnixMicros(ledger_.cursor());
  out["written_unix_us"] = absl::ToUnixMicros(now);
  out["goodput"] = wall > 0 ? t.productive() / wall : 0.0;
  out["model_flops"] = t.model_flops();
  out["peak_flop_budget"] = t.peak_flop_budget();
  out["peak_flops"] = t.peak_flops();
  out["peak_flops_source"] = peak_source_;
  out["flops_per_item"] = t.flops_per_item();
  out["mfu"] = t.peak_flop_budget() > 0 ? t.model_flops() / t.peak_flop_budget() : -1.0;
  return out;
}

}  // namespace zeroshard
