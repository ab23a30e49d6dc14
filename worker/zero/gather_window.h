// Stage 3's window of gathered units over a pass (engine.h, "Stage 3's
// window") as rules on pass positions: which gathers acquiring a position
// issues, which positions take their unit over from the position before,
// and where a released position's unit goes. Pure: the engine's gathers
// follow these rules (engine_gather.cc), and Create walks them to learn how
// many gathered units can be alive at once: the pool it plans
// (step_buffers.h).
#ifndef ZEROSHARD_WORKER_ZERO_GATHER_WINDOW_H_
#define ZEROSHARD_WORKER_ZERO_GATHER_WINDOW_H_

#include <vector>

namespace zeroshard {

class GatherWindow {
 public:
  GatherWindow() = default;
  // `positions`: the unit of every pass position, the n forward ops then the
  // same n ops backward (2n positions). `prefetch` >= 0.
  GatherWindow(std::vector<int> positions, int prefetch);

  int forward_ops() const { return static_cast<int>(positions_.size()) / 2; }
  int unit(int position) const { return positions_[position]; }
  const std::vector<int>& positions() const { return positions_; }

  // The last position acquiring `position` issues gathers for (from
  // `position` on): `prefetch` ahead in the forward, one in the backward, never
  // past `last_position` (the pass's end).
  int IssueEnd(int position, int last_position) const;
  // `position` needs no gather of its own: the position before it has the
  // same unit and hands it over on release.
  bool TakesOver(int position) const;
  // Where releasing `position` hands its unit: the next position (the same
  // unit twice in a row) or, at the turn from forward to backward, the
  // backward mirror of one of the last `prefetch` forward positions (kept
  // instead of gathered again); -1: the unit is freed. `backward_follows` is
  // false in evaluation passes. A mirror takes the unit only when it has no
  // gather of its own yet (HandsOver).
  int HandOverTarget(int position, bool backward_follows) const;
  // HandOverTarget's `next` applied: whether the unit moves there, given
  // whether `next` already has a slot.
  static bool HandsOver(int position, int next, bool next_has_slot) {
    return next == position + 1 || (next >= 0 && !next_has_slot);
  }
  // Step's early gathers of the next pass: positions 0..EarlyEnd().
  int EarlyEnd() const;
  // The most gathered units alive at once over any pass the engine runs: a
  // training pass or an evaluation pass, each with or without Step's early
  // gathers before it (every pass ends with none alive).
  int PeakUnits() const;

 private:
  // One pass walked with the rules above; its peak of units alive.
  int Walk(bool early_gathers, bool training) const;

  std::vector<int> positions_;
  int prefetch_ = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_GATHER_WINDOW_H_
