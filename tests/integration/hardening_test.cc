// #29's small findings with real processes: shardctl consolidate's output
// (a FIFO, an existing file), token files (world-readable, short), slow
// connections to the metrics port, and the per-step history (a rank whose
// step goes down, a NaN loss).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

std::pair<int, std::string> Shardctl(const LocalCluster& cluster, const std::string& args) {
  return testing::RunCommand(absl::StrCat(testing::RunfilePath("client/shardctl"),
                                          " --server=", cluster.address(), " ", args, " 2>&1"));
}

bool IsFifo(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
}

TEST(ConsolidateOutputTest, AFifoIsRefusedAndAnExistingFileNeedsForce) {
  LocalCluster cluster(testing::MakeTempDir("consolidate-out"));
  ASSERT_TRUE(cluster.ok());
  ASSERT_TRUE(cluster.Run(
      "small", 1,
      {"--model=mlp", "--layers=2", "--width=8", "--steps=2", "--seed=1", "--checkpoint_at_end"}));
  const std::string consolidate = "consolidate --job=small --step=latest --out=";

  const std::string fifo = cluster.dir() + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto [fifo_code, fifo_output] = Shardctl(cluster, consolidate + fifo);
  EXPECT_NE(fifo_code, 0) << fifo_output;
  EXPECT_NE(fifo_output.find("is a FIFO"), std::string::npos) << fifo_output;
  EXPECT_TRUE(IsFifo(fifo)) << "the FIFO was replaced";
  // --force does not make a FIFO replaceable.
  auto [forced_code, forced_output] = Shardctl(cluster, consolidate + fifo + " --force");
  EXPECT_NE(forced_code, 0) << forced_output;
  EXPECT_TRUE(IsFifo(fifo)) << "the FIFO was replaced with --force";

  const std::string existing = cluster.dir() + "/model.safetensors";
  testing::WriteFile(existing, "keep me");
  auto [code, output] = Shardctl(cluster, consolidate + existing);
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(output.find("--force"), std::string::npos) << output;
  EXPECT_EQ(testing::ReadFileOrEmpty(existing), "keep me");
  auto [replaced_code, replaced_output] = Shardctl(cluster, consolidate + existing + " --force");
  EXPECT_EQ(replaced_code, 0) << replaced_output;
  EXPECT_GT(testing::ReadFileOrEmpty(existing).size(), 100u);
}

// The server's and shardctl's token files: one any user may read, or a short
// token, is refused unless --insecure.
TEST(TokenFileTest, WorldReadableOrShortTokensAreRefusedUnlessInsecure) {
  const std::string dir = testing::MakeTempDir("tokens");
  const std::string open_file = dir + "/open";
  testing::WriteFile(open_file, "a-long-enough-token-0123456789\n");
  chmod(open_file.c_str(), 0644);
  const std::string short_file = dir + "/short";
  testing::WriteSecretFile(short_file, "s3cret\n");
  const std::string server = testing::RunfilePath("shard_server/shard_server");
  const std::string refused_flags = " --listen=127.0.0.1:0 --state_dir=" + dir + "/state";

  auto [open_code, open_output] = testing::RunCommand(absl::StrCat(
      "timeout 20 ", server, refused_flags, " --auth_token_file=", open_file, " 2>&1"));
  EXPECT_NE(open_code, 0) << open_output;
  EXPECT_NE(open_output.find("readable by every user"), std::string::npos) << open_output;
  auto [short_code, short_output] = testing::RunCommand(absl::StrCat(
      "timeout 20 ", server, refused_flags, " --auth_token_file=", short_file, " 2>&1"));
  EXPECT_NE(short_code, 0) << short_output;
  EXPECT_NE(short_output.find("6-character token"), std::string::npos) << short_output;

  // With --insecure the server starts, and so does a client.
  LocalCluster cluster(dir + "/cluster", {"--auth_token_file=" + short_file, "--insecure"});
  ASSERT_TRUE(cluster.ok());
  auto [client_code, client_output] = Shardctl(cluster, "--token_file=" + open_file + " status");
  EXPECT_NE(client_code, 0) << client_output;
  EXPECT_NE(client_output.find("readable by every user"), std::string::npos) << client_output;
  auto [insecure_code, insecure_output] =
      Shardctl(cluster, "--token_file=" + short_file + " --insecure status");
  EXPECT_EQ(insecure_code, 0) << insecure_output;
}

