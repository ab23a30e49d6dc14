#include "worker/comm/kv_gloo_store.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gloo/common/error.h"
#include "gtest/gtest.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace {

std::vector<char> Bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

TEST(KvGlooStoreTest, PrefixesKeys) {
  InMemoryKvStore kv;
  KvGlooStore store(&kv, KvGlooStore::PrefixForTag("gather"));
  EXPECT_EQ(store.prefix(), "gloo/gather/");
  store.set("0", Bytes(std::string("a\0b", 3)));
  EXPECT_EQ(*kv.Get("gloo/gather/0", absl::Milliseconds(1)), std::string("a\0b", 3));
  EXPECT_EQ(store.get("0"), Bytes(std::string("a\0b", 3)));
}

TEST(KvGlooStoreTest, PrefixesKeepContextsApart) {
  InMemoryKvStore kv;
  KvGlooStore a(&kv, "gloo/a/", absl::Milliseconds(50));
  KvGlooStore b(&kv, "gloo/b/", absl::Milliseconds(50));
  a.set("rank_0", Bytes("from a"));
  b.set("rank_0", Bytes("from b"));
  EXPECT_EQ(a.get("rank_0"), Bytes("from a"));
  EXPECT_EQ(b.get("rank_0"), Bytes("from b"));
  a.set("only_a", Bytes("x"));
  EXPECT_THROW(b.get("only_a"), gloo::IoException);
}

TEST(KvGlooStoreTest, GetBlocksUntilSetThenTimesOut) {
  InMemoryKvStore kv;
  KvGlooStore store(&kv, "p/", absl::Milliseconds(200));
  std::thread writer([&] {
    ASSERT_TRUE(kv.AwaitReaderBlocks(1, absl::Seconds(10)));  // the get below is waiting
    KvGlooStore other(&kv, "p/");
    other.set("k", Bytes("v"));
  });
  EXPECT_EQ(store.get("k"), Bytes("v"));
  writer.join();
  EXPECT_TRUE(store.last_error().ok());

  const absl::Time start = absl::Now();
  EXPECT_THROW(store.get("never"), gloo::IoException);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, absl::Milliseconds(190));
  EXPECT_LT(elapsed, absl::Seconds(2));
  EXPECT_EQ(store.last_error().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(KvGlooStoreTest, WaitHonoursItsTimeout) {
  InMemoryKvStore kv;
  KvGlooStore store(&kv, "p/", absl::Seconds(30));
  store.set("a", Bytes(""));
  store.wait({"a"}, std::chrono::milliseconds(10));

  const absl::Time start = absl::Now();
  try {
    store.wait({"a", "b"}, std::chrono::milliseconds(100));
    ADD_FAILURE() << "wait returned without key b";
  } catch (const gloo::IoException& e) {
    EXPECT_NE(std::string(e.what()).find("p/b"), std::string::npos) << e.what();
  }
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, absl::Milliseconds(95));
  EXPECT_LT(elapsed, absl::Seconds(2));  // not the 30 s default
  EXPECT_EQ(store.last_error().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(KvGlooStoreTest, WaitWithoutTimeoutUsesTheDefault) {
  InMemoryKvStore kv;
  KvGlooStore store(&kv, "p/", absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  EXPECT_THROW(store.wait({"never"}), gloo::IoException);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace zeroshard
