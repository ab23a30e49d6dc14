// The replicated control plane with real processes: a three-member etcd
// cluster (Debian's etcd-server) and three shard servers on it, all on
// loopback ports. A 4-worker job with checkpoints outlives the kill of an
// etcd member and then a kill -9 of the leading shard server: another server
// leads within seconds (measured and printed), no member is declared dead
// (the generation stays 1), every worker exits 0, and the final checkpoint
// equals, bit for bit, that of the same job run undisturbed. A leader paused
// (SIGSTOP) past its lease and resumed has its write refused and steps down.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/model_zoo.h"
#include "common/table.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

constexpr int kWorld = 4;
constexpr int kLayers = 3;
constexpr int kWidth = 64;
constexpr int kSteps = 400;

std::vector<std::string> Flags(int steps = kSteps, bool periodic_checkpoints = true) {
  std::vector<std::string> flags = {"--model=mlp",
                                    absl::StrCat("--layers=", kLayers),
                                    absl::StrCat("--width=", kWidth),
                                    "--seed=5",
                                    "--stage=3",
                                    absl::StrCat("--steps=", steps),
                                    "--batch=8",
                                    "--checkpoint_at_end",
                                    "--collective_timeout=30s"};
  if (periodic_checkpoints) flags.push_back("--checkpoint_every=100");
  return flags;
}

// Steps worker 0 has logged ("step N/M ...").
int LoggedSteps(const testing::LocalCluster& workers) {
  int steps = 0;
  for (absl::string_view line : absl::StrSplit(workers.WorkerLog(0), '\n')) {
    steps += absl::StartsWith(line, "step ");
  }
  return steps;
}

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string MakeDir(const std::string& path) {
  testing::RunCommand("mkdir -p " + path);
  return path;
}

class FailoverTest : public ::testing::Test {
 protected:
  explicit FailoverTest(const std::vector<std::string>& extra_server_flags = {})
      : dir_(testing::MakeTempDir("failover")),
        checkpoints_(MakeDir(dir_ + "/workers/checkpoints")),
        etcd_(dir_ + "/etcd"),
        servers_(dir_ + "/servers", etcd_.endpoints(),
                 Concat({"--checkpoint_root=" + checkpoints_, "--heartbeat_interval_ms=1000",
                         "--heartbeat_timeout_ms=3000"},
                        extra_server_flags)),
        workers_(testing::ExternalServers(servers_.addresses()), dir_ + "/workers") {}

