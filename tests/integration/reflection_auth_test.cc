// gRPC reflection describes every method and message of the server: with a
// bearer token configured, it is served only to callers that present it.
// The server runs as its own process: this test speaks the reflection
// protocol through its own copy of the protocol's messages.
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "tests/integration/reflection_probe.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using zeroshard::testing::reflection::ServerReflectionRequest;
using zeroshard::testing::reflection::ServerReflectionResponse;

constexpr char kReflectionMethod[] =
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

// A shard_server process, with --auth_token_file holding `token` if any.
std::unique_ptr<testing::LocalCluster> Start(const std::string& token) {
  const std::string dir = testing::MakeTempDir("reflection");
  std::vector<std::string> flags;
  if (!token.empty()) {
    testing::WriteSecretFile(dir + "/token", token + "\n");
    flags.push_back("--auth_token_file=" + dir + "/token");
  }
  auto cluster = std::make_unique<testing::LocalCluster>(dir, flags);
  EXPECT_TRUE(cluster->ok());
  return cluster;
}

// The services the server lists, or the status that ended the call.
struct Listing {
  grpc::Status status;
  std::vector<std::string> services;
};

Listing ListServices(const testing::LocalCluster& server, const std::string& bearer) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
  // What a generated stub of the protocol does.
  const grpc::internal::RpcMethod method(kReflectionMethod,
                                         grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>>
      stream(grpc::internal::ClientReaderWriterFactory<
             ServerReflectionRequest, ServerReflectionResponse>::Create(channel.get(), method,
                                                                        &context));
  ServerReflectionRequest request;
  request.set_list_services("");
  Listing out;
  if (stream->Write(request)) {
    ServerReflectionResponse response;
    if (stream->Read(&response)) {
      for (const auto& s : response.list_services_response().service()) {
        out.services.push_back(s.name());
      }
    }
  }
  stream->WritesDone();
  out.status = stream->Finish();
  return out;
}

bool Has(const std::vector<std::string>& names, const std::string& name) {
  for (const std::string& n : names) {
    if (n == name) return true;
  }
  return false;
}

TEST(ReflectionAuthTest, WithATokenReflectionIsServedOnlyToCallersThatPresentIt) {
  std::unique_ptr<testing::LocalCluster> server = Start("s3cret-token-0123456789");
  ASSERT_TRUE(server->ok());
  for (const std::string& bearer : {std::string(), std::string("wrong")}) {
    SCOPED_TRACE(bearer);
    Listing refused = ListServices(*server, bearer);
    EXPECT_FALSE(refused.status.ok());
    EXPECT_TRUE(refused.services.empty());
  }
  Listing served = ListServices(*server, "s3cret-token-0123456789");
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_TRUE(Has(served.services, "zeroshard.v1.Coordinator"));
}

TEST(ReflectionAuthTest, WithoutATokenReflectionIsOpen) {
  std::unique_ptr<testing::LocalCluster> server = Start("");
  ASSERT_TRUE(server->ok());
  Listing served = ListServices(*server, "");
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_TRUE(Has(served.services, "zeroshard.v1.Coordinator"));
}

}  // namespace
}  // namespace zeroshard
