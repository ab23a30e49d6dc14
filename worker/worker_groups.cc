// Where a generation's shard groups (HSDP) and hpZ secondary groups are
// formed: from the flags, or with =host from the ranks per host agreed
// through the KV store; checked as common/plan/shard_groups.h's ShardGroups,
// which everything after the plan reads.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/local_address.h"
#include "common/plan/shard_groups.h"
#include "common/status_context.h"
#include "worker/comm/client_kv_store.h"
#include "worker/comm/two_level_communicator.h"
#include "worker/worker.h"

namespace zeroshard {

absl::StatusOr<int> Worker::ShardGroupSize() {
  if (!config_.shard_group_by_host) return config_.plan.shard_group_size;
  return ConsecutiveRanksPerHost("--shard_group_size", "shard_groups");
}

absl::StatusOr<int> Worker::SecondaryGroupSize(int shard_group_size) {
  int h = config_.secondary_group_size;
  if (config_.secondary_group_by_host) {
    absl::StatusOr<int> per_host =
        ConsecutiveRanksPerHost("--secondary_shard_group_size", "secondary_groups");
    if (!per_host.ok()) return per_host.status();
    h = *per_host;
  }
  if (h == 0) return 0;
  absl::StatusOr<ShardGroups> groups = ShardGroups::Make(world(), shard_group_size, h);
  if (!groups.ok()) {
    const ShardGroups flat(world(), shard_group_size);
    return absl::InvalidArgumentError(absl::StrCat(
        "--secondary_shard_group_size: secondary groups of ", h, " ranks",
        config_.secondary_group_by_host ? " (the ranks per host)" : "",
        " must divide the world size ", world(), " and be smaller than the shard groups of ",
        flat.size(),
        " ranks (hpZ keeps the backward's gathers inside a host when the shard groups span "
        "hosts); drop the flag for this layout"));
  }
  return h;
}

absl::StatusOr<int> Worker::ConsecutiveRanksPerHost(const char* flag, const char* key) {
  const std::string what = absl::StrCat(flag, "=host");
  ClientKvStore store(client_.get());
  absl::StatusOr<std::vector<std::string>> keys =
      ExchangeHostKeys(&store, rank_, world(), key, HostIdentity(), config_.data_plane.timeout);
  if (!keys.ok()) return Annotate(keys.status(), absl::StrCat(what, ": exchanging hosts"));
  absl::StatusOr<HostLayout> layout = HostLayout::Of(*keys);
  if (!layout.ok()) return Annotate(layout.status(), what);
  // Groups are consecutive ranks: host h must hold ranks h*L .. h*L + L - 1.
  for (int h = 0; h < layout->hosts; ++h) {
    for (int i = 0; i < layout->local_size; ++i) {
      if (layout->ranks_on[h][i] != h * layout->local_size + i) {
        return absl::FailedPreconditionError(absl::StrCat(
            what, ": the ranks of a host must be consecutive, but rank ", layout->ranks_on[h][i],
            " runs on host ", h, " with rank ", layout->ranks_on[h][0],
            " (ranks follow the sorted worker ids: name workers host first, e.g. "
            "'<host>/<local rank>'), or give ",
            flag, "=G"));
      }
    }
  }
  return layout->local_size;
}

}  // namespace zeroshard
