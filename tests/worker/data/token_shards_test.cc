// Tests of llm.c token shards: the format checks (each bad shard gives one
// error naming the file), the streams and windows over several shards, and
// the validation window count.
#include "worker/data/token_shards.h"

#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TestDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/token_shards_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  mkdir(dir.c_str(), 0777);
  return dir;
}

struct ShardBytes {
  int32_t magic = kTokenShardMagic;
  int32_t version = kTokenShardVersion;
  int64_t count = -1;          // -1: tokens.size()
  std::vector<uint16_t> tokens;
  int64_t drop_tail_bytes = 0;  // truncation
};

// Writes a shard as llm.c's tokenizer scripts do.
std::string WriteShard(const std::string& path, const ShardBytes& s) {
  std::vector<int32_t> header(256, 0);
  header[0] = s.magic;
  header[1] = s.version;
  header[2] = static_cast<int32_t>(s.count >= 0 ? s.count : s.tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  bytes.append(reinterpret_cast<const char*>(s.tokens.data()), s.tokens.size() * 2);
  bytes.resize(bytes.size() - s.drop_tail_bytes);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr) << path;
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return path;
}

std::vector<uint16_t> Iota(int n, int first = 0) {
  std::vector<uint16_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(first + i);
  return v;
}

TEST(TokenShardTest, OpensAValidShardAndReadsItsTokens) {
  const std::string path = WriteShard(TestDir() + "/a.bin", {.tokens = Iota(10, 100)});
  auto shard = TokenShard::Open(path, 50257);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ((*shard)->size(), 10);
  EXPECT_EQ((*shard)->token(0), 100);
  EXPECT_EQ((*shard)->token(9), 109);
}

TEST(TokenShardTest, WrongMagicIsAnErrorNamingTheFile) {
  const std::string path = WriteShard(TestDir() + "/m.bin", {.magic = 1234, .tokens = Iota(4)});
  auto shard = TokenShard::Open(path, 256);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shard.status().message(), AllOf(HasSubstr(path), HasSubstr("wrong magic 1234")));
}

TEST(TokenShardTest, WrongVersionIsAnError) {
  const std::string path = WriteShard(TestDir() + "/v.bin", {.version = 2, .tokens = Iota(4)});
  auto shard = TokenShard::Open(path, 256);
  EXPECT_THAT(shard.status().message(), AllOf(HasSubstr(path), HasSubstr("version 2")));
}

TEST(TokenShardTest, TruncatedTokensAreAnErrorWithBothSizes) {
  const std::string path =
      WriteShard(TestDir() + "/t.bin", {.tokens = Iota(8), .drop_tail_bytes = 3});
  auto shard = TokenShard::Open(path, 256);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shard.status().message(),
              AllOf(HasSubstr(path), HasSubstr("8 tokens, so 1040 bytes"),
                    HasSubstr("the file has 1037"), HasSubstr("truncated")));
}

TEST(TokenShardTest, ATruncatedHeaderIsAnError) {
  const std::string path =
      WriteShard(TestDir() + "/h.bin", {.tokens = {}, .drop_tail_bytes = 1000});
  auto shard = TokenShard::Open(path, 256);
  EXPECT_THAT(shard.status().message(),
              AllOf(HasSubstr(path), HasSubstr("24 bytes, shorter than the 1024-byte header")));
}

TEST(TokenShardTest, AnEmptyFileIsAnError) {
  const std::string path = TestDir() + "/empty.bin";
  std::fclose(std::fopen(path.c_str(), "wb"));
  auto shard = TokenShard::Open(path, 256);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shard.status().message(), AllOf(HasSubstr(path), HasSubstr("empty")));
}

TEST(TokenShardTest, AShardOfZeroTokensIsAnError) {
  const std::string path = WriteShard(TestDir() + "/zero.bin", {.tokens = {}});
  auto shard = TokenShard::Open(path, 256);
  EXPECT_THAT(shard.status().message(), AllOf(HasSubstr(path), HasSubstr("holds 0 tokens")));
}

TEST(TokenShardTest, ATokenOutsideTheVocabularyNamesTheFileAndOffset) {
  std::vector<uint16_t> tokens = Iota(20);
  tokens[7] = 50257;
  const std::string path = WriteShard(TestDir() + "/big.bin", {.tokens = tokens});
  auto shard = TokenShard::Open(path, 50257);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kInvalidArgument);
  // Byte offset 1024 + 2 * 7.
  EXPECT_THAT(shard.status().message(),
              AllOf(HasSubstr(path), HasSubstr("token 50257 at byte offset 1038"),
                    HasSubstr("vocabulary size 50257")));
  EXPECT_TRUE(TokenShard::Open(path, 65536).ok());
}

