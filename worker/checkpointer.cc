#include "worker/checkpointer.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/finite_scan.h"
#include "common/status_context.h"

namespace zeroshard {
namespace {

// A checkpoint's commit: the server reads the file's header and, for the
// last rank, writes and fsyncs the manifest, on a shared filesystem that may
// be slow. The client retries while the server is out of reach, within it.
constexpr absl::Duration kCommitTimeout = absl::Minutes(5);
// An upload (--checkpoint_transport=grpc) moves the whole shard.
constexpr absl::Duration kUploadTimeout = absl::Hours(1);

// A full disk (ours, or the server's root) clears up without the job's
// help; a step another rank abandoned (ABORTED) is gone for every rank. A
// shard holding NaN or Inf is refused and its step abandoned, so that it
// never completes and --keep_last never counts it; training goes on, and the
// next step's verdict on its loss stops or skips it (docs/numerics.md).
bool TrainingOutlivesCheckpointFailure(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsAborted(s) || IsNonFiniteTensorError(s);
}

}  // namespace

Checkpointer::Checkpointer(Client* client, const CheckpointConfig& config,
                           const std::string& optimizer, std::vector<double>* pause_ms)
    : client_(client), config_(config), optimizer_(optimizer), pause_ms_(pause_ms) {}

Checkpointer::~Checkpointer() = default;  // the threads finish their queues

bool Checkpointer::TrainingOutlives(const absl::Status& s) {
  return TrainingOutlivesCheckpointFailure(s);
}

absl::Status Checkpointer::Abandon(const ShardIdentity& id, const std::string& written_path,
                                   const absl::Status& saved, int64_t retry_step) {
  if (!TrainingOutlivesCheckpointFailure(saved)) return saved;
  // On a shared filesystem this rank's piece of the abandoned step is
  // nobody's: no manifest will ever name it. A staged file (grpc) is never
  // uploaded.
  if (!written_path.empty()) unlink(written_path.c_str());
  if (!absl::IsAborted(saved)) {
    // The others must learn of it through the server, not wait for it.
    absl::Status reported =
        client_->AbandonCheckpointStep(id.step, std::string(saved.message()), retry_step);
    if (!reported.ok()) std::fprintf(stderr, "rank %d: %s\n", id.rank, reported.ToString().c_str());
  }
  if (retry_step == 0) return saved;
  const std::string message =
      absl::StrCat("checkpoint step ", id.step, " failed on rank ", id.rank, ": ", saved.message(),
                   "; retrying at step ", retry_step);
  std::fprintf(stderr, "%s\n", message.c_str());
  absl::MutexLock lock(&mu_);
  failures_.push_back(message);
  return absl::OkStatus();
}

void Checkpointer::NoteWritten(int64_t step, int rank) {
  absl::MutexLock lock(&mu_);
  waiting_.push_back(step);
  // The one being committed counts: at most max_pending_commits files wait.
  int live = committing_;
  for (int64_t s : waiting_) live += dropped_.count(s) == 0;
  if (live <= config_.max_pending_commits) return;
  for (int64_t oldest : waiting_) {
    if (dropped_.count(oldest) != 0 || oldest == step) continue;
    dropped_.insert(oldest);
    std::fprintf(stderr,
                 "rank %d: checkpoint step %lld dropped before its commit: %d checkpoints wait "
                 "for the server (--max_pending_commits=%d); the step is abandoned once the "
                 "server answers, and training goes on\n",
                 rank, static_cast<long long>(oldest), live, config_.max_pending_commits);
    return;
  }
}

absl::Status Checkpointer::Commit(const ShardIdentity& id, const WrittenShard& written,
                                  int64_t retry_step, absl::Time saved_at) {
  bool dropped = false;
  {
    absl::MutexLock lock(&mu_);
    if (!waiting_.empty() && waiting_.front() == id.step) waiting_.pop_front();
    dropped = dropped_.erase(id.step) > 0;
    ++committing_;
  }
  absl::Status committed;
  if (dropped) {
    committed = absl::ResourceExhaustedError(absl::StrCat(
        "dropped before its commit: more than --max_pending_commits=", config_.max_pending_commits,
        " checkpoints waited for the server"));
  } else if (config_.transport == CheckpointTransport::kGrpc) {
    committed =
        client_->UploadShard(id.step, written.relative_path, written.path, kUploadTimeout).status();
  }
  if (committed.ok()) {
    committed = client_
                    ->CommitShard(id.step, written.relative_path, written.size_bytes,
                                  written.checksums, kCommitTimeout)
                    .status();
  }
  if (committed.ok() && config_.transport == CheckpointTransport::kGrpc) {
    // The server holds the committed copy, and nothing reads a staged one
    // (--resume needs a manifest, which only the server's root has): a
    // staging directory must not keep every step for ever (#51).
    unlink(written.path.c_str());
    const size_t slash = written.path.rfind('/');
    if (slash != std::string::npos) rmdir(written.path.substr(0, slash).c_str());  // if empty
  }
  absl::Status out = committed.ok() ? committed : Abandon(id, written.path, committed, retry_step);
  absl::MutexLock lock(&mu_);
  --committing_;
  if (committed.ok()) commit_ms_.push_back(absl::ToDoubleMilliseconds(absl::Now() - saved_at));
  return out;
}

absl::Status Checkpointer::Save(ZeroEngine& engine, const ShardIdentity& id, int64_t retry_step,
                                bool on_device) {
  const absl::Time start = absl::Now();
  WaitCopied();  // the previous one's copy: done long ago, its write maybe not
  if (absl::Status s = writer_.Drain(); !s.ok()) return Annotate(s, "previous checkpoint");
  if (absl::Status s = committer_.FirstError(); !s.ok()) {
    return Annotate(s, "previous checkpoint");
  }
  absl::StatusOr<ShardView> view;
  if (on_device) {
    // Device memory: copied to the host here (the pause).
    absl::StatusOr<ShardSnapshot> copy =
        SnapshotShard(engine, id, optimizer_, config_.save_optimizer);
    if (copy.ok())
      view = ViewOf(std::make_shared<const ShardSnapshot>(*std::move(copy)));
    else
      view = copy.status();
  } else {
    // The engine's own host memory, copied by the writer (WaitCopied).
    view = ViewShard(engine, id, optimizer_, config_.save_optimizer);
  }
  if (!view.ok()) return Annotate(view.status(), "checkpoint snapshot");
  pause_ms_->push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  auto copied = std::make_shared<absl::Notification>();
  copied_ = copied;
  // The writer thread runs every task queued after a successful Drain, so
  // `copied` is always notified.
  writer_.Submit([this, shared = std::make_shared<ShardView>(*std::move(view)), copied, retry_step,
                  start]() -> absl::Status { return Write(*shared, *copied, retry_step, start); });
  return absl::OkStatus();
}

void Checkpointer::WaitCopied() {
  if (copied_ == nullptr) return;
  const absl::Time wait = absl::Now();
  copied_->WaitForNotification();
  copied_.reset();
  if (!pause_ms_->empty()) pause_ms_->back() += absl::ToDoubleMilliseconds(absl::Now() - wait);
}

absl::Status Checkpointer::Write(const ShardView& view, absl::Notification& copied,
                                 int64_t retry_step, absl::Time saved_at) {
  const ShardIdentity id = view.id;
  // Tests only: hold the copy back, so that the next update must wait for it.
  if (const char* delay = getenv("ZEROSHARD_TEST_CHECKPOINT_COPY_DELAY_MS")) {
    absl::SleepFor(absl::Milliseconds(atoi(delay)));
  }
  // Measured with checkpoint_bench (576 MiB shard, a checkpoint every 12
  // steps of ~0.3 s, 2 cores): written straight from the engine's memory,
  // the update waited for write(2) to take every value into the page cache:
  // a 14 ms pause (220 ms when copied into a fresh buffer each time: page
  // faults and zeroing). Staged into a kept buffer, the copy ends within
  // the next step's forward and backward (docs/benchmarks.md). The kernel
  // paces write(2) to the disk once dirty pages pile up, so checkpoints more
  // frequent than the disk can write make the next Save wait for the
  // previous write whatever the method (~1 s each at a checkpoint every 4
  // steps).
  absl::StatusOr<WrittenShard> written;
  if (config_.staging && view.owner == nullptr) {
    absl::Notification unused;  // `copied` is notified once the copy is staged
    written = WriteShardFromView(Stage(view, copied), config_.dir, &unused);
  } else {
    written = WriteShardFromView(view, config_.dir, &copied);
  }
  // Tests only: stretch the time from the write to its commit, so that a
  // kill lands inside it (training goes on meanwhile).
  if (const char* delay = getenv("ZEROSHARD_TEST_CHECKPOINT_DELAY_MS")) {
    absl::SleepFor(absl::Milliseconds(atoi(delay)));
  }
  if (!written.ok()) {
    // In step order with the commits before it (the server may be away).
    absl::Status failed = written.status();
    if (!TrainingOutlivesCheckpointFailure(failed)) return failed;
    committer_.Submit(
        [this, id, failed, retry_step] { return Abandon(id, "", failed, retry_step); });
    return absl::OkStatus();
  }
  NoteWritten(id.step, id.rank);
  committer_.Submit([this, id, w = *std::move(written), retry_step, saved_at] {
    return Commit(id, w, retry_step, saved_at);
  });
  return absl::OkStatus();
}

void Checkpointer::Reserve(ZeroEngine& engine, const ShardIdentity& id) {
  if (!config_.staging || !config_.enabled()) return;
  absl::StatusOr<ShardView> view = ViewShard(engine, id, optimizer_, config_.save_optimizer);
  if (!view.ok()) return;  // Save says why
  int64_t floats = 0;
  for (int64_t n : view->elements) floats += n;
  writer_.Submit([this, floats]() -> absl::Status {
    Grow(floats);
    // Faulted in now, beside the first steps, not by the first checkpoint's
    // copy (which the next update may wait for).
    std::memset(staging_.get(), 0, static_cast<size_t>(floats) * sizeof(float));
    return absl::OkStatus();
  });
}

void Checkpointer::Grow(int64_t floats) {
  if (floats <= staging_floats_) return;
  staging_.reset(new float[static_cast<size_t>(floats)]);
  staging_floats_ = floats;
  staging_bytes_.store(floats * static_cast<int64_t>(sizeof(float)), std::memory_order_relaxed);
}

ShardView Checkpointer::Stage(const ShardView& view, absl::Notification& copied) {
  int64_t floats = 0;
  for (int64_t n : view.elements) floats += n;
  Grow(floats);  // Reserve made it this size, normally
  ShardView staged = view;
  float* to = staging_.get();
  for (size_t i = 0; i < view.values.size(); ++i) {
    std::memcpy(to, view.values[i], static_cast<size_t>(view.elements[i]) * sizeof(float));
    staged.values[i] = to;
    to += view.elements[i];
  }
  copied.Notify();  // the engine may change its state now
  return staged;
}

absl::Status Checkpointer::Drain() {
  absl::Status s = writer_.Drain();
  if (s.ok()) s = committer_.Drain();
  return s.ok() ? s : Annotate(s, "checkpoint");
}

std::vector<std::string> Checkpointer::failures() const {
  absl::MutexLock lock(&mu_);
  return failures_;
}

std::vector<double> Checkpointer::commit_ms() const {
  absl::MutexLock lock(&mu_);
  return commit_ms_;
}

int Checkpointer::pending_commits() const {
  absl::MutexLock lock(&mu_);
  return committing_ + static_cast<int>(waiting_.size());
}

}  // namespace zeroshard
