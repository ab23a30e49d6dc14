// Member credentials the server accepted, as a node agent saw it answer
// them: the credentials of each join answer it delivered and of each beat
// and StoreWait the server answered without a refusal. The agent checks no
// token itself; it shares a call to the server only among callers whose
// credentials are here (#44 finding 4: a caller that knew a job's id and
// generation, with a wrong token, shared the ranks' waits).
//
// Bounded: the oldest entries go first beyond `capacity`. Thread-safe.
#ifndef ZEROSHARD_AGENT_VERIFIED_CREDENTIALS_H_
#define ZEROSHARD_AGENT_VERIFIED_CREDENTIALS_H_

#include <cstddef>
#include <deque>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard {

class VerifiedCredentials {
 public:
  explicit VerifiedCredentials(size_t capacity) : capacity_(capacity) {}

  // The server accepted `member` (its job, generation, rank and token).
  void Add(const v1::MemberCredentials& member);
  // Whether the server accepted exactly these credentials.
  bool Contains(const v1::MemberCredentials& member);
  size_t size();

 private:
  const size_t capacity_;
  absl::Mutex mu_;
  absl::flat_hash_set<std::string> known_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace zeroshard

#endif  // ZEROSHARD_AGENT_VERIFIED_CREDENTIALS_H_
