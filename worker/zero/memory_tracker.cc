#include "worker/zero/memory_tracker.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

namespace zeroshard {

const char* MemoryCategoryName(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParamsSharded: return "params_sharded";
    case MemoryCategory::kParamsReplicated: return "params_replicated";
    case MemoryCategory::kParamsGathered: return "params_gathered";
    case MemoryCategory::kParamsSecondary: return "params_secondary";
    case MemoryCategory::kGradsPersistent: return "grads";
    case MemoryCategory::kGradsTransient: return "grads_transient";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kActivations: return "activations";
    case MemoryCategory::kCommBuffers: return "comm_buffers";
    case MemoryCategory::kPoolCached: return "pool_cached";
    case MemoryCategory::kCount: break;
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
         current(MemoryCategory::kParamsSecondary) + current(MemoryCategory::kGradsPersistent) + current(MemoryCategory::kOptimizerState);
}

namespace {
int64_t Rounded(int64_t bytes) { return (bytes + 63) / 64 * 64; }
}  // namespace

void* MemoryTracker::Allocate(int64_t bytes) {
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
    std::lock_guard<std::mutex> lock(pool_mu_);
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
    std::lock_guard<std::mutex> lock(pool_mu_);
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
    category_ = other.category_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void TrackedBuffer::Reset() {
  if (data_ != nullptr) {
    if (tracker_ != nullptr) {
      tracker_->Sub(category_, bytes_);
      tracker_->Free(data_, bytes_);
    } else {
      std::free(data_);
    }
  }
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace zeroshard
