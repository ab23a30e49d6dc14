#include "worker/comm/gloo_communicator.h"

#include <limits.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/context.h"
#include "gloo/transport/tcp/attr.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/comm/comm_internal.h"
#include "worker/comm/gloo_mesh.h"
#include "worker/comm/gloo_port_range.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/comm/shm_exchange.h"

namespace zeroshard {
namespace {

using comm_internal::ChunkBlocks;
using comm_internal::kMaxTimeout;
using comm_internal::Mod;
using comm_internal::Supported;
using gloo::transport::UnboundBuffer;

// Slots of the ring algorithms implemented here. Gloo's own collectives use
// prefixes 0x01..0x08 in the top byte (gloo/types.h); these stay clear of
// them. Each communicator runs one collective at a time, and messages with
// one slot between two ranks are matched in order, so a slot is reused by
// every step and every call.
constexpr uint64_t kReduceScatterSlot = uint64_t{0x40} << 56;
constexpr uint64_t kAllReduceScatterSlot = uint64_t{0x41} << 56;
constexpr uint64_t kAllReduceGatherSlot = uint64_t{0x42} << 56;
constexpr uint64_t kAllGatherBlocksSlot = uint64_t{0x43} << 56;
constexpr uint64_t kReduceScatterBlocksSlot = uint64_t{0x44} << 56;
// SendRecv: the top byte, and the caller's tag in the low bits.
constexpr uint64_t kPointToPointSlot = uint64_t{0x46} << 56;
constexpr uint64_t kAllToAllSlot = uint64_t{0x47} << 56;
// Never sent on: Abort() waits for a message here to make a wait time out.
constexpr uint64_t kAbortSlot = uint64_t{0x45} << 56;

// Gloo waits this many times a context's timeout for a pair's first connect.
constexpr int kGlooConnectWaits = 5;

// Rounds up to whole milliseconds; at least 1 ms (Gloo treats 0 as "no
// timeout" in places), at most kMaxTimeout.
std::chrono::milliseconds ToMillis(absl::Duration d) {
  d = std::min(d, kMaxTimeout);
  int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1)));
  return std::chrono::milliseconds(std::max<int64_t>(ms, 1));
}

std::chrono::milliseconds Remaining(absl::Time deadline) {
  return ToMillis(deadline - absl::Now());
}

// Number of sends of rank `rank` in Gloo's binomial-tree broadcast from
// `root` (mirrors gloo/broadcast.cc).
int BroadcastSends(int rank, int root, int world_size) {
  const int vrank = Mod(rank - root, world_size);
  int dim = 0;
  while ((1 << dim) < world_size) ++dim;
  int mask = (1 << dim) - 1;
  int sends = 0;
  for (int i = 0; i < dim; ++i) {
    mask ^= (1 << i);
    if ((vrank & mask) != 0) continue;
    const int vpeer = vrank ^ (1 << i);
    if (vpeer >= world_size) continue;
    if ((vrank & (1 << i)) == 0) ++sends;
  }
  return sends;
}

// Gloo writes without MSG_NOSIGNAL; see the header.
void IgnoreSigpipeIfDefault() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current;
    if (sigaction(SIGPIPE, nullptr, &current) != 0) return;
    if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction ignore;
    std::memset(&ignore, 0, sizeof(ignore));
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  });
}

// Gloo's tcp::CreateDevice checks getaddrinfo's result against -1 only and
// then walks an uninitialized list when the name does not resolve (EAI_*
// codes), which crashes. Resolve it here first.
absl::Status CheckResolvable(const std::string& hostname) {
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* result = nullptr;
  const int rv = getaddrinfo(hostname.c_str(), nullptr, &hints, &result);
  if (rv != 0 || result == nullptr) {
    if (result != nullptr) freeaddrinfo(result);
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot resolve host '", hostname, "': ", rv != 0 ? gai_strerror(rv) : "no address"));
  }
  freeaddrinfo(result);
  return absl::OkStatus();
}

std::string LocalHostname() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

