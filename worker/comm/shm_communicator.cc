#include "worker/comm/shm_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "worker/comm/comm_internal.h"
#include "worker/comm/kv_gloo_store.h"

namespace zeroshard {
namespace {

using comm_internal::ChunkBlocks;
using comm_internal::kMaxTimeout;
using comm_internal::RingAllGatherBytes;
using comm_internal::RingReduceScatterBytes;
using comm_internal::Supported;

}  // namespace

absl::StatusOr<std::unique_ptr<HostCommunicator>> CreateHostCommunicator(
    KeyValueStore* store, int rank, int world_size, const std::string& tag,
    const HostCommunicatorOptions& options) {
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> tcp =
      GlooCommunicator::Create(store, rank, world_size, tag, options);
  if (!tcp.ok()) return tcp.status();
  if (world_size == 1) return std::unique_ptr<HostCommunicator>(*std::move(tcp));
  // Every rank takes part, even with shared memory off, so that all of them
  // agree on the transport.
  std::string why_not;
  absl::StatusOr<std::unique_ptr<ShmExchange>> shm = ShmExchange::Create(
      store, KvGlooStore::PrefixForTag(tag) + "shm/", rank, world_size, options.shared_memory,
      options.shm_slot_bytes, options.connect_timeout, &why_not);
  if (!shm.ok()) {
    return absl::Status(
        shm.status().code(),
        absl::StrCat("GlooCommunicator (rank ", rank, " of ", world_size, ", tag '", tag,
                     "'): agreeing on shared memory: ", shm.status().message()));
  }
  if (*shm == nullptr) {
    (*tcp)->set_transport_note(why_not);
    return std::unique_ptr<HostCommunicator>(*std::move(tcp));
  }
  return std::unique_ptr<HostCommunicator>(new ShmCommunicator(*std::move(tcp), *std::move(shm)));
}

// The SharedGather interface over the ShmGather: the communicator's checks,
// failure handling and byte counters around it.
class ShmCommunicator::SharedGatherImpl : public SharedGather {
 public:
  SharedGatherImpl(ShmCommunicator* comm, ShmGather* gather) : comm_(comm), gather_(gather) {}
  int regions() const override { return gather_->regions(); }
  int64_t region_bytes() const override { return gather_->region_bytes(); }

