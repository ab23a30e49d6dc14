// CheckpointRegistry's commit path: a rank's shard committed (checked against
// its plan and the step's other commits, recorded), and a step completed once
// every rank's shard is in. The rest of the registry is in
// checkpoint_registry.cc.
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "shard_server/checkpoint/checkpoint_registry.h"
#include "shard_server/checkpoint/checkpoint_registry_internal.h"
#include "shard_server/checkpoint/shard_file_validator.h"

namespace zeroshard {

using checkpoint_registry_internal::DeleteStepRows;
using checkpoint_registry_internal::NowUnixMs;

absl::StatusOr<v1::CommitShardResponse> CheckpointRegistry::Commit(
    const v1::CommitShardRequest& request, int world_size) {
  auto refuse = [&](const absl::Status& s) {
    log_->Log("checkpoint_commit_refused", {{"job", request.member().job_id()},
                                            {"step", absl::StrCat(request.step())},
                                            {"rank", absl::StrCat(request.member().rank())},
                                            {"file", request.file()},
                                            {"error", s.ToString()}});
    return s;
  };
  if (!request.failure().empty()) return Abandon(request, world_size);
  if (absl::Status s = CheckCommitRequest(request, world_size); !s.ok()) return refuse(s);
  absl::StatusOr<v1::ShardPlan> plan = PlanOfCommit(request.member(), world_size);
  if (!plan.ok()) return refuse(plan.status());
  // No lock held: this reads the file's header.
  absl::StatusOr<CommittedShard> shard = ValidateShardFile(root_, request, world_size, *plan);
  if (!shard.ok()) return refuse(shard.status());
  return RecordCommit(request.member(), request.step(), world_size, *plan, *shard, refuse);
}

absl::Status CheckpointRegistry::CheckCommitRequest(const v1::CommitShardRequest& request,
                                                    int world_size) {
  const v1::MemberCredentials& member = request.member();
  const int64_t step = request.step();
  if (absl::Status s = ValidateJobId(member.job_id()); !s.ok()) return s;
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
  if (absl::Status s = ValidateRelativePath(request.file()); !s.ok()) return s;
  const std::string expected_file =
      CheckpointShardPath(member.job_id(), step, member.rank(), world_size);
  if (request.file() != expected_file) {
    return absl::InvalidArgumentError(
        absl::StrCat("file '", request.file(), "' is not the shard file of rank ", member.rank(),
                     " of ", world_size, " for step ", step, "; expected '", expected_file, "'"));
  }
  if (request.size_bytes() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("size_bytes ", request.size_bytes(), " of '",
                                                   request.file(), "' is not positive"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ShardPlan> CheckpointRegistry::PlanOfCommit(const v1::MemberCredentials& member,
                                                               int world_size) {
  const std::string& job = member.job_id();
  absl::StatusOr<v1::ShardPlan> plan = plans_(job, member.generation());
  if (!plan.ok()) {
    if (!absl::IsNotFound(plan.status())) return plan.status();
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job, "' generation ", member.generation(),
                     " has no shard plan; call PlanShards before committing checkpoints"));
  }
  if (plan->world_size() != world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plan of job '", job, "' generation ", member.generation(), " is for ",
                     plan->world_size(), " ranks; the job has ", world_size));
  }
  return plan;
}

