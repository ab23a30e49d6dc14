#include "shard_server/checkpoint/checkpoint_registry.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "shard_server/checkpoint/checkpoint_registry_internal.h"

namespace zeroshard {
namespace {

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS checkpoint_steps (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  world_size INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  plan_hash TEXT NOT NULL,
  complete INTEGER NOT NULL,
  manifest TEXT NOT NULL,
  created_unix_ms INTEGER NOT NULL,
  completed_unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS checkpoint_commits (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  file TEXT NOT NULL,
  size_bytes INTEGER NOT NULL,
  checksums TEXT NOT NULL,
  generation INTEGER NOT NULL,
  optimizer TEXT NOT NULL,
  optimizer_step INTEGER NOT NULL,
  committed_unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, step, rank)
);
CREATE TABLE IF NOT EXISTS checkpoint_verified (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  output_checksums TEXT NOT NULL,
  verified_unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS checkpoint_verify_failed (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  error TEXT NOT NULL,
  failed_unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS checkpoint_abandoned (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  message TEXT NOT NULL,
  abandoned_unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, step)
);
)sql";

}  // namespace

namespace checkpoint_registry_internal {

int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }

absl::Status DeleteStepRows(StateStore::Connection& db, const std::string& job, int64_t step,
                            bool commits_only) {
  std::vector<absl::string_view> tables = {"checkpoint_verify_failed", "checkpoint_commits",
                                           "checkpoint_verified"};
  if (!commits_only) tables.push_back("checkpoint_steps");
  for (absl::string_view table : tables) {
    const std::string sql = absl::StrCat("DELETE FROM ", table, " WHERE job_id = ? AND step = ?");
    Statement st = db.Prepare(absl::StrCat("delete from ", table), sql.c_str());
    if (absl::Status s = st.Bind(1, job).Bind(2, step).Run(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace checkpoint_registry_internal

using checkpoint_registry_internal::DeleteStepRows;
using checkpoint_registry_internal::NowUnixMs;

namespace {

// Appends the abandoned steps of `job` (empty: every job) to `response`.
absl::Status ListAbandoned(StateStore::Connection& db, const std::string& job,
                           v1::ListCheckpointsResponse* response) {
  Statement st = db.Prepare("list abandoned checkpoints",
                            "SELECT job_id, step, message, abandoned_unix_ms "
                            "FROM checkpoint_abandoned WHERE ?1 = '' OR job_id = ?1");
  st.Bind(1, job);
  while (st.Next()) {
    v1::CheckpointInfo* info = response->add_checkpoints();
    info->set_job_id(st.Text(0));
    info->set_step(st.Int(1));
    info->set_failure(st.Text(2));
    info->set_created_unix_ms(st.Int(3));
  }
  return st.status();
}

}  // namespace

PinnedCheckpoint::~PinnedCheckpoint() { registry_->Unpin(manifest_.job, manifest_.step); }

absl::StatusOr<std::unique_ptr<CheckpointRegistry>> CheckpointRegistry::Open(
    CheckpointRegistryOptions options, StateStore* state, EventLog* log, PlanLookup plans) {
  if (options.keep_last < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_last is ", options.keep_last, "; expected >= 0 (0 keeps every step)"));
  }
  absl::StatusOr<CheckpointRoot> root = CheckpointRoot::Open(options.root);
  if (!root.ok()) return root.status();
  absl::Status schema = state->Transaction(
      [](StateStore::Connection& db) { return db.Execute("create checkpoint tables", kSchema); });
  if (!schema.ok()) return schema;
  std::unique_ptr<CheckpointRegistry> registry(
      new CheckpointRegistry(std::move(options), *std::move(root), state, log, std::move(plans)));
  if (absl::Status s = registry->Recover(); !s.ok()) return s;
  // What a crash left: temporary files and directories no running process
  // writes any more. Workers on a shared filesystem may be writing shard
  // files right now, so only what was last changed a while before this
  // start goes (the margin also covers clocks of a shared filesystem's
  // server that run a little off).
  const CheckpointRoot::Swept swept =
      registry->root_.SweepLeftovers(absl::Now() - registry->options_.sweep_margin);
  if (swept.files + swept.directories + swept.failed > 0) {
    log->Log("checkpoint_leftovers_removed", {{"files", absl::StrCat(swept.files)},
                                              {"directories", absl::StrCat(swept.directories)},
                                              {"failed", absl::StrCat(swept.failed)}});
  }
  return registry;
}

absl::Status CheckpointRegistry::Recover() {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, int64_t>> pending;
  absl::Status found = state_->Read([&](StateStore::Connection& db) {
    Statement st =
        db.Prepare("find checkpoint steps to recover",
                   "SELECT s.job_id, s.step FROM checkpoint_steps s WHERE s.complete = 0 AND "
                   "s.world_size = (SELECT COUNT(*) FROM checkpoint_commits c "
                   "WHERE c.job_id = s.job_id AND c.step = s.step)");
    while (st.Next()) pending.emplace_back(st.Text(0), st.Int(1));
    return st.status();
  });
  if (!found.ok()) return found;
  for (const auto& [job, step] : pending) {
    absl::StatusOr<std::optional<StepRow>> row = LoadStep(job, step);
    if (!row.ok()) return row.status();
    absl::Status s = CompleteStep(job, step, **row, nullptr);
    log_->Log("checkpoint_recovered", {{"job", job},
                                       {"step", absl::StrCat(step)},
                                       {"result", s.ok() ? "complete" : s.ToString()}});
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<CheckpointRegistry::StepRow>> CheckpointRegistry::LoadStep(
    const std::string& job, int64_t step) {
  std::optional<StepRow> row;
  absl::Status status = state_->Read([&](StateStore::Connection& db) {
    Statement st = db.Prepare("load checkpoint step",
                              "SELECT world_size, generation, plan_hash, complete "
                              "FROM checkpoint_steps WHERE job_id = ? AND step = ?");
    st.Bind(1, job).Bind(2, step);
    if (st.Next()) {
      row.emplace();
      row->world_size = static_cast<int>(st.Int(0));
      row->generation = st.Int(1);
      row->plan_hash = st.Text(2);
      row->complete = st.Int(3) != 0;
    }
    return st.status();
  });
  if (!status.ok()) return status;
  return row;
}

absl::StatusOr<std::vector<CommittedShard>> CheckpointRegistry::LoadCommits(const std::string& job,
                                                                            int64_t step) {
  std::vector<CommittedShard> commits;
  absl::Status status = state_->Read([&](StateStore::Connection& db) -> absl::Status {
    Statement st = db.Prepare("load checkpoint commits",
                              "SELECT rank, file, size_bytes, checksums, optimizer, "
                              "optimizer_step FROM checkpoint_commits "
                              "WHERE job_id = ? AND step = ? ORDER BY rank");
    st.Bind(1, job).Bind(2, step);
    while (st.Next()) {
      CommittedShard c;
      c.rank = static_cast<int>(st.Int(0));
      c.file = st.Text(1);
      c.size_bytes = st.Int(2);
      if (!ChecksumsFromJson(st.Text(3), &c.checksums)) {
        return absl::DataLossError(absl::StrCat("checkpoint registry: checksums of job '", job,
                                                "' step ", step, " rank ", c.rank, " are corrupt"));
      }
      c.optimizer = st.Text(4);
      c.optimizer_step = st.Int(5);
      commits.push_back(std::move(c));
    }
    return st.status();
  });
  if (!status.ok()) return status;
  return commits;
}

void CheckpointRegistry::SetCompletionListener(CompletionListener listener) {
  listener_ = std::move(listener);
  // Complete steps that were never verified (the server stopped first).
  std::vector<std::pair<std::string, int64_t>> pending;
  absl::Status found;
  {
    absl::MutexLock lock(&mu_);
    found = state_->Read([&](StateStore::Connection& db) {
      Statement st = db.Prepare(
          "find unverified checkpoint steps",
          "SELECT s.job_id, s.step FROM checkpoint_steps s LEFT JOIN checkpoint_verified v "
          "ON v.job_id = s.job_id AND v.step = s.step "
          "WHERE s.complete = 1 AND v.step IS NULL ORDER BY s.job_id, s.step");
      while (st.Next()) pending.emplace_back(st.Text(0), st.Int(1));
      return st.status();
    });
  }
  if (!found.ok()) {
    // Those found before the error are still verified; the rest wait for
    // the next start.
    log_->Log("checkpoint_registry_error", {{"error", found.ToString()}});
  }
  for (const auto& [job, step] : pending) listener_(job, step);
}

absl::Status CheckpointRegistry::RecordVerified(
    const std::string& job, int64_t step, const std::map<std::string, std::string>& checksums) {
  absl::MutexLock lock(&mu_);
  absl::Status saved = state_->Transaction([&](StateStore::Connection& db) {
    Statement st = db.Prepare("save checkpoint verification",
                              "INSERT OR REPLACE INTO checkpoint_verified(job_id, step, "
                              "output_checksums, verified_unix_ms) VALUES (?, ?, ?, ?)");
    st.Bind(1, job).Bind(2, step).Bind(3, ChecksumsToJson(checksums)).Bind(4, NowUnixMs());
    return st.Run();
  });
  if (!saved.ok()) return saved;
  return ApplyRetention(job);
}

absl::Status CheckpointRegistry::RecordVerifyFailed(const std::string& job, int64_t step,
                                                    const std::string& error) {
  absl::MutexLock lock(&mu_);
  return state_->Transaction([&](StateStore::Connection& db) {
    Statement st = db.Prepare("save failed checkpoint verification",
                              "INSERT OR REPLACE INTO checkpoint_verify_failed(job_id, step, "
                              "error, failed_unix_ms) VALUES (?, ?, ?, ?)");
    return st.Bind(1, job).Bind(2, step).Bind(3, error).Bind(4, NowUnixMs()).Run();
  });
}

absl::Status CheckpointRegistry::ApplyRetention(const std::string& job) {
  if (options_.keep_last <= 0) return absl::OkStatus();
  std::vector<std::pair<int64_t, bool>> complete;  // (step, verified), newest first
  absl::Status found = state_->Read([&](StateStore::Connection& db) {
    Statement st =
        db.Prepare("list complete checkpoint steps",
                   "SELECT s.step, v.step IS NOT NULL FROM checkpoint_steps s "
                   "LEFT JOIN checkpoint_verified v ON v.job_id = s.job_id AND v.step = s.step "
                   "WHERE s.job_id = ? AND s.complete = 1 ORDER BY s.step DESC");
    st.Bind(1, job);
    while (st.Next()) complete.emplace_back(st.Int(0), st.Int(1) != 0);
    return st.status();
  });
  if (!found.ok()) return found;
  // Only complete steps older than the newest keep_last complete (and, with
  // verification, verified) ones go: never the latest complete step
  // (keep_last >= 1), never an incomplete step (which may still be being
  // written), never anything newer than what was verified.
  size_t first_deleted = complete.size();
  int kept = 0;
  for (size_t i = 0; i < complete.size(); ++i) {
    if (complete[i].second || !listener_) ++kept;
    if (kept == options_.keep_last) {
      first_deleted = i + 1;
      break;
    }
  }
  for (size_t i = first_deleted; i < complete.size(); ++i) {
    const int64_t step = complete[i].first;
    if (pins_.count({job, step}) > 0) {
      log_->Log("checkpoint_retention_deferred",
                {{"job", job}, {"step", absl::StrCat(step)}, {"reason", "being consolidated"}});
      continue;
    }
    const std::string dir = CheckpointStepDir(job, step);
    // The manifest goes first, so that a crash part-way never leaves a
    // directory that looks complete with pieces missing.
    const std::string manifest = root_.Join(absl::StrCat(dir, "/", kManifestFileName));
    if (unlink(manifest.c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus(errno, "cannot remove", manifest);
    }
    absl::Status deleted = state_->Transaction([&](StateStore::Connection& db) {
      return DeleteStepRows(db, job, step, /*commits_only=*/false);
    });
    if (!deleted.ok()) return deleted;
    absl::Status removed = root_.RemoveDir(dir);
    log_->Log("checkpoint_deleted", {{"job", job},
                                     {"step", absl::StrCat(step)},
                                     {"reason", absl::StrCat("keep_last=", options_.keep_last)},
                                     {"files", removed.ok() ? "removed" : removed.ToString()}});
  }
  return absl::OkStatus();
}

int64_t CheckpointRegistry::HighestGeneration(const std::string& job) {
  int64_t highest = 0;
  absl::Status s = state_->Read([&](StateStore::Connection& db) -> absl::Status {
    Statement st = db.Prepare("highest checkpoint generation",
                              "SELECT COALESCE(MAX(generation), 0) FROM checkpoint_steps "
                              "WHERE job_id = ?");
    st.Bind(1, job);
    if (st.Next()) highest = st.Int(0);
    return st.status();
  });
  if (!s.ok()) log_->Log("checkpoint_registry_error", {{"job", job}, {"error", s.ToString()}});
  return highest;
}

absl::Status CheckpointRegistry::CheckWritable(const std::string& job, int64_t step,
                                               int64_t writer_generation) {
  absl::MutexLock lock(&mu_);
  return CheckWritableLocked(job, step, writer_generation);
}

absl::Status CheckpointRegistry::PublishIfWritable(const std::string& job, int64_t step,
                                                   int64_t writer_generation,
                                                   const std::function<absl::Status()>& admit,
                                                   const std::function<absl::Status()>& publish) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = admit(); !s.ok()) return s;
  if (absl::Status s = CheckWritableLocked(job, step, writer_generation); !s.ok()) return s;
  return publish();
}

absl::Status CheckpointRegistry::CheckWritableLocked(const std::string& job, int64_t step,
                                                     int64_t writer_generation) {
  absl::StatusOr<std::optional<StepRow>> row = LoadStep(job, step);
  if (!row.ok()) return row.status();
  if (row->has_value() && (*row)->complete) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " of job '", job,
                                                      "' is already complete; a complete "
                                                      "checkpoint's files must not change"));
  }
  // An upload of an abandoned step would leave a file no commit ever claims.
  return CheckNotAbandoned(job, step, writer_generation);
}

absl::Status CheckpointRegistry::CheckNotAbandoned(const std::string& job, int64_t step,
                                                   int64_t generation) {
  std::string message;
  absl::Status read = state_->Read([&](StateStore::Connection& db) {
    Statement st = db.Prepare("find checkpoint abandonment",
                              "SELECT message FROM checkpoint_abandoned "
                              "WHERE job_id = ? AND step = ? AND generation >= ?");
    st.Bind(1, job).Bind(2, step).Bind(3, generation);
    if (st.Next()) message = st.Text(0);
    return st.status();
  });
  if (!read.ok()) return read;
  if (message.empty()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("step ", step, " of job '", job, "' was abandoned (",
                                         message, "); nothing of it is kept"));
}

absl::StatusOr<v1::CommitShardResponse> CheckpointRegistry::Abandon(
    const v1::CommitShardRequest& request, int world_size) {
  const v1::MemberCredentials& member = request.member();
  const std::string& job = member.job_id();
  const int64_t step = request.step();
  if (absl::Status s = ValidateJobId(job); !s.ok()) return s;
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
  if (request.retry_step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("retry_step ", request.retry_step(),
                                                   " is negative; expected 0 (none) or a step"));
  }
  // Bounded like any other text the server keeps and shows.
  constexpr size_t kMaxFailureBytes = 1024;
  const std::string failure = request.failure().substr(0, kMaxFailureBytes);
  const std::string message = absl::StrCat(
      "checkpoint step ", step, " failed on rank ", member.rank(), ": ", failure,
      request.retry_step() > 0 ? absl::StrCat("; retrying at step ", request.retry_step())
                               : std::string("; no later checkpoint is scheduled"));
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::optional<StepRow>> row = LoadStep(job, step);
  if (!row.ok()) return row.status();
  if (row->has_value() && (*row)->complete) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " of job '", job, "' is already complete; it cannot be abandoned"));
  }
  if (row->has_value() && (*row)->generation > member.generation()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " of job '", job, "' is being written by generation ",
                     (*row)->generation, "; this member is of generation ", member.generation()));
  }
  v1::CommitShardResponse response;
  if (!CheckNotAbandoned(job, step, member.generation()).ok()) return response;  // known
  RemoveCommittedFiles(job, step);
  absl::Status saved = state_->Transaction([&](StateStore::Connection& db) -> absl::Status {
    if (absl::Status s = DeleteStepRows(db, job, step, /*commits_only=*/false); !s.ok()) return s;
    Statement st = db.Prepare("save checkpoint abandonment",
                              "INSERT OR REPLACE INTO checkpoint_abandoned(job_id, step, "
                              "generation, rank, message, abandoned_unix_ms) "
                              "VALUES (?, ?, ?, ?, ?, ?)");
    st.Bind(1, job).Bind(2, step).Bind(3, member.generation()).Bind(4, member.rank());
    if (absl::Status s = st.Bind(5, message).Bind(6, NowUnixMs()).Run(); !s.ok()) return s;
    // What status shows is the latest failures; older ones stay in the
    // event log only, so a disk full for days keeps this table small.
    Statement prune = db.Prepare("prune checkpoint abandonments",
                                 "DELETE FROM checkpoint_abandoned WHERE job_id = ?1 AND step NOT "
                                 "IN (SELECT step FROM checkpoint_abandoned WHERE job_id = ?1 "
                                 "ORDER BY step DESC LIMIT 8)");
    return prune.Bind(1, job).Run();
  });
  // Logged also when it could not be saved (a full state disk): the log is
  // then the only place that says why the checkpoints stopped.
  log_->Log("checkpoint_step_failed", {{"job", job},
                                       {"step", absl::StrCat(step)},
                                       {"rank", absl::StrCat(member.rank())},
                                       {"world_size", absl::StrCat(world_size)},
                                       {"retry_step", absl::StrCat(request.retry_step())},
                                       {"message", message},
                                       {"saved", saved.ok() ? "yes" : saved.ToString()}});
  if (!saved.ok()) return saved;
  return response;
}

