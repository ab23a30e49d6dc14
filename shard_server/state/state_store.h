// Durable server state in one SQLite file (or, with --etcd_endpoints, an
// in-memory SQLite database whose rows etcd keeps as keys: OpenReplicated): jobs,
// their current generation and the members of the last formed generation,
// why each recent generation began, their goodput ledgers, and shard plans. Other
// components (the checkpoint registry) keep their own tables in the same
// file. A restarted server loads it and still knows its jobs.
//
// The store is a SqlDatabase (sql_database.h) with this schema: SQL is
// reached only through Transaction() (writes, all or nothing, durable) and
// Read() (queries). Errors name the operation and SQLite's own message, e.g.
// "state store: save job: database or disk is full".
#ifndef ZEROSHARD_SHARD_SERVER_STATE_STATE_STORE_H_
#define ZEROSHARD_SHARD_SERVER_STATE_STATE_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shard_server/state/sql_database.h"

namespace zeroshard {

struct StoredMember {
  int rank = 0;
  std::string worker_id;
  std::string host;
  std::string token;
  bool left = false;
  bool dead = false;
  std::string node;  // "<hostname> <boot id>" (JoinRequest.node); "" before it was kept
  // The step, loss and last step's telemetry it ended at (the counts of
  // skipped steps, rewinds, corrupted shards): saved for a member that left or died
  // (what status shows of it after a restart); 0 for a live member, whose
  // beats say (saving them would rewrite every member row at every save).
  int64_t step = 0;
  double loss = 0;
  std::string last_step;  // its last step's telemetry (a serialized StepTelemetry)
};

// Why a job moved to a generation (shardctl status's "generations"): `seq`
// numbers a job's entries in order (a generation may have two: a death,
// then the shrink that formed it).
struct StoredGenerationChange {
  int64_t seq = 0;
  int64_t generation = 0;
  int64_t unix_ms = 0;
  std::string reason;
};

// A machine fenced from a job (EvictHost: docs/numerics.md).
struct StoredFence {
  std::string node;
  std::string reason;
  int rank = 0;
  int64_t step = 0;
  int64_t unix_ms = 0;
};

struct StoredJob {
  std::string job_id;
  int world_size = 0;
  int64_t generation = 0;          // the current (possibly forming) generation
  int64_t members_generation = 0;  // the generation `members` belong to (0: none yet)
  int state = 0;                   // zeroshard.v1.JobState
  // The world size its workers were started with (world_size is smaller
  // after a shrink); 0: not recorded (a database from before), world_size.
  int target_world_size = 0;
  std::vector<StoredMember> members;
  std::vector<StoredFence> fences;  // by node
  // The last few, oldest first; SaveJob keeps exactly these.
  std::vector<StoredGenerationChange> history;
};

struct StoredPlan {
  std::string spec_hash;   // identifies the request (spec + options)
  std::string plan_bytes;  // serialized zeroshard.v1.ShardPlan
};

// Thread-safe.
class StateStore {
 public:
  // The store's connection, lent to a Transaction() or Read() body while the
  // store's mutex is held (sql_database.h).
  using Connection = SqlDatabase::Connection;
  using Body = SqlDatabase::Body;

  // Opens or creates `path` and its schema.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& path);
  // In memory, starting from `replica`'s last saved state and saving every
  // transaction's changed rows to it (SqlDatabase::OpenReplicated): the
  // etcd-backed store of a leading server. Members are kept as pages of
  // kMembersPerPage ranks. `replica` outlives the store.
  static constexpr int kMembersPerPage = 256;
  static absl::StatusOr<std::unique_ptr<StateStore>> OpenReplicated(DatabaseReplica* replica);
  ~StateStore() = default;

  // Runs `body` as one SQLite transaction: every write of it is committed,
  // durably, or, when `body` or the commit fails, none is; that error is
  // returned. `body` must not call the store (its mutex is held).
  absl::Status Transaction(Body body) { return db_->Transaction(body); }
  int64_t LastCommit() const { return db_->LastCommit(); }
  absl::Status Sync(int64_t commit) { return db_->Sync(commit); }
  // Runs `body`'s queries, which see what the last transaction committed.
  // A statement that would write fails: writes need Transaction().
  absl::Status Read(Body body) { return db_->Read(body); }

  // Inserts or replaces the job row, its members, its fences and its
  // generation history, in one transaction.
  // SaveJob and DeleteJob commit without waiting for the disk: durable once
  // Sync(LastCommit()) returns (Membership commits under its lock and syncs
  // after releasing it, before it answers anyone: sql_database.h).
  absl::Status SaveJob(const StoredJob& job);
  absl::StatusOr<std::vector<StoredJob>> LoadJobs();
  // Forgets the job: its row, its members, its plans and its goodput ledger,
  // in one transaction.
  absl::Status DeleteJob(const std::string& job_id);

  // The goodput table: a job's time ledger (a serialized
  // zeroshard.v1.GoodputState: shard_server/goodput/), one small row per
  // job apart from its jobs row, which SaveJob rewrites with its member pages
  // (too costly every few seconds at 100,000 ranks). Committed without
  // waiting for the disk, as SaveJob. An equal row is not written again.
  absl::Status SaveGoodput(const std::string& job_id, const std::string& state);
  // Every saved ledger, by job id.
  absl::StatusOr<std::map<std::string, std::string>> LoadGoodput();

  absl::Status SavePlan(const std::string& job_id, int64_t generation, const StoredPlan& plan);
  absl::StatusOr<std::optional<StoredPlan>> LoadPlan(const std::string& job_id,
                                                     int64_t generation);
  // The plan of the job's newest planned generation (none: nullopt): what
  // status shows after a restart or a failover, before any rank asks again.
  absl::StatusOr<std::optional<StoredPlan>> LoadLatestPlan(const std::string& job_id);

 private:
  explicit StateStore(std::unique_ptr<SqlDatabase> db) : db_(std::move(db)) {}
  static absl::StatusOr<std::unique_ptr<StateStore>> WithSchema(
      absl::StatusOr<std::unique_ptr<SqlDatabase>> db, absl::string_view where);

  const std::unique_ptr<SqlDatabase> db_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_STATE_STORE_H_
