// The guard on the data plane's TCP connections: a connection to one of
// Gloo's pairs counts only when its first bytes are the pair's hello (the
// generation's secret and who connects to whom); any other is closed before
// Gloo reads a byte of it, and the setup goes on.
//
// Why it works this way. Gloo's TCP transport (Debian's libgloo 0.5, 2022)
// gives each pair a listening socket of its own and takes the first
// connection it accepts there as the peer, then parses its bytes as Gloo's
// protocol: one stray connection during setup (a port scanner, junk, four
// bytes then silence) becomes "the peer", the real peer is refused, and the
// context fails; bytes shaped like a Gloo preamble end the process (a
// GLOO_ENFORCE on Gloo's event-loop thread). Gloo has no hook between its
// accept() and its first read, cannot adopt a socket connected elsewhere,
// and Debian builds it without its TLS transport. Weighed and not taken:
// TCP-MD5 signatures (the kernel drops unsigned SYNs, but it needs the same
// hook before Gloo's connect() and hashes every segment of the bulk
// traffic), a proxy in front (every byte copied twice more), a handshake
// over Gloo once connected (the stray's bytes reach Gloo's parser first).
//
// How. This library defines accept() and connect(). Linked into an
// executable, these definitions come before libc's for every shared library,
// libgloo's included (ELF symbol interposition); each passes the call to
// libc's unless a guard below is armed for it:
//   ListenGuard   accept() on the pair's listening socket reads the first
//                 kPairHelloBytes of every pending connection at once (a
//                 silent one delays no other) and returns the first that
//                 presents the hello; the others are reset. At the deadline,
//                 or once the guard is gone, it fails with ETIMEDOUT or
//                 ECONNABORTED, which Gloo reports as the pair's error.
//   ConnectGuard  on this thread, connect() to the peer's address completes
//                 the TCP handshake and writes the hello before returning 0,
//                 so Gloo's own bytes follow it.
// CheckConnectionGuardActive says whether the interposition holds in this
// process (a binary that loads the library with dlopen would not have it).
//
// Limits. A guarded accept() runs on Gloo's event thread, which serves every
// pair of the communicator: while a stray that says nothing (or too little)
// sits ahead of the real peer, that thread waits for the peer's hello, and
// the rank's own connects wait for a tick of it. One rank's strays delay
// nothing for long (its peers send their hellos regardless); strays at
// several ranks of a W >= 3 job can make ranks wait on each other around a
// cycle until the deadline, and the setup then fails like any other: the
// worker joins again (worker.h, "Recovery"). Gloo gives no way to vet a
// connection off its thread.
#ifndef ZEROSHARD_WORKER_COMM_GLOO_CONNECTION_GUARD_H_
#define ZEROSHARD_WORKER_COMM_GLOO_CONNECTION_GUARD_H_

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace zeroshard {

// Bytes of a pair's hello.
constexpr int kPairHelloBytes = 48;
// Bytes of a generation's secret.
constexpr int kPairSecretBytes = 32;

// The hello rank `from` sends first on its connection to rank `to`: a magic,
// the two ranks, and `secret` (kPairSecretBytes).
std::string PairHello(const std::string& secret, int from, int to);

// Whether Gloo gives the end of a pair listening at `self` the connecting
// role towards `peer` (tcp::Pair::connect: the larger address connects,
// comparing the IP's bytes, then the port as stored).
bool GlooConnectsOut(const sockaddr_storage& self, const sockaddr_storage& peer);

// kPairSecretBytes from the kernel's random source.
absl::StatusOr<std::string> NewPairSecret();

// OK when accept() and connect() in this process are the guard's;
// FAILED_PRECONDITION naming the one that is libc's otherwise.
absl::Status CheckConnectionGuardActive();

// Thread-safe. While it lives, accept() on the listening socket bound to
// `address` returns only a connection that starts with `hello`.
class ListenGuard {
 public:
  // `cancelled` (may be empty) is polled every few tens of milliseconds
  // while accept() waits: true ends the wait (ECONNABORTED).
  ListenGuard(const sockaddr_storage& address, std::string hello, absl::Time deadline,
              std::function<bool()> cancelled);
  ~ListenGuard();
  ListenGuard(const ListenGuard&) = delete;
  ListenGuard& operator=(const ListenGuard&) = delete;

  // Connections closed because they did not present the hello.
  int dropped() const;

  // This end of the pair is about to connect out to `peer` (Gloo gives the
  // lower address the listening role: GlooConnectsOut). An accept() that
  // Gloo's event thread is in (a stray came) then returns a placeholder
  // connection at once instead of waiting for a hello: Gloo's connect()
  // replaces it, and would otherwise wait for the pair's lock that Gloo's
  // thread holds while in accept(). The placeholder's local address is
  // ordered above `peer` too, since Gloo decides the role from it then.
  void ConnectingOut(const sockaddr_storage& peer);

  struct Entry;

 private:
  std::shared_ptr<Entry> entry_;
};

// While it lives, connect() on this thread to `peer` writes `hello` first
// (and waits for the TCP connect until `deadline`, or until `cancelled`).
class ConnectGuard {
 public:
  ConnectGuard(const sockaddr_storage& peer, std::string hello, absl::Time deadline,
               std::function<bool()> cancelled);
  ~ConnectGuard();
  ConnectGuard(const ConnectGuard&) = delete;
  ConnectGuard& operator=(const ConnectGuard&) = delete;

  struct Armed;

 private:
  std::unique_ptr<Armed> armed_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_GLOO_CONNECTION_GUARD_H_
