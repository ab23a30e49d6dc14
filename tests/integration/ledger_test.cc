// #44's ledger with real processes: what callers can make a shard_server and
// a shard_agent hold. Each process is driven, one family of calls after
// another, by many callers with the largest requests the bounds let through
// (and more, which are refused); before each family the process's peak RSS
// is reset (/proc/PID/clear_refs), and its growth over the family must stay
// under the sum of the bounds that family meets plus a stated baseline. The
// rows (bound, measured) are printed as docs/design.md's ledger table has
// them.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

constexpr int64_t kMiB = 1 << 20;
// gRPC's buffers for a family's connections (up to 64, ~256 KiB each for
// reading and HTTP/2 framing) and malloc's slack over what is counted (its
// arenas keep up to ~1/8 more of what was freed): what a family may add
// beyond its bounds.
constexpr int64_t kBaseline = 32 * kMiB;

// A process's RSS over one family of calls. Each family runs on fresh
// processes: memory an earlier family freed would be reused unseen.
class Meter {
 public:
  // Resets the peak (VmHWM) to the RSS now and remembers that RSS.
  explicit Meter(pid_t pid) : pid_(pid) {
    std::ofstream(absl::StrCat("/proc/", pid_, "/clear_refs")) << "5";
    start_ = testing::ProcStatusBytes(pid_, "VmRSS");
  }
  // Checks the peak since against `bound` + kBaseline and prints the row.
  void Check(const std::string& process, const std::string& family, int64_t bound) {
    const int64_t grown = testing::ProcStatusBytes(pid_, "VmHWM") - start_;
    EXPECT_LT(grown, bound + kBaseline) << family << ": RSS " << start_ << " at its start";
    std::fprintf(stderr, "ledger | %s | %s | %.1f MiB | %.1f MiB |\n", process.c_str(),
                 family.c_str(), static_cast<double>(bound) / kMiB,
                 static_cast<double>(grown) / kMiB);
  }

 private:
  const pid_t pid_;
  int64_t start_ = 0;
};

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  // Each caller its own connection, as separate processes would have.
  args.SetInt("zeroshard.caller", rand());  // NOLINT: a distinct channel argument each
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

void Deadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

// A member of a new one-member job, joined at `address`; no token when
// the join was refused.
v1::MemberCredentials JoinAlone(const std::string& address, const std::string& job) {
  auto stub = v1::Coordinator::NewStub(Channel(address));
  grpc::ClientContext context;
  Deadline(&context, absl::Seconds(30));
  v1::JoinRequest join;
  join.set_job_id(job);
  join.set_world_size(1);
  join.set_worker_id("w0");
  join.set_host("127.0.0.1");
  v1::JoinResponse joined;
  // Refused (beyond --max_jobs): credentials without a token.
  if (!stub->Join(&context, join, &joined).ok()) return {};
  v1::MemberCredentials member;
  member.set_job_id(job);
  member.set_generation(joined.generation());
  member.set_rank(joined.rank());
  member.set_token(joined.token());
  return member;
}

// `callers` threads each making `call(caller)`; returns when all returned.
void ManyCallers(int callers, const std::function<void(int)>& call) {
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c) threads.emplace_back(call, c);
  for (std::thread& t : threads) t.join();
}

// A StoreWait of `keys` keys of 24 bytes (a 1.8 MB message at 65,536).
v1::StoreWaitRequest BigWait(const v1::MemberCredentials& member, int keys) {
  v1::StoreWaitRequest wait;
  *wait.mutable_member() = member;
  wait.set_timeout_ms(2000);
  for (int k = 0; k < keys; ++k) wait.add_keys(absl::StrFormat("rendezvous/key-%09d", k));
  return wait;
}

// The largest beat the server keeps: a unit name of 256 bytes, a record of
// a new generation with a 32-byte source and phase.
v1::HeartbeatRequest BigBeat(const v1::MemberCredentials& member, int generation) {
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = member;
  beat.set_step(generation);
  beat.mutable_telemetry()->mutable_in_progress()->set_unit(std::string(256, 'u'));
  beat.mutable_recovery()->set_generation(generation);
  beat.mutable_recovery()->set_source(std::string(32, 's'));
  beat.mutable_recovery()->set_phase(std::string(32, 'p'));
  return beat;
}

