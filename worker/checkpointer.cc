#include "worker/checkpointer.h"

#include <stdlib.h>

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_context.h"

namespace zeroshard {
namespace {

// A checkpoint's commit: the server reads the file's header and, for the
// last rank, writes and fsyncs the manifest, on a shared filesystem that may
// be slow.
constexpr absl::Duration kCommitTimeout = absl::Minutes(5);
// An upload (--checkpoint_transport=grpc) moves the whole shard.
constexpr absl::Duration kUploadTimeout = absl::Hours(1);

// The background half of a save: write, upload if asked, commit.
absl::Status WriteAndCommit(const ShardSnapshot& snapshot, Client* client,
                            const CheckpointConfig& config) {
  // Tests only: stretch the write so that a kill lands inside it.
  if (const char* delay = getenv("ZEROSHARD_TEST_CHECKPOINT_DELAY_MS")) {
    absl::SleepFor(absl::Milliseconds(atoi(delay)));
  }
  absl::StatusOr<WrittenShard> written = WriteShard(snapshot, config.dir);
  if (!written.ok()) return written.status();
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

}  // namespace

Checkpointer::Checkpointer(Client* client, const CheckpointConfig& config,
                           const std::string& optimizer, std::vector<double>* pause_ms)
    : client_(client), config_(config), optimizer_(optimizer), pause_ms_(pause_ms) {}

absl::Status Checkpointer::Save(ZeroEngine& engine, const ShardIdentity& id) {
  const absl::Time start = absl::Now();
  if (absl::Status s = thread_.Drain(); !s.ok()) return Annotate(s, "previous checkpoint");
  absl::StatusOr<ShardSnapshot> snapshot =
      SnapshotShard(engine, id, optimizer_, config_.save_optimizer);
  if (!snapshot.ok()) return Annotate(snapshot.status(), "checkpoint snapshot");
  pause_ms_->push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  auto shared = std::make_shared<ShardSnapshot>(*std::move(snapshot));
  thread_.Submit([shared, client = client_, config = config_]() {
    return WriteAndCommit(*shared, client, config);
  });
  return absl::OkStatus();
}

absl::Status Checkpointer::Drain() {
  absl::Status s = thread_.Drain();
  return s.ok() ? s : Annotate(s, "checkpoint");
}

}  // namespace zeroshard
