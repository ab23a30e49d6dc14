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
//
// Cost: a Record writes at most max_points_per_record points per job (1,024
// by default), taking the ranks with a new step in turn from where the last
// Record stopped. A job of up to that many ranks gets every rank's every
// step seen by the timer; a job of W ranks gets each rank's point every
// W / 1,024 Records, which its per-rank bound thins to anyway (at W = 100K a
// rank keeps 64 points). So the server's time for history is bounded per
// pass, not proportional to the job (issue #31).
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_HISTORY_STORE_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_HISTORY_STORE_H_

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
  int64_t max_points_per_record = 1024;
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
  // One rank's last step recorded and the points the file holds for it
  // (-1: not counted by this process yet).
  struct RankState {
    int64_t last_step = -1;
    int64_t points = -1;
  };
  struct JobHistory {
    std::vector<RankState> ranks;  // by rank
    int next = 0;                  // the member a Record looks at first
  };
  // A rank chosen for this Record: the member's status and its state,
  // changed in the transaction and kept only when it commits.
  struct Pick {
    const v1::JobStatus* job;
    const v1::MemberStatus* member;
    RankState state;
  };

  HistoryStore(std::unique_ptr<SqlDatabase> db, HistoryOptions options)
      : options_(options), db_(std::move(db)) {}
  // Chooses, per job, up to max_points_per_record members with a step not
  // recorded yet, from the job's `next` on; moves `next` past them.
  std::vector<Pick> PickNewPoints(const v1::GetStatusResponse& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inserts the picked points and thins the ranks that went over their
  // bound, counting in each pick's state.
  absl::Status RecordPicks(SqlDatabase::Connection& db, std::vector<Pick>& picks,
                           absl::Time now) const;
  // Points the file holds for the rank; whether it holds `step`.
  static absl::StatusOr<int64_t> CountPoints(SqlDatabase::Connection& db, const std::string& job,
                                             int rank);
  // `has` is PrepareHasPoint's statement, reset and bound here.
  static Statement PrepareHasPoint(SqlDatabase::Connection& db);
  static absl::StatusOr<bool> HasPoint(Statement& has, const std::string& job, int rank,
                                       int64_t step);
  // Deletes every other point of the rank older than its newest
  // `keep_recent` (history_store.h's rule); counts the deleted in `*state`.
  static absl::Status Thin(SqlDatabase::Connection& db, const std::string& job, int rank,
                           int64_t keep_recent, RankState* state);

  const HistoryOptions options_;
  const std::unique_ptr<SqlDatabase> db_;
  // Held across a Record so that `ranks_` matches what the file holds.
  absl::Mutex mu_;
  std::map<std::string, JobHistory> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_HISTORY_STORE_H_
