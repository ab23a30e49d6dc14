// The state store on a real etcd (a one-member cluster on a loopback port):
// what one leader commits the next one loads, a write of a leader whose
// leadership key is gone is refused and leaves etcd unchanged, and a
// transaction etcd did not take is undone in the leader's memory too. The
// state is kept as keys: a large job in values of at most 256 KiB over
// several transactions, a small change as a small write, a half-written
// change repaired by the next leader, etcd's history compacted, and etcd's
// refusals named; and a job's goodput ledger kept across a failover.
#include "shard_server/state/etcd_state.h"

#include <zlib.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shard_server/base/clock.h"
#include "shard_server/base/event_log.h"
#include "shard_server/membership/membership.h"
#include "shard_server/state/state_store.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

class EtcdStateTest : public ::testing::Test {
 protected:
  explicit EtcdStateTest(std::vector<std::string> etcd_flags = {})
      : etcd_(testing::MakeTempDir("etcd-state"), /*members=*/1, {}, std::move(etcd_flags)) {}

  std::unique_ptr<EtcdSession> Leader(const std::string& name, EtcdOptions options = {}) {
    options.endpoints = etcd_.endpoints();
    options.prefix = "/test";
    auto session = EtcdSession::Connect(options);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return nullptr;
    EXPECT_TRUE((*session)->StartLease().ok());
    absl::Status won = (*session)->Campaign(name);
    EXPECT_TRUE(won.ok()) << won;
    return *std::move(session);
  }

  testing::EtcdCluster etcd_;
};

// A job of `world` members with ids and hosts as a cluster has them.
StoredJob BigJob(const std::string& id, int world, int64_t generation) {
  StoredJob job;
  job.job_id = id;
  job.world_size = world;
  job.generation = generation;
  job.members_generation = generation;
  uint64_t x = 0x9E3779B97F4A7C15ull * (generation + 1);
  for (int r = 0; r < world; ++r) {
    const std::string host = absl::StrCat("node-", r / 8, ".cluster.example.com");
    // A token as the server makes them: 128 random bits in hex.
    std::string token;
    for (int i = 0; i < 2; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      absl::StrAppend(&token, absl::Hex(x, absl::kZeroPad16));
    }
    job.members.push_back({r, absl::StrCat(host, "/gpu", r % 8), host, token, false, false});
  }
  return job;
}

StoredJob Job(const std::string& id, int64_t generation) {
  StoredJob job;
  job.job_id = id;
  job.world_size = 2;
  job.generation = generation;
  job.members_generation = generation;
  job.members = {{0, "w0", "h0", "t0", false, false}, {1, "w1", "h1", "t1", false, false}};
  return job;
}

TEST_F(EtcdStateTest, TheNextLeaderLoadsWhatTheLastOneCommitted) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> first = Leader("a:1");
  ASSERT_NE(first, nullptr);
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    StoredJob job = Job("j", 3);
    job.members[1].node = "h1 boot-1";
    // A machine fenced from the job (EvictHost) is job state like the rest:
    // the next leader refuses it too.
    job.fences.push_back({"h1 boot-1", "silent corruption on rank 1 at step 20", 1, 20, 1234});
    ASSERT_TRUE((*store)->SaveJob(job).ok());
  }
  first->Resign();
  std::unique_ptr<EtcdSession> second = Leader("b:1");
  ASSERT_NE(second, nullptr);
  EtcdStateReplica replica(second.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].generation, 3);
  ASSERT_EQ((*jobs)[0].members.size(), 2u);
  EXPECT_EQ((*jobs)[0].members[1].worker_id, "w1");
  EXPECT_EQ((*jobs)[0].members[1].node, "h1 boot-1");
  ASSERT_EQ((*jobs)[0].fences.size(), 1u);
  EXPECT_EQ((*jobs)[0].fences[0].node, "h1 boot-1");
  EXPECT_EQ((*jobs)[0].fences[0].reason, "silent corruption on rank 1 at step 20");
  EXPECT_EQ((*jobs)[0].fences[0].step, 20);
  // Lifted (shardctl unfence): the row is deleted.
  StoredJob lifted = Job("j", 3);
  ASSERT_TRUE((*store)->SaveJob(lifted).ok());
  auto after = (*store)->LoadJobs();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE((*after)[0].fences.empty());
}

