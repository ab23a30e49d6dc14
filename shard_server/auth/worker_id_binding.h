// With mutual TLS, which worker ids a client certificate may join as
// (--tls_bind_worker_ids, --tls_worker_id_map). Without it any certificate the
// client CA signed may join as any worker id, so one compromised host could
// take every other host's ranks.
//
// A certificate's identities are its subject alternative names and its
// common name. A worker id's host part is the text before its first '/'
// ("node-7/3" -> "node-7"), or the whole id. A join is allowed when
//   - an identity equals the host part (ASCII case ignored, as DNS names), or
//   - the map names one of the identities with that host part, or with "*".
// The map has one "IDENTITY HOST_PART" pair a line; '#' starts a comment.
// A launcher that joins for every host gets "launcher.example *".
#ifndef ZEROSHARD_SHARD_SERVER_AUTH_WORKER_ID_BINDING_H_
#define ZEROSHARD_SHARD_SERVER_AUTH_WORKER_ID_BINDING_H_

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

// Immutable after Parse: thread-safe.
class WorkerIdBinding {
 public:
  // `map_text`: the map file's contents ("" for none). INVALID_ARGUMENT naming
  // the line for a line that is not two fields.
  static absl::StatusOr<WorkerIdBinding> Parse(absl::string_view map_text);

  // OK when one of `identities` may join as `worker_id`; PERMISSION_DENIED
  // naming the worker id and the identities otherwise (none: the call
  // carried no client certificate).
  absl::Status Check(const std::vector<std::string>& identities,
                     absl::string_view worker_id) const;

 private:
  // (lower-cased identity, lower-cased host part or "*")
  std::set<std::pair<std::string, std::string>> map_;
};

// The identities the call's verified client certificate proves: its subject
// alternative names, then its common name; empty without one.
std::vector<std::string> CertificateIdentities(const grpc::AuthContext& context);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_AUTH_WORKER_ID_BINDING_H_
