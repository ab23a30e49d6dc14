#include "shard_server/base/event_log.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace zeroshard {
namespace {

bool Plain(unsigned char c) { return c > 0x20 && c < 0x7f && c != '"' && c != '=' && c != '\\'; }

// A value as one logfmt token that a reader cannot mistake for more: bare
// when it is non-empty printable ASCII without space, '"', '=' or '\\';
// otherwise quoted, with '"' and '\\' escaped and every byte outside
// printable ASCII (newlines, carriage returns, terminal escapes, NUL,
// UTF-8) written as \xHH. Values from the wire can be long: at most
// kMaxLogValueBytes of the value are written, then how many were left out.
std::string Quote(absl::string_view value) {
  const bool cut = value.size() > kMaxLogValueBytes;
  const absl::string_view shown = value.substr(0, kMaxLogValueBytes);
  bool plain = !value.empty() && !cut;
  for (unsigned char c : shown) plain = plain && Plain(c);
  if (plain) return std::string(value);
  std::string out = "\"";
  for (unsigned char c : shown) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20 || c >= 0x7f) {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (cut) absl::StrAppend(&out, "...(", value.size() - kMaxLogValueBytes, " more bytes)");
  out.push_back('"');
  return out;
}

}  // namespace

EventLog::EventLog(Sink sink) : sink_(std::move(sink)) {}

void EventLog::Log(absl::string_view event, std::initializer_list<LogField> fields) {
  std::string line = absl::StrCat(
      "ts=", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
      " event=", event);
  for (const auto& [key, value] : fields) absl::StrAppend(&line, " ", key, "=", Quote(value));
  // Event names and keys are the server's own constants, never wire data.
  if (sink_) {
    sink_(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

}  // namespace zeroshard
