#include "worker/comm/in_memory_kv_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace zeroshard {

absl::Status InMemoryKvStore::Set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKvStore::Get(const std::string& key, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (AwaitKeys({key}, absl::Now() + timeout).has_value()) {
    return absl::DeadlineExceededError(
        absl::StrCat("key '", key, "' not set after ", absl::FormatDuration(timeout)));
  }
  return values_.at(key);
}

absl::StatusOr<int64_t> InMemoryKvStore::Add(const std::string& key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  int64_t value = 0;
  auto it = values_.find(key);
  if (it != values_.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", key, "' holds a non-integer value; cannot Add"));
  }
  value += delta;
  values_[key] = absl::StrCat(value);
  changed_.SignalAll();
  return value;
}

absl::Status InMemoryKvStore::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  std::optional<std::string> missing = AwaitKeys(keys, absl::Now() + timeout);
  if (missing.has_value()) {
    return absl::DeadlineExceededError(
        absl::StrCat("key '", *missing, "' not set after ", absl::FormatDuration(timeout),
                     " (waiting for ", keys.size(), " keys: ", absl::StrJoin(keys, ", "), ")"));
  }
  return absl::OkStatus();
}

size_t InMemoryKvStore::size() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

bool InMemoryKvStore::AwaitReaderBlocks(int64_t n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reader_blocks_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

std::optional<std::string> InMemoryKvStore::AwaitKeys(const std::vector<std::string>& keys,
                                                      absl::Time deadline) {
  while (true) {
    const std::string* missing = nullptr;
    for (const std::string& key : keys) {
      if (values_.count(key) == 0) {
        missing = &key;
        break;
      }
    }
    if (missing == nullptr) return std::nullopt;
    // WaitWithDeadline returns true on timeout; check the keys once more so
    // that a write racing with the deadline still counts.
    ++reader_blocks_;
    if (changed_.WaitWithDeadline(&mu_, deadline)) {
      for (const std::string& key : keys) {
        if (values_.count(key) == 0) return key;
      }
      return std::nullopt;
    }
  }
}

}  // namespace zeroshard
