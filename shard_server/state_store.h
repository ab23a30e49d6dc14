// Durable server state in one SQLite file: jobs, their current generation and
// the members of the last formed generation, and shard plans. Other
// components (the checkpoint registry) keep their own tables in the same
// file. A restarted server loads it and still knows its jobs.
//
// Every statement runs on the store's one connection while the store's mutex
// is held: SQL is reached only through Transaction() (writes, all or nothing)
// and Read() (queries), which lend the connection to a callback under the
// mutex. Errors name the operation and SQLite's own message, e.g.
// "state store: save job: database or disk is full".
#ifndef ZEROSHARD_SHARD_SERVER_STATE_STORE_H_
#define ZEROSHARD_SHARD_SERVER_STATE_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

struct sqlite3;
struct sqlite3_stmt;

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
  // The world size its workers were started with (world_size is smaller
  // after a shrink); 0: not recorded (a database from before), world_size.
  int target_world_size = 0;
  std::vector<StoredMember> members;
};

struct StoredPlan {
  std::string spec_hash;   // identifies the request (spec + options)
  std::string plan_bytes;  // serialized zeroshard.v1.ShardPlan
};

// A prepared statement. Made only by StateStore::Connection::Prepare, and so
// used only inside a Transaction() or Read() body; it must not outlive it.
// Errors (preparing, binding, stepping) are kept, as a LevelDB iterator
// keeps them: the first one is status(), and Next() then returns false.
class Statement {
 public:
  Statement(Statement&& other) noexcept;
  Statement& operator=(Statement&&) = delete;
  ~Statement();

  // Parameters are numbered from 1, as in SQL ("?1", or the N-th "?").
  Statement& Bind(int index, absl::string_view text);
  Statement& BindBlob(int index, absl::string_view bytes);
  Statement& Bind(int index, int64_t value);

  // Steps to the next result row; false after the last row or on an error.
  bool Next();
  // Runs a statement that returns no rows; status().
  absl::Status Run();
  // Rewinds the statement to run it again; the bindings are kept.
  void Reset();
  // OK, or the first error.
  const absl::Status& status() const { return status_; }

  // Columns of the current row, numbered from 0. NULL reads as "" and 0.
  std::string Text(int column) const;
  int64_t Int(int column) const;
  bool IsNull(int column) const;

 private:
  friend class StateStore;
  Statement(sqlite3* db, absl::string_view what, const char* sql, bool read_only);
  // Records SQLite's error for `code` unless an earlier one is recorded.
  void Fail(int code);

  sqlite3* db_;
  std::string what_;  // the operation, for error messages
  sqlite3_stmt* stmt_ = nullptr;
  absl::Status status_;
};

// Thread-safe.
class StateStore {
 public:
  // The store's connection, lent to a Transaction() or Read() body while the
  // store's mutex is held. Not copyable; invalid once the body returns.
  class Connection {
   public:
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    // `what` names the operation in error messages ("save job"). In a
    // Read(), a statement that would write fails (status()).
    Statement Prepare(absl::string_view what, const char* sql);
    // Runs statements that return no rows (a schema). Transaction() only.
    absl::Status Execute(absl::string_view what, const char* sql);

   private:
    friend class StateStore;
    Connection(sqlite3* db, bool read_only) : db_(db), read_only_(read_only) {}

    sqlite3* const db_;
    const bool read_only_;
  };
  using Body = absl::FunctionRef<absl::Status(Connection& db)>;

  // Opens or creates `path` and its schema.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& path);
  ~StateStore();

  // Runs `body` as one SQLite transaction: every write of it is committed,
  // durably, or, when `body` or the commit fails, none is; that error is
  // returned. `body` must not call the store (its mutex is held).
  absl::Status Transaction(Body body) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `body`'s queries, which see what the last transaction committed.
  // A statement that would write fails: writes need Transaction().
  absl::Status Read(Body body) ABSL_LOCKS_EXCLUDED(mu_);

  // Inserts or replaces the job row and its members, in one transaction.
  absl::Status SaveJob(const StoredJob& job) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<StoredJob>> LoadJobs() ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the job: its row, its members and its plans, in one transaction.
  absl::Status DeleteJob(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status SavePlan(const std::string& job_id, int64_t generation, const StoredPlan& plan)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::optional<StoredPlan>> LoadPlan(const std::string& job_id, int64_t generation)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit StateStore(sqlite3* db) : db_(db) {}
  absl::Status ExecuteLocked(absl::string_view what, const char* sql)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_STORE_H_