// Joins held at `address` (a job of `world` that never forms) until
// cancelled; `worker_bytes` long worker ids. The statuses come to `answers`.
class HeldJoins {
 public:
  HeldJoins(const std::string& address, int joins, int world, int worker_bytes)
      : stub_(v1::Coordinator::NewStub(Channel(address))) {
    for (int i = 0; i < joins; ++i) {
      calls_.push_back(std::make_unique<Call>());
      Call& c = *calls_.back();
      c.request.set_job_id("held-joins");
      c.request.set_world_size(world);
      c.request.set_worker_id(absl::StrFormat("%0*d", worker_bytes, i));
      c.request.set_host(std::string(worker_bytes, 'h'));
      c.request.set_incarnation(std::string(worker_bytes, 'i'));
      Deadline(&c.context, absl::Seconds(120));
      stub_->async()->Join(&c.context, &c.request, &c.response, [this](grpc::Status s) {
        absl::MutexLock lock(&mu_);
        answers_.push_back(s);
      });
    }
  }
  ~HeldJoins() {
    for (auto& c : calls_) c->context.TryCancel();
    absl::MutexLock lock(&mu_);
    auto all = [this]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return answers_.size() == calls_.size(); };
    mu_.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(60));
  }
  // The answers so far.
  std::vector<grpc::Status> answers() {
    absl::MutexLock lock(&mu_);
    return answers_;
  }

 private:
  struct Call {
    grpc::ClientContext context;
    v1::JoinRequest request;
    v1::JoinResponse response;
  };
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::vector<std::unique_ptr<Call>> calls_;
  absl::Mutex mu_;
  std::vector<grpc::Status> answers_ ABSL_GUARDED_BY(mu_);
};

int Count(const std::vector<grpc::Status>& answers, grpc::StatusCode code) {
  int n = 0;
  for (const grpc::Status& s : answers) n += s.error_code() == code;
  return n;
}

// A client joined alone to `job` at `address`, beating (its member stays
// live while the test drives the store with its credentials).
std::unique_ptr<Client> LiveMember(const std::string& address, const std::string& job) {
  ClientOptions options;
  options.server = address;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  EXPECT_TRUE((*client)->Join(job, 1, "w0", "127.0.0.1", absl::Seconds(30)).ok());
  (*client)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});
  return *std::move(client);
}

// `callers` StoreWaits of 65,536 keys at `address` at once (held 2 s or
// refused); the statuses.
std::vector<grpc::Status> WaitFlood(const std::string& address, const v1::StoreWaitRequest& wait,
                                    int callers) {
  absl::Mutex mu;
  std::vector<grpc::Status> answers;
  ManyCallers(callers, [&](int) {
    auto stub = v1::Coordinator::NewStub(Channel(address));
    grpc::ClientContext context;
    Deadline(&context, absl::Seconds(60));
    v1::StoreWaitResponse response;
    grpc::Status s = stub->StoreWait(&context, wait, &response);
    absl::MutexLock lock(&mu);
    answers.push_back(s);
  });
  return answers;
}

// The server, its bounds made small enough to fill on this machine.
constexpr int64_t kKvTotal = 64 * kMiB;
constexpr int64_t kKvJob = 32 * kMiB;
constexpr int64_t kServerInFlight = 64 * kMiB;
constexpr int kMaxJobs = 64;
constexpr int kMaxPendingJoins = 2048;

