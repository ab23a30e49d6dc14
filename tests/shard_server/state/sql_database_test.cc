// SqlDatabase's WAL (kFull on a file): no commit copies the WAL into the
// database (SQLite's automatic checkpoint would, fsyncing under the mutex of
// whoever commits: the membership lock); Sync() does, on a connection of its
// own, so the WAL stays bounded and nothing is lost. A real SQLite file, on
// tmpfs where there is one (every Sync is an fdatasync).
#include "shard_server/state/sql_database.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

constexpr int kPageBytes = 4096;              // SQLite's default page size
constexpr int kFrameBytes = kPageBytes + 24;  // a WAL frame: its header and one page
constexpr int kRowBytes = 2000;               // each commit writes at least one page

std::string TempDir() {
  if (access("/dev/shm", W_OK) == 0) {
    std::string dir = "/dev/shm/sql_database_test.XXXXXX";
    if (mkdtemp(dir.data()) != nullptr) return dir;
  }
  return testing::MakeTempDir("sql_database");
}

int64_t FileBytes(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

class SqlDatabaseWalTest : public ::testing::Test {
 protected:
  void TearDown() override {
    db_.reset();
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  void Open(int checkpoint_pages) {
    dir_ = TempDir();
    path_ = dir_ + "/state.db";
    auto db = SqlDatabase::Open(path_, "test", SqlDatabase::Durability::kFull, checkpoint_pages);
    ASSERT_TRUE(db.ok()) << db.status();
    db_ = *std::move(db);
    ASSERT_TRUE(db_->Transaction([](SqlDatabase::Connection& c) {
                     return c.Execute("create", "CREATE TABLE t (x INTEGER, b BLOB)");
                   }).ok());
  }

  void Commit(int64_t x) {
    ASSERT_TRUE(db_->TransactionSyncedLater([x](SqlDatabase::Connection& c) {
                     return c.Prepare("insert", "INSERT INTO t VALUES (?, ?)")
                         .Bind(1, x)
                         .BindBlob(2, std::string(kRowBytes, 'z'))
                         .Run();
                   }).ok());
  }

  int64_t Rows(SqlDatabase& db) {
    int64_t rows = -1;
    EXPECT_TRUE(db.Read([&](SqlDatabase::Connection& c) {
                    Statement count = c.Prepare("count", "SELECT COUNT(*) FROM t");
                    if (count.Next()) rows = count.Int(0);
                    return count.status();
                  }).ok());
    return rows;
  }

  std::string dir_;
  std::string path_;
  std::unique_ptr<SqlDatabase> db_;
};

TEST_F(SqlDatabaseWalTest, CommitsNeverCheckpointASyncDoes) {
  Open(/*checkpoint_pages=*/50);
  // Past SQLite's own automatic checkpoint (1,000 pages), which would have
  // started the WAL again inside a commit.
  const int commits = SqlDatabase::kCheckpointPages + 100;
  for (int i = 0; i < commits; ++i) Commit(i);
  EXPECT_GE(db_->wal_pages(), commits);
  EXPECT_EQ(db_->checkpoints(), 0);

  ASSERT_TRUE(db_->Sync(db_->LastCommit()).ok());
  EXPECT_EQ(db_->checkpoints(), 1);
  Commit(commits);  // the WAL starts again from its beginning
  EXPECT_LT(db_->wal_pages(), 10);
  EXPECT_EQ(Rows(*db_), commits + 1);
}

TEST_F(SqlDatabaseWalTest, SyncKeepsTheWalBoundedAndLosesNothing) {
  const int checkpoint_pages = 50;
  Open(checkpoint_pages);
  const int commits = 2000;  // ~2,000 WAL pages (8 MiB) were nothing copied back
  for (int i = 0; i < commits; ++i) {
    Commit(i);
    ASSERT_TRUE(db_->Sync(db_->LastCommit()).ok());
  }
  // The WAL file is never shrunk: its size is the most frames it ever held,
  // one commit past the checkpoint threshold (and the header).
  EXPECT_LE(FileBytes(path_ + "-wal"), 2 * checkpoint_pages * kFrameBytes);
  EXPECT_GE(db_->checkpoints(), commits / (checkpoint_pages + 2));

  db_.reset();  // every commit is in the database file or its WAL
  auto reopened = SqlDatabase::Open(path_, "test", SqlDatabase::Durability::kFull);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  db_ = *std::move(reopened);
  EXPECT_EQ(Rows(*db_), commits);
}

}  // namespace
}  // namespace zeroshard
