#include "shard_server/observability/history_store.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

constexpr char kSchema[] =
    "CREATE TABLE IF NOT EXISTS history (job TEXT NOT NULL, rank INTEGER NOT NULL, "
    "step INTEGER NOT NULL, unix_ms INTEGER, loss REAL, step_ms REAL, items_per_second REAL, "
    "memory_bytes INTEGER, PRIMARY KEY (job, rank, step)) WITHOUT ROWID;";

}  // namespace

absl::StatusOr<std::unique_ptr<HistoryStore>> HistoryStore::Open(const std::string& path,
                                                                 HistoryOptions options) {
  // Not fsynced: history is worth less than a commit's latency (header).
  absl::StatusOr<std::unique_ptr<SqlDatabase>> db =
      SqlDatabase::Open(path, "history store", SqlDatabase::Durability::kOff);
  if (!db.ok()) return db.status();
  std::unique_ptr<HistoryStore> store(new HistoryStore(*std::move(db), options));
  absl::Status schema = store->db_->Transaction(
      [](SqlDatabase::Connection& db) { return db.Execute("create the history table", kSchema); });
  if (!schema.ok()) return absl::Status(schema.code(), absl::StrCat(path, ": ", schema.message()));
  absl::MutexLock lock(&store->mu_);
  absl::Status counted = store->db_->Read([&](SqlDatabase::Connection& db) {
    Statement counts = db.Prepare(
        "count points", "SELECT job, rank, MAX(step), COUNT(*) FROM history GROUP BY job, rank");
    while (counts.Next()) {
      const int rank = static_cast<int>(counts.Int(1));
      std::vector<RankState>& ranks = store->jobs_[counts.Text(0)].ranks;
      if (rank < 0) continue;
      if (static_cast<int>(ranks.size()) <= rank) ranks.resize(rank + 1);
      ranks[rank] = {counts.Int(2), counts.Int(3)};
    }
    return counts.status();
  });
  if (!counted.ok()) return counted;
  return store;
}

int64_t HistoryStore::PointsPerRank(int world_size) const {
  return std::max(options_.min_points_per_rank,
                  options_.max_points_per_job / std::max(1, world_size));
}

absl::Status HistoryStore::Record(const v1::GetStatusResponse& status, absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<Pick> picks = PickNewPoints(status);
  // Nothing new (the common case between two steps): no transaction.
  if (picks.empty()) return absl::OkStatus();
  absl::Status recorded = db_->Transaction(
      [&](SqlDatabase::Connection& db) { return RecordPicks(db, picks, now); });
  if (!recorded.ok()) return recorded;
  // The counts change only with the transaction that changed the file.
  for (const Pick& p : picks) jobs_[p.job->job_id()].ranks[p.member->rank()] = p.state;
  return absl::OkStatus();
}

std::vector<HistoryStore::Pick> HistoryStore::PickNewPoints(const v1::GetStatusResponse& status) {
  std::vector<Pick> picks;
  for (const v1::JobStatus& job : status.jobs()) {
    const int n = job.members_size();
    if (n == 0) continue;
    JobHistory& history = jobs_[job.job_id()];
    const int first = history.next % n;
    int64_t budget = options_.max_points_per_record;
    int looked = 0;
    for (; looked < n && budget > 0; ++looked) {
      const v1::MemberStatus& m = job.members((first + looked) % n);
      if (m.rank() < 0 || m.step() <= 0 || m.last_heartbeat_age_ms() < 0) continue;
      if (static_cast<int>(history.ranks.size()) <= m.rank()) history.ranks.resize(m.rank() + 1);
      const RankState& state = history.ranks[m.rank()];
      if (state.points >= 0 && state.last_step == m.step()) continue;
      picks.push_back({&job, &m, state});
      --budget;
    }
    history.next = (first + looked) % n;
  }
  return picks;
}

