// --data_plane_ports: the parser, the bind scope on its own, and Gloo
// communicators whose pairs listen in a range (ranks as threads, 127.0.0.1).
#include "worker/comm/gloo_port_range.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace {

TEST(ParsePortRangeTest, AcceptsLoHiAndEmptyAndSaysWhatIsExpected) {
  auto range = ParsePortRange("29500-29599");
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->first, 29500);
  EXPECT_EQ(range->last, 29599);
  EXPECT_EQ(range->size(), 100);
  EXPECT_TRUE(ParsePortRange("")->empty());
  for (const char* bad : {"29500", "29599-29500", "0-10", "1-70000", "a-b", "1-2-3"}) {
    auto parsed = ParsePortRange(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find("expected LO-HI"), std::string::npos)
        << parsed.status();
  }
}

// A TCP socket bound to 127.0.0.1 port 0; its port (-1: the bind failed).
int BindLoopbackPortZero(int* fd) {
  *fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(*fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return -1;
  socklen_t length = sizeof(address);
  getsockname(*fd, reinterpret_cast<sockaddr*>(&address), &length);
  return ntohs(address.sin_port);
}

TEST(ListenPortRangeTest, PortZeroTakesAFreePortOfTheRangeUntilItIsFull) {
  const PortRange range{41611, 41612};
  std::vector<int> fds(3, -1);
  std::set<int> ports;
  {
    ListenPortRange scope(range);
    for (int i = 0; i < 2; ++i) {
      const int port = BindLoopbackPortZero(&fds[i]);
      ASSERT_GE(port, range.first) << port;
      ASSERT_LE(port, range.last) << port;
      ASSERT_EQ(listen(fds[i], 1), 0);
      ports.insert(port);
    }
    EXPECT_EQ(ports.size(), 2u);  // two sockets, two ports
    EXPECT_EQ(BindLoopbackPortZero(&fds[2]), -1);
    EXPECT_EQ(errno, EADDRINUSE);
    close(fds[2]);
  }
  // Outside the scope port 0 is ephemeral again.
  const int ephemeral = BindLoopbackPortZero(&fds[2]);
  EXPECT_GT(ephemeral, 0);
  EXPECT_EQ(ports.count(ephemeral), 0u);
  for (int fd : fds) close(fd);
}

// Local ports of this network namespace's established TCP sockets.
std::multiset<int> EstablishedLocalPorts() {
  std::multiset<int> ports;
  std::ifstream file("/proc/net/tcp");
  std::string line;
  std::getline(file, line);  // header
  while (std::getline(file, line)) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 4 || fields[3] != "01") continue;  // 01: ESTABLISHED
    std::vector<std::string> local = absl::StrSplit(fields[1], ':');
    int port = 0;
    if (local.size() == 2 && absl::SimpleHexAtoi(local[1], &port)) ports.insert(port);
  }
  return ports;
}

GlooCommunicator::Options RangeOptions(PortRange range, absl::Duration timeout) {
  GlooCommunicator::Options options;
  options.hostname = "127.0.0.1";
  options.connect_timeout = timeout;
  options.shared_memory = false;
  options.ports = range;
  return options;
}

TEST(GlooPortRangeTest, EveryPairListensInTheRangeAndTheRanksTrain) {
  constexpr int kWorld = 3;
  const PortRange range{41620, 41625};  // world_size - 1 per rank, 3 ranks on this host
  InMemoryKvStore store;
  std::vector<std::unique_ptr<GlooCommunicator>> comms(kWorld);
  comm_test::RunThreads(kWorld, [&](int rank) {
    auto comm = GlooCommunicator::Create(&store, rank, kWorld, "ports",
                                         RangeOptions(range, absl::Seconds(10)));
    ASSERT_TRUE(comm.ok()) << comm.status();
    comms[rank] = *std::move(comm);
  });
  for (const auto& comm : comms) ASSERT_NE(comm, nullptr);
  // Each of the 3 pairs has a listening end, whose accepted socket keeps
  // the port it listened on.
  int in_range = 0;
  for (int port : EstablishedLocalPorts()) in_range += port >= range.first && port <= range.last;
  EXPECT_GE(in_range, kWorld * (kWorld - 1) / 2);
  comm_test::RunThreads(kWorld, [&](int rank) {
    float value = static_cast<float>(rank + 1);
    ASSERT_TRUE(
        comms[rank]->AllReduce(&value, 1, DType::kF32, ReduceOp::kSum, absl::Seconds(10)).ok());
    EXPECT_EQ(value, 6.0f);
  });
}

TEST(GlooPortRangeTest, ARangeTooSmallSaysSo) {
  constexpr int kWorld = 3;
  const PortRange range{41630, 41630};  // one port: the second pair of a rank finds none
  InMemoryKvStore store;
  std::vector<std::string> errors(kWorld);
  comm_test::RunThreads(kWorld, [&](int rank) {
    auto comm = GlooCommunicator::Create(&store, rank, kWorld, "few",
                                         RangeOptions(range, absl::Seconds(2)));
    if (!comm.ok()) errors[rank] = comm.status().ToString();
  });
  bool named = false;
  for (const std::string& e : errors) {
    named |= e.find("no free port in --data_plane_ports=41630-41630") != std::string::npos;
  }
  EXPECT_TRUE(named) << errors[0] << "\n" << errors[1] << "\n" << errors[2];
}

}  // namespace
}  // namespace zeroshard
