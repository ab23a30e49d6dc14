// The CPU communicators and the factory that picks one.
//
//   GlooCommunicator  every collective over Gloo's TCP transport (rings
//                     here, Gloo's broadcast and barrier), point to point.
//   ShmCommunicator   the bulk collectives (all-gather, reduce-scatter,
//                     all-reduce, SharedGather) through one shared-memory
//                     segment when every rank runs on one host; broadcast
//                     and barrier over a GlooCommunicator it owns.
//
// CreateHostCommunicator bootstraps the TCP context, then agrees with every
// rank whether shared memory can be used by all (ShmExchange::Create): all
// ranks end up on the same transport. Both give the same results up to the
// order of additions (and, in bf16, rounding once instead of per hop) and
// count the same bytes.
#ifndef ZEROSHARD_WORKER_COMM_HOST_COMMUNICATOR_H_
#define ZEROSHARD_WORKER_COMM_HOST_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo_port_range.h"
#include "worker/comm/kv_store.h"

namespace zeroshard {

struct HostCommunicatorOptions {
  // Address or hostname to bind the listening sockets to and to advertise
  // to peers, e.g. "127.0.0.1" or this host's name ("" = gethostname()).
  // Ignored if `iface` is set.
  std::string hostname = "127.0.0.1";
  // Alternatively, a network interface name (e.g. "eth0") whose address is
  // used.
  std::string iface;
  // Bounds the rendezvous (waiting in the store for the peers' addresses)
  // and each TCP connect to a peer that published its address.
  absl::Duration connect_timeout = absl::Seconds(30);
  // The ports the TCP pairs listen on (--data_plane_ports); empty: ephemeral.
  PortRange ports;
  // CreateHostCommunicator: a ShmCommunicator when every rank runs on this
  // host (see shm_exchange.h); a GlooCommunicator (TCP) otherwise, when any
  // rank has it off, or when the segment cannot be made (the reason is in
  // transport_note()). All ranks always end up on the same transport.
  bool shared_memory = true;
  // Bytes each rank moves per round over shared memory, 4 KiB .. 1 GiB and
  // at least 4 KiB per rank; the segment holds 2 * world_size of them.
  // Ranks with different values use TCP.
  int64_t shm_slot_bytes = int64_t{4} << 20;
  // Polled (from any thread) while connecting to peers: true ends the setup
  // with ABORTED (the job's generation ended under it). May be empty.
  std::function<bool()> cancelled;
  // Tests only: run after this rank published its addresses, before it
  // connects to its peers.
  std::function<void()> before_connecting;
};

// What a host communicator moves its bytes over: shared memory (every rank
// on this host), Gloo's TCP pairs, or two levels (shared memory or TCP
// inside a host, TCP across; two_level_communicator.h).
enum class HostTransport { kSharedMemory, kTcp, kTwoLevel };

// What the CPU communicators have beyond Communicator.
class HostCommunicator : public Communicator {
 public:
  virtual const std::string& tag() const = 0;
  // transport_note() says why this one (or how big the segment is).
  virtual HostTransport transport() const = 0;
  virtual const std::string& transport_note() const = 0;
  // Bytes of shared memory this rank maps (0 on TCP); not part of the
  // engine's memory accounting.
  virtual int64_t shm_segment_bytes() const = 0;
  // OK while usable; otherwise the status of the failure that broke it.
  virtual absl::Status health() const = 0;
  // For tests that must act while a rank is inside a collective (abort it,
  // take its peer away) rather than sleep and hope: waits up to `timeout`
  // until a collective of this communicator has passed its checks and not
  // yet returned; returns whether one has. Any thread may call it.
  virtual bool AwaitCollectiveInFlight(absl::Duration timeout) const = 0;
};

// Connects to the other `world_size - 1` ranks, which must call it with the
// same store, tag, world_size and options: a ShmCommunicator or a
// GlooCommunicator (see above). `store` is only used here. Errors as
// GlooCommunicator::Create's, and the store's while agreeing on shared
// memory.
absl::StatusOr<std::unique_ptr<HostCommunicator>> CreateHostCommunicator(
    KeyValueStore* store, int rank, int world_size, const std::string& tag,
    const HostCommunicatorOptions& options = HostCommunicatorOptions());

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_HOST_COMMUNICATOR_H_