TEST(TokenShardTest, AMissingFileIsNotFound) {
  auto shard = TokenShard::Open(TestDir() + "/nope.bin", 256);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(shard.status().message(), HasSubstr("nope.bin"));
}

TEST(TokenShardDataTest, AGlobThatMatchesNothingNamesTheFlag) {
  auto data = TokenShardData::Open(TestDir() + "/none_*.bin", TestDir() + "/v_*.bin", 256, 0);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr("--data="), HasSubstr("matches no file")));
}

TEST(TokenShardDataTest, ShardsNeedValidationShards) {
  const std::string dir = TestDir();
  WriteShard(dir + "/train_0.bin", {.tokens = Iota(10)});
  auto data = TokenShardData::Open(dir + "/train_*.bin", "", 256, 0);
  EXPECT_THAT(data.status().message(), HasSubstr("--val_data=GLOB"));
}

TEST(TokenShardDataTest, ABadValidationShardFailsTheOpen) {
  const std::string dir = TestDir();
  WriteShard(dir + "/train_0.bin", {.tokens = Iota(10)});
  WriteShard(dir + "/val_0.bin", {.magic = 7, .tokens = Iota(10)});
  auto data = TokenShardData::Open(dir + "/train_*.bin", dir + "/val_*.bin", 256, 0);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr("val_0.bin"), HasSubstr("wrong magic")));
}

TEST(TokenShardDataTest, VocabularyAboveUint16IsRefused) {
  auto data = TokenShardData::Open("a.bin", "b.bin", 65537, 0);
  EXPECT_THAT(data.status().message(), HasSubstr("--vocab=65537"));
}

TEST(TokenShardDataTest, WindowsSpanShardsInSortedOrderWithStrideContext) {
  const std::string dir = TestDir();
  // Written out of order: the stream follows the sorted names.
  WriteShard(dir + "/train_1.bin", {.tokens = Iota(5, 5)});
  WriteShard(dir + "/train_0.bin", {.tokens = Iota(5, 0)});
  WriteShard(dir + "/val_0.bin", {.tokens = Iota(10, 200)});
  auto data = TokenShardData::Open(dir + "/train_*.bin", dir + "/val_*.bin", 256, 0);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ((*data)->vocab(), 256);
  EXPECT_EQ((*data)->StreamTokens(Split::kTrain), 10);
  // (10 - 1) / 3 = 3 windows: tokens 0-3, 3-6, 6-9.
  EXPECT_EQ((*data)->Windows(Split::kTrain, 3), 3);
  std::vector<int32_t> window(4);
  ASSERT_TRUE((*data)->FillSample(Split::kTrain, 1, 3, window.data()).ok());
  EXPECT_EQ(window, (std::vector<int32_t>{3, 4, 5, 6}));  // across the shard boundary
  ASSERT_TRUE((*data)->FillSample(Split::kTrain, 3, 3, window.data()).ok());
  EXPECT_EQ(window, (std::vector<int32_t>{0, 1, 2, 3}));  // wraps: window 3 mod 3
  ASSERT_TRUE((*data)->FillSample(Split::kValidation, 2, 3, window.data()).ok());
  EXPECT_EQ(window, (std::vector<int32_t>{206, 207, 208, 209}));
}

TEST(TokenShardDataTest, ValidationWindowsFollowValTokens) {
  const std::string dir = TestDir();
  WriteShard(dir + "/train.bin", {.tokens = Iota(50)});
  WriteShard(dir + "/val.bin", {.tokens = Iota(41)});
  auto all = TokenShardData::Open(dir + "/train.bin", dir + "/val.bin", 256, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ((*all)->ValidationWindows(8), 5);  // (41 - 1) / 8
  auto some = TokenShardData::Open(dir + "/train.bin", dir + "/val.bin", 256, 20);
  ASSERT_TRUE(some.ok());
  EXPECT_EQ((*some)->ValidationWindows(8), 2);  // 20 / 8
  EXPECT_THAT((*some)->CheckContext(64).message(), HasSubstr("fewer than one window"));
  auto tiny = TokenShardData::Open(dir + "/train.bin", dir + "/val.bin", 256, 4);
  EXPECT_THAT((*tiny)->CheckContext(8).message(), HasSubstr("--val_tokens=4"));
}

TEST(TokenShardDataTest, LooksLikeTokenShardsByGlobOrExtension) {
  EXPECT_TRUE(LooksLikeTokenShards("data/fineweb_train_*.bin"));
  EXPECT_TRUE(LooksLikeTokenShards("data/tiny_val.bin"));
  EXPECT_FALSE(LooksLikeTokenShards("data/shakespeare.txt"));
}

}  // namespace
}  // namespace zeroshard
