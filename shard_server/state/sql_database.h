// SqlDatabase: the one SQLite layer of the server. A database file and its
// one connection, lent out under a mutex: SQL is reached only through
// Transaction() (writes, all or nothing) and Read() (queries), which lend
// the connection to a callback while the mutex is held. The state store
// (jobs, plans, the checkpoint registry's tables) and the history store
// (per-step curves, in another file) are both built on it.
//
// Errors name the database, the operation and SQLite's own message, e.g.
// "state store: save job: database or disk is full": a full disk is
// RESOURCE_EXHAUSTED, a database another process holds locked UNAVAILABLE
// (worth retrying), anything else INTERNAL.
#ifndef ZEROSHARD_SHARD_SERVER_STATE_SQL_DATABASE_H_
#define ZEROSHARD_SHARD_SERVER_STATE_SQL_DATABASE_H_

#include <cstdint>
#include <atomic>
#include <memory>
#include <string>
#include <utility>
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

class SqlReplication;

// A prepared statement. Made only by SqlDatabase::Connection::Prepare, and so
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
  Statement& BindDouble(int index, double value);

  // Steps to the next result row; false after the last row or on an error.
  bool Next();
  // Runs a statement that returns no rows; status().
  absl::Status Run();
  // Rewinds the statement to run it again; the bindings are kept.
  void Reset();
  // OK, or the first error.
  const absl::Status& status() const { return status_; }
  // Rows the last Run() changed (inserted, updated or deleted).
  int64_t Changes() const;

  // Columns of the current row, numbered from 0. NULL reads as "" and 0.
  std::string Text(int column) const;
  int64_t Int(int column) const;
  double Double(int column) const;
  bool IsNull(int column) const;

 private:
  friend class SqlDatabase;
  Statement(sqlite3* db, absl::string_view name, absl::string_view what, const char* sql,
            bool read_only);
  // Records SQLite's error for `code` unless an earlier one is recorded.
  void Fail(int code);

  sqlite3* db_;
  std::string where_;  // "<database>: <operation>", for error messages
  sqlite3_stmt* stmt_ = nullptr;
  absl::Status status_;
};

// One entry of a replicated database in its replica: a key ("schema", or
// "rows/<table>/<primary key>" as state/sql_replication.h makes them) and
// its value (a StateRows message, or the schema's SQL).
struct ReplicaEntry {
  std::string key;
  std::string value;
};

// What one transaction changed, as entries to put and keys to delete.
struct ReplicaBatch {
  std::vector<ReplicaEntry> puts;
  std::vector<std::string> deletes;
  bool empty() const { return puts.empty() && deletes.empty(); }
};

// Where a replicated database (SqlDatabase::OpenReplicated) keeps its
// committed state beside this process: one entry per row (or per page of a
// paged table's rows), written as the transactions change them. The etcd
// implementation (etcd_state.h) writes only while this server leads.
class DatabaseReplica {
 public:
  virtual ~DatabaseReplica() = default;
  // Every entry saved, in any order; none for a new cluster. An entry with
  // the key "image" is a whole database image (sqlite3_serialize) kept by an
  // older version: the database loads it and writes every row at its next
  // transaction.
  virtual absl::StatusOr<std::vector<ReplicaEntry>> Load() = 0;
  // Saves the batch so that a later Load sees all of it or none of it, or
  // fails (then the transaction that made it is rolled back here too).
  virtual absl::Status Save(const ReplicaBatch& batch) = 0;
};

// Tables kept as pages of rows rather than a row per entry: the rows whose
// last primary-key column (an integer) falls in [k * rows_per_page,
// (k + 1) * rows_per_page) share one entry. For a table of many small rows
// written together (a generation's members).
struct PagedTable {
  std::string table;
  int rows_per_page = 256;
};

