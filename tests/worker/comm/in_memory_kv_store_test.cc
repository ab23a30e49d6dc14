#include "worker/comm/in_memory_kv_store.h"

#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

TEST(InMemoryKvStoreTest, SetThenGet) {
  InMemoryKvStore store;
  ASSERT_TRUE(store.Set("a", std::string("x\0y", 3)).ok());
  auto value = store.Get("a", absl::Milliseconds(10));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("x\0y", 3));
  ASSERT_TRUE(store.Set("a", "z").ok());
  EXPECT_EQ(*store.Get("a", absl::Milliseconds(10)), "z");
  EXPECT_EQ(store.size(), 1u);
}

TEST(InMemoryKvStoreTest, GetTimesOutNamingTheKey) {
  InMemoryKvStore store;
  const absl::Time start = absl::Now();
  auto value = store.Get("missing", absl::Milliseconds(100));
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(value.status().message()), HasSubstr("'missing'"));
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, absl::Milliseconds(95));
  EXPECT_LT(elapsed, absl::Seconds(2));
}

TEST(InMemoryKvStoreTest, GetWaitsForAWriter) {
  InMemoryKvStore store;
  std::thread writer([&] {
    // Write only once the reader is blocked on the missing key.
    ASSERT_TRUE(store.AwaitReaderBlocks(1, absl::Seconds(10)));
    ASSERT_TRUE(store.Set("late", "v").ok());
  });
  auto value = store.Get("late", absl::Seconds(10));
  writer.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "v");
}

TEST(InMemoryKvStoreTest, AddCounts) {
  InMemoryKvStore store;
  EXPECT_EQ(*store.Add("n", 1), 1);
  EXPECT_EQ(*store.Add("n", 5), 6);
  EXPECT_EQ(*store.Add("n", -2), 4);
  EXPECT_EQ(*store.Get("n", absl::Milliseconds(1)), "4");
  ASSERT_TRUE(store.Set("s", "text").ok());
  EXPECT_EQ(store.Add("s", 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(InMemoryKvStoreTest, AddFromManyThreads) {
  InMemoryKvStore store;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) ASSERT_TRUE(store.Add("c", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*store.Add("c", 0), 400);
}

TEST(InMemoryKvStoreTest, WaitForSeveralKeysNamesTheMissingOne) {
  InMemoryKvStore store;
  ASSERT_TRUE(store.Set("k1", "").ok());
  EXPECT_TRUE(store.Wait({"k1"}, absl::Milliseconds(1)).ok());
  EXPECT_TRUE(store.Wait({}, absl::Milliseconds(1)).ok());
  absl::Status status = store.Wait({"k1", "k2"}, absl::Milliseconds(50));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(status.message()), HasSubstr("'k2'"));
}

TEST(InMemoryKvStoreTest, WaitForSeveralKeysOutlastsAPartialWrite) {
  InMemoryKvStore store;
  ASSERT_TRUE(store.Set("k1", "").ok());
  std::thread writer([&] {
    // Each write lands while the reader is blocked: k2 must not end the wait,
    // the reader blocks again on k3.
    ASSERT_TRUE(store.AwaitReaderBlocks(1, absl::Seconds(10)));
    ASSERT_TRUE(store.Set("k2", "").ok());
    ASSERT_TRUE(store.AwaitReaderBlocks(2, absl::Seconds(10)));
    ASSERT_TRUE(store.Set("k3", "").ok());
  });
  EXPECT_TRUE(store.Wait({"k1", "k2", "k3"}, absl::Seconds(10)).ok());
  writer.join();
}

}  // namespace
}  // namespace zeroshard
