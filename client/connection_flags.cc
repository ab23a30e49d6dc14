#include "client/connection_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7070", "Shard server HOST:PORT, or several comma-separated (a replicated control plane on etcd: the one leading is used)");
ABSL_FLAG(std::string, token_file, "", "File holding the server's bearer token");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA file: connect with TLS and verify the server");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mutual TLS)");
ABSL_FLAG(bool, insecure, false,
          "Accept a --token_file that every user may read or write, or a token shorter than 16 "
          "characters (both refused otherwise)");

namespace zeroshard {

absl::StatusOr<ClientOptions> ClientOptionsFromFlags() {
  ClientOptions options;
  options.server = absl::GetFlag(FLAGS_server);
  options.insecure = absl::GetFlag(FLAGS_insecure);
  absl::Status loaded =
      LoadClientFiles(absl::GetFlag(FLAGS_token_file), absl::GetFlag(FLAGS_tls_ca),
                      absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), &options);
  if (!loaded.ok()) return loaded;
  return options;
}

}  // namespace zeroshard
