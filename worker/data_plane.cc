#include "worker/data_plane.h"

#include <unistd.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/local_address.h"
#include "common/plan/shard_groups.h"
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

// --test_hold_data_plane: waits until `file` exists (or `cancelled`, or
// `timeout`), saying so once.
std::function<void()> HoldUntilFileExists(const std::string& file, absl::Duration timeout,
                                          std::function<bool()> cancelled) {
  if (file.empty()) return {};
  return [file, timeout, cancelled] {
    const absl::Time deadline = absl::Now() + timeout;
    bool said = false;
    while (access(file.c_str(), F_OK) != 0 && absl::Now() < deadline &&
           !(cancelled && cancelled())) {
      if (!said) {
        std::fprintf(stderr,
                     "shard_worker: test: holding the data plane's connections until %s "
                     "exists\n",
                     file.c_str());
        said = true;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  };
}

GlooCommunicator::Options GlooOptions(const DataPlaneOptions& options, bool shared_memory,
                                      const std::function<bool()>& cancelled) {
  GlooCommunicator::Options gloo;
  gloo.hostname = options.host;
  gloo.connect_timeout = options.timeout;
  gloo.ports = options.ports;
  gloo.shared_memory = shared_memory;
  gloo.cancelled = cancelled;
  gloo.before_connecting = HoldUntilFileExists(options.test_hold_file, options.timeout, cancelled);
  return gloo;
}

// Where a flat ring's bytes go: all to its successor.
std::function<HostBytes()> RingBytes(const Communicator* comm, bool successor_elsewhere) {
  return [comm, successor_elsewhere] {
    const CollectiveBytes b = comm->bytes_sent();
    const int64_t sum = b.all_gather + b.reduce_scatter + b.all_reduce + b.broadcast;
    return successor_elsewhere ? HostBytes{0, sum} : HostBytes{sum, 0};
  };
}

// Host identities in the store, one per rank, so that each ring can tell
// whether its successor runs on another host: one write and one read per
// ring, whatever the world size.
constexpr char kHostKeyPrefix[] = "data_plane/host/";

absl::Status PublishHost(KeyValueStore* store, int rank) {
  return store->Set(absl::StrCat(kHostKeyPrefix, rank), HostIdentity());
}

// Whether job rank `other` (which published its host) runs on another host.
absl::StatusOr<bool> RunsElsewhere(KeyValueStore* store, int other, absl::Duration timeout) {
  absl::StatusOr<std::string> host = store->Get(absl::StrCat(kHostKeyPrefix, other), timeout);
  if (!host.ok()) return Failed("data plane: the ring successor's host", host.status());
  return *host != HostIdentity();
}

// What a Gloo communicator (flat or two levels) runs on.
CommunicatorDescription DescribeHost(const HostCommunicator& comm) {
  CommunicatorDescription d;
  switch (comm.transport()) {
    case HostTransport::kSharedMemory:
      d.transport = BulkTransport::kSharedMemory;
      break;
    case HostTransport::kTcp:
      d.transport = BulkTransport::kTcp;
      break;
    case HostTransport::kTwoLevel:
      d.transport = BulkTransport::kTwoLevel;
      break;
  }
  d.note = comm.transport_note();
  d.shm_segment_bytes = comm.shm_segment_bytes();
  return d;
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(
    KeyValueStore* store, int rank, int world_size, const std::string& tag,
    const DataPlaneOptions& options, bool shared_memory, const std::function<bool()>& cancelled,
    CommunicatorDescription* description, bool successor_elsewhere = false,
    std::function<HostBytes()>* host_bytes = nullptr) {
  const GlooCommunicator::Options gloo = GlooOptions(options, shared_memory, cancelled);
  // Shared memory or TCP, the same for every rank (host_communicator.h).
  absl::StatusOr<std::unique_ptr<HostCommunicator>> created =
      CreateHostCommunicator(store, rank, world_size, tag, gloo);
  if (!created.ok()) return Failed(absl::StrCat("gloo bootstrap (", tag, ")"), created.status());
  if (description != nullptr) *description = DescribeHost(**created);
  if (host_bytes != nullptr) {
    // Shared memory never leaves the host.
    *host_bytes =
        RingBytes(created->get(),
                  successor_elsewhere && (*created)->transport() != HostTransport::kSharedMemory);
  }
  return std::unique_ptr<Communicator>(*std::move(created));
}

// Two levels when the ranks share hosts (every rank reads the same host
// identities, so all agree); nullptr when they do not, and the flat
// transport serves.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectTwoLevel(
    KeyValueStore* store, int rank, int world_size, const std::string& tag,
    const DataPlaneOptions& options, const std::function<bool()>& cancelled,
    CommunicatorDescription* description, std::function<HostBytes()>* host_bytes) {
  TwoLevelCommunicator::Options two_level;
  two_level.host = GlooOptions(options, options.shared_memory, cancelled);
  std::string why_not;
  absl::StatusOr<std::unique_ptr<TwoLevelCommunicator>> created =
      TwoLevelCommunicator::Create(store, rank, world_size, tag, two_level, &why_not);
  if (!created.ok()) {
    return Failed(absl::StrCat("two-level bootstrap (", tag, ")"), created.status());
  }
  if (*created == nullptr) {
    if (rank == 0)
      std::fprintf(stderr, "data plane (%s): flat: %s\n", tag.c_str(), why_not.c_str());
    return nullptr;
  }
  *description = DescribeHost(**created);
  // The communicator knows which of its levels crossed the network.
  const TwoLevelCommunicator* levels = created->get();
  *host_bytes = [levels] {
    const CollectiveBytes all = levels->bytes_sent();
    const CollectiveBytes inter = levels->inter_host_bytes_sent();
    const int64_t sum = all.all_gather + all.reduce_scatter + all.all_reduce + all.broadcast;
    const int64_t across =
        inter.all_gather + inter.reduce_scatter + inter.all_reduce + inter.broadcast;
    return HostBytes{sum - across, across};
  };
  return std::unique_ptr<Communicator>(*std::move(created));
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectBulk(KeyValueStore* store, int rank,
                                                          int world_size, const std::string& tag,
                                                          const DataPlaneOptions& options,
                                                          const std::function<bool()>& cancelled,
                                                          bool successor_elsewhere,
                                                          CommunicatorDescription* description,
                                                          std::function<HostBytes()>* host_bytes) {
  if (options.backend == DataPlaneBackend::kNccl) {
#ifdef ZEROSHARD_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl = NcclCommunicator::Create(
        store, rank, world_size, options.cuda_device, tag, options.timeout);
    if (!nccl.ok()) return Failed(absl::StrCat("nccl bootstrap (", tag, ")"), nccl.status());
    description->transport = BulkTransport::kNccl;
    // Taken as a ring (NCCL may pick trees; the split is then approximate).
    *host_bytes = RingBytes(nccl->get(), successor_elsewhere);
    return std::unique_ptr<Communicator>(*std::move(nccl));
#else
    return absl::FailedPreconditionError("nccl: this shard_worker was built without CUDA");
#endif
  }
  if (options.two_level) {
    absl::StatusOr<std::unique_ptr<Communicator>> two_level =
        ConnectTwoLevel(store, rank, world_size, tag, options, cancelled, description, host_bytes);
    if (!two_level.ok() || *two_level != nullptr) return two_level;
  }
  return ConnectGloo(store, rank, world_size, tag, options, options.shared_memory, cancelled,
                     description, successor_elsewhere, host_bytes);
}

// --outer_timeout (options.group_aux) with shard groups: the group's own
// aux (Gloo over TCP), for the step's loss and norm agreement inside it.
absl::Status ConnectGroupAux(KeyValueStore* store, const ShardGroups& groups, int rank,
                             const DataPlaneOptions& options,
                             const std::function<bool()>& cancelled, DataPlane* plane) {
  if (!options.group_aux || !groups.hybrid()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      ConnectGloo(store, groups.MemberOf(rank), groups.size(),
                  absl::StrCat("aux/group", groups.GroupOf(rank)), options,
                  /*shared_memory=*/false, cancelled, nullptr);
  if (!comm.ok()) return comm.status();
  plane->group_aux = *std::move(comm);
  return absl::OkStatus();
}

}  // namespace

HostBytes DataPlane::BytesByHost() const {
  HostBytes sum;
  for (const auto& bytes : host_bytes) {
    const HostBytes b = bytes();
    sum.intra_host += b.intra_host;
    sum.inter_host += b.inter_host;
  }
  return sum;
}

void DataPlane::Abort() {
  for (Communicator* c : {gather.get(), reduce.get(), replicas.get(), secondary.get(), aux.get(),
                          group_aux.get(), static_cast<Communicator*>(snapshot.get())}) {
    if (c != nullptr) c->Abort();
  }
}

absl::StatusOr<std::unique_ptr<DataPlane>> ConnectDataPlane(Client* client, int rank,
                                                            int world_size,
                                                            const DataPlaneOptions& options,
                                                            std::function<bool()> cancelled) {
  // Only the rendezvous uses the store; the communicators do not keep it.
  ClientKvStore store(client);
  auto plane = std::make_unique<DataPlane>();
  if (absl::Status s = PublishHost(&store, rank); !s.ok()) return s;
  // Shard groups of G consecutive ranks (G = W: none): this rank is member
  // `member` of group `group`; its replicas are the members `member` of the
  // other groups (common/plan/shard_groups.h).
  const ShardGroups groups(world_size, options.shard_group_size, options.secondary_group_size);
  const int g = groups.size(), member = groups.MemberOf(rank), group = groups.GroupOf(rank),
            replicas = groups.count();
  // One bulk communicator into `slot`, described in `described`: `role`
  // over the `size` ranks listed by job_rank(i), this rank at index `index`.
  auto connect = [&](std::unique_ptr<Communicator>* slot,
                     std::optional<CommunicatorDescription>* described, const std::string& role,
                     const std::string& tag, int index, int size,
                     const std::function<int(int)>& job_rank) -> absl::Status {
    absl::StatusOr<bool> elsewhere =
        size > 1 ? RunsElsewhere(&store, job_rank((index + 1) % size), options.timeout) : false;
    if (!elsewhere.ok()) return elsewhere.status();
    plane->host_bytes.emplace_back();
    CommunicatorDescription description;
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        ConnectBulk(&store, index, size, tag, options, cancelled, *elsewhere, &description,
                    &plane->host_bytes.back());
    if (!comm.ok()) return comm.status();
    if (tag != role) description.tag = tag;  // described by role, with the group's tag
    *described = std::move(description);
    *slot = *std::move(comm);
    return absl::OkStatus();
  };
  DataPlaneDescription& described = plane->description;
  const std::string in_group = groups.hybrid() ? absl::StrCat("/group", group) : "";
  auto group_rank = [&](int i) { return groups.RankOf(group, i); };
  if (absl::Status s = connect(&plane->gather, &described.gather, "gather",
                               absl::StrCat("gather", in_group), member, g, group_rank);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = connect(&plane->reduce, &described.reduce, "reduce",
                               absl::StrCat("reduce", in_group), member, g, group_rank);
      !s.ok()) {
    return s;
  }
  if (replicas > 1) {
    absl::Status s = connect(&plane->replicas, &described.replicas, "replicas",
                             absl::StrCat("replicas/member", member), group, replicas,
                             [&](int k) { return groups.RankOf(k, member); });
    if (!s.ok()) return s;
  }
  if (options.secondary_group_size > 0) {
    // hpZ: groups of H consecutive ranks (a host's, with H = ranks per host).
    const int h = groups.secondary(), base = groups.SecondaryBase(rank);
    absl::Status s = connect(&plane->secondary, &described.secondary, "secondary",
                             absl::StrCat("secondary/group", rank / h), rank - base, h,
                             [&](int i) { return base + i; });
    if (!s.ok()) return s;
  }
  // Host-side metrics only: a few bytes, so TCP (no segment to map), and not
  // in the report.
  absl::StatusOr<std::unique_ptr<Communicator>> aux = ConnectGloo(
      &store, rank, world_size, "aux", options, /*shared_memory=*/false, cancelled, nullptr);
  if (!aux.ok()) return aux.status();
  plane->aux = *std::move(aux);
  if (absl::Status s = ConnectGroupAux(&store, groups, rank, options, cancelled, plane.get());
      !s.ok()) {
    return s;
  }
  if (options.snapshots) {
    absl::StatusOr<std::unique_ptr<GlooCommunicator>> snapshot = GlooCommunicator::Create(
        &store, rank, world_size, "snapshot", GlooOptions(options, false, cancelled));
    if (!snapshot.ok()) return Failed("gloo bootstrap (snapshot)", snapshot.status());
    plane->snapshot = *std::move(snapshot);
  }
  return plane;
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectReplicaSubset(
    Client* client, int rank, int world_size, const DataPlaneOptions& options, uint64_t present,
    std::function<bool()> cancelled) {
  ClientKvStore store(client);
  const ShardGroups groups(world_size, options.shard_group_size, options.secondary_group_size);
  const int member = groups.MemberOf(rank), group = groups.GroupOf(rank);
  std::vector<int> ranks;  // the present groups' members `member`, by group
  int index = -1;
  for (int k = 0; k < groups.count() && k < 64; ++k) {
    if ((present >> k & 1) == 0) continue;
    if (k == group) index = static_cast<int>(ranks.size());
    ranks.push_back(groups.RankOf(k, member));
  }
  if (index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, "'s group ", group,
                                                   " is not in the outer step's groups (mask ",
                                                   present, ")"));
  }
  const int size = static_cast<int>(ranks.size());
  absl::StatusOr<bool> elsewhere =
      size > 1 ? RunsElsewhere(&store, ranks[(index + 1) % size], options.timeout) : false;
  if (!elsewhere.ok()) return elsewhere.status();
  CommunicatorDescription description;
  std::function<HostBytes()> host_bytes;
  return ConnectBulk(&store, index, size,
                     absl::StrCat("replicas/groups", present, "/member", member), options,
                     cancelled, *elsewhere, &description, &host_bytes);
}

void LogHostTransports(const DataPlane& plane) {
  const DataPlaneDescription& d = plane.description;
  const std::pair<const char*, const std::optional<CommunicatorDescription>*> roles[] = {
      {"gather", &d.gather},
      {"reduce", &d.reduce},
      {"replicas", &d.replicas},
      {"secondary", &d.secondary}};
  for (const auto& [role, described] : roles) {
    if (!described->has_value()) continue;  // replicas: only with shard groups
    const CommunicatorDescription& c = **described;
    if (c.transport == BulkTransport::kNccl) continue;
    std::fprintf(stderr, "data plane (%s): %s, %s\n", role,
                 c.transport == BulkTransport::kSharedMemory ? "shared memory"
                 : c.transport == BulkTransport::kTwoLevel   ? "two levels"
                                                             : "TCP",
                 c.note.c_str());
  }
}

}  // namespace zeroshard