void CheckpointRegistry::RemoveCommittedFiles(const std::string& job, int64_t step) {
  absl::StatusOr<std::vector<CommittedShard>> commits = LoadCommits(job, step);
  if (!commits.ok()) {
    log_->Log("checkpoint_registry_error", {{"job", job}, {"error", commits.status().ToString()}});
    return;
  }
  for (const CommittedShard& c : *commits) {
    const std::string path = root_.Join(c.file);
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      log_->Log("checkpoint_registry_error",
                {{"job", job}, {"error", ErrnoStatus(errno, "cannot remove", path).ToString()}});
    }
  }
}

absl::StatusOr<v1::ListCheckpointsResponse> CheckpointRegistry::List(const std::string& job) {
  if (!job.empty()) {
    if (absl::Status s = ValidateJobId(job); !s.ok()) return s;
  }
  v1::ListCheckpointsResponse response;
  absl::MutexLock lock(&mu_);
  absl::Status status = state_->Read([&](StateStore::Connection& db) {
    Statement st = db.Prepare(
        "list checkpoints",
        "SELECT s.job_id, s.step, s.world_size, s.complete, s.plan_hash, s.created_unix_ms, "
        "s.completed_unix_ms, COUNT(c.rank), COALESCE(SUM(c.size_bytes), 0), "
        "(SELECT COUNT(*) FROM checkpoint_verified v "
        " WHERE v.job_id = s.job_id AND v.step = s.step), "
        "(SELECT f.error FROM checkpoint_verify_failed f "
        " WHERE f.job_id = s.job_id AND f.step = s.step) "
        "FROM checkpoint_steps s LEFT JOIN checkpoint_commits c "
        "ON c.job_id = s.job_id AND c.step = s.step "
        "WHERE ?1 = '' OR s.job_id = ?1 "
        "GROUP BY s.job_id, s.step ORDER BY s.job_id, s.step");
    st.Bind(1, job);
    while (st.Next()) {
      v1::CheckpointInfo* info = response.add_checkpoints();
      info->set_job_id(st.Text(0));
      info->set_step(st.Int(1));
      info->set_world_size(static_cast<int>(st.Int(2)));
      info->set_complete(st.Int(3) != 0);
      info->set_plan_hash(st.Text(4));
      // A complete step dates from its manifest; an incomplete one from its
      // first commit.
      info->set_created_unix_ms(info->complete() ? st.Int(6) : st.Int(5));
      info->set_committed(static_cast<int>(st.Int(7)));
      info->set_total_bytes(st.Int(8));
      if (info->complete()) {
        info->set_manifest(CheckpointManifestPath(info->job_id(), info->step()));
        const std::string error = st.Text(10);
        if (!error.empty()) {
          info->set_verification("failed");
          info->set_verification_error(error);
        } else {
          info->set_verification(st.Int(9) > 0 ? "verified" : "pending");
        }
      }
    }
    if (!st.status().ok()) return st.status();
    return ListAbandoned(db, job, &response);
  });
  if (!status.ok()) return status;
  // By job, then step, whichever table a step came from.
  std::stable_sort(response.mutable_checkpoints()->begin(), response.mutable_checkpoints()->end(),
                   [](const v1::CheckpointInfo& a, const v1::CheckpointInfo& b) {
                     return std::forward_as_tuple(a.job_id(), a.step()) <
                            std::forward_as_tuple(b.job_id(), b.step());
                   });
  return response;
}