TEST_F(EtcdStateTest, ADeposedLeadersWriteIsRefusedAndUndone) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> old_leader = Leader("a:1");
  ASSERT_NE(old_leader, nullptr);
  EtcdStateReplica replica(old_leader.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->SaveJob(Job("j", 1)).ok());
  const int64_t written = etcd_.ModRevision("/test/state.head");
  ASSERT_GT(written, 0);

  // Its lease ends behind its back (as when it was paused past its TTL), and
  // another server is elected.
  auto [code, out] =
      etcd_.Etcdctl(absl::StrCat("lease revoke ", absl::Hex(old_leader->lease_id())));
  ASSERT_EQ(code, 0) << out;
  std::unique_ptr<EtcdSession> new_leader = Leader("b:1");
  ASSERT_NE(new_leader, nullptr);

  absl::Status late = (*store)->SaveJob(Job("j", 2));
  EXPECT_TRUE(absl::IsUnavailable(late)) << late;
  EXPECT_NE(late.message().find("no longer leads"), absl::string_view::npos) << late;
  EXPECT_EQ(etcd_.ModRevision("/test/state.head"), written) << "the deposed leader wrote";
  // Undone in its memory too: it still reads generation 1.
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].generation, 1);
  // And it knows it no longer leads.
  EXPECT_NE(old_leader->WaitLost().find("leadership key"), std::string::npos);
}

TEST_F(EtcdStateTest, ALargeJobIsKeptInValuesOfAtMost256KiBAndLoadsWhole) {
  ASSERT_TRUE(etcd_.ok());
  constexpr int kWorld = 50000;
  std::unique_ptr<EtcdSession> first = Leader("a:1");
  ASSERT_NE(first, nullptr);
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->SaveJob(BigJob("big", kWorld, 1)).ok());
    // More than one etcd transaction (128 operations, 1 MiB each at most).
    EXPECT_GT(replica.stats().last_batch_transactions, 1);
    EXPECT_LE(replica.stats().largest_value_bytes, 256 << 10);
    // The same job saved again: nothing changed, nothing written.
    const int64_t batches = replica.stats().batches;
    ASSERT_TRUE((*store)->SaveJob(BigJob("big", kWorld, 1)).ok());
    EXPECT_EQ(replica.stats().batches, batches);
    // One member changed: one page of members written, in one transaction.
    StoredJob changed = BigJob("big", kWorld, 1);
    changed.members[12345].dead = true;
    ASSERT_TRUE((*store)->SaveJob(changed).ok());
    EXPECT_EQ(replica.stats().last_batch_transactions, 1);
    EXPECT_LT(replica.stats().last_batch_bytes, 64 << 10);
  }
  // Every value etcd holds is at most 256 KiB.
  auto stored = first->RangeAll("/test/state/", 0, /*keys_only=*/false);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_GT(stored->size(), static_cast<size_t>(kWorld / StateStore::kMembersPerPage));
  for (const EtcdKeyValue& kv : *stored) EXPECT_LE(kv.value.size(), 256u << 10) << kv.key;
  first->Resign();
  std::unique_ptr<EtcdSession> second = Leader("b:1");
  ASSERT_NE(second, nullptr);
  EtcdStateReplica replica(second.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  ASSERT_EQ((*jobs)[0].members.size(), static_cast<size_t>(kWorld));
  StoredJob expected = BigJob("big", kWorld, 1);
  for (int r = 0; r < kWorld; ++r) {
    const StoredMember& m = (*jobs)[0].members[r];
    ASSERT_EQ(m.rank, r);
    ASSERT_EQ(m.worker_id, expected.members[r].worker_id);
    ASSERT_EQ(m.token, expected.members[r].token);
    ASSERT_EQ(m.dead, r == 12345) << r;
  }
  EXPECT_GT(replica.stats().loaded_keys, kWorld / StateStore::kMembersPerPage);
}

