// One structured log line per control-plane event, in logfmt:
//   ts=2026-11-22T08:00:00.123Z event=join job=train-1 worker=host/0 ...
// Lines go to stderr (or a test's sink); values with spaces are quoted.
#ifndef ZEROSHARD_SHARD_SERVER_EVENT_LOG_H_
#define ZEROSHARD_SHARD_SERVER_EVENT_LOG_H_

#include <functional>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"

namespace zeroshard {

using LogField = std::pair<absl::string_view, std::string>;

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

#endif  // ZEROSHARD_SHARD_SERVER_EVENT_LOG_H_
