// The goodput ledger's fields on the wire (#45, proto/goodput.proto), as the
// client library sends and reads them: JoinRequest.steps_completed,
// JoinResponse.steps_done, the telemetry source's TimeLedger in heartbeats,
// and LeaveRequest.final_time. The server is a real gRPC server on loopback
// that records what it receives.
#include <memory>
#include <optional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

constexpr int64_t kJobSteps = 7;  // what the server says the job completed

class RecordingCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override {
    absl::MutexLock lock(&mu_);
    steps_completed_ = request->steps_completed();
    response->set_rank(0);
    response->set_world_size(1);
    response->set_generation(1);
    response->set_token("t");
    response->set_heartbeat_interval_ms(20);
    response->set_heartbeat_timeout_ms(10000);
    response->set_steps_done(kJobSteps);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest>* stream) override {
    v1::HeartbeatRequest request;
    while (stream->Read(&request)) {
      {
        absl::MutexLock lock(&mu_);
        if (request.telemetry().has_time()) beat_time_ = request.telemetry().time();
      }
      v1::HeartbeatResponse response;
      response.set_command(v1::CONTINUE);
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest* request,
                     v1::LeaveResponse*) override {
    absl::MutexLock lock(&mu_);
    final_time_ = request->final_time();
    return grpc::Status::OK;
  }

  int64_t steps_completed() {
    absl::MutexLock lock(&mu_);
    return steps_completed_;
  }
  std::optional<v1::TimeLedger> beat_time() {
    absl::MutexLock lock(&mu_);
    return beat_time_;
  }
  std::optional<v1::TimeLedger> final_time() {
    absl::MutexLock lock(&mu_);
    return final_time_;
  }

 private:
  absl::Mutex mu_;
  int64_t steps_completed_ ABSL_GUARDED_BY(mu_) = -1;
  std::optional<v1::TimeLedger> beat_time_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::TimeLedger> final_time_ ABSL_GUARDED_BY(mu_);
};

TEST(GoodputWireTest, JoinHeartbeatsAndLeaveCarryTheLedger) {
  RecordingCoordinator service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.server = "127.0.0.1:" + std::to_string(port);
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();

  (*client)->set_steps_completed(12);
  absl::StatusOr<JoinInfo> joined = (*client)->Join("job", 1, "w0", "127.0.0.1", absl::Seconds(10));
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(service.steps_completed(), 12);
  EXPECT_EQ(joined->steps_done, kJobSteps);

  (*client)->SetTelemetrySource(
      [](v1::RankTelemetry* telemetry) { telemetry->mutable_time()->set_productive(1.5); });
  (*client)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});
  ASSERT_TRUE(testing::WaitFor([&] { return service.beat_time().has_value(); }, absl::Seconds(20)))
      << "no heartbeat carried a ledger";
  EXPECT_EQ(service.beat_time()->productive(), 1.5);

  v1::TimeLedger final_time;
  final_time.set_productive(2.5);
  final_time.set_other(0.25);
  ASSERT_TRUE((*client)->Leave(final_time).ok());
  ASSERT_TRUE(service.final_time().has_value());
  EXPECT_EQ(service.final_time()->productive(), 2.5);
  EXPECT_EQ(service.final_time()->other(), 0.25);
  server->Shutdown();
}

}  // namespace
}  // namespace zeroshard