TEST_F(EtcdStateTest, AValueLargerThanTheLimitIsSplitIntoPartsAndJoinedOnLoad) {
  ASSERT_TRUE(etcd_.ok());
  EtcdOptions small;
  small.max_value_bytes = 4096;
  std::unique_ptr<EtcdSession> first = Leader("a:1", small);
  ASSERT_NE(first, nullptr);
  // A plan of random bytes (it does not compress): ~40 KiB, ~10 parts.
  std::string plan(40000, '\0');
  uint64_t x = 88172645463325252ull;
  for (char& c : plan) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<char>(x);
  }
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->SavePlan("j", 1, {"hash", plan}).ok());
    EXPECT_LE(replica.stats().largest_value_bytes, 4096);
    // Shrunk to one part: the others are deleted.
    ASSERT_TRUE((*store)->SavePlan("j", 1, {"hash", "small"}).ok());
    ASSERT_TRUE((*store)->SavePlan("j", 2, {"hash", plan}).ok());
  }
  auto [code, keys] = etcd_.Etcdctl("get --prefix /test/state/rows/plans/j/1 --keys-only");
  ASSERT_EQ(code, 0);
  EXPECT_EQ(keys.find("/~"), std::string::npos) << keys;
  first->Resign();
  std::unique_ptr<EtcdSession> second = Leader("b:1", small);
  ASSERT_NE(second, nullptr);
  EtcdStateReplica replica(second.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  auto one = (*store)->LoadPlan("j", 1);
  auto two = (*store)->LoadPlan("j", 2);
  ASSERT_TRUE(one.ok() && two.ok());
  ASSERT_TRUE(one->has_value() && two->has_value());
  EXPECT_EQ((*one)->plan_bytes, "small");
  EXPECT_EQ((*two)->plan_bytes, plan);
}

TEST_F(EtcdStateTest, AHalfWrittenChangeIsUndoneByTheNextLeader) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> first = Leader("a:1");
  ASSERT_NE(first, nullptr);
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->SaveJob(Job("j", 1)).ok());
    ASSERT_TRUE((*store)->SaveJob(Job("k", 1)).ok());
  }
  first->Resign();
  // What a leader that died after the first transactions of a change leaves:
  // pending, a key changed, a key added, a key deleted, no new head.
  const std::string job_j = etcd_.Get("/test/state/rows/jobs/j");
  ASSERT_FALSE(job_j.empty());
  for (const std::string& command : {std::string("put /test/state.pending 99"),
                                     std::string("put /test/state/rows/jobs/j r-garbage"),
                                     std::string("put /test/state/rows/jobs/zz r-garbage"),
                                     std::string("del /test/state/rows/jobs/k")}) {
    auto [code, out] = etcd_.Etcdctl(command);
    ASSERT_EQ(code, 0) << command << ": " << out;
  }
  std::unique_ptr<EtcdSession> second = Leader("b:1");
  ASSERT_NE(second, nullptr);
  EtcdStateReplica replica(second.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(replica.stats().repaired);
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_EQ((*jobs)[0].job_id, "j");
  EXPECT_EQ((*jobs)[1].job_id, "k");
  // And etcd holds the state as of the last complete change again.
  EXPECT_EQ(etcd_.Get("/test/state/rows/jobs/j"), job_j);
  EXPECT_FALSE(etcd_.Get("/test/state/rows/jobs/k").empty());
  EXPECT_TRUE(etcd_.Get("/test/state/rows/jobs/zz").empty());
  EXPECT_TRUE(etcd_.Get("/test/state.pending").empty());
}

TEST_F(EtcdStateTest, TheLeaderCompactsEtcdsHistory) {
  ASSERT_TRUE(etcd_.ok());
  EtcdOptions options;
  options.compact_every_writes = 5;
  std::unique_ptr<EtcdSession> leader = Leader("a:1", options);
  ASSERT_NE(leader, nullptr);
  EtcdStateReplica replica(leader.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  const int64_t before = etcd_.Revision();
  for (int g = 1; g <= 12; ++g) ASSERT_TRUE((*store)->SaveJob(Job("j", g)).ok());
  // Compacted at least twice (after writes 5 and 10), at a complete change.
  EXPECT_GT(replica.stats().compacted_revision, before);
  // The history before it is gone: a read there is refused.
  auto [code, out] = etcd_.Etcdctl(absl::StrCat("get /test/state.head --rev=", before));
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("compacted"), std::string::npos) << out;
}

