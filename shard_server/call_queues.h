// Completion queues for the calls that are many and long-lived: the ranks'
// Heartbeat streams and the node agents' HostHeartbeat streams and HostJoin
// calls, served with gRPC's async API over K queues, each polled by a thread
// of its own. Every other method stays on the callback API.
//
// Why not the callback API: Debian's libgrpc is built without NDEBUG, and in
// such a build every completion-queue event searches the queue's list of
// outstanding tags linearly (grpc completion_queue.cc, cq_check_tag). The
// callback API puts every call's pending operation into one process-wide
// queue, so an event cost O(open calls): a direct beat 31 us at 4,096 streams
// and 122 us at 32,768. Spread over K queues, a queue's list is 1/K as long
// (docs/scale.md).
#ifndef ZEROSHARD_SHARD_SERVER_CALL_QUEUES_H_
#define ZEROSHARD_SHARD_SERVER_CALL_QUEUES_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

class CallQueues {
 public:
  // One call served on a queue, from the request that accepts it to its
  // end. Its events are delivered on its queue's thread, one at a time.
  class Call {
   public:
    // What a queue event names: the call and which of its operations
    // completed (the call's own numbering).
    struct Tag {
      Call* call;
      int step;
    };
    // `ok`: the operation succeeded. May End() the call.
    virtual void Proceed(int step, bool ok) = 0;

   protected:
    explicit Call(CallQueues* owner);  // counts the call alive
    virtual ~Call() = default;
    // Deletes this; the last thing a call does.
    void End();

   private:
    CallQueues* const owner_;
  };

  // Puts the first waiting call of a kind on `queue`; each accepted call
  // then puts the next one there.
  using Acceptor = std::function<void(grpc::ServerCompletionQueue* queue)>;

  // Adds `queues` (>= 1) completion queues to `builder`; construct before
  // builder.BuildAndStart(). `builder` is not kept.
  CallQueues(grpc::ServerBuilder* builder, int queues);
  ~CallQueues();  // Stop()

  // Runs every acceptor on every queue and starts the queues' threads. Call
  // once, after the server started.
  void Start(const std::vector<Acceptor>& acceptors);
  // How far behind the queues' threads are: an alarm on each queue every
  // 100 ms is timed when its thread gets to it (a queue whose alarm is
  // overdue counts as that far behind). The worst queue's. The failure
  // detector extends the heartbeat timeout by it (failure_detector.h, rule
  // 4b): a beat waiting here is not a silence.
  absl::Duration Lag() const;

  // Call after grpc::Server::Shutdown (which cancels every call): waits
  // until every call ended, then shuts the queues down, drains them and
  // joins the threads. Idempotent.
  void Stop();

 private:
  class LagProbe;
  // A queue's probe's times (microseconds since the epoch), kept here so
  // that Lag() reads them after the probe ended.
  struct ProbeTimes {
    std::atomic<int64_t> due_us{0};  // of the alarm outstanding
    std::atomic<int64_t> lag_us{0};  // of the last alarm its thread got to
  };

  void Poll(grpc::ServerCompletionQueue* queue);
  void CallStarted();
  void CallEnded();

  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> pollers_;  // one per queue, from Start() to Stop()
  std::vector<std::unique_ptr<ProbeTimes>> probe_times_;  // one per queue, from Start()
  std::atomic<bool> stopping_{false};  // the probes end instead of re-arming
  absl::Mutex mu_;
  // Calls alive (accepting or serving): a queue is shut down only at 0,
  // since an operation started on a shut-down queue aborts the process.
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CALL_QUEUES_H_
