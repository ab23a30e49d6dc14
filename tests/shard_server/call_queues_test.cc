// CallQueues' lag probe: how far behind a queue's thread is, as the failure
// detector reads it (failure_detector.h, rule 4b). A real gRPC server with
// one call queue, whose thread a test call holds busy.
#include "shard_server/call_queues.h"

#include <memory>

#include "absl/time/clock.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

// Gets onto the queue's thread through an alarm due now and keeps it busy
// for `busy` (what a backlog of heartbeat messages does), then ends.
class BusyCall final : public CallQueues::Call {
 public:
  BusyCall(CallQueues* owner, grpc::ServerCompletionQueue* queue, absl::Duration busy)
      : Call(owner), busy_(busy) {
    alarm_.Set(queue, gpr_now(GPR_CLOCK_MONOTONIC), &tag_);
  }
  void Proceed(int /*step*/, bool /*ok*/) override {
    absl::SleepFor(busy_);  // the queue's thread, busy: the scenario, not a wait
    End();
  }

 private:
  const absl::Duration busy_;
  grpc::Alarm alarm_;
  Tag tag_{this, 0};
};

TEST(CallQueuesTest, LagShowsAQueueThreadHeldBusyAndRecoversAfterwards) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  CallQueues queues(&builder, 1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  grpc::ServerCompletionQueue* queue = nullptr;
  queues.Start({[&](grpc::ServerCompletionQueue* q) { queue = q; }});
  ASSERT_NE(queue, nullptr);
  // An idle queue's probe runs every 100 ms and is on time.
  EXPECT_TRUE(testing::WaitFor([&] { return queues.Lag() < absl::Milliseconds(500); },
                               absl::Seconds(20)))
      << queues.Lag();
  new BusyCall(&queues, queue, absl::Seconds(2));
  // Its probe's alarm comes due while the thread is busy: the lag grows.
  EXPECT_TRUE(testing::WaitFor([&] { return queues.Lag() > absl::Seconds(1); },
                               absl::Seconds(20)))
      << queues.Lag();
  EXPECT_TRUE(testing::WaitFor([&] { return queues.Lag() < absl::Milliseconds(500); },
                               absl::Seconds(20)))
      << queues.Lag();
  server->Shutdown(std::chrono::system_clock::now());
  queues.Stop();  // the probe ends at its next alarm: Stop returns
}

}  // namespace
}  // namespace zeroshard
