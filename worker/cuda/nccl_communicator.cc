#include "worker/cuda/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace zeroshard {
namespace {

// NCCL's reduction for `op` over `world_size` ranks. Over one rank the
// average is the sum, and asking for the sum keeps NCCL on its one-rank copy:
// its one-rank average kernel (before NCCL 2.29.7) leaves the last elements
// of a buffer unwritten when the count is not a multiple of its block count
// (NCCL issue #1950; seen here as a ZeRO-3 reduce-scatter that lost the last
// 12 gradient elements of every unit on one GPU).
ncclRedOp_t NcclOp(ReduceOp op, int world_size) {
  return op == ReduceOp::kAverage && world_size > 1 ? ncclAvg : ncclSum;
}

// How long the destructor lets a healthy communicator finalize (flush its
// work and free its resources with the peers) before aborting it instead.
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(10);

// Polling a stream or NCCL's async state. ZeRO-3 puts the next unit's gather
// on the step's critical path once per unit (on one GPU: a copy queued behind
// the compute stream's kernels, done in tens to hundreds of microseconds), so
// a young wait is seen at once: it yields between polls for its first 2 ms
// (a sleep would add Linux's 50 us timer slack and more), sleeps 20 us
// between polls until 20 ms, and beyond that (a slow or missing peer) backs
// off to 1 ms sleeps so that it does not burn a core the step needs.
class Backoff {
 public:
  void Pause() {
    const absl::Duration age = absl::Now() - start_;
    if (age < absl::Milliseconds(2)) {
      std::this_thread::yield();
    } else if (age < absl::Milliseconds(20)) {
      absl::SleepFor(absl::Microseconds(20));
    } else {
      absl::SleepFor(sleep_);
      sleep_ = std::min(sleep_ * 2, absl::Milliseconds(1));
    }
  }

