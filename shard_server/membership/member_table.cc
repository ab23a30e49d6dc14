#include "shard_server/membership/member_table.h"

#include <cassert>
#include <string>

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

void Membership::RebuildSilenceOrder(Job& job) {
  std::vector<int> live;
  live.reserve(job.members.size());
  for (const MemberState& m : job.members) {
    if (m.alive && !m.left && !job.undelivered.contains(m.rank)) live.push_back(m.rank);
  }
  std::stable_sort(live.begin(), live.end(), [&](int a, int b) {
    return job.members[a].last_heartbeat < job.members[b].last_heartbeat;
  });
  job.silence.Reset(static_cast<int>(job.members.size()));
  for (int rank : live) job.silence.MoveToBack(rank);
  job.closed_streams.clear();
  for (const MemberState& m : job.members) {
    if (m.alive && !m.left && m.stream_closed > m.last_heartbeat) job.closed_streams.insert(m.rank);
  }
}

void Membership::StopWatching(Job& job, int rank) {
  job.silence.Remove(rank);
  job.undelivered.erase(rank);
  job.closed_streams.erase(rank);
}

void Membership::StartClock(Job& job, int rank, absl::Time now) {
  if (job.undelivered.erase(rank) == 0) return;  // started already
  MemberState& m = job.members[rank];
  if (!m.alive || m.left) return;
  m.last_heartbeat = now;  // the latest time any member has: the back of the order
  job.silence.MoveToBack(rank);
}

int64_t Membership::CommittedSnapshot(const Job& job) {
  int64_t snapshot_step = -1;
  bool any = false;
  for (const MemberState& m : job.members) {
    if (!m.alive || m.left) continue;
    snapshot_step = any ? std::min(snapshot_step, m.snapshot_step) : m.snapshot_step;
    any = true;
  }
  return snapshot_step;
}

int Membership::WithGrowers(const Job& job, int world_size) {
  return std::min(job.target_world_size, world_size + static_cast<int>(job.pending.size()));
}

}  // namespace zeroshard
