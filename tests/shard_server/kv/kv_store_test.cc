// KvStore: set/get/add/wait, held gets, deadlines, generation scoping, limits.
#include "shard_server/kv/kv_store.h"

#include <malloc.h>

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
  ASSERT_TRUE(kv_.Set("job", 1, "other", "v").ok());
  const size_t without_k = kv_.TotalBytes();
  ASSERT_TRUE(kv_.Set("job", 1, "k", std::string(100, 'v')).ok());
  EXPECT_EQ(kv_.NumKeys("job", 1), 2);
  EXPECT_TRUE(*kv_.Delete("job", 1, "k"));
  EXPECT_FALSE(*kv_.Delete("job", 1, "k"));
  EXPECT_EQ(kv_.NumKeys("job", 1), 1);
  EXPECT_EQ(kv_.TotalBytes(), without_k);
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
  // Room for two such entries, as the store counts them, not three.
  size_t entry = 0;
  {
    KvStore measure(&clock);
    ASSERT_TRUE(measure.Set("job", 1, "k1", std::string(16, 'x')).ok());
    entry = measure.JobBytes("job");
  }
  limits.max_job_bytes = 2 * entry + entry / 2;
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

// The attack of #29 (finding 3) in miniature: a job holds many waits of many
// keys; a Set of another job, and a Tick with nothing due, look at none of
// them.
TEST_F(KvStoreTest, ASetLooksOnlyAtTheWaitersOfItsKey) {
  for (int w = 0; w < 200; ++w) {
    std::vector<std::string> keys;
    for (int k = 0; k < 500; ++k) keys.push_back(absl::StrCat("flood-key-", k));
    kv_.Wait("flood", 1, std::move(keys), Later(), [](absl::Status) {});
  }
  std::optional<absl::Status> done;
  ASSERT_NE(kv_.Wait("calm", 1, {"rank0", "rank1"}, Later(), [&](absl::Status s) { done = s; }),
            0u);
  const uint64_t before = kv_.WaiterVisits();
  ASSERT_TRUE(kv_.Set("calm", 1, "rank0", "addr").ok());
  EXPECT_FALSE(done.has_value());
  ASSERT_TRUE(kv_.Set("calm", 1, "rank1", "addr").ok());
  ASSERT_TRUE(done.has_value() && done->ok());
  EXPECT_EQ(kv_.WaiterVisits() - before, 2u) << "a Set looked at waiters of other keys";
  kv_.Tick();
  EXPECT_EQ(kv_.WaiterVisits() - before, 2u) << "a Tick looked at waiters not due";
  // The flood's own Set looks at the flood's waiters of that key: 200.
  ASSERT_TRUE(kv_.Set("flood", 1, "flood-key-7", "v").ok());
  EXPECT_EQ(kv_.WaiterVisits() - before, 202u);
}

TEST_F(KvStoreTest, AWaitCountsEachMissingKeyOnceWhateverTheOrder) {
  ASSERT_TRUE(kv_.Set("job", 1, "there", "v").ok());
  std::optional<absl::Status> done;
  kv_.Wait("job", 1, {"b", "a", "b", "there", "c"}, Later(), [&](absl::Status s) { done = s; });
  ASSERT_TRUE(kv_.Set("job", 1, "c", "1").ok());
  ASSERT_TRUE(kv_.Set("job", 1, "c", "2").ok());  // overwriting does not count twice
  ASSERT_TRUE(kv_.Set("job", 1, "b", "1").ok());
  EXPECT_FALSE(done.has_value());
  ASSERT_TRUE(kv_.Add("job", 1, "a", 1).ok());
  ASSERT_TRUE(done.has_value() && done->ok());
  EXPECT_EQ(kv_.JobBytes("job"), kv_.TotalBytes());
}

TEST_F(KvStoreTest, CancelledAndExpiredWaitsLeaveNoIndexOrBytes) {
  ASSERT_TRUE(kv_.Set("job", 1, "k", "v").ok());
  const size_t values = kv_.TotalBytes();
  uint64_t id = kv_.Wait("job", 1, {"x", "y"}, Later(), [](absl::Status) {});
  kv_.Wait("job", 1, {"x"}, clock_.Now() + absl::Seconds(1), [](absl::Status) {});
  kv_.Cancel(id);
  clock_.Advance(absl::Seconds(2));
  kv_.Tick();
  EXPECT_EQ(kv_.TotalBytes(), values);
  const uint64_t before = kv_.WaiterVisits();
  ASSERT_TRUE(kv_.Set("job", 1, "x", "v").ok());
  EXPECT_EQ(kv_.WaiterVisits(), before) << "a gone waiter stayed in the key index";
}

// The store counts at least what it makes malloc hold (and not wildly more):
// the bound is on memory, not on bookkeeping.
TEST(KvStoreAccountingTest, TheCountedBytesCoverWhatMallocHolds) {
  FakeClock clock;
  auto store = std::make_unique<KvStore>(&clock);
  const size_t before = mallinfo2().uordblks;
  for (int w = 0; w < 100; ++w) {
    std::vector<std::string> keys;
    for (int k = 0; k < 1000; ++k) keys.push_back(absl::StrCat("job-key-of-some-length-", w, "-", k));
    store->Wait("job", 1, std::move(keys), clock.Now() + absl::Seconds(10), [](absl::Status) {});
  }
  for (int k = 0; k < 2000; ++k) {
    ASSERT_TRUE(store->Set("job", 1, absl::StrCat("value-", k), std::string(100 + k % 50, 'v')).ok());
  }
  const size_t held = mallinfo2().uordblks - before;
  const size_t counted = store->TotalBytes();
  std::printf("malloc holds %zu bytes, the store counts %zu (%.2fx)\n", held, counted,
              static_cast<double>(counted) / held);
  EXPECT_GE(counted, held);
  EXPECT_LE(counted, 3 * held);
}

TEST(KvStoreLimitsTest, AJobAtItsBoundIsRefusedNamingItWhileAnotherJobGoesOn) {
  FakeClock clock;
  KvLimits limits;
  limits.max_job_bytes = 1 << 20;
  KvStore kv(&clock, limits);
  std::optional<absl::Status> refused;
  for (int w = 0; w < 100 && !refused.has_value(); ++w) {
    std::vector<std::string> keys;
    for (int k = 0; k < 1000; ++k) keys.push_back(absl::StrCat("flood-", w, "-", k));
    kv.Wait("flood", 1, std::move(keys), clock.Now() + absl::Seconds(10),
            [&](absl::Status s) { refused = s; });
  }
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused->message().find("job 'flood'"), std::string::npos) << *refused;
  EXPECT_NE(refused->message().find("--kv_max_job_bytes"), std::string::npos) << *refused;
  EXPECT_NE(refused->message().find(absl::StrCat(limits.max_job_bytes)), std::string::npos)
      << *refused;
  EXPECT_LE(kv.JobBytes("flood"), limits.max_job_bytes);
  EXPECT_TRUE(kv.Set("calm", 1, "k", "v").ok());
  std::optional<absl::Status> calm;
  kv.Wait("calm", 1, {"k"}, clock.Now() + absl::Seconds(10), [&](absl::Status s) { calm = s; });
  ASSERT_TRUE(calm.has_value() && calm->ok());
}

}  // namespace
}  // namespace zeroshard