absl::Status HistoryStore::RecordPicks(SqlDatabase::Connection& db, std::vector<Pick>& picks,
                                       absl::Time now) const {
  Statement insert =
      db.Prepare("insert",
                 "INSERT OR REPLACE INTO history (job, rank, step, unix_ms, loss, step_ms, "
                 "items_per_second, memory_bytes) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)");
  // Prepared once for the whole pass: parsing SQL per point cost more than
  // running it.
  Statement has = PrepareHasPoint(db);
  for (Pick& p : picks) {
    const v1::JobStatus& job = *p.job;
    const v1::MemberStatus& m = *p.member;
    RankState& rank = p.state;
    if (rank.points < 0) {
      // First seen by this process (a restarted server): count what the
      // file holds.
      absl::StatusOr<int64_t> held = CountPoints(db, job.job_id(), m.rank());
      if (!held.ok()) return held.status();
      rank.points = *held;
    }
    // Counted by what the file holds, whatever the step does: a step that
    // goes down (a rank resumed from an older checkpoint, or a forged
    // report) inserts a point as surely as one that goes up.
    absl::StatusOr<bool> held = HasPoint(has, job.job_id(), m.rank(), m.step());
    if (!held.ok()) return held.status();
    insert.Reset();
    insert.Bind(1, job.job_id()).Bind(2, m.rank()).Bind(3, m.step());
    insert.Bind(4, absl::ToUnixMillis(now)).BindDouble(5, m.loss());
    insert.BindDouble(6, m.last_step().step_ms());
    insert.BindDouble(7, m.last_step().items_per_second()).Bind(8, m.memory_bytes());
    if (absl::Status s = insert.Run(); !s.ok()) return s;
    // A step seen again (a resumed generation) replaces its point.
    if (!*held) rank.points++;
    rank.last_step = m.step();
    const int64_t cap = PointsPerRank(job.world_size());
    if (rank.points > cap) {
      if (absl::Status s = Thin(db, job.job_id(), m.rank(), cap / 2, &rank); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> HistoryStore::CountPoints(SqlDatabase::Connection& db,
                                                  const std::string& job, int rank) {
  Statement count =
      db.Prepare("count", "SELECT COUNT(*) FROM history WHERE job = ?1 AND rank = ?2");
  count.Bind(1, job).Bind(2, rank);
  const int64_t n = count.Next() ? count.Int(0) : 0;
  if (absl::Status s = count.status(); !s.ok()) return s;
  return n;
}

Statement HistoryStore::PrepareHasPoint(SqlDatabase::Connection& db) {
  return db.Prepare("has", "SELECT 1 FROM history WHERE job = ?1 AND rank = ?2 AND step = ?3");
}

absl::StatusOr<bool> HistoryStore::HasPoint(Statement& has, const std::string& job, int rank,
                                            int64_t step) {
  has.Reset();
  has.Bind(1, job).Bind(2, rank).Bind(3, step);
  const bool found = has.Next();
  if (absl::Status s = has.status(); !s.ok()) return s;
  return found;
}

absl::Status HistoryStore::Thin(SqlDatabase::Connection& db, const std::string& job, int rank,
                                int64_t keep_recent, RankState* state) {
  Statement thin =
      db.Prepare("thin",
                 "DELETE FROM history WHERE job = ?1 AND rank = ?2 AND step IN ("
                 " SELECT step FROM (SELECT step, ROW_NUMBER() OVER (ORDER BY step DESC) AS n"
                 "  FROM history WHERE job = ?1 AND rank = ?2) WHERE n > ?3 AND n % 2 = 0)");
  thin.Bind(1, job).Bind(2, rank).Bind(3, keep_recent);
  if (absl::Status s = thin.Run(); !s.ok()) return s;
  state->points -= thin.Changes();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::HistoryPoint>> HistoryStore::Points(const std::string& job,
                                                                   int rank) {
  std::vector<v1::HistoryPoint> points;
  absl::Status read = db_->Read([&](SqlDatabase::Connection& db) {
    Statement select =
        db.Prepare("select",
                   "SELECT rank, step, unix_ms, loss, step_ms, items_per_second, memory_bytes "
                   "FROM history WHERE job = ?1 AND (?2 < 0 OR rank = ?2) ORDER BY rank, step");
    select.Bind(1, job).Bind(2, rank);
    while (select.Next()) {
      v1::HistoryPoint& p = points.emplace_back();
      p.set_rank(static_cast<int>(select.Int(0)));
      p.set_step(select.Int(1));
      p.set_unix_ms(select.Int(2));
      // SQLite stores a NaN as NULL: a diverged step reads back as NaN, not 0.
      p.set_loss(select.IsNull(3) ? std::numeric_limits<double>::quiet_NaN() : select.Double(3));
      p.set_step_ms(select.Double(4));
      p.set_items_per_second(select.Double(5));
      p.set_memory_bytes(select.Int(6));
    }
    return select.status();
  });
  if (!read.ok()) return read;
  return points;
}

absl::Status HistoryStore::ForgetJob(const std::string& job) {
  absl::MutexLock lock(&mu_);
  absl::Status erased = db_->Transaction([&](SqlDatabase::Connection& db) {
    return db.Prepare("delete", "DELETE FROM history WHERE job = ?1").Bind(1, job).Run();
  });
  if (!erased.ok()) return erased;
  jobs_.erase(job);
  return absl::OkStatus();
}

}  // namespace zeroshard
