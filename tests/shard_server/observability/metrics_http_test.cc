// The metrics port (civetweb) over a real socket: a page larger than the
// socket buffers reaches a client that reads it slowly, whole.
#include "shard_server/observability/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// GET `path` on 127.0.0.1:`port` reading at most `chunk` bytes every
// `pause`, as a scraper on a busy machine does; everything until the server
// closes (or resets) the connection.
std::string SlowGet(int port, const std::string& path, size_t chunk, absl::Duration pause) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  int small = 16 << 10;  // a small receive window: the server's writes block on us
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  std::string buffer(chunk, '\0');
  while (true) {
    ssize_t n = read(fd, buffer.data(), buffer.size());
    if (n <= 0) break;  // 0: the server's FIN; < 0: a reset
    response.append(buffer.data(), static_cast<size_t>(n));
    absl::SleepFor(pause);
  }
  close(fd);
  return response;
}

// The server closes the connection after the handler wrote the last bytes
// into the kernel's send buffer. With an abortive close (linger 0) the
// kernel reset the connection and dropped what the client had not read yet:
// a 32K-rank /metrics stopped after 128,000 bytes under load (#31).
TEST(MetricsHttpTest, APageLargerThanTheSocketBuffersReachesASlowReaderWhole) {
  const std::string body(4 << 20, 'm');  // 4 MiB: a 100,000-rank /metrics is 4.7 MB
  auto server = MetricsHttpServer::Start(
      "127.0.0.1:0", "",
      {{"/metrics", HttpPage{[&](const std::map<std::string, std::string>&) {
                               return HttpResponse{200, "text/plain", body};
                             },
                             false}}});
  ASSERT_TRUE(server.ok()) << server.status();
  // 64 KiB per ms at most: ~64 ms of pauses for 4 MiB, the client always
  // behind the server.
  const std::string response =
      SlowGet((*server)->port(), "/metrics", 64 << 10, absl::Milliseconds(1));
  const size_t head = response.find("\r\n\r\n");
  ASSERT_NE(head, std::string::npos) << response.substr(0, 200);
  EXPECT_TRUE(absl::StartsWith(response, "HTTP/1.1 200")) << response.substr(0, 200);
  EXPECT_EQ(response.size() - head - 4, body.size()) << "the body was cut short";
}

}  // namespace
}  // namespace zeroshard