// A server with those bounds and a live member of job "flood".
class ServerFixture {
 public:
  ServerFixture()
      : cluster_(testing::MakeTempDir("ledger-server"),
                 {absl::StrCat("--kv_max_job_bytes=", kKvJob),
                  absl::StrCat("--kv_max_total_bytes=", kKvTotal),
                  absl::StrCat("--max_request_bytes_in_flight=", kServerInFlight),
                  absl::StrCat("--max_jobs=", kMaxJobs),
                  absl::StrCat("--max_pending_joins=", kMaxPendingJoins)}) {
    if (cluster_.ok()) flood_ = LiveMember(cluster_.address(), "flood");
  }
  ~ServerFixture() {
    if (flood_ != nullptr) flood_->StopHeartbeats();
  }
  bool ok() const { return flood_ != nullptr; }
  const std::string& address() const { return cluster_.address(); }
  v1::MemberCredentials member() const { return flood_->credentials(); }
  pid_t pid() { return cluster_.server()->pid(); }

 private:
  testing::LocalCluster cluster_;
  std::unique_ptr<Client> flood_;
};

// The KV store: 32 waits and 4 checks of 65,536 keys, 8 callers setting
// 4 MiB values, 4 compare-and-setting 4 MiB values (with gets held, adds,
// deletes and counts), at once: the KV bounds, the requests in flight, and
// the messages gRPC receives whole before a handler runs.
TEST(ServerLedgerTest, KvStore) {
  ServerFixture server;
  ASSERT_TRUE(server.ok());
  const std::string address = server.address();
  const v1::MemberCredentials member = server.member();
  Meter meter(server.pid());
  const v1::StoreWaitRequest wait = BigWait(member, 65536);
  v1::StoreCheckRequest check;
  *check.mutable_member() = member;
  *check.mutable_keys() = wait.keys();
  const std::string value(4 * kMiB, 'v');
  std::atomic<int> refused{0};
  std::vector<grpc::Status> waits;
  std::thread waiters([&] { waits = WaitFlood(address, wait, 32); });
  ManyCallers(16, [&](int c) {
    auto stub = v1::Coordinator::NewStub(Channel(address));
    for (int i = 0; i < 4; ++i) {
      grpc::ClientContext context;
      Deadline(&context, absl::Seconds(60));
      grpc::Status s;
      if (c < 8) {
        v1::StoreSetRequest set;
        *set.mutable_member() = member;
        set.set_key(absl::StrCat("value-", c, "-", i));
        set.set_value(value);
        v1::StoreSetResponse r;
        s = stub->StoreSet(&context, set, &r);
      } else if (c < 12) {
        v1::StoreCheckResponse r;
        s = stub->StoreCheck(&context, check, &r);
      } else {
        // A 4 MiB compare-and-set, then the small calls: a get held until
        // its timeout, an add, a delete, a count.
        v1::StoreCompareSetRequest cas;
        *cas.mutable_member() = member;
        cas.set_key(absl::StrCat("cas-", c, "-", i));
        cas.set_desired(value);
        v1::StoreCompareSetResponse r;
        s = stub->StoreCompareSet(&context, cas, &r);
        grpc::ClientContext get_context, add_context, delete_context, count_context;
        for (grpc::ClientContext* small :
             {&get_context, &add_context, &delete_context, &count_context}) {
          Deadline(small, absl::Seconds(60));
        }
        v1::StoreGetRequest get;
        *get.mutable_member() = member;
        get.set_key(std::string(1024, 'g'));
        get.set_timeout_ms(500);
        v1::StoreGetResponse got;
        (void)stub->StoreGet(&get_context, get, &got);
        v1::StoreAddRequest add;
        *add.mutable_member() = member;
        add.set_key("counter");
        add.set_delta(1);
        v1::StoreAddResponse added;
        EXPECT_TRUE(stub->StoreAdd(&add_context, add, &added).ok());
        v1::StoreDeleteRequest del;
        *del.mutable_member() = member;
        del.set_key("counter");
        v1::StoreDeleteResponse deleted;
        EXPECT_TRUE(stub->StoreDelete(&delete_context, del, &deleted).ok());
        v1::StoreNumKeysRequest count;
        *count.mutable_member() = member;
        v1::StoreNumKeysResponse counted;
        EXPECT_TRUE(stub->StoreNumKeys(&count_context, count, &counted).ok());
      }
      refused += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    }
  });
  waiters.join();
  EXPECT_GT(refused + Count(waits, grpc::StatusCode::RESOURCE_EXHAUSTED), 0)
      << "nothing reached a bound";
  const int64_t received = 32 * static_cast<int64_t>(wait.ByteSizeLong()) +
                           4 * static_cast<int64_t>(check.ByteSizeLong()) + 12 * 4 * kMiB;
  meter.Check("shard_server", "the KV store's calls", kKvTotal + kServerInFlight + received);
}

