// Raw access to the Coordinator service for tests that send what
// zeroshard::Client never would (forged credentials, short uploads, joins
// the client library would retry). Client keeps its stub private; such
// tests make their own.
#ifndef ZEROSHARD_TESTS_TESTING_COORDINATOR_STUB_H_
#define ZEROSHARD_TESTS_TESTING_COORDINATOR_STUB_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard::testing {

// A stub for the server at `address` (HOST:PORT), over an insecure channel.
std::unique_ptr<v1::Coordinator::Stub> NewCoordinatorStub(const std::string& address);

// Sets a deadline `timeout` from now on `context` and, when `token` is not
// empty, the "authorization: Bearer <token>" metadata the server checks.
void PrepareContext(grpc::ClientContext* context, absl::Duration timeout,
                    const std::string& token = "");

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_COORDINATOR_STUB_H_
