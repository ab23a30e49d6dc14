#include "worker/loss_spike.h"

#include <algorithm>
#include <cmath>

namespace zeroshard {

void LossSpikeDetector::Screen(StepVerdict* verdict) const {
  if (!enabled() || !verdict->finite()) return;
  const int n = static_cast<int>(window_.size());
  if (n < kMinSteps) return;
  double mean = 0;
  for (const auto& [step, loss] : window_) mean += loss;
  mean /= n;
  double squares = 0;
  for (const auto& [step, loss] : window_) squares += (loss - mean) * (loss - mean);
  // A window whose losses are (nearly) equal has a standard deviation of
  // rounding noise, against which any later wobble is "many sigma": a
  // floor of 1e-3 of the mean keeps a spike a real jump (0.1 % of the loss
  // is far above f32 rounding, ~1e-7 relative, and far below any spike
  // worth a rewind).
  const double sd = std::max(std::sqrt(squares / (n - 1)), 1e-3 * std::fabs(mean));
  const double z = sd > 0 ? (verdict->mean_loss - mean) / sd : 0;
  if (z <= zscore_) return;
  verdict->loss_spike = true;
  verdict->zscore = z;
  verdict->window_mean = mean;
  verdict->window_sd = sd;
  verdict->window_steps = n;
}

void LossSpikeDetector::RewindTo(int64_t step) {
  while (!window_.empty() && window_.back().first >= step) window_.pop_back();
}

void LossSpikeDetector::Record(int64_t step, double loss) {
  RewindTo(step);
  window_.emplace_back(step, loss);
  while (static_cast<int>(window_.size()) > kWindow) window_.pop_front();
}

}  // namespace zeroshard
