// KvStore: set/get/add/wait, held gets, deadlines, generation scoping, limits.
#include "shard_server/kv_store.h"

#include <optional>

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

}  // namespace
}  // namespace zeroshard
