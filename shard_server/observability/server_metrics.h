// The shard server's own counters (RPCs by method and status code with a
// latency histogram, heartbeats, checkpoint commits and bytes,
// consolidations) and the Prometheus text exposition of them and of every
// job and rank (MetricsExposition).
//
// RPCs are counted by a gRPC server interceptor (RpcMetricsInterceptorFactory)
// so that no service needs to know: a unary call's latency is from its
// arrival to its status; a stream's is its life; a stream's messages are
// counted when it ends. Heartbeat streams are left out (an interceptor costs
// every beat): CoordinatorService counts each beat (AddHeartbeat).
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_SERVER_METRICS_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard {

// Thread-safe.
class ServerMetrics {
 public:
  // Upper bounds of the RPC latency buckets, in seconds (then +Inf).
  static constexpr std::array<double, 12> kLatencyBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 10, 60};

  // `method`: the short name ("Join"), `code` gRPC's.
  void RecordRpc(const std::string& method, grpc::StatusCode code, absl::Duration latency);
  void AddMessagesReceived(const std::string& method, int64_t count);
  void AddHeartbeat() { heartbeats_.fetch_add(1, std::memory_order_relaxed); }
  // How long the server took to answer one beat once it was read: Membership's
  // work and any wait for its lock (what KV, checkpoint or join work could
  // delay). Lock-free: it runs on every beat.
  void AddHeartbeatHandling(absl::Duration handling);
  // How far behind the server's call queues are (CallQueues::Lag), set by
  // the server's timer.
  void SetCallQueueLag(absl::Duration lag) {
    call_queue_lag_ns_.store(absl::ToInt64Nanoseconds(lag), std::memory_order_relaxed);
  }
  void AddCheckpointCommit(int64_t bytes);
  void AddConsolidation(int64_t bytes, double seconds);

  // Appends the server-wide series (no job's) in the Prometheus text format.
  void Write(std::string* out) const;

 private:
  struct Rpc {
    int64_t count = 0;
    double seconds = 0;
    std::array<int64_t, kLatencyBuckets.size()> buckets{};  // not cumulative
  };
  // Write's parts: the RPC counts and latencies, the heartbeats'.
  void WriteRpcFamiliesLocked(std::string* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteHeartbeatFamilies(std::string* out) const;
  // RPCs of `method` answered (`ok_only`: with OK).
  int64_t AnsweredLocked(absl::string_view method, bool ok_only) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, Rpc> rpcs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> messages_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> heartbeats_{0};
  std::array<std::atomic<int64_t>, kLatencyBuckets.size()> beat_buckets_{};  // not cumulative
  std::atomic<int64_t> beat_handled_{0};
  std::atomic<int64_t> beat_handling_ns_{0};      // sum
  std::atomic<int64_t> beat_handling_max_ns_{0};  // since the server started
  std::atomic<int64_t> call_queue_lag_ns_{0};
  std::atomic<int64_t> commits_{0};
  std::atomic<int64_t> commit_bytes_{0};
  std::atomic<int64_t> consolidations_{0};
  std::atomic<int64_t> consolidation_bytes_{0};
  std::atomic<double> consolidation_seconds_{0};
};

// Times and counts every RPC into `metrics` (not owned; outlives the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RpcMetricsInterceptorFactory(
    ServerMetrics* metrics);

// What the exposition shows of the checkpoints of one job.
struct CheckpointCounts {
  int complete = 0;
  int verified = 0;
  int pending = 0;
  int failed = 0;  // verification failures
  int incomplete = 0;
  int64_t latest_step = -1;
  int64_t latest_bytes = 0;
};

// Which ranks /metrics lists one by one (its query: ?all=1, ?job=J&rank=R).
struct MetricsView {
  // A job of more ranks lists only its `worst_ranks` (rank_views.h); its
  // hosts and histograms stand for the rest. So a scrape of a 100,000-rank
  // job is megabytes, not the ~2.6 KB per rank of the full listing.
  int max_rank_series = 1024;
  int worst_ranks = 32;
  bool all_ranks = false;  // every rank of every job, whatever its size
  // >= 0: only this rank's series (of job `job`), besides the job series.
  int rank = -1;
  std::string job;
};

// The whole /metrics page: server series, then jobs (by state, generation,
// diagnoses, checkpoints), each job's hosts and histograms over its ranks,
// and the ranks' series that `view` selects. `status` is annotated
// (TelemetryAnalyzer::Annotate).
std::string MetricsExposition(const ServerMetrics& server, const v1::GetStatusResponse& status,
                              const std::map<std::string, CheckpointCounts>& checkpoints,
                              const MetricsView& view = {});

// A label value escaped for the text format (backslash, quote, newline).
std::string EscapeLabelValue(const std::string& value);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_SERVER_METRICS_H_
