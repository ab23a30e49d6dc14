// Bytes held by the engine, by category, with peaks: the figures the ZeRO
// papers' tables show, measured rather than estimated.
#ifndef ZEROSHARD_WORKER_ZERO_MEMORY_TRACKER_H_
#define ZEROSHARD_WORKER_ZERO_MEMORY_TRACKER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/zero/backend.h"

namespace zeroshard {

enum class MemoryCategory {
  kParamsSharded,     // this rank's fp32 master shard (stage 3; bf16 runs at stages 0-2)
  kParamsReplicated,  // full parameters every rank holds (stages 0-2)
  kParamsGathered,    // stage 3: full units, alive only between gather and release
  kParamsSecondary,   // hpZ: this rank's slice of every unit for the backward's gathers
  kGradsPersistent,   // full gradients (stages 0-1) or gradient shards (stages 2-3)
  kGradsTransient,    // stages 2-3: a unit's full gradient during its backward
  kOptimizerState,    // moments of this rank's shard
  kActivations,       // what the model keeps for backward
  kCommBuffers,       // send/receive buffers of collectives
  kPoolCached,        // freed buffers kept for reuse (see MemoryTracker::Allocate)
  kCount,
};

const char* MemoryCategoryName(MemoryCategory category);

// Thread-safe (lock-free counters).
class MemoryTracker {
 public:
  void Add(MemoryCategory category, int64_t bytes);
  void Sub(MemoryCategory category, int64_t bytes) { Add(category, -bytes); }
  // For categories measured elsewhere (activations): sets the current value.
  void Set(MemoryCategory category, int64_t bytes);

  int64_t current(MemoryCategory category) const;
  int64_t peak(MemoryCategory category) const;
  int64_t total() const { return total_.load(); }
  int64_t peak_total() const { return peak_total_.load(); }
  // Persistent model state: sharded + replicated params, hpZ's secondary
  // copy, persistent grads, optimizer state (what the ZeRO formulas count,
  // ZeRO++'s hpZ adding its Psi/H).
  int64_t model_state() const;

  // Memory for TrackedBuffer, from the backend (default: the CPU's). On the
  // host, freed blocks are kept (by size, up to `pool_limit_bytes` in all)
  // and handed out again: the engine frees and reallocates the same few
  // sizes every unit, and fresh pages from the kernel cost a page fault and
  // a zeroing each. (A device backend pools by itself.) Thread-safe. Out of
  // memory: a message naming the size and backend on stderr, then
  // std::bad_alloc.
  void* Allocate(int64_t bytes);
  // Allocate calls so far: a step's count is zero (the engine plans its
  // step buffers at Create; tests/worker/zero/engine_test.cc checks).
  int64_t allocations() const { return allocations_.load(); }
  void Free(void* data, int64_t bytes);
  void set_pool_limit_bytes(int64_t limit) { pool_limit_bytes_ = limit; }
  // Before the first Allocate.
  void set_backend(Backend* backend) { backend_ = backend; }
  Backend* backend() const { return backend_; }
  ~MemoryTracker();

 private:
  static void RaisePeak(std::atomic<int64_t>& peak, int64_t value);
  std::array<std::atomic<int64_t>, static_cast<int>(MemoryCategory::kCount)> current_{};
  std::array<std::atomic<int64_t>, static_cast<int>(MemoryCategory::kCount)> peak_{};
  std::atomic<int64_t> total_{0};
  std::atomic<int64_t> peak_total_{0};
  std::atomic<int64_t> allocations_{0};
  absl::Mutex pool_mu_;
  std::multimap<int64_t, void*> pool_ ABSL_GUARDED_BY(pool_mu_);  // rounded bytes -> block
  int64_t pool_bytes_ ABSL_GUARDED_BY(pool_mu_) = 0;
  int64_t pool_limit_bytes_ = int64_t{256} << 20;
  Backend* backend_ = CpuBackend();
};

class BufferPool;

// A zero-initialized buffer in the tracker's backend memory whose bytes are
// counted in a category for its lifetime (without a tracker: host memory).
// Movable, not copyable.
class TrackedBuffer {
 public:
  TrackedBuffer() = default;
  // `zero`: fill with zeros (skip when the caller overwrites every byte).
  TrackedBuffer(MemoryTracker* tracker, MemoryCategory category, int64_t bytes, bool zero = true);
  ~TrackedBuffer() { Reset(); }
  TrackedBuffer(TrackedBuffer&& other) noexcept { *this = std::move(other); }
  TrackedBuffer& operator=(TrackedBuffer&& other) noexcept;
  TrackedBuffer(const TrackedBuffer&) = delete;
  TrackedBuffer& operator=(const TrackedBuffer&) = delete;

  void Reset();
  bool empty() const { return data_ == nullptr; }
  int64_t bytes() const { return bytes_; }
  void* data() { return data_; }
  const void* data() const { return data_; }
  float* f32() { return static_cast<float*>(data_); }
  const float* f32() const { return static_cast<const float*>(data_); }
  uint16_t* u16() { return static_cast<uint16_t*>(data_); }

 private:
  friend class BufferPool;
  MemoryTracker* tracker_ = nullptr;
  BufferPool* pool_ = nullptr;  // lent by it (Reset gives it back); null: owned
  MemoryCategory category_ = MemoryCategory::kCommBuffers;
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

// Buffers allocated once, up front, and lent again and again: the engine's
// step path takes every buffer it uses from pools planned when the engine is
// created (step_buffers.h), so that a step allocates nothing. A lent buffer
// is a TrackedBuffer whose bytes count in the borrower's category until it
// is reset or destroyed, when it comes back here; the bytes not lent count
// as pool_cached, so the categories mean what they mean for owned buffers
// and the total is what the pool holds. Thread-safe. REQUIRES: the pool
// outlives every buffer it lent.
class BufferPool {
 public:
  explicit BufferPool(std::string name) : name_(std::move(name)) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // Adds one buffer of `bytes` from `tracker` (every call: the same tracker).
  void Reserve(MemoryTracker* tracker, int64_t bytes);
  // The smallest free buffer of at least `bytes`, counted in `category` as
  // `bytes`; `zero`: its first `bytes` zeroed. Waits up to `wait` for one to
  // come back (lent to another thread); none in time: RESOURCE_EXHAUSTED
  // naming the pool, its buffers and the size asked for (a plan too small).
  absl::StatusOr<TrackedBuffer> Lend(MemoryCategory category, int64_t bytes, bool zero,
                                     absl::Duration wait = absl::ZeroDuration());
  int buffers() const;
  int lent() const;
  int64_t reserved_bytes() const;

 private:
  friend class TrackedBuffer;
  struct Block {
    void* data = nullptr;
    int64_t capacity = 0;
    bool lent = false;
  };
  void GiveBack(void* data);
  int FindFree(int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  MemoryTracker* tracker_ = nullptr;
  mutable absl::Mutex mu_;
  std::vector<Block> blocks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_MEMORY_TRACKER_H_
