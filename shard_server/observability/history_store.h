// Each job's per-step history — loss, step time, throughput and memory per
// rank — in its own SQLite file (<state_dir>/history.db; in memory without
// a state directory), so curves survive a client's reconnect and a server
// restart.
//
// Bound: a job keeps at most max_points_per_job points (262,144 by default,
// about 16 MiB), spread over its ranks: each rank keeps at most
// max(64, max_points_per_job / world_size). When a rank goes over, its
// points older than the newest half are thinned by two (every other one
// goes), so resolution falls with age — a long run keeps its whole curve,
// the recent steps at full resolution. The count is what the file holds,
// whatever order the steps come in (a step that goes down adds a point like
// one that goes up). A NaN loss reads back as NaN. Writes are not fsynced
// (synchronous=OFF): a crash may lose the last seconds of history, never
// the server's state, which lives in another file.
#ifndef ZEROSHARD_SHARD_SERVER_HISTORY_STORE_H_
#define ZEROSHARD_SHARD_SERVER_HISTORY_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/state/sql_database.h"

namespace zeroshard {

struct HistoryOptions {
  int64_t max_points_per_job = 1 << 18;
  int64_t min_points_per_rank = 64;
};

// Thread-safe.
class HistoryStore {
 public:
  // `path` ":memory:" keeps it in memory.
  static absl::StatusOr<std::unique_ptr<HistoryStore>> Open(const std::string& path,
                                                            HistoryOptions options = {});

  // Records every live rank's latest completed step that is not recorded
  // yet, received at `now`.
  absl::Status Record(const v1::GetStatusResponse& status, absl::Time now);
  // The job's points by rank, then step (`rank` -1: every rank).
  absl::StatusOr<std::vector<v1::HistoryPoint>> Points(const std::string& job, int rank = -1);
  absl::Status ForgetJob(const std::string& job);
  // Points a rank of a job may keep.
  int64_t PointsPerRank(int world_size) const;

 private:
  // (job, rank) -> last step recorded and points held.
  struct RankState {
    int64_t last_step = -1;
    int64_t points = 0;
  };
  using RankStates = std::map<std::pair<std::string, int>, RankState>;

  HistoryStore(std::unique_ptr<SqlDatabase> db, HistoryOptions options)
      : options_(options), db_(std::move(db)) {}
  // Inserts the points of `status` not recorded yet and thins the ranks
  // that went over their bound, counting in `*ranks`.
  absl::Status RecordNewPoints(SqlDatabase::Connection& db, const v1::GetStatusResponse& status,
                               absl::Time now, RankStates* ranks) const;
  // Points the file holds for the rank; whether it holds `step`.
  static absl::StatusOr<int64_t> CountPoints(SqlDatabase::Connection& db, const std::string& job,
                                             int rank);
  static absl::StatusOr<bool> HasPoint(SqlDatabase::Connection& db, const std::string& job,
                                       int rank, int64_t step);
  // Deletes every other point of the rank older than its newest
  // `keep_recent` (history_store.h's rule); counts the deleted in `*state`.
  static absl::Status Thin(SqlDatabase::Connection& db, const std::string& job, int rank,
                           int64_t keep_recent, RankState* state);

  const HistoryOptions options_;
  const std::unique_ptr<SqlDatabase> db_;
  // Held across a Record so that `ranks_` matches what the file holds.
  absl::Mutex mu_;
  RankStates ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_HISTORY_STORE_H_