// Gloo's own words for a pair that could not listen or connect, said first
// in ours: a connect that timed out ("... Connect timeout
// [198.18.0.3]:41873") names the peer's address and what to check; a bind
// that found the port range full names the range.
std::string DescribeGlooFailure(const std::string& message,
                                const GlooCommunicator::Options& options) {
  const std::string ports = options.ports.empty()
                                ? std::string("ephemeral ports")
                                : absl::StrCat("ports ", options.ports.first, "-",
                                               options.ports.last, " (--data_plane_ports)");
  static constexpr char kMark[] = "Connect timeout ";
  const size_t at = message.find(kMark);
  if (at != std::string::npos) {
    std::string peer = message.substr(at + sizeof(kMark) - 1);
    peer = peer.substr(0, peer.find_first_of(" \n"));
    return absl::StrCat("no connection to the peer's data plane at ", peer, " within ",
                        absl::FormatDuration(options.connect_timeout),
                        " (dropped: a firewall or a cut network between the hosts? the data "
                        "plane listens on ",
                        ports, " of each worker's --host) [gloo: ", message, "]");
  }
  if (!options.ports.empty() && absl::StrContains(message, "Address already in use")) {
    return absl::StrCat("no free port in --data_plane_ports=", options.ports.first, "-",
                        options.ports.last, " (", options.ports.size(),
                        " ports; each rank needs world_size - 1 of them while it connects, and "
                        "the ranks of a host share them) [gloo: ",
                        message, "]");
  }
  return message;
}

bool IsTimeoutMessage(const std::string& message) {
  // "Timed out waiting 500ms for recv operation to complete" (unbound
  // buffers), "Read timeout", "Write timeout", "Connect timeout" (pairs).
  // "Application timeout caused pair closure" is what *other* operations on a
  // context see after one timed out: not this call's timeout.
  if (absl::StrContains(message, "Application timeout")) return false;
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(KeyValueStore* store,
                                                                           int rank, int world_size,
                                                                           const std::string& tag,
                                                                           const Options& options) {
  if (store == nullptr) return absl::InvalidArgumentError("GlooCommunicator: store is null");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("GlooCommunicator: rank ", rank,
                                                   " is not in [0, world_size ", world_size, ")"));
  }
  if (tag.empty()) return absl::InvalidArgumentError("GlooCommunicator: tag is empty");
  if (options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooCommunicator: connect_timeout must be positive, got ",
                     absl::FormatDuration(options.connect_timeout)));
  }
  IgnoreSigpipeIfDefault();

  const std::string where = absl::StrCat("(rank ", rank, " of ", world_size, ", tag '", tag, "')");
  gloo::transport::tcp::attr attr;
  std::string bind;
  if (options.iface.empty()) {
    attr.hostname = options.hostname.empty() ? LocalHostname() : options.hostname;
    bind = absl::StrCat("host '", attr.hostname, "'");
    absl::Status resolvable = CheckResolvable(attr.hostname);
    if (!resolvable.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GlooCommunicator ", where, ": ", resolvable.message()));
    }
  } else {
    attr.iface = options.iface;
    bind = absl::StrCat("interface '", options.iface, "'");
  }

  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooCommunicator ", where, ": cannot use ", bind, ": ", e.what()));
  }

  MeshOptions mesh_options;
  mesh_options.rank = rank;
  mesh_options.world_size = world_size;
  mesh_options.prefix = KvGlooStore::PrefixForTag(tag);
  mesh_options.timeout = options.connect_timeout;
  // Gloo waits kGlooConnectWaits x a pair's timeout for its first connect
  // (tcp::Pair::waitUntilConnected): so a connect that a firewall or a cut
  // network drops fails within connect_timeout (not after TCP's SYN retries,
  // minutes), naming the peer's address. Collectives pass their own timeouts.
  mesh_options.pair_timeout = options.connect_timeout / kGlooConnectWaits;
  mesh_options.cancelled = options.cancelled;
  mesh_options.before_connecting = options.before_connecting;
  absl::StatusOr<Mesh> mesh;
  {
    ListenPortRange ports(options.ports);  // the pairs' listening sockets
    mesh = ConnectMesh(store, device, mesh_options);
  }
  if (!mesh.ok()) {
    return absl::Status(
        mesh.status().code(),
        absl::StrCat("GlooCommunicator ", where, " from ", bind, ": ",
                     DescribeGlooFailure(std::string(mesh.status().message()), options)));
  }
  if (mesh->dropped > 0) {
    // Said where the operator looks: someone connected to the data plane's
    // ports without the generation's secret.
    std::fprintf(stderr,
                 "GlooCommunicator %s: dropped %d connection(s) that did not present the "
                 "generation's secret\n",
                 where.c_str(), mesh->dropped);
  }
  std::shared_ptr<gloo::Context> context = std::move(mesh->context);
  auto comm = std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(rank, world_size, tag, std::move(device), std::move(context)));
  comm->transport_note_ = world_size > 1 ? "TCP" : "a single rank";
  return comm;
}

