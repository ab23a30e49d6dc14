#include "shard_server/state_store.h"

#include <sqlite3.h>

#include <string>
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
  PRIMARY KEY (job_id, rank)
);
CREATE TABLE IF NOT EXISTS plans (
  job_id TEXT NOT NULL,
  generation INTEGER NOT NULL,
  spec_hash TEXT NOT NULL,
  plan BLOB NOT NULL,
  PRIMARY KEY (job_id, generation)
);
)sql";

// A full disk is RESOURCE_EXHAUSTED and a database another process holds
// locked UNAVAILABLE (worth retrying); anything else is the server's fault.
absl::StatusCode StatusCodeOf(int sqlite_code) {
  switch (sqlite_code & 0xff) {
    case SQLITE_FULL:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status SqliteError(int code, absl::string_view what, absl::string_view message) {
  return absl::Status(StatusCodeOf(code), absl::StrCat("state store: ", what, ": ", message));
}

// Runs `sql` (statements without results) on `db`.
absl::Status ExecuteSql(sqlite3* db, absl::string_view what, const char* sql) {
  char* error = nullptr;
  int code = sqlite3_exec(db, sql, nullptr, nullptr, &error);
  if (code == SQLITE_OK) return absl::OkStatus();
  std::string message = error != nullptr ? error : sqlite3_errstr(code);
  sqlite3_free(error);
  return SqliteError(sqlite3_extended_errcode(db), what, message);
}

}  // namespace

// ---------------------------------------------------------------------------
// Statement

Statement::Statement(sqlite3* db, absl::string_view what, const char* sql, bool read_only)
    : db_(db), what_(what) {
  int code = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  if (code != SQLITE_OK) {
    Fail(code);
    sqlite3_finalize(stmt_);
    stmt_ = nullptr;
  } else if (read_only && !sqlite3_stmt_readonly(stmt_)) {
    status_ = absl::InternalError(absl::StrCat(
        "state store: ", what_, ": a statement that writes in Read(); use Transaction()"));
  }
}

Statement::Statement(Statement&& other) noexcept
    : db_(other.db_),
      what_(std::move(other.what_)),
      stmt_(std::exchange(other.stmt_, nullptr)),
      status_(std::move(other.status_)) {}

Statement::~Statement() { sqlite3_finalize(stmt_); }

void Statement::Fail(int code) {
  if (!status_.ok()) return;
  status_ = SqliteError(code, what_, sqlite3_errmsg(db_));
}

Statement& Statement::Bind(int index, absl::string_view text) {
  if (!status_.ok()) return *this;
  int code =
      sqlite3_bind_text(stmt_, index, text.data(), static_cast<int>(text.size()), SQLITE_TRANSIENT);
  if (code != SQLITE_OK) Fail(code);
  return *this;
}

Statement& Statement::BindBlob(int index, absl::string_view bytes) {
  if (!status_.ok()) return *this;
  int code = sqlite3_bind_blob(stmt_, index, bytes.data(), static_cast<int>(bytes.size()),
                               SQLITE_TRANSIENT);
  if (code != SQLITE_OK) Fail(code);
  return *this;
}

Statement& Statement::Bind(int index, int64_t value) {
  if (!status_.ok()) return *this;
  int code = sqlite3_bind_int64(stmt_, index, value);
  if (code != SQLITE_OK) Fail(code);
  return *this;
}

bool Statement::Next() {
  if (!status_.ok() || stmt_ == nullptr) return false;
  int code = sqlite3_step(stmt_);
  if (code == SQLITE_ROW) return true;
  if (code != SQLITE_DONE) Fail(code);
  return false;
}

absl::Status Statement::Run() {
  while (Next()) {
  }
  return status_;
}

void Statement::Reset() {
  // sqlite3_reset repeats the last step's error, which Next() has recorded.
  if (stmt_ != nullptr) sqlite3_reset(stmt_);
}

std::string Statement::Text(int column) const {
  // sqlite3_column_blob reads TEXT and BLOB columns alike, embedded NULs
  // included.
  const void* p = sqlite3_column_blob(stmt_, column);
  int n = sqlite3_column_bytes(stmt_, column);
  return p == nullptr ? std::string() : std::string(static_cast<const char*>(p), n);
}

int64_t Statement::Int(int column) const { return sqlite3_column_int64(stmt_, column); }

bool Statement::IsNull(int column) const {
  return sqlite3_column_type(stmt_, column) == SQLITE_NULL;
}

// ---------------------------------------------------------------------------
// StateStore

Statement StateStore::Connection::Prepare(absl::string_view what, const char* sql) {
  return Statement(db_, what, sql, read_only_);
}

absl::Status StateStore::Connection::Execute(absl::string_view what, const char* sql) {
  if (read_only_) {
    return absl::InternalError(
        absl::StrCat("state store: ", what, ": Execute() in Read(); use Transaction()"));
  }
  return ExecuteSql(db_, what, sql);
}

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("cannot open state database ", path, ": ", msg));
  }
  sqlite3_busy_timeout(db, 5000);
  std::unique_ptr<StateStore> store(new StateStore(db));
  absl::MutexLock lock(&store->mu_);
  // WAL keeps readers and the writer apart; synchronous=FULL makes a commit
  // durable before the server answers the call that caused it.
  for (const char* sql : {"PRAGMA journal_mode=WAL;", "PRAGMA synchronous=FULL;", kSchema}) {
    absl::Status s = store->ExecuteLocked("open", sql);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  // A database from before jobs.target_world_size: the column is added
  // (0: the job's world size, which it was before a shrink could happen).
  bool has_target = false;
  sqlite3_exec(
      db, "PRAGMA table_info(jobs);",
      [](void* found, int columns, char** values, char** names) {
        for (int i = 0; i < columns; ++i) {
          if (std::string(names[i]) == "name" && values[i] != nullptr &&
              std::string(values[i]) == "target_world_size") {
            *static_cast<bool*>(found) = true;
          }
        }
        return 0;
      },
      &has_target, nullptr);
  if (!has_target) {
    absl::Status s = store->ExecuteLocked(
        "add jobs.target_world_size",
        "ALTER TABLE jobs ADD COLUMN target_world_size INTEGER NOT NULL DEFAULT 0;");
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return store;
}

StateStore::~StateStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close(db_);
}

