// What a job generation's data plane runs on (DataPlane::description): the
// transport of each bulk communicator, typed, so that the worker decides
// engine options by value; the run report writes it out as JSON
// (run_report.cc, "data_plane").
#ifndef ZEROSHARD_WORKER_DATA_PLANE_DESCRIPTION_H_
#define ZEROSHARD_WORKER_DATA_PLANE_DESCRIPTION_H_

#include <cstdint>
#include <optional>
#include <string>

namespace zeroshard {

// What a bulk communicator moves its bytes over: Gloo's shared memory (every
// rank of it on this host), Gloo's TCP pairs, two levels (shared memory or
// TCP inside a host, TCP across; two_level_communicator.h), or NCCL.
enum class BulkTransport { kSharedMemory, kTcp, kTwoLevel, kNccl };

// "shm", "tcp", "two-level", "nccl": the words of the run report and logs.
inline const char* BulkTransportName(BulkTransport transport) {
  switch (transport) {
    case BulkTransport::kSharedMemory:
      return "shm";
    case BulkTransport::kTcp:
      return "tcp";
    case BulkTransport::kTwoLevel:
      return "two-level";
    case BulkTransport::kNccl:
      return "nccl";
  }
  return "unknown";
}

// One bulk communicator.
struct CommunicatorDescription {
  BulkTransport transport = BulkTransport::kTcp;
  // Gloo (every transport but NCCL): why this transport, or how big its
  // segment is; and the bytes of shared memory this rank maps (0 on TCP).
  std::string note;
  int64_t shm_segment_bytes = 0;
  // The KV-store tag it bootstrapped under when that is not its role's name
  // (a shard group's: "gather/group1", "replicas/member0"); "" otherwise.
  std::string tag;
};

// Each bulk communicator's, by role; empty where the plane has none
// (replicas: only with shard groups; secondary: only with hpZ).
struct DataPlaneDescription {
  std::optional<CommunicatorDescription> gather;
  std::optional<CommunicatorDescription> reduce;
  std::optional<CommunicatorDescription> replicas;
  std::optional<CommunicatorDescription> secondary;

  // The reductions (a shard group's, with HSDP) run over shared memory: they
  // cross no link.
  bool ReduceOverSharedMemory() const {
    return reduce.has_value() && reduce->transport == BulkTransport::kSharedMemory;
  }
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_DATA_PLANE_DESCRIPTION_H_
