// The data plane's setup disturbed (#29, findings 1 and 2), with real
// processes on loopback: W = 2, MLP, ZeRO stage 3. Each disturbed job must
// finish at its W with final parameters bitwise equal to an uninterrupted
// run (same W at every step, state from the seed or restored exactly, the
// same arithmetic in the same order).
//
// --test_hold_data_plane=FILE holds a worker after it published its
// data-plane addresses and before it connects, so the test acts while the
// setup is in flight (instead of racing a ~30 ms window).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;
using testing::Params;

constexpr int kLayers = 3;
constexpr int kWidth = 16;
constexpr int kSteps = 12;
constexpr char kHolding[] = "holding the data plane's connections";

std::vector<std::string> Flags(std::vector<std::string> extra = {}) {
  std::vector<std::string> flags = {"--model=mlp",
                                    absl::StrCat("--layers=", kLayers),
                                    absl::StrCat("--width=", kWidth),
                                    "--activation=relu",
                                    "--lr=0.01",
                                    "--seed=7",
                                    "--stage=3",
                                    "--batch=4",
                                    absl::StrCat("--steps=", kSteps),
                                    "--collective_timeout=20s",
                                    "--checkpoint_at_end",
                                    "--rejoin_timeout=60s",
                                    "--join_timeout_s=60"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

// A connection from outside the job: connects to 127.0.0.1:port and sends
// `payload` (as much as the socket takes without blocking), then stays open
// until destroyed.
class StrayConnection {
 public:
  StrayConnection(int port, const std::string& payload) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address = {};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    if (!connected_) return;
    fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
    size_t sent = 0;
    while (sent < payload.size()) {
      const ssize_t n = send(fd_, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
  }
  ~StrayConnection() { close(fd_); }
  bool connected() const { return connected_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

class SetupFaultsTest : public ::testing::Test {
 protected:
  SetupFaultsTest()
      : cluster_(testing::MakeTempDir("setup"),
                 {"--heartbeat_interval_ms=1000", "--heartbeat_timeout_ms=3000"}) {}

  Params Final(const std::string& job) {
    return testing::LoadCheckpointParams(cluster_.checkpoint_root(), job, kSteps,
                                         *MlpSpec(kLayers, kWidth, "relu"));
  }

  Params Reference() {
    EXPECT_TRUE(cluster_.Run("reference", 2, Flags()));
    return Final("reference");
  }

  bool LogHas(int rank, const std::string& text) {
    return cluster_.WorkerLog(rank).find(text) != std::string::npos;
  }

  bool AllExitZero(absl::Duration timeout = absl::Seconds(120)) {
    std::vector<int> codes = cluster_.WaitWorkers(timeout);
    bool ok = true;
    for (size_t r = 0; r < codes.size(); ++r) {
      if (codes[r] != 0) {
        ok = false;
        std::fprintf(stderr, "worker %zu exited %d:\n%s\n", r, codes[r],
                     cluster_.WorkerLog(r).c_str());
      }
    }
    if (!ok) std::fprintf(stderr, "server:\n%s\n", cluster_.server()->Log().c_str());
    return ok;
  }

  void ExpectEqual(const Params& got, const Params& want) {
    ASSERT_FALSE(got.empty()) << "no final checkpoint";
    EXPECT_TRUE(got == want) << "not bitwise equal; max relative difference "
                             << testing::MaxRelativeDifference(got, want);
  }

  // The job's generation as the server has it (0: not known).
  int64_t Generation(const std::string& job) {
    ClientOptions options;
    options.server = cluster_.address();
    options.rpc_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return 0;
    absl::StatusOr<v1::GetStatusResponse> status = (*client)->GetStatus(job);
    if (!status.ok() || status->jobs_size() != 1) return 0;
    return status->jobs(0).generation();
  }

  LocalCluster cluster_;
};

struct Stray {
  const char* name;
  std::string payload;
};

class StrayConnectionTest : public SetupFaultsTest, public ::testing::WithParamInterface<Stray> {};

// A connection that does not present the generation's secret, to every
// port both workers listen on while their setup is held: dropped, and the
// job goes on as if it had never come.
TEST_P(StrayConnectionTest, IsDroppedAndTheJobMatchesAnUninterruptedRun) {
  ASSERT_TRUE(cluster_.ok());
  const Params reference = Reference();
  const std::string hold = cluster_.dir() + "/hold";
  const std::vector<std::string> held = {"--test_hold_data_plane=" + hold};
  cluster_.StartWorkers("stray", 2, Flags(), {{0, held}, {1, held}});
  ASSERT_TRUE(testing::WaitFor([&] { return LogHas(0, kHolding) && LogHas(1, kHolding); },
                               absl::Seconds(60)))
      << cluster_.WorkerLog(0) << cluster_.WorkerLog(1);
  std::vector<std::unique_ptr<StrayConnection>> strays;
  for (int r = 0; r < 2; ++r) {
    for (int port : testing::ListeningPorts(cluster_.worker(r)->pid())) {
      strays.push_back(std::make_unique<StrayConnection>(port, GetParam().payload));
      EXPECT_TRUE(strays.back()->connected()) << "port " << port;
    }
  }
  // Both hold one listening socket per peer: the pair's two ends.
  ASSERT_GE(strays.size(), 2u);
  testing::WriteFile(hold, "");
  ASSERT_TRUE(AllExitZero());
  // The end that listened dropped its stray (the other end connected, which
  // closed its listening socket and the stray queued there).
  EXPECT_TRUE(LogHas(0, "did not present the generation's secret") ||
              LogHas(1, "did not present the generation's secret"))
      << cluster_.WorkerLog(0) << cluster_.WorkerLog(1);
  EXPECT_FALSE(LogHas(0, "recovering")) << cluster_.WorkerLog(0);
  ExpectEqual(Final("stray"), reference);
}

std::string Junk(size_t bytes) {
  std::string junk(bytes, '\0');
  uint64_t state = 29;
  for (char& c : junk) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    c = static_cast<char>(state >> 56);
  }
  return junk;
}

INSTANTIATE_TEST_SUITE_P(Strays, StrayConnectionTest,
                         ::testing::Values(Stray{"Junk", Junk(4096)},
                                           Stray{"FourBytesThenSilence", "GLOO"},
                                           Stray{"OneMebibyte", Junk(1 << 20)}),
                         [](const ::testing::TestParamInfo<Stray>& info) {
                           return info.param.name;
                         });

// The generation moves on while rank 0 is held in its setup (rank 1 was
// killed there and is replaced): rank 0's next call is refused as stale,
// and it joins the next generation instead of exiting.
TEST_F(SetupFaultsTest, AGenerationChangeDuringSetupIsJoinedAgain) {
  ASSERT_TRUE(cluster_.ok());
  const Params reference = Reference();
  const std::string hold = cluster_.dir() + "/hold";
  cluster_.StartWorkers("moved", 2, Flags(), {{0, {"--test_hold_data_plane=" + hold}}});
  ASSERT_TRUE(testing::WaitFor([&] { return LogHas(0, kHolding); }, absl::Seconds(60)))
      << cluster_.WorkerLog(0);
  ASSERT_EQ(Generation("moved"), 1);
  // Rank 1 waits on rank 0 in its own setup: kill it there.
  cluster_.worker(1)->Signal(SIGKILL);
  ASSERT_TRUE(testing::WaitFor([&] { return Generation("moved") >= 2; }, absl::Seconds(30)))
      << cluster_.server()->Log();
  testing::WriteFile(hold, "");
  cluster_.RestartWorker(1);
  ASSERT_TRUE(AllExitZero());
  EXPECT_TRUE(LogHas(0, "recovering (1 of at most")) << cluster_.WorkerLog(0);
  ExpectEqual(Final("moved"), reference);
}

// #29 finding 2, second half: a join with a beating member's worker id and a
// new incarnation (the "ping-pong") is refused with ALREADY_EXISTS and the
// job is not disturbed.
TEST_F(SetupFaultsTest, ThePingPongJoinCannotEvictABeatingMember) {
  ASSERT_TRUE(cluster_.ok());
  cluster_.StartWorkers("pingpong", 2, Flags({"--steps=60", "--test_step_delay_ms=100"}));
  ASSERT_TRUE(testing::WaitFor([&] { return LogHas(0, "step 3/"); }, absl::Seconds(60)))
      << cluster_.WorkerLog(0);
  auto stub = testing::NewCoordinatorStub(cluster_.address());
  for (int i = 0; i < 9; ++i) {
    grpc::ClientContext context;
    testing::PrepareContext(&context, absl::Seconds(5));
    v1::JoinRequest join;
    join.set_job_id("pingpong");
    join.set_world_size(2);
    join.set_worker_id(i % 2 == 0 ? "w0" : "w1");
    join.set_host("127.0.0.1");
    join.set_incarnation(absl::StrCat("pingpong-", i));
    join.set_rejoin_grace_ms(30000);  // the workers' --rejoin_grace, as a real process sends
    v1::JoinResponse response;
    const grpc::Status status = stub->Join(&context, join, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << status.error_message();
  }
  EXPECT_EQ(Generation("pingpong"), 1);
  ASSERT_TRUE(AllExitZero());
  EXPECT_FALSE(LogHas(0, "recovering")) << cluster_.WorkerLog(0);
}

}  // namespace
}  // namespace zeroshard
