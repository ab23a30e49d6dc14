// Where a worker's wall clock went (#45, docs/goodput.md "On the worker"):
// every second since its generation's join answer, partitioned into the
// causes of proto/goodput.proto's TimeLedger.
//
// The partition. The ledger keeps a cursor, the last instant accounted for
// (the join answer at first). Each call accounts the interval from the
// cursor to the time it is given to one cause (or, for a step, splits it
// between causes) and moves the cursor there; nothing is counted twice and
// nothing is left out up to the cursor. Only finished intervals are
// counted: a step in progress shows in no cause until Step is called. The
// times are arguments, so the classification is testable without sleeping.
//
// A step's interval [start, end] (its micro-batches and its update) is
// split: the waits measured inside it (the batch: data_wait; a checkpoint's
// copy: checkpoint_pause; a snapshot's copy: snapshot_pause) go to their
// causes, and the rest, its compute time c, by this rule:
//   - lost_work when the step was not applied (a bad step rewound or
//     skipped), or its index is below the generation's lost mark: the job's
//     most completed steps at the join (JoinResponse.steps_done, or this
//     process's own when more: trained again after a recovery), raised by
//     a rewind to the bad step (the steps before it are re-runs);
//   - otherwise, against m, the median compute time of the generation's
//     last kWindow steps (once kMinWindow steps are known; before that the
//     whole step is productive):
//       straggler = min(max(c - m, 0), the step's arrival spread: the last
//                   rank's arrival at its first collective minus the first's)
//       stall     = (c - straggler) - m  when c - straggler > 2 m, else 0
//       productive = c - straggler - stall
//     The spread bounds what a late rank can have cost this one; a step
//     more than twice the median with no late rank to explain it stalled,
//     and what it took above the median is the stall.
// Between steps the caller names the cause (evaluation, checkpoint_pause,
// snapshot_pause, lost_work for a rewind); Between() gives the rest to
// startup (restore in a recovery generation) before the generation's first
// step, and to other after it.
//
// MFU: an applied, non-lost step adds flops_per_item x its job-wide items
// to model_flops and its productive seconds x world size x peak_flops to
// peak_flop_budget.
//
// Thread-safe (one mutex): the training thread accounts, the heartbeat
// thread reads Generation().
#ifndef ZEROSHARD_WORKER_TIME_LEDGER_H_
#define ZEROSHARD_WORKER_TIME_LEDGER_H_

#include <array>
#include <cstdint>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/goodput.pb.h"

namespace zeroshard {

// TimeLedger's causes, in its field order.
enum class TimeCause {
  kStartup,
  kRestore,
  kProductive,
  kDataWait,
  kCheckpointPause,
  kSnapshotPause,
  kLostWork,
  kStall,
  kStraggler,
  kEvaluation,
  kOther,
  kCount
};
constexpr int kTimeCauses = static_cast<int>(TimeCause::kCount);
// "productive", "data_wait", ...: TimeLedger's field names.
const char* TimeCauseName(TimeCause cause);

// One finished step, as RunStep measured it.
struct StepTiming {
  int64_t step = 0;  // 0-based
  absl::Time start;  // before its first micro-batch
  absl::Time end;    // after its update
  // Inside [start, end]: waiting for the batch, for a checkpoint's copy and
  // for a snapshot's copy of the state the update changes. Seconds.
  double data_wait = 0;
  double checkpoint_wait = 0;
  double snapshot_wait = 0;
  // Over every rank: the last arrival at the step's first collective minus
  // the first (seconds; 0 when not known).
  double arrival_spread = 0;
  double items = 0;     // rows or tokens the whole job trained in it
  bool applied = true;  // false: its update was dropped (rewound, skipped)
  // Rewound: run again next (not completed). A skipped step is completed:
  // the run goes on past it.
  bool rewound = false;
};

class WorkerTimeLedger {
 public:
  static constexpr int kWindow = 20;    // steps in the median
  static constexpr int kMinWindow = 5;  // steps before stalls and stragglers are judged

