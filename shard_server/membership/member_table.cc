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

}  // namespace zeroshard
