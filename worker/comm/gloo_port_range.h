// Gloo's TCP pairs listening on ports of a fixed range (--data_plane_ports),
// so that a firewall between hosts can let the data plane through.
//
// This Gloo (Debian's, 2022) gives every pair a listening socket of its own,
// bound to the device's address with port 0: an ephemeral port, with no
// setting to change it, and its headers for the TCP context and pair are
// incomplete in the package (gloo/common/memory.h is missing), so a device
// or context of our own cannot be built on them. What remains is the bind
// itself: while a ListenPortRange lives on a thread, a bind() on that thread
// of a TCP socket to port 0 takes the first free port of the range instead
// (this file defines bind(), which the dynamic linker gives precedence over
// libc's; any other bind passes through unchanged). Gloo creates a context's
// pairs on the thread that connects it, so GlooCommunicator::Create holds one
// around connectFullMesh.
//
// A rank holds at most world_size - 1 listening ports at a time (one
// context's pairs while they connect; Gloo closes them once connected): the
// ranks of a host need that many each.
#ifndef ZEROSHARD_WORKER_COMM_GLOO_PORT_RANGE_H_
#define ZEROSHARD_WORKER_COMM_GLOO_PORT_RANGE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// Ports first..last (inclusive); empty (0, 0): ephemeral ports.
struct PortRange {
  int first = 0;
  int last = 0;
  bool empty() const { return first == 0 && last == 0; }
  int size() const { return empty() ? 0 : last - first + 1; }
};

// "LO-HI" (1 <= LO <= HI <= 65535) or "" (empty). INVALID_ARGUMENT naming
// the text and what is expected otherwise.
absl::StatusOr<PortRange> ParsePortRange(absl::string_view text);

// While it lives, TCP sockets this thread binds to port 0 get a free port of
// `range` (EADDRINUSE when every port is taken). An empty range changes
// nothing. Not nestable.
class ListenPortRange {
 public:
  explicit ListenPortRange(PortRange range);
  ~ListenPortRange();
  ListenPortRange(const ListenPortRange&) = delete;
  ListenPortRange& operator=(const ListenPortRange&) = delete;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_GLOO_PORT_RANGE_H_