// A token over plaintext off loopback: the server refuses to listen on a
// non-loopback address with a token and no TLS, shardctl refuses to send one
// to such a server, unless --insecure (#29 finding 8's second half).
TEST(TokenFileTest, ATokenWithoutTlsOffLoopbackIsRefusedUnlessInsecure) {
  const std::string dir = testing::MakeTempDir("plaintext");
  const std::string token = dir + "/token";
  testing::WriteSecretFile(token, "a-long-enough-token-0123456789\n");
  const std::string server = testing::RunfilePath("shard_server/shard_server");
  auto [code, output] = testing::RunCommand(
      absl::StrCat("timeout 20 ", server, " --listen=0.0.0.0:0 --state_dir=", dir,
                   "/state --auth_token_file=", token, " 2>&1"));
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(output.find("turn TLS on (--tls_cert and --tls_key)"), std::string::npos) << output;
  // With --insecure it serves (on every address, loopback included).
  LocalCluster cluster(dir + "/cluster", {"--auth_token_file=" + token, "--insecure"});
  ASSERT_TRUE(cluster.ok());

  // shardctl to an address that is not loopback: refused before connecting.
  const std::string shardctl = testing::RunfilePath("client/shardctl");
  auto [remote_code, remote_output] = testing::RunCommand(
      absl::StrCat(shardctl, " --server=10.255.255.1:7070 --token_file=", token, " status 2>&1"));
  EXPECT_NE(remote_code, 0) << remote_output;
  EXPECT_NE(remote_output.find("turn TLS on (--tls_ca)"), std::string::npos) << remote_output;
  auto [local_code, local_output] = testing::RunCommand(absl::StrCat(
      shardctl, " --server=", cluster.address(), " --token_file=", token, " status 2>&1"));
  EXPECT_EQ(local_code, 0) << local_output;
}

// A server off loopback that authenticates no one refuses to start, saying
// which flag and what to do; --insecure lets it serve (#51 item 8).
TEST(TokenFileTest, AnUnauthenticatedServerOffLoopbackRefusesToStartUnlessInsecure) {
  const std::string dir = testing::MakeTempDir("unauthenticated");
  const std::string server = testing::RunfilePath("shard_server/shard_server");
  auto [code, output] = testing::RunCommand(absl::StrCat(
      "timeout 20 ", server, " --listen=0.0.0.0:0 --state_dir=", dir, "/refused 2>&1"));
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(code, 124) << "it served instead of refusing: " << output;
  EXPECT_NE(output.find("--listen=0.0.0.0:0 is reachable from other machines and no client is "
                        "authenticated"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("pass --insecure"), std::string::npos) << output;
  EXPECT_EQ(output.find("listening on"), std::string::npos) << output;
  // With --insecure it serves (0.0.0.0 includes loopback, where it is asked).
  testing::ChildProcess insecure(server,
                                 {"--listen=0.0.0.0:0", "--insecure", "--state_dir=" + dir + "/ok",
                                  "--port_file=" + dir + "/port"},
                                 dir + "/insecure.log");
  std::string port;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        port = testing::ReadFileOrEmpty(dir + "/port");
        return !port.empty() && port.back() == '\n';
      },
      absl::Seconds(60)))
      << insecure.Log();
  auto [health_code, health] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"),
                   " --server=127.0.0.1:", absl::StripAsciiWhitespace(port), " health 2>&1"));
  EXPECT_EQ(health_code, 0) << health << insecure.Log();
}

