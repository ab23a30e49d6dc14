// The state store on a real etcd (a one-member cluster on a loopback port):
// what one leader commits the next one loads, a write of a leader whose
// leadership key is gone is refused and leaves etcd unchanged, and a
// transaction etcd did not take is undone in the leader's memory too.
#include "shard_server/state/etcd_state.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shard_server/state/state_store.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

class EtcdStateTest : public ::testing::Test {
 protected:
  EtcdStateTest() : etcd_(testing::MakeTempDir("etcd-state"), /*members=*/1) {}

  std::unique_ptr<EtcdSession> Leader(const std::string& name) {
    EtcdOptions options;
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
    ASSERT_TRUE((*store)->SaveJob(Job("j", 3)).ok());
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
}

TEST_F(EtcdStateTest, ADeposedLeadersWriteIsRefusedAndUndone) {
  ASSERT_TRUE(etcd_.ok());
  std::unique_ptr<EtcdSession> old_leader = Leader("a:1");
  ASSERT_NE(old_leader, nullptr);
  EtcdStateReplica replica(old_leader.get());
  auto store = StateStore::OpenReplicated(&replica);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->SaveJob(Job("j", 1)).ok());
  const int64_t written = etcd_.ModRevision("/test/state");
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
  EXPECT_EQ(etcd_.ModRevision("/test/state"), written) << "the deposed leader wrote";
  // Undone in its memory too: it still reads generation 1.
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].generation, 1);
  // And it knows it no longer leads.
  EXPECT_NE(old_leader->WaitLost().find("leadership key"), std::string::npos);
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
