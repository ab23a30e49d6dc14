// The data plane of one job generation: the communicators the ZeRO engine
// moves parameters and gradients over, bootstrapped through the shard
// server's KV store (which is scoped to the generation, so the next
// generation bootstraps afresh with the same tags).
//
//   gather  all-gathers of parameters (Gloo: shared memory or TCP; or NCCL)
//   reduce  reductions of gradients (the same transport, its own context, so
//           that gathers and reductions run at once)
//   replicas  with shard groups (HSDP): averages gradient shards over the
//           groups holding the same shard
//   secondary  with hpZ: the backward's gathers from the secondary shards,
//           over groups of H consecutive ranks (those of a host)
//   aux     small collectives of host-side metrics (Gloo over TCP)
#ifndef ZEROSHARD_WORKER_DATA_PLANE_H_
#define ZEROSHARD_WORKER_DATA_PLANE_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/data_plane_description.h"

namespace zeroshard {

enum class DataPlaneBackend { kGloo, kNccl };

struct DataPlaneOptions {
  // kNccl: gather and reduce over NCCL on `cuda_device`; aux stays on Gloo.
  DataPlaneBackend backend = DataPlaneBackend::kGloo;
  int cuda_device = 0;
  // kNccl, the device GPT: its attention kernel (auto | cudnn | flash |
  // naive, CudaGptOptions::Attention) and TF32 for f32 products.
  std::string gpu_attention = "auto";
  bool tf32 = false;
  // Gloo binds to this address and advertises it to the peers.
  std::string host = "127.0.0.1";
  // Gloo: gathers and reductions through shared memory when every rank runs
  // on this host (GlooCommunicator::Options::shared_memory).
  bool shared_memory = true;
  // Gloo: gathers and reductions in two levels (two_level_communicator.h)
  // when the ranks share hosts, the same number on each of several hosts.
  bool two_level = false;
  // Hybrid sharding: G > 0 and < W puts gather and reduce over groups of G
  // consecutive ranks and adds the replicas' communicator (DataPlane). G
  // divides W; 0 or W: no groups.
  int shard_group_size = 0;
  // hpZ: H > 0 adds the `secondary` communicator over groups of H
  // consecutive ranks. H divides W; 0: none.
  int secondary_group_size = 0;
  // Bounds the rendezvous, each connect to a peer and every collective.
  absl::Duration timeout = absl::Seconds(60);
  // Gloo's TCP pairs listen on these ports (--data_plane_ports); empty:
  // ephemeral ports.
  PortRange ports;
  // A fourth context, "snapshot" (Gloo over TCP, point to point), for the
  // in-memory snapshots' buddy copies and recovery transfers.
  bool snapshots = false;
  // Shard groups under --outer_timeout: a fifth context, "aux/group<g>"
  // (Gloo over TCP), over this rank's group only, for the per-step
  // agreement on the loss and the gradient norm (the groups do not meet
  // between outer steps).
  bool group_aux = false;
  // Tests only (--test_hold_data_plane): after publishing its addresses,
  // each communicator waits until this file exists (at most `timeout`)
  // before connecting.
  std::string test_hold_file;
};

// Bytes sent, by where they went: to a rank on this host (shared memory or
// loopback TCP) or across the network to another host.
struct HostBytes {
  int64_t intra_host = 0;
  int64_t inter_host = 0;
};

inline HostBytes operator-(const HostBytes& a, const HostBytes& b) {
  return {a.intra_host - b.intra_host, a.inter_host - b.inter_host};
}

struct DataPlane {
  std::unique_ptr<Communicator> gather;
  std::unique_ptr<Communicator> reduce;
  // With shard groups (options.shard_group_size < W) gather and reduce run
  // over this rank's group, and `replicas` over the ranks holding the same
  // shard in the other groups; null without groups.
  std::unique_ptr<Communicator> replicas;
  // hpZ (options.secondary_group_size > 0): over this rank's secondary group.
  std::unique_ptr<Communicator> secondary;
  std::unique_ptr<Communicator> aux;
  std::unique_ptr<GlooCommunicator> snapshot;  // options.snapshots; else null
  std::unique_ptr<Communicator> group_aux;     // options.group_aux; else null
  // --outer_timeout: communicators over some groups' members `member`
  // (ConnectReplicaSubset), by group mask; the worker's thread only.
  std::map<uint64_t, std::unique_ptr<Communicator>> replica_subsets;
  // What each bulk communicator runs on (the run report's "data_plane").
  DataPlaneDescription description;

  // Communicator::Abort on all three: a collective blocked in another thread
  // fails promptly, and so do the peers blocked on this rank. Thread-safe;
  // REQUIRES: the communicators are not being destroyed.
  void Abort();

  // What the bulk communicators (gather, reduce, replicas, secondary) sent so far, by where it
  // went. Two-level communicators count their levels; a flat ring (Gloo TCP,
  // NCCL) sends everything to its successor, so its bytes are intra-host
  // when the successor runs on this host and inter-host otherwise; shared
  // memory is intra-host. Thread-safe as bytes_sent() is.
  HostBytes BytesByHost() const;
  // One per bulk communicator, set by ConnectDataPlane: its bytes split.
  std::vector<std::function<HostBytes()>> host_bytes;
};

// Says on stderr what the host communicators run on and why (shared memory
// or TCP); nothing for NCCL.
void LogHostTransports(const DataPlane& plane);

// Connects this rank's communicators with the `world_size` - 1 others of the
// generation `client` joined, through its KV store. The KV store's or the
// transport's error, naming the communicator ("gloo bootstrap (gather): ..."),
// otherwise; ABORTED soon after `cancelled` (polled from any thread; may be
// empty) turns true. Built without CUDA, kNccl is FAILED_PRECONDITION.
// REQUIRES: `client` joined the generation; every rank calls this.
absl::StatusOr<std::unique_ptr<DataPlane>> ConnectDataPlane(Client* client, int rank,
                                                            int world_size,
                                                            const DataPlaneOptions& options,
                                                            std::function<bool()> cancelled = {});

// --outer_timeout: the replicas' communicator over the groups in
// `present` (bit g: group g) only, for an outer step some groups were left
// out of: this rank's member index in each of them, tagged by the mask
// (the KV store is the generation's, so the tag need not name it). Every
// rank of the present groups calls it with the same mask; this rank's group
// must be in it. REQUIRES: ConnectDataPlane ran in this generation.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectReplicaSubset(
    Client* client, int rank, int world_size, const DataPlaneOptions& options, uint64_t present,
    std::function<bool()> cancelled = {});

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_DATA_PLANE_H_
