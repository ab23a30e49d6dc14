// Where a job's wall-clock time went, by cause: the server's side of the
// goodput ledger (issue #45; docs/goodput.md, "On the server").
//
// The wall clock since the job's first join (stopped while the job is
// FINISHED; a restart resumes it) is partitioned into phases:
//   rendezvous  a start's first join -> the generation formed
//   running     formed -> the verdict that ended the generation, or the finish
//   detection   the dead member's last sign of life -> the verdict
//   reforming   the verdict -> the next generation formed
// A running segment is split by the workers' TimeLedger (proto/goodput.proto):
// the latest report of one rank, the lowest that reported in the generation
// (rank 0 but for its first beat). One rank's ledger only grows, so every
// cause does too (a counter in /metrics); ranks' splits differ a little
// (each its own data waits), and switching between them would not. The segment's time it does not
// cover is in_flight while the generation runs (the step in progress), lost_work when the
// generation ends by a verdict (the step in flight is thrown away), other when the job finishes
// (between the last report and the last leave). A ledger that sums more than its segment (clock
// skew between the machines) is scaled down to it. So the causes sum to the wall clock by
// construction.
//
// Pure: every time is an argument (no clock), no lock (Membership, which
// keeps one per job, holds its own). Not thread-safe.
#ifndef ZEROSHARD_SHARD_SERVER_GOODPUT_GOODPUT_LEDGER_H_
#define ZEROSHARD_SHARD_SERVER_GOODPUT_GOODPUT_LEDGER_H_

#include <array>
#include <cstdint>
#include <deque>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/goodput.pb.h"

namespace zeroshard {

class GoodputLedger {
 public:
  enum class Phase { kNone = 0, kRendezvous = 1, kRunning = 2, kReforming = 3 };
  // Every cause, in the order tables list them (proto/goodput.proto says
  // what each is). kProductive first; kInFlight last.
  enum Cause {
    kProductive,
    kRendezvous,
    kStartup,
    kRestore,
    kDataWait,
    kCheckpointPause,
    kSnapshotPause,
    kDetection,
    kReforming,
    kLostWork,
    kStall,
    kStraggler,
    kEvaluation,
    kOther,
    kInFlight,
    kCauseCount,
  };
  static const char* CauseName(int cause);
  // Samples: at most kMaxSamples, one per kSampleEvery; when full, the older
  // half is thinned by two (so the spacing doubles with age).
  static constexpr int kMaxSamples = 64;
  static constexpr absl::Duration kSampleEvery = absl::Seconds(10);

  // ---- events, each at the time the caller read from its clock ----
  // The job starts (its first join, or the first after it finished):
  // rendezvous from `at`, and steps_done from 0 (a new run). Nothing when a
  // phase is open.
  void Started(absl::Time at);
  // `generation` formed at `at`: the open phase ends; running from `at`.
  void Formed(int64_t generation, absl::Time at);
  // Rank `rank`'s ledger of `generation` (a beat's, a leave's): kept when
  // that generation is the running one and it comes from a lower rank than
  // the kept one, or from the same rank and sums higher (beats may arrive
  // out of order); the peak FLOP/s and FLOPs per item from any rank. Negative or non-finite ledgers
  // are ignored (the server refuses them before: ValidateTimeLedger). True: changed.
  bool Report(int64_t generation, int rank, const v1::TimeLedger& ledger);
  // A member completed `steps` steps (a beat's step, a join's
  // steps_completed). True: a new most.
  bool StepsCompleted(int64_t steps);
  // The running generation ended by a verdict at `verdict`. `evidence`: the
  // dead member's last sign of life (`verdict` when nobody died: a re-join,
  // a grow back). Running lasts until the later of `evidence` and what the
  // kept ledger covers (a survivor that completed a step saw the dead member
  // alive), then detection until `verdict`, then reforming. Nothing unless
  // running.
  void GenerationEnded(absl::Time evidence, absl::Time verdict);
  // Every member left at `at`: the open phase ends and the clock stops.
  void Finished(absl::Time at);
  // Adds a sample at `now` when the last is kSampleEvery old and a phase is
  // open. True: added.
  bool MaybeSample(absl::Time now);
  // After a restore: when the open phase is not `phase` (of `generation`,
  // when running), the open one ends at `at` and `phase` opens there (the
  // server stopped between a job's save and its ledger's).
  void Reconcile(Phase phase, int64_t generation, absl::Time at);

  // The ledger at `now`: every cause (zero ones too) and the samples.
  v1::Goodput Snapshot(absl::Time now) const;
  Phase phase() const { return phase_; }
  int64_t generation() const { return generation_; }
  int64_t steps_done() const { return steps_done_; }

  v1::GoodputState State() const;
  // INVALID_ARGUMENT naming what is wrong (an unknown cause or phase, a
  // negative or non-finite number).
  static absl::StatusOr<GoodputLedger> FromState(const v1::GoodputState& state);

 private:
  using Seconds = std::array<double, kCauseCount>;
  // The open phase's seconds at `now` added to `seconds`, and its MFU terms
  // to `*flops` and `*budget`.
  void AddOpen(absl::Time now, Seconds& seconds, double* flops, double* budget) const;
  // Ends the open phase at `end` (running: its uncovered time as `rest`).
  void CloseOpen(absl::Time end, Cause rest);
  void Open(Phase phase, absl::Time at);

  Seconds closed_{};
  double closed_flops_ = 0;
  double closed_budget_ = 0;
  Phase phase_ = Phase::kNone;
  absl::Time phase_start_ = absl::UnixEpoch();
  int64_t generation_ = 0;
  v1::TimeLedger ledger_;  // the running generation's kept report
  double ledger_sum_ = 0;  // its causes' sum
  int ledger_rank_ = -1;   // whose it is (-1: none yet)
  int64_t steps_done_ = 0;
  double peak_flops_ = 0;
  double flops_per_item_ = 0;
  std::deque<v1::GoodputSample> samples_;  // oldest first
};

// Seconds a worker's ledger accounts for (its causes' sum), or -1 when one
// is negative or not finite.
double LedgerSeconds(const v1::TimeLedger& ledger);
// OK when every number of `ledger` is finite and >= 0; else
// INVALID_ARGUMENT naming `where`.<field> and its value.
absl::Status ValidateTimeLedger(const v1::TimeLedger& ledger, absl::string_view where);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_GOODPUT_GOODPUT_LEDGER_H_