GlooCommunicator::GlooCommunicator(int rank, int world_size, std::string tag,
                                   std::shared_ptr<gloo::transport::Device> device,
                                   std::shared_ptr<gloo::Context> context)
    : rank_(rank),
      world_size_(world_size),
      tag_(std::move(tag)),
      device_(std::move(device)),
      context_(std::move(context)),
      ring_(context_.get(), rank_, world_size_,
            [this](UnboundBuffer* buffer, bool send, absl::Time deadline) {
              Wait(buffer, send, deadline);
            }) {}

GlooCommunicator::~GlooCommunicator() {
  // Destroying the context closes its sockets (peers read EOF); the device
  // (and its event-loop thread) goes after every context using it.
  context_.reset();
  device_.reset();
}

CollectiveBytes GlooCommunicator::bytes_sent() const {
  CollectiveBytes bytes;
  bytes.all_gather = all_gather_bytes_.load();
  bytes.reduce_scatter = reduce_scatter_bytes_.load();
  bytes.all_reduce = all_reduce_bytes_.load();
  bytes.broadcast = broadcast_bytes_.load();
  return bytes;
}

void GlooCommunicator::Wait(UnboundBuffer* buffer, bool send, absl::Time deadline) {
  {
    absl::MutexLock lock(&wait_mu_);
    if (aborted_.load()) throw gloo::IoException("aborted before the wait");
    waiting_ = buffer;
    waiting_for_send_ = send;
  }
  struct Unregister {
    GlooCommunicator* self;
    ~Unregister() {
      absl::MutexLock lock(&self->wait_mu_);
      self->waiting_ = nullptr;
    }
  } unregister{this};
  // Throws gloo::IoException on timeout or on an error of the pair.
  const bool completed = send ? buffer->waitSend(nullptr, Remaining(deadline))
                              : buffer->waitRecv(nullptr, Remaining(deadline));
  if (!completed) throw gloo::IoException(send ? "send was aborted" : "recv was aborted");
}

void GlooCommunicator::Abort() {
  if (aborted_.exchange(true)) return;
  if (world_size_ == 1) return;
  // The rings here: end their wait directly. (Gloo ends a wait on a pair
  // that an error already closed only at the wait's timeout.)
  {
    absl::MutexLock lock(&wait_mu_);
    if (waiting_ != nullptr) {
      if (waiting_for_send_) {
        waiting_->abortWaitSend();
      } else {
        waiting_->abortWaitRecv();
      }
    }
  }
  // Gloo's own collectives (broadcast, barrier), and the peers: Gloo has no
  // call that wakes another thread's wait on a context, but when one wait
  // of a context times out, Gloo closes every pair of the context and hands
  // each pending operation an exception ("Application timeout caused pair
  // closure"), and the peers read EOF. So wait 1 ms for a message nobody
  // sends. Operations on the context are thread-safe in Gloo's TCP
  // transport (each pair has its own lock).
  try {
    char byte = 0;
    std::unique_ptr<UnboundBuffer> probe = context_->createUnboundBuffer(&byte, 1);
    probe->recv(Mod(rank_ + 1, world_size_), kAbortSlot, 0, 1);
    probe->waitRecv(nullptr, std::chrono::milliseconds(1));
  } catch (const std::exception&) {
    // The expected timeout, or pairs a failure closed already.
  }
  try {
    context_->closeConnections();  // a no-op after the timeout above; cheap
  } catch (const std::exception&) {
  }
}

absl::Status GlooCommunicator::CheckCall(const char* name, int64_t count, DType dtype,
                                         absl::Duration timeout) const {
  return comm_internal::CheckCall(name, rank_, world_size_, tag_, aborted_.load(), broken_, count,
                                  dtype, timeout);
}

