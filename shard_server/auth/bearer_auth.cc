#include "shard_server/auth/bearer_auth.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

class ReflectionAuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  ReflectionAuthInterceptor(grpc::experimental::ServerRpcInfo* info, const std::string* token)
      : info_(info), token_(token) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const ClientMetadata* metadata = methods->GetRecvInitialMetadata();
      if (metadata == nullptr || !CheckBearerToken(*metadata, *token_).ok()) {
        info_->server_context()->TryCancel();
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const std::string* const token_;  // owned by the factory, which outlives the server
};

class ReflectionAuthFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReflectionAuthFactory(std::string token) : token_(std::move(token)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (!absl::StartsWith(info->method(), "/grpc.reflection.")) return nullptr;
    return new ReflectionAuthInterceptor(info, &token_);
  }

 private:
  const std::string token_;
};

}  // namespace

grpc::Status CheckBearerToken(const ClientMetadata& metadata, absl::string_view token) {
  if (token.empty()) return grpc::Status::OK;
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <token>' metadata; this server requires "
                        "the token in its --auth_token_file (pass it with --token_file)");
  }
  const absl::string_view presented(it->second.data(), it->second.size());
  const std::string expected = absl::StrCat("Bearer ", token);
  unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < presented.size() && i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(presented[i] ^ expected[i]);
  }
  if (diff != 0) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong bearer token");
  return grpc::Status::OK;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ReflectionAuthInterceptorFactory(std::string token) {
  return std::make_unique<ReflectionAuthFactory>(std::move(token));
}

}  // namespace zeroshard