absl::StatusOr<v1::CommitShardResponse> CheckpointRegistry::RecordCommit(
    const v1::MemberCredentials& member, int64_t step, int world_size, const v1::ShardPlan& plan,
    const CommittedShard& shard, const std::function<absl::Status(const absl::Status&)>& refuse) {
  const std::string& job = member.job_id();
  const int rank = member.rank();
  absl::ReleasableMutexLock lock(&mu_);
  absl::StatusOr<std::optional<StepRow>> row = LoadStep(job, step);
  if (!row.ok()) return row.status();
  v1::CommitShardResponse response;
  if (row->has_value() && (*row)->complete) {
    absl::StatusOr<int> again = CountOfRepeatedCommit(job, step, shard);
    if (!again.ok()) return again.status();
    if (*again == 0) {
      return refuse(absl::FailedPreconditionError(
          absl::StrCat("step ", step, " of job '", job,
                       "' is already complete; a complete "
                       "checkpoint's files must not change (save under a new step)")));
    }
    // The same commit again (its answer was lost): nothing changes.
    response.set_committed(*again);
    return response;
  }
  if (absl::Status s = CheckNotAbandoned(job, step, member.generation()); !s.ok()) {
    return refuse(s);
  }
  bool new_step = !row->has_value();
  // A newer generation saves this step again: the old pieces are abandoned
  // (in the transaction that records this commit).
  bool restart = false;
  if (row->has_value() && ((*row)->generation != member.generation() ||
                           (*row)->world_size != world_size || (*row)->plan_hash != plan.hash())) {
    if ((*row)->generation > member.generation()) {
      return refuse(absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " of job '", job, "' is being written by generation ", (*row)->generation,
          "; this member is of generation ", member.generation())));
    }
    restart = true;
    new_step = true;
  }
  if (!new_step) {
    if (absl::Status s = CheckSameOptimizerStep(job, step, shard); !s.ok()) {
      return s.code() == absl::StatusCode::kFailedPrecondition ? refuse(s) : s;
    }
  }
  const StepRow step_row{world_size, member.generation(), plan.hash(), false};
  absl::StatusOr<int> committed = SaveCommit(member, step, step_row, shard, new_step, restart);
  // Not saved (the state store's disk is full, or it is away): said, as a
  // refusal is, or the operator sees checkpoints stop with no reason.
  if (!committed.ok()) return refuse(committed.status());
  if (restart) {
    log_->Log("checkpoint_step_restarted", {{"job", job},
                                            {"step", absl::StrCat(step)},
                                            {"old_generation", absl::StrCat((*row)->generation)},
                                            {"generation", absl::StrCat(member.generation())}});
  }
  log_->Log("checkpoint_commit", {{"job", job},
                                  {"step", absl::StrCat(step)},
                                  {"rank", absl::StrCat(rank)},
                                  {"file", shard.file},
                                  {"bytes", absl::StrCat(shard.size_bytes)},
                                  {"tensors", absl::StrCat(shard.checksums.size())},
                                  {"committed", absl::StrCat(*committed, "/", world_size)}});
  response.set_committed(*committed);
  if (*committed == world_size) {
    std::vector<std::pair<std::string, int64_t>> completed;
    if (absl::Status s = CompleteStep(job, step, step_row, &completed); !s.ok()) return s;
    response.set_step_complete(true);
    lock.Release();
    for (const auto& [j, n] : completed) listener_(j, n);
  }
  return response;
}

absl::StatusOr<int> CheckpointRegistry::CountOfRepeatedCommit(const std::string& job, int64_t step,
                                                              const CommittedShard& shard) {
  absl::StatusOr<std::vector<CommittedShard>> commits = LoadCommits(job, step);
  if (!commits.ok()) return commits.status();
  for (const CommittedShard& c : *commits) {
    if (c.rank == shard.rank && c.file == shard.file && c.size_bytes == shard.size_bytes &&
        c.checksums == shard.checksums) {
      return static_cast<int>(commits->size());
    }
  }
  return 0;
}

absl::Status CheckpointRegistry::CheckSameOptimizerStep(const std::string& job, int64_t step,
                                                        const CommittedShard& shard) {
  // Every row of the step passed this check when it was saved, so they all
  // hold one optimizer step: one other rank's row says it. One indexed row,
  // not the step's W rows (a job of 131,072 ranks commits W times a step).
  return state_->Read([&](StateStore::Connection& db) -> absl::Status {
    Statement st = db.Prepare("load another rank's optimizer step",
                              "SELECT rank, optimizer_step FROM checkpoint_commits "
                              "WHERE job_id = ? AND step = ? AND rank != ? LIMIT 1");
    st.Bind(1, job).Bind(2, step).Bind(3, shard.rank);
    if (st.Next() && st.Int(1) != shard.optimizer_step) {
      return absl::FailedPreconditionError(
          absl::StrCat("'", shard.file, "' has optimizer_step ", shard.optimizer_step, "; rank ",
                       st.Int(0), " committed ", st.Int(1), " for the same step"));
    }
    return st.status();
  });
}

