// GPU time per named section of one stream's work, from CUDA events: the
// device GPT marks where each kind of work begins (Mark("attention"), ...),
// and the time between one mark and the next is charged to the first one's
// name. The stream's time between the model's ops (the engine's gathers,
// reductions and optimizer on that stream, or the stream idle while the host
// enqueues) is charged to kOutside. For cuda_gpt_bench --profile: where a
// step's time goes, on machines without Nsight.
//
// Disabled (the default) every call is a no-op. Not thread-safe: one stream,
// one thread (the engine's compute thread).
#ifndef ZEROSHARD_WORKER_CUDA_SECTION_TIMER_H_
#define ZEROSHARD_WORKER_CUDA_SECTION_TIMER_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace zeroshard {
namespace gpu {

class SectionTimer {
 public:
  static constexpr char kOutside[] = "outside the model";

  explicit SectionTimer(void* stream) : stream_(stream) {}
  ~SectionTimer();
  SectionTimer(const SectionTimer&) = delete;
  SectionTimer& operator=(const SectionTimer&) = delete;

  void set_enabled(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }

  // Records an event on the stream; work enqueued from now on is `name`'s
  // (nullptr: kOutside). Past kMaxMarks marks before a Take, further marks
  // are dropped (their time goes to the last kept mark) and Take says so.
  void Mark(const char* name);

  // Waits for the last mark and returns milliseconds per section since the
  // previous Take (or since enabling), then starts over.
  absl::StatusOr<std::map<std::string, double>> Take();

 private:
  static constexpr size_t kMaxMarks = 1 << 14;
  void* stream_;
  bool enabled_ = false;
  std::vector<void*> events_;       // cudaEvent_t, reused across Takes
  std::vector<const char*> names_;  // names_[i]: the section events_[i] opens
  size_t used_ = 0;
  bool dropped_ = false;
};

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_SECTION_TIMER_H_
