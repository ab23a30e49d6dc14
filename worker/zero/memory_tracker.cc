#include "worker/zero/memory_tracker.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace zeroshard {

const char* MemoryCategoryName(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParamsSharded:
      return "params_sharded";
    case MemoryCategory::kParamsReplicated:
      return "params_replicated";
    case MemoryCategory::kParamsGathered:
      return "params_gathered";
    case MemoryCategory::kParamsSecondary:
      return "params_secondary";
    case MemoryCategory::kGradsPersistent:
      return "grads";
    case MemoryCategory::kGradsTransient:
      return "grads_transient";
    case MemoryCategory::kOptimizerState:
      return "optimizer_state";
    case MemoryCategory::kActivations:
      return "activations";
    case MemoryCategory::kCommBuffers:
      return "comm_buffers";
    case MemoryCategory::kPoolCached:
      return "pool_cached";
    case MemoryCategory::kCount:
      break;
  }
  return "unknown";
}

void MemoryTracker::RaisePeak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}

void MemoryTracker::Add(MemoryCategory category, int64_t bytes) {
  int i = static_cast<int>(category);
  int64_t now = current_[i].fetch_add(bytes) + bytes;
  RaisePeak(peak_[i], now);
  int64_t total = total_.fetch_add(bytes) + bytes;
  RaisePeak(peak_total_, total);
}

void MemoryTracker::Set(MemoryCategory category, int64_t bytes) {
  int i = static_cast<int>(category);
  int64_t old = current_[i].exchange(bytes);
  RaisePeak(peak_[i], bytes);
  int64_t total = total_.fetch_add(bytes - old) + (bytes - old);
  RaisePeak(peak_total_, total);
}

int64_t MemoryTracker::current(MemoryCategory category) const {
  return current_[static_cast<int>(category)].load();
}

int64_t MemoryTracker::peak(MemoryCategory category) const {
  return peak_[static_cast<int>(category)].load();
}

int64_t MemoryTracker::model_state() const {
  return current(MemoryCategory::kParamsSharded) + current(MemoryCategory::kParamsReplicated) +
         current(MemoryCategory::kParamsSecondary) + current(MemoryCategory::kGradsPersistent) +
         current(MemoryCategory::kOptimizerState);
}

namespace {
int64_t Rounded(int64_t bytes) { return (bytes + 63) / 64 * 64; }
}  // namespace

void* MemoryTracker::Allocate(int64_t bytes) {
  allocations_.fetch_add(1);
  const int64_t rounded = Rounded(bytes);
  if (!backend_->host_accessible()) {
    void* data = backend_->Allocate(rounded);
    if (data == nullptr) {
      std::fprintf(stderr, "zeroshard: out of memory on %s: cannot allocate %lld bytes\n",
                   backend_->name().c_str(), static_cast<long long>(rounded));
      throw std::bad_alloc();
    }
    return data;
  }
  {
    absl::MutexLock lock(&pool_mu_);
    auto it = pool_.find(rounded);
    if (it != pool_.end()) {
      void* data = it->second;
      pool_.erase(it);
      pool_bytes_ -= rounded;
      Sub(MemoryCategory::kPoolCached, rounded);
      return data;
    }
  }
  // 64-byte alignment for vectorized kernels.
  void* data = backend_->Allocate(rounded);
  if (data == nullptr) {
    std::fprintf(stderr, "zeroshard: out of host memory: cannot allocate %lld bytes\n",
                 static_cast<long long>(rounded));
    throw std::bad_alloc();
  }
  return data;
}

void MemoryTracker::Free(void* data, int64_t bytes) {
  const int64_t rounded = Rounded(bytes);
  if (!backend_->host_accessible()) {
    backend_->Free(data, rounded);
    return;
  }
  {
    absl::MutexLock lock(&pool_mu_);
    if (pool_bytes_ + rounded <= pool_limit_bytes_) {
      pool_.emplace(rounded, data);
      pool_bytes_ += rounded;
      Add(MemoryCategory::kPoolCached, rounded);
      return;
    }
  }
  backend_->Free(data, rounded);
}

MemoryTracker::~MemoryTracker() {
  absl::MutexLock lock(&pool_mu_);
  for (auto& [size, data] : pool_) backend_->Free(data, size);
}

