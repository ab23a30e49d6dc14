// Reading a bearer token from a file, refusing the files that leak it or
// the tokens that are easy to guess (#29, finding 8).
#ifndef ZEROSHARD_COMMON_SECRET_FILE_H_
#define ZEROSHARD_COMMON_SECRET_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace zeroshard {

// Shorter tokens are refused: 16 characters of `openssl rand -hex 32` are
// 64 bits, beyond guessing over RPC.
inline constexpr int kMinTokenLength = 16;

// The token in `path` without surrounding whitespace. errno's code (NOT_FOUND,
// PERMISSION_DENIED) when the file cannot be read; INVALID_ARGUMENT naming
// `flag` ("--auth_token_file") when it is empty, and, unless `insecure`, when
// any user may read or write it (mode o+r or o+w) or the token is shorter
// than kMinTokenLength.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag,
                                          bool insecure);

// A bearer token sent or accepted without TLS is readable by anyone on the
// path: OK when there is no token, TLS is on, `address` (HOST:PORT or
// [IPV6]:PORT: where the client connects, or where the server listens) is a
// loopback address (the token never leaves the machine), or `insecure`;
// otherwise INVALID_ARGUMENT saying to use TLS (`tls_flag`) or --insecure.
absl::Status CheckTokenTransport(bool has_token, bool tls, const std::string& address,
                                 bool insecure, const std::string& tls_flag);

// A server that authenticates no client (no token, no job tokens, no TLS
// client certificates) lets anyone who reaches its port join jobs, read and
// write their keys and commit or delete checkpoints: OK when it listens on
// loopback only (`address`, HOST:PORT or [IPV6]:PORT), when `authenticated`,
// or when `insecure`; otherwise INVALID_ARGUMENT naming the address and the
// three ways out.
absl::Status CheckListenAuthenticated(const std::string& address, bool authenticated,
                                      bool insecure);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_SECRET_FILE_H_
