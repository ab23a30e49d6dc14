// --outer_timeout's quorum (docs/diloco.md, "Elastic outer steps"): which
// shard groups take part in one DiLoCo outer step, decided once through the
// generation's KV store on the shard server and read identically by every
// caller, late ones included.
//
// Each group's leader adds its group's bit to "outer_quorum/<step>/arrived";
// the leader that completes the mask decides "every group"; a leader that
// waited `timeout` from its own arrival without a decision decides "the
// groups arrived by now". The decision is a compare-and-set on
// "outer_quorum/<step>/decision" from empty: the first one stands. A
// `wait_for_all` step (a checkpoint's, the last) decides only "every group".
#ifndef ZEROSHARD_WORKER_OUTER_QUORUM_H_
#define ZEROSHARD_WORKER_OUTER_QUORUM_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace zeroshard {

// The KV operations the quorum uses (the shard server's, through Client).
class QuorumStore {
 public:
  virtual ~QuorumStore() = default;
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // DEADLINE_EXCEEDED when the key did not appear within `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // TCPStore's compare_set: the value the key holds afterwards.
  virtual absl::StatusOr<std::string> CompareSet(const std::string& key,
                                                 const std::string& expected,
                                                 const std::string& desired) = 0;
  virtual absl::Status Delete(const std::string& key) = 0;
};

// Client's KV store (the member's job generation's).
class ClientQuorumStore final : public QuorumStore {
 public:
  explicit ClientQuorumStore(Client* client) : client_(client) {}
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    return client_->StoreAdd(key, delta);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return client_->StoreGet(key, timeout);
  }
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    return client_->StoreCompareSet(key, expected, desired);
  }
  absl::Status Delete(const std::string& key) override {
    return client_->StoreDelete(key).status();
  }

 private:
  Client* const client_;
};

struct QuorumCall {
  int64_t after_step = 0;  // the outer step's: the inner steps before it
  int group = 0;           // the caller's group
  int groups = 2;          // the generation's, 1 to kMaxOuterQuorumGroups
  bool wait_for_all = false;
  // The caller's group took part in the last outer step (so it holds the
  // newest anchor). Only such a leader decides by timeout: a stale group
  // deciding alone would fork the anchor (two sets of groups each taking an
  // outer step from different anchors with the same count, which the
  // catch-up could not tell apart); it waits for a decision instead.
  bool up_to_date = true;
  absl::Duration timeout;  // --outer_timeout
  // How long a wait for every group (wait_for_all), or a member's wait for
  // its leader's decision, may last before it is an error.
  absl::Duration limit;
  // Drop the keys of this earlier outer step (its decision is no longer
  // read); 0: none.
  int64_t forget_step = 0;
};

// The leader's call: the decision's mask (bit g: group g takes part).
absl::StatusOr<uint64_t> LeadOuterQuorum(QuorumStore* store, const QuorumCall& call);
// A member's: waits up to call.limit for its leader's (or any) decision.
absl::StatusOr<uint64_t> ReadOuterQuorum(QuorumStore* store, const QuorumCall& call);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_OUTER_QUORUM_H_
