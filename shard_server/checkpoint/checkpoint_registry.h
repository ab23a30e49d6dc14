// The checkpoint registry: which ranks committed which shard file of which
// step, and which steps are complete. Kept in the server's SQLite state
// store (tables checkpoint_steps and checkpoint_commits), so a restarted
// server still knows its checkpoints.
//
// A step becomes complete when all W ranks of the generation that wrote it
// committed a verified shard file: then the registry writes
// <job>/step-<N>/manifest.json (temporary file, fsync, rename, directory
// fsync), marks the step complete, and applies keep_last retention. A step
// with a missing or unverifiable piece never becomes complete; a commit of a
// newer generation restarts an incomplete step from scratch.
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_REGISTRY_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/checkpoint/checkpoint_manifest.h"
#include "shard_server/checkpoint/checkpoint_paths.h"
#include "shard_server/base/event_log.h"
#include "shard_server/state/state_store.h"

namespace zeroshard {

struct CheckpointRegistryOptions {
  std::string root;   // the checkpoint root directory (created if missing)
  int keep_last = 0;  // complete steps kept per job; 0: all
  // At Open, leftovers of a crash (temporary files, unfinished outputs,
  // empty step directories) last changed this long before now are removed.
  absl::Duration sweep_margin = absl::Seconds(60);
};

class CheckpointRegistry;

// A complete step that retention leaves alone while this object lives.
class PinnedCheckpoint {
 public:
  ~PinnedCheckpoint();
  PinnedCheckpoint(const PinnedCheckpoint&) = delete;
  PinnedCheckpoint& operator=(const PinnedCheckpoint&) = delete;

  const CheckpointManifest& manifest() const { return manifest_; }
  // Output tensor -> XXH64 hex of its F32 bytes once the step was verified
  // (ConsolidationOptions::known_checksums); empty before.
  const std::map<std::string, std::string>& verified_checksums() const { return verified_; }

 private:
  friend class CheckpointRegistry;
  PinnedCheckpoint(CheckpointRegistry* registry, CheckpointManifest manifest,
                   std::map<std::string, std::string> verified)
      : registry_(registry), manifest_(std::move(manifest)), verified_(std::move(verified)) {}

  CheckpointRegistry* const registry_;
  const CheckpointManifest manifest_;
  const std::map<std::string, std::string> verified_;
};

// Thread-safe.
class CheckpointRegistry {
 public:
  // The shard plan of (job, generation); NOT_FOUND if there is none.
  using PlanLookup =
      std::function<absl::StatusOr<v1::ShardPlan>(const std::string& job, int64_t generation)>;

  // `state` and `log` are not owned and must outlive the registry. Creates
  // the tables and completes steps whose last commit was recorded but whose
  // manifest was not (a crash in between).
  static absl::StatusOr<std::unique_ptr<CheckpointRegistry>> Open(CheckpointRegistryOptions options,
                                                                  StateStore* state, EventLog* log,
                                                                  PlanLookup plans);
  // REQUIRES: no PinnedCheckpoint of this registry is alive.
  ~CheckpointRegistry() = default;

  const CheckpointRoot& root() const { return root_; }

  // Called (under no lock of the registry) with every step that becomes
  // complete, and at once with every complete step not yet verified. Once
  // set, retention counts only verified steps: an older step is deleted
  // only after keep_last newer ones were read back and found intact.
  // Without a listener every complete step counts. Set before use.
  using CompletionListener = std::function<void(const std::string& job, int64_t step)>;
  void SetCompletionListener(CompletionListener listener);

  // The outcome of verifying a complete step: the F32 checksums of its
  // output tensors (Consolidator::Verify) are kept for consolidations, and
  // retention runs for the job. REQUIRES: the step is pinned by the caller.
  absl::Status RecordVerified(const std::string& job, int64_t step,
                              const std::map<std::string, std::string>& checksums);
  // The other outcome: the read-back found damage (`error` names the file
  // and tensor). The step is listed with verification "failed" and is
  // skipped when "latest" is asked for; retention never counts it.
  absl::Status RecordVerifyFailed(const std::string& job, int64_t step, const std::string& error);

  // Records a rank's shard file after checking it: the path is exactly
  // "<job>/step-<N>/rank-<R>-of-<W>.safetensors" for the member, stays below
  // the root, the file has the committed size, is a shard of the member's
  // generation's plan holding exactly the rank's pieces (F32, right shapes),
  // and its metadata (job, step, rank, world size, plan hash, checksums)
  // agrees with the request. Completes the step when this was its last rank.
  // INVALID_ARGUMENT for a malformed request, FAILED_PRECONDITION for a file
  // or a step state that does not allow the commit; messages name the value.
  // REQUIRES: the caller fenced request.member() (a live member of its job's
  // current generation) and `world_size` is that job's world size.
  absl::StatusOr<v1::CommitShardResponse> Commit(const v1::CommitShardRequest& request,
                                                 int world_size);

  // A rank that could not save its piece (request.failure() set, e.g. a
  // full disk): abandons the step for every rank. Its committed pieces are
  // removed, the step is listed with CheckpointInfo.failure, and later
  // commits and uploads of it by its generation (or an older one) are
  // refused with ABORTED naming the failure, so no rank waits on it and
  // nothing half-written looks complete. The first failure of a step is
  // kept; reporting it again is answered OK. FAILED_PRECONDITION for a step
  // that is already complete. REQUIRES: as Commit.
  absl::StatusOr<v1::CommitShardResponse> Abandon(const v1::CommitShardRequest& request,
                                                  int world_size);