absl::StatusOr<std::unique_ptr<PinnedCheckpoint>> CheckpointRegistry::Acquire(
    const std::string& job, int64_t step) {
  if (absl::Status s = ValidateJobId(job); !s.ok()) return s;
  if (step < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step, " is not a step; expected N >= 0 or -1 (latest)"));
  }
  absl::MutexLock lock(&mu_);
  std::optional<CheckpointManifest> manifest;
  std::map<std::string, std::string> verified;
  absl::Status found = state_->Read([&](StateStore::Connection& db) -> absl::Status {
    if (step == -1) {
      Statement latest =
          db.Prepare("find the latest checkpoint",
                     "SELECT MAX(step) FROM checkpoint_steps s WHERE job_id = ? AND complete = 1 "
                     "AND NOT EXISTS (SELECT 1 FROM checkpoint_verify_failed f "
                     "WHERE f.job_id = s.job_id AND f.step = s.step)");
      latest.Bind(1, job);
      if (!latest.Next() || latest.IsNull(0)) {
        if (!latest.status().ok()) return latest.status();
        return absl::NotFoundError(
            absl::StrCat("job '", job, "' has no complete checkpoint on this server"));
      }
      step = latest.Int(0);
    }
    Statement st =
        db.Prepare("load checkpoint manifest",
                   "SELECT s.complete, s.manifest, s.world_size, "
                   "(SELECT COUNT(*) FROM checkpoint_commits c WHERE c.job_id = s.job_id AND "
                   "c.step = s.step) FROM checkpoint_steps s WHERE s.job_id = ? AND s.step = ?");
    st.Bind(1, job).Bind(2, step);
    if (!st.Next()) {
      if (!st.status().ok()) return st.status();
      return absl::NotFoundError(absl::StrCat("job '", job, "' has no checkpoint at step ", step,
                                              " (shardctl checkpoints --job=", job,
                                              " lists them)"));
    }
    if (st.Int(0) == 0) {
      return absl::FailedPreconditionError(absl::StrCat("step ", step, " of job '", job,
                                                        "' is not complete: ", st.Int(3), " of ",
                                                        st.Int(2), " ranks committed"));
    }
    absl::StatusOr<CheckpointManifest> parsed = ParseManifestJson(st.Text(1));
    if (!parsed.ok()) return parsed.status();
    manifest = *std::move(parsed);
    Statement v = db.Prepare(
        "load checkpoint verification",
        "SELECT output_checksums FROM checkpoint_verified WHERE job_id = ? AND step = ?");
    v.Bind(1, job).Bind(2, step);
    if (v.Next() && !ChecksumsFromJson(v.Text(0), &verified)) verified.clear();
    return v.status();
  });
  if (!found.ok()) return found;
  ++pins_[{job, step}];
  return std::unique_ptr<PinnedCheckpoint>(
      new PinnedCheckpoint(this, *std::move(manifest), std::move(verified)));
}

void CheckpointRegistry::Unpin(const std::string& job, int64_t step) {
  absl::MutexLock lock(&mu_);
  auto it = pins_.find({job, step});
  if (it == pins_.end()) return;
  if (--it->second > 0) return;
  pins_.erase(it);
  // Deletions deferred while the step was being consolidated happen now.
  if (absl::Status s = ApplyRetention(job); !s.ok()) {
    log_->Log("checkpoint_retention_failed", {{"job", job}, {"error", s.ToString()}});
  }
}

}  // namespace zeroshard
