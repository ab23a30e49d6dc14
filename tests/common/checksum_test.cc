#include "common/checksum.h"

#include <string>
#include <utility>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(ChecksumTest, KnownXxh64Values) {
  EXPECT_EQ(Checksum("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(Checksum(nullptr, 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(Checksum("abc"), 0x44bc2cf5ad770999ull);
  EXPECT_EQ(ChecksumToHex(Checksum("")), "ef46db3751d8e999");
}

TEST(ChecksumTest, StreamingMatchesOneShot) {
  std::string data;
  for (int i = 0; i < 10000; ++i) data.push_back(static_cast<char>(i * 131 + (i >> 7)));
  const uint64_t expected = Checksum(data);
  for (size_t piece : {1u, 7u, 31u, 32u, 33u, 4096u, 10000u}) {
    Hasher hasher;
    for (size_t pos = 0; pos < data.size(); pos += piece) {
      hasher.Update(absl::string_view(data).substr(pos, piece));
    }
    EXPECT_EQ(hasher.Digest(), expected) << piece;
    EXPECT_EQ(hasher.Digest(), expected) << "Digest must not end the stream";
  }
  Hasher hasher;
  EXPECT_EQ(hasher.Digest(), Checksum(""));
  hasher.Update("junk");
  hasher.Reset();
  hasher.Update(data);
  EXPECT_EQ(hasher.Digest(), expected);

  Hasher moved(std::move(hasher));
  EXPECT_EQ(moved.Digest(), expected);
  hasher = std::move(moved);
  hasher.Update("x", 1);
  EXPECT_EQ(hasher.Digest(), Checksum(data + "x"));
}

TEST(ChecksumTest, HexFormatsAndParses) {
  EXPECT_EQ(ChecksumToHex(0), "0000000000000000");
  EXPECT_EQ(ChecksumToHex(0x0123456789abcdefull), "0123456789abcdef");
  EXPECT_EQ(ChecksumToHex(~0ull), "ffffffffffffffff");
  for (uint64_t v : {0ull, 1ull, 0xef46db3751d8e999ull, ~0ull}) {
    absl::StatusOr<uint64_t> parsed = ParseChecksumHex(ChecksumToHex(v));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, v);
  }
  absl::StatusOr<uint64_t> upper = ParseChecksumHex("EF46DB3751D8E999");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(*upper, 0xef46db3751d8e999ull);
  for (const char* bad : {"", "ef46db3751d8e99", "ef46db3751d8e9999", "ef46db3751d8e99g",
                          "0xef46db3751d8e9", " ef46db3751d8e99"}) {
    EXPECT_EQ(ParseChecksumHex(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace zeroshard
