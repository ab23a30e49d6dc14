#include "worker/replica_check.h"

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "worker/nonfinite_policy.h"

namespace zeroshard {

std::string DescribeReplicaMismatch(const ReplicaMismatch& mismatch, int64_t completed,
                                    int64_t steps, const std::vector<std::string>& hosts) {
  std::map<uint64_t, int> votes;
  for (uint64_t c : mismatch.checksums) ++votes[c];
  std::vector<std::string> held;
  std::vector<int> minority;
  for (size_t i = 0; i < mismatch.ranks.size(); ++i) {
    const int r = mismatch.ranks[i];
    const std::string host = r < static_cast<int>(hosts.size()) ? hosts[r] : "";
    held.push_back(absl::StrFormat("rank %d%s XXH3 %016x", r,
                                   host.empty() ? "" : absl::StrCat(" (host ", host, ")"),
                                   mismatch.checksums[i]));
    if (2 * votes[mismatch.checksums[i]] < static_cast<int>(mismatch.checksums.size())) {
      minority.push_back(r);
    }
  }
  return absl::StrCat(
      "after step ", completed, "/", steps, ": the replicas of shard member ", mismatch.member,
      " differ (", absl::StrJoin(held, ", "), "): silent data corruption on ",
      minority.empty() ? "one of them (two replicas cannot say which)"
                       : absl::StrCat("rank(s) ", absl::StrJoin(minority, ","), " (the minority)"));
}

absl::Status CheckReplicas(ZeroEngine& engine, int64_t completed, int64_t steps,
                           const std::vector<std::string>& hosts, double* hash_ms) {
  const int group = engine.group_size();
  if (group >= engine.world_size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--replica_check_every needs replicas: shard groups smaller than the job "
                     "(--shard_group_size=G < W=",
                     engine.world_size(), "); flat stage 3 has none to compare against"));
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<uint64_t> own = engine.MasterShardChecksum();
  if (!own.ok()) return own.status();
  if (hash_ms != nullptr) *hash_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  // Eight bytes per rank, carried as a double's bits.
  double carrier;
  std::memcpy(&carrier, &*own, sizeof(carrier));
  absl::StatusOr<std::vector<double>> all = engine.GatherOverRanks(carrier, "shard checksums");
  if (!all.ok()) return all.status();
  std::vector<uint64_t> checksums(all->size());
  for (size_t r = 0; r < all->size(); ++r) {
    std::memcpy(&checksums[r], &(*all)[r], sizeof(uint64_t));
  }
  std::vector<ReplicaMismatch> mismatches = FindReplicaMismatches(checksums, group);
  if (mismatches.empty()) return absl::OkStatus();
  return MarkNumericalStop(absl::FailedPreconditionError(absl::StrCat(
      DescribeReplicaMismatch(mismatches.front(), completed, steps, hosts), kReplicaStop)));
}

}  // namespace zeroshard
