// Simulated members of a job for the control-plane benchmarks: many joins
// and heartbeat streams from one process over a few shared channels, with
// gRPC's callback API (no thread per member), against a real shard_server.
#ifndef ZEROSHARD_TESTS_TESTING_SIMULATED_MEMBERS_H_
#define ZEROSHARD_TESTS_TESTING_SIMULATED_MEMBERS_H_

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard::testing {

// `count` stubs to `address`, each on its own TCP connection.
std::vector<std::unique_ptr<v1::Coordinator::Stub>> MakeStubs(const std::string& address,
                                                              int count);

struct Joined {
  std::vector<v1::JoinResponse> responses;
  double seconds = 0;  // from the first join sent to the last answered
  int failures = 0;
};

// `world` concurrent joins of `job` (worker ids node00000/0, ...), spread
// over `stubs`; returns when every one was answered. `ranks_per_host` > 0:
// that many on each host node00000, node00001, ... (worker ids
// node00000/0..k-1); 0: every member on host 127.0.0.1.
Joined JoinAll(std::vector<std::unique_ptr<v1::Coordinator::Stub>>& stubs, const std::string& job,
               int world, bool member_table = false, int ranks_per_host = 0);

v1::MemberCredentials Credentials(const std::string& job, const v1::JoinResponse& r);

// The telemetry a beat carries: "full" (a training rank's, as shard_worker
// sends it), "step" (the step fields only) or "none".
void FillTelemetry(const std::string& telemetry, v1::HeartbeatRequest* request);

// One member's heartbeat stream, beating back to back: the next beat is
// written once the previous beat's write and reply have both completed.
class Beater : public grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  // `interval` zero: the next beat goes once the previous one's write and
  // reply completed (back to back); else that long after (a worker's pace).
  Beater(v1::Coordinator::Stub* stub, const v1::MemberCredentials& member,
         const std::string& telemetry, std::atomic<bool>* stop, std::atomic<int64_t>* replies,
         absl::BlockingCounter* finished, absl::Duration interval = absl::ZeroDuration())
      : stop_(stop), replies_(replies), finished_(finished), interval_(interval) {
    *request_.mutable_member() = member;
    FillTelemetry(telemetry, &request_);
    stub->async()->Heartbeat(&context_, this);
    Round();
    StartCall();
  }
  void OnWriteDone(bool ok) override { Step(ok); }
  void OnReadDone(bool ok) override {
    if (ok) {
      if (response_.command() != v1::CONTINUE) bad_commands_++;
      replies_->fetch_add(1, std::memory_order_relaxed);
      own_replies_.fetch_add(1, std::memory_order_relaxed);
    }
    Step(ok);
  }
  void OnWritesDoneDone(bool) override {}
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    finished_->DecrementCount();
  }
  int bad_commands() const { return bad_commands_; }
  // Replies this member's beats got.
  int64_t replies() const { return own_replies_.load(std::memory_order_relaxed); }
  const grpc::Status& status() const { return status_; }

 private:
  void Round() {
    pending_.store(2);
    request_.set_step(request_.step() + 1);
    StartWrite(&request_);
    StartRead(&response_);
  }
  void Step(bool ok) {
    if (pending_.fetch_sub(1) != 1) return;  // the other half of the round is still out
    if (!ok || failed_) {
      failed_ = true;
      return;
    }
    if (stop_->load()) {
      StartWritesDone();
      StartRead(&response_);  // drains the server's end of the stream
      return;
    }
    if (interval_ == absl::ZeroDuration()) {
      Round();
    } else {
      alarm_.Set(absl::ToChronoTime(absl::Now() + interval_), [this](bool fired) {
        if (fired) Round();
      });
    }
  }

  grpc::ClientContext context_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  std::atomic<int> pending_{0};
  std::atomic<int64_t> own_replies_{0};
  bool failed_ = false;
  int bad_commands_ = 0;
  std::atomic<bool>* stop_;
  std::atomic<int64_t>* replies_;
  absl::BlockingCounter* finished_;
  const absl::Duration interval_;
  grpc::Alarm alarm_;
  grpc::Status status_;
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_SIMULATED_MEMBERS_H_