// Joins held for a job that never forms, 452 beyond --max_pending_joins:
// each holds its request (ids of 200 bytes: ~1 KiB parsed), the
// membership's entry (~1 KiB) and gRPC's state of a held call with its
// HTTP/2 stream: 24 KiB a join in all (measured 22.5 KiB).
TEST(ServerLedgerTest, HeldJoins) {
  ServerFixture server;
  ASSERT_TRUE(server.ok());
  Meter meter(server.pid());
  HeldJoins joins(server.address(), kMaxPendingJoins + 452, 4096, 200);
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Count(joins.answers(), grpc::StatusCode::RESOURCE_EXHAUSTED) >= 452; },
      absl::Seconds(60)))
      << Count(joins.answers(), grpc::StatusCode::RESOURCE_EXHAUSTED) << " refused";
  meter.Check("shard_server", "Join (held)", kMaxPendingJoins * 24 * 1024);
}

// Every job the server may hold, each member beating its largest beats (a
// new record each) 40 times, and 8 callers reading every job's status and
// a job's history 10 times. A job keeps its member's telemetry (<= 1 KiB),
// its last 32 records (<= 256 B each), its history and its rows: 64 KiB a
// job covers them; a status answer in flight, 16 KiB a job.
TEST(ServerLedgerTest, JobsBeatsAndStatus) {
  ServerFixture server;
  ASSERT_TRUE(server.ok());
  const std::string address = server.address();
  Meter meter(server.pid());
  std::atomic<int> refused{0};
  ManyCallers(8, [&](int c) {
    auto stub = v1::Coordinator::NewStub(Channel(address));
    for (int j = c; j < kMaxJobs; j += 8) {
      const std::string job = absl::StrCat("job-", j);
      v1::MemberCredentials m = JoinAlone(address, job);
      if (m.token().empty()) {
        ++refused;  // beyond --max_jobs (the flood's job is one)
        continue;
      }
      grpc::ClientContext context;
      Deadline(&context, absl::Seconds(60));
      auto stream = stub->Heartbeat(&context);
      for (int g = 1; g <= 40; ++g) {
        v1::HeartbeatResponse r;
        ASSERT_TRUE(stream->Write(BigBeat(m, g)) && stream->Read(&r)) << job << " beat " << g;
      }
      context.TryCancel();
      stream->Finish();
    }
    for (int i = 0; i < 10; ++i) {
      grpc::ClientContext context;
      Deadline(&context, absl::Seconds(60));
      v1::GetStatusRequest request;
      v1::GetStatusResponse status;
      ASSERT_TRUE(stub->GetStatus(&context, request, &status).ok());
      grpc::ClientContext history_context;
      Deadline(&history_context, absl::Seconds(60));
      v1::GetHistoryRequest history;
      history.set_job_id(absl::StrCat("job-", (c + i * 8) % kMaxJobs));
      history.set_rank(-1);
      v1::GetHistoryResponse points;
      (void)stub->GetHistory(&history_context, history, &points);
    }
  });
  EXPECT_GE(refused, 1) << "--max_jobs was never reached";
  meter.Check("shard_server", "Join, Heartbeat (largest beats), GetStatus, GetHistory",
              kMaxJobs * 64 * 1024 + 8 * kMaxJobs * 16 * 1024);
}