  std::unique_ptr<Client> Observer() {
    ClientOptions options;
    options.server = servers_.addresses();
    options.rpc_timeout = absl::Seconds(2);
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // The highest step a member of `job` reported (-1: none yet or no answer).
  static int64_t Step(Client& observer, const std::string& job) {
    auto status = observer.GetStatus(job);
    if (!status.ok() || status->jobs_size() != 1) return -1;
    int64_t step = -1;
    for (const auto& m : status->jobs(0).members()) step = std::max<int64_t>(step, m.step());
    return step;
  }

  testing::Params Final(const std::string& job, int64_t step = kSteps) {
    return testing::LoadCheckpointParams(checkpoints_, job, step,
                                         *MlpSpec(kLayers, kWidth, "none"));
  }

  // Status of `job` as server `index` alone sees it (a fresh channel to it).
  absl::StatusOr<v1::GetStatusResponse> StatusFrom(int index, const std::string& job) {
    ClientOptions options;
    options.server = servers_.address(index);
    options.rpc_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return client.status();
    return (*client)->GetStatus(job);
  }

  // How many workers server `index` holds in the join barrier of `job` (-1: no answer).
  int Joined(int index, const std::string& job) {
    absl::StatusOr<v1::GetStatusResponse> status = StatusFrom(index, job);
    if (!status.ok() || status->jobs_size() != 1) return -1;
    return status->jobs(0).state() == v1::JOINING ? status->jobs(0).joined() : -1;
  }

  std::string dir_;
  std::string checkpoints_;
  testing::EtcdCluster etcd_;
  testing::ReplicatedServers servers_;
  testing::LocalCluster workers_;
};

TEST_F(FailoverTest, TrainingOutlivesAnEtcdMemberAndTheLeaderKilled) {
  ASSERT_TRUE(etcd_.ok());
  const int leader = servers_.WaitLeader(absl::Seconds(30));
  ASSERT_GE(leader, 0) << servers_.Log(0);
  ASSERT_TRUE(workers_.Run("calm", kWorld, Flags()));

  workers_.StartWorkers("storm", kWorld, Flags());
  std::unique_ptr<Client> observer = Observer();
  ASSERT_NE(observer, nullptr);
  ASSERT_TRUE(testing::WaitFor([&] { return Step(*observer, "storm") > 0; }, absl::Seconds(60)));

  // One etcd member of three gone: a quorum is left and nothing changes;
  // training goes on and the same server leads.
  etcd_.member(2)->Signal(SIGKILL);
  const int64_t step = Step(*observer, "storm");
  ASSERT_TRUE(testing::WaitFor([&] { return Step(*observer, "storm") > step; }, absl::Seconds(30)));
  EXPECT_EQ(servers_.Leader(), leader);

  // The plan the leader computed (every rank asked for it before stepping).
  auto planned = observer->GetStatus("storm");
  ASSERT_TRUE(planned.ok()) << planned.status();
  ASSERT_EQ(planned->jobs_size(), 1);
  const std::string plan_hash = planned->jobs(0).plan_hash();
  EXPECT_FALSE(plan_hash.empty());

  // The leader dies mid-training.
  servers_.server(leader)->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  const int next = servers_.WaitLeader(absl::Seconds(30), leader);
  const absl::Duration failover = absl::Now() - killed;
  ASSERT_GE(next, 0) << servers_.Log((leader + 1) % 3);
  std::printf("failover: server %d killed, server %d leads after %.2f s\n", leader, next,
              absl::ToDoubleSeconds(failover));
  RecordProperty("failover_ms", static_cast<int>(absl::ToInt64Milliseconds(failover)));

  std::vector<int> codes = workers_.WaitWorkers(absl::Seconds(120));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ":\n" << workers_.WorkerLog(r);
  }
  // The observer's channel may still hold the killed leader's connection;
  // the client asks a read again on a new one (Client::Read).
  auto status = observer->GetStatus("storm");
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).generation(), 1) << "a member was declared dead";
  EXPECT_EQ(status->jobs(0).state(), v1::FINISHED);
  // The plan is durable state: the new leader shows it though no rank asked
  // it for the plan again (the generation did not change).
  EXPECT_EQ(status->jobs(0).plan_hash(), plan_hash);
  // Status names the new leader, whom it took over from, and the one server
  // left to follow (the killed one's registration went with its lease).
  const v1::ControlPlaneStatus& cp = status->control_plane();
  EXPECT_EQ(cp.leader(), servers_.address(next));
  EXPECT_EQ(cp.previous_leader(), servers_.address(leader));
  EXPECT_EQ(cp.etcd_endpoints(), etcd_.endpoints());
  EXPECT_LT(cp.etcd_lease_renewed_seconds_ago(), cp.etcd_lease_ttl_seconds());
  const int third = 3 - leader - next;
  // The follower left names the leader of now in its log, not the one it
  // saw when it began to campaign (#51 item 7).
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        return absl::StrContains(
            servers_.Log(third),
            absl::StrCat("following ", servers_.address(next), ", the leader of "));
      },
      absl::Seconds(10)))
      << servers_.Log(third);
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        auto s = observer->GetStatus("");
        return s.ok() && s->control_plane().followers_size() == 1 &&
               s->control_plane().followers(0) == servers_.address(third);
      },
      absl::Seconds(10)));
  // The same arithmetic in the same order: the same bits.
  EXPECT_EQ(Final("storm"), Final("calm"));
}

