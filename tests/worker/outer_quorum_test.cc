// --outer_timeout's quorum (worker/outer_quorum.h) over an in-memory store
// with the shard server's KV semantics (add, a held get, compare-and-set,
// delete): every group arriving decides every group; a group later than the
// timeout is left out and told so by the decision the others made, which
// every later caller reads unchanged; a wait_for_all step waits for the
// late group; a member reads its leader's decision. The late caller is run
// after the decision was made (no race to hope about); the timeouts are
// real time, short, and only bound how long a leader waits.
#include "worker/outer_quorum.h"

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

class MemoryQuorumStore final : public QuorumStore {
 public:
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t value = 0;
    if (auto it = values_.find(key); it != values_.end()) absl::SimpleAtoi(it->second, &value);
    values_[key] = absl::StrCat(value + delta);
    changed_.notify_all();
    return value + delta;
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool found = changed_.wait_for(lock, absl::ToChronoMilliseconds(timeout),
                                         [&] { return values_.count(key) > 0; });
    if (!found) return absl::DeadlineExceededError(absl::StrCat("no key ", key));
    return values_[key];
  }
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = values_.find(key);
    if ((it == values_.end() && expected.empty()) ||
        (it != values_.end() && it->second == expected)) {
      values_[key] = desired;
      changed_.notify_all();
      return desired;
    }
    return it == values_.end() ? expected : it->second;
  }
  absl::Status Delete(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    values_.erase(key);
    return absl::OkStatus();
  }
  bool Has(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return values_.count(key) > 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

QuorumCall Call(int64_t after_step, int group, int groups, bool wait_for_all = false) {
  QuorumCall call;
  call.after_step = after_step;
  call.group = group;
  call.groups = groups;
  call.wait_for_all = wait_for_all;
  call.timeout = absl::Milliseconds(100);
  call.limit = absl::Seconds(30);
  return call;
}

TEST(OuterQuorumTest, EveryGroupArrivingDecidesEveryGroup) {
  MemoryQuorumStore store;
  std::vector<absl::StatusOr<uint64_t>> got(3, absl::UnknownError("not run"));
  std::vector<std::thread> leaders;
  for (int g = 0; g < 3; ++g) {
    leaders.emplace_back([&, g] { got[g] = LeadOuterQuorum(&store, Call(4, g, 3)); });
  }
  for (std::thread& t : leaders) t.join();
  for (int g = 0; g < 3; ++g) {
    ASSERT_TRUE(got[g].ok()) << got[g].status();
    EXPECT_EQ(*got[g], 0b111u) << "group " << g;
  }
  absl::StatusOr<uint64_t> member = ReadOuterQuorum(&store, Call(4, 1, 3));
  ASSERT_TRUE(member.ok()) << member.status();
  EXPECT_EQ(*member, 0b111u);
}

TEST(OuterQuorumTest, ALateGroupIsLeftOutAndEveryLaterCallerReadsTheSameDecision) {
  MemoryQuorumStore store;
  // Groups 0 and 2 arrive; group 1 does not within the timeout.
  std::vector<absl::StatusOr<uint64_t>> got(3, absl::UnknownError("not run"));
  std::thread g0([&] { got[0] = LeadOuterQuorum(&store, Call(6, 0, 3)); });
  std::thread g2([&] { got[2] = LeadOuterQuorum(&store, Call(6, 2, 3)); });
  g0.join();
  g2.join();
  ASSERT_TRUE(got[0].ok() && got[2].ok()) << got[0].status() << got[2].status();
  EXPECT_EQ(*got[0], 0b101u);
  EXPECT_EQ(*got[2], 0b101u);
  // Group 1 comes late: its arrival completes the mask, but the decision
  // stands and excludes it.
  got[1] = LeadOuterQuorum(&store, Call(6, 1, 3));
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  EXPECT_EQ(*got[1], 0b101u);
  absl::StatusOr<uint64_t> member = ReadOuterQuorum(&store, Call(6, 1, 3));
  ASSERT_TRUE(member.ok()) << member.status();
  EXPECT_EQ(*member, 0b101u);
  // A group alone past the timeout decides itself alone.
  absl::StatusOr<uint64_t> alone = LeadOuterQuorum(&store, Call(8, 0, 2));
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(*alone, 0b01u);
}

TEST(OuterQuorumTest, AWaitForAllStepWaitsForTheLateGroup) {
  MemoryQuorumStore store;
  absl::StatusOr<uint64_t> first = absl::UnknownError("not run");
  std::thread g0([&] { first = LeadOuterQuorum(&store, Call(10, 0, 2, /*wait_for_all=*/true)); });
  // Group 1 arrives only once group 0 has arrived and waited 3 timeouts:
  // group 0 must not have decided alone meanwhile (a leader that did would
  // have written its decision after 1).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!store.Has("outer_quorum/10/arrived") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(store.Has("outer_quorum/10/arrived"));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(store.Has("outer_quorum/10/decision"));
  absl::StatusOr<uint64_t> second = LeadOuterQuorum(&store, Call(10, 1, 2, /*wait_for_all=*/true));
  g0.join();
  ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
  EXPECT_EQ(*first, 0b11u);
  EXPECT_EQ(*second, 0b11u);
}

// A stale group (left out of the last outer step) arriving first must not
// decide alone: groups 0 and 1 would then each take an outer step from a
// different anchor with the same count (a fork no catch-up can tell). It
// waits; the up-to-date group, arriving later, completes the mask.
TEST(OuterQuorumTest, AStaleGroupDoesNotDecideAlone) {
  MemoryQuorumStore store;
  absl::StatusOr<uint64_t> stale = absl::UnknownError("not run");
  QuorumCall call = Call(12, 1, 2);
  call.up_to_date = false;
  std::thread g1([&] { stale = LeadOuterQuorum(&store, call); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!store.Has("outer_quorum/12/arrived") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(store.Has("outer_quorum/12/arrived"));
  absl::SleepFor(absl::Milliseconds(300));  // 3 timeouts: no decision alone
  EXPECT_FALSE(store.Has("outer_quorum/12/decision"));
  absl::StatusOr<uint64_t> current = LeadOuterQuorum(&store, Call(12, 0, 2));
  g1.join();
  ASSERT_TRUE(stale.ok() && current.ok()) << stale.status() << current.status();
  EXPECT_EQ(*stale, 0b11u);
  EXPECT_EQ(*current, 0b11u);
}

TEST(OuterQuorumTest, OldKeysAreForgottenAndAMemberWithoutADecisionTimesOut) {
  MemoryQuorumStore store;
  ASSERT_TRUE(LeadOuterQuorum(&store, Call(2, 0, 1)).ok());  // one group: decides at once
  EXPECT_TRUE(store.Has("outer_quorum/2/decision"));
  QuorumCall later = Call(4, 0, 1);
  later.forget_step = 2;
  ASSERT_TRUE(LeadOuterQuorum(&store, later).ok());
  EXPECT_FALSE(store.Has("outer_quorum/2/decision"));
  EXPECT_FALSE(store.Has("outer_quorum/2/arrived"));
  QuorumCall member = Call(6, 0, 2);
  member.limit = absl::Milliseconds(50);
  absl::StatusOr<uint64_t> none = ReadOuterQuorum(&store, member);
  EXPECT_TRUE(absl::IsDeadlineExceeded(none.status())) << none.status();
  EXPECT_NE(none.status().message().find("the outer quorum after step 6"), std::string::npos);
}

}  // namespace
}  // namespace zeroshard