TrackedBuffer::TrackedBuffer(MemoryTracker* tracker, MemoryCategory category, int64_t bytes,
                             bool zero)
    : tracker_(tracker), category_(category), bytes_(bytes) {
  if (bytes <= 0) {
    bytes_ = 0;
    return;
  }
  if (tracker_ != nullptr) {
    data_ = tracker_->Allocate(bytes);
    tracker_->Add(category_, bytes_);
  } else {
    data_ = std::aligned_alloc(64, Rounded(bytes));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  if (zero) {
    if (tracker_ != nullptr) {
      tracker_->backend()->Zero(data_, Rounded(bytes));
    } else {
      std::memset(data_, 0, Rounded(bytes));
    }
  }
}

TrackedBuffer& TrackedBuffer::operator=(TrackedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    tracker_ = other.tracker_;
    pool_ = other.pool_;
    category_ = other.category_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void TrackedBuffer::Reset() {
  if (data_ != nullptr && pool_ != nullptr) {
    tracker_->Sub(category_, bytes_);
    tracker_->Add(MemoryCategory::kPoolCached, bytes_);
    pool_->GiveBack(data_);
  } else if (data_ != nullptr) {
    if (tracker_ != nullptr) {
      tracker_->Sub(category_, bytes_);
      tracker_->Free(data_, bytes_);
    } else {
      std::free(data_);
    }
  }
  data_ = nullptr;
  bytes_ = 0;
  pool_ = nullptr;
}

BufferPool::~BufferPool() {
  absl::MutexLock lock(&mu_);
  for (const Block& block : blocks_) {
    assert(!block.lent && "a BufferPool destroyed while a buffer is lent");
    tracker_->Sub(MemoryCategory::kPoolCached, block.capacity);
    tracker_->Free(block.data, block.capacity);
  }
}

void BufferPool::Reserve(MemoryTracker* tracker, int64_t bytes) {
  assert(tracker != nullptr && (tracker_ == nullptr || tracker_ == tracker));
  if (bytes <= 0) return;
  tracker_ = tracker;
  Block block;
  block.data = tracker->Allocate(bytes);
  block.capacity = bytes;
  tracker->Add(MemoryCategory::kPoolCached, bytes);
  absl::MutexLock lock(&mu_);
  blocks_.push_back(block);
}

int BufferPool::FindFree(int64_t bytes) const {
  int best = -1;
  for (int i = 0; i < static_cast<int>(blocks_.size()); ++i) {
    const Block& b = blocks_[i];
    if (b.lent || b.capacity < bytes) continue;
    if (best < 0 || b.capacity < blocks_[best].capacity) best = i;
  }
  return best;
}

absl::StatusOr<TrackedBuffer> BufferPool::Lend(MemoryCategory category, int64_t bytes, bool zero,
                                               absl::Duration wait) {
  TrackedBuffer out;
  if (bytes <= 0) return out;
  int index = -1;
  {
    absl::MutexLock lock(&mu_);
    auto free = [this, bytes, &index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      index = FindFree(bytes);
      return index >= 0;
    };
    if (!free() && wait > absl::ZeroDuration()) {
      mu_.AwaitWithTimeout(absl::Condition(&free), wait);
    }
    if (index < 0) {
      int64_t largest = 0;
      int lent = 0;
      for (const Block& b : blocks_) {
        largest = std::max(largest, b.capacity);
        lent += b.lent ? 1 : 0;
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "buffer pool '", name_, "': no free buffer of ", bytes, " bytes (", blocks_.size(),
          " buffers planned, the largest ", largest, " bytes, ", lent,
          " lent): the engine's buffer plan is too small for its schedule; please report it"));
    }
    blocks_[index].lent = true;
    out.data_ = blocks_[index].data;
  }
  out.tracker_ = tracker_;
  out.pool_ = this;
  out.category_ = category;
  out.bytes_ = bytes;
  tracker_->Sub(MemoryCategory::kPoolCached, bytes);
  tracker_->Add(category, bytes);
  if (zero) tracker_->backend()->Zero(out.data_, bytes);
  return out;
}

void BufferPool::GiveBack(void* data) {
  absl::MutexLock lock(&mu_);
  for (Block& b : blocks_) {
    if (b.data != data) continue;
    assert(b.lent && "a buffer given back twice");
    b.lent = false;
    return;
  }
  assert(false && "a buffer given back to a pool that did not lend it");
}

int BufferPool::buffers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(blocks_.size());
}

int BufferPool::lent() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const Block& b : blocks_) n += b.lent ? 1 : 0;
  return n;
}

int64_t BufferPool::reserved_bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const Block& b : blocks_) total += b.capacity;
  return total;
}

}  // namespace zeroshard
