// The job's record of who took part in each DiLoCo outer step (docs/diloco.md,
// "Elastic outer steps"): rank 0 of each generation reports its last outer
// steps in heartbeats and in its Leave; the server keeps the job's last
// Job::kMaxOuterSteps, naming the workers from the generation's members.
#include <deque>
#include <string>

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
    // The ranks that took part are the first groups x group_size of the
    // generation (every group, until a group can be left out of one).
    const int64_t ranks = int64_t{r.groups()} * r.group_size();
    if (r.generation() == job.members_generation && ranks <= kMaxWorkersNamed &&
        ranks <= static_cast<int64_t>(job.members.size())) {
      for (int64_t rank = 0; rank < ranks; ++rank) kept.add_workers(job.members[rank].worker_id);
    }
    while (job.outer_steps.size() > Job::kMaxOuterSteps) job.outer_steps.pop_front();
  }
}

}  // namespace zeroshard
