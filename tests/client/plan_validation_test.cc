// Client::PlanShards checks the plan a server returns before anyone uses it:
// a server of another version, or a broken one, must not hand a worker a
// plan whose pieces overlap, leave rows out or lie outside their chunks.
// The server here is a real gRPC server on loopback that answers PlanShards
// with the planner's plan, changed by the test.
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "client/client.h"
#include "common/model_zoo.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

// Plans as the real planner does, then lets the test damage the plan.
class TamperingCoordinator final : public v1::Coordinator::Service {
 public:
  explicit TamperingCoordinator(std::function<void(ShardPlan*)> tamper)
      : tamper_(std::move(tamper)) {}

  grpc::Status PlanShards(grpc::ServerContext*, const v1::PlanShardsRequest* request,
                          v1::PlanShardsResponse* response) override {
    absl::StatusOr<ShardPlan> plan =
        Plan(ModelSpecFromProto(request->spec()), request->world_size(),
             PlanOptionsFromProto(request->options()));
    if (!plan.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad spec");
    const std::string planned_hash = plan->hash;
    tamper_(&*plan);
    // Consistent with itself, as a server of another version would make it,
    // unless the test set a hash of its own.
    if (plan->hash == planned_hash) plan->hash = PlanHash(*plan);
    *response->mutable_plan() = ShardPlanToProto(*plan);
    return grpc::Status::OK;
  }

 private:
  std::function<void(ShardPlan*)> tamper_;
};

class PlanValidationTest : public ::testing::Test {
 protected:
  // Starts the server; returns a client of it.
  std::unique_ptr<Client> Serve(std::function<void(ShardPlan*)> tamper) {
    service_ = std::make_unique<TamperingCoordinator>(std::move(tamper));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    EXPECT_GT(port, 0);
    ClientOptions options;
    options.server = "127.0.0.1:" + std::to_string(port);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  ModelSpec Spec() const { return *Gpt2Spec(2, 32, 4, 64, 16); }

  std::unique_ptr<TamperingCoordinator> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(PlanValidationTest, AnIntactPlanIsReturnedAsPlanned) {
  std::unique_ptr<Client> client = Serve([](ShardPlan*) {});
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ShardPlan> plan = client->PlanShards(Spec(), PlanOptions(), 3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<ShardPlan> local = Plan(Spec(), 3, PlanOptions());
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(plan->hash, local->hash);
}

TEST_F(PlanValidationTest, APieceOutsideItsChunkIsRefusedNamingTheCheck) {
  std::unique_ptr<Client> client = Serve(
      [](ShardPlan* plan) { plan->units[0].pieces[0].offset += plan->units[0].chunk_elements; });
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ShardPlan> plan = client->PlanShards(Spec(), PlanOptions(), 3);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("fails validation"));
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("127.0.0.1"));
}

TEST_F(PlanValidationTest, AMissingPieceIsRefused) {
  std::unique_ptr<Client> client = Serve([](ShardPlan* plan) { plan->units[1].pieces.pop_back(); });
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ShardPlan> plan = client->PlanShards(Spec(), PlanOptions(), 3);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
}

TEST_F(PlanValidationTest, APlanForAnotherSpecIsRefused) {
  std::unique_ptr<Client> client =
      Serve([](ShardPlan* plan) { plan->units[0].tensors[0].shape[0] += 1; });
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ShardPlan> plan = client->PlanShards(Spec(), PlanOptions(), 3);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
}

TEST_F(PlanValidationTest, APlanWhoseHashDoesNotMatchItsContentsIsRefused) {
  std::unique_ptr<Client> client = Serve([](ShardPlan* plan) { plan->hash = "0000000000000000"; });
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ShardPlan> plan = client->PlanShards(Spec(), PlanOptions(), 3);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("hash"));
}

TEST_F(PlanValidationTest, APlanForAnotherWorldSizeIsRefused) {
  std::unique_ptr<Client> client = Serve([](ShardPlan* plan) { plan->world_size = 4; });
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ShardPlan> plan = client->PlanShards(Spec(), PlanOptions(), 3);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("world size"));
}

}  // namespace
}  // namespace zeroshard
