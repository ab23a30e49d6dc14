// Durable server state in one SQLite file: jobs, their current generation and
// the members of the last formed generation, and shard plans. A restarted
// server loads it and still knows its jobs.
#ifndef ZEROSHARD_SHARD_SERVER_STATE_STORE_H_
#define ZEROSHARD_SHARD_SERVER_STATE_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

struct sqlite3;

namespace zeroshard {

struct StoredMember {
  int rank = 0;
  std::string worker_id;
  std::string host;
  std::string token;
  bool left = false;
  bool dead = false;
};

struct StoredJob {
  std::string job_id;
  int world_size = 0;
  int64_t generation = 0;          // the current (possibly forming) generation
  int64_t members_generation = 0;  // the generation `members` belong to (0: none yet)
  int state = 0;                   // zeroshard.v1.JobState
  std::vector<StoredMember> members;
};

struct StoredPlan {
  std::string spec_hash;   // identifies the request (spec + options)
  std::string plan_bytes;  // serialized zeroshard.v1.ShardPlan
};

// Thread-safe (one connection behind a mutex).
class StateStore {
 public:
  // Opens or creates `path` and its schema.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& path);
  ~StateStore();

  // Inserts or replaces the job row and its members, in one transaction.
  absl::Status SaveJob(const StoredJob& job);
  absl::StatusOr<std::vector<StoredJob>> LoadJobs();

  absl::Status SavePlan(const std::string& job_id, int64_t generation, const StoredPlan& plan);
  absl::StatusOr<std::optional<StoredPlan>> LoadPlan(const std::string& job_id,
                                                     int64_t generation);

  // Runs `sql` (no results) — for components that keep their own tables.
  absl::Status Execute(const std::string& sql);
  sqlite3* db() { return db_; }  // REQUIRES: the caller holds mu()
  absl::Mutex* mu() { return &mu_; }

 private:
  explicit StateStore(sqlite3* db) : db_(db) {}
  absl::Status ExecuteLocked(const std::string& sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* db_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_STORE_H_