// etcd's history compacted past the last change's revision (an operator
// following "When etcd is full", etcd's own auto-compaction, or another
// control plane on the same etcd): the next leader still loads the state
// (it read the rows at head's revision, which etcd then refused, and no
// server could lead again). A change cut half-way cannot be put back
// without that revision: the leader says so and what to do, and does once
// the operator chose.
TEST_F(EtcdStateTest, TheNextLeaderLoadsAfterEtcdsHistoryWasCompactedPastTheLastChange) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> first = Leader("a:1");
  ASSERT_NE(first, nullptr);
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->SaveJob(Job("j", 4)).ok());
  }
  first->Resign();
  auto compact_now = [&] {
    for (int i = 0; i < 3; ++i) {  // another control plane's writes
      auto [code, out] = etcd_.Etcdctl(absl::StrCat("put /other/state.head ", i));
      ASSERT_EQ(code, 0) << out;
    }
    auto [code, out] = etcd_.Etcdctl(absl::StrCat("compact ", etcd_.Revision()));
    ASSERT_EQ(code, 0) << out;
  };
  compact_now();
  {
    std::unique_ptr<EtcdSession> second = Leader("b:1");
    ASSERT_NE(second, nullptr);
    EtcdStateReplica replica(second.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    auto jobs = (*store)->LoadJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ(jobs->size(), 1u);
    EXPECT_EQ((*jobs)[0].generation, 4);
    second->Resign();
  }
  // A leader that died after the first transaction of a change, then a
  // compaction before the next one loads.
  for (const std::string& command : {std::string("put /test/state.pending 99"),
                                     std::string("del /test/state/rows/jobs/j")}) {
    auto [code, out] = etcd_.Etcdctl(command);
    ASSERT_EQ(code, 0) << command << ": " << out;
  }
  compact_now();
  {
    std::unique_ptr<EtcdSession> third = Leader("c:1");
    ASSERT_NE(third, nullptr);
    EtcdStateReplica replica(third.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_FALSE(store.ok());
    EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
    EXPECT_NE(store.status().message().find("etcdctl del /test/state.pending"),
              std::string::npos)
        << store.status();
    third->Resign();
  }
  auto [code, out] = etcd_.Etcdctl("del /test/state.pending");
  ASSERT_EQ(code, 0) << out;
  std::unique_ptr<EtcdSession> fourth = Leader("d:1");
  ASSERT_NE(fourth, nullptr);
  EtcdStateReplica replica(fourth.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_TRUE(jobs->empty());  // the cut change, as it was: job j deleted
}

// etcd with a request limit lower than the server was told.
class EtcdLimitsTest : public EtcdStateTest {
 protected:
  EtcdLimitsTest() : EtcdStateTest({"--max-request-bytes=65536"}) {}
};

TEST_F(EtcdLimitsTest, ARequestOverEtcdsLimitIsRefusedNamingTheLimit) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> leader = Leader("a:1");
  ASSERT_NE(leader, nullptr);
  EtcdStateReplica replica(leader.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::Status saved = (*store)->SaveJob(BigJob("big", 8000, 1));
  ASSERT_FALSE(saved.ok());
  EXPECT_NE(saved.message().find("--max-request-bytes"), absl::string_view::npos) << saved;
  EXPECT_EQ(saved.message().find("quorum"), absl::string_view::npos) << saved;
  // Undone: the job is not there.
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_TRUE(jobs->empty());
}

// What an older version kept: the whole SQLite image, zlib-compressed behind
// its 8-byte little-endian size, as one value under "<prefix>/state".
std::string LegacyImage(const std::string& dir) {
  {
    auto store = StateStore::Open(dir + "/old.db");
    EXPECT_TRUE(store.ok()) << store.status();
    if (!store.ok()) return "";
    EXPECT_TRUE((*store)->SaveJob(Job("old", 7)).ok());
  }
  // Closed, the file holds every commit (its WAL checkpointed); its header
  // says rollback mode (bytes 18 and 19: 1), as the in-memory database's
  // sqlite3_serialize image of the older version did.
  std::string image = testing::ReadFileOrEmpty(dir + "/old.db");
  EXPECT_GT(image.size(), 100u);
  if (image.size() < 100) return "";
  image[18] = image[19] = 1;
  uLongf bound = compressBound(image.size());
  std::string stored(8 + bound, '\0');
  for (int i = 0; i < 8; ++i)
    stored[i] = static_cast<char>((uint64_t{image.size()} >> (8 * i)) & 0xff);
  compress2(reinterpret_cast<Bytef*>(&stored[8]), &bound,
            reinterpret_cast<const Bytef*>(image.data()), image.size(), 6);
  stored.resize(8 + bound);
  return stored;
}

TEST_F(EtcdStateTest, AnOlderVersionsImageIsLoadedAndRewrittenAsKeys) {
  ASSERT_TRUE(etcd_.ok());
  const std::string image = LegacyImage(testing::MakeTempDir("legacy"));
  ASSERT_FALSE(image.empty());
  std::unique_ptr<EtcdSession> leader = Leader("a:1");
  ASSERT_NE(leader, nullptr);
  ASSERT_TRUE(leader->FencedPut("/test/state", image).ok());
  {
    EtcdStateReplica replica(leader.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    auto jobs = (*store)->LoadJobs();
    ASSERT_TRUE(jobs.ok() && jobs->size() == 1u);
    EXPECT_EQ((*jobs)[0].generation, 7);
  }
  // Written as keys at the store's first transaction; the image is gone.
  EXPECT_FALSE(etcd_.Get("/test/state/rows/jobs/old").empty());
  EXPECT_TRUE(etcd_.Get("/test/state").empty());
  leader->Resign();
  std::unique_ptr<EtcdSession> next = Leader("b:1");
  ASSERT_NE(next, nullptr);
  EtcdStateReplica replica(next.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok() && jobs->size() == 1u);
  EXPECT_EQ((*jobs)[0].generation, 7);
  ASSERT_EQ((*jobs)[0].members.size(), 2u);
}

// A newer version adds columns (ALTER TABLE, which SQLite's update hook
// does not see): every row is written again with the new schema, so the
// leader after the next still loads them (rows are inserted by position:
// before, the third leader failed with "table members has 11 columns but 8
// values were supplied").
TEST_F(EtcdStateTest, RowsOfAnOlderSchemaAreWrittenAgainWhenANewerVersionAddsColumns) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> older = Leader("a:1");
  ASSERT_NE(older, nullptr);
  {
    EtcdStateReplica replica(older.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    // The members table as a version without step and loss kept it, and a
    // job saved by it.
    ASSERT_TRUE((*store)
                    ->Transaction([](StateStore::Connection& db) {
                      return db.Execute("older version",
                                        "ALTER TABLE members DROP COLUMN last_step;"
                                        "ALTER TABLE members DROP COLUMN loss;"
                                        "ALTER TABLE members DROP COLUMN step;"
                                        "INSERT INTO jobs VALUES ('old', 2, 3, 3, 4, 2);"
                                        "INSERT INTO members VALUES ('old', 0, 'w0', 'h0', 't0', "
                                        "1, 0, ''), ('old', 1, 'w1', 'h1', 't1', 1, 0, '')");
                    })
                    .ok());
  }
  older->Resign();
  for (const char* candidate : {"b:1", "c:1"}) {
    SCOPED_TRACE(candidate);
    std::unique_ptr<EtcdSession> leader = Leader(candidate);
    ASSERT_NE(leader, nullptr);
    EtcdStateReplica replica(leader.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    auto jobs = (*store)->LoadJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ(jobs->size(), 1u);
    ASSERT_EQ((*jobs)[0].members.size(), 2u);
    EXPECT_EQ((*jobs)[0].members[1].worker_id, "w1");
    EXPECT_EQ((*jobs)[0].members[1].step, 0);
    leader->Resign();
  }
}

TEST_F(EtcdStateTest, AStoreCannotBeOpenedWithoutEtcd) {
  EtcdOptions options;
  options.endpoints = absl::StrCat("127.0.0.1:", testing::FreeLoopbackPort());
  auto session = EtcdSession::Connect(options);
  ASSERT_TRUE(session.ok());
  absl::Status lease = (*session)->StartLease();
  EXPECT_TRUE(absl::IsUnavailable(lease)) << lease;
  EXPECT_NE(lease.message().find(options.endpoints), absl::string_view::npos) << lease;
}

}  // namespace
}  // namespace zeroshard

namespace zeroshard {
namespace {

// The goodput table is rows like the others: a failover's next leader loads
// the ledger the last one saved, and it goes with its job.
TEST_F(EtcdStateTest, TheNextLeaderLoadsTheGoodputLedgerAndItGoesWithItsJob) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> first = Leader("a:1");
  ASSERT_NE(first, nullptr);
  const std::string state("\x0a\x00goodput\xff", 10);
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->SaveJob(Job("j", 2)).ok());
    ASSERT_TRUE((*store)->SaveGoodput("j", "older").ok());
    ASSERT_TRUE((*store)->SaveGoodput("j", state).ok());
  }
  first->Resign();
  std::unique_ptr<EtcdSession> second = Leader("b:1");
  ASSERT_NE(second, nullptr);
  {
    EtcdStateReplica replica(second.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    auto loaded = (*store)->LoadGoodput();
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_EQ(loaded->size(), 1u);
    EXPECT_EQ(loaded->at("j"), state);
    ASSERT_TRUE((*store)->DeleteJob("j").ok());
  }
  second->Resign();
  std::unique_ptr<EtcdSession> third = Leader("c:1");
  ASSERT_NE(third, nullptr);
  EtcdStateReplica replica(third.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  auto loaded = (*store)->LoadGoodput();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->empty());
}

// The same through Membership, as a failover runs it: a leader's job and
// its ledger (a report, the Tick's save), and the next leader's Restore on
// the keys it left: the ledger's totals, and its running phase going on.
TEST_F(EtcdStateTest, TheNextLeadersMembershipRestoresTheLedger) {
  ASSERT_TRUE(etcd_.ok());
  FakeClock clock;
  EventLog log;
  const absl::Time t0 = clock.Now();
  std::unique_ptr<EtcdSession> first = Leader("a:1");
  ASSERT_NE(first, nullptr);
  {
    EtcdStateReplica replica(first.get());
    auto store = StateStore::OpenReplicated(&replica);
    ASSERT_TRUE(store.ok()) << store.status();
    Membership leader(&clock, &log, store->get(), MembershipOptions());
    v1::JoinRequest join;
    join.set_job_id("gp");
    join.set_world_size(1);
    join.set_worker_id("w0");
    join.set_host("h0");
    std::optional<absl::StatusOr<v1::JoinResponse>> joined;
    clock.Advance(absl::Seconds(2));  // rendezvous: 0 (one member)
    leader.Join(join, clock.Now() + absl::Hours(1), [&](auto r) { joined = std::move(r); });
    ASSERT_TRUE(joined && joined->ok());
    clock.Advance(absl::Seconds(11));
    v1::HeartbeatRequest beat;
    beat.mutable_member()->set_job_id("gp");
    beat.mutable_member()->set_generation((*joined)->generation());
    beat.mutable_member()->set_token((*joined)->token());
    beat.mutable_telemetry()->mutable_time()->set_productive(9.5);
    ASSERT_TRUE(leader.Heartbeat(beat).ok());
    leader.Tick();  // changed, and the last save is 11 s old: saved
  }
  first->Resign();
  clock.Advance(absl::Seconds(4));  // the failover
  std::unique_ptr<EtcdSession> second = Leader("b:1");
  ASSERT_NE(second, nullptr);
  EtcdStateReplica replica(second.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  Membership next(&clock, &log, store->get(), MembershipOptions());
  ASSERT_TRUE(next.Restore().ok());
  const v1::GetStatusResponse status = next.Status("gp");
  ASSERT_EQ(status.jobs_size(), 1);
  const v1::Goodput& g = status.jobs(0).goodput();
  // Exact: whole seconds on the fake clock, a few additions of them.
  EXPECT_EQ(g.wall_seconds(), absl::ToDoubleSeconds(clock.Now() - t0 - absl::Seconds(2)));
  EXPECT_EQ(g.productive_seconds(), 9.5);
  EXPECT_EQ(g.badput_seconds().at("in_flight"), 15 - 9.5);
}
}  // namespace
}  // namespace zeroshard
