// The event log: one line per event whatever the values hold, since many of
// them (worker ids, hosts, files, error messages) come from the wire.
#include "shard_server/base/event_log.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// The keys of a logfmt line, read as a logfmt reader reads it: key=value
// pairs separated by spaces, a value bare or in quotes with backslash
// escapes. Empty on a line that is not logfmt.
std::vector<std::string> Keys(const std::string& line) {
  std::vector<std::string> keys;
  size_t i = 0;
  while (i < line.size()) {
    const size_t eq = line.find('=', i);
    if (eq == std::string::npos) return {};
    keys.push_back(line.substr(i, eq - i));
    i = eq + 1;
    if (i < line.size() && line[i] == '"') {
      for (++i; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\') ++i;
      }
      if (i >= line.size()) return {};  // unterminated
      ++i;
    } else {
      while (i < line.size() && line[i] != ' ') ++i;
    }
    if (i < line.size()) {
      if (line[i] != ' ') return {};
      ++i;
    }
  }
  return keys;
}

class EventLogTest : public ::testing::Test {
 protected:
  EventLogTest() : log_([this](const std::string& line) { lines_.push_back(line); }) {}

  std::vector<std::string> lines_;
  EventLog log_;
};

TEST_F(EventLogTest, PlainValuesStayBareAndOthersAreQuoted) {
  log_.Log("join", {{"job", "train-1"}, {"worker", "host/0"}, {"note", "two words"}});
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_TRUE(absl::StrContains(lines_[0], " event=join job=train-1 worker=host/0 ")) << lines_[0];
  EXPECT_TRUE(absl::EndsWith(lines_[0], " note=\"two words\"")) << lines_[0];
}

TEST_F(EventLogTest, AValueCannotEndTheLineFakeAnEventOrEscapeToTheTerminal) {
  const std::string hostile[] = {
      "a\r\nts=2026-01-01T00:00:00.000Z event=member_dead job=x",
      "x\rts=... event=member_dead",
      "\x1b[2J\x1b[31mred",
      std::string("nul\0byte", 8),
      "quote\" event=member_dead",
      "back\\slash",
      "caf\xc3\xa9",
  };
  for (const std::string& value : hostile) {
    lines_.clear();
    log_.Log("join", {{"host", value}, {"after", "kept"}});
    ASSERT_EQ(lines_.size(), 1u);
    const std::string& line = lines_[0];
    for (unsigned char c : line) {
      EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << int{c} << " in " << line;
    }
    // The value is one token: the line has exactly the fields logged.
    EXPECT_EQ(Keys(line), (std::vector<std::string>{"ts", "event", "host", "after"})) << line;
    EXPECT_TRUE(absl::EndsWith(line, " after=kept")) << line;
  }
}

TEST_F(EventLogTest, ALongValueIsCutSayingHowMuchWasLeftOut) {
  log_.Log("join", {{"worker", std::string(10000, 'w')}});
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_LT(lines_[0].size(), kMaxLogValueBytes + 200);
  EXPECT_TRUE(absl::StrContains(lines_[0], "(9488 more bytes)")) << lines_[0];
}

}  // namespace
}  // namespace zeroshard