 private:
  const absl::Time start_ = absl::Now();
  absl::Duration sleep_ = absl::Microseconds(20);
};

bool Supported(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

ncclDataType_t NcclType(DType dtype) { return dtype == DType::kF32 ? ncclFloat32 : ncclBfloat16; }

// NCCL's error as a status: its generic string for the code and its detailed
// last-error message (the text NCCL_DEBUG=WARN would print).
absl::Status NcclError(ncclResult_t result, const std::string& context) {
  const char* last = ncclGetLastError(nullptr);
  std::string message = absl::StrCat(context, ": NCCL error ", static_cast<int>(result), " (",
                                     ncclGetErrorString(result), ")");
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, ": ", last);
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

// Rejects host pointers early with a clear message (NCCL would fail with an
// illegal memory access, or read stale host memory over PCIe).
absl::Status CheckDevicePointer(const char* name, const void* p) {
  cudaPointerAttributes attributes;
  const cudaError_t error = cudaPointerGetAttributes(&attributes, p);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return CudaErrorToStatus(error, absl::StrCat(name, ": cudaPointerGetAttributes"));
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": buffer ", absl::Hex(reinterpret_cast<uintptr_t>(p)),
                     " is not device memory; NcclCommunicator needs device buffers"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string NcclUniqueIdKey(const std::string& tag) {
  return absl::StrCat("nccl/", tag, "/unique_id");
}

absl::StatusOr<std::string> PublishOrFetchNcclUniqueId(KeyValueStore* store, int rank,
                                                       const std::string& tag,
                                                       absl::Duration timeout) {
  if (store == nullptr) return absl::InvalidArgumentError("NCCL unique id: store is null");
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("NCCL unique id: rank ", rank));
  if (tag.empty()) return absl::InvalidArgumentError("NCCL unique id: tag is empty");
  const std::string key = NcclUniqueIdKey(tag);
  if (rank == 0) {
    ncclUniqueId id;
    const ncclResult_t result = ncclGetUniqueId(&id);
    if (result != ncclSuccess) {
      return NcclError(result, absl::StrCat("rank 0, tag '", tag, "': ncclGetUniqueId"));
    }
    std::string bytes(id.internal, sizeof(id.internal));
    absl::Status set = store->Set(key, bytes);
    if (!set.ok()) {
      return absl::Status(
          set.code(), absl::StrCat("rank 0, tag '", tag, "': publishing the NCCL unique id at '",
                                   key, "': ", set.message()));
    }
    return bytes;
  }
  absl::StatusOr<std::string> bytes = store->Get(key, timeout);
  if (!bytes.ok()) {
    return absl::Status(
        bytes.status().code(),
        absl::StrCat("rank ", rank, ", tag '", tag, "': waiting for rank 0's NCCL unique id at '",
                     key, "': ", bytes.status().message()));
  }
  if (bytes->size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::DataLossError(
        absl::StrCat("rank ", rank, ", tag '", tag, "': the NCCL unique id at '", key, "' has ",
                     bytes->size(), " bytes, expected ", NCCL_UNIQUE_ID_BYTES));
  }
  return bytes;
}

namespace {

// ncclCommInitRankConfig, non-blocking, waited for until `deadline` (the
// end of Create's `timeout`): it completes only once all world_size ranks
// have joined. On failure the communicator is aborted.
absl::StatusOr<ncclComm_t> InitComm(const ncclUniqueId& id, int rank, int world_size,
                                    absl::Time deadline, absl::Duration timeout,
                                    const std::string& where) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    absl::Status status = NcclError(result, where + ": ncclCommInitRankConfig");
    if (comm != nullptr) ncclCommAbort(comm);
    return status;
  }
  Backoff backoff;
  ncclResult_t state = ncclInProgress;
  while (true) {
    result = ncclCommGetAsyncError(comm, &state);
    if (result != ncclSuccess) state = result;
    if (state != ncclInProgress) break;
    if (absl::Now() >= deadline) {
      ncclCommAbort(comm);
      return absl::DeadlineExceededError(
          absl::StrCat(where, ": ncclCommInitRankConfig did not complete within ",
                       absl::FormatDuration(timeout), " (are all ", world_size,
                       " ranks up and able to reach each other?); the communicator was aborted"));
    }
    backoff.Pause();
  }
  if (state != ncclSuccess) {
    absl::Status status = NcclError(state, where + ": ncclCommInitRankConfig");
    ncclCommAbort(comm);
    return status;
  }
  return comm;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    KeyValueStore* store, int rank, int world_size, int device, const std::string& tag,
    absl::Duration init_timeout) {
  if (store == nullptr) return absl::InvalidArgumentError("NcclCommunicator: store is null");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("NcclCommunicator: rank ", rank,
                                                   " is not in [0, world_size ", world_size, ")"));
  }
  if (tag.empty()) return absl::InvalidArgumentError("NcclCommunicator: tag is empty");
  if (init_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclCommunicator: init_timeout must be positive, got ",
                     absl::FormatDuration(init_timeout)));
  }
  // Before touching the store: a rank without a GPU must not publish an id
  // that the others would then wait on in vain.
  if (absl::Status s = CheckCudaDevice(device); !s.ok()) return s;

  const absl::Time deadline = absl::Now() + init_timeout;
  const std::string where = absl::StrCat("NcclCommunicator (rank ", rank, " of ", world_size,
                                         ", tag '", tag, "', device ", device, ")");
  absl::StatusOr<std::string> id_bytes = PublishOrFetchNcclUniqueId(store, rank, tag, init_timeout);
  if (!id_bytes.ok()) {
    return absl::Status(id_bytes.status().code(),
                        absl::StrCat(where, ": ", id_bytes.status().message()));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, id_bytes->data(), sizeof(id.internal));

  if (absl::Status s = CudaErrorToStatus(cudaSetDevice(device), where + ": cudaSetDevice");
      !s.ok()) {
    return s;
  }
  // Non-blocking with respect to the legacy default stream, so that compute
  // enqueued there does not serialize with communication.
  cudaStream_t stream = nullptr;
  if (absl::Status s = CudaErrorToStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                         where + ": cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  float* barrier_buffer = nullptr;
  if (absl::Status s =
          CudaErrorToStatus(cudaMalloc(reinterpret_cast<void**>(&barrier_buffer), sizeof(float)),
                            where + ": cudaMalloc");
      !s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  auto release = [&] {
    cudaFree(barrier_buffer);
    cudaStreamDestroy(stream);
  };

  absl::StatusOr<ncclComm_t> comm = InitComm(id, rank, world_size, deadline, init_timeout, where);
  if (!comm.ok()) {
    release();
    return comm.status();
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(rank, world_size, device, tag, *comm, stream, barrier_buffer));
}

NcclCommunicator::NcclCommunicator(int rank, int world_size, int device, std::string tag,
                                   ncclComm* comm, cudaStream_t stream, float* barrier_buffer)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      tag_(std::move(tag)),
      stream_(stream),
      barrier_buffer_(barrier_buffer),
      comm_(comm) {}

NcclCommunicator::~NcclCommunicator() {
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
    comm_ = nullptr;
  }
  cudaSetDevice(device_);
  if (comm != nullptr) {
    // Finalize flushes outstanding work and frees resources shared with the
    // peers; on a non-blocking communicator it completes asynchronously.
    bool finalized = false;
    ncclResult_t result = ncclCommFinalize(comm);
    if (result == ncclSuccess || result == ncclInProgress) {
      const absl::Time deadline = absl::Now() + kFinalizeTimeout;
      Backoff backoff;
      ncclResult_t state = ncclInProgress;
      while (absl::Now() < deadline) {
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
        if (state != ncclInProgress) break;
        backoff.Pause();
      }
      finalized = state == ncclSuccess;
    }
    // Either may complete in NCCL's background thread (non-blocking
    // communicator); the handle is not used again here.
    if (finalized) {
      ncclCommDestroy(comm);
    } else {
      ncclCommAbort(comm);
    }
  }
  cudaFree(barrier_buffer_);
  if (staging_ != nullptr) cudaFree(staging_);
  cudaStreamDestroy(stream_);
}