absl::Status GlooCommunicator::Run(const char* name, absl::Duration timeout,
                                   const std::function<void()>& body) {
  comm_internal::CollectiveInFlight::Scope in_flight(&in_flight_);
  std::string detail;
  absl::StatusCode code;
  try {
    body();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    detail = e.what();
    code = IsTimeoutMessage(detail) ? absl::StatusCode::kDeadlineExceeded
                                    : absl::StatusCode::kUnavailable;
  } catch (const gloo::EnforceNotMet& e) {
    detail = e.what();
    code = absl::StatusCode::kInternal;
  } catch (const std::exception& e) {
    detail = e.what();
    code = absl::StatusCode::kInternal;
  }
  return Break(name, timeout, code, detail);
}

absl::Status GlooCommunicator::Break(const char* name, absl::Duration timeout,
                                     absl::StatusCode code, const std::string& detail) {
  const std::string where =
      absl::StrCat("(rank ", rank_, " of ", world_size_, ", tag '", tag_, "')");
  std::string message;
  switch (code) {
    case absl::StatusCode::kDeadlineExceeded:
      message = absl::StrCat(name, " timed out after ", absl::FormatDuration(timeout), " ", where,
                             ": ", detail);
      break;
    case absl::StatusCode::kUnavailable:
      message = absl::StrCat(name, " failed: a peer is gone", " (connection closed or lost) ",
                             where, ": ", detail);
      break;
    default:
      message = absl::StrCat(name, " failed ", where, ": ", "gloo: ", detail);
      break;
  }
  if (aborted_.load()) {
    // Whatever the transport reported is the abort's doing.
    code = absl::StatusCode::kAborted;
    message = absl::StrCat(name, " aborted ", where, ": Abort() was called (the job generation ",
                           "is over); the transport said: ", detail);
  }
  absl::Status status(code, message);
  broken_ = status;
  // The communicator is unusable now (see the header). Close every
  // connection so that peers blocked in this collective fail now rather
  // than at their timeout.
  CloseConnections();
  return status;
}

void GlooCommunicator::CloseConnections() {
  try {
    context_->closeConnections();
  } catch (const std::exception&) {
    // Already broken; nothing more to do.
  }
}

absl::Status GlooCommunicator::AllGather(const void* input, void* output, int64_t count,
                                         DType dtype, absl::Duration timeout) {
  static constexpr char kName[] = "all_gather";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (count == 0) return absl::OkStatus();
  if (input == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  }
  const size_t bytes = count * DTypeSize(dtype);
  char* out = static_cast<char*>(output);
  char* in = const_cast<char*>(static_cast<const char*>(input));  // Gloo only reads it.
  if (world_size_ == 1) {
    if (in != out) std::memmove(out, in, bytes);
    return absl::OkStatus();
  }
  // The block all-gather over W equal chunks: rank r's shard is `in`, viewed
  // from `out`'s own slot when in place. (Not Gloo's allgather, whose waits
  // Abort() cannot end once an error closed a pair.)
  return AllGatherBlocks(in, out, ChunkBlocks(world_size_, count), dtype, timeout);
}

absl::Status GlooCommunicator::ReduceScatter(const void* input, void* output, int64_t count,
                                             DType dtype, ReduceOp op, absl::Duration timeout) {
  static constexpr char kName[] = "reduce_scatter";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (count == 0) return absl::OkStatus();
  if (input == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  }
  if (world_size_ == 1) {
    if (input != output) std::memmove(output, input, count * DTypeSize(dtype));
    return absl::OkStatus();
  }
  const std::vector<ShardBlock> blocks = ChunkBlocks(world_size_, count);
  const BlockGroups g = GroupBlocks(blocks, world_size_);
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(world_size_) : 1.0f;
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  const char* in = static_cast<const char*>(input);
  char* out = static_cast<char*>(output);
  return Run(kName, timeout, [&] {
    ring_.ReduceScatter(in, out, g, dtype, divisor, kReduceScatterSlot, deadline,
                        &reduce_scatter_bytes_);
  });
}

absl::Status GlooCommunicator::CheckBlockCall(const char* name,
                                              const std::vector<ShardBlock>& blocks, DType dtype,
                                              absl::Duration timeout, const void* full,
                                              const void* shard, BlockGroups* groups) {
  absl::Status status = CheckCall(name, 0, dtype, timeout);
  if (!status.ok()) return status;
  return comm_internal::CheckBlocks(name, blocks, rank_, world_size_, full, shard, groups);
}

