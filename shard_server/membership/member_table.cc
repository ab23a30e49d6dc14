#include "shard_server/membership/member_table.h"

#include <algorithm>
#include <cassert>
#include <string>
#include <vector>

namespace zeroshard {

Membership::MemberState* Membership::Job::FindMember(const std::string& worker_id) {
  assert(rank_by_worker.size() == members.size());  // IndexMembers after every change
  auto it = rank_by_worker.find(worker_id);
  if (it == rank_by_worker.end()) return nullptr;
  MemberState& m = members[it->second];
  assert(m.worker_id == worker_id);
  return &m;
}

void Membership::Job::IndexMembers() {
  rank_by_worker.clear();
  rank_by_worker.reserve(members.size());
  for (const MemberState& m : members) rank_by_worker[m.worker_id] = m.rank;
}

const Membership::MemberState* Membership::Job::FindMember(const std::string& worker_id) const {
  return const_cast<Job*>(this)->FindMember(worker_id);
}

void Membership::Job::RebuildSilenceOrder() {
  std::vector<int> live;
  live.reserve(members.size());
  for (const MemberState& m : members) {
    if (m.alive && !m.left && !undelivered.contains(m.rank)) live.push_back(m.rank);
  }
  std::stable_sort(live.begin(), live.end(), [&](int a, int b) {
    return members[a].last_heartbeat < members[b].last_heartbeat;
  });
  silence.Reset(static_cast<int>(members.size()));
  for (int rank : live) silence.MoveToBack(rank);
  closed_streams.clear();
  for (const MemberState& m : members) {
    if (m.alive && !m.left && m.stream_closed > m.last_heartbeat) closed_streams.insert(m.rank);
  }
}

void Membership::Job::StopWatching(int rank) {
  silence.Remove(rank);
  undelivered.erase(rank);
  closed_streams.erase(rank);
}

void Membership::Job::StartClock(int rank, absl::Time now) {
  if (undelivered.erase(rank) == 0) return;  // started already
  MemberState& m = members[rank];
  if (!m.alive || m.left) return;
  m.last_heartbeat = now;  // the latest time any member has: the back of the order
  silence.MoveToBack(rank);
}

int64_t Membership::Job::CommittedSnapshot() const {
  int64_t snapshot_step = -1;
  bool any = false;
  for (const MemberState& m : members) {
    if (!m.alive || m.left) continue;
    snapshot_step = any ? std::min(snapshot_step, m.snapshot_step) : m.snapshot_step;
    any = true;
  }
  return snapshot_step;
}

int Membership::Job::WithGrowers(int size) const {
  return std::min(target_world_size, size + static_cast<int>(pending.size()));
}

}  // namespace zeroshard
