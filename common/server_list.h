// A list of servers ("a:7070,b:7070,c:7070") as one gRPC channel target.
//
// Why: a replicated control plane (several shard servers on etcd, or an etcd
// cluster) is reached through one channel whose pick_first policy connects to
// the first address that accepts. Only the leading shard server listens, so
// the channel finds the leader by itself and finds the next one within one
// reconnect after a failover, without a redirect round trip.
#ifndef ZEROSHARD_COMMON_SERVER_LIST_H_
#define ZEROSHARD_COMMON_SERVER_LIST_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// One HOST:PORT is returned as it is (gRPC resolves it; one DNS name with
// several addresses is already a list). Several, comma-separated, become an
// "ipv4:A:P,B:P" (or "ipv6:[A]:P,...") target, each host resolved now.
// INVALID_ARGUMENT naming the entry that is not HOST:PORT or not resolved,
// or when IPv4 and IPv6 addresses are mixed.
absl::StatusOr<std::string> GrpcTargetForServers(absl::string_view servers);

// The first HOST:PORT of the list (all of `servers` when it has one): the
// route to any server of a control plane picks this host's address.
std::string FirstServer(absl::string_view servers);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_SERVER_LIST_H_
