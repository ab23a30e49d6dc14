// Connects a fully connected Gloo context through a KeyValueStore, every
// connection guarded by the generation's secret (gloo_connection_guard.h).
//
// Gloo's own rendezvous (gloo::rendezvous::Context::connectFullMesh) does
// the same steps without the guard; this is it with the guard and statuses:
//   1. rank 0 makes a secret and sets <prefix>secret; the others get it
//      (the store is scoped to the job generation: a secret per generation
//      and tag);
//   2. every rank makes a pair per peer (a listening socket each), guards
//      each listening address, and sets <prefix><rank> to their addresses;
//   3. for each peer in rank order: get its addresses and connect the pair
//      (Gloo decides which side listens), the connect guarded.
#ifndef ZEROSHARD_WORKER_COMM_GLOO_MESH_H_
#define ZEROSHARD_WORKER_COMM_GLOO_MESH_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/kv_store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace zeroshard {

struct MeshOptions {
  int rank = 0;
  int world_size = 1;
  std::string prefix;  // of the store's keys, e.g. "gloo/gather/"
  // Bounds each wait in the store, and then connecting the pairs: Connect
  // takes at most about twice this.
  absl::Duration timeout = absl::Seconds(30);
  // Gloo's timeout of each pair (its first connect waits 5 x this).
  absl::Duration pair_timeout = absl::Seconds(30);
  // Polled while waiting for a peer's connection: true ends the wait
  // (ABORTED). May be empty.
  std::function<bool()> cancelled;
  // Tests: run after this rank published its addresses, before it connects.
  std::function<void()> before_connecting;
};

struct Mesh {
  std::shared_ptr<gloo::Context> context;
  // Connections closed for not presenting the hello (strays).
  int dropped = 0;
};

// REQUIRES: every rank calls it with the same prefix and world size.
// The store's error (with its code), DEADLINE_EXCEEDED when a peer does not
// connect in time, ABORTED when cancelled, UNAVAILABLE for the network's
// errors; FAILED_PRECONDITION when the guard is not in effect.
absl::StatusOr<Mesh> ConnectMesh(KeyValueStore* store,
                                 const std::shared_ptr<gloo::transport::Device>& device,
                                 const MeshOptions& options);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_GLOO_MESH_H_
