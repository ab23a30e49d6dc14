// KvStore: set/get/add/wait, held gets, deadlines, generation scoping, limits.
#include "shard_server/kv/kv_store.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

class KvStoreTest : public ::testing::Test {
 protected:
  absl::Time Later() { return clock_.Now() + absl::Seconds(10); }
  FakeClock clock_;
  KvStore kv_{&clock_};
};

TEST_F(KvStoreTest, GetReturnsWhatSetStored) {
  ASSERT_TRUE(kv_.Set("job", 1, "k", "v").ok());
  std::optional<absl::StatusOr<std::string>> got;
  EXPECT_EQ(kv_.Get("job", 1, "k", Later(), [&](auto r) { got = r; }), 0u);
  ASSERT_TRUE(got.has_value() && got->ok());
  EXPECT_EQ(**got, "v");
}

TEST_F(KvStoreTest, GetWaitsUntilTheKeyIsSet) {
  std::optional<absl::StatusOr<std::string>> got;
  kv_.Get("job", 1, "k", Later(), [&](auto r) { got = r; });
  EXPECT_FALSE(got.has_value());
  ASSERT_TRUE(kv_.Set("job", 1, "k", "late").ok());
  ASSERT_TRUE(got.has_value() && got->ok());
  EXPECT_EQ(**got, "late");
}

TEST_F(KvStoreTest, GetExpiresAtItsDeadlineNamingTheKey) {
  std::optional<absl::StatusOr<std::string>> got;
  kv_.Get("job", 1, "missing-key", clock_.Now() + absl::Seconds(1), [&](auto r) { got = r; });
  kv_.Tick();
  EXPECT_FALSE(got.has_value());
  clock_.Advance(absl::Seconds(2));
  kv_.Tick();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(got->status().message().find("missing-key"), std::string::npos);
}