std::string NcclCommunicator::Where() const {
  return absl::StrCat("(rank ", rank_, " of ", world_size_, ", tag '", tag_, "', device ", device_,
                      ")");
}

CollectiveBytes NcclCommunicator::bytes_sent() const {
  CollectiveBytes bytes;
  bytes.all_gather = all_gather_bytes_.load();
  bytes.reduce_scatter = reduce_scatter_bytes_.load();
  bytes.all_reduce = all_reduce_bytes_.load();
  bytes.broadcast = broadcast_bytes_.load();
  return bytes;
}

absl::Status NcclCommunicator::health() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

bool NcclCommunicator::AwaitCollectiveInFlight(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto in_call = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_call_; };
  return mu_.AwaitWithTimeout(absl::Condition(&in_call), timeout);
}

absl::Status NcclCommunicator::Begin(const char* name, int64_t count, DType dtype,
                                     absl::Duration timeout,
                                     std::initializer_list<const void*> buffers) {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return absl::UnavailableError(
          absl::StrCat(name, ": communicator ", Where(),
                       " is unusable after an earlier failure; create a new one. Earlier failure: ",
                       broken_.message()));
    }
  }
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": negative count ", count));
  if (!Supported(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": dtype ", DTypeName(dtype), " is not supported (F32 and BF16 are)"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": timeout must be positive, got ", absl::FormatDuration(timeout)));
  }
  if (absl::Status s = CudaErrorToStatus(cudaSetDevice(device_),
                                         absl::StrCat(name, " ", Where(), ": cudaSetDevice"));
      !s.ok()) {
    return s;
  }
  if (count > 0) {
    for (const void* buffer : buffers) {
      if (buffer == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": null buffer"));
      if (absl::Status s = CheckDevicePointer(name, buffer); !s.ok()) return s;
    }
  }
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) {  // Abort() ran since the check above
    return absl::UnavailableError(
        absl::StrCat(name, ": communicator ", Where(), " was aborted: ", broken_.message()));
  }
  in_call_ = true;
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Wait(const char* name, int enqueue_result, absl::Duration timeout) {
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;  // stays valid: in_call_ keeps Abort() from freeing it
  }
  const absl::Time deadline = absl::Now() + timeout;
  auto timed_out = [&] {
    return absl::DeadlineExceededError(absl::StrCat(
        name, " timed out after ", absl::FormatDuration(timeout), " ", Where(),
        "; the communicator was aborted (a peer may be missing, slow, or in another collective)"));
  };
  auto aborted = [&] {
    return absl::AbortedError(
        absl::StrCat(name, " ", Where(), ": aborted by Abort() (a new generation?)"));
  };

  ncclResult_t result = static_cast<ncclResult_t>(enqueue_result);
  if (result != ncclSuccess && result != ncclInProgress) {
    return NcclError(result, absl::StrCat(name, " ", Where()));
  }
  Backoff backoff;
  // A non-blocking communicator may still be enqueuing the collective.
  while (result == ncclInProgress) {
    if (abort_requested_.load()) return aborted();
    ncclResult_t state = ncclInProgress;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    result = query != ncclSuccess ? query : state;
    if (result != ncclSuccess && result != ncclInProgress) {
      return NcclError(result, absl::StrCat(name, " ", Where()));
    }
    if (result == ncclInProgress && absl::Now() >= deadline) return timed_out();
    if (result == ncclInProgress) backoff.Pause();
  }
  // Enqueued: wait for the stream. NCCL reports peer and network failures
  // asynchronously, so the stream alone would never finish in that case.
  while (true) {
    if (abort_requested_.load()) return aborted();
    const cudaError_t query = cudaStreamQuery(stream_);
    if (query == cudaSuccess) return absl::OkStatus();
    if (query != cudaErrorNotReady) {
      return CudaErrorToStatus(query, absl::StrCat(name, " ", Where(), ": cudaStreamQuery"));
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t check = ncclCommGetAsyncError(comm, &state);
    if (check != ncclSuccess) state = check;
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclError(state, absl::StrCat(name, " ", Where()));
    }
    if (absl::Now() >= deadline) return timed_out();
    backoff.Pause();
  }
}