absl::StatusOr<int> CheckpointRegistry::SaveCommit(const v1::MemberCredentials& member,
                                                   int64_t step, const StepRow& step_row,
                                                   const CommittedShard& shard, bool new_step,
                                                   bool restart) {
  const std::string& job = member.job_id();
  const int64_t now = NowUnixMs();
  int committed = 0;
  absl::Status saved = state_->Transaction([&](StateStore::Connection& db) -> absl::Status {
    if (restart) {
      if (absl::Status s = DeleteStepRows(db, job, step, /*commits_only=*/true); !s.ok()) {
        return s;
      }
    }
    if (new_step) {
      // A newer generation saves an abandoned step again: it starts clean.
      Statement forget = db.Prepare("forget older checkpoint abandonment",
                                    "DELETE FROM checkpoint_abandoned WHERE job_id = ? AND "
                                    "step = ? AND generation < ?");
      forget.Bind(1, job).Bind(2, step).Bind(3, member.generation());
      if (absl::Status s = forget.Run(); !s.ok()) return s;
      Statement st = db.Prepare(
          "save checkpoint step",
          "INSERT OR REPLACE INTO checkpoint_steps(job_id, step, world_size, generation, "
          "plan_hash, complete, manifest, created_unix_ms, completed_unix_ms) "
          "VALUES (?, ?, ?, ?, ?, 0, '', ?, 0)");
      st.Bind(1, job).Bind(2, step).Bind(3, step_row.world_size).Bind(4, member.generation());
      st.Bind(5, step_row.plan_hash).Bind(6, now);
      if (absl::Status s = st.Run(); !s.ok()) return s;
    }
    Statement save = db.Prepare(
        "save checkpoint commit",
        "INSERT OR REPLACE INTO checkpoint_commits(job_id, step, rank, file, size_bytes, "
        "checksums, generation, optimizer, optimizer_step, committed_unix_ms) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
    save.Bind(1, job).Bind(2, step).Bind(3, shard.rank).Bind(4, shard.file);
    save.Bind(5, shard.size_bytes).Bind(6, ChecksumsToJson(shard.checksums));
    save.Bind(7, member.generation()).Bind(8, shard.optimizer).Bind(9, shard.optimizer_step);
    save.Bind(10, now);
    if (absl::Status s = save.Run(); !s.ok()) return s;
    Statement count =
        db.Prepare("count checkpoint commits",
                   "SELECT COUNT(*) FROM checkpoint_commits WHERE job_id = ? AND step = ?");
    count.Bind(1, job).Bind(2, step);
    if (count.Next()) committed = static_cast<int>(count.Int(0));
    return count.status();
  });
  if (!saved.ok()) return saved;
  return committed;
}

absl::Status CheckpointRegistry::CompleteStep(
    const std::string& job, int64_t step, const StepRow& row,
    std::vector<std::pair<std::string, int64_t>>* completed) {
  absl::StatusOr<std::vector<CommittedShard>> commits = LoadCommits(job, step);
  if (!commits.ok()) return commits.status();
  absl::StatusOr<v1::ShardPlan> plan = plans_(job, row.generation);
  if (!plan.ok()) return plan.status();
  const int64_t now = NowUnixMs();
  absl::StatusOr<CheckpointManifest> manifest =
      BuildManifest(job, step, row.generation, *plan, *commits, now);
  if (!manifest.ok()) return manifest.status();
  const std::string json = ManifestToJson(*manifest);
  const std::string relative = CheckpointManifestPath(job, step);
  if (absl::Status s = root_.MakeDirs(CheckpointStepDir(job, step)); !s.ok()) return s;
  // The manifest on disk is written before the registry marks the step
  // complete: a crash in between leaves a step that Recover() completes
  // again, never a "complete" step without its manifest.
  if (absl::Status s = WriteFileAtomically(root_.Join(relative), json); !s.ok()) return s;
  absl::Status marked = state_->Transaction([&](StateStore::Connection& db) {
    Statement st =
        db.Prepare("mark checkpoint step complete",
                   "UPDATE checkpoint_steps SET complete = 1, manifest = ?, completed_unix_ms = ? "
                   "WHERE job_id = ? AND step = ?");
    return st.Bind(1, json).Bind(2, now).Bind(3, job).Bind(4, step).Run();
  });
  if (!marked.ok()) return marked;
  log_->Log("checkpoint_complete", {{"job", job},
                                    {"step", absl::StrCat(step)},
                                    {"world_size", absl::StrCat(manifest->world_size)},
                                    {"tensors", absl::StrCat(manifest->tensors.size())},
                                    {"bytes", absl::StrCat(manifest->TotalBytes())},
                                    {"optimizer_state", manifest->has_exp_avg ? "yes" : "no"},
                                    {"manifest", relative}});
  if (listener_) {
    if (completed != nullptr) completed->emplace_back(job, step);
    return absl::OkStatus();  // retention follows the verification
  }
  if (absl::Status s = ApplyRetention(job); !s.ok()) {
    log_->Log("checkpoint_retention_failed", {{"job", job}, {"error", s.ToString()}});
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
