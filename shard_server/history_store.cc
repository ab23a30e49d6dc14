#include "shard_server/history_store.h"

#include <sqlite3.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// A prepared statement, finalized on scope exit.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &st_, nullptr); }
  ~Statement() { sqlite3_finalize(st_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return st_; }
  void Text(int i, const std::string& s) {
    sqlite3_bind_text(st_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }

 private:
  sqlite3_stmt* st_ = nullptr;
  int rc_ = SQLITE_ERROR;
};

absl::Status Error(sqlite3* db, absl::string_view what) {
  return absl::InternalError(absl::StrCat("history store: ", what, ": ", sqlite3_errmsg(db)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<HistoryStore>> HistoryStore::Open(const std::string& path,
                                                                 HistoryOptions options) {
  std::unique_ptr<HistoryStore> store(new HistoryStore());
  store->options_ = options;
  absl::MutexLock lock(&store->mu_);
  if (sqlite3_open(path.c_str(), &store->db_) != SQLITE_OK) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open the history store ", path, ": ", sqlite3_errmsg(store->db_)));
  }
  const char* schema =
      "PRAGMA journal_mode=WAL; PRAGMA synchronous=OFF;"
      "CREATE TABLE IF NOT EXISTS history (job TEXT NOT NULL, rank INTEGER NOT NULL, "
      "step INTEGER NOT NULL, unix_ms INTEGER, loss REAL, step_ms REAL, items_per_second REAL, "
      "memory_bytes INTEGER, PRIMARY KEY (job, rank, step)) WITHOUT ROWID;";
  if (sqlite3_exec(store->db_, schema, nullptr, nullptr, nullptr) != SQLITE_OK) {
    return Error(store->db_, absl::StrCat("schema of ", path));
  }
  Statement counts(store->db_,
                   "SELECT job, rank, MAX(step), COUNT(*) FROM history GROUP BY job, rank");
  if (!counts.ok()) return Error(store->db_, "count points");
  while (sqlite3_step(counts.get()) == SQLITE_ROW) {
    std::string job(reinterpret_cast<const char*>(sqlite3_column_text(counts.get(), 0)));
    store->ranks_[{job, sqlite3_column_int(counts.get(), 1)}] = {
        sqlite3_column_int64(counts.get(), 2), sqlite3_column_int64(counts.get(), 3)};
  }
  return store;
}

HistoryStore::~HistoryStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close(db_);
}

int64_t HistoryStore::PointsPerRank(int world_size) const {
  return std::max(options_.min_points_per_rank,
                  options_.max_points_per_job / std::max(1, world_size));
}

absl::Status HistoryStore::Record(const v1::GetStatusResponse& status, absl::Time now) {
  absl::MutexLock lock(&mu_);
  bool in_transaction = false;
  Statement insert(db_,
                   "INSERT OR REPLACE INTO history (job, rank, step, unix_ms, loss, step_ms, "
                   "items_per_second, memory_bytes) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)");
  if (!insert.ok()) return Error(db_, "prepare insert");
  std::vector<std::pair<std::string, int>> over;
  for (const v1::JobStatus& job : status.jobs()) {
    const int64_t cap = PointsPerRank(job.world_size());
    for (const v1::MemberStatus& m : job.members()) {
      if (m.rank() < 0 || m.step() <= 0 || m.last_heartbeat_age_ms() < 0) continue;
      RankState& rank = ranks_[{job.job_id(), m.rank()}];
      if (rank.last_step == m.step()) continue;
      if (!in_transaction) {
        sqlite3_exec(db_, "BEGIN", nullptr, nullptr, nullptr);
        in_transaction = true;
      }
      sqlite3_stmt* st = insert.get();
      sqlite3_reset(st);
      insert.Text(1, job.job_id());
      sqlite3_bind_int(st, 2, m.rank());
      sqlite3_bind_int64(st, 3, m.step());
      sqlite3_bind_int64(st, 4, absl::ToUnixMillis(now));
      sqlite3_bind_double(st, 5, m.loss());
      sqlite3_bind_double(st, 6, m.last_step().step_ms());
      sqlite3_bind_double(st, 7, m.last_step().items_per_second());
      sqlite3_bind_int64(st, 8, m.memory_bytes());
      if (sqlite3_step(st) != SQLITE_DONE) {
        absl::Status error = Error(db_, "insert");
        sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
        return error;
      }
      // A step seen again (a resumed generation) replaces its point.
      if (m.step() > rank.last_step) rank.points++;
      rank.last_step = m.step();
      if (rank.points > cap) over.push_back({job.job_id(), m.rank()});
    }
    for (const auto& [job_id, r] : over) {
      if (absl::Status s = Thin(job_id, r, cap / 2); !s.ok()) {
        sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
        return s;
      }
    }
    over.clear();
  }
  if (in_transaction && sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
    return Error(db_, "commit");
  }
  return absl::OkStatus();
}

absl::Status HistoryStore::Thin(const std::string& job, int rank, int64_t keep_recent) {
  Statement thin(db_,
                 "DELETE FROM history WHERE job = ?1 AND rank = ?2 AND step IN ("
                 " SELECT step FROM (SELECT step, ROW_NUMBER() OVER (ORDER BY step DESC) AS n"
                 "  FROM history WHERE job = ?1 AND rank = ?2) WHERE n > ?3 AND n % 2 = 0)");
  if (!thin.ok()) return Error(db_, "prepare thinning");
  thin.Text(1, job);
  sqlite3_bind_int(thin.get(), 2, rank);
  sqlite3_bind_int64(thin.get(), 3, keep_recent);
  if (sqlite3_step(thin.get()) != SQLITE_DONE) return Error(db_, "thin");
  ranks_[{job, rank}].points -= sqlite3_changes(db_);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::HistoryPoint>> HistoryStore::Points(const std::string& job,
                                                                   int rank) {
  absl::MutexLock lock(&mu_);
  Statement select(db_,
                   "SELECT rank, step, unix_ms, loss, step_ms, items_per_second, memory_bytes "
                   "FROM history WHERE job = ?1 AND (?2 < 0 OR rank = ?2) ORDER BY rank, step");
  if (!select.ok()) return Error(db_, "prepare select");
  select.Text(1, job);
  sqlite3_bind_int(select.get(), 2, rank);
  std::vector<v1::HistoryPoint> points;
  int rc;
  while ((rc = sqlite3_step(select.get())) == SQLITE_ROW) {
    v1::HistoryPoint& p = points.emplace_back();
    sqlite3_stmt* st = select.get();
    p.set_rank(sqlite3_column_int(st, 0));
    p.set_step(sqlite3_column_int64(st, 1));
    p.set_unix_ms(sqlite3_column_int64(st, 2));
    p.set_loss(sqlite3_column_double(st, 3));
    p.set_step_ms(sqlite3_column_double(st, 4));
    p.set_items_per_second(sqlite3_column_double(st, 5));
    p.set_memory_bytes(sqlite3_column_int64(st, 6));
  }
  if (rc != SQLITE_DONE) return Error(db_, "select");
  return points;
}

absl::Status HistoryStore::ForgetJob(const std::string& job) {
  absl::MutexLock lock(&mu_);
  Statement erase(db_, "DELETE FROM history WHERE job = ?1");
  if (!erase.ok()) return Error(db_, "prepare delete");
  erase.Text(1, job);
  if (sqlite3_step(erase.get()) != SQLITE_DONE) return Error(db_, "delete");
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    it = it->first.first == job ? ranks_.erase(it) : std::next(it);
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