absl::Status NcclCommunicator::Finish(const char* name, int enqueue_result, absl::Duration timeout,
                                      std::atomic<int64_t>* counter, int64_t bytes) {
  return Complete(Wait(name, enqueue_result, timeout), counter, bytes);
}

absl::Status NcclCommunicator::Complete(absl::Status status, std::atomic<int64_t>* counter,
                                        int64_t bytes) {
  if (status.ok()) {
    if (counter != nullptr) counter->fetch_add(bytes);
    absl::MutexLock lock(&mu_);
    in_call_ = false;
    return status;
  }
  {
    absl::MutexLock lock(&mu_);
    in_call_ = false;
  }
  // The collective may be half done on some ranks, so the communicator
  // cannot be trusted again; aborting also stops its kernels so that the
  // stream drains.
  AbortComm(status);
  return status;
}

void NcclCommunicator::AbortComm(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) broken_ = why;
  if (comm_ == nullptr) return;
  // The abort may finish in NCCL's background thread; comm_ is not used again.
  ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::Abort() {
  const absl::Status why = absl::AbortedError(
      absl::StrCat("communicator ", Where(), " aborted by Abort() (a new generation?)"));
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return;
    if (in_call_) {
      // The calling thread is polling comm_: let it abort (Finish does) and
      // wait for that, rather than free comm_ under it.
      abort_requested_.store(true);
      auto call_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_call_; };
      mu_.Await(absl::Condition(&call_done));
    }
  }
  // No call in progress (or it just finished, successfully or not).
  AbortComm(why);
}

absl::Status NcclCommunicator::AllGather(const void* input, void* output, int64_t count,
                                         DType dtype, absl::Duration timeout) {
  static constexpr char kName[] = "all_gather";
  if (absl::Status s = Begin(kName, count, dtype, timeout, {input, output}); !s.ok()) return s;
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  const int64_t bytes = count * DTypeSize(dtype);
  const ncclResult_t result = count == 0 ? ncclSuccess
                                         : ncclAllGather(input, output, static_cast<size_t>(count),
                                                         NcclType(dtype), comm, stream_);
  return Finish(kName, result, timeout, &all_gather_bytes_, (world_size_ - 1) * bytes);
}

absl::Status NcclCommunicator::ReduceScatter(const void* input, void* output, int64_t count,
                                             DType dtype, ReduceOp op, absl::Duration timeout) {
  static constexpr char kName[] = "reduce_scatter";
  if (absl::Status s = Begin(kName, count, dtype, timeout, {input, output}); !s.ok()) return s;
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  const int64_t bytes = count * DTypeSize(dtype);
  const ncclResult_t result =
      count == 0 ? ncclSuccess
                 : ncclReduceScatter(input, output, static_cast<size_t>(count), NcclType(dtype),
                                     NcclOp(op, world_size_), comm, stream_);
  return Finish(kName, result, timeout, &reduce_scatter_bytes_, (world_size_ - 1) * bytes);
}