// A TCP connection to 127.0.0.1:port; -1 on failure.
int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET /metrics on a fresh connection: the status line, or "" (a 60 s
// bound, far above the seconds a blocked port took).
std::string StatusLineOfGet(int port) {
  const int fd = ConnectTo(port);
  if (fd < 0) return "";
  timeval limit = {60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while (reply.find("\r\n") == std::string::npos && (n = recv(fd, buffer, sizeof(buffer), 0)) > 0) {
    reply.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return reply.substr(0, reply.find("\r\n"));
}

// Still open from the server's side: nothing to read yet, no EOF or reset.
bool StillOpen(int fd) {
  char byte;
  const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

// #29 finding 7: six connections that send half a request held /metrics
// until civetweb's request timeout freed a thread. Now a GET is answered
// while they are all still held open.
TEST(MetricsPortTest, SlowConnectionsDoNotBlockAScrape) {
  const std::string dir = testing::MakeTempDir("slow-metrics");
  LocalCluster cluster(dir,
                       {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/mport"});
  ASSERT_TRUE(cluster.ok());
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(dir + "/mport")),
                               &port));
  std::vector<int> slow;
  for (int i = 0; i < 8; ++i) {
    const int fd = ConnectTo(port);
    ASSERT_GE(fd, 0);
    const std::string half = "GET /metrics HTTP/1.1\r\nHost: ";
    send(fd, half.data(), half.size(), MSG_NOSIGNAL);
    slow.push_back(fd);
  }
  EXPECT_EQ(StatusLineOfGet(port), "HTTP/1.1 200 OK");
  int open = 0;
  for (int fd : slow) open += StillOpen(fd) ? 1 : 0;
  EXPECT_EQ(open, 8) << "the scrape was answered only after slow connections were dropped";
  for (int fd : slow) close(fd);
}

// Finding 5: a rank whose reported step went down added a history point
// every status pass without counting it (119 points after 60 s where the
// bound was 64, and growing), and a NaN loss read back as 0.0000. A real
// server with a bound of 8 points per rank; one rank beats every 50 ms with
// its step going down by one each beat and every other loss NaN. The
// history is read with shardctl while the server records a point per pass
// (every 500 ms): it must never hold more than 8 points for the rank while
// at least 24 distinct steps pass through it, and NaN must read as NaN.
TEST(HistoryTest, AStepThatGoesDownStaysWithinTheBoundAndANaNLossReadsAsNaN) {
  constexpr int kBound = 8;
  const std::string dir = testing::MakeTempDir("history-bound");
  LocalCluster cluster(dir, {absl::StrCat("--history_max_points_per_job=", kBound),
                             absl::StrCat("--history_min_points_per_rank=", kBound)});
  ASSERT_TRUE(cluster.ok());
  std::unique_ptr<v1::Coordinator::Stub> stub = testing::NewCoordinatorStub(cluster.address());
  v1::JoinRequest join;
  join.set_job_id("hist");
  join.set_world_size(1);
  join.set_worker_id("w0");
  v1::JoinResponse joined;
  {
    grpc::ClientContext context;
    testing::PrepareContext(&context, absl::Seconds(30));
    grpc::Status status = stub->Join(&context, join, &joined);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  grpc::ClientContext beat_context;
  // The whole loop's deadline and some: a server that stops answering ends
  // the stream instead of holding the test.
  testing::PrepareContext(&beat_context, absl::Seconds(120));
  std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> beats =
      stub->Heartbeat(&beat_context);
  v1::HeartbeatRequest beat;
  v1::MemberCredentials* member = beat.mutable_member();
  member->set_job_id("hist");
  member->set_generation(joined.generation());
  member->set_rank(joined.rank());
  member->set_token(joined.token());
  std::set<int64_t> seen;  // the steps the history held at some read
  size_t most = 0;         // the most points it held at one read
  bool nan_shown = false;
  std::string csv;
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  int64_t step = 100000;
  absl::Time next_read = absl::Now();
  while (absl::Now() < deadline && (seen.size() < 3 * kBound || !nan_shown)) {
    beat.set_step(step);
    beat.set_loss(step % 2 == 0 ? 0.5 : std::nan(""));
    beat.mutable_last_step()->set_step_ms(10);
    v1::HeartbeatResponse answer;
    ASSERT_TRUE(beats->Write(beat) && beats->Read(&answer)) << "the heartbeat stream broke";
    ASSERT_EQ(answer.command(), v1::CONTINUE) << answer.reason();
    --step;
    absl::SleepFor(absl::Milliseconds(50));
    if (absl::Now() < next_read) continue;
    next_read = absl::Now() + absl::Milliseconds(300);
    auto [code, out] = Shardctl(cluster, "--job=hist history --csv");
    if (code != 0) continue;  // no point recorded yet
    csv = out;
    size_t points = 0;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      std::vector<std::string> fields = absl::StrSplit(line, ',');
      int64_t point_step = 0;
      if (fields.size() != 7 || fields[0] != "0" || !absl::SimpleAtoi(fields[1], &point_step)) {
        continue;
      }
      ++points;
      seen.insert(point_step);
      if (fields[3] == "nan" || fields[3] == "-nan") nan_shown = true;
    }
    most = std::max(most, points);
    ASSERT_LE(points, static_cast<size_t>(kBound)) << out;
  }
  beats->WritesDone();
  beat_context.TryCancel();
  EXPECT_GE(seen.size(), static_cast<size_t>(3 * kBound))
      << "the server recorded too few points in 90 s to test the bound:\n" << csv;
  EXPECT_GE(most, static_cast<size_t>(kBound / 2)) << csv;
  EXPECT_TRUE(nan_shown) << csv;
  // The table people read says NaN too, not 0.0000.
  auto [code, table] = Shardctl(cluster, "--job=hist history");
  EXPECT_EQ(code, 0) << table;
  EXPECT_TRUE(absl::StrContains(absl::AsciiStrToLower(table), "nan")) << table;
}

}  // namespace
}  // namespace zeroshard
