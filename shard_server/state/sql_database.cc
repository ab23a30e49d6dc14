#include "shard_server/state/sql_database.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "shard_server/state/sql_replication.h"

namespace zeroshard {
namespace {

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

absl::Status SqliteError(int code, absl::string_view where, absl::string_view message) {
  return absl::Status(StatusCodeOf(code), absl::StrCat(where, ": ", message));
}

// Runs `sql` (statements without results) on `db`.
absl::Status ExecuteSql(sqlite3* db, absl::string_view name, absl::string_view what,
                        const char* sql) {
  char* error = nullptr;
  int code = sqlite3_exec(db, sql, nullptr, nullptr, &error);
  if (code == SQLITE_OK) return absl::OkStatus();
  std::string message = error != nullptr ? error : sqlite3_errstr(code);
  sqlite3_free(error);
  return SqliteError(sqlite3_extended_errcode(db), absl::StrCat(name, ": ", what), message);
}

}  // namespace

// ---------------------------------------------------------------------------
// Statement

Statement::Statement(sqlite3* db, absl::string_view name, absl::string_view what, const char* sql,
                     bool read_only)
    : db_(db), where_(absl::StrCat(name, ": ", what)) {
  int code = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  if (code != SQLITE_OK) {
    Fail(code);
    sqlite3_finalize(stmt_);
    stmt_ = nullptr;
  } else if (read_only && !sqlite3_stmt_readonly(stmt_)) {
    status_ = absl::InternalError(
        absl::StrCat(where_, ": a statement that writes in Read(); use Transaction()"));
  }
}

Statement::Statement(Statement&& other) noexcept
    : db_(other.db_),
      where_(std::move(other.where_)),
      stmt_(std::exchange(other.stmt_, nullptr)),
      status_(std::move(other.status_)) {}

Statement::~Statement() { sqlite3_finalize(stmt_); }

void Statement::Fail(int code) {
  if (!status_.ok()) return;
  status_ = SqliteError(code, where_, sqlite3_errmsg(db_));
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

Statement& Statement::BindDouble(int index, double value) {
  if (!status_.ok()) return *this;
  int code = sqlite3_bind_double(stmt_, index, value);
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

int64_t Statement::Changes() const { return sqlite3_changes(db_); }

std::string Statement::Text(int column) const {
  // sqlite3_column_blob reads TEXT and BLOB columns alike, embedded NULs
  // included.
  const void* p = sqlite3_column_blob(stmt_, column);
  int n = sqlite3_column_bytes(stmt_, column);
  return p == nullptr ? std::string() : std::string(static_cast<const char*>(p), n);
}

int64_t Statement::Int(int column) const { return sqlite3_column_int64(stmt_, column); }

double Statement::Double(int column) const { return sqlite3_column_double(stmt_, column); }

bool Statement::IsNull(int column) const {
  return sqlite3_column_type(stmt_, column) == SQLITE_NULL;
}

// ---------------------------------------------------------------------------
// SqlDatabase

Statement SqlDatabase::Connection::Prepare(absl::string_view what, const char* sql) {
  return Statement(db_, name_, what, sql, read_only_);
}

absl::Status SqlDatabase::Connection::Execute(absl::string_view what, const char* sql) {
  if (read_only_) {
    return absl::InternalError(
        absl::StrCat(name_, ": ", what, ": Execute() in Read(); use Transaction()"));
  }
  return ExecuteSql(db_, name_, what, sql);
}

absl::StatusOr<std::unique_ptr<SqlDatabase>> SqlDatabase::Open(const std::string& path,
                                                               absl::string_view name,
                                                               Durability durability,
                                                               int checkpoint_pages) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat(name, ": cannot open ", path, ": ", msg));
  }
  sqlite3_busy_timeout(db, 5000);
  std::unique_ptr<SqlDatabase> database(new SqlDatabase(db, std::string(name)));
  absl::MutexLock lock(&database->mu_);
  // WAL keeps readers and the writer apart. kFull: synchronous=NORMAL writes
  // a commit to the WAL without fsync (and syncs the WAL before each
  // checkpoint copies it into the database); Sync() makes commits durable.
  const char* synchronous =
      durability == Durability::kFull ? "PRAGMA synchronous=NORMAL;" : "PRAGMA synchronous=OFF;";
  if (durability == Durability::kFull && path != ":memory:") database->wal_path_ = path + "-wal";
  for (const char* sql : {"PRAGMA journal_mode=WAL;", synchronous}) {
    absl::Status s = database->ExecuteLocked("open", sql);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  if (!database->wal_path_.empty()) {
    // The hook replaces SQLite's automatic checkpoint (itself a WAL hook),
    // which would copy the WAL and fsync under mu_ in a COMMIT; it only
    // notes the WAL's size, and Sync() checkpoints.
    database->path_ = path;
    database->checkpoint_pages_ = std::max(1, checkpoint_pages);
    sqlite3_wal_hook(
        db,
        [](void* self, sqlite3*, const char*, int pages) {
          static_cast<SqlDatabase*>(self)->wal_pages_.store(pages, std::memory_order_relaxed);
          return SQLITE_OK;
        },
        database.get());
  }
  return database;
}

SqlDatabase::SqlDatabase(sqlite3* db, std::string name) : db_(db), name_(std::move(name)) {}

SqlDatabase::~SqlDatabase() {
  {
    absl::MutexLock lock(&sync_mu_);
    if (wal_fd_ >= 0) close(wal_fd_);
  }
  {
    absl::MutexLock lock(&checkpoint_mu_);
    sqlite3_close(checkpointer_);  // a no-op for null
  }
  absl::MutexLock lock(&mu_);
  replication_.reset();  // its session, if any, before the connection
  sqlite3_close(db_);
}

absl::Status SqlDatabase::ExecuteLocked(absl::string_view what, const char* sql) {
  return ExecuteSql(db_, name_, what, sql);
}

absl::Status SqlDatabase::Transaction(Body body) {
  absl::Status status = TransactionSyncedLater(body);
  if (!status.ok()) return status;
  return Sync(LastCommit());
}

absl::Status SqlDatabase::TransactionSyncedLater(Body body) {
  absl::MutexLock lock(&mu_);
  absl::Status status = TransactionLocked(body);
  if (status.ok()) committed_.fetch_add(1, std::memory_order_release);
  return status;
}

absl::Status SqlDatabase::Sync(int64_t commit) {
  if (wal_path_.empty()) return absl::OkStatus();
  absl::Status synced = SyncWal(commit);
  MaybeCheckpoint();  // after: the caller's commit is durable first
  return synced;
}

absl::Status SqlDatabase::SyncWal(int64_t commit) {
  if (synced_.load(std::memory_order_acquire) >= commit) return absl::OkStatus();
  absl::MutexLock lock(&sync_mu_);
  // A sync while we waited may have covered it.
  if (synced_.load(std::memory_order_acquire) >= commit) return absl::OkStatus();
  // Every commit counted so far is in the WAL's pages: this sync covers them.
  const int64_t covered = LastCommit();
  if (wal_fd_ < 0) wal_fd_ = open(wal_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (wal_fd_ < 0 || fdatasync(wal_fd_) != 0) {
    const int error = errno;
    return absl::UnavailableError(absl::StrCat(name_, ": cannot sync ", wal_path_, ": ",
                                               std::strerror(error),
                                               "; the last changes may not survive a crash"));
  }
  synced_.store(covered, std::memory_order_release);
  return absl::OkStatus();
}

void SqlDatabase::MaybeCheckpoint() {
  if (wal_pages_.load(std::memory_order_relaxed) < checkpoint_pages_) return;
  // One at a time; a caller that finds one running goes on (it would find
  // nothing left to copy).
  if (!checkpoint_mu_.TryLock()) return;
  if (checkpointer_ == nullptr) {
    // A read first: a connection opens the WAL only once it reads the
    // database, and a checkpoint without it copies nothing.
    if (sqlite3_open_v2(path_.c_str(), &checkpointer_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX,
                        nullptr) != SQLITE_OK ||
        sqlite3_exec(checkpointer_, "SELECT COUNT(*) FROM sqlite_master;", nullptr, nullptr,
                     nullptr) != SQLITE_OK) {
      sqlite3_close(checkpointer_);  // a later Sync tries again
      checkpointer_ = nullptr;
    }
  }
  int wal_frames = 0;
  int copied = 0;
  // PASSIVE: copies what no reader still needs, never waits for the writer
  // (which goes on committing to the WAL meanwhile). With every frame copied,
  // the writer's next commit starts the WAL again from its beginning.
  if (checkpointer_ != nullptr &&
      sqlite3_wal_checkpoint_v2(checkpointer_, "main", SQLITE_CHECKPOINT_PASSIVE, &wal_frames,
                                &copied) == SQLITE_OK &&
      wal_frames >= 0 && copied == wal_frames) {
    checkpoints_.fetch_add(1, std::memory_order_relaxed);
    wal_pages_.store(0, std::memory_order_relaxed);  // until the next commit's hook
  }
  checkpoint_mu_.Unlock();
}

absl::Status SqlDatabase::TransactionLocked(Body body) {
  // IMMEDIATE takes the write lock now: a transaction never fails half-way
  // because another connection started writing first.
  absl::Status status = ExecuteLocked("begin transaction", "BEGIN IMMEDIATE;");
  if (!status.ok()) return status;
  if (replication_ != nullptr) status = replication_->Begin();
  Connection connection(db_, name_, /*read_only=*/false);
  if (status.ok()) status = body(connection);
  // Replicated: the rows it changed are saved before it commits here, so
  // that what this server serves is never ahead of what a successor loads.
  if (status.ok() && replica_ != nullptr) status = ReplicateLocked();
  if (status.ok()) status = ExecuteLocked("commit", "COMMIT;");
  // After some errors (a full disk, an I/O error) SQLite has already rolled
  // the transaction back; after the others it is still open.
  if (!status.ok() && sqlite3_get_autocommit(db_) == 0) {
    ExecuteLocked("rollback", "ROLLBACK;").IgnoreError();
  }
  return status;
}

absl::StatusOr<std::unique_ptr<SqlDatabase>> SqlDatabase::OpenReplicated(
    DatabaseReplica* replica, absl::string_view name, std::vector<PagedTable> paged) {
  absl::StatusOr<std::vector<ReplicaEntry>> entries = replica->Load();
  if (!entries.ok()) {
    return absl::Status(entries.status().code(),
                        absl::StrCat(name, ": load: ", entries.status().message()));
  }
  absl::StatusOr<std::unique_ptr<SqlDatabase>> database =
      Open(":memory:", name, Durability::kOff);  // durability is the replica's
  if (!database.ok()) return database.status();
  SqlDatabase& db = **database;
  absl::MutexLock lock(&db.mu_);
  db.replication_ = std::make_unique<SqlReplication>(db.db_, std::string(name), std::move(paged));
  if (entries->size() == 1 && (*entries)[0].key == "image") {
    // An older version's whole image: loaded, and written as rows next.
    if (absl::Status s = db.DeserializeLocked((*entries)[0].value); !s.ok()) return s;
    db.replication_->WriteEverythingNext();
  } else if (absl::Status s = db.replication_->Load(*entries); !s.ok()) {
    return s;
  }
  db.replica_ = replica;
  return database;
}

absl::Status SqlDatabase::DeserializeLocked(absl::string_view image) {
  // SQLite owns (and may grow) the buffer from here on.
  auto* bytes = static_cast<unsigned char*>(sqlite3_malloc64(std::max<size_t>(image.size(), 1)));
  if (bytes == nullptr) return absl::ResourceExhaustedError(absl::StrCat(name_, ": out of memory"));
  std::memcpy(bytes, image.data(), image.size());
  int code = sqlite3_deserialize(db_, "main", bytes, image.size(), std::max<size_t>(image.size(), 1),
                                 SQLITE_DESERIALIZE_FREEONCLOSE | SQLITE_DESERIALIZE_RESIZEABLE);
  if (code != SQLITE_OK) {
    return SqliteError(code, absl::StrCat(name_, ": load image"), sqlite3_errmsg(db_));
  }
  return absl::OkStatus();
}

absl::Status SqlDatabase::ReplicateLocked() {
  absl::StatusOr<ReplicaBatch> batch = replication_->Collect();
  if (!batch.ok()) {
    replication_->Saved(false);
    return batch.status();
  }
  if (batch->empty()) {  // nothing changed: no write
    replication_->Saved(true);
    return absl::OkStatus();
  }
  absl::Status saved = replica_->Save(*batch);
  replication_->Saved(saved.ok());
  if (saved.ok()) return saved;
  // Nothing of the transaction may stay: what is not saved did not happen.
  return absl::Status(saved.code(), absl::StrCat(name_, ": not saved: ", saved.message()));
}

absl::Status SqlDatabase::Read(Body body) {
  absl::MutexLock lock(&mu_);
  Connection connection(db_, name_, /*read_only=*/true);
  return body(connection);
}

}  // namespace zeroshard