// Thread-safe.
class SqlDatabase {
 public:
  // The connection, lent to a Transaction() or Read() body while the
  // database's mutex is held. Not copyable; invalid once the body returns.
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
    friend class SqlDatabase;
    Connection(sqlite3* db, absl::string_view name, bool read_only)
        : db_(db), name_(name), read_only_(read_only) {}
    sqlite3* const db_;
    const absl::string_view name_;  // the database's, for error messages
    const bool read_only_;
  };
  using Body = absl::FunctionRef<absl::Status(Connection& db)>;

  // kFull: a commit is durable before Transaction() returns (the server's
  // state). kOff: not fsynced; a crash may lose the last commits, never
  // corrupt the file (history).
  enum class Durability { kFull, kOff };

  // SQLite's default: the WAL is copied into the database once it holds
  // this many pages (4 KiB each).
  static constexpr int kCheckpointPages = 1000;

  // Opens or creates `path` (":memory:" keeps it in memory) in WAL mode.
  // `name` ("state store") starts every error message. UNAVAILABLE when the
  // file cannot be opened. kFull on a file: no commit copies the WAL into the
  // database (a checkpoint, which fsyncs both, would run under the mutex of
  // whoever commits); Sync() does, on a connection of its own, once the WAL
  // holds `checkpoint_pages`, so the WAL stays bounded.
  static absl::StatusOr<std::unique_ptr<SqlDatabase>> Open(
      const std::string& path, absl::string_view name, Durability durability,
      int checkpoint_pages = kCheckpointPages);
  // An in-memory database that starts as `replica`'s last saved state and
  // saves every transaction's changed rows to it before committing; a
  // transaction the replica does not save is rolled back and returns the
  // replica's error. `replica` outlives the database.
  // `paged`: tables kept as pages of rows.
  static absl::StatusOr<std::unique_ptr<SqlDatabase>> OpenReplicated(
      DatabaseReplica* replica, absl::string_view name, std::vector<PagedTable> paged = {});
  ~SqlDatabase();

  SqlDatabase(const SqlDatabase&) = delete;
  SqlDatabase& operator=(const SqlDatabase&) = delete;

  // Runs `body` as one SQLite transaction: every write of it is committed
  // or, when `body` or the commit fails, none is; that error is returned.
  // `body` must not call the database (its mutex is held). Durable on return
  // (TransactionSyncedLater, then Sync).
  absl::Status Transaction(Body body) ABSL_LOCKS_EXCLUDED(mu_, sync_mu_);
  // As Transaction(), but with kFull the commit is only written (to the WAL
  // in the page cache, ~0.1 ms), not yet durable: it is once Sync(n) returns
  // for an n >= LastCommit() read after it. A caller that commits under a
  // lock of its own syncs after releasing that lock, so that nothing waiting
  // for the lock waits for the disk, and the callers syncing at once share
  // one fsync (group commit). The data is in the file either way: a crash of
  // the process loses nothing; a crash of the machine may lose what no Sync
  // covered, and nobody was told of it.
  absl::Status TransactionSyncedLater(Body body) ABSL_LOCKS_EXCLUDED(mu_);
  // The sequence number of the last commit (0: none yet).
  int64_t LastCommit() const { return committed_.load(std::memory_order_acquire); }
  // Makes every commit up to `commit` durable (fdatasync of the WAL file);
  // returns at once when a Sync already covered it, and for kOff and
  // replicated databases. UNAVAILABLE when the disk refuses. Then, when the
  // WAL holds checkpoint_pages and no other caller is at it, checkpoints it
  // (a failed checkpoint is tried again by a later Sync).
  absl::Status Sync(int64_t commit) ABSL_LOCKS_EXCLUDED(sync_mu_, checkpoint_mu_);
  // Pages in the WAL after the last commit (kFull on a file; 0 otherwise).
  int wal_pages() const { return wal_pages_.load(std::memory_order_relaxed); }
  // Checkpoints Sync() completed: for tests.
  int64_t checkpoints() const { return checkpoints_.load(std::memory_order_relaxed); }
  // Runs `body`'s queries, which see what the last transaction committed.
  // A statement that would write fails: writes need Transaction().
  absl::Status Read(Body body) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  SqlDatabase(sqlite3* db, std::string name);
  absl::Status TransactionLocked(Body body) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ExecuteLocked(absl::string_view what, const char* sql)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces the database's content with `image` ("" : empty).
  absl::Status DeserializeLocked(absl::string_view image) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before a commit: saves what the open transaction changed to replica_.
  absl::Status ReplicateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sync() without the checkpoint.
  absl::Status SyncWal(int64_t commit) ABSL_LOCKS_EXCLUDED(sync_mu_);
  // Sync()'s checkpoint, when the WAL is due one and nobody runs one.
  void MaybeCheckpoint() ABSL_LOCKS_EXCLUDED(checkpoint_mu_);

  absl::Mutex mu_;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
  const std::string name_;
  DatabaseReplica* replica_ = nullptr;  // null: not replicated
  // What each transaction changed, for replica_ (sql_replication.h).
  std::unique_ptr<SqlReplication> replication_ ABSL_GUARDED_BY(mu_);
  // Group commit (kFull on a file): the WAL file whose fdatasync makes
  // commits durable; "" when commits need no sync.
  std::string wal_path_;
  std::atomic<int64_t> committed_{0};  // commits so far (written under mu_)
  absl::Mutex sync_mu_;                // one fdatasync at a time
  // Commits a sync covered; written under sync_mu_, read without it so that
  // a caller whose commit is durable never waits behind a running sync.
  std::atomic<int64_t> synced_{0};
  int wal_fd_ ABSL_GUARDED_BY(sync_mu_) = -1;     // opened at the first Sync
  // Checkpoints (kFull on a file): a second connection, so that copying the
  // WAL into the database and its fsyncs hold neither mu_ nor sync_mu_
  // (SQLite's PASSIVE checkpoint runs beside the writer).
  int checkpoint_pages_ = kCheckpointPages;
  std::string path_;
  std::atomic<int> wal_pages_{0};  // set by the WAL hook after each commit
  std::atomic<int64_t> checkpoints_{0};
  absl::Mutex checkpoint_mu_;
  sqlite3* checkpointer_ ABSL_GUARDED_BY(checkpoint_mu_) = nullptr;  // opened at the first one
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_SQL_DATABASE_H_
