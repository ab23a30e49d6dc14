#include "worker/data_plane.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/comm/client_kv_store.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/host_communicator.h"
#include "worker/comm/two_level_communicator.h"

#ifdef ZEROSHARD_HAVE_CUDA
#include "worker/cuda/nccl_communicator.h"
#endif

namespace zeroshard {
namespace {

// "<what>: <CODE>: <message>", keeping the code: the text shard_worker has
// always printed for a failed bootstrap.
absl::Status Failed(const std::string& what, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.ToString()));
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(KeyValueStore* store, int rank,
                                                          int world_size, const std::string& tag,
                                                          const DataPlaneOptions& options,
                                                          bool shared_memory,
                                                          nlohmann::json* description) {
  GlooCommunicator::Options gloo;
  gloo.hostname = options.host;
  gloo.connect_timeout = options.timeout;
  gloo.ports = options.ports;
  gloo.shared_memory = shared_memory;
  // Shared memory or TCP, the same for every rank (host_communicator.h).
  absl::StatusOr<std::unique_ptr<HostCommunicator>> created =
      CreateHostCommunicator(store, rank, world_size, tag, gloo);
  if (!created.ok()) return Failed(absl::StrCat("gloo bootstrap (", tag, ")"), created.status());
  if (description != nullptr) {
    (*description)[tag] = {{"transport", (*created)->transport()},
                           {"note", (*created)->transport_note()},
                           {"shm_segment_bytes", (*created)->shm_segment_bytes()}};
  }
  return std::unique_ptr<Communicator>(*std::move(created));
}

// Two levels when the ranks share hosts (every rank reads the same host
// identities, so all agree); nullptr when they do not, and the flat
// transport serves.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectTwoLevel(KeyValueStore* store, int rank,
                                                              int world_size,
                                                              const std::string& tag,
                                                              const DataPlaneOptions& options,
                                                              nlohmann::json* description) {
  TwoLevelCommunicator::Options two_level;
  two_level.host.hostname = options.host;
  two_level.host.connect_timeout = options.timeout;
  two_level.host.ports = options.ports;
  two_level.host.shared_memory = options.shared_memory;
  std::string why_not;
  absl::StatusOr<std::unique_ptr<TwoLevelCommunicator>> created =
      TwoLevelCommunicator::Create(store, rank, world_size, tag, two_level, &why_not);
  if (!created.ok()) {
    return Failed(absl::StrCat("two-level bootstrap (", tag, ")"), created.status());
  }
  if (*created == nullptr) {
    if (rank == 0) std::fprintf(stderr, "data plane (%s): flat: %s\n", tag.c_str(), why_not.c_str());
    return nullptr;
  }
  (*description)[tag] = {{"transport", (*created)->transport()},
                         {"note", (*created)->transport_note()},
                         {"shm_segment_bytes", (*created)->shm_segment_bytes()}};
  return std::unique_ptr<Communicator>(*std::move(created));
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectBulk(KeyValueStore* store, int rank,
                                                          int world_size, const std::string& tag,
                                                          const DataPlaneOptions& options,
                                                          nlohmann::json* description) {
  if (options.backend == DataPlaneBackend::kNccl) {
#ifdef ZEROSHARD_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl = NcclCommunicator::Create(
        store, rank, world_size, options.cuda_device, tag, options.timeout);
    if (!nccl.ok()) return Failed(absl::StrCat("nccl bootstrap (", tag, ")"), nccl.status());
    (*description)[tag] = {{"transport", "nccl"}};
    return std::unique_ptr<Communicator>(*std::move(nccl));
#else
    return absl::FailedPreconditionError("nccl: this shard_worker was built without CUDA");
#endif
  }
  if (options.two_level) {
    absl::StatusOr<std::unique_ptr<Communicator>> two_level =
        ConnectTwoLevel(store, rank, world_size, tag, options, description);
    if (!two_level.ok() || *two_level != nullptr) return two_level;
  }
  return ConnectGloo(store, rank, world_size, tag, options, options.shared_memory, description);
}

}  // namespace

void DataPlane::Abort() {
  for (Communicator* c :
       {gather.get(), reduce.get(), aux.get(), static_cast<Communicator*>(snapshot.get())}) {
    if (c != nullptr) c->Abort();
  }
}

absl::StatusOr<std::unique_ptr<DataPlane>> ConnectDataPlane(Client* client, int rank,
                                                            int world_size,
                                                            const DataPlaneOptions& options) {
  // Only the rendezvous uses the store; the communicators do not keep it.
  ClientKvStore store(client);
  auto plane = std::make_unique<DataPlane>();
  absl::StatusOr<std::unique_ptr<Communicator>> gather =
      ConnectBulk(&store, rank, world_size, "gather", options, &plane->description);
  if (!gather.ok()) return gather.status();
  plane->gather = *std::move(gather);
  absl::StatusOr<std::unique_ptr<Communicator>> reduce =
      ConnectBulk(&store, rank, world_size, "reduce", options, &plane->description);
  if (!reduce.ok()) return reduce.status();
  plane->reduce = *std::move(reduce);
  // Host-side metrics only: a few bytes, so TCP (no segment to map), and not
  // in the report.
  absl::StatusOr<std::unique_ptr<Communicator>> aux =
      ConnectGloo(&store, rank, world_size, "aux", options, /*shared_memory=*/false, nullptr);
  if (!aux.ok()) return aux.status();
  plane->aux = *std::move(aux);
  if (options.snapshots) {
    GlooCommunicator::Options gloo;
    gloo.hostname = options.host;
    gloo.connect_timeout = options.timeout;
    gloo.ports = options.ports;
    gloo.shared_memory = false;
    absl::StatusOr<std::unique_ptr<GlooCommunicator>> snapshot =
        GlooCommunicator::Create(&store, rank, world_size, "snapshot", gloo);
    if (!snapshot.ok()) return Failed("gloo bootstrap (snapshot)", snapshot.status());
    plane->snapshot = *std::move(snapshot);
  }
  return plane;
}

void LogHostTransports(const DataPlane& plane) {
  for (const char* tag : {"gather", "reduce"}) {
    const nlohmann::json& d = plane.description.at(tag);
    const std::string transport = d["transport"];
    if (transport == "nccl") continue;
    std::fprintf(stderr, "data plane (%s): %s, %s\n", tag,
                 transport == "shm"         ? "shared memory"
                 : transport == "two-level" ? "two levels"
                                            : "TCP",
                 d["note"].get<std::string>().c_str());
  }
}

}  // namespace zeroshard