// A node agent's stream carrying 4,096 rank streams (the most; one more is
// refused), each with the largest beat: ~2 KiB a rank stream.
TEST(ServerLedgerTest, AgentStream) {
  ServerFixture server;
  ASSERT_TRUE(server.ok());
  Meter meter(server.pid());
  auto stub = v1::HostAgent::NewStub(Channel(server.address()));
  grpc::ClientContext context;
  Deadline(&context, absl::Seconds(60));
  auto stream = stub->HostHeartbeat(&context);
  v1::HostHeartbeatRequest request;
  request.set_node("ledger-host boot-1");
  for (int i = 0; i < 4097; ++i) {
    v1::RankBeat* beat = request.add_beats();
    beat->set_local_stream(i + 1);
    *beat->mutable_beat() = BigBeat(server.member(), 1);
  }
  v1::HostHeartbeatResponse response;
  ASSERT_TRUE(stream->Write(request) && stream->Read(&response));
  ASSERT_EQ(response.answers_size(), 4097);
  EXPECT_EQ(response.answers(0).error_code(), 0) << response.answers(0).error_message();
  EXPECT_EQ(response.answers(4096).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  meter.Check("shard_server", "HostHeartbeat",
              4096 * 2 * 1024 + static_cast<int64_t>(request.ByteSizeLong()));
  context.TryCancel();
  stream->Finish();
}

// One-off plans: three of the largest asked at once (one computed at a
// time): held_bounds_test's error model, 256 B a piece of the 2^21 and
// 64 MiB of gRPC's buffers.
TEST(ServerLedgerTest, OneOffPlans) {
  ServerFixture server;
  ASSERT_TRUE(server.ok());
  Meter meter(server.pid());
  v1::PlanShardsRequest plan;
  plan.set_world_size(131072);
  plan.mutable_options()->set_shard_group_size(2);
  for (int i = 0; i < 16; ++i) {
    v1::TensorSpec* t = plan.mutable_spec()->add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->set_unit(t->name());
    t->add_shape(262144);
    t->add_shape(4);
    t->set_dtype("F32");
  }
  std::atomic<int> answered{0};
  ManyCallers(3, [&](int) {
    auto stub = v1::Coordinator::NewStub(Channel(server.address()));
    grpc::ClientContext context;
    Deadline(&context, absl::Seconds(120));
    v1::PlanShardsResponse r;
    answered += stub->PlanShards(&context, plan, &r).ok();
  });
  EXPECT_GE(answered, 1);
  meter.Check("shard_server", "PlanShards (one-off)", (int64_t{1} << 21) * 256 + 64 * kMiB);
}

// The node agent, its bounds small enough to fill on this machine, on a
// unix socket under /tmp (a socket path has at most 107 characters), with
// a server and a live member of job "flood".
constexpr int64_t kAgentInFlight = 32 * kMiB;
constexpr int kMaxRankStreams = 512;
// A rank stream at the agent: gRPC's state of the stream and its buffers
// (~32 KiB), the reactor and its beat (~2 KiB), the upstream's entries.
constexpr int64_t kRankStreamBytes = 64 * 1024;

class AgentFixture {
 public:
  AgentFixture() : cluster_(testing::MakeTempDir("ledger-agent")) {
    char dir[] = "/tmp/zs-ledger-XXXXXX";
    if (!cluster_.ok() || mkdtemp(dir) == nullptr) return;
    dir_ = dir;
    socket_ = dir_ + "/agent.sock";
    agent_ = std::make_unique<testing::ChildProcess>(
        testing::RunfilePath("agent/shard_agent"),
        std::vector<std::string>{"--server=" + cluster_.address(), "--listen=unix:" + socket_,
                                 "--batch_window_ms=1",
                                 absl::StrCat("--max_request_bytes_in_flight=", kAgentInFlight),
                                 absl::StrCat("--max_rank_streams=", kMaxRankStreams)},
        cluster_.dir() + "/agent.log");
    if (!testing::WaitFor([&] { return access(socket_.c_str(), F_OK) == 0; }, absl::Seconds(30))) {
      ADD_FAILURE() << "shard_agent did not start:\n" << agent_->Log();
      return;
    }
    flood_ = LiveMember(cluster_.address(), "flood");
  }
  ~AgentFixture() {
    if (flood_ != nullptr) flood_->StopHeartbeats();
    agent_.reset();
    if (!socket_.empty()) std::remove(socket_.c_str());
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  bool ok() const { return flood_ != nullptr; }
  std::string via() const { return "unix:" + socket_; }
  v1::MemberCredentials member() const { return flood_->credentials(); }
  pid_t pid() { return agent_->pid(); }

 private:
  testing::LocalCluster cluster_;
  std::string dir_;
  std::string socket_;
  std::unique_ptr<testing::ChildProcess> agent_;
  std::unique_ptr<Client> flood_;
};

// Rank streams: 600 opened (512 may be), each beating the largest beat.
TEST(AgentLedgerTest, RankStreams) {
  AgentFixture agent;
  ASSERT_TRUE(agent.ok());
  Meter meter(agent.pid());
  auto stub = v1::Coordinator::NewStub(Channel(agent.via()));
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> rw;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  int refused = 0;
  for (int i = 0; i < kMaxRankStreams + 88; ++i) {
    streams.push_back(std::make_unique<Stream>());
    Stream& st = *streams.back();
    Deadline(&st.context, absl::Seconds(120));
    st.rw = stub->Heartbeat(&st.context);
    v1::HeartbeatRequest beat = BigBeat(agent.member(), 1);
    beat.clear_recovery();  // the same member on every stream: no new records
    v1::HeartbeatResponse r;
    if (!st.rw->Write(beat) || !st.rw->Read(&r)) {
      grpc::Status s = st.rw->Finish();
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      ++refused;
      streams.pop_back();
    }
  }
  EXPECT_EQ(refused, 88);
  meter.Check("shard_agent", "Heartbeat (rank streams, largest beats)",
              kMaxRankStreams * kRankStreamBytes);
  for (auto& st : streams) st->context.TryCancel();
  for (auto& st : streams) st->rw->Finish();
}

// Joins held (a job of 100,000 that never forms), ids of 200 bytes, beyond
// the agent's bound: each counted as 3x its parsed request (three 200-byte
// strings: > 600 B), 2x its bytes (> 600 B) and 32 KiB of call state, so at
// most kAgentInFlight / (32 KiB + 3,000 B) = 936 are held and the rest of
// 2,500 refused.
TEST(AgentLedgerTest, HeldJoins) {
  AgentFixture agent;
  ASSERT_TRUE(agent.ok());
  Meter meter(agent.pid());
  constexpr int kJoins = 2500;
  constexpr int kMostHeld = kAgentInFlight / (32768 + 3000);
  HeldJoins joins(agent.via(), kJoins, 100000, 200);
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        return Count(joins.answers(), grpc::StatusCode::RESOURCE_EXHAUSTED) >= kJoins - kMostHeld;
      },
      absl::Seconds(90)))
      << Count(joins.answers(), grpc::StatusCode::RESOURCE_EXHAUSTED) << " refused";
  // Beyond the budget: each call's message and gRPC's state of a call in
  // flight, held or refused (~16 KiB: its HTTP/2 stream, metadata and
  // arena before any handler runs, bounded by no flag of the agent).
  meter.Check("shard_agent", "Join (held)", kAgentInFlight + int64_t{kJoins} * (800 + 16384));
}

// 32 StoreWaits of 65,536 keys at once: each held at the agent counts 2x
// its parsed request (the fan-out's copy) and its call.
TEST(AgentLedgerTest, StoreWaits) {
  AgentFixture agent;
  ASSERT_TRUE(agent.ok());
  Meter meter(agent.pid());
  const v1::StoreWaitRequest wait = BigWait(agent.member(), 65536);
  std::vector<grpc::Status> answers = WaitFlood(agent.via(), wait, 32);
  EXPECT_GT(Count(answers, grpc::StatusCode::RESOURCE_EXHAUSTED), 0);
  meter.Check("shard_agent", "StoreWait",
              kAgentInFlight + 32 * static_cast<int64_t>(wait.ByteSizeLong()));
}

}  // namespace
}  // namespace zeroshard
