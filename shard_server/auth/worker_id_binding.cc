#include "shard_server/auth/worker_id_binding.h"

#include <grpc/grpc_security_constants.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace zeroshard {

absl::StatusOr<WorkerIdBinding> WorkerIdBinding::Parse(absl::string_view map_text) {
  WorkerIdBinding binding;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(map_text, '\n')) {
    ++number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_worker_id_map line ", number, " '", absl::StripAsciiWhitespace(line),
                       "' has ", fields.size(),
                       " fields; expected 'IDENTITY HOST_PART' (HOST_PART '*': any)"));
    }
    binding.map_.emplace(absl::AsciiStrToLower(fields[0]), absl::AsciiStrToLower(fields[1]));
  }
  return binding;
}

absl::Status WorkerIdBinding::Check(const std::vector<std::string>& identities,
                                    absl::string_view worker_id) const {
  const std::string host = absl::AsciiStrToLower(worker_id.substr(0, worker_id.find('/')));
  for (const std::string& identity : identities) {
    const std::string id = absl::AsciiStrToLower(identity);
    if (id == host || map_.count({id, host}) > 0 || map_.count({id, "*"}) > 0) {
      return absl::OkStatus();
    }
  }
  if (identities.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "worker id '", worker_id,
        "' may join only with a client certificate naming its host part '", host,
        "' (the server's --tls_bind_worker_ids), and this call carried none"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "worker id '", worker_id, "' is not bound to this client certificate (identities: ",
      absl::StrJoin(identities, ", "), "): its host part '", host,
      "' must be one of them, or --tls_worker_id_map must pair one of them with it (the "
      "server's --tls_bind_worker_ids)"));
}

std::vector<std::string> CertificateIdentities(const grpc::AuthContext& context) {
  std::vector<std::string> identities;
  if (!context.IsPeerAuthenticated()) return identities;
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : context.FindPropertyValues(property)) {
      identities.emplace_back(value.data(), value.size());
    }
  }
  return identities;
}

}  // namespace zeroshard
