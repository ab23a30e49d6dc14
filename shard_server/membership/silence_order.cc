#include "shard_server/membership/silence_order.h"

#include <cassert>

namespace zeroshard {

void SilenceOrder::Reset(int size) {
  prev_.assign(size, kUnlinked);
  next_.assign(size, -1);
  head_ = tail_ = -1;
  size_ = 0;
}

bool SilenceOrder::Contains(int rank) const {
  return rank >= 0 && rank < static_cast<int>(prev_.size()) && prev_[rank] != kUnlinked;
}

void SilenceOrder::Remove(int rank) {
  if (!Contains(rank)) return;
  const int before = prev_[rank];
  const int after = next_[rank];
  (before == -1 ? head_ : next_[before]) = after;
  (after == -1 ? tail_ : prev_[after]) = before;
  prev_[rank] = kUnlinked;
  next_[rank] = -1;
  --size_;
}

void SilenceOrder::MoveToBack(int rank) {
  assert(rank >= 0 && rank < static_cast<int>(prev_.size()));
  if (tail_ == rank) return;  // already the newest: the common case of a lone member
  Remove(rank);
  prev_[rank] = tail_;
  next_[rank] = -1;
  (tail_ == -1 ? head_ : next_[tail_]) = rank;
  tail_ = rank;
  ++size_;
}

}  // namespace zeroshard
