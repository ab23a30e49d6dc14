// The command-line flags that say how to reach the shard server, defined once
// for every binary that talks to it (shardctl, shard_worker):
//
//   --server=HOST:PORT  --token_file=F  --tls_ca=F  --tls_cert=F  --tls_key=F
//
// A binary gets them by linking //client:connection_flags.
#ifndef ZEROSHARD_CLIENT_CONNECTION_FLAGS_H_
#define ZEROSHARD_CLIENT_CONNECTION_FLAGS_H_

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "client/client.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);

namespace zeroshard {

// ClientOptions for --server, with the bearer token and the TLS PEM files the
// flags name already read (LoadClientFiles). Everything else keeps its
// default. The error of reading a file (NOT_FOUND "cannot read token file
// F", INVALID_ARGUMENT for an empty token file) otherwise.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags();

}  // namespace zeroshard

#endif  // ZEROSHARD_CLIENT_CONNECTION_FLAGS_H_
