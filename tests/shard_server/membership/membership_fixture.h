// The fixture of Membership's tests (tests/shard_server/membership_*_test.cc):
// a Membership on a FakeClock whose event log lines are kept, and helpers
// that join, form a job, beat and read the log.
#ifndef ZEROSHARD_TESTS_SHARD_SERVER_MEMBERSHIP_FIXTURE_H_
#define ZEROSHARD_TESTS_SHARD_SERVER_MEMBERSHIP_FIXTURE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/base/clock.h"
#include "shard_server/membership/membership.h"
#include "shard_server/base/event_log.h"

namespace zeroshard {

using JoinResult = std::optional<absl::StatusOr<v1::JoinResponse>>;

class MembershipTest : public ::testing::Test {
 protected:
  MembershipTest() : log_([this](const std::string& line) { lines_.push_back(line); }) {
    options_.heartbeat_timeout = absl::Seconds(3);
    options_.join_timeout = absl::Seconds(60);
    options_.max_world_size = 1024;
    membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  }

  v1::JoinRequest Request(const std::string& job, int world, const std::string& worker) {
    v1::JoinRequest r;
    r.set_job_id(job);
    r.set_world_size(world);
    r.set_worker_id(worker);
    r.set_host("host-" + worker);
    return r;
  }

  // Starts a join; the result lands in *out when answered.
  void Join(const std::string& job, int world, const std::string& worker, JoinResult* out) {
    membership_->Join(Request(job, world, worker), clock_.Now() + absl::Hours(1),
                      [out](absl::StatusOr<v1::JoinResponse> r) { *out = std::move(r); });
  }

  // Joins W workers "w0".."w{W-1}" and returns their responses by rank.
  std::vector<v1::JoinResponse> Form(
      const std::string& job, int world,
      Membership::ClockStart clock = Membership::ClockStart::kAtFormation) {
    std::vector<JoinResult> results(world);
    for (int i = 0; i < world; ++i) {
      JoinResult* out = &results[i];
      membership_->Join(
          Request(job, world, absl::StrCat("w", i)), clock_.Now() + absl::Hours(1),
          [out](absl::StatusOr<v1::JoinResponse> r) { *out = std::move(r); }, clock);
    }
    std::vector<v1::JoinResponse> by_rank(world);
    for (auto& r : results) {
      EXPECT_TRUE(r.has_value() && r->ok());
      by_rank[(*r)->rank()] = **r;
    }
    return by_rank;
  }

  v1::MemberCredentials Credentials(const std::string& job, const v1::JoinResponse& r) {
    v1::MemberCredentials c;
    c.set_job_id(job);
    c.set_generation(r.generation());
    c.set_rank(r.rank());
    c.set_token(r.token());
    return c;
  }

  absl::StatusOr<v1::HeartbeatResponse> Beat(const v1::MemberCredentials& c) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = c;
    return membership_->Heartbeat(h);
  }

  // Lines of `event` in the log so far.
  int Logged(const std::string& event) {
    int n = 0;
    for (const auto& line : lines_) n += line.find("event=" + event + " ") != std::string::npos;
    return n;
  }

  std::string StatusText(const std::string& job = "") {
    return membership_->Status(job).DebugString();
  }

  FakeClock clock_;
  std::vector<std::string> lines_;
  EventLog log_;
  MembershipOptions options_;
  std::unique_ptr<Membership> membership_;
};

// `r` with the recovery options --min_world_size and --rejoin_grace (ms).
inline v1::JoinRequest Elastic(v1::JoinRequest r, int min_world, int64_t grace_ms) {
  r.set_min_world_size(min_world);
  r.set_rejoin_grace_ms(grace_ms);
  return r;
}

}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_SHARD_SERVER_MEMBERSHIP_FIXTURE_H_
