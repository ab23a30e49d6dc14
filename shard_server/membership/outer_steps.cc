// The job's record of who took part in each DiLoCo outer step (docs/diloco.md,
// "Elastic outer steps"): rank 0 of each generation reports its last outer
// steps in heartbeats and in its Leave; the server keeps the job's last
// Job::kMaxOuterSteps, naming the workers from the generation's members.
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {
namespace {

// At most this many worker ids per record: enough to name a test's or a
// small job's groups; a large job's record keeps its numbers only.
constexpr int kMaxWorkersNamed = 32;

bool Kept(const std::deque<v1::OuterStepRecord>& kept, const v1::OuterStepRecord& r) {
  for (const v1::OuterStepRecord& k : kept) {
    if (k.generation() == r.generation() && k.after_step() == r.after_step()) return true;
  }
  return false;
}

// The ranks that took part, by rank: the groups in present_groups
// (--outer_timeout's quorum), else the first groups x group_size of the
// generation (every group).
template <typename Member>
void NameWorkers(int64_t generation, const std::vector<Member>& members_by_rank,
                 v1::OuterStepRecord* kept) {
  if (kept->generation() != generation) return;
  const int64_t size = kept->group_size();
  const int64_t members = static_cast<int64_t>(members_by_rank.size());
  uint64_t present = kept->present_groups();
  if (present == 0 && kept->groups() > 0 && kept->groups() < 64) {
    present = (uint64_t{1} << kept->groups()) - 1;
  }
  std::vector<int64_t> ranks;
  for (int64_t g = 0; g < 64; ++g) {
    if ((present >> g & 1) == 0) continue;
    for (int64_t r = g * size; r < (g + 1) * size; ++r) ranks.push_back(r);
    if (static_cast<int64_t>(ranks.size()) > kMaxWorkersNamed) return;
  }
  for (int64_t rank : ranks) {
    if (rank >= members) return;
  }
  for (int64_t rank : ranks) kept->add_workers(members_by_rank[rank].worker_id);
}

}  // namespace

void Membership::RecordOuterSteps(
    Job& job, const google::protobuf::RepeatedPtrField<v1::OuterStepRecord>& records) {
  for (const v1::OuterStepRecord& r : records) {
    if (Kept(job.outer_steps, r)) continue;
    // A record older than the newest kept (resent while already dropped
    // from the window) is not added back.
    if (!job.outer_steps.empty() && (r.generation() < job.outer_steps.back().generation() ||
                                     (r.generation() == job.outer_steps.back().generation() &&
                                      r.after_step() < job.outer_steps.back().after_step()))) {
      continue;
    }
    v1::OuterStepRecord& kept = job.outer_steps.emplace_back(r);
    NameWorkers(job.members_generation, job.members, &kept);
    while (job.outer_steps.size() > Job::kMaxOuterSteps) job.outer_steps.pop_front();
  }
}

}  // namespace zeroshard
