// Utf8Prefix (common/utf8_prefix.h): a cut never splits a character.
#include "common/utf8_prefix.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(Utf8PrefixTest, ShortTextIsWhole) {
  EXPECT_EQ(Utf8Prefix("abc", 3), "abc");
  EXPECT_EQ(Utf8Prefix("", 0), "");
}

TEST(Utf8PrefixTest, CutsBeforeACharacterThatWouldNotFit) {
  const std::string text = "ab\xC3\xA9z";  // "abéz": é is 2 bytes
  EXPECT_EQ(Utf8Prefix(text, 4), "ab\xC3\xA9");
  EXPECT_EQ(Utf8Prefix(text, 3), "ab");  // not "ab\xC3"
  const std::string euro = "\xE2\x82\xAC\xE2\x82\xAC";  // two 3-byte characters
  EXPECT_EQ(Utf8Prefix(euro, 5), "\xE2\x82\xAC");
  EXPECT_EQ(Utf8Prefix(euro, 2), "");
  EXPECT_EQ(Utf8Prefix("abcdef", 4), "abcd");
}

}  // namespace
}  // namespace zeroshard