absl::Status GlooCommunicator::AllGatherBlocks(const void* shard, void* full,
                                               const std::vector<ShardBlock>& blocks, DType dtype,
                                               absl::Duration timeout) {
  static constexpr char kName[] = "all_gather";
  BlockGroups g;
  if (absl::Status s = CheckBlockCall(kName, blocks, dtype, timeout, full, shard, &g); !s.ok()) {
    return s;
  }
  if (g.full_extent == 0) return absl::OkStatus();
  const size_t esize = DTypeSize(dtype);
  const char* in = static_cast<const char*>(shard);
  char* out = static_cast<char*>(full);
  auto copy_own = [&] {
    for (const ShardBlock* b : g.blocks[rank_]) {
      std::memmove(out + b->full_offset * esize, in + b->shard_offset * esize, b->count * esize);
    }
  };
  if (world_size_ == 1) {
    copy_own();
    return absl::OkStatus();
  }
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  return Run(kName, timeout, [&] {
    ring_.AllGatherBlocks(in, out, g, dtype, kAllGatherBlocksSlot, deadline, copy_own,
                          &all_gather_bytes_);
  });
}

absl::Status GlooCommunicator::ReduceScatterBlocks(const void* full, void* shard,
                                                   const std::vector<ShardBlock>& blocks,
                                                   DType dtype, ReduceOp op,
                                                   absl::Duration timeout) {
  static constexpr char kName[] = "reduce_scatter";
  BlockGroups g;
  if (absl::Status s = CheckBlockCall(kName, blocks, dtype, timeout, full, shard, &g); !s.ok()) {
    return s;
  }
  if (g.full_extent == 0) return absl::OkStatus();
  const size_t esize = DTypeSize(dtype);
  const char* in = static_cast<const char*>(full);
  char* out = static_cast<char*>(shard);
  const int w = world_size_;
  if (w == 1) {
    for (const ShardBlock* b : g.blocks[rank_]) {
      std::memmove(out + b->shard_offset * esize, in + b->full_offset * esize, b->count * esize);
    }
    return absl::OkStatus();
  }
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(w) : 1.0f;
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  return Run(kName, timeout, [&] {
    ring_.ReduceScatter(in, out, g, dtype, divisor, kReduceScatterBlocksSlot, deadline,
                        &reduce_scatter_bytes_);
  });
}

absl::Status GlooCommunicator::AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                                         absl::Duration timeout) {
  static constexpr char kName[] = "all_reduce";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (count == 0 || world_size_ == 1) return absl::OkStatus();
  if (buffer == nullptr) return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  // W chunks whose sizes differ by at most one element.
  std::vector<int64_t> offset(world_size_), size(world_size_);
  for (const ShardBlock& b : comm_internal::EvenChunkBlocks(world_size_, count)) {
    offset[b.rank] = b.full_offset;
    size[b.rank] = b.count;
  }
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  // Reduce-scatter into this rank's chunk of the buffer, in place, then
  // all-gather the chunks in place.
  std::vector<ShardBlock> blocks(world_size_);
  for (int c = 0; c < world_size_; ++c) blocks[c] = {c, offset[c], offset[c], size[c]};
  const BlockGroups g = GroupBlocks(blocks, world_size_);
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(world_size_) : 1.0f;
  char* data = static_cast<char*>(buffer);
  return Run(kName, timeout, [&] {
    ring_.ReduceScatter(data, data, g, dtype, divisor, kAllReduceScatterSlot, deadline,
                        &all_reduce_bytes_);
    ring_.AllGatherInPlace(buffer, offset, size, dtype, kAllReduceGatherSlot, deadline,
                           &all_reduce_bytes_);
  });
}

absl::Status GlooCommunicator::Broadcast(void* buffer, int64_t count, DType dtype, int root,
                                         absl::Duration timeout) {
  static constexpr char kName[] = "broadcast";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (root < 0 || root >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat(kName, ": root ", root, " is not in [0, ", world_size_, ")"));
  }
  if (count == 0 || world_size_ == 1) return absl::OkStatus();
  if (buffer == nullptr) return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  const size_t bytes = count * DTypeSize(dtype);
  return Run(kName, timeout, [&] {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(static_cast<char*>(buffer), bytes);
    opts.setRoot(root);
    opts.setTimeout(ToMillis(timeout));
    gloo::broadcast(opts);
    broadcast_bytes_.fetch_add(static_cast<int64_t>(BroadcastSends(rank_, root, world_size_)) *
                               bytes);
  });
}

