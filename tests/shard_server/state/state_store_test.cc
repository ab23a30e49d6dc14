// StateStore: transactions are all or nothing, reads cannot write, and a
// failed save names SQLite's error and keeps what was saved before. A real
// SQLite file in a temporary directory.
#include "shard_server/state/state_store.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "tests/testing/state_faults.h"

namespace zeroshard {
namespace {

class StateStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::MakeTempDir("state_store") + "/state.db";
    auto store = StateStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    ASSERT_TRUE(store_
                    ->Transaction([](StateStore::Connection& db) {
                      return db.Execute("create table",
                                        "CREATE TABLE t (x INTEGER NOT NULL, y TEXT)");
                    })
                    .ok());
  }

  absl::Status Insert(StateStore::Connection& db, int64_t x) {
    return db.Prepare("insert", "INSERT INTO t(x) VALUES (?)").Bind(1, x).Run();
  }

  int64_t Rows() {
    int64_t rows = -1;
    absl::Status s = store_->Read([&](StateStore::Connection& db) {
      Statement count = db.Prepare("count", "SELECT COUNT(*) FROM t");
      if (count.Next()) rows = count.Int(0);
      return count.status();
    });
    EXPECT_TRUE(s.ok()) << s;
    return rows;
  }

  StoredJob Job(int64_t generation, int members) {
    StoredJob job;
    job.job_id = "job";
    job.world_size = members;
    job.generation = generation;
    job.members_generation = generation;
    for (int r = 0; r < members; ++r) {
      job.members.push_back({r, absl::StrCat("w", r), "host", absl::StrCat("token", r)});
    }
    return job;
  }

  std::string path_;
  std::unique_ptr<StateStore> store_;
};

TEST_F(StateStoreTest, TransactionCommitsEveryWriteOfItsBody) {
  absl::Status s = store_->Transaction([&](StateStore::Connection& db) {
    if (absl::Status s = Insert(db, 1); !s.ok()) return s;
    return Insert(db, 2);
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Rows(), 2);
}

TEST_F(StateStoreTest, TransactionWritesNothingWhenItsBodyFails) {
  absl::Status s = store_->Transaction([&](StateStore::Connection& db) {
    if (absl::Status s = Insert(db, 1); !s.ok()) return s;
    return absl::FailedPreconditionError("the caller changed its mind");
  });
  EXPECT_EQ(s, absl::FailedPreconditionError("the caller changed its mind"));
  EXPECT_EQ(Rows(), 0);
}

TEST_F(StateStoreTest, TransactionWritesNothingWhenAStatementFailsAndNamesSqlitesError) {
  absl::Status s = store_->Transaction([&](StateStore::Connection& db) {
    if (absl::Status s = Insert(db, 1); !s.ok()) return s;
    return db.Prepare("insert a row without x", "INSERT INTO t(y) VALUES ('no x')").Run();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("state store: insert a row without x: NOT NULL constraint failed"),
            std::string::npos)
      << s;
  EXPECT_EQ(Rows(), 0);
}

TEST_F(StateStoreTest, StatementThatDoesNotPrepareFailsWhenRun) {
  absl::Status s = store_->Transaction([](StateStore::Connection& db) {
    return db.Prepare("broken", "INSERT INTO no_such_table VALUES (1)").Bind(1, int64_t{1}).Run();
  });
  EXPECT_NE(s.message().find("state store: broken: no such table: no_such_table"),
            std::string::npos)
      << s;
}

TEST_F(StateStoreTest, ReadRefusesAStatementThatWrites) {
  absl::Status s = store_->Read([&](StateStore::Connection& db) { return Insert(db, 1); });
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("use Transaction()"), std::string::npos) << s;
  EXPECT_EQ(Rows(), 0);
}

TEST_F(StateStoreTest, FullDatabaseIsResourceExhaustedNamingSqlitesError) {
  // The database may not grow by a page: a 1 MiB value needs hundreds.
  absl::Status limited = store_->Transaction([](StateStore::Connection& db) {
    Statement pages = db.Prepare("page count", "PRAGMA page_count");
    if (!pages.Next()) return pages.status();
    const std::string limit = absl::StrCat("PRAGMA max_page_count = ", pages.Int(0));
    return db.Prepare("limit", limit.c_str()).Run();
  });
  ASSERT_TRUE(limited.ok()) << limited;
  absl::Status s = store_->Transaction([](StateStore::Connection& db) {
    return db.Prepare("insert a large row", "INSERT INTO t(x, y) VALUES (1, ?)")
        .Bind(1, std::string(1 << 20, 'y'))
        .Run();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("database or disk is full"), std::string::npos) << s;
  EXPECT_EQ(Rows(), 0);
}

TEST_F(StateStoreTest, FailedSaveNamesSqlitesErrorAndKeepsTheJobSavedBefore) {
  ASSERT_TRUE(store_->SaveJob(Job(1, 3)).ok());
  ASSERT_TRUE(testing::RefuseJobSaves(path_).ok());
  absl::Status s = store_->SaveJob(Job(2, 1));
  EXPECT_NE(s.message().find(absl::StrCat("state store: save job: ", testing::kRefusedSaveError)),
            std::string::npos)
      << s;
  auto jobs = store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].generation, 1);
  EXPECT_EQ((*jobs)[0].members.size(), 3u);

  ASSERT_TRUE(testing::AllowJobSaves(path_).ok());
  ASSERT_TRUE(store_->SaveJob(Job(2, 1)).ok());
  jobs = store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ((*jobs)[0].generation, 2);
  EXPECT_EQ((*jobs)[0].members.size(), 1u);
}

