#include "tests/worker/zero/outer_ranks.h"

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/host_communicator.h"

namespace zeroshard {

absl::StatusOr<OuterRankComms> ConnectOuterRank(InMemoryKvStore* store, int rank, int world,
                                                int group_size, bool group_numerics) {
  const int group = rank / group_size, member = rank % group_size;
  OuterRankComms comms;
  auto connect = [&](std::unique_ptr<Communicator>* out, int r, int n,
                     const std::string& tag) -> absl::Status {
    auto comm = CreateHostCommunicator(store, r, n, tag);
    if (!comm.ok()) return comm.status();
    *out = *std::move(comm);
    return absl::OkStatus();
  };
  for (absl::Status s : {connect(&comms.gather, member, group_size, absl::StrCat("gather", group)),
                         connect(&comms.reduce, member, group_size, absl::StrCat("reduce", group)),
                         connect(&comms.aux, rank, world, "aux")}) {
    if (!s.ok()) return s;
  }
  if (world > group_size) {
    absl::Status s =
        connect(&comms.replicas, group, world / group_size, absl::StrCat("replicas", member));
    if (!s.ok()) return s;
  }
  if (group_numerics) {
    absl::Status s = connect(&comms.numerics, member, group_size, absl::StrCat("numerics", group));
    if (!s.ok()) return s;
  }
  return comms;
}

absl::StatusOr<ShardPlan> PlanOuterMlp(const MlpConfig& mlp, int world, int group_size) {
  auto probe = MlpModel::Create(mlp);
  if (!probe.ok()) return probe.status();
  PlanOptions options;
  options.alignment_elements = 4;
  options.shard_group_size = group_size;
  return Plan((*probe)->Spec(), world, options);
}

absl::Status InitializeFromSeed(ZeroEngine& engine, const Model& model, uint64_t seed) {
  return engine.Initialize([&](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
    model.InitRows(t, begin, end, seed, out);
    return absl::OkStatus();
  });
}

void OnRankThreads(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) threads.emplace_back(body, rank);
  for (auto& t : threads) t.join();
}

}  // namespace zeroshard
