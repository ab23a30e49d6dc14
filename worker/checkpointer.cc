#include "worker/checkpointer.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

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
// be slow.
constexpr absl::Duration kCommitTimeout = absl::Minutes(5);
// An upload (--checkpoint_transport=grpc) moves the whole shard.
constexpr absl::Duration kUploadTimeout = absl::Hours(1);

// The background half of a save: write, upload if asked, commit. Sets
// `*written_path` once the file is in place locally.
absl::Status WriteAndCommit(const ShardSnapshot& snapshot, Client* client,
                            const CheckpointConfig& config, std::string* written_path) {
  // Tests only: stretch the write so that a kill lands inside it.
  if (const char* delay = getenv("ZEROSHARD_TEST_CHECKPOINT_DELAY_MS")) {
    absl::SleepFor(absl::Milliseconds(atoi(delay)));
  }
  absl::StatusOr<WrittenShard> written = WriteShard(snapshot, config.dir);
  if (!written.ok()) return written.status();
  *written_path = written->path;
  if (config.transport == CheckpointTransport::kGrpc) {
    absl::Status uploaded =
        client->UploadShard(snapshot.id.step, written->relative_path, written->path, kUploadTimeout)
            .status();
    if (!uploaded.ok()) return uploaded;
  }
  return client
      ->CommitShard(snapshot.id.step, written->relative_path, written->size_bytes,
                    written->checksums, kCommitTimeout)
      .status();
}

// A full disk (ours, or the server's root) clears up without the job's
// help; a step another rank abandoned (ABORTED) is gone for every rank. A
// shard holding NaN or Inf is refused and its step abandoned, so that it
// never completes and --keep_last never counts it; training goes on, and the
// next step's verdict on its loss stops or skips it (docs/numerics.md).
bool TrainingOutlivesCheckpointFailure(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsAborted(s) || IsNonFiniteTensorError(s);
}

}  // namespace

absl::Status Checkpointer::SaveOrAbandon(const ShardSnapshot& snapshot, Client* client,
                                         const CheckpointConfig& config, int64_t retry_step,
                                         Failures* failures) {
  std::string written_path;
  const absl::Status saved = WriteAndCommit(snapshot, client, config, &written_path);
  if (saved.ok() || !TrainingOutlivesCheckpointFailure(saved)) return saved;
  const int64_t step = snapshot.id.step;
  // On a shared filesystem this rank's piece of the abandoned step is
  // nobody's: no manifest will ever name it.
  if (config.transport == CheckpointTransport::kFs && !written_path.empty()) {
    unlink(written_path.c_str());
  }
  if (!absl::IsAborted(saved)) {
    // The others must learn of it through the server, not wait for it.
    absl::Status reported =
        client->AbandonCheckpointStep(step, std::string(saved.message()), retry_step);
    if (!reported.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", snapshot.id.rank, reported.ToString().c_str());
    }
  }
  if (retry_step == 0) return saved;
  const std::string message =
      absl::StrCat("checkpoint step ", step, " failed on rank ", snapshot.id.rank, ": ",
                   saved.message(), "; retrying at step ", retry_step);
  std::fprintf(stderr, "%s\n", message.c_str());
  absl::MutexLock lock(&failures->mu);
  failures->messages.push_back(message);
  return absl::OkStatus();
}

bool Checkpointer::TrainingOutlives(const absl::Status& s) {
  return TrainingOutlivesCheckpointFailure(s);
}

Checkpointer::Checkpointer(Client* client, const CheckpointConfig& config,
                           const std::string& optimizer, std::vector<double>* pause_ms)
    : client_(client), config_(config), optimizer_(optimizer), pause_ms_(pause_ms) {}

absl::Status Checkpointer::Save(ZeroEngine& engine, const ShardIdentity& id, int64_t retry_step) {
  const absl::Time start = absl::Now();
  if (absl::Status s = thread_.Drain(); !s.ok()) return Annotate(s, "previous checkpoint");
  absl::StatusOr<ShardSnapshot> snapshot =
      SnapshotShard(engine, id, optimizer_, config_.save_optimizer);
  if (!snapshot.ok()) return Annotate(snapshot.status(), "checkpoint snapshot");
  pause_ms_->push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  auto shared = std::make_shared<ShardSnapshot>(*std::move(snapshot));
  thread_.Submit([shared, client = client_, config = config_, retry_step, failures = failures_]() {
    return SaveOrAbandon(*shared, client, config, retry_step, failures.get());
  });
  return absl::OkStatus();
}

absl::Status Checkpointer::Drain() {
  absl::Status s = thread_.Drain();
  return s.ok() ? s : Annotate(s, "checkpoint");
}

std::vector<std::string> Checkpointer::failures() const {
  absl::MutexLock lock(&failures_->mu);
  return failures_->messages;
}

}  // namespace zeroshard