  absl::StatusOr<Result> Gather(const void* shard, const std::vector<ShardBlock>& blocks,
                                DType dtype, absl::Duration timeout) override {
    static constexpr char kName[] = "all_gather";
    BlockGroups g;
    // `full` is the region: never null.
    absl::Status s = comm_->CheckBlockCall(kName, blocks, dtype, timeout, /*full=*/this, shard, &g);
    if (!s.ok()) return s;
    const size_t esize = DTypeSize(dtype);
    if (g.full_extent * static_cast<int64_t>(esize) > gather_->region_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": the blocks reach ", g.full_extent * esize,
                       " bytes into the full buffer; the shared gather's regions hold ",
                       gather_->region_bytes()));
    }
    const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
    Result result;
    s = comm_->Run(kName, timeout, [&]() -> absl::Status {
      absl::StatusOr<const void*> full = gather_->Gather(shard, g, dtype, deadline, &result.ticket);
      if (!full.ok()) return full.status();
      result.full = *full;
      comm_->all_gather_bytes_.fetch_add(
          RingAllGatherBytes(g, comm_->rank(), comm_->world_size(), esize));
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
    return result;
  }

  void Release(int64_t ticket) override { gather_->Release(ticket); }

 private:
  ShmCommunicator* const comm_;
  ShmGather* const gather_;
};

ShmCommunicator::ShmCommunicator(std::unique_ptr<GlooCommunicator> tcp,
                                 std::unique_ptr<ShmExchange> exchange)
    : tcp_(std::move(tcp)), shm_(std::move(exchange)) {
  transport_note_ = absl::StrCat(shm_->segment_bytes() >> 20, " MiB shared-memory segment");
}

ShmCommunicator::~ShmCommunicator() {
  gather_for_abort_.store(nullptr);
  shared_gather_.reset();
  gather_.reset();
}

int64_t ShmCommunicator::shm_segment_bytes() const {
  return shm_->segment_bytes() + (gather_ != nullptr ? gather_->segment_bytes() : 0);
}

CollectiveBytes ShmCommunicator::bytes_sent() const {
  CollectiveBytes bytes;
  bytes.all_gather = all_gather_bytes_.load();
  // AllToAll runs over TCP: the only reduce-scatter bytes tcp_ counts.
  const CollectiveBytes tcp = tcp_->bytes_sent();
  bytes.reduce_scatter = reduce_scatter_bytes_.load() + tcp.reduce_scatter;
  bytes.all_reduce = all_reduce_bytes_.load();
  bytes.broadcast = tcp.broadcast;
  return bytes;
}

void ShmCommunicator::Abort() {
  if (aborted_.exchange(true)) return;
  // Waiters here and on the peers watch the segment's failed flag.
  shm_->Abort();
  if (ShmGather* gather = gather_for_abort_.load(); gather != nullptr) gather->Abort();
  tcp_->Abort();  // broadcast and barrier
}

absl::Status ShmCommunicator::CheckCall(const char* name, int64_t count, DType dtype,
                                        absl::Duration timeout) const {
  return comm_internal::CheckCall(name, rank(), world_size(), tag(), aborted_.load(), broken_,
                                  count, dtype, timeout);
}

absl::Status ShmCommunicator::CheckBlockCall(const char* name,
                                             const std::vector<ShardBlock>& blocks, DType dtype,
                                             absl::Duration timeout, const void* full,
                                             const void* shard, BlockGroups* groups) const {
  absl::Status status = CheckCall(name, 0, dtype, timeout);
  if (!status.ok()) return status;
  return comm_internal::CheckBlocks(name, blocks, rank(), world_size(), full, shard, groups);
}

absl::Status ShmCommunicator::Run(const char* name, absl::Duration timeout,
                                  const std::function<absl::Status()>& body) {
  comm_internal::CollectiveInFlight::Scope in_flight(&in_flight_);
  absl::Status result = body();
  if (result.ok()) return result;
  const std::string where =
      absl::StrCat("(rank ", rank(), " of ", world_size(), ", tag '", tag(), "', shared memory)");
  const std::string detail(result.message());
  absl::StatusCode code = result.code();
  std::string message;
  switch (code) {
    case absl::StatusCode::kDeadlineExceeded:
      message = absl::StrCat(name, " timed out after ", absl::FormatDuration(timeout), " ", where,
                             ": ", detail);
      break;
    case absl::StatusCode::kUnavailable:
      message = absl::StrCat(name, " failed: a peer is gone ", where, ": ", detail);
      break;
    default:
      message = absl::StrCat(name, " failed ", where, ": ", detail);
      break;
  }
  if (aborted_.load()) {
    // Whatever the segment reported is the abort's doing.
    code = absl::StatusCode::kAborted;
    message = absl::StrCat(name, " aborted ", where, ": Abort() was called (the job generation ",
                           "is over); the transport said: ", detail);
  }
  absl::Status status(code, message);
  Break(status);
  return status;
}

void ShmCommunicator::Break(absl::Status status) {
  broken_ = std::move(status);
  // Unusable now: peers blocked in a collective here or over TCP fail now
  // rather than at their timeout.
  shm_->Abort();
  if (gather_ != nullptr) gather_->Abort();
  tcp_->CloseConnections();
}

absl::Status ShmCommunicator::AllGather(const void* input, void* output, int64_t count, DType dtype,
                                        absl::Duration timeout) {
  static constexpr char kName[] = "all_gather";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (count == 0) return absl::OkStatus();
  if (input == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  }
  return AllGatherBlocks(input, output, ChunkBlocks(world_size(), count), dtype, timeout);
}

absl::Status ShmCommunicator::ReduceScatter(const void* input, void* output, int64_t count,
                                            DType dtype, ReduceOp op, absl::Duration timeout) {
  static constexpr char kName[] = "reduce_scatter";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (count == 0) return absl::OkStatus();
  if (input == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  }
  const int w = world_size();
  const std::vector<ShardBlock> blocks = ChunkBlocks(w, count);
  const BlockGroups g = GroupBlocks(blocks, w);
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(w) : 1.0f;
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  return Run(kName, timeout, [&] {
    absl::Status s = shm_->ReduceScatterBlocks(input, output, g, dtype, divisor, deadline);
    if (s.ok()) {
      reduce_scatter_bytes_.fetch_add(static_cast<int64_t>(w - 1) * count * DTypeSize(dtype));
    }
    return s;
  });
}

absl::Status ShmCommunicator::AllGatherBlocks(const void* shard, void* full,
                                              const std::vector<ShardBlock>& blocks, DType dtype,
                                              absl::Duration timeout) {
  static constexpr char kName[] = "all_gather";
  BlockGroups g;
  if (absl::Status s = CheckBlockCall(kName, blocks, dtype, timeout, full, shard, &g); !s.ok()) {
    return s;
  }
  if (g.full_extent == 0) return absl::OkStatus();
  const size_t esize = DTypeSize(dtype);
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  return Run(kName, timeout, [&] {
    absl::Status s = shm_->AllGatherBlocks(shard, full, g, dtype, deadline);
    if (s.ok()) all_gather_bytes_.fetch_add(RingAllGatherBytes(g, rank(), world_size(), esize));
    return s;
  });
}

absl::Status ShmCommunicator::ReduceScatterBlocks(const void* full, void* shard,
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
  const int w = world_size();
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(w) : 1.0f;
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  return Run(kName, timeout, [&] {
    absl::Status s = shm_->ReduceScatterBlocks(full, shard, g, dtype, divisor, deadline);
    if (s.ok()) reduce_scatter_bytes_.fetch_add(RingReduceScatterBytes(g, rank(), w, esize));
    return s;
  });
}

absl::Status ShmCommunicator::AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                                        absl::Duration timeout) {
  static constexpr char kName[] = "all_reduce";
  absl::Status status = CheckCall(kName, count, dtype, timeout);
  if (!status.ok()) return status;
  if (count == 0) return absl::OkStatus();
  if (buffer == nullptr) return absl::InvalidArgumentError(absl::StrCat(kName, ": null buffer"));
  const int w = world_size();
  // W chunks whose sizes differ by at most one element; reduce-scatter into
  // this rank's chunk in place, then all-gather the chunks in place.
  const std::vector<ShardBlock> blocks = comm_internal::EvenChunkBlocks(w, count);
  const BlockGroups g = GroupBlocks(blocks, w);
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(w) : 1.0f;
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  const size_t esize = DTypeSize(dtype);
  return Run(kName, timeout, [&] {
    absl::Status s = shm_->ReduceScatterBlocks(buffer, buffer, g, dtype, divisor, deadline);
    if (s.ok()) s = shm_->AllGatherBlocks(buffer, buffer, g, dtype, deadline);
    if (s.ok()) {
      all_reduce_bytes_.fetch_add(RingReduceScatterBytes(g, rank(), w, esize) +
                                  RingAllGatherBytes(g, rank(), w, esize));
    }
    return s;
  });
}

