// How a generation's W ranks are grouped for hybrid sharding (HSDP) and hpZ:
// the one place that says which ranks spread one shard, which hold its
// replicas and which share a secondary (hpZ) copy. The planner, the memory
// estimate, shardctl, the data plane, the engine and the recovery decision
// all ask it (planner.h, "Shard groups"; docs/design.md).
//
//   shard group   G consecutive ranks, g*G .. g*G + G - 1, spreading one copy
//                 of the model's state (ZeRO inside the group). G = W: plain
//                 ZeRO, one group. Rank r is member r % G of group r / G.
//   replicas      the R = W / G groups each hold the whole state: rank r's
//                 replicas are the ranks with its member index in the other
//                 groups (HSDP averages gradients over them).
//   secondary     hpZ: groups of H consecutive ranks (a host's) each holding
//                 a secondary copy of the parameters for the backward's
//                 gathers; H divides W and is smaller than G. 0: none.
//
// The worker forms a generation's groups (worker/worker_groups.cc: the
// flags, or the ranks per host agreed through the KV store) and checks them
// with Make; the plan carries G (PlanOptions::shard_group_size).
#ifndef ZEROSHARD_COMMON_PLAN_SHARD_GROUPS_H_
#define ZEROSHARD_COMMON_PLAN_SHARD_GROUPS_H_

#include <cassert>

#include "absl/status/statusor.h"

namespace zeroshard {

class ShardGroups {
 public:
  // Groups of `shard_group_size` ranks when 0 < it < `world`, else one
  // group of all (plain ZeRO: 0, or W). REQUIRES: world >= 1; a size below
  // W divides W and `secondary` is 0 or valid (Make checks both).
  ShardGroups(int world, int shard_group_size, int secondary = 0)
      : world_(world),
        size_(shard_group_size > 0 && shard_group_size < world ? shard_group_size : world),
        secondary_(secondary) {
    assert(world >= 1 && world % size_ == 0);
  }
  // The same, checked: INVALID_ARGUMENT naming the flag for a group size
  // that does not divide W, or a secondary size that does not divide W or is
  // not smaller than G.
  static absl::StatusOr<ShardGroups> Make(int world, int shard_group_size, int secondary);

  int world() const { return world_; }
  int size() const { return size_; }              // G
  int count() const { return world_ / size_; }    // R: groups, each a replica
  int secondary() const { return secondary_; }    // H (0: no hpZ)
  bool hybrid() const { return size_ < world_; }  // more than one group

  int GroupOf(int rank) const { return rank / size_; }
  int MemberOf(int rank) const { return rank % size_; }
  int RankOf(int group, int member) const { return group * size_ + member; }
  // Whether ranks `a` and `b` hold the same shard (one is the other's
  // replica, or a == b).
  bool SameShard(int a, int b) const { return MemberOf(a) == MemberOf(b); }
  // The replica of `rank` in the next group, cyclically (-1 without
  // replicas): whose run of the shard an in-memory snapshot keeps too.
  int NextReplica(int rank) const {
    return count() < 2 ? -1 : RankOf((GroupOf(rank) + 1) % count(), MemberOf(rank));
  }
  // The first rank of `rank`'s secondary group. REQUIRES: secondary() > 0.
  int SecondaryBase(int rank) const { return rank / secondary_ * secondary_; }

 private:
  int world_;
  int size_;
  int secondary_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_PLAN_SHARD_GROUPS_H_