TEST_F(FailoverTest, TrainingGoesOnWhileEtcdHasNoQuorumAndResumesAfter) {
  ASSERT_TRUE(etcd_.ok());
  const int leader = servers_.WaitLeader(absl::Seconds(30));
  ASSERT_GE(leader, 0) << servers_.Log(0);
  // Long enough to outlast the outage; no periodic checkpoint (a commit
  // would wait for a leader).
  workers_.StartWorkers("quorum", kWorld, Flags(/*steps=*/1500, /*periodic_checkpoints=*/false));
  std::unique_ptr<Client> observer = Observer();
  ASSERT_NE(observer, nullptr);
  ASSERT_TRUE(testing::WaitFor([&] { return Step(*observer, "quorum") > 0; }, absl::Seconds(60)));

  // Two etcd members of three stop: no quorum. The leader cannot renew its
  // lease and stops serving; no other server can be elected.
  etcd_.member(1)->Signal(SIGSTOP);
  etcd_.member(2)->Signal(SIGSTOP);
  ASSERT_TRUE(testing::WaitFor([&] { return servers_.Leader() < 0; }, absl::Seconds(30)))
      << "a server still leads without an etcd quorum:\n"
      << servers_.Log(leader);
  EXPECT_NE(servers_.Log(leader).find("is a quorum of etcd members up?"), std::string::npos)
      << servers_.Log(leader);
  // The data plane does not need the control plane: steps go on.
  const int logged = LoggedSteps(workers_);
  EXPECT_TRUE(
      testing::WaitFor([&] { return LoggedSteps(workers_) > logged + 10; }, absl::Seconds(30)));
  EXPECT_LT(servers_.Leader(), 0) << "etcd has no quorum, yet a server leads";
  // A write meanwhile (a new job's join) is refused, saying where to look.
  {
    ClientOptions options;
    options.server = servers_.addresses();
    options.rpc_timeout = absl::Seconds(2);
    auto late = Client::Connect(options);
    ASSERT_TRUE(late.ok()) << late.status();
    absl::StatusOr<JoinInfo> refused =
        (*late)->Join("during-outage", 1, "x0", "127.0.0.1", absl::Seconds(2));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                  "is a quorum of their etcd members up?"))
        << refused.status();
  }
  // The stepped-down leader's metrics port says it follows and why it
  // cannot lead.
  std::string metrics;
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        metrics =
            testing::RunCommand("curl -s http://" + servers_.metrics_address(leader) + "/metrics")
                .second;
        return absl::StrContains(metrics, "zeroshard_control_plane_etcd_session{error=\"etcd") &&
               absl::StrContains(metrics, "quorum of etcd members up?)\"} 0");
      },
      absl::Seconds(30)))
      << metrics;
  EXPECT_TRUE(absl::StrContains(
      metrics, "zeroshard_control_plane_leader{address=\"" + servers_.address(leader) + "\"} 0"))
      << metrics;

  etcd_.member(1)->Signal(SIGCONT);
  etcd_.member(2)->Signal(SIGCONT);
  const int back = servers_.WaitLeader(absl::Seconds(30));
  ASSERT_GE(back, 0);
  // The new leader's ShardServer took its metrics port over from its
  // follower page.
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        metrics =
            testing::RunCommand("curl -s http://" + servers_.metrics_address(back) + "/metrics")
                .second;
        return absl::StrContains(metrics, "zeroshard_control_plane_leader{address=\"" +
                                              servers_.address(back) + "\"} 1");
      },
      absl::Seconds(10)))
      << metrics;
  std::vector<int> codes = workers_.WaitWorkers(absl::Seconds(120));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ":\n" << workers_.WorkerLog(r);
  }
  auto status = observer->GetStatus("quorum");
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).generation(), 1) << "a member was declared dead";
  EXPECT_EQ(status->jobs(0).state(), v1::FINISHED);
}

TEST_F(FailoverTest, ALeaderPausedPastItsLeaseHasItsWriteRefused) {
  ASSERT_TRUE(etcd_.ok());
  const int leader = servers_.WaitLeader(absl::Seconds(30));
  ASSERT_GE(leader, 0) << servers_.Log(0);
  servers_.server(leader)->Signal(SIGSTOP);
  const int next = servers_.WaitLeader(absl::Seconds(30), leader);
  ASSERT_GE(next, 0);
  const int64_t state_revision = etcd_.ModRevision("/zeroshard/state.head");

  // A join sent to the paused server (the kernel takes the connection), which
  // would form a one-worker job and save it: it meets the server as it wakes.
  ClientOptions direct;
  direct.server = servers_.address(leader);
  direct.rpc_timeout = absl::Seconds(5);
  auto client = Client::Connect(direct);
  ASSERT_TRUE(client.ok());
  absl::StatusOr<JoinInfo> joined;
  std::thread join(
      [&] { joined = (*client)->Join("late", 1, "w0", "127.0.0.1", absl::Seconds(3)); });
  absl::SleepFor(absl::Milliseconds(300));  // the scenario: the join waits on a paused server
  servers_.server(leader)->Signal(SIGCONT);
  join.join();
  EXPECT_FALSE(joined.ok()) << "the deposed leader took a join";
  // It stepped down, and the state in etcd is the new leader's alone.
  EXPECT_TRUE(testing::WaitFor([&] { return servers_.Leader() == next; }, absl::Seconds(10)));
  EXPECT_EQ(etcd_.ModRevision("/zeroshard/state.head"), state_revision);
  std::unique_ptr<Client> observer = Observer();
  ASSERT_NE(observer, nullptr);
  auto status = observer->GetStatus("");
  ASSERT_TRUE(status.ok()) << status.status();
  for (const auto& job : status->jobs()) EXPECT_NE(job.job_id(), "late");
}