absl::Status GlooCommunicator::Barrier(absl::Duration timeout) {
  static constexpr char kName[] = "barrier";
  absl::Status status = CheckCall(kName, 0, DType::kF32, timeout);
  if (!status.ok()) return status;
  if (world_size_ == 1) return absl::OkStatus();
  return Run(kName, timeout, [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTimeout(ToMillis(timeout));
    gloo::barrier(opts);
  });
}

absl::Status GlooCommunicator::SendRecv(const std::vector<PointToPoint>& sends,
                                        const std::vector<PointToPoint>& recvs,
                                        absl::Duration timeout) {
  static constexpr char kName[] = "send_recv";
  absl::Status status = CheckCall(kName, 0, DType::kF32, timeout);
  if (!status.ok()) return status;
  for (const auto* list : {&sends, &recvs}) {
    for (const PointToPoint& op : *list) {
      if (op.peer < 0 || op.peer >= world_size_ || op.peer == rank_ || op.bytes < 0 ||
          (op.bytes > 0 && op.data == nullptr)) {
        return absl::InvalidArgumentError(absl::StrCat(kName, ": bad operation (peer ", op.peer,
                                                       ", ", op.bytes, " bytes) on rank ", rank_,
                                                       " of ", world_size_));
      }
    }
  }
  const absl::Time deadline = absl::Now() + timeout;
  return Run(kName, timeout, [&] {
    std::vector<std::unique_ptr<UnboundBuffer>> send_buffers, recv_buffers;
    for (const PointToPoint& op : recvs) {
      if (op.bytes == 0) continue;
      recv_buffers.push_back(context_->createUnboundBuffer(op.data, op.bytes));
      recv_buffers.back()->recv(op.peer, kPointToPointSlot | op.tag, 0, op.bytes);
    }
    for (const PointToPoint& op : sends) {
      if (op.bytes == 0) continue;
      send_buffers.push_back(context_->createUnboundBuffer(op.data, op.bytes));
      send_buffers.back()->send(op.peer, kPointToPointSlot | op.tag, 0, op.bytes);
    }
    for (auto& b : recv_buffers) Wait(b.get(), /*send=*/false, deadline);
    for (auto& b : send_buffers) Wait(b.get(), /*send=*/true, deadline);
    for (const PointToPoint& op : sends) p2p_bytes_.fetch_add(op.bytes);
  });
}

absl::Status GlooCommunicator::AllToAll(const void* input, void* output, int64_t bytes_per_rank,
                                        absl::Duration timeout) {
  static constexpr char kName[] = "all_to_all";
  absl::Status status = CheckCall(kName, bytes_per_rank, DType::kF32, timeout);
  if (!status.ok()) return status;
  if (bytes_per_rank == 0) return absl::OkStatus();
  if (input == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  }
  const int w = world_size_;
  const size_t piece = static_cast<size_t>(bytes_per_rank);
  char* in = const_cast<char*>(static_cast<const char*>(input));  // Gloo only reads it.
  char* out = static_cast<char*>(output);
  std::memmove(out + rank_ * piece, in + rank_ * piece, piece);
  if (w == 1) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  return Run(kName, timeout, [&] {
    std::unique_ptr<UnboundBuffer> send = context_->createUnboundBuffer(in, w * piece);
    std::unique_ptr<UnboundBuffer> recv = context_->createUnboundBuffer(out, w * piece);
    // Peers in ring order from this rank, so that no peer gets every first
    // message at once.
    for (int s = 1; s < w; ++s) {
      const int from = (rank_ - s + w) % w;
      recv->recv(from, kAllToAllSlot, from * piece, piece);
    }
    for (int s = 1; s < w; ++s) {
      const int to = (rank_ + s) % w;
      send->send(to, kAllToAllSlot, to * piece, piece);
    }
    for (int s = 1; s < w; ++s) Wait(recv.get(), /*send=*/false, deadline);
    for (int s = 1; s < w; ++s) Wait(send.get(), /*send=*/true, deadline);
    reduce_scatter_bytes_.fetch_add(static_cast<int64_t>(w - 1) * bytes_per_rank);
  });
}

}  // namespace zeroshard
