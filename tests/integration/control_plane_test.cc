// The control plane over real gRPC on loopback: an in-process ShardServer on
// 127.0.0.1 with an ephemeral port, and real clients.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "shard_server/shard_server.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"
#include "tests/testing/state_faults.h"

namespace zeroshard {
namespace {

using testing::WaitFor;

// Tests about failure detection pass a short heartbeat timeout; the others a
// long one, so that a slow machine never declares their silent members dead.
ShardServerOptions FastOptions(absl::Duration heartbeat_timeout = absl::Seconds(60)) {
  ShardServerOptions o;
  o.listen = "127.0.0.1:0";
  o.membership.heartbeat_interval = absl::Milliseconds(100);
  o.membership.heartbeat_timeout = heartbeat_timeout;
  o.membership.join_timeout = absl::Seconds(30);
  o.log_sink = [](const std::string&) {};
  return o;
}

// Moves `clock` on by `step` (less than the heartbeat timeout), waits until
// each of `ranks` of `job` has beaten at the new time, then has the server
// check for silent members at that time.
void AdvanceWhileBeating(FakeClock* clock, ShardServer* server, const std::string& job,
                         const std::vector<int>& ranks, absl::Duration step) {
  clock->Advance(step);
  ASSERT_TRUE(WaitFor(
      [&] {
        const v1::JobStatus status = server->membership()->Status(job).jobs(0);
        for (int r : ranks) {
          if (status.members(r).last_heartbeat_age_ms() != 0) return false;
        }
        return true;
      },
      absl::Seconds(10)))
      << "a member did not beat after the clock moved on";
  server->membership()->Tick();
}

std::unique_ptr<ShardServer> StartServer(ShardServerOptions options) {
  auto server = ShardServer::Start(std::move(options));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<Client> Connect(const ShardServer& server, std::string token = "") {
  ClientOptions o;
  o.server = server.address();
  o.token = std::move(token);
  o.rpc_timeout = absl::Seconds(10);
  auto client = Client::Connect(o);
  EXPECT_TRUE(client.ok()) << client.status();
  return std::move(*client);
}

// Joins `world` clients "w0".. concurrently; returns them indexed by rank.
std::vector<std::unique_ptr<Client>> JoinAll(const ShardServer& server, const std::string& job,
                                             int world) {
  std::vector<std::unique_ptr<Client>> clients(world);
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(world);
  for (int i = 0; i < world; ++i) {
    clients[i] = Connect(server);
    threads.emplace_back([&, i] {
      statuses[i] = clients[i]
                        ->Join(job, world, absl::StrCat("w", i), "127.0.0.1", absl::Seconds(20))
                        .status();
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::unique_ptr<Client>> by_rank(world);
  for (int i = 0; i < world; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << statuses[i];
    if (statuses[i].ok()) by_rank[clients[i]->info().rank] = std::move(clients[i]);
  }
  return by_rank;
}

TEST(ControlPlaneTest, ConcurrentJoinsGetEveryRankExactlyOnceInWorkerIdOrder) {
  auto server = StartServer(FastOptions());
  auto probe = testing::NewCoordinatorStub(server->address());
  constexpr int kWorld = 64;
  std::vector<v1::JoinResponse> responses(kWorld);
  std::vector<grpc::Status> statuses(kWorld);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorld; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      testing::PrepareContext(&context, absl::Seconds(20));
      v1::JoinRequest request;
      request.set_job_id("sixty-four");
      request.set_world_size(kWorld);
      request.set_worker_id(absl::StrFormat("node%02d/0", kWorld - 1 - i));
      request.set_host("127.0.0.1");
      statuses[i] = probe->Join(&context, request, &responses[i]);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int> seen(kWorld, 0);
  for (int i = 0; i < kWorld; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    int rank = responses[i].rank();
    ASSERT_GE(rank, 0);
    ASSERT_LT(rank, kWorld);
    seen[rank]++;
    EXPECT_EQ(rank, kWorld - 1 - i) << "ranks follow sorted worker ids";
    EXPECT_EQ(responses[i].generation(), responses[0].generation());
    EXPECT_EQ(responses[i].members_size(), kWorld);
  }
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(seen[r], 1) << r;
}

TEST(ControlPlaneTest, SilentMemberIsDeclaredDeadAndSurvivorsAreToldToAbort) {
  FakeClock clock;
  ShardServerOptions options = FastOptions(absl::Milliseconds(600));
  options.clock = &clock;
  auto server = StartServer(options);
  auto clients = JoinAll(*server, "beats", 3);
  absl::Mutex mu;
  std::vector<v1::Command> commands(3, v1::COMMAND_UNSPECIFIED);
  for (int r = 0; r < 3; ++r) {
    clients[r]->StartHeartbeats([&, r](absl::StatusOr<v1::HeartbeatResponse> reply) {
      absl::MutexLock lock(&mu);
      commands[r] = reply.ok() ? reply->command() : v1::COMMAND_UNSPECIFIED;
    });
  }
  // All alive past the 600 ms timeout, in steps shorter than it.
  for (int i = 0; i < 3; ++i) {
    AdvanceWhileBeating(&clock, server.get(), "beats", {0, 1, 2}, absl::Milliseconds(400));
  }
  EXPECT_EQ(server->membership()->Status("beats").jobs(0).state(), v1::RUNNING);
  clients[1]->StopHeartbeats();  // rank 1 "crashes"
  // 400 ms on, the others beat and rank 1 is still within its timeout; 400
  // more, it has been silent for 800 ms.
  AdvanceWhileBeating(&clock, server.get(), "beats", {0, 2}, absl::Milliseconds(400));
  EXPECT_TRUE(server->membership()->Status("beats").jobs(0).members(1).alive());
  clock.Advance(absl::Milliseconds(400));
  ASSERT_TRUE(WaitFor(
      [&] {
        absl::MutexLock lock(&mu);
        return commands[0] == v1::ABORT_GENERATION_CHANGED &&
               commands[2] == v1::ABORT_GENERATION_CHANGED;
      },
      absl::Seconds(5)));
  // (How fast, in seconds, is measured by //tests/bench:control_plane_bench;
  // the exact timeout rule by membership_deaths_test with a fake clock.)
  v1::JobStatus job = server->membership()->Status("beats").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_EQ(commands[1], v1::COMMAND_UNSPECIFIED);
}

TEST(ControlPlaneTest, RestartedServerStillListsTheJob) {
  std::string dir = testing::MakeTempDir("restart");
  ShardServerOptions options = FastOptions();
  options.state_dir = dir;
  int64_t generation = 0;
  {
    auto server = StartServer(options);
    auto clients = JoinAll(*server, "durable", 2);
    generation = clients[0]->info().generation;
    server->Shutdown();
  }
  auto server = StartServer(options);
  auto client = Connect(*server);
  auto status = client->GetStatus("durable");
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).generation(), generation);
  EXPECT_EQ(status->jobs(0).members_size(), 2);
  EXPECT_EQ(status->jobs(0).state(), v1::RUNNING);
}

TEST(ControlPlaneTest, MembersThatHeartbeatAgainAfterRestartStayAlive) {
  std::string dir = testing::MakeTempDir("restart-beat");
  FakeClock clock;
  ShardServerOptions options = FastOptions(absl::Milliseconds(1500));
  options.state_dir = dir;
  options.clock = &clock;
  // A fixed port, so the clients' channels find the restarted server.
  auto first = StartServer(options);
  options.listen = first->address();
  auto clients = JoinAll(*first, "resilient", 2);
  std::atomic<int> commands{0};
  for (auto& c : clients) c->StartHeartbeats([&](auto) { commands++; });
  first->Shutdown();
  first.reset();
  auto second = StartServer(options);
  ASSERT_NE(second, nullptr);
  // Both members find the new server and beat again...
  ASSERT_TRUE(WaitFor(
      [&] {
        auto job = second->membership()->Status("resilient").jobs(0);
        return job.members(0).last_heartbeat_age_ms() >= 0 &&
               job.members(1).last_heartbeat_age_ms() >= 0;
      },
      absl::Seconds(10)));
  // ...and keep beating past the 1.5 s timeout.
  for (int i = 0; i < 4; ++i) {
    AdvanceWhileBeating(&clock, second.get(), "resilient", {0, 1}, absl::Milliseconds(500));
  }
  EXPECT_EQ(second->membership()->Status("resilient").jobs(0).state(), v1::RUNNING);
  EXPECT_EQ(commands.load(), 0);
  for (auto& c : clients) c->StopHeartbeats();
}

TEST(ControlPlaneTest, JoinAndLeaveThatCannotBeSavedFailWithTheStoreErrorAndTheServerServesOn) {
  std::string dir = testing::MakeTempDir("unsaved");
  ShardServerOptions options = FastOptions();
  options.state_dir = dir;
  auto server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string db = dir + "/zeroshard.db";
  auto client = Connect(*server);

  ASSERT_TRUE(testing::RefuseJobSaves(db).ok());
  absl::Status joined = client->Join("job", 1, "w0", "127.0.0.1", absl::Seconds(5)).status();
  EXPECT_FALSE(joined.ok());
  EXPECT_NE(joined.message().find(testing::kRefusedSaveError), std::string::npos) << joined;
  EXPECT_TRUE(client->HealthCheck().ok());
  auto status = client->GetStatus("");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->jobs_size(), 0);

  ASSERT_TRUE(testing::AllowJobSaves(db).ok());
  ASSERT_TRUE(client->Join("job", 1, "w0", "127.0.0.1", absl::Seconds(5)).ok());
  ASSERT_TRUE(testing::RefuseJobSaves(db).ok());
  absl::Status left = client->Leave();
  EXPECT_FALSE(left.ok());
  EXPECT_NE(left.message().find(testing::kRefusedSaveError), std::string::npos) << left;
  status = client->GetStatus("job");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->jobs(0).state(), v1::RUNNING);
  EXPECT_FALSE(status->jobs(0).members(0).left());

  ASSERT_TRUE(testing::AllowJobSaves(db).ok());
  EXPECT_TRUE(client->Leave().ok());
  status = client->GetStatus("job");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->jobs(0).state(), v1::FINISHED);
}

TEST(ControlPlaneTest, WrongOrMissingTokenGetsUnauthenticatedButHealthIsOpen) {
  ShardServerOptions options = FastOptions();
  options.auth_token = "s3cret";
  auto server = StartServer(options);
  for (std::string token : {std::string(), std::string("wrong")}) {
    auto client = Connect(*server, token);
    EXPECT_EQ(client->GetStatus("").status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(client->Join("job", 1, "w0", "h", absl::Seconds(2)).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_TRUE(client->HealthCheck().ok());
  }
  EXPECT_EQ(server->membership()->Status("").jobs_size(), 0);
  auto good = Connect(*server, "s3cret");
  EXPECT_TRUE(good->Join("job", 1, "w0", "h", absl::Seconds(5)).ok());
  EXPECT_TRUE(good->GetStatus("").ok());
  EXPECT_TRUE(good->StoreSet("k", "v").ok());
}

TEST(ControlPlaneTest, KeyValueStoreHoldsGetsUntilSetAndScopesToTheGeneration) {
  auto server = StartServer(FastOptions());
  auto clients = JoinAll(*server, "kv", 2);
  absl::StatusOr<std::string> got;
  const size_t held = server->kv()->TotalBytes();
  std::thread waiter([&] { got = clients[1]->StoreGet("addr/0", absl::Seconds(10)); });
  // The server holds the Get (its waiting key counts in the store's bytes).
  ASSERT_TRUE(WaitFor([&] { return server->kv()->TotalBytes() > held; }, absl::Seconds(10)));
  ASSERT_TRUE(clients[0]->StoreSet("addr/0", "10.0.0.1:1234").ok());
  waiter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "10.0.0.1:1234");
  EXPECT_EQ(*clients[0]->StoreAdd("count", 1), 1);
  EXPECT_EQ(*clients[1]->StoreAdd("count", 1), 2);
  EXPECT_TRUE(clients[1]->StoreWait({"addr/0", "count"}, absl::Seconds(1)).ok());
  absl::Time start = absl::Now();
  EXPECT_EQ(clients[1]->StoreGet("never", absl::Milliseconds(300)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(ControlPlaneTest, StaleGenerationAndWrongTokenAreFencedOverRpc) {
  auto server = StartServer(FastOptions(absl::Milliseconds(600)));
  auto clients = JoinAll(*server, "fence", 2);
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(5));
  v1::StoreSetRequest request;
  *request.mutable_member() = clients[0]->credentials();
  request.mutable_member()->set_token("forged");
  request.set_key("k");
  v1::StoreSetResponse response;
  EXPECT_EQ(testing::NewCoordinatorStub(server->address())
                ->StoreSet(&context, request, &response)
                .error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Rank 1 goes silent: generation bumps; rank 0's old credentials are fenced.
  ASSERT_TRUE(WaitFor(
      [&] { return server->membership()->Status("fence").jobs(0).state() == v1::DEGRADED; },
      absl::Seconds(5)));
  EXPECT_EQ(clients[0]->StoreSet("k", "v").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server->kv()->KeyCount("fence"), 0u);
}

TEST(ControlPlaneTest, JoinTimeoutSaysHowManyJoined) {
  ShardServerOptions options = FastOptions();
  options.membership.join_timeout = absl::Milliseconds(300);
  auto server = StartServer(options);
  auto client = Connect(*server);
  auto result = client->Join("lonely", 3, "w0", "h", absl::Seconds(10));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(result.status().message().find("1 of 3"), std::string::npos) << result.status();
}

TEST(ControlPlaneTest, RefusalsOverRpcNameTheValueAndChangeNothing) {
  auto server = StartServer(FastOptions());
  auto clients = JoinAll(*server, "full", 2);
  // The jobs' state, less the goodput ledger, whose clock runs on between
  // the two reads (no refusal changes it: it is time, not state).
  auto state = [&] {
    v1::GetStatusResponse status = server->membership()->Status("");
    for (v1::JobStatus& job : *status.mutable_jobs()) job.clear_goodput();
    return status.DebugString();
  };
  const std::string before = state();
  auto other = testing::NewCoordinatorStub(server->address());
  struct Case {
    std::string job;
    int world;
    std::string worker;
    absl::StatusCode code;
    std::string mention;
  };
  std::vector<Case> cases = {
      {"", 2, "w", absl::StatusCode::kInvalidArgument, "job_id"},
      {"full", 2, "", absl::StatusCode::kInvalidArgument, "worker_id"},
      {"full", 0, "w", absl::StatusCode::kInvalidArgument, "world_size 0"},
      {"full", 200000, "w", absl::StatusCode::kInvalidArgument, "world_size 200000"},
      {"full", 3, "w9", absl::StatusCode::kFailedPrecondition, "world_size 3"},
      {"full", 2, "w9", absl::StatusCode::kResourceExhausted, "w9"},
  };
  for (const Case& c : cases) {
    grpc::ClientContext context;
    testing::PrepareContext(&context, absl::Seconds(5));
    v1::JoinRequest request;
    request.set_job_id(c.job);
    request.set_world_size(c.world);
    request.set_worker_id(c.worker);
    v1::JoinResponse response;
    grpc::Status status = other->Join(&context, request, &response);
    EXPECT_EQ(static_cast<int>(status.error_code()), static_cast<int>(c.code)) << c.mention;
    EXPECT_NE(status.error_message().find(c.mention), std::string::npos)
        << status.error_message();
  }
  // A live member's id: the client library retries ALREADY_EXISTS, so ask raw.
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(5));
  v1::JoinRequest dup;
  dup.set_job_id("full");
  dup.set_world_size(2);
  dup.set_worker_id("w1");
  v1::JoinResponse response;
  EXPECT_EQ(other->Join(&context, dup, &response).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // Membership state is unchanged (heartbeat ages aside: nobody beats here).
  EXPECT_EQ(state(), before);
}

TEST(ControlPlaneTest, RestartedWorkerRejoinsOnceItsOldSelfIsDeclaredDead) {
  auto server = StartServer(FastOptions(absl::Milliseconds(600)));
  auto clients = JoinAll(*server, "restart-worker", 2);
  std::atomic<bool> told{false};
  clients[0]->StartHeartbeats([&](auto) { told = true; });
  // Rank 1 never beats (it "crashed"); its replacement joins with the same id
  // and is retried by the client until the old rank 1 is declared dead.
  auto replacement = Connect(*server);
  absl::StatusOr<JoinInfo> joined;
  std::thread t([&] {
    joined = replacement->Join("restart-worker", 2, "w1", "h", absl::Seconds(10));
  });
  ASSERT_TRUE(WaitFor([&] { return told.load(); }, absl::Seconds(5)));
  auto survivor = clients[0]->Join("restart-worker", 2, "w0", "h", absl::Seconds(10));
  t.join();
  ASSERT_TRUE(joined.ok()) << joined.status();
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  EXPECT_EQ(joined->rank, 1);
  EXPECT_EQ(survivor->rank, 0);
  EXPECT_EQ(joined->generation, survivor->generation);
  clients[0]->StopHeartbeats();
}

TEST(ControlPlaneTest, TlsWithClientCertificates) {
  std::string dir = testing::MakeTempDir("tls");
  std::string script = absl::StrCat(
      "cd ", dir, " && ",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca "
      "-keyout ca.key -out ca.crt && ",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key "
      "-out server.csr && ",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > san.ext && ",
      "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 "
      "-extfile san.ext -out server.crt && ",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=worker -keyout client.key "
      "-out client.csr && ",
      "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 "
      "-out client.crt");
  auto [code, output] = testing::RunCommand(script);
  ASSERT_EQ(code, 0) << output;
  auto read = [&](const char* name) { return testing::ReadFileOrEmpty(dir + "/" + name); };
  ShardServerOptions options = FastOptions();
  options.tls_cert = read("server.crt");
  options.tls_key = read("server.key");
  options.tls_client_ca = read("ca.crt");
  auto server = StartServer(options);

  ClientOptions good;
  good.server = server->address();
  good.tls_ca = read("ca.crt");
  good.tls_cert = read("client.crt");
  good.tls_key = read("client.key");
  good.rpc_timeout = absl::Seconds(5);
  auto client = Client::Connect(good);
  ASSERT_TRUE(client.ok());
  EXPECT_TRUE((*client)->GetStatus("").ok());
  EXPECT_TRUE((*client)->HealthCheck().ok());

  ClientOptions no_cert = good;
  no_cert.tls_cert.clear();
  no_cert.tls_key.clear();
  auto anonymous = Client::Connect(no_cert);
  EXPECT_FALSE((*anonymous)->GetStatus("").ok());

  ClientOptions plaintext;
  plaintext.server = server->address();
  plaintext.rpc_timeout = absl::Seconds(3);
  auto insecure = Client::Connect(plaintext);
  EXPECT_FALSE((*insecure)->GetStatus("").ok());
}

// A CA, a server certificate for localhost and one client certificate per
// name (CN and DNS subject alternative name both the name), as files in `dir`:
// ca.crt, server.{crt,key}, <name>.{crt,key}. EC keys: quick to make.
void MakeCertificates(const std::string& dir, const std::vector<std::string>& clients) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  std::string script = absl::StrCat(
      "set -e; cd ", dir, "; openssl req -x509 ", key,
      " -days 1 -subj /CN=test-ca -keyout ca.key -out ca.crt; ", "openssl req ", key,
      " -subj /CN=localhost -keyout server.key -out server.csr; ",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext; ",
      "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 "
      "-extfile server.ext -out server.crt; ");
  for (const std::string& name : clients) {
    absl::StrAppend(&script, "openssl req ", key, " -subj /CN=", name, " -keyout ", name,
                    ".key -out ", name, ".csr; printf 'subjectAltName=DNS:", name, "\\n' > ", name,
                    ".ext; openssl x509 -req -in ", name,
                    ".csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile ", name,
                    ".ext -out ", name, ".crt; ");
  }
  auto [code, output] = testing::RunCommand(script);
  ASSERT_EQ(code, 0) << output;
}

TEST(ControlPlaneTest, WithBoundWorkerIdsACertificateJoinsOnlyAsItsOwnHosts) {
  const std::string dir = testing::MakeTempDir("tls-bind");
  ASSERT_NO_FATAL_FAILURE(MakeCertificates(dir, {"node-a", "launcher"}));
  auto read = [&](const std::string& name) { return testing::ReadFileOrEmpty(dir + "/" + name); };
  ShardServerOptions options = FastOptions();
  options.tls_cert = read("server.crt");
  options.tls_key = read("server.key");
  options.tls_client_ca = read("ca.crt");
  options.tls_bind_worker_ids = true;
  options.tls_worker_id_map = "# the launcher joins for every host\nlauncher *\n";
  auto server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto connect = [&](const std::string& name) {
    ClientOptions o;
    o.server = server->address();
    o.tls_ca = read("ca.crt");
    o.tls_cert = read(name + ".crt");
    o.tls_key = read(name + ".key");
    o.rpc_timeout = absl::Seconds(10);
    auto client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  };
  // node-a's certificate joins as its own host...
  auto node_a = connect("node-a");
  auto own = node_a->Join("bind-own", 1, "node-a/0", "127.0.0.1", absl::Seconds(10));
  EXPECT_TRUE(own.ok()) << own.status();
  // ...but not as another host's worker: refused, naming the id and the identity.
  auto other = node_a->Join("bind-other", 1, "node-b/0", "127.0.0.1", absl::Seconds(10));
  EXPECT_TRUE(absl::IsPermissionDenied(other.status())) << other.status();
  for (const char* part : {"'node-b/0'", "node-a", "--tls_bind_worker_ids"}) {
    EXPECT_TRUE(absl::StrContains(other.status().message(), part)) << part << ": " << other.status();
  }
  EXPECT_EQ(server->membership()->Status("bind-other").jobs_size(), 0);
  // The map lets the launcher's certificate join as any host.
  auto launcher = connect("launcher");
  auto mapped = launcher->Join("bind-mapped", 1, "node-c/0", "127.0.0.1", absl::Seconds(10));
  EXPECT_TRUE(mapped.ok()) << mapped.status();
  // Binding without client certificates is a configuration error.
  ShardServerOptions no_ca = FastOptions();
  no_ca.tls_cert = read("server.crt");
  no_ca.tls_key = read("server.key");
  no_ca.tls_bind_worker_ids = true;
  auto refused = ShardServer::Start(std::move(no_ca));
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
}

}  // namespace
}  // namespace zeroshard
