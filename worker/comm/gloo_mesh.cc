#include "worker/comm/gloo_mesh.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gloo/context.h"
#include "gloo/transport/context.h"
#include "gloo/transport/device.h"
#include "gloo/transport/tcp/address.h"
#include "worker/comm/gloo_connection_guard.h"

namespace zeroshard {
namespace {

// A gloo::Context over a transport context connected here (what
// gloo::rendezvous::Context is over its own).
class MeshContext : public gloo::Context {
 public:
  MeshContext(int rank, int size, std::shared_ptr<gloo::transport::Device> device,
              std::shared_ptr<gloo::transport::Context> transport)
      : gloo::Context(rank, size) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

// Threads that connect a rank's pairs (at most; fewer for a smaller world).
constexpr int kMaxConnectThreads = 64;

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1)))));
}

// The generation's secret for this prefix: made by rank 0, read by the rest.
absl::StatusOr<std::string> ShareSecret(KeyValueStore* store, const MeshOptions& o) {
  const std::string key = o.prefix + "secret";
  if (o.rank == 0) {
    absl::StatusOr<std::string> secret = NewPairSecret();
    if (!secret.ok()) return secret.status();
    if (absl::Status s = store->Set(key, absl::BytesToHexString(*secret)); !s.ok()) return s;
    return secret;
  }
  absl::StatusOr<std::string> hex = store->Get(key, o.timeout);
  if (!hex.ok()) return hex.status();
  if (hex->size() != 2 * kPairSecretBytes ||
      !std::all_of(hex->begin(), hex->end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return absl::DataLossError(absl::StrCat("the store's '", key, "' is not ", 2 * kPairSecretBytes,
                                            " hex digits (", hex->size(), " bytes)"));
  }
  return absl::HexStringToBytes(*hex);
}

sockaddr_storage SockaddrOf(const std::vector<char>& address_bytes) {
  return gloo::transport::tcp::Address(address_bytes).getSockaddr();
}

bool IsTimeout(const std::string& message) {
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

}  // namespace

namespace {

// Reads every peer's published addresses (`o.prefix` + rank) and keeps its
// end of its pair with this rank in (*peer_ends)[peer]; a pair this rank
// connects out on tells its listening guard so.
absl::Status ReadPeerEnds(KeyValueStore* store, const MeshOptions& o, size_t address_bytes,
                          const std::vector<sockaddr_storage>& own,
                          const std::vector<std::unique_ptr<ListenGuard>>& listening,
                          std::vector<std::vector<char>>* peer_ends) {
  const int rank = o.rank;
  const int size = o.world_size;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    absl::StatusOr<std::string> theirs = store->Get(absl::StrCat(o.prefix, peer), o.timeout);
    if (!theirs.ok()) return theirs.status();
    if (theirs->size() != address_bytes * (size - 1)) {
      return absl::DataLossError(absl::StrCat("rank ", peer, " published ", theirs->size(),
                                              " bytes of addresses; expected ",
                                              address_bytes * (size - 1)));
    }
    // Peers do not list themselves: this rank's address sits one earlier
    // in the list of a lower rank.
    const size_t slot = static_cast<size_t>(rank > peer ? rank - 1 : rank);
    (*peer_ends)[peer].assign(theirs->begin() + slot * address_bytes,
                              theirs->begin() + (slot + 1) * address_bytes);
    const sockaddr_storage peer_address = SockaddrOf((*peer_ends)[peer]);
    if (GlooConnectsOut(own[peer], peer_address)) listening[peer]->ConnectingOut(peer_address);
  }
  return absl::OkStatus();
}

absl::Status ConnectPairs(gloo::transport::Context* transport,
                          const std::vector<std::vector<char>>& peer_ends,
                          const std::string& secret, const MeshOptions& o,
                          absl::Time connect_deadline) {
  const int rank = o.rank;
  const int size = o.world_size;
  // All pairs at once: a pair's connect waits on Gloo's event thread, which
  // a stray can hold in a guarded accept() until that pair's peer sends its
  // hello; connecting in rank order could make ranks wait on each other
  // around a cycle until the deadline.
  std::vector<absl::Status> connected(size);
  std::atomic<int> next_peer{0};
  auto connect_pairs = [&] {
    for (int peer = next_peer.fetch_add(1); peer < size; peer = next_peer.fetch_add(1)) {
      if (peer == rank) continue;
      try {
        ConnectGuard guard(SockaddrOf(peer_ends[peer]), PairHello(secret, rank, peer),
                           connect_deadline, o.cancelled);
        transport->getPair(peer)->connect(peer_ends[peer]);
      } catch (const std::exception& e) {
        const std::string message = e.what();
        const std::string what = absl::StrCat("connecting to rank ", peer, ": ", message);
        connected[peer] = o.cancelled && o.cancelled() ? absl::AbortedError(what)
                          : IsTimeout(message)         ? absl::DeadlineExceededError(what)
                                                       : absl::UnavailableError(what);
      }
    }
  };
  {
    std::vector<std::thread> threads;
    for (int t = 1; t < std::min(size - 1, kMaxConnectThreads); ++t)
      threads.emplace_back(connect_pairs);
    connect_pairs();
    for (std::thread& t : threads) t.join();
  }
  for (const absl::Status& s : connected) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Mesh> ConnectMesh(KeyValueStore* store,
                                 const std::shared_ptr<gloo::transport::Device>& device,
                                 const MeshOptions& o) {
  if (absl::Status s = CheckConnectionGuardActive(); !s.ok()) return s;
  const int rank = o.rank;
  const int size = o.world_size;
  std::shared_ptr<gloo::transport::Context> transport = device->createContext(rank, size);
  transport->setTimeout(Millis(o.pair_timeout));
  Mesh mesh;
  if (size == 1) {
    mesh.context = std::make_shared<MeshContext>(rank, size, device, std::move(transport));
    mesh.context->setTimeout(Millis(o.pair_timeout));
    return mesh;
  }
  absl::StatusOr<std::string> secret = ShareSecret(store, o);
  if (!secret.ok()) return secret.status();

  // Declared after `transport`: a guard goes (and ends an accept() waiting
  // on Gloo's thread) before the pairs it guards.
  std::vector<std::unique_ptr<ListenGuard>> listening(size);
  std::vector<sockaddr_storage> own(size);  // each pair's listening address
  const absl::Time connect_deadline = absl::Now() + 2 * o.timeout;
  std::string addresses;
  size_t address_bytes = 0;
  try {
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      std::vector<char> bytes = transport->createPair(peer)->address().bytes();
      address_bytes = bytes.size();
      own[peer] = SockaddrOf(bytes);
      listening[peer] = std::make_unique<ListenGuard>(own[peer], PairHello(*secret, peer, rank),
                                                      connect_deadline, o.cancelled);
      addresses.append(bytes.begin(), bytes.end());
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot listen for peers: ", e.what()));
  }
  if (absl::Status s = store->Set(absl::StrCat(o.prefix, rank), addresses); !s.ok()) return s;
  if (o.before_connecting) o.before_connecting();

  // Every peer's end of its pair with this rank, and which end connects.
  std::vector<std::vector<char>> peer_ends(size);
  if (absl::Status s = ReadPeerEnds(store, o, address_bytes, own, listening, &peer_ends); !s.ok()) {
    return s;
  }
  if (absl::Status s = ConnectPairs(transport.get(), peer_ends, *secret, o, connect_deadline);
      !s.ok()) {
    return s;
  }
  for (const auto& guard : listening) {
    if (guard != nullptr) mesh.dropped += guard->dropped();
  }
  listening.clear();
  mesh.context = std::make_shared<MeshContext>(rank, size, device, std::move(transport));
  mesh.context->setTimeout(Millis(o.pair_timeout));
  return mesh;
}

}  // namespace zeroshard