absl::StatusOr<char*> NcclCommunicator::Staging(const char* name, size_t bytes) {
  if (staging_bytes_ >= bytes) return staging_;
  if (staging_ != nullptr) {
    // Earlier calls' copies finished before they returned.
    cudaFree(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
  }
  void* p = nullptr;
  if (absl::Status s = CudaErrorToStatus(
          cudaMalloc(&p, bytes),
          absl::StrCat(name, " ", Where(), ": cudaMalloc of ", bytes, " bytes of staging"));
      !s.ok()) {
    return s;
  }
  staging_ = static_cast<char*>(p);
  staging_bytes_ = bytes;
  return staging_;
}

namespace {

// The largest shard extent of a block layout over every rank (elements).
int64_t LargestShard(const std::vector<ShardBlock>& blocks) {
  int64_t chunk = 0;
  for (const ShardBlock& b : blocks) chunk = std::max(chunk, b.shard_offset + b.count);
  return chunk;
}

int64_t ShardExtent(const std::vector<ShardBlock>& blocks, int rank) {
  int64_t extent = 0;
  for (const ShardBlock& b : blocks) {
    if (b.rank == rank && b.count > 0) extent = std::max(extent, b.shard_offset + b.count);
  }
  return extent;
}

}  // namespace

absl::Status NcclCommunicator::AllGatherBlocks(const void* shard, void* full,
                                               const std::vector<ShardBlock>& blocks, DType dtype,
                                               absl::Duration timeout) {
  static constexpr char kName[] = "all_gather";
  if (absl::Status s = ValidateBlocks(kName, blocks, world_size_); !s.ok()) return s;
  const int64_t chunk = LargestShard(blocks);
  const int64_t own = ShardExtent(blocks, rank_);
  if (own > 0) {
    if (shard == nullptr) return absl::InvalidArgumentError(absl::StrCat(kName, ": null shard"));
    if (absl::Status s = CheckDevicePointer(kName, shard); !s.ok()) return s;
  }
  if (absl::Status s = Begin(kName, chunk, dtype, timeout, {full}); !s.ok()) return s;
  if (chunk == 0) return Complete(absl::OkStatus(), nullptr, 0);
  const int64_t esize = DTypeSize(dtype);
  absl::StatusOr<char*> staging = Staging(kName, (world_size_ + 1) * chunk * esize);
  if (!staging.ok()) return Complete(staging.status(), nullptr, 0);
  char* send = *staging;
  char* received = send + chunk * esize;
  char* out = static_cast<char*>(full);
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  // Pack: this rank's shard extent into the send chunk (the rest is padding
  // that no block reads).
  absl::Status status;
  if (own > 0) {
    status = CudaErrorToStatus(
        cudaMemcpyAsync(send, shard, own * esize, cudaMemcpyDeviceToDevice, stream_),
        absl::StrCat(kName, " ", Where(), ": cudaMemcpyAsync"));
  }
  if (!status.ok()) return Complete(status, nullptr, 0);
  const ncclResult_t result =
      ncclAllGather(send, received, static_cast<size_t>(chunk), NcclType(dtype), comm, stream_);
  status = Wait(kName, result, timeout);
  // Unpack every block into place (after the gather is enqueued and done).
  for (const ShardBlock& b : blocks) {
    if (!status.ok() || b.count == 0) continue;
    status = CudaErrorToStatus(cudaMemcpyAsync(out + b.full_offset * esize,
                                               received + (b.rank * chunk + b.shard_offset) * esize,
                                               b.count * esize, cudaMemcpyDeviceToDevice, stream_),
                               absl::StrCat(kName, " ", Where(), ": cudaMemcpyAsync"));
  }
  if (status.ok()) {
    status = CudaErrorToStatus(cudaStreamSynchronize(stream_),
                               absl::StrCat(kName, " ", Where(), ": cudaStreamSynchronize"));
  }
  return Complete(status, &all_gather_bytes_, (world_size_ - 1) * chunk * esize);
}

absl::Status NcclCommunicator::ReduceScatterBlocks(const void* full, void* shard,
                                                   const std::vector<ShardBlock>& blocks,
                                                   DType dtype, ReduceOp op,
                                                   absl::Duration timeout) {
  static constexpr char kName[] = "reduce_scatter";
  if (absl::Status s = ValidateBlocks(kName, blocks, world_size_); !s.ok()) return s;
  const int64_t chunk = LargestShard(blocks);
  if (ShardExtent(blocks, rank_) > 0) {
    if (shard == nullptr) return absl::InvalidArgumentError(absl::StrCat(kName, ": null shard"));
    if (absl::Status s = CheckDevicePointer(kName, shard); !s.ok()) return s;
  }
  if (absl::Status s = Begin(kName, chunk, dtype, timeout, {full}); !s.ok()) return s;
  if (chunk == 0) return Complete(absl::OkStatus(), nullptr, 0);
  const int64_t esize = DTypeSize(dtype);
  absl::StatusOr<char*> staging = Staging(kName, (world_size_ + 1) * chunk * esize);
  if (!staging.ok()) return Complete(staging.status(), nullptr, 0);
  char* send = *staging;
  char* received = send + world_size_ * chunk * esize;
  const char* in = static_cast<const char*>(full);
  char* out = static_cast<char*>(shard);
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  // Pack: every block at its rank's chunk; padding is zero, so it adds
  // nothing.
  const std::string where = absl::StrCat(kName, " ", Where(), ": ");
  absl::Status status =
      CudaErrorToStatus(cudaMemsetAsync(send, 0, world_size_ * chunk * esize, stream_),
                        absl::StrCat(where, "cudaMemsetAsync"));
  for (const ShardBlock& b : blocks) {
    if (!status.ok() || b.count == 0) continue;
    status = CudaErrorToStatus(cudaMemcpyAsync(send + (b.rank * chunk + b.shard_offset) * esize,
                                               in + b.full_offset * esize, b.count * esize,
                                               cudaMemcpyDeviceToDevice, stream_),
                               absl::StrCat(where, "cudaMemcpyAsync"));
  }
  if (!status.ok()) return Complete(status, nullptr, 0);
  const ncclResult_t result =
      ncclReduceScatter(send, received, static_cast<size_t>(chunk), NcclType(dtype),
                        NcclOp(op, world_size_), comm, stream_);
  status = Wait(kName, result, timeout);
  for (const ShardBlock& b : blocks) {
    if (!status.ok() || b.count == 0 || b.rank != rank_) continue;
    status = CudaErrorToStatus(
        cudaMemcpyAsync(out + b.shard_offset * esize, received + b.shard_offset * esize,
                        b.count * esize, cudaMemcpyDeviceToDevice, stream_),
        absl::StrCat(where, "cudaMemcpyAsync"));
  }
  if (status.ok()) {
    status = CudaErrorToStatus(cudaStreamSynchronize(stream_),
                               absl::StrCat(where, "cudaStreamSynchronize"));
  }
  return Complete(status, &reduce_scatter_bytes_, (world_size_ - 1) * chunk * esize);
}

absl::Status NcclCommunicator::AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                                         absl::Duration timeout) {
  static constexpr char kName[] = "all_reduce";
  if (absl::Status s = Begin(kName, count, dtype, timeout, {buffer}); !s.ok()) return s;
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  const int64_t bytes = count * DTypeSize(dtype);
  const ncclResult_t result =
      count == 0 ? ncclSuccess
                 : ncclAllReduce(buffer, buffer, static_cast<size_t>(count), NcclType(dtype),
                                 NcclOp(op, world_size_), comm, stream_);
  return Finish(kName, result, timeout, &all_reduce_bytes_,
                2 * (world_size_ - 1) * bytes / world_size_);
}

