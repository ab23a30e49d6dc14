#include "worker/comm/gloo_connection_guard.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace zeroshard {

// ---- The guards' state ----

struct ListenGuard::Entry {
  sockaddr_storage address;
  std::string hello;
  absl::Time deadline;
  std::function<bool()> cancelled;
  std::atomic<int> dropped{0};
  std::atomic<bool> gone{false};            // the guard was destroyed
  sockaddr_storage peer;                    // ConnectingOut()'s, set before the flag
  std::atomic<bool> connecting_out{false};  // ConnectingOut()
  // The far end of a placeholder handed to Gloo: open while the guard
  // lives, so Gloo reads no EOF on it before its connect() closes it.
  std::atomic<int> placeholder_far_end{-1};
};

struct ConnectGuard::Armed {
  sockaddr_storage peer;
  std::string hello;
  absl::Time deadline;
  std::function<bool()> cancelled;
};

namespace {

using AcceptFunction = int (*)(int, sockaddr*, socklen_t*);
using ConnectFunction = int (*)(int, const sockaddr*, socklen_t);

// How often a waiting accept() or connect() looks at its deadline and
// cancellation.
constexpr int kPollSliceMs = 20;
// Connections a guarded accept() reads at once; beyond it the oldest is
// dropped (each is a file descriptor).
constexpr size_t kMaxCandidates = 64;
constexpr char kHelloMagic[8] = {'Z', 'S', 'G', 'L', 'O', 'O', '0', '1'};

AcceptFunction LibcAccept() {
  static const auto f = reinterpret_cast<AcceptFunction>(dlsym(RTLD_NEXT, "accept"));
  return f;
}

ConnectFunction LibcConnect() {
  static const auto f = reinterpret_cast<ConnectFunction>(dlsym(RTLD_NEXT, "connect"));
  return f;
}

absl::Mutex registry_mu(absl::kConstInit);
std::map<const ListenGuard::Entry*, std::shared_ptr<ListenGuard::Entry>>& Registry()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(registry_mu) {
  static auto* registry =
      new std::map<const ListenGuard::Entry*, std::shared_ptr<ListenGuard::Entry>>();
  return *registry;
}

// The connect guard armed on this thread (null: none).
thread_local const ConnectGuard::Armed* armed_connect = nullptr;

// Same family, address and port (IPv4 or IPv6).
bool SameEndpoint(const sockaddr* a, const sockaddr_storage& b) {
  if (a->sa_family != b.ss_family) return false;
  if (a->sa_family == AF_INET) {
    const auto* x = reinterpret_cast<const sockaddr_in*>(a);
    const auto* y = reinterpret_cast<const sockaddr_in*>(&b);
    return x->sin_port == y->sin_port &&
           std::memcmp(&x->sin_addr, &y->sin_addr, sizeof(x->sin_addr)) == 0;
  }
  if (a->sa_family == AF_INET6) {
    const auto* x = reinterpret_cast<const sockaddr_in6*>(a);
    const auto* y = reinterpret_cast<const sockaddr_in6*>(&b);
    return x->sin6_port == y->sin6_port &&
           std::memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0;
  }
  return false;
}

// The guard of the listening socket `fd`, or null.
std::shared_ptr<ListenGuard::Entry> GuardOf(int fd) {
  sockaddr_storage local;
  socklen_t length = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) return nullptr;
  absl::MutexLock lock(&registry_mu);
  for (const auto& [key, entry] : Registry()) {
    if (SameEndpoint(reinterpret_cast<const sockaddr*>(&local), entry->address)) return entry;
  }
  return nullptr;
}

// Compares without an early exit, so the time taken says nothing of where
// a guess went wrong.
bool SameBytes(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Closes with a reset: the stray learns at once, and no TIME_WAIT is left.
void Reset(int fd) {
  linger hard = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
  close(fd);
}

void SetBlocking(int fd, bool blocking) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return;
  fcntl(fd, F_SETFL, blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK));
}

int SliceMs(absl::Time deadline) {
  const int64_t left =
      absl::ToInt64Milliseconds(absl::Ceil(deadline - absl::Now(), absl::Milliseconds(1)));
  return static_cast<int>(std::clamp<int64_t>(left, 0, kPollSliceMs));
}