absl::Status StateStore::ExecuteLocked(absl::string_view what, const char* sql) {
  return ExecuteSql(db_, what, sql);
}

absl::Status StateStore::Transaction(Body body) {
  absl::MutexLock lock(&mu_);
  // IMMEDIATE takes the write lock now: a transaction never fails half-way
  // because another connection started writing first.
  absl::Status status = ExecuteLocked("begin transaction", "BEGIN IMMEDIATE;");
  if (!status.ok()) return status;
  Connection connection(db_, /*read_only=*/false);
  status = body(connection);
  if (status.ok()) status = ExecuteLocked("commit", "COMMIT;");
  // After some errors (a full disk, an I/O error) SQLite has already rolled
  // the transaction back; after the others it is still open.
  if (!status.ok() && sqlite3_get_autocommit(db_) == 0) {
    ExecuteLocked("rollback", "ROLLBACK;").IgnoreError();
  }
  return status;
}

absl::Status StateStore::Read(Body body) {
  absl::MutexLock lock(&mu_);
  Connection connection(db_, /*read_only=*/true);
  return body(connection);
}

absl::Status StateStore::SaveJob(const StoredJob& job) {
  return Transaction([&](Connection& db) -> absl::Status {
    Statement save = db.Prepare("save job",
                                "INSERT OR REPLACE INTO jobs(job_id, world_size, generation, "
                                "members_generation, state, target_world_size) "
                                "VALUES (?, ?, ?, ?, ?, ?)");
    save.Bind(1, job.job_id).Bind(2, job.world_size).Bind(3, job.generation);
    save.Bind(4, job.members_generation).Bind(5, job.state).Bind(6, job.target_world_size);
    if (absl::Status s = save.Run(); !s.ok()) return s;
    Statement clear = db.Prepare("save job members", "DELETE FROM members WHERE job_id = ?");
    if (absl::Status s = clear.Bind(1, job.job_id).Run(); !s.ok()) return s;
    Statement insert = db.Prepare("save job members",
                                  "INSERT INTO members(job_id, rank, worker_id, host, token, "
                                  "left_job, dead) VALUES (?, ?, ?, ?, ?, ?, ?)");
    for (const StoredMember& m : job.members) {
      insert.Reset();
      insert.Bind(1, job.job_id).Bind(2, m.rank).Bind(3, m.worker_id).Bind(4, m.host);
      insert.Bind(5, m.token).Bind(6, m.left).Bind(7, m.dead);
      if (absl::Status s = insert.Run(); !s.ok()) return s;
    }
    return absl::OkStatus();
  });
}

absl::Status StateStore::DeleteJob(const std::string& job_id) {
  return Transaction([&](Connection& db) -> absl::Status {
    for (const char* sql : {"DELETE FROM members WHERE job_id = ?",
                            "DELETE FROM plans WHERE job_id = ?",
                            "DELETE FROM jobs WHERE job_id = ?"}) {
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
                                   "SELECT rank, worker_id, host, token, left_job, dead "
                                   "FROM members WHERE job_id = ? ORDER BY rank");
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
        job.members.push_back(std::move(m));
      }
      if (!members.status().ok()) return members.status();
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return jobs;
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

}  // namespace zeroshard