// The KV store lives in the leader's memory: a write acknowledged by a
// server that no longer leads would vanish. Writes queued at a leader paused
// past its lease are all refused when it wakes.
TEST_F(FailoverTest, ALeaderPausedPastItsLeaseAcknowledgesNoQueuedKvWrite) {
  ASSERT_TRUE(etcd_.ok());
  const int leader = servers_.WaitLeader(absl::Seconds(30));
  ASSERT_GE(leader, 0) << servers_.Log(0);
  constexpr int kWrites = 16;
  // One member of a one-member job, joined at the leader: its credentials
  // are what the writes carry.
  ClientOptions direct;
  direct.server = servers_.address(leader);
  direct.rpc_timeout = absl::Seconds(10);
  auto member = Client::Connect(direct);
  ASSERT_TRUE(member.ok()) << member.status();
  auto joined = (*member)->Join("kv", 1, "w0", "127.0.0.1", absl::Seconds(10));
  ASSERT_TRUE(joined.ok()) << joined.status();
  ASSERT_TRUE((*member)->StoreSet("before", "1").ok());
  std::unique_ptr<v1::Coordinator::Stub> stub =
      testing::NewCoordinatorStub(servers_.address(leader));

  servers_.server(leader)->Signal(SIGSTOP);
  ASSERT_GE(servers_.WaitLeader(absl::Seconds(30), leader), 0);
  std::vector<grpc::Status> written(kWrites);
  std::vector<std::thread> writers;
  for (int i = 0; i < kWrites; ++i) {
    writers.emplace_back([&, i] {
      v1::StoreSetRequest request;
      *request.mutable_member() = (*member)->credentials();
      request.set_key(absl::StrCat("key", i));
      request.set_value("value");
      v1::StoreSetResponse response;
      grpc::ClientContext context;
      testing::PrepareContext(&context, absl::Seconds(10));
      written[i] = stub->StoreSet(&context, request, &response);
    });
  }
  // The writes reach the paused server's socket (the kernel takes them);
  // not observable from outside the paused process: give the threads their start.
  absl::SleepFor(absl::Milliseconds(500));
  servers_.server(leader)->Signal(SIGCONT);
  for (std::thread& t : writers) t.join();
  for (int i = 0; i < kWrites; ++i) {
    EXPECT_FALSE(written[i].ok()) << "write " << i << " was acknowledged by a deposed leader";
    if (!written[i].ok()) std::printf("write %d: %s\n", i, written[i].error_message().c_str());
  }
}

// Rank 3's checkpoint commits wait 5 s in the server before they are
// recorded: the window in which the test kills the leader, the other three
// ranks' commits of the step already saved in etcd.
class KillDuringJoinAndCommitTest : public FailoverTest {
 protected:
  static constexpr int kHeldRank = kWorld - 1;
  KillDuringJoinAndCommitTest()
      : FailoverTest({absl::StrCat("--testing_hold_commit_of_rank=", kHeldRank),
                      "--testing_commit_hold=5s"}) {}

  absl::StatusOr<v1::CheckpointInfo> CheckpointFrom(int index, const std::string& job,
                                                    int64_t step) {
    ClientOptions options;
    options.server = servers_.address(index);
    options.rpc_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return client.status();
    absl::StatusOr<v1::ListCheckpointsResponse> list = (*client)->ListCheckpoints(job);
    if (!list.ok()) return list.status();
    for (const v1::CheckpointInfo& info : list->checkpoints()) {
      if (info.step() == step) return info;
    }
    return absl::NotFoundError(absl::StrCat("no step ", step));
  }

  // Kills server `victim` and waits for another to lead: its index (-1: none
  // within 30 s); `failover` gets the time from the kill to its serving.
  int KillLeader(int victim, absl::Duration* failover) {
    servers_.server(victim)->Signal(SIGKILL);
    const absl::Time killed = absl::Now();
    const int next = servers_.WaitLeader(absl::Seconds(30), victim);
    *failover = absl::Now() - killed;
    return next;
  }
};