TEST_F(StateStoreTest, SavesAndLoadsTheTargetWorldSizeOfAShrunkJob) {
  StoredJob job = Job(3, 2);
  job.target_world_size = 3;
  ASSERT_TRUE(store_->SaveJob(job).ok());
  auto loaded = store_->LoadJobs();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].world_size, 2);
  EXPECT_EQ((*loaded)[0].target_world_size, 3);
}

TEST_F(StateStoreTest, OpensADatabaseFromBeforeTheTargetWorldSizeColumn) {
  // The jobs table as it was, with one job in it.
  ASSERT_TRUE(store_
                  ->Transaction([](StateStore::Connection& db) {
                    absl::Status s = db.Execute("old table", "DROP TABLE jobs");
                    if (s.ok()) {
                      s = db.Execute("old table",
                                     "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, world_size "
                                     "INTEGER NOT NULL, generation INTEGER NOT NULL, "
                                     "members_generation INTEGER NOT NULL, state INTEGER NOT "
                                     "NULL)");
                    }
                    if (s.ok()) {
                      s = db.Execute("old row", "INSERT INTO jobs VALUES ('old', 4, 2, 2, 1)");
                    }
                    return s;
                  })
                  .ok());
  store_.reset();
  auto reopened = StateStore::Open(path_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto loaded = (*reopened)->LoadJobs();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].world_size, 4);
  EXPECT_EQ((*loaded)[0].target_world_size, 0);  // not recorded: the world size
  StoredJob job = Job(5, 3);
  job.target_world_size = 4;
  ASSERT_TRUE((*reopened)->SaveJob(job).ok());
}

