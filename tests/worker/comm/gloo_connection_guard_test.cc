// The guard on the data plane's connections (gloo_connection_guard.h), in
// one process: ranks as threads over an in-memory store, strays connected
// to every listening socket of the process while the ranks hold between
// publishing their addresses and connecting.
#include "worker/comm/gloo_connection_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace {

// Connects to 127.0.0.1:port and sends what of `payload` fits without
// blocking; the socket (returned) stays open.
int ConnectStray(int port, const std::string& payload) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return fd;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  size_t sent = 0;
  while (sent < payload.size()) {
    const ssize_t n = send(fd, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  return fd;
}

class GuardTest : public ::testing::TestWithParam<std::string> {};

// W = 2: one pair per rank. (With W >= 3 and strays at several ranks, the
// ranks' event threads can wait on each other's hellos until the deadline:
// gloo_connection_guard.h, "Limits".)
TEST_P(GuardTest, StraysDuringSetupAreDroppedAndTheContextWorks) {
  constexpr int kWorld = 2;
  InMemoryKvStore store;
  absl::BlockingCounter published(kWorld);
  absl::Notification strays_sent;
  std::vector<int> strays;
  std::atomic<int> waiting{0};
  comm_test::RunThreads(kWorld, [&](int rank) {
    GlooCommunicator::Options options;
    options.connect_timeout = absl::Seconds(10);
    options.before_connecting = [&] {
      published.DecrementCount();
      if (waiting.fetch_add(1) + 1 == kWorld) {
        published.Wait();
        for (int port : testing::ListeningPorts(getpid())) {
          strays.push_back(ConnectStray(port, GetParam()));
        }
        strays_sent.Notify();
      }
      strays_sent.WaitForNotification();
    };
    auto comm = GlooCommunicator::Create(&store, rank, kWorld, "guard", options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::vector<float> x(8, static_cast<float>(rank + 1));
    ASSERT_TRUE((*comm)
                    ->AllReduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum, absl::Seconds(10))
                    .ok());
    EXPECT_EQ(x[0], 3.0f);
  });
  EXPECT_GE(strays.size(), static_cast<size_t>(kWorld * (kWorld - 1)));
  for (int fd : strays) close(fd);
}

INSTANTIATE_TEST_SUITE_P(Payloads, GuardTest,
                         ::testing::Values(std::string(4096, '\x01'), std::string("GLOO"),
                                           std::string(1 << 20, 'x'), std::string()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return absl::StrCat("Bytes", info.param.size());
                         });

TEST(PairHelloTest, NamesBothRanksAndTheSecret) {
  const std::string secret(kPairSecretBytes, 's');
  EXPECT_EQ(PairHello(secret, 1, 0).size(), static_cast<size_t>(kPairHelloBytes));
  EXPECT_NE(PairHello(secret, 1, 0), PairHello(secret, 0, 1));
  EXPECT_NE(PairHello(secret, 1, 0), PairHello(std::string(kPairSecretBytes, 't'), 1, 0));
}

TEST(ConnectionGuardTest, IsActiveInThisProcess) {
  EXPECT_TRUE(CheckConnectionGuardActive().ok()) << CheckConnectionGuardActive();
}

}  // namespace
}  // namespace zeroshard
