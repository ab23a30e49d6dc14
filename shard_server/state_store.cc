#include "shard_server/state_store.h"

#include <sqlite3.h>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY,
  world_size INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  members_generation INTEGER NOT NULL,
  state INTEGER NOT NULL
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

absl::Status SqliteError(sqlite3* db, absl::string_view what) {
  return absl::InternalError(absl::StrCat("state store: ", what, ": ", sqlite3_errmsg(db)));
}

// Owns a prepared statement.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) {
    if (sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr) != SQLITE_OK) stmt_ = nullptr;
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  bool ok() const { return stmt_ != nullptr; }
  sqlite3_stmt* get() { return stmt_; }
  void Bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void BindBlob(int i, const std::string& v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void Bind(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  std::string Text(int col) {
    const void* p = sqlite3_column_blob(stmt_, col);
    int n = sqlite3_column_bytes(stmt_, col);
    return p == nullptr ? std::string() : std::string(static_cast<const char*>(p), n);
  }
  int64_t Int(int col) { return sqlite3_column_int64(stmt_, col); }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
};

}  // namespace

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
    absl::Status s = store->ExecuteLocked(sql);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return store;
}

StateStore::~StateStore() { sqlite3_close(db_); }

absl::Status StateStore::ExecuteLocked(const std::string& sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("state store: ", msg));
  }
  return absl::OkStatus();
}

absl::Status StateStore::Execute(const std::string& sql) {
  absl::MutexLock lock(&mu_);
  return ExecuteLocked(sql);
}

absl::Status StateStore::SaveJob(const StoredJob& job) {
  absl::MutexLock lock(&mu_);
  absl::Status s = ExecuteLocked("BEGIN IMMEDIATE;");
  if (!s.ok()) return s;
  auto fail = [&](absl::string_view what) {
    absl::Status e = SqliteError(db_, what);
    ExecuteLocked("ROLLBACK;").IgnoreError();
    return e;
  };
  {
    Statement st(db_,
                 "INSERT OR REPLACE INTO jobs(job_id, world_size, generation, "
                 "members_generation, state) VALUES (?, ?, ?, ?, ?)");
    if (!st.ok()) return fail("prepare jobs");
    st.Bind(1, job.job_id);
    st.Bind(2, int64_t{job.world_size});
    st.Bind(3, job.generation);
    st.Bind(4, job.members_generation);
    st.Bind(5, int64_t{job.state});
    if (sqlite3_step(st.get()) != SQLITE_DONE) return fail("save job");
  }
  {
    Statement st(db_, "DELETE FROM members WHERE job_id = ?");
    if (!st.ok()) return fail("prepare members");
    st.Bind(1, job.job_id);
    if (sqlite3_step(st.get()) != SQLITE_DONE) return fail("delete members");
  }
  Statement st(db_,
               "INSERT INTO members(job_id, rank, worker_id, host, token, left_job, dead) "
               "VALUES (?, ?, ?, ?, ?, ?, ?)");
  if (!st.ok()) return fail("prepare members");
  for (const StoredMember& m : job.members) {
    sqlite3_reset(st.get());
    st.Bind(1, job.job_id);
    st.Bind(2, int64_t{m.rank});
    st.Bind(3, m.worker_id);
    st.Bind(4, m.host);
    st.Bind(5, m.token);
    st.Bind(6, int64_t{m.left});
    st.Bind(7, int64_t{m.dead});
    if (sqlite3_step(st.get()) != SQLITE_DONE) return fail("save member");
  }
  return ExecuteLocked("COMMIT;");
}

absl::StatusOr<std::vector<StoredJob>> StateStore::LoadJobs() {
  absl::MutexLock lock(&mu_);
  std::vector<StoredJob> jobs;
  Statement st(db_,
               "SELECT job_id, world_size, generation, members_generation, state FROM jobs "
               "ORDER BY job_id");
  if (!st.ok()) return SqliteError(db_, "prepare load jobs");
  while (sqlite3_step(st.get()) == SQLITE_ROW) {
    StoredJob job;
    job.job_id = st.Text(0);
    job.world_size = static_cast<int>(st.Int(1));
    job.generation = st.Int(2);
    job.members_generation = st.Int(3);
    job.state = static_cast<int>(st.Int(4));
    jobs.push_back(std::move(job));
  }
  Statement ms(db_,
               "SELECT rank, worker_id, host, token, left_job, dead FROM members "
               "WHERE job_id = ? ORDER BY rank");
  if (!ms.ok()) return SqliteError(db_, "prepare load members");
  for (StoredJob& job : jobs) {
    sqlite3_reset(ms.get());
    ms.Bind(1, job.job_id);
    while (sqlite3_step(ms.get()) == SQLITE_ROW) {
      StoredMember m;
      m.rank = static_cast<int>(ms.Int(0));
      m.worker_id = ms.Text(1);
      m.host = ms.Text(2);
      m.token = ms.Text(3);
      m.left = ms.Int(4) != 0;
      m.dead = ms.Int(5) != 0;
      job.members.push_back(std::move(m));
    }
  }
  return jobs;
}

absl::Status StateStore::SavePlan(const std::string& job_id, int64_t generation,
                                  const StoredPlan& plan) {
  absl::MutexLock lock(&mu_);
  Statement st(db_,
               "INSERT OR REPLACE INTO plans(job_id, generation, spec_hash, plan) "
               "VALUES (?, ?, ?, ?)");
  if (!st.ok()) return SqliteError(db_, "prepare save plan");
  st.Bind(1, job_id);
  st.Bind(2, generation);
  st.Bind(3, plan.spec_hash);
  st.BindBlob(4, plan.plan_bytes);
  if (sqlite3_step(st.get()) != SQLITE_DONE) return SqliteError(db_, "save plan");
  return absl::OkStatus();
}

absl::StatusOr<std::optional<StoredPlan>> StateStore::LoadPlan(const std::string& job_id,
                                                               int64_t generation) {
  absl::MutexLock lock(&mu_);
  Statement st(db_, "SELECT spec_hash, plan FROM plans WHERE job_id = ? AND generation = ?");
  if (!st.ok()) return SqliteError(db_, "prepare load plan");
  st.Bind(1, job_id);
  st.Bind(2, generation);
  if (sqlite3_step(st.get()) != SQLITE_ROW) return std::optional<StoredPlan>();
  return std::optional<StoredPlan>(StoredPlan{st.Text(0), st.Text(1)});
}

}  // namespace zeroshard
