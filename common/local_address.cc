#include "common/local_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {

namespace {

// A port's digits as a number, or -1 when they are not 0-65535.
int PortNumber(const std::string& digits) {
  if (digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  const int port = std::stoi(digits);
  return port <= 65535 ? port : -1;
}

}  // namespace

absl::Status CheckListenAddress(const std::string& flag, const std::string& address,
                                bool unix_allowed) {
  if (unix_allowed && absl::StartsWith(address, "unix:")) return absl::OkStatus();
  const std::string expected =
      unix_allowed ? "expected HOST:PORT (a port of 0-65535, 0 picks a free one) or unix:PATH"
                   : "expected HOST:PORT (a port of 0-65535, 0 picks a free one)";
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", address, " has no port: ", expected));
  }
  if (PortNumber(address.substr(colon + 1)) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", address, ": port '",
                                                   address.substr(colon + 1),
                                                   "' is not a port number; ", expected));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LocalAddressTowards(const std::string& server) {
  const size_t colon = server.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("server address '", server,
                     "' is not HOST:PORT: pass --server=HOST:PORT of a shard_server"));
  }
  std::string host = server.substr(0, colon);
  const std::string port = server.substr(colon + 1);
  if (PortNumber(port) <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "server address '", server, "': port '", port,
        "' is not a port number (1-65535): pass --server=HOST:PORT of a shard_server"));
  }
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  auto fail = [&](const std::string& why) {
    return absl::UnavailableError(
        absl::StrCat("cannot tell this machine's address towards the server ", server, " (", why,
                     "): pass --host=<the address peers reach this worker at>"));
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    // The server's name does not resolve here: the address is wrong (or
    // DNS is), not this machine's.
    return absl::UnavailableError(absl::StrCat("server address '", server, "': host '", host,
                                               "' does not resolve (", gai_strerror(rc),
                                               "): check --server=HOST:PORT (or, if the "
                                               "server is reached that way all the same, pass "
                                               "--host=<the address peers reach this worker "
                                               "at>)"));
  }
  // IPv4 first: a name like "localhost" may resolve to ::1 before
  // 127.0.0.1, and the data plane's peers are usually reached over IPv4.
  std::vector<addrinfo*> candidates;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) candidates.push_back(a);
  }
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET) candidates.push_back(a);
  }
  std::string why = "no address";
  for (addrinfo* a : candidates) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      why = std::strerror(errno);
      close(fd);
      continue;
    }
    close(fd);
    char text[INET6_ADDRSTRLEN] = {0};
    const void* raw =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (inet_ntop(local.ss_family, raw, text, sizeof(text)) == nullptr) continue;
    freeaddrinfo(found);
    return std::string(text);
  }
  freeaddrinfo(found);
  return fail(why);
}

std::string HostIdentity() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (!(boot >> boot_id) || boot_id.empty()) return "";
  return absl::StrCat(name, " ", boot_id);
}

bool IsLoopback(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "::1" || host == "localhost";
}

}  // namespace zeroshard
