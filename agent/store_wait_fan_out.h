// The bootstrap fan-out of a node agent (issue #31, docs/scale.md): a host's
// ranks wait for the same keys of their job's KV store at about the same time
// (Gloo's rendezvous, NCCL's unique id), and the agent sends the server one
// StoreWait for them instead of one per rank.
//
// Waits for the same keys of the same job generation that overlap in time
// share one call to the server, carrying the first waiter's credentials (the
// others are of the same generation: the server fences them alike). Its
// answer is every waiter's, except that a waiter whose own deadline has not
// passed when the shared call timed out waits on, in a call of its own. A
// wait that begins after the shared call was answered starts a new one: no
// answer is kept, so a wait means what it means at the server (every key
// exists at some moment during the wait).
//
// Only waits whose credentials the server accepted (verified_credentials.h)
// share: another's goes to the server in a call of its own, so the server
// judges its token and its answer is its own. A call answered OK vouches
// for the credentials it carried.
//
// Thread-safe.
#ifndef ZEROSHARD_AGENT_STORE_WAIT_FAN_OUT_H_
#define ZEROSHARD_AGENT_STORE_WAIT_FAN_OUT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "agent/verified_credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard {

class StoreWaitFanOut {
 public:
  using Done = std::function<void(const grpc::Status&)>;

  // `authorization`: the "authorization" header the waiters' calls carried
  // ("" if none), passed on unchanged.
  // `verified`: not owned, outlives this.
  StoreWaitFanOut(std::shared_ptr<grpc::Channel> channel, std::string authorization,
                  VerifiedCredentials* verified);
  // Stop, then waits for the server's calls to end.
  ~StoreWaitFanOut();
  StoreWaitFanOut(const StoreWaitFanOut&) = delete;
  StoreWaitFanOut& operator=(const StoreWaitFanOut&) = delete;

  // Waits for request.keys(), for request.timeout_ms() from now; `done` is
  // called once, with the outcome (possibly at once, on this thread).
  // Returns the waiter's id for Cancel (0: already answered).
  uint64_t Wait(const v1::StoreWaitRequest& request, Done done);
  // The waiter's caller went away: its `done` gets CANCELLED now unless it
  // was answered; a shared call nobody waits on any more is cancelled.
  void Cancel(uint64_t waiter);
  // Answers every waiter UNAVAILABLE and cancels the server's calls; later
  // waits are answered so at once.
  void Stop();

  // For tests: ranks' waits held now, and calls made to the server so far.
  int held();
  int64_t calls();
  // No wait held and no call in flight: it may be destroyed at once.
  bool idle();

 private:
  struct Waiter {
    absl::Time deadline;
    Done done;
  };
  // One StoreWait to the server and the ranks' waits it answers.
  struct Shared {
    std::string key;  // in open_ while it takes waiters ("": a call of its own)
    v1::StoreWaitRequest request;
    v1::StoreWaitResponse response;
    grpc::ClientContext context;
    std::map<uint64_t, Waiter> waiters;
  };

  // Starts a call for `request` (its member, keys and timeout) with `waiter`.
  // The caller starts the call (outside mu_).
  std::shared_ptr<Shared> StartShared(const std::string& key, const v1::StoreWaitRequest& request,
                                      uint64_t id, Waiter waiter)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Answered(const std::shared_ptr<Shared>& shared, const grpc::Status& status);

  const std::unique_ptr<v1::Coordinator::Stub> stub_;
  const std::string authorization_;
  VerifiedCredentials* const verified_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::shared_ptr<Shared>> open_ ABSL_GUARDED_BY(mu_);  // by key
  std::map<uint64_t, std::shared_ptr<Shared>> by_waiter_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // calls whose callback has not run
  int64_t calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_AGENT_STORE_WAIT_FAN_OUT_H_
