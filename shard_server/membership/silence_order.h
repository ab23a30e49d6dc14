// The live members of one job in the order of their last heartbeat, oldest
// first, so that the server's timer finds the silent ones without looking at
// the others: a beat moves its member to the back in O(1), and the timer
// walks from the front only while the members it meets are silent. What the
// timer does per tick is then proportional to the silent members, not to the
// job (issue #31: a job of 100,000 ranks).
//
// An intrusive doubly-linked list over ranks [0, size): two ints per rank.
// Invariant (kept by the caller, Membership): the list holds exactly the
// live members (alive, not left), and a member is moved to the back with
// the time of its latest beat, which is never before anyone else's (the
// server's clock; a wall clock stepped back delays a silent member's
// discovery by at most the step). Not thread-safe: guarded by Membership's
// mutex.
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_SILENCE_ORDER_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_SILENCE_ORDER_H_

#include <vector>

namespace zeroshard {

class SilenceOrder {
 public:
  // Empty, with room for ranks [0, size).
  void Reset(int size);
  // Links `rank` at the back (the newest beat), from wherever it was.
  // REQUIRES: 0 <= rank < size.
  void MoveToBack(int rank);
  // Unlinks `rank`; nothing when it is not linked.
  void Remove(int rank);
  bool Contains(int rank) const;

  // The member that beat longest ago; -1 when empty.
  int Oldest() const { return head_; }
  // The member that beat last; -1 when empty.
  int Newest() const { return tail_; }
  // The member after `rank` (one that beat later); -1 at the back.
  // REQUIRES: Contains(rank).
  int Next(int rank) const { return next_[rank]; }
  int size() const { return size_; }

 private:
  static constexpr int kUnlinked = -2;
  std::vector<int> prev_;  // by rank; kUnlinked: not in the list, -1: the front
  std::vector<int> next_;  // by rank; -1: the back
  int head_ = -1;
  int tail_ = -1;
  int size_ = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_SILENCE_ORDER_H_
