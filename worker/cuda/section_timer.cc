#include "worker/cuda/section_timer.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {
namespace gpu {

SectionTimer::~SectionTimer() {
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void SectionTimer::Mark(const char* name) {
  if (!enabled_) return;
  if (used_ == kMaxMarks) {
    dropped_ = true;
    return;
  }
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) {
      cudaGetLastError();  // not sticky; the profile just loses this mark
      dropped_ = true;
      return;
    }
    events_.push_back(e);
    names_.push_back(nullptr);
  }
  cudaEventRecord(static_cast<cudaEvent_t>(events_[used_]), static_cast<cudaStream_t>(stream_));
  names_[used_] = name;
  ++used_;
}

absl::StatusOr<std::map<std::string, double>> SectionTimer::Take() {
  std::map<std::string, double> ms;
  if (used_ == 0) return ms;
  if (absl::Status s = CudaErrorToStatus(
          cudaEventSynchronize(static_cast<cudaEvent_t>(events_[used_ - 1])), "SectionTimer");
      !s.ok()) {
    return s;
  }
  for (size_t i = 0; i + 1 < used_; ++i) {
    float elapsed = 0;
    if (absl::Status s =
            CudaErrorToStatus(cudaEventElapsedTime(&elapsed, static_cast<cudaEvent_t>(events_[i]),
                                                   static_cast<cudaEvent_t>(events_[i + 1])),
                              "SectionTimer: elapsed time");
        !s.ok()) {
      return s;
    }
    ms[names_[i] != nullptr ? names_[i] : kOutside] += elapsed;
  }
  if (dropped_) ms[absl::StrCat("(marks dropped past ", kMaxMarks, ")")] = 0;
  // The last mark opens the next period.
  std::swap(events_[0], events_[used_ - 1]);
  names_[0] = names_[used_ - 1];
  used_ = 1;
  dropped_ = false;
  return ms;
}

}  // namespace gpu
}  // namespace zeroshard
