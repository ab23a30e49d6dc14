#include "tests/testing/coordinator_stub.h"

#include "absl/time/clock.h"

namespace zeroshard::testing {

std::unique_ptr<v1::Coordinator::Stub> NewCoordinatorStub(const std::string& address) {
  return v1::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

void PrepareContext(grpc::ClientContext* context, absl::Duration timeout,
                    const std::string& token) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace zeroshard::testing
