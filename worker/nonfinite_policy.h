// What a worker does with a step whose loss or gradient norm is not finite
// (worker/zero/step_numerics.h). The engine never applies such a step: its
// parameters and optimizer state stay as they were, on every rank, because
// every rank judged the same gathered numbers. This policy decides whether
// training goes on:
//
//   --on_nonfinite=stop (default)  every rank stops with one line naming the
//       step, the quantity, the first rank that saw it and, when the data is
//       a file, the rows that rank trained on. A run that produced a NaN has
//       a cause someone should look at before it costs more machine time.
//   --on_nonfinite=skip            the step is dropped and counted; training
//       goes on with the next step's data, until more than
//       --max_skipped_steps (default 10) steps in a row were dropped (then
//       as stop: a run whose every step overflows is not training).
//
// Not thread-safe: the training thread's.
#ifndef ZEROSHARD_WORKER_NONFINITE_POLICY_H_
#define ZEROSHARD_WORKER_NONFINITE_POLICY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "worker/zero/step_numerics.h"

namespace zeroshard {

enum class OnNonFinite { kStop, kSkip };

struct NonFiniteConfig {
  OnNonFinite on_nonfinite = OnNonFinite::kStop;
  int max_skipped_steps = 10;  // in a row; >= 0
};

// "stop" / "skip" to the enum; INVALID_ARGUMENT naming the flag otherwise.
absl::Status ParseOnNonFinite(const std::string& value, OnNonFinite* out);

// Whether `status` is the stop this policy returned: main prints its line
// and exits 1 even when a peer's exit made the server end the generation
// meanwhile (the numbers, not the peer, are why).
bool IsNonFiniteStop(const absl::Status& status);
// Marks `status` as such a stop (also used by the replica check: a
// corrupted shard is a numerical stop, not a fault a recovery cures).
absl::Status MarkNumericalStop(absl::Status status);

class NonFinitePolicy {
 public:
  explicit NonFinitePolicy(NonFiniteConfig config) : config_(config) {}

  // After 0-based `step` of `steps` was judged: OK to go on (a finite step,
  // or one skipped within the limit), else the status that ends the run
  // (FAILED_PRECONDITION: not a fault any recovery can cure). `samples`
  // names the data of the verdict's first rank ("" when unknown).
  absl::Status Judge(int64_t step, int64_t steps, const StepVerdict& verdict,
                     const std::string& samples);

  int64_t skipped_total() const { return skipped_total_; }
  int skipped_in_a_row() const { return skipped_in_a_row_; }
  // The line Judge printed last for a skipped step ("" if none).
  const std::string& last_skip() const { return last_skip_; }

 private:
  const NonFiniteConfig config_;
  int64_t skipped_total_ = 0;
  int skipped_in_a_row_ = 0;
  std::string last_skip_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_NONFINITE_POLICY_H_