  // FAILED_PRECONDITION if (job, step) is complete: its files must not change;
  // ABORTED if `writer_generation` or a newer one abandoned it (0: any
  // abandonment counts).
  absl::Status CheckWritable(const std::string& job, int64_t step, int64_t writer_generation = 0);

  // Runs `publish` (the rename that puts a shard file of (job, step) in
  // place) only if `admit` (the writer's fencing: its generation and token)
  // and CheckWritable still pass, all under the registry's lock. A step
  // completes under the same lock, so no step changes after it is complete,
  // and a writer fenced out while it was uploading never replaces a newer
  // generation's file. Returns the first error; `publish` does not run then.
  absl::Status PublishIfWritable(const std::string& job, int64_t step, int64_t writer_generation,
                                 const std::function<absl::Status()>& admit,
                                 const std::function<absl::Status()>& publish);

  // The highest generation any checkpoint step of `job` was written by (0:
  // none). Reads the state store only and never takes the registry's lock,
  // so Membership may ask while holding its own.
  int64_t HighestGeneration(const std::string& job);

  // Every step of `job` (empty: every job), by job then step.
  absl::StatusOr<v1::ListCheckpointsResponse> List(const std::string& job);

  // The manifest of a complete step (`step` -1: the latest complete one),
  // pinned against retention. NOT_FOUND for an unknown step, FAILED_PRECONDITION
  // for an incomplete one.
  absl::StatusOr<std::unique_ptr<PinnedCheckpoint>> Acquire(const std::string& job, int64_t step);

 private:
  friend class PinnedCheckpoint;
  struct StepRow {
    int world_size = 0;
    int64_t generation = 0;
    std::string plan_hash;
    bool complete = false;
  };

  CheckpointRegistry(CheckpointRegistryOptions options, CheckpointRoot root, StateStore* state,
                     EventLog* log, PlanLookup plans)
      : options_(std::move(options)),
        root_(std::move(root)),
        state_(state),
        log_(log),
        plans_(std::move(plans)) {}

  // Commit's parts: the request's own checks (INVALID_ARGUMENT), the plan
  // of the member's generation, then, under the lock, the record.
  static absl::Status CheckCommitRequest(const v1::CommitShardRequest& request, int world_size);
  absl::StatusOr<v1::ShardPlan> PlanOfCommit(const v1::MemberCredentials& member, int world_size);
  absl::StatusOr<v1::CommitShardResponse> RecordCommit(
      const v1::MemberCredentials& member, int64_t step, int world_size, const v1::ShardPlan& plan,
      const CommittedShard& shard, const std::function<absl::Status(const absl::Status&)>& refuse)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The number of commits of the complete step when `shard` is one of them
  // (the same commit again), else 0.
  absl::StatusOr<int> CountOfRepeatedCommit(const std::string& job, int64_t step,
                                            const CommittedShard& shard)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank of a step must save the same optimizer step count: `shard`'s
  // against another rank's commit of the step (FAILED_PRECONDITION when they
  // differ; the store's error when it cannot be read).
  absl::Status CheckSameOptimizerStep(const std::string& job, int64_t step,
                                      const CommittedShard& shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the commit (and the step row when `new_step`, after dropping the
  // abandoned pieces when `restart`) in one transaction; the step's number
  // of commits then.
  absl::StatusOr<int> SaveCommit(const v1::MemberCredentials& member, int64_t step,
                                 const StepRow& step_row, const CommittedShard& shard,
                                 bool new_step, bool restart) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckWritableLocked(const std::string& job, int64_t step, int64_t writer_generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ABORTED naming the failure when `generation` (or a newer one) abandoned
  // (job, step); OK otherwise.
  absl::Status CheckNotAbandoned(const std::string& job, int64_t step, int64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the files of the step's committed pieces (not the directory:
  // other ranks of a shared filesystem may be writing into it).
  void RemoveCommittedFiles(const std::string& job, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::optional<StepRow>> LoadStep(const std::string& job, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<CommittedShard>> LoadCommits(const std::string& job, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the manifest and marks the step complete; then retention (or,
  // with a listener, adds the step to `completed` for it).
  absl::Status CompleteStep(const std::string& job, int64_t step, const StepRow& row,
                            std::vector<std::pair<std::string, int64_t>>* completed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyRetention(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Recover();
  void Unpin(const std::string& job, int64_t step);

  const CheckpointRegistryOptions options_;
  const CheckpointRoot root_;
  StateStore* const state_;
  EventLog* const log_;
  const PlanLookup plans_;

  // Serializes changes to the tables (and the files they describe), so that
  // what a query reads still holds when the transaction that follows writes.
  // Held while calling the state store (whose own mutex comes after it).
  absl::Mutex mu_;
  // (job, step) -> live PinnedCheckpoints: consolidations in progress.
  std::map<std::pair<std::string, int64_t>, int> pins_ ABSL_GUARDED_BY(mu_);
  CompletionListener listener_;  // set once, before use
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_REGISTRY_H_
