// The server's bearer-token check, shared by the zeroshard.v1 service and the
// interceptor that keeps gRPC reflection behind the same token.
#ifndef ZEROSHARD_SHARD_SERVER_AUTH_BEARER_AUTH_H_
#define ZEROSHARD_SHARD_SERVER_AUTH_BEARER_AUTH_H_

#include <map>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"

namespace zeroshard {

using ClientMetadata = std::multimap<grpc::string_ref, grpc::string_ref>;

// OK when `token` is empty (no authentication) or `metadata` carries
// "authorization: Bearer <token>" (compared in constant time for the
// token's length); UNAUTHENTICATED saying what is missing or wrong.
grpc::Status CheckBearerToken(const ClientMetadata& metadata, absl::string_view token);

// Server interceptors that cancel every call to a gRPC reflection method
// (/grpc.reflection.*) that does not carry the bearer token, before the
// reflection service sees it; the caller gets CANCELLED. Health checks and
// zeroshard.v1 (which authenticates itself) pass through. REQUIRES: `token`
// is not empty.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ReflectionAuthInterceptorFactory(std::string token);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_AUTH_BEARER_AUTH_H_