absl::Status NcclCommunicator::Broadcast(void* buffer, int64_t count, DType dtype, int root,
                                         absl::Duration timeout) {
  static constexpr char kName[] = "broadcast";
  if (root < 0 || root >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat(kName, ": root ", root, " is not in [0, ", world_size_, ")"));
  }
  if (absl::Status s = Begin(kName, count, dtype, timeout, {buffer}); !s.ok()) return s;
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  const int64_t bytes = count * DTypeSize(dtype);
  const ncclResult_t result = count == 0 ? ncclSuccess
                                         : ncclBroadcast(buffer, buffer, static_cast<size_t>(count),
                                                         NcclType(dtype), root, comm, stream_);
  // The ring from the root: every rank forwards the data except the last one,
  // the root's predecessor.
  const bool last_in_ring = (rank_ + 1) % world_size_ == root;
  return Finish(kName, result, timeout, &broadcast_bytes_,
                world_size_ == 1 || last_in_ring ? 0 : bytes);
}

absl::Status NcclCommunicator::Barrier(absl::Duration timeout) {
  static constexpr char kName[] = "barrier";
  if (absl::Status s = Begin(kName, 1, DType::kF32, timeout, {barrier_buffer_}); !s.ok()) return s;
  ncclComm* comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
  }
  // Completes on a rank only once every rank has contributed its element.
  const ncclResult_t result =
      ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclFloat32, ncclSum, comm, stream_);
  return Finish(kName, result, timeout, nullptr, 0);
}

}  // namespace zeroshard
