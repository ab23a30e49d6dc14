#include "shard_server/checkpoint/checkpoint_verifier.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "shard_server/checkpoint/checkpoint_consolidator.h"

namespace zeroshard {
namespace {

// Verification writes nothing: only progress and cancellation matter.
class VerifyOutput : public ConsolidationOutput {
 public:
  explicit VerifyOutput(std::function<bool()> cancelled) : cancelled_(std::move(cancelled)) {}
  absl::StatusOr<ByteSink*> BeginFile(const std::string&, int64_t) override {
    return absl::InternalError("verification writes no file");
  }
  absl::Status EndFile() override { return absl::OkStatus(); }
  absl::Status Progress(int64_t, int64_t) override { return absl::OkStatus(); }
  bool Cancelled() override { return cancelled_(); }

 private:
  std::function<bool()> cancelled_;
};

}  // namespace

CheckpointVerifier::CheckpointVerifier(CheckpointRegistry* registry, EventLog* log,
                                       int64_t buffer_bytes)
    : registry_(registry), log_(log), buffer_bytes_(buffer_bytes) {
  thread_ = std::thread([this] { Loop(); });
}

CheckpointVerifier::~CheckpointVerifier() { Stop(); }

void CheckpointVerifier::Enqueue(const std::string& job, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (!stop_) queue_.emplace_back(job, step);
}

void CheckpointVerifier::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

void CheckpointVerifier::WaitIdle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || (queue_.empty() && !busy_);
  };
  mu_.Await(absl::Condition(&idle));
}

bool CheckpointVerifier::stopping() {
  absl::MutexLock lock(&mu_);
  return stop_;
}

void CheckpointVerifier::Loop() {
  while (true) {
    std::pair<std::string, int64_t> next;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    Verify(next.first, next.second);
  }
}

void CheckpointVerifier::Verify(const std::string& job, int64_t step) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<PinnedCheckpoint>> pinned = registry_->Acquire(job, step);
  if (!pinned.ok()) return;  // deleted meanwhile
  ConsolidationOptions options;
  options.buffer_bytes = buffer_bytes_;
  Consolidator consolidator(registry_->root(), (*pinned)->manifest(), options);
  VerifyOutput output([this] { return stopping(); });
  absl::StatusOr<std::map<std::string, std::string>> checksums = consolidator.Verify(&output);
  if (!checksums.ok()) {
    if (!absl::IsCancelled(checksums.status())) {
      absl::Status recorded =
          registry_->RecordVerifyFailed(job, step, checksums.status().ToString());
      log_->Log("checkpoint_verify_failed", {{"job", job},
                                             {"step", absl::StrCat(step)},
                                             {"error", checksums.status().ToString()},
                                             {"recorded", recorded.ok() ? "ok" : recorded.ToString()}});
    }
    return;
  }
  absl::Status recorded = registry_->RecordVerified(job, step, *checksums);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  log_->Log("checkpoint_verified",
            {{"job", job},
             {"step", absl::StrCat(step)},
             {"bytes", absl::StrCat((*pinned)->manifest().TotalBytes())},
             {"seconds", absl::StrFormat("%.3f", seconds)},
             {"result", recorded.ok() ? "ok" : recorded.ToString()}});
}

}  // namespace zeroshard
