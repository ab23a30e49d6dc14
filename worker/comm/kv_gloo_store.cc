#include "worker/comm/kv_gloo_store.h"

#include <algorithm>

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"

namespace zeroshard {

KvGlooStore::KvGlooStore(KeyValueStore* store, std::string prefix, absl::Duration default_timeout)
    : store_(store), prefix_(std::move(prefix)), default_timeout_(default_timeout) {}

std::string KvGlooStore::PrefixForTag(const std::string& tag) {
  return absl::StrCat("gloo/", tag, "/");
}

void KvGlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status status = store_->Set(FullKey(key), std::string(data.begin(), data.end()));
  if (!status.ok()) Fail(status);
}

std::vector<char> KvGlooStore::get(const std::string& key) {
  absl::StatusOr<std::string> value = store_->Get(FullKey(key), default_timeout_);
  if (!value.ok()) Fail(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void KvGlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(default_timeout_)));
}

void KvGlooStore::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full_keys;
  full_keys.reserve(keys.size());
  for (const std::string& key : keys) full_keys.push_back(FullKey(key));
  // Gloo passes kNoTimeout (zero) to mean "no timeout"; we still bound the
  // wait, by the default timeout.
  absl::Duration limit =
      timeout.count() > 0 ? std::max(absl::FromChrono(timeout), min_wait_) : default_timeout_;
  absl::Status status = store_->Wait(full_keys, limit);
  if (!status.ok()) Fail(status);
}

absl::Status KvGlooStore::last_error() const {
  absl::MutexLock lock(&mu_);
  return last_error_;
}

void KvGlooStore::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    last_error_ = status;
  }
  throw gloo::IoException(
      absl::StrCat("rendezvous store (prefix '", prefix_, "'): ", status.ToString()));
}

}  // namespace zeroshard