TEST_F(KvStoreTest, AddCountsAtomically) {
  EXPECT_EQ(*kv_.Add("job", 1, "n", 2), 2);
  EXPECT_EQ(*kv_.Add("job", 1, "n", 5), 7);
  EXPECT_EQ(*kv_.Add("job", 1, "n", -1), 6);
  ASSERT_TRUE(kv_.Set("job", 1, "text", "abc").ok());
  EXPECT_EQ(kv_.Add("job", 1, "text", 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

// TCPStore's compare_set: swap on a match (or a missing key and an empty
// expectation); the answer is the value held afterwards.
TEST_F(KvStoreTest, CompareSetSwapsOnlyOnAMatchAndAnswersTheValueHeld) {
  ASSERT_TRUE(kv_.Set("job", 1, "k", "a").ok());
  EXPECT_EQ(*kv_.CompareSet("job", 1, "k", "a", "b"), "b");
  EXPECT_EQ(*kv_.CompareSet("job", 1, "k", "a", "c"), "b");
  EXPECT_EQ(*kv_.CompareSet("job", 1, "missing", "x", "y"), "x");
  EXPECT_FALSE(*kv_.Check("job", 1, {"missing"}));
  EXPECT_EQ(*kv_.CompareSet("job", 1, "new", "", "v"), "v");
  EXPECT_TRUE(*kv_.Check("job", 1, {"k", "new"}));
}

TEST_F(KvStoreTest, CompareSetWakesAGetOfTheKey) {
  std::optional<absl::StatusOr<std::string>> got;
  kv_.Get("job", 1, "k", Later(), [&](auto r) { got = r; });
  EXPECT_EQ(*kv_.CompareSet("job", 1, "k", "", "set"), "set");
  ASSERT_TRUE(got.has_value() && got->ok());
  EXPECT_EQ(**got, "set");
}

TEST_F(KvStoreTest, DeleteRemovesTheKeyAndItsBytes) {
  ASSERT_TRUE(kv_.Set("job", 1, "k", "value").ok());
  ASSERT_TRUE(kv_.Set("job", 1, "other", "v").ok());
  const size_t before = kv_.TotalBytes();
  EXPECT_EQ(kv_.NumKeys("job", 1), 2);
  EXPECT_TRUE(*kv_.Delete("job", 1, "k"));
  EXPECT_FALSE(*kv_.Delete("job", 1, "k"));
  EXPECT_EQ(kv_.NumKeys("job", 1), 1);
  EXPECT_EQ(kv_.TotalBytes(), before - std::string("kvalue").size());
  EXPECT_FALSE(*kv_.Check("job", 1, {"k"}));
  EXPECT_EQ(kv_.Delete("job", 1, "").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(KvStoreTest, NumKeysCountsOnlyTheCurrentGeneration) {
  ASSERT_TRUE(kv_.Set("job", 1, "k", "v").ok());
  EXPECT_EQ(kv_.NumKeys("job", 1), 1);
  EXPECT_EQ(kv_.NumKeys("job", 2), 0);
}

TEST_F(KvStoreTest, WaitReturnsWhenEveryKeyExists) {
  std::optional<absl::Status> done;
  kv_.Wait("job", 1, {"a", "b"}, Later(), [&](absl::Status s) { done = s; });
  ASSERT_TRUE(kv_.Set("job", 1, "a", "1").ok());
  EXPECT_FALSE(done.has_value());
  ASSERT_TRUE(kv_.Add("job", 1, "b", 1).ok());
  ASSERT_TRUE(done.has_value());
  EXPECT_TRUE(done->ok());
}

TEST_F(KvStoreTest, NewGenerationStartsEmptyAndAbortsOldWaiters) {
  ASSERT_TRUE(kv_.Set("job", 1, "k", "old").ok());
  std::optional<absl::StatusOr<std::string>> waiting;
  kv_.Get("job", 1, "other", Later(), [&](auto r) { waiting = r; });
  kv_.DropJob("job", 2);
  ASSERT_TRUE(waiting.has_value());
  EXPECT_EQ(waiting->status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(kv_.KeyCount("job"), 0u);
  std::optional<absl::StatusOr<std::string>> got;
  kv_.Get("job", 2, "k", clock_.Now(), [&](auto r) { got = r; });
  EXPECT_FALSE(got.has_value());  // not carried over
}

TEST_F(KvStoreTest, JobsAreIsolated) {
  ASSERT_TRUE(kv_.Set("a", 1, "k", "from-a").ok());
  std::optional<absl::StatusOr<std::string>> got;
  kv_.Get("b", 1, "k", clock_.Now(), [&](auto r) { got = r; });
  EXPECT_FALSE(got.has_value());
}

TEST_F(KvStoreTest, CancelAnswersCancelled) {
  std::optional<absl::StatusOr<std::string>> got;
  uint64_t id = kv_.Get("job", 1, "k", Later(), [&](auto r) { got = r; });
  kv_.Cancel(id);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->status().code(), absl::StatusCode::kCancelled);
}

TEST(KvStoreLimitsTest, RefusesOversizedKeysValuesAndJobs) {
  FakeClock clock;
  KvLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  limits.max_job_bytes = 40;
  KvStore kv(&clock, limits);
  EXPECT_EQ(kv.Set("job", 1, "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set("job", 1, "123456789", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set("job", 1, "k", std::string(17, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(kv.Set("job", 1, "k1", std::string(16, 'x')).ok());
  ASSERT_TRUE(kv.Set("job", 1, "k2", std::string(16, 'x')).ok());
  EXPECT_EQ(kv.Set("job", 1, "k3", std::string(16, 'x')).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv.KeyCount("job"), 2u);
}

TEST(KvStoreLimitsTest, AWaitForTooManyKeysIsRefusedNamingTheFlag) {
  FakeClock clock;
  KvLimits limits;
  limits.max_wait_keys = 100;
  KvStore kv(&clock, limits);
  std::vector<std::string> keys;
  for (int i = 0; i < 101; ++i) keys.push_back(absl::StrCat("k", i));
  std::optional<absl::Status> done;
  EXPECT_EQ(kv.Wait("job", 1, keys, clock.Now() + absl::Seconds(10),
                    [&](absl::Status s) { done = s; }),
            0u);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(done->message().find("--kv_max_wait_keys"), std::string::npos) << *done;
  EXPECT_EQ(kv.TotalBytes(), 0u);
}

TEST(KvStoreLimitsTest, WaitersPerJobAreBoundedAndOtherJobsStillWait) {
  FakeClock clock;
  KvLimits limits;
  limits.max_waiters_per_job = 3;
  KvStore kv(&clock, limits);
  std::vector<std::optional<absl::Status>> done(4);
  for (int i = 0; i < 4; ++i) {
    kv.Wait("job", 1, {"never"}, clock.Now() + absl::Seconds(10),
            [&done, i](absl::Status s) { done[i] = s; });
  }
  EXPECT_FALSE(done[0].has_value());
  ASSERT_TRUE(done[3].has_value());
  EXPECT_EQ(done[3]->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(done[3]->message().find("--kv_max_waiters_per_job"), std::string::npos) << *done[3];
  std::optional<absl::Status> other;
  EXPECT_NE(kv.Wait("other", 1, {"k"}, clock.Now() + absl::Seconds(10),
                    [&](absl::Status s) { other = s; }),
            0u);
  EXPECT_FALSE(other.has_value());
}

TEST(KvStoreLimitsTest, TheServerWideBoundCoversValuesAndWaitsOfEveryJobAndIsReleased) {
  FakeClock clock;
  KvLimits limits;
  limits.max_total_bytes = 4096;
  KvStore kv(&clock, limits);
  ASSERT_TRUE(kv.Set("a", 1, "k", std::string(3000, 'x')).ok());
  // Another job: its value would pass its own job bound but not the server's.
  absl::Status s = kv.Set("b", 1, "k", std::string(2000, 'x'));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--kv_max_total_bytes"), std::string::npos) << s;
  // Waiting keys count too.
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) keys.push_back(std::string(60, 'a' + i));
  std::optional<absl::Status> done;
  kv.Wait("b", 1, keys, clock.Now() + absl::Seconds(10), [&](absl::Status st) { done = st; });
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->code(), absl::StatusCode::kResourceExhausted);
  // A new generation of "a" frees its bytes for everyone.
  kv.DropJob("a", 2);
  EXPECT_EQ(kv.TotalBytes(), 0u);
  EXPECT_TRUE(kv.Set("b", 1, "k", std::string(2000, 'x')).ok());
  std::optional<absl::Status> expired;
  kv.Wait("b", 1, {"late"}, clock.Now() + absl::Seconds(1), [&](absl::Status st) { expired = st; });
  const size_t holding = kv.TotalBytes();
  clock.Advance(absl::Seconds(2));
  kv.Tick();
  ASSERT_TRUE(expired.has_value());
  EXPECT_LT(kv.TotalBytes(), holding) << "an expired wait still counts";
}

TEST_F(KvStoreTest, AnExpiredWaitNamesAFewMissingKeysAndCountsTheRest) {
  std::vector<std::string> keys;
  for (int i = 0; i < 10000; ++i) keys.push_back(absl::StrCat("key-", i));
  std::optional<absl::Status> done;
  kv_.Wait("job", 1, keys, clock_.Now() + absl::Seconds(1), [&](absl::Status s) { done = s; });
  clock_.Advance(absl::Seconds(2));
  kv_.Tick();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->code(), absl::StatusCode::kDeadlineExceeded);
  // It travels in a status: small enough for a client's metadata limit.
  EXPECT_LT(done->message().size(), 300u) << *done;
  EXPECT_NE(done->message().find("key-0, key-1"), std::string::npos) << *done;
  EXPECT_NE(done->message().find("9996 more"), std::string::npos) << *done;
}

}  // namespace
}  // namespace zeroshard