  // peak_flops: this rank's FLOP/s (0: not known, no MFU); flops_per_item:
  // the model's FLOPs per trained row or token, forward and backward.
  void SetFlops(double flops_per_item, double peak_flops) ABSL_LOCKS_EXCLUDED(mu_);

  // A generation's join answer at `join_answer`: the generation's ledger
  // starts at zero. `recovery`: its setup is restore, not startup.
  // `steps_done`: the job's most completed steps (the lost mark, at least
  // this process's steps_completed()). The previous
  // generation, if EndGeneration did not close it, is closed at its cursor.
  void StartGeneration(absl::Time join_answer, bool recovery, int64_t steps_done, int world_size)
      ABSL_LOCKS_EXCLUDED(mu_);
  // [cursor, now] to `cause`. A `now` before the cursor accounts nothing.
  void Account(absl::Time now, TimeCause cause) ABSL_LOCKS_EXCLUDED(mu_);
  // [cursor, now] to the time between phases: startup or restore before the
  // generation's first step, other after it.
  void Between(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // [cursor, step.start] as Between, then the step split by the rule above.
  void Step(const StepTiming& step) ABSL_LOCKS_EXCLUDED(mu_);
  // A rewind ended at `now` (its time, [cursor, now], is lost work) after the
  // bad step `bad_step`: the steps before it are re-runs.
  void Rewound(absl::Time now, int64_t bad_step) ABSL_LOCKS_EXCLUDED(mu_);
  // The generation failed, seen here at `now`: [cursor, now] (the step in
  // flight, the wait for the verdict) is lost work in the process's totals,
  // and the time until the next join answer is between generations.
  void EndGeneration(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  // The current generation's ledger (zero before StartGeneration).
  v1::TimeLedger Generation() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every generation's, summed: this process's time since its first join
  // answer, but for the time between generations.
  v1::TimeLedger Process() const ABSL_LOCKS_EXCLUDED(mu_);
  // Seconds from a failed generation's end to the next join answer, summed.
  double between_generations() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time first_join_answer() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time cursor() const ABSL_LOCKS_EXCLUDED(mu_);
  // The most steps this process completed (applied or skipped, not rewound;
  // 0: none).
  int64_t steps_completed() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Totals {
    std::array<double, kTimeCauses> seconds{};
    double model_flops = 0;
    double peak_flop_budget = 0;
  };
  void AddLocked(TimeCause cause, double seconds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // [cursor, now] to `cause`; moves the cursor.
  void AccountLocked(absl::Time now, TimeCause cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  TimeCause BetweenCauseLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the generation into past_.
  void FoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::TimeLedger ToProtoLocked(const Totals& totals) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  double flops_per_item_ ABSL_GUARDED_BY(mu_) = 0;
  double peak_flops_ ABSL_GUARDED_BY(mu_) = 0;
  Totals generation_ ABSL_GUARDED_BY(mu_);
  Totals past_ ABSL_GUARDED_BY(mu_);        // closed generations
  bool open_ ABSL_GUARDED_BY(mu_) = false;  // a generation is being accounted
  absl::Time cursor_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time first_join_answer_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time ended_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // EndGeneration's
  double between_generations_ ABSL_GUARDED_BY(mu_) = 0;
  bool recovery_ ABSL_GUARDED_BY(mu_) = false;
  bool stepped_ ABSL_GUARDED_BY(mu_) = false;  // a step finished in this generation
  int64_t lost_below_ ABSL_GUARDED_BY(mu_) = 0;
  int world_size_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t steps_completed_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<double> window_ ABSL_GUARDED_BY(mu_);  // compute seconds, newest last
};

// Runs f() (returning a status or a value) as `cause`: the time before it
// goes to Between, its own to `cause`.
template <typename F>
auto AccountAs(WorkerTimeLedger& ledger, TimeCause cause, F&& f) {
  ledger.Between(absl::Now());
  auto result = f();
  ledger.Account(absl::Now(), cause);
  return result;
}

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_TIME_LEDGER_H_
