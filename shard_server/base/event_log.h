// One structured log line per control-plane event, in logfmt:
//   ts=2026-11-22T08:00:00.123Z event=join job=train-1 worker=host/0 ...
// Lines go to stderr (or a test's sink). Values often come from the wire
// (worker ids, hosts, file names, error messages), so every value is one
// token of printable ASCII: quoted when it holds anything but plain
// characters, with control and non-ASCII bytes written as \xHH and long
// values cut, so that no value can end a line, fake a field or an event,
// or send escape sequences to a terminal.
#ifndef ZEROSHARD_SHARD_SERVER_BASE_EVENT_LOG_H_
#define ZEROSHARD_SHARD_SERVER_BASE_EVENT_LOG_H_

#include <functional>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"

namespace zeroshard {

using LogField = std::pair<absl::string_view, std::string>;

// The most bytes of one value a line shows.
inline constexpr size_t kMaxLogValueBytes = 512;

// Thread-safe.
class EventLog {
 public:
  using Sink = std::function<void(const std::string& line)>;
  // Writes to stderr when `sink` is empty.
  explicit EventLog(Sink sink = nullptr);
  void Log(absl::string_view event, std::initializer_list<LogField> fields);

 private:
  Sink sink_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_BASE_EVENT_LOG_H_
