#include "worker/zero/gather_window.h"

#include <algorithm>
#include <cassert>
#include <map>
#include <utility>

namespace zeroshard {

GatherWindow::GatherWindow(std::vector<int> positions, int prefetch)
    : positions_(std::move(positions)), prefetch_(prefetch) {
  assert(positions_.size() % 2 == 0 && prefetch_ >= 0);
}

int GatherWindow::IssueEnd(int position, int last_position) const {
  const int depth = position < forward_ops() ? prefetch_ : std::min(prefetch_, 1);
  return std::min(position + depth, last_position);
}

bool GatherWindow::TakesOver(int position) const {
  return position > 0 && positions_[position - 1] == positions_[position];
}

int GatherWindow::HandOverTarget(int position, bool backward_follows) const {
  const int n = forward_ops();
  const int end = backward_follows ? 2 * n : n;
  if (position + 1 < end && positions_[position + 1] == positions_[position]) {
    return position + 1;
  }
  // One of the last `prefetch` forward positions: its backward mirror
  // 2n - 1 - position is reached within the prefetch window, so keeping the
  // unit costs no more memory than gathering it again would.
  if (backward_follows && position < n - 1 && position >= n - 1 - prefetch_) {
    return 2 * n - 1 - position;
  }
  return -1;
}

int GatherWindow::EarlyEnd() const { return std::min(prefetch_, forward_ops() - 1); }

int GatherWindow::Walk(bool early_gathers, bool training) const {
  const int n = forward_ops();
  std::map<int, bool> slots;  // position -> holds a unit (false: takes one over)
  int alive = 0, peak = 0;
  auto issue = [&](int p) {
    if (slots.count(p)) return;
    const bool holds = !TakesOver(p);
    slots[p] = holds;
    if (holds) peak = std::max(peak, ++alive);
  };
  auto release = [&](int p) {
    auto it = slots.find(p);
    if (it == slots.end()) return;
    const bool holds = it->second;
    const int next = HandOverTarget(p, training);
    if (HandsOver(p, next, slots.count(next) > 0)) {
      auto target = slots.find(next);
      if (target != slots.end() && target->second) --alive;  // replaced
      slots[next] = holds;
    } else if (holds) {
      --alive;
    }
    slots.erase(p);
  };
  if (early_gathers) {
    for (int k = 0; k <= EarlyEnd(); ++k) issue(k);
  }
  const int end = training ? 2 * n : n;
  for (int position = 0; position < end; ++position) {
    for (int p = position; p <= IssueEnd(position, end - 1); ++p) issue(p);
    release(position);
  }
  return peak;
}

int GatherWindow::PeakUnits() const {
  int peak = 0;
  for (bool early : {false, true}) {
    for (bool training : {false, true}) peak = std::max(peak, Walk(early, training));
  }
  return peak;
}

}  // namespace zeroshard
