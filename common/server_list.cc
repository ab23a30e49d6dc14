#include "common/server_list.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace zeroshard {
namespace {

struct Endpoint {
  std::string host;
  std::string port;
};

absl::StatusOr<Endpoint> SplitHostPort(absl::string_view entry) {
  size_t colon = entry.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(entry.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("server address '", entry, "' is not HOST:PORT"));
  }
  absl::string_view host = entry.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  return Endpoint{std::string(host), std::string(entry.substr(colon + 1))};
}

// The first address of `host`, numeric, and its family.
absl::StatusOr<std::pair<std::string, int>> Resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int code = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (code != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("server host '", host, "' does not resolve: ", gai_strerror(code)));
  }
  char text[INET6_ADDRSTRLEN] = {};
  int family = found->ai_family;
  const void* address =
      family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr);
  inet_ntop(family, address, text, sizeof(text));
  freeaddrinfo(found);
  return std::make_pair(std::string(text), family);
}

}  // namespace

absl::StatusOr<std::string> GrpcTargetForServers(absl::string_view servers) {
  std::vector<absl::string_view> entries =
      absl::StrSplit(servers, ',', absl::SkipWhitespace());
  if (entries.empty()) return absl::InvalidArgumentError("no server address given");
  if (entries.size() == 1) {
    if (absl::StatusOr<Endpoint> one = SplitHostPort(absl::StripAsciiWhitespace(entries[0]));
        !one.ok()) {
      return one.status();
    }
    return std::string(absl::StripAsciiWhitespace(entries[0]));
  }
  std::vector<std::string> addresses;
  int family = 0;
  for (absl::string_view entry : entries) {
    absl::StatusOr<Endpoint> endpoint = SplitHostPort(absl::StripAsciiWhitespace(entry));
    if (!endpoint.ok()) return endpoint.status();
    absl::StatusOr<std::pair<std::string, int>> resolved = Resolve(endpoint->host);
    if (!resolved.ok()) return resolved.status();
    if (family != 0 && resolved->second != family) {
      return absl::InvalidArgumentError(absl::StrCat(
          "servers '", servers, "' mix IPv4 and IPv6 addresses; list addresses of one family"));
    }
    family = resolved->second;
    addresses.push_back(family == AF_INET6
                            ? absl::StrCat("[", resolved->first, "]:", endpoint->port)
                            : absl::StrCat(resolved->first, ":", endpoint->port));
  }
  return absl::StrCat(family == AF_INET6 ? "ipv6:" : "ipv4:", absl::StrJoin(addresses, ","));
}

std::string FirstServer(absl::string_view servers) {
  return std::string(absl::StripAsciiWhitespace(servers.substr(0, servers.find(','))));
}

}  // namespace zeroshard
