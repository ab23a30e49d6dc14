#include "agent/verified_credentials.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// Length-prefixed: ids and tokens may hold any byte.
std::string KeyOf(const v1::MemberCredentials& m) {
  return absl::StrCat(m.job_id().size(), ":", m.job_id(), "/", m.generation(), "/", m.rank(), "/",
                      m.token().size(), ":", m.token());
}

}  // namespace

void VerifiedCredentials::Add(const v1::MemberCredentials& member) {
  std::string key = KeyOf(member);
  absl::MutexLock lock(&mu_);
  if (!known_.insert(key).second) return;
  order_.push_back(std::move(key));
  while (order_.size() > capacity_) {
    known_.erase(order_.front());
    order_.pop_front();
  }
}

bool VerifiedCredentials::Contains(const v1::MemberCredentials& member) {
  const std::string key = KeyOf(member);
  absl::MutexLock lock(&mu_);
  return known_.count(key) > 0;
}

size_t VerifiedCredentials::size() {
  absl::MutexLock lock(&mu_);
  return known_.size();
}

}  // namespace zeroshard