TEST_F(KillDuringJoinAndCommitTest, AJobOutlivesItsLeaderKilledInTheJoinBarrierAndInACommit) {
  ASSERT_TRUE(etcd_.ok());
  const int first = servers_.WaitLeader(absl::Seconds(30));
  ASSERT_GE(first, 0) << servers_.Log(0);
  constexpr int kShortSteps = 100;
  constexpr int kCommitStep = 50;
  const std::vector<std::string> flags =
      Concat(Flags(kShortSteps, false), {"--checkpoint_every=50"});
  ASSERT_TRUE(workers_.Run("calm", kWorld, flags));

  // 1. The join. Worker 3 starts pointed at a port nobody serves: three
  // workers wait in the barrier until it is restarted with the real servers.
  const std::string nowhere = absl::StrCat("127.0.0.1:", testing::FreeLoopbackPort());
  workers_.StartWorkers("storm", kWorld, flags, {{kHeldRank, {"--server=" + nowhere}}});
  ASSERT_TRUE(
      testing::WaitFor([&] { return Joined(first, "storm") == kWorld - 1; }, absl::Seconds(60)));
  absl::Duration failover;
  const int second = KillLeader(first, &failover);
  ASSERT_GE(second, 0) << servers_.Log((first + 1) % 3);
  const absl::Time serving = absl::Now();
  // The waiting workers' joins failed with the leader; each must find the
  // new leader on its own channel within a reconnect (<= 1 s).
  ASSERT_TRUE(
      testing::WaitFor([&] { return Joined(second, "storm") == kWorld - 1; }, absl::Seconds(30)))
      << workers_.WorkerLog(0);
  std::printf(
      "join: server %d killed with %d workers in the barrier; server %d leads after "
      "%.2f s; the workers joined it %.2f s after it served\n",
      first, kWorld - 1, second, absl::ToDoubleSeconds(failover),
      absl::ToDoubleSeconds(absl::Now() - serving));
  RecordProperty("join_failover_ms", static_cast<int>(absl::ToInt64Milliseconds(failover)));
  workers_.RestartWorker(kHeldRank, {"--server=" + servers_.addresses()}, absl::ZeroDuration());

  // 2. The commit of step 50: ranks 0-2 committed (saved in etcd), rank 3's
  // commit held inside the leader, which is killed.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto info = CheckpointFrom(second, "storm", kCommitStep);
        return info.ok() && info->committed() == kWorld - 1 && !info->complete();
      },
      absl::Seconds(60)))
      << workers_.WorkerLog(0);
  const int third = KillLeader(second, &failover);
  ASSERT_GE(third, 0) << servers_.Log(3 - first - second);
  std::printf(
      "commit: server %d killed with rank %d's commit of step %d in flight; server %d "
      "leads after %.2f s\n",
      second, kHeldRank, kCommitStep, third, absl::ToDoubleSeconds(failover));
  RecordProperty("commit_failover_ms", static_cast<int>(absl::ToInt64Milliseconds(failover)));

  std::vector<int> codes = workers_.WaitWorkers(absl::Seconds(120));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ":\n" << workers_.WorkerLog(r);
  }
  auto status = StatusFrom(third, "storm");
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).generation(), 1) << "a member was declared dead";
  EXPECT_EQ(status->jobs(0).state(), v1::FINISHED);
  // The step was committed once, by the last leader: every rank counted
  // once, complete, and it consolidates into the calm run's parameters.
  auto info = CheckpointFrom(third, "storm", kCommitStep);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->complete());
  EXPECT_EQ(info->committed(), kWorld);
  const std::string merged = dir_ + "/storm-50.safetensors";
  auto [code, output] = testing::RunCommand(absl::StrCat(
      testing::RunfilePath("client/shardctl"), " --server=", servers_.addresses(),
      " consolidate --job=storm --step=", kCommitStep, " --weights_only --out=", merged, " 2>&1"));
  EXPECT_EQ(code, 0) << output;
  // The operator's view of etcd's storage, in units that fit each size (a
  // quota under 1 MiB printed "0 MiB"; 2 GiB, "2048 MiB").
  auto [status_code, status_text] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", servers_.addresses(),
                   " status 2>&1"));
  EXPECT_EQ(status_code, 0) << status_text;
  const v1::EtcdStorage& storage = status->control_plane().etcd_storage();
  ASSERT_GT(storage.quota_bytes(), 0) << status->DebugString();
  EXPECT_TRUE(absl::StrContains(
      status_text,
      absl::StrCat("of a ", HumanBytes(static_cast<double>(storage.quota_bytes())), " quota (")))
      << status_text;
  const testing::Params calm = Final("calm", kCommitStep);
  EXPECT_EQ(Final("storm", kCommitStep), calm);
  EXPECT_EQ(testing::LoadSafetensorsParams(merged), calm);
  EXPECT_EQ(Final("storm", kShortSteps), Final("calm", kShortSteps));
}

}  // namespace
}  // namespace zeroshard
