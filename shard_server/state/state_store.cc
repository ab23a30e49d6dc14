#include "shard_server/state/state_store.h"

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY,
  world_size INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  members_generation INTEGER NOT NULL,
  state INTEGER NOT NULL,
  target_world_size INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS members (
  job_id TEXT NOT NULL,
  rank INTEGER NOT NULL,
  worker_id TEXT NOT NULL,
  host TEXT NOT NULL,
  token TEXT NOT NULL,
  left_job INTEGER NOT NULL,
  dead INTEGER NOT NULL,
  node TEXT NOT NULL DEFAULT '',
  step INTEGER NOT NULL DEFAULT 0,
  loss REAL NOT NULL DEFAULT 0,
  last_step BLOB NOT NULL DEFAULT x'',
  PRIMARY KEY (job_id, rank)
);
CREATE TABLE IF NOT EXISTS fenced_hosts (
  job_id TEXT NOT NULL,
  node TEXT NOT NULL,
  reason TEXT NOT NULL,
  rank INTEGER NOT NULL,
  step INTEGER NOT NULL,
  unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, node)
);
CREATE TABLE IF NOT EXISTS generation_history (
  job_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  unix_ms INTEGER NOT NULL,
  reason TEXT NOT NULL,
  PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS goodput (
  job_id TEXT PRIMARY KEY,
  state BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS plans (
  job_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  spec_hash TEXT NOT NULL,
  plan BLOB NOT NULL,
  PRIMARY KEY (job_id, generation)
);
)sql";

// A database from before jobs.target_world_size: the column is added (0:
// the job's world size, which it was before a shrink could happen).
// The same for members.node (''; the fence of a member without one falls
// back to its host: Membership::EvictHost) and members.step, members.loss
// (0: status shows step 0 for a member that ended before they were kept).
absl::Status AddColumnIfMissing(StateStore::Connection& db, const std::string& table,
                                const std::string& column, const std::string& definition) {
  const std::string read = absl::StrCat("SELECT name FROM pragma_table_info('", table, "')");
  Statement columns = db.Prepare(absl::StrCat("read the ", table, " columns"), read.c_str());
  bool has = false;
  while (columns.Next()) has = has || columns.Text(0) == column;
  if (!columns.status().ok()) return columns.status();
  if (has) return absl::OkStatus();
  const std::string add =
      absl::StrCat("ALTER TABLE ", table, " ADD COLUMN ", column, " ", definition, ";");
  return db.Execute(absl::StrCat("add ", table, ".", column), add.c_str());
}

// A job's fences as given: rows that differ are written, those gone deleted
// (a job has a few at most; nothing is written while they stay the same).
absl::Status SaveFences(StateStore::Connection& db, const StoredJob& job) {
  Statement existing =
      db.Prepare("save job fences", "SELECT node FROM fenced_hosts WHERE job_id = ?");
  existing.Bind(1, job.job_id);
  std::vector<std::string> gone;
  while (existing.Next()) {
    const std::string node = existing.Text(0);
    bool kept = false;
    for (const StoredFence& f : job.fences) kept = kept || f.node == node;
    if (!kept) gone.push_back(node);
  }
  if (!existing.status().ok()) return existing.status();
  Statement remove =
      db.Prepare("save job fences", "DELETE FROM fenced_hosts WHERE job_id = ? AND node = ?");
  for (const std::string& node : gone) {
    remove.Reset();
    if (absl::Status s = remove.Bind(1, job.job_id).Bind(2, node).Run(); !s.ok()) return s;
  }
  Statement upsert = db.Prepare(
      "save job fences",
      "INSERT INTO fenced_hosts(job_id, node, reason, rank, step, unix_ms) VALUES (?, ?, ?, ?, "
      "?, ?) ON CONFLICT(job_id, node) DO UPDATE SET reason = excluded.reason, rank = "
      "excluded.rank, step = excluded.step, unix_ms = excluded.unix_ms WHERE reason IS NOT "
      "excluded.reason OR rank IS NOT excluded.rank OR step IS NOT excluded.step OR unix_ms IS "
      "NOT excluded.unix_ms");
  for (const StoredFence& f : job.fences) {
    upsert.Reset();
    upsert.Bind(1, job.job_id).Bind(2, f.node).Bind(3, f.reason).Bind(4, f.rank);
    upsert.Bind(5, f.step).Bind(6, f.unix_ms);
    if (absl::Status s = upsert.Run(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// A job's generation history as given: entries older than the oldest kept
// are deleted, new ones inserted (a few rows; an unchanged history writes
// nothing).
absl::Status SaveHistory(StateStore::Connection& db, const StoredJob& job) {
  Statement trim =
      db.Prepare("save job history", "DELETE FROM generation_history WHERE job_id = ? AND seq < ?");
  trim.Bind(1, job.job_id)
      .Bind(2, job.history.empty() ? std::numeric_limits<int64_t>::max() : job.history.front().seq);
  if (absl::Status s = trim.Run(); !s.ok()) return s;
  Statement upsert = db.Prepare(
      "save job history",
      "INSERT INTO generation_history(job_id, seq, generation, unix_ms, reason) VALUES (?, ?, "
      "?, ?, ?) ON CONFLICT(job_id, seq) DO UPDATE SET generation = excluded.generation, "
      "unix_ms = excluded.unix_ms, reason = excluded.reason WHERE generation IS NOT "
      "excluded.generation OR unix_ms IS NOT excluded.unix_ms OR reason IS NOT excluded.reason");
  for (const StoredGenerationChange& h : job.history) {
    upsert.Reset();
    upsert.Bind(1, job.job_id).Bind(2, h.seq).Bind(3, h.generation).Bind(4, h.unix_ms);
    upsert.Bind(5, h.reason);
    if (absl::Status s = upsert.Run(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status AddMissingColumns(StateStore::Connection& db) {
  for (const auto& [table, column, definition] :
       {std::tuple<const char*, const char*, const char*>{"members", "node",
                                                          "TEXT NOT NULL DEFAULT ''"},
        {"members", "step", "INTEGER NOT NULL DEFAULT 0"},
        {"members", "loss", "REAL NOT NULL DEFAULT 0"},
        {"members", "last_step", "BLOB NOT NULL DEFAULT x''"},
        {"jobs", "target_world_size", "INTEGER NOT NULL DEFAULT 0"}}) {
    if (absl::Status s = AddColumnIfMissing(db, table, column, definition); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& path) {
  return WithSchema(SqlDatabase::Open(path, "state store", SqlDatabase::Durability::kFull), path);
}

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::OpenReplicated(DatabaseReplica* replica) {
  // A generation's members are written as pages of 256 rows (at most ~210
  // KiB each: 128-byte job id, 256-byte worker id and host, the token),
  // not 100,000 entries.
  return WithSchema(
      SqlDatabase::OpenReplicated(replica, "state store", {{"members", kMembersPerPage}}),
      "replicated state");
}

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::WithSchema(
    absl::StatusOr<std::unique_ptr<SqlDatabase>> db, absl::string_view where) {
  if (!db.ok()) return db.status();
  std::unique_ptr<StateStore> store(new StateStore(*std::move(db)));
  absl::Status schema = store->Transaction([](Connection& db) -> absl::Status {
    if (absl::Status s = db.Execute("open", kSchema); !s.ok()) return s;
    return AddMissingColumns(db);
  });
  if (!schema.ok()) return absl::Status(schema.code(), absl::StrCat(where, ": ", schema.message()));
  return store;
}

absl::Status StateStore::SaveJob(const StoredJob& job) {
  return db_->TransactionSyncedLater([&](Connection& db) -> absl::Status {
    // An upsert that leaves an equal row untouched (no write, nothing for a
    // replica), as for the members below.
    Statement save = db.Prepare(
        "save job",
        "INSERT INTO jobs(job_id, world_size, generation, members_generation, state, "
        "target_world_size) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET "
        "world_size = excluded.world_size, generation = excluded.generation, "
        "members_generation = excluded.members_generation, state = excluded.state, "
        "target_world_size = excluded.target_world_size WHERE "
        "world_size IS NOT excluded.world_size OR generation IS NOT excluded.generation OR "
        "members_generation IS NOT excluded.members_generation OR state IS NOT excluded.state OR "
        "target_world_size IS NOT excluded.target_world_size");
    save.Bind(1, job.job_id).Bind(2, job.world_size).Bind(3, job.generation);
    save.Bind(4, job.members_generation).Bind(5, job.state).Bind(6, job.target_world_size);
    if (absl::Status s = save.Run(); !s.ok()) return s;
    // Ranks 0..n-1, as a job's members are: rows that differ are written
    // and the others left untouched (no write to the file, and nothing for
    // a replica: a death at 100,000 members changes one row, not 100,000).
    bool dense = true;
    for (size_t i = 0; i < job.members.size(); ++i) {
      dense = dense && job.members[i].rank == static_cast<int>(i);
    }
    if (!dense) {
      Statement clear = db.Prepare("save job members", "DELETE FROM members WHERE job_id = ?");
      if (absl::Status s = clear.Bind(1, job.job_id).Run(); !s.ok()) return s;
    } else {
      Statement beyond =
          db.Prepare("save job members", "DELETE FROM members WHERE job_id = ? AND rank >= ?");
      beyond.Bind(1, job.job_id).Bind(2, static_cast<int64_t>(job.members.size()));
      if (absl::Status s = beyond.Run(); !s.ok()) return s;
    }
    Statement upsert = db.Prepare(
        "save job members",
        "INSERT INTO members(job_id, rank, worker_id, host, token, left_job, dead, node, step, "
        "loss, last_step) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(job_id, rank) DO "
        "UPDATE SET worker_id = excluded.worker_id, host = excluded.host, token = "
        "excluded.token, left_job = excluded.left_job, dead = excluded.dead, node = "
        "excluded.node, step = excluded.step, loss = excluded.loss, last_step = "
        "excluded.last_step WHERE worker_id IS NOT excluded.worker_id OR host IS NOT "
        "excluded.host OR token IS NOT excluded.token OR left_job IS NOT excluded.left_job OR "
        "dead IS NOT excluded.dead OR node IS NOT excluded.node OR step IS NOT excluded.step OR "
        "loss IS NOT excluded.loss OR last_step IS NOT excluded.last_step");
    for (const StoredMember& m : job.members) {
      upsert.Reset();
      upsert.Bind(1, job.job_id).Bind(2, m.rank).Bind(3, m.worker_id).Bind(4, m.host);
      upsert.Bind(5, m.token).Bind(6, m.left).Bind(7, m.dead).Bind(8, m.node);
      upsert.Bind(9, m.step).BindDouble(10, m.loss).BindBlob(11, m.last_step);
      if (absl::Status s = upsert.Run(); !s.ok()) return s;
    }
    if (absl::Status s = SaveFences(db, job); !s.ok()) return s;
    return SaveHistory(db, job);
  });
}

absl::Status StateStore::DeleteJob(const std::string& job_id) {
  return db_->TransactionSyncedLater([&](Connection& db) -> absl::Status {
    for (const char* sql :
         {"DELETE FROM members WHERE job_id = ?", "DELETE FROM fenced_hosts WHERE job_id = ?",
          "DELETE FROM generation_history WHERE job_id = ?", "DELETE FROM plans WHERE job_id = ?",
          "DELETE FROM goodput WHERE job_id = ?", "DELETE FROM jobs WHERE job_id = ?"}) {
      Statement st = db.Prepare("forget job", sql);
      if (absl::Status s = st.Bind(1, job_id).Run(); !s.ok()) return s;
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<StoredJob>> StateStore::LoadJobs() {
  std::vector<StoredJob> jobs;
  absl::Status status = Read([&](Connection& db) -> absl::Status {
    Statement load = db.Prepare("load jobs",
                                "SELECT job_id, world_size, generation, members_generation, "
                                "state, target_world_size FROM jobs ORDER BY job_id");
    while (load.Next()) {
      StoredJob job;
      job.job_id = load.Text(0);
      job.world_size = static_cast<int>(load.Int(1));
      job.generation = load.Int(2);
      job.members_generation = load.Int(3);
      job.state = static_cast<int>(load.Int(4));
      job.target_world_size = static_cast<int>(load.Int(5));
      jobs.push_back(std::move(job));
    }
    if (!load.status().ok()) return load.status();
    Statement members = db.Prepare("load job members",
                                   "SELECT rank, worker_id, host, token, left_job, dead, node, "
                                   "step, loss, last_step FROM members WHERE job_id = ? ORDER BY rank");
    Statement fences = db.Prepare("load job fences",
                                  "SELECT node, reason, rank, step, unix_ms FROM fenced_hosts "
                                  "WHERE job_id = ? ORDER BY node");
    Statement history = db.Prepare("load job history",
                                   "SELECT seq, generation, unix_ms, reason FROM "
                                   "generation_history WHERE job_id = ? ORDER BY seq");
    for (StoredJob& job : jobs) {
      members.Reset();
      members.Bind(1, job.job_id);
      while (members.Next()) {
        StoredMember m;
        m.rank = static_cast<int>(members.Int(0));
        m.worker_id = members.Text(1);
        m.host = members.Text(2);
        m.token = members.Text(3);
        m.left = members.Int(4) != 0;
        m.dead = members.Int(5) != 0;
        m.node = members.Text(6);
        m.step = members.Int(7);
        m.loss = members.Double(8);
        m.last_step = members.Text(9);
        job.members.push_back(std::move(m));
      }
      if (!members.status().ok()) return members.status();
      fences.Reset();
      fences.Bind(1, job.job_id);
      while (fences.Next()) {
        job.fences.push_back({fences.Text(0), fences.Text(1), static_cast<int>(fences.Int(2)),
                              fences.Int(3), fences.Int(4)});
      }
      if (!fences.status().ok()) return fences.status();
      history.Reset();
      history.Bind(1, job.job_id);
      while (history.Next()) {
        job.history.push_back({history.Int(0), history.Int(1), history.Int(2), history.Text(3)});
      }
      if (!history.status().ok()) return history.status();
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return jobs;
}

absl::Status StateStore::SaveGoodput(const std::string& job_id, const std::string& state) {
  return db_->TransactionSyncedLater([&](Connection& db) -> absl::Status {
    // Unchanged: no write (and nothing for a replica).
    Statement save = db.Prepare(
        "save goodput",
        "INSERT INTO goodput(job_id, state) VALUES (?, ?) ON CONFLICT(job_id) DO UPDATE SET "
        "state = excluded.state WHERE state IS NOT excluded.state");
    save.Bind(1, job_id).BindBlob(2, state);
    return save.Run();
  });
}

absl::StatusOr<std::map<std::string, std::string>> StateStore::LoadGoodput() {
  std::map<std::string, std::string> states;
  absl::Status status = Read([&](Connection& db) {
    Statement load = db.Prepare("load goodput", "SELECT job_id, state FROM goodput");
    while (load.Next()) states[load.Text(0)] = load.Text(1);
    return load.status();
  });
  if (!status.ok()) return status;
  return states;
}

absl::Status StateStore::SavePlan(const std::string& job_id, int64_t generation,
                                  const StoredPlan& plan) {
  return Transaction([&](Connection& db) {
    Statement save = db.Prepare("save plan",
                                "INSERT OR REPLACE INTO plans(job_id, generation, spec_hash, "
                                "plan) VALUES (?, ?, ?, ?)");
    save.Bind(1, job_id).Bind(2, generation).Bind(3, plan.spec_hash).BindBlob(4, plan.plan_bytes);
    return save.Run();
  });
}

absl::StatusOr<std::optional<StoredPlan>> StateStore::LoadPlan(const std::string& job_id,
                                                               int64_t generation) {
  std::optional<StoredPlan> plan;
  absl::Status status = Read([&](Connection& db) {
    Statement load = db.Prepare(
        "load plan", "SELECT spec_hash, plan FROM plans WHERE job_id = ? AND generation = ?");
    load.Bind(1, job_id).Bind(2, generation);
    if (load.Next()) plan = StoredPlan{load.Text(0), load.Text(1)};
    return load.status();
  });
  if (!status.ok()) return status;
  return plan;
}

absl::StatusOr<std::optional<StoredPlan>> StateStore::LoadLatestPlan(const std::string& job_id) {
  std::optional<StoredPlan> plan;
  absl::Status status = Read([&](Connection& db) {
    Statement load = db.Prepare("load latest plan",
                                "SELECT spec_hash, plan FROM plans WHERE job_id = ? "
                                "ORDER BY generation DESC LIMIT 1");
    load.Bind(1, job_id);
    if (load.Next()) plan = StoredPlan{load.Text(0), load.Text(1)};
    return load.status();
  });
  if (!status.ok()) return status;
  return plan;
}

}  // namespace zeroshard
