// The local address of this machine's route to a server: what a worker
// advertises to its peers unless told otherwise (shard_worker --host). On a
// machine with several interfaces it is the one the server is reached
// through, which is the network the job's other hosts share with it; a
// server on 127.0.0.1 gives 127.0.0.1 (one host).
#ifndef ZEROSHARD_COMMON_LOCAL_ADDRESS_H_
#define ZEROSHARD_COMMON_LOCAL_ADDRESS_H_

#include <string>

#include "absl/status/statusor.h"

namespace zeroshard {

// `server` is HOST:PORT or [IPV6]:PORT. Sends nothing: the kernel picks the
// route for a connected UDP socket. Errors name the server and what to do.
absl::StatusOr<std::string> LocalAddressTowards(const std::string& server);

// "<hostname> <boot id>": which machine this process runs on (a container or
// an emulated host with its own hostname counts as its own), or "" if either
// cannot be read.
std::string HostIdentity();

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopback(const std::string& host);

// An address to listen on, as `--<flag>=<address>`: HOST:PORT or
// [IPV6]:PORT with a port of 0-65535 (0: a free one), or, where
// `unix_allowed`, unix:PATH. INVALID_ARGUMENT naming the flag, the value and
// the expected form otherwise (gRPC would take a port past 65535 modulo
// 65536 and serve somewhere else).
absl::Status CheckListenAddress(const std::string& flag, const std::string& address,
                                bool unix_allowed);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_LOCAL_ADDRESS_H_