// Where a member that ended stopped, and why each generation began: what
// a restarted server shows of a finished job. SaveJob keeps exactly the
// history it is given (older entries trimmed), and DeleteJob forgets it.
TEST_F(StateStoreTest, SavesWhereEndedMembersStoppedAndTheGenerationHistory) {
  StoredJob job = Job(3, 2);
  job.members[0].left = true;
  job.members[0].step = 120;
  job.members[0].loss = 0.5;
  job.members[0].last_step = std::string("a\0b", 3);  // bytes, NULs included
  job.history = {{1, 1, 1000, "job created"},
                 {2, 2, 2000, "worker 'w1' (rank 1) stopped heartbeating"},
                 {3, 2, 2100, "shrunk from 2 to 1 workers"}};
  ASSERT_TRUE(store_->SaveJob(job).ok());
  auto loaded = store_->LoadJobs();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].members[0].step, 120);
  EXPECT_DOUBLE_EQ((*loaded)[0].members[0].loss, 0.5);
  EXPECT_EQ((*loaded)[0].members[0].last_step, std::string("a\0b", 3));
  EXPECT_EQ((*loaded)[0].members[1].step, 0);
  ASSERT_EQ((*loaded)[0].history.size(), 3u);
  EXPECT_EQ((*loaded)[0].history[1].reason, "worker 'w1' (rank 1) stopped heartbeating");
  EXPECT_EQ((*loaded)[0].history[2].generation, 2);
  EXPECT_EQ((*loaded)[0].history[2].unix_ms, 2100);

  job.history.erase(job.history.begin());  // the oldest dropped, a new one
  job.history.push_back({4, 3, 3000, "job created again"});
  ASSERT_TRUE(store_->SaveJob(job).ok());
  loaded = store_->LoadJobs();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ((*loaded)[0].history.size(), 3u);
  EXPECT_EQ((*loaded)[0].history[0].seq, 2);
  EXPECT_EQ((*loaded)[0].history[2].reason, "job created again");

  ASSERT_TRUE(store_->DeleteJob("job").ok());
  int64_t rows = -1;
  ASSERT_TRUE(store_
                  ->Read([&](StateStore::Connection& db) {
                    Statement count =
                        db.Prepare("count", "SELECT COUNT(*) FROM generation_history");
                    if (count.Next()) rows = count.Int(0);
                    return count.status();
                  })
                  .ok());
  EXPECT_EQ(rows, 0);
}

TEST_F(StateStoreTest, OpensADatabaseFromBeforeTheMembersStepAndLossColumns) {
  ASSERT_TRUE(store_
                  ->Transaction([](StateStore::Connection& db) {
                    absl::Status s = db.Execute("old table", "DROP TABLE members");
                    if (s.ok()) {
                      s = db.Execute("old table",
                                     "CREATE TABLE members (job_id TEXT NOT NULL, rank INTEGER "
                                     "NOT NULL, worker_id TEXT NOT NULL, host TEXT NOT NULL, "
                                     "token TEXT NOT NULL, left_job INTEGER NOT NULL, dead "
                                     "INTEGER NOT NULL, node TEXT NOT NULL DEFAULT '', PRIMARY "
                                     "KEY (job_id, rank))");
                    }
                    if (s.ok()) {
                      s = db.Execute("old row",
                                     "INSERT INTO jobs VALUES ('old', 1, 2, 2, 4, 1);"
                                     "INSERT INTO members VALUES ('old', 0, 'w0', 'h', 't', 1, 0, "
                                     "'h boot')");
                    }
                    return s;
                  })
                  .ok());
  store_.reset();
  auto reopened = StateStore::Open(path_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto loaded = (*reopened)->LoadJobs();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 1u);
  ASSERT_EQ((*loaded)[0].members.size(), 1u);
  EXPECT_EQ((*loaded)[0].members[0].step, 0);  // not kept then
  EXPECT_TRUE((*loaded)[0].history.empty());
  StoredJob job = Job(5, 1);
  job.members[0].step = 7;
  ASSERT_TRUE((*reopened)->SaveJob(job).ok());
}

}  // namespace
}  // namespace zeroshard

namespace zeroshard {
namespace {

// The goodput table (a job's time ledger, saved apart from its jobs row):
// what is saved is loaded by the next server, bytes for bytes (a serialized
// message may hold NULs), and it goes with the job.
TEST_F(StateStoreTest, AGoodputLedgerIsKeptUntilItsJobIsDeleted) {
  ASSERT_TRUE(store_->SaveJob(Job(1, 2)).ok());
  const std::string state("\x0a\x00\x12\x03ok\xff", 7);
  ASSERT_TRUE(store_->SaveGoodput("job", state).ok());
  ASSERT_TRUE(store_->SaveGoodput("other", "x").ok());
  store_.reset();
  auto reopened = StateStore::Open(path_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto loaded = (*reopened)->LoadGoodput();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ(loaded->at("job"), state);
  ASSERT_TRUE((*reopened)->SaveGoodput("job", "newer").ok());
  EXPECT_EQ((*reopened)->LoadGoodput()->at("job"), "newer");
  ASSERT_TRUE((*reopened)->DeleteJob("job").ok());
  loaded = (*reopened)->LoadGoodput();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->count("job"), 0u);
  EXPECT_EQ(loaded->count("other"), 1u);
}

}  // namespace
}  // namespace zeroshard