absl::Status ShmCommunicator::Broadcast(void* buffer, int64_t count, DType dtype, int root,
                                        absl::Duration timeout) {
  absl::Status status = CheckCall("broadcast", count, dtype, timeout);
  if (!status.ok()) return status;
  comm_internal::CollectiveInFlight::Scope in_flight(&in_flight_);
  status = tcp_->Broadcast(buffer, count, dtype, root, timeout);
  // A failure over TCP breaks this communicator too (not a bad argument).
  if (!status.ok() && !tcp_->health().ok()) Break(status);
  return status;
}

absl::Status ShmCommunicator::Barrier(absl::Duration timeout) {
  absl::Status status = CheckCall("barrier", 0, DType::kF32, timeout);
  if (!status.ok()) return status;
  comm_internal::CollectiveInFlight::Scope in_flight(&in_flight_);
  status = tcp_->Barrier(timeout);
  if (!status.ok() && !tcp_->health().ok()) Break(status);
  return status;
}

absl::StatusOr<SharedGather*> ShmCommunicator::MakeSharedGather(int regions, int64_t region_bytes,
                                                                absl::Duration timeout) {
  static constexpr char kName[] = "make_shared_gather";
  absl::Status status = CheckCall(kName, 0, DType::kF32, timeout);
  if (!status.ok()) return status;
  if (gather_ != nullptr) {
    // Every rank made the same one, so every rank answers alike.
    if (regions <= gather_->regions() && region_bytes <= gather_->region_bytes()) {
      return shared_gather_.get();
    }
    shared_gather_note_ = "a smaller shared gather exists already";
    return nullptr;
  }
  const absl::Time deadline = absl::Now() + std::min(timeout, kMaxTimeout);
  std::unique_ptr<ShmGather> made;
  status = Run(kName, timeout, [&]() -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShmGather>> created = ShmGather::Create(
        shm_.get(), rank(), world_size(), regions, region_bytes, deadline, &shared_gather_note_);
    if (!created.ok()) return created.status();
    made = *std::move(created);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  if (made == nullptr) return nullptr;
  shared_gather_note_ =
      absl::StrCat(regions, " regions of ", made->region_bytes() >> 20, " MiB in shared memory");
  gather_ = std::move(made);
  shared_gather_ = std::make_unique<SharedGatherImpl>(this, gather_.get());
  gather_for_abort_.store(gather_.get());
  return shared_gather_.get();
}

}  // namespace zeroshard

namespace zeroshard {

// Over TCP on this host: only the int8 reduce-scatter uses it, and it moves
// a quarter of the f32 bytes.
absl::Status ShmCommunicator::AllToAll(const void* input, void* output, int64_t bytes_per_rank,
                                       absl::Duration timeout) {
  return tcp_->AllToAll(input, output, bytes_per_rank, timeout);
}

}  // namespace zeroshard
