#include "common/secret_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/local_address.h"

namespace zeroshard {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag,
                                          bool insecure) {
  const std::string named = absl::StrCat(flag, "=", path);
  struct stat st;
  // A file that is not there or cannot be read keeps errno's code
  // (NOT_FOUND, PERMISSION_DENIED).
  if (stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot read " + flag, path);
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) return contents.status();
  const std::string token(absl::StripAsciiWhitespace(*contents));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(named, " is empty"));
  if (insecure) return token;
  if ((st.st_mode & (S_IROTH | S_IWOTH)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is %s by every user (mode %04o): chmod 600 it (640 to share it with a group), or "
        "pass --insecure",
        named, (st.st_mode & S_IWOTH) != 0 ? "writable" : "readable", st.st_mode & 07777));
  }
  if (static_cast<int>(token.size()) < kMinTokenLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        named, " holds a ", token.size(), "-character token; at least ", kMinTokenLength,
        " are needed (e.g. `openssl rand -hex 32`), or pass --insecure"));
  }
  return token;
}

namespace {

// The host of HOST:PORT or [IPV6]:PORT ("" for ":PORT", every address).
std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

absl::Status CheckTokenTransport(bool has_token, bool tls, const std::string& address,
                                 bool insecure, const std::string& tls_flag) {
  if (!has_token || tls || insecure) return absl::OkStatus();
  if (IsLoopback(HostOf(address))) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("a bearer token over plaintext to or from ", address,
                   " can be read by anyone on the network: turn TLS on (", tls_flag,
                   "), or pass --insecure to send it anyway (loopback addresses need neither)"));
}

absl::Status CheckListenAuthenticated(const std::string& address, bool authenticated,
                                      bool insecure) {
  if (authenticated || insecure || IsLoopback(HostOf(address))) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--listen=", address,
      " is reachable from other machines and no client is authenticated: anyone who reaches "
      "the port could join jobs, read and write their keys, and commit or delete "
      "checkpoints. Give --auth_token_file (with --tls_cert and --tls_key, or --insecure "
      "for a token over plaintext) or --tls_client_ca; or listen on 127.0.0.1; or pass "
      "--insecure to serve every caller on a network you trust"));
}

}  // namespace zeroshard