// An address of `own`'s family and IP with port `raw_port` (network order).
sockaddr_storage WithPort(const sockaddr_storage& own, uint16_t raw_port) {
  sockaddr_storage address = own;
  if (own.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&address)->sin_port = raw_port;
  } else {
    reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = raw_port;
  }
  return address;
}

socklen_t LengthOf(const sockaddr_storage& address) {
  return address.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

// A socket bound to `own`'s IP at a port that Gloo orders above `peer`
// (GlooConnectsOut), so that Gloo's connect() still takes the connecting
// role when this end's address is the placeholder's; -1 if none.
int BindAbove(const sockaddr_storage& own, const sockaddr_storage& peer) {
  const uint16_t peer_port = own.ss_family == AF_INET
                                 ? reinterpret_cast<const sockaddr_in*>(&peer)->sin_port
                                 : reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_port;
  // An ephemeral port first; the kernel's pick is above the peer's about
  // half the time. Then the ports just above it, in Gloo's order.
  for (int attempt = 0; attempt < 1100; ++attempt) {
    uint16_t raw = 0;
    if (attempt >= 100) {
      const int above = peer_port + (attempt - 99);
      if (above > 0xFFFF) break;
      raw = static_cast<uint16_t>(above);
    }
    const int fd = socket(own.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    const sockaddr_storage wanted = WithPort(own, raw);
    sockaddr_storage bound;
    socklen_t length = sizeof(bound);
    if (bind(fd, reinterpret_cast<const sockaddr*>(&wanted), LengthOf(wanted)) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0 &&
        GlooConnectsOut(bound, peer)) {
      return fd;
    }
    close(fd);
  }
  errno = EADDRINUSE;
  return -1;
}

// A connected TCP socket on `own`'s IP, ordered above `peer`, whose far end
// goes to `*far_end`; -1 (errno set) when one cannot be made.
int MakePlaceholder(const sockaddr_storage& own, const sockaddr_storage& peer, int* far_end) {
  const int listener = socket(own.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return -1;
  sockaddr_storage address = WithPort(own, 0);
  socklen_t length = sizeof(address);
  int near_end = -1;
  if (bind(listener, reinterpret_cast<const sockaddr*>(&address), LengthOf(address)) == 0 &&
      listen(listener, 1) == 0 &&
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    near_end = BindAbove(own, peer);
    if (near_end >= 0 &&
        LibcConnect()(near_end, reinterpret_cast<const sockaddr*>(&address), length) == 0) {
      *far_end = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    }
    if (*far_end < 0 && near_end >= 0) {
      close(near_end);
      near_end = -1;
    }
  }
  const int saved = errno;
  close(listener);
  errno = saved;
  return near_end;
}

struct Candidate {
  int fd;
  std::string got;  // the hello's bytes read so far
};

// Reads what is there of `c`'s hello. True while it may still be the
// peer; false when it must go (closed, an error, or the wrong bytes).
bool ReadHello(Candidate& c, const std::string& hello, bool* complete) {
  char buffer[kPairHelloBytes];
  const size_t want = hello.size() - c.got.size();
  const ssize_t n = recv(c.fd, buffer, want, MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  c.got.append(buffer, static_cast<size_t>(n));
  *complete = c.got.size() == hello.size();
  return !*complete || SameBytes(c.got, hello);
}

// accept() on a guarded listening socket (see the header).
int GuardedAccept(int fd, ListenGuard::Entry& guard, sockaddr* address, socklen_t* length) {
  const int flags = fcntl(fd, F_GETFL);
  SetBlocking(fd, false);
  std::vector<Candidate> candidates;
  auto drop = [&guard](Candidate& c) {
    Reset(c.fd);
    guard.dropped.fetch_add(1);
  };
  auto finish = [&](int result, int error) {
    for (Candidate& c : candidates) drop(c);
    if (flags >= 0) fcntl(fd, F_SETFL, flags);
    errno = error;
    return result;
  };
  while (true) {
    if (guard.gone.load() || (guard.cancelled && guard.cancelled())) {
      return finish(-1, ECONNABORTED);
    }
    if (absl::Now() >= guard.deadline) return finish(-1, ETIMEDOUT);
    if (guard.connecting_out.load()) {
      int far_end = -1;
      const int placeholder = MakePlaceholder(guard.address, guard.peer, &far_end);
      if (placeholder < 0) return finish(-1, errno);
      const int previous = guard.placeholder_far_end.exchange(far_end);
      if (previous >= 0) close(previous);
      if (address != nullptr && length != nullptr) getpeername(placeholder, address, length);
      return finish(placeholder, 0);
    }
    std::vector<pollfd> polled(1 + candidates.size());
    polled[0] = {fd, POLLIN, 0};
    for (size_t i = 0; i < candidates.size(); ++i) polled[1 + i] = {candidates[i].fd, POLLIN, 0};
    if (poll(polled.data(), polled.size(), SliceMs(guard.deadline)) < 0 && errno != EINTR) {
      return finish(-1, errno);
    }
    // Read the candidates first (the poll's indexes hold until new ones come).
    for (size_t i = candidates.size(); i-- > 0;) {
      if (polled[1 + i].revents == 0) continue;
      bool complete = false;
      if (!ReadHello(candidates[i], guard.hello, &complete)) {
        drop(candidates[i]);
        candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (!complete) continue;
      const int peer = candidates[i].fd;
      candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(i));
      SetBlocking(peer, true);  // as accept() returns it
      if (address != nullptr && length != nullptr) getpeername(peer, address, length);
      return finish(peer, 0);
    }
    if ((polled[0].revents & POLLIN) == 0) continue;
    while (true) {
      const int c = accept4(fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) break;
      if (candidates.size() >= kMaxCandidates) {
        drop(candidates.front());
        candidates.erase(candidates.begin());
      }
      candidates.push_back({c, ""});
    }
  }
}

bool Cancelled(const ConnectGuard::Armed& armed) { return armed.cancelled && armed.cancelled(); }

// Waits until `fd` polls `events` (false at the deadline or cancellation,
// errno set).
bool AwaitSocket(int fd, short events, const ConnectGuard::Armed& armed) {
  while (true) {
    if (Cancelled(armed)) {
      errno = ECONNABORTED;
      return false;
    }
    if (absl::Now() >= armed.deadline) {
      errno = ETIMEDOUT;
      return false;
    }
    pollfd p = {fd, events, 0};
    const int n = poll(&p, 1, SliceMs(armed.deadline));
    if (n < 0 && errno != EINTR) return false;
    if (n > 0) return true;
  }
}

// connect() to a guarded peer (see the header); Gloo's socket is
// non-blocking, and 0 tells it the connection is made.
int GuardedConnect(int fd, const sockaddr* address, socklen_t length,
                   const ConnectGuard::Armed& armed) {
  if (LibcConnect()(fd, address, length) != 0) {
    if (errno != EINPROGRESS) return -1;
    if (!AwaitSocket(fd, POLLOUT, armed)) return -1;
    int error = 0;
    socklen_t size = sizeof(error);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) return -1;
    if (error != 0) {
      errno = error;
      return -1;
    }
  }
  size_t sent = 0;
  while (sent < armed.hello.size()) {
    const ssize_t n =
        send(fd, armed.hello.data() + sent, armed.hello.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return -1;
    } else if (!AwaitSocket(fd, POLLOUT, armed)) {
      return -1;
    }
  }
  return 0;
}

}  // namespace

std::string PairHello(const std::string& secret, int from, int to) {
  std::string hello(kPairHelloBytes, '\0');
  std::memcpy(hello.data(), kHelloMagic, sizeof(kHelloMagic));
  const uint32_t ranks[2] = {static_cast<uint32_t>(from), static_cast<uint32_t>(to)};
  std::memcpy(hello.data() + 8, ranks, sizeof(ranks));
  std::memcpy(hello.data() + 16, secret.data(), std::min<size_t>(secret.size(), kPairSecretBytes));
  return hello;
}

absl::StatusOr<std::string> NewPairSecret() {
  std::string secret(kPairSecretBytes, '\0');
  size_t filled = 0;
  while (filled < secret.size()) {
    const ssize_t n = getrandom(secret.data() + filled, secret.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("cannot read the kernel's random source: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  return secret;
}

absl::Status CheckConnectionGuardActive() {
  void* libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  if (libc == nullptr) return absl::OkStatus();  // not glibc: nothing to compare with
  std::string libc_ones;
  for (const char* name : {"accept", "connect"}) {
    if (dlsym(RTLD_DEFAULT, name) == dlsym(libc, name)) {
      absl::StrAppend(&libc_ones, libc_ones.empty() ? "" : " and ", name, "()");
    }
  }
  dlclose(libc);
  if (libc_ones.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this process's ", libc_ones,
                   " are libc's, so the data plane's connections cannot be authenticated: link "
                   "//worker/comm:gloo_communicator into the executable (statically) so that its "
                   "accept() and connect() come first (worker/comm/gloo_connection_guard.h)"));
}

ListenGuard::ListenGuard(const sockaddr_storage& address, std::string hello, absl::Time deadline,
                         std::function<bool()> cancelled)
    : entry_(std::make_shared<Entry>()) {
  entry_->address = address;
  entry_->hello = std::move(hello);
  entry_->deadline = deadline;
  entry_->cancelled = std::move(cancelled);
  absl::MutexLock lock(&registry_mu);
  Registry()[entry_.get()] = entry_;
}

ListenGuard::~ListenGuard() {
  entry_->gone = true;
  {
    absl::MutexLock lock(&registry_mu);
    Registry().erase(entry_.get());
  }
  const int far_end = entry_->placeholder_far_end.exchange(-1);
  if (far_end >= 0) close(far_end);
}

int ListenGuard::dropped() const { return entry_->dropped.load(); }

void ListenGuard::ConnectingOut(const sockaddr_storage& peer) {
  entry_->peer = peer;
  entry_->connecting_out = true;
}

bool GlooConnectsOut(const sockaddr_storage& self, const sockaddr_storage& peer) {
  int order = 0;
  if (self.ss_family == AF_INET && peer.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&self);
    const auto* b = reinterpret_cast<const sockaddr_in*>(&peer);
    order = std::memcmp(&a->sin_addr, &b->sin_addr, sizeof(a->sin_addr));
    if (order == 0) order = static_cast<int>(a->sin_port) - static_cast<int>(b->sin_port);
  } else if (self.ss_family == AF_INET6 && peer.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&self);
    const auto* b = reinterpret_cast<const sockaddr_in6*>(&peer);
    order = std::memcmp(&a->sin6_addr, &b->sin6_addr, sizeof(a->sin6_addr));
    if (order == 0) order = static_cast<int>(a->sin6_port) - static_cast<int>(b->sin6_port);
  }
  return order > 0;
}

ConnectGuard::ConnectGuard(const sockaddr_storage& peer, std::string hello, absl::Time deadline,
                           std::function<bool()> cancelled)
    : armed_(new Armed{peer, std::move(hello), deadline, std::move(cancelled)}) {
  armed_connect = armed_.get();
}

ConnectGuard::~ConnectGuard() { armed_connect = nullptr; }

}  // namespace zeroshard

// The interposers (see the header). Every call that no guard is armed for
// goes to libc's unchanged.
extern "C" int accept(int fd, __SOCKADDR_ARG address, socklen_t* __restrict length) {
  std::shared_ptr<zeroshard::ListenGuard::Entry> guard = zeroshard::GuardOf(fd);
  if (guard == nullptr) return zeroshard::LibcAccept()(fd, address, length);
  return zeroshard::GuardedAccept(fd, *guard, address, length);
}

extern "C" int connect(int fd, __CONST_SOCKADDR_ARG address, socklen_t length) {
  const zeroshard::ConnectGuard::Armed* armed = zeroshard::armed_connect;
  if (armed == nullptr || address == nullptr || !zeroshard::SameEndpoint(address, armed->peer)) {
    return zeroshard::LibcConnect()(fd, address, length);
  }
  return zeroshard::GuardedConnect(fd, address, length, *armed);
}
