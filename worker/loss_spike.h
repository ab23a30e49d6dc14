// Loss spikes (--loss_spike_zscore=Z, docs/numerics.md): a step whose mean
// loss over ranks is more than Z standard deviations above the mean of the
// last kWindow applied steps is judged bad before any parameter changes, as a
// non-finite step is. Every rank screens the same gathered mean against the
// same window (built from the same verdicts), so every rank judges alike.
//
// The window holds the losses of applied steps by step number: after a
// rewind to step s, Record of a re-run step replaces what the first run
// recorded from s on, so the re-run is judged against the window the first
// run had.
//
// Not thread-safe: the training thread's (the engine calls Screen inside
// ZeroEngine::Step, on the thread that called it).
#ifndef ZEROSHARD_WORKER_LOSS_SPIKE_H_
#define ZEROSHARD_WORKER_LOSS_SPIKE_H_

#include <cstdint>
#include <deque>
#include <utility>

#include "worker/zero/step_numerics.h"

namespace zeroshard {

class LossSpikeDetector {
 public:
  // Steps in the window: long enough that its standard deviation is a
  // measure of the noise between batches, short enough to follow the
  // loss's descent (a spike is judged against the recent loss, not the
  // first steps').
  static constexpr int kWindow = 32;
  // Fewer applied steps than this and no step is judged a spike: the sample
  // standard deviation of a handful of early, fast-falling losses says
  // little.
  static constexpr int kMinSteps = 8;

  // `zscore` <= 0: off (Screen never marks a spike).
  explicit LossSpikeDetector(double zscore) : zscore_(zscore) {}

  bool enabled() const { return zscore_ > 0; }
  // Marks `verdict` a loss spike (StepVerdict::loss_spike and its window)
  // when its finite mean loss is more than Z standard deviations above the
  // window. A non-finite step is left as it is (already bad).
  void Screen(StepVerdict* verdict) const;
  // 0-based `step` was applied with mean loss `loss`: it enters the window,
  // replacing whatever was recorded for `step` and later (a rewind's re-run).
  void Record(int64_t step, double loss);
  // A rewind to `step` steps completed: the losses of 0-based steps `step`
  // and later leave the window, so that the re-run is screened against the
  // window the first run had.
  void RewindTo(int64_t step);

 private:
  const double zscore_;
  std::deque<std::pair<int64_t, double>> window_;  // (step, mean loss), oldest first
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_LOSS_SPIKE_H_
