// Reads every complete checkpoint step back once, in the background, right
// after it completed (its files are usually still in the page cache): every
// shard tensor's XXH64 is checked against the manifest and the F32 output
// checksums are recorded in the registry. So
//  - a corrupt step is reported when it happens (event
//    checkpoint_verify_failed, naming the file and tensor), not when someone
//    needs the file, and keep_last retention never deletes an older step
//    because of a newer one that turned out corrupt;
//  - consolidations of a verified step skip their verification pass (they
//    still check every piece they copy).
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_VERIFIER_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_VERIFIER_H_

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "shard_server/checkpoint/checkpoint_registry.h"
#include "shard_server/base/event_log.h"

namespace zeroshard {

// Thread-safe. One verification at a time, on a thread of its own.
class CheckpointVerifier {
 public:
  // Pointers are not owned and must outlive the verifier.
  CheckpointVerifier(CheckpointRegistry* registry, EventLog* log,
                     int64_t buffer_bytes = int64_t{4} << 20);
  ~CheckpointVerifier();  // Stop()

  void Enqueue(const std::string& job, int64_t step);
  // Cancels the running verification, drops the queue and joins the thread.
  void Stop();
  // Blocks until nothing is queued or running.
  void WaitIdle();

 private:
  void Loop();
  void Verify(const std::string& job, int64_t step);
  bool stopping();

  CheckpointRegistry* const registry_;
  EventLog* const log_;
  const int64_t buffer_bytes_;
  absl::Mutex mu_;
  std::deque<std::pair<std::string, int64_t>> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_VERIFIER_H_
