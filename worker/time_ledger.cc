#include "worker/time_ledger.h"

#include <algorithm>
#include <vector>

namespace zeroshard {
namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

double MedianOf(const std::deque<double>& values) {
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

}  // namespace

const char* TimeCauseName(TimeCause cause) {
  switch (cause) {
    case TimeCause::kStartup:
      return "startup";
    case TimeCause::kRestore:
      return "restore";
    case TimeCause::kProductive:
      return "productive";
    case TimeCause::kDataWait:
      return "data_wait";
    case TimeCause::kCheckpointPause:
      return "checkpoint_pause";
    case TimeCause::kSnapshotPause:
      return "snapshot_pause";
    case TimeCause::kLostWork:
      return "lost_work";
    case TimeCause::kStall:
      return "stall";
    case TimeCause::kStraggler:
      return "straggler";
    case TimeCause::kEvaluation:
      return "evaluation";
    case TimeCause::kOther:
    case TimeCause::kCount:
      break;
  }
  return "other";
}

void WorkerTimeLedger::SetFlops(double flops_per_item, double peak_flops) {
  absl::MutexLock lock(&mu_);
  flops_per_item_ = flops_per_item;
  peak_flops_ = peak_flops;
}

void WorkerTimeLedger::StartGeneration(absl::Time join_answer, bool recovery, int64_t steps_done,
                                       int world_size) {
  absl::MutexLock lock(&mu_);
  if (open_) {  // not closed by EndGeneration: its time after the cursor is between generations
    FoldLocked();
    ended_ = cursor_;
  }
  if (first_join_answer_ == absl::InfinitePast()) first_join_answer_ = join_answer;
  if (ended_ != absl::InfinitePast()) {
    between_generations_ += std::max(0.0, Seconds(join_answer - ended_));
    ended_ = absl::InfinitePast();
  }
  open_ = true;
  cursor_ = join_answer;
  recovery_ = recovery;
  stepped_ = false;
  // This process's own completed steps count too: a server that does not
  // know the job's (an older one) still has the survivors' re-runs lost.
  lost_below_ = std::max(steps_done, steps_completed_);
  world_size_ = std::max(1, world_size);
  window_.clear();
}

void WorkerTimeLedger::Account(absl::Time now, TimeCause cause) {
  absl::MutexLock lock(&mu_);
  AccountLocked(now, cause);
}

void WorkerTimeLedger::Between(absl::Time now) {
  absl::MutexLock lock(&mu_);
  AccountLocked(now, BetweenCauseLocked());
}

void WorkerTimeLedger::Step(const StepTiming& t) {
  absl::MutexLock lock(&mu_);
  if (!open_) return;
  AccountLocked(t.start, BetweenCauseLocked());
  const absl::Time from = std::max(cursor_, t.start);
  if (t.end <= from) return;
  const double elapsed = Seconds(t.end - from);
  cursor_ = t.end;
  stepped_ = true;
  // The waits inside the step, each at most what is left of it: the parts
  // never sum past the step's time.
  double left = elapsed;
  auto take = [&left](double wanted) {
    const double taken = std::clamp(wanted, 0.0, left);
    left -= taken;
    return taken;
  };
  AddLocked(TimeCause::kDataWait, take(t.data_wait));
  AddLocked(TimeCause::kCheckpointPause, take(t.checkpoint_wait));
  AddLocked(TimeCause::kSnapshotPause, take(t.snapshot_wait));
  const double compute = left;
  if (!t.applied || t.step < lost_below_) {
    AddLocked(TimeCause::kLostWork, compute);
  } else {
    double straggler = 0;
    double stall = 0;
    if (static_cast<int>(window_.size()) >= kMinWindow) {
      const double median = MedianOf(window_);
      straggler = std::min(std::max(compute - median, 0.0), std::max(t.arrival_spread, 0.0));
      const double rest = compute - straggler;
      if (rest > 2 * median) stall = rest - median;
    }
    const double productive = compute - straggler - stall;
    AddLocked(TimeCause::kStraggler, straggler);
    AddLocked(TimeCause::kStall, stall);
    AddLocked(TimeCause::kProductive, productive);
    generation_.model_flops += flops_per_item_ * t.items;
    generation_.peak_flop_budget += productive * world_size_ * peak_flops_;
  }
  if (!t.rewound) steps_completed_ = std::max(steps_completed_, t.step + 1);
  window_.push_back(compute);
  if (static_cast<int>(window_.size()) > kWindow) window_.pop_front();
}

void WorkerTimeLedger::Rewound(absl::Time now, int64_t bad_step) {
  absl::MutexLock lock(&mu_);
  AccountLocked(now, TimeCause::kLostWork);
  lost_below_ = std::max(lost_below_, bad_step);
}

void WorkerTimeLedger::EndGeneration(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (!open_) return;
  AccountLocked(now, TimeCause::kLostWork);
  FoldLocked();
  ended_ = std::max(now, cursor_);
}

v1::TimeLedger WorkerTimeLedger::Generation() const {
  absl::MutexLock lock(&mu_);
  return open_ ? ToProtoLocked(generation_) : ToProtoLocked(Totals());
}

v1::TimeLedger WorkerTimeLedger::Process() const {
  absl::MutexLock lock(&mu_);
  Totals sum = past_;
  if (open_) {
    for (int c = 0; c < kTimeCauses; ++c) sum.seconds[c] += generation_.seconds[c];
    sum.model_flops += generation_.model_flops;
    sum.peak_flop_budget += generation_.peak_flop_budget;
  }
  return ToProtoLocked(sum);
}

double WorkerTimeLedger::between_generations() const {
  absl::MutexLock lock(&mu_);
  return between_generations_;
}

absl::Time WorkerTimeLedger::first_join_answer() const {
  absl::MutexLock lock(&mu_);
  return first_join_answer_;
}

absl::Time WorkerTimeLedger::cursor() const {
  absl::MutexLock lock(&mu_);
  return cursor_;
}

int64_t WorkerTimeLedger::steps_completed() const {
  absl::MutexLock lock(&mu_);
  return steps_completed_;
}

void WorkerTimeLedger::AddLocked(TimeCause cause, double seconds) {
  generation_.seconds[static_cast<int>(cause)] += seconds;
}

void WorkerTimeLedger::AccountLocked(absl::Time now, TimeCause cause) {
  if (!open_ || now <= cursor_) return;
  AddLocked(cause, Seconds(now - cursor_));
  cursor_ = now;
}

TimeCause WorkerTimeLedger::BetweenCauseLocked() const {
  if (stepped_) return TimeCause::kOther;
  return recovery_ ? TimeCause::kRestore : TimeCause::kStartup;
}

void WorkerTimeLedger::FoldLocked() {
  for (int c = 0; c < kTimeCauses; ++c) past_.seconds[c] += generation_.seconds[c];
  past_.model_flops += generation_.model_flops;
  past_.peak_flop_budget += generation_.peak_flop_budget;
  generation_ = Totals();
  open_ = false;
}

v1::TimeLedger WorkerTimeLedger::ToProtoLocked(const Totals& t) const {
  v1::TimeLedger out;
  auto at = [&t](TimeCause c) { return t.seconds[static_cast<int>(c)]; };
  out.set_startup(at(TimeCause::kStartup));
  out.set_restore(at(TimeCause::kRestore));
  out.set_productive(at(TimeCause::kProductive));
  out.set_data_wait(at(TimeCause::kDataWait));
  out.set_checkpoint_pause(at(TimeCause::kCheckpointPause));
  out.set_snapshot_pause(at(TimeCause::kSnapshotPause));
  out.set_lost_work(at(TimeCause::kLostWork));
  out.set_stall(at(TimeCause::kStall));
  out.set_straggler(at(TimeCause::kStraggler));
  out.set_evaluation(at(TimeCause::kEvaluation));
  out.set_other(at(TimeCause::kOther));
  out.set_model_flops(t.model_flops);
  out.set_peak_flop_budget(t.peak_flop_budget);
  out.set_peak_flops(peak_flops_);
  out.set_flops_per_item(flops_per_item_);
  return out;
}

}  // namespace zeroshard
