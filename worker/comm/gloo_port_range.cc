#include "worker/comm/gloo_port_range.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace zeroshard {
namespace {

thread_local const PortRange* listen_range = nullptr;

// Where a search starts: contexts and the ranks of a host then rarely try the
// same port first (a taken port only costs one more bind).
std::atomic<int> next_offset{0};

using BindFunction = int (*)(int, const sockaddr*, socklen_t);

BindFunction LibcBind() {
  static const BindFunction libc = reinterpret_cast<BindFunction>(dlsym(RTLD_NEXT, "bind"));
  return libc;
}

// The port of an IPv4 or IPv6 address; -1 for other families.
int PortOf(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(address)->sin_port);
  }
  if (address->sa_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(address)->sin6_port);
  }
  return -1;
}

void SetPort(sockaddr_storage* address, int port) {
  if (address->ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(address)->sin_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in6*>(address)->sin6_port = htons(port);
  }
}

bool IsTcp(int fd) {
  int type = 0;
  socklen_t length = sizeof(type);
  return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) == 0 && type == SOCK_STREAM;
}

int BindInRange(int fd, const sockaddr* address, socklen_t length, const PortRange& range) {
  sockaddr_storage copy;
  if (length > sizeof(copy)) {
    errno = EINVAL;
    return -1;
  }
  std::memcpy(&copy, address, length);
  const int start = next_offset.fetch_add(1) % range.size();
  for (int i = 0; i < range.size(); ++i) {
    SetPort(&copy, range.first + (start + i) % range.size());
    if (LibcBind()(fd, reinterpret_cast<const sockaddr*>(&copy), length) == 0) return 0;
    if (errno != EADDRINUSE) return -1;
  }
  errno = EADDRINUSE;
  return -1;
}

}  // namespace

absl::StatusOr<PortRange> ParsePortRange(absl::string_view text) {
  if (text.empty()) return PortRange{};
  std::vector<absl::string_view> parts = absl::StrSplit(text, '-');
  PortRange range;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &range.first) ||
      !absl::SimpleAtoi(parts[1], &range.last) || range.first < 1 || range.last > 65535 ||
      range.first > range.last) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_plane_ports='", text,
                     "': expected LO-HI, two port numbers with 1 <= LO <= HI <= 65535 (e.g. "
                     "29500-29599), or empty for ephemeral ports"));
  }
  return range;
}

ListenPortRange::ListenPortRange(PortRange range) {
  if (!range.empty()) listen_range = new PortRange(range);
}

ListenPortRange::~ListenPortRange() {
  delete listen_range;
  listen_range = nullptr;
}

}  // namespace zeroshard

// Gloo's (and everyone's) bind: see gloo_port_range.h.
extern "C" int bind(int fd, const sockaddr* address, socklen_t length) {
  const zeroshard::PortRange* range = zeroshard::listen_range;
  if (range == nullptr || address == nullptr || zeroshard::PortOf(address) != 0 ||
      !zeroshard::IsTcp(fd)) {
    return zeroshard::LibcBind()(fd, address, length);
  }
  return zeroshard::BindInRange(fd, address, length, *range);
}
