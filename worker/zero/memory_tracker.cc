#include "worker/zero/memory_tracker.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace zeroshard {

const char* MemoryCategoryName(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParamsSharded: return "params_sharded";
    case MemoryCategory::kParamsReplicated: return "params_replicated";
    case MemoryCategory::kParamsGathered: return "params_gathered";
    case MemoryCategory::kGradsPersistent: return "grads";
    case MemoryCategory::kGradsTransient: return "grads_transient";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kActivations: return "activations";
    case MemoryCategory::kCommBuffers: return "comm_buffers";
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
         current(MemoryCategory::kGradsPersistent) + current(MemoryCategory::kOptimizerState);
}

TrackedBuffer::TrackedBuffer(MemoryTracker* tracker, MemoryCategory category, int64_t bytes)
    : tracker_(tracker), category_(category), bytes_(bytes) {
  if (bytes <= 0) {
    bytes_ = 0;
    return;
  }
  // 64-byte alignment for vectorized kernels; calloc-like zeroing.
  size_t rounded = (static_cast<size_t>(bytes) + 63) / 64 * 64;
  data_ = std::aligned_alloc(64, rounded);
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, rounded);
  if (tracker_ != nullptr) tracker_->Add(category_, bytes_);
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
    std::free(data_);
    if (tracker_ != nullptr) tracker_->Sub(category_, bytes_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace zeroshard
