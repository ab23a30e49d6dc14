// Grow back: workers missing from a shrunk job join the next generation at
// the members' next committed snapshot.
#include <string>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {
namespace {

// Grow back: how long growers wait for the members' next committed snapshot
// before they are admitted anyway (the job then restores its latest snapshot
// or disk checkpoint, as after a death): a job that takes no snapshots
// (--snapshot_every=0) still grows back.
constexpr absl::Duration kGrowBoundaryWait = absl::Seconds(60);

}  // namespace

void Membership::MaybeGrowBack(Job& job, absl::Time now, Deferred& deferred) {
  if (!job.formed() || job.pending.empty()) {
    job.grow_since = absl::InfinitePast();
    return;
  }
  const int64_t committed = job.CommittedSnapshot();
  const bool boundary = committed > job.grow_mark;
  if (!boundary && now - job.grow_since < kGrowBoundaryWait) return;
  // Whole shard groups only: one grower of a group of two would make a
  // world size no plan of that group size covers (W = 3 in groups of 2);
  // it waits for the rest of its group. A job's target is a multiple.
  const int m = job.world_multiple;
  if (m > 1 && job.WithGrowers(job.world_size) % m != 0) return;
  std::string who;
  for (const auto& [worker_id, p] : job.pending) {
    absl::StrAppend(&who, who.empty() ? "" : ", ", "'", worker_id, "'");
  }
  const int from = job.world_size;
  const std::string reason =
      absl::StrCat("grow back from ", from, " to ", job.WithGrowers(from), " of ",
                   job.target_world_size, " workers (", who, ") ",
                   boundary ? absl::StrCat("once every member had the snapshot of step ", committed,
                                           " (the job resumes from its latest common one)")
                            : absl::StrCat("after ", absl::FormatDuration(kGrowBoundaryWait),
                                           " without a new snapshot"));
  if (StartGeneration(job, from, v1::DEGRADED, reason, deferred).ok()) {
    log_->Log("grow_back", {{"job", job.id},
                            {"generation", absl::StrCat(job.generation)},
                            {"from", absl::StrCat(from)},
                            {"to", absl::StrCat(job.world_size)},
                            {"snapshot_step", absl::StrCat(committed)}});
  }
}

}  // namespace zeroshard
