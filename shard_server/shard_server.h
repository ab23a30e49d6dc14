// The shard server: the gRPC server with the Coordinator, health and
// reflection services, its durable state, and the timer that detects dead
// members and expires held calls.
#ifndef ZEROSHARD_SHARD_SERVER_SHARD_SERVER_H_
#define ZEROSHARD_SHARD_SERVER_SHARD_SERVER_H_

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "shard_server/agent_service.h"
#include "shard_server/call_queues.h"
#include "shard_server/checkpoint/checkpoint_registry.h"
#include "shard_server/checkpoint/checkpoint_service.h"
#include "shard_server/checkpoint/checkpoint_verifier.h"
#include "shard_server/base/clock.h"
#include "shard_server/coordinator_service.h"
#include "shard_server/heartbeat_streams.h"
#include "shard_server/base/event_log.h"
#include "shard_server/observability/history_store.h"
#include "shard_server/auth/job_credentials.h"
#include "shard_server/kv/kv_store.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/metrics_http.h"
#include "shard_server/plan_service.h"
#include "shard_server/observability/server_metrics.h"
#include "shard_server/state/state_store.h"
#include "shard_server/observability/telemetry_analyzer.h"
#include "shard_server/auth/worker_id_binding.h"

namespace zeroshard {

struct ShardServerOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT; port 0 picks a free port
  std::string state_dir;               // empty: no persistence
  // Set: the durable state lives in memory and every commit is saved to it
  // (the leader on etcd: state/etcd_state.h); state_dir then holds only the
  // history. Not owned; outlives the server.
  DatabaseReplica* state_replica = nullptr;
  // Fills GetStatus's and /metrics' control-plane part (the leadership on
  // etcd: replicated_server.h); empty: a single server.
  std::function<void(v1::ControlPlaneStatus*)> control_plane;
  // OK while this server leads (EtcdSession::CheckLeading); KV writes are
  // acknowledged only while it holds. Empty: a single server.
  std::function<absl::Status()> leadership_check;
  MembershipOptions membership;
  KvLimits kv;  // bounds of the KV store
  // Bytes that StoreSet, StoreWait, StoreCheck and StoreCompareSet
  // requests in flight may hold, as received and as parsed
  // (request_budget.h); beyond, refused.
  // At least one request of the largest size gRPC takes (64 MiB) fits.
  size_t max_request_bytes_in_flight = size_t{256} << 20;
  std::string auth_token;  // the admin token; empty: no authentication
  // Job tokens, <job>.token files (job_credentials.h); empty: none. Needs
  // auth_token.
  std::string job_tokens_dir;
  bool insecure_job_tokens = false;  // accept world-readable or short job token files
  // TLS (PEM contents, not paths). Client certificates are required when
  // tls_client_ca is set.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // With tls_client_ca: a join's worker id must be bound to its client
  // certificate (worker_id_binding.h); tls_worker_id_map is the map's text
  // (set: binding on).
  bool tls_bind_worker_ids = false;
  std::string tls_worker_id_map;
  // Checkpoints are committed, listed and consolidated below this directory
  // (empty: the checkpoint RPCs answer FAILED_PRECONDITION). Without
  // state_dir the registry lives in memory and is lost on restart.
  std::string checkpoint_root;
  int keep_last = 0;  // complete checkpoints kept per job; 0: all
  // Read every complete step back in the background (CheckpointVerifier);
  // retention then waits for verified steps.
  bool verify_checkpoints = true;
  CheckpointServiceOptions checkpoint_service;  // consolidation slots and their deadline
  absl::Duration tick = absl::Milliseconds(50);  // failure detection granularity
  // Completion queues (one polling thread each) that serve heartbeat
  // streams and the node agents' calls; a queue's cost per event grows with
  // the calls on it (call_queues.h), so more queues keep a beat's cost flat
  // to more ranks.
  int heartbeat_queues = 16;
  // The time every timer of the server reads (heartbeat ages, KV deadlines,
  // diagnosis); null: the real clock. Tests pass a FakeClock to check that
  // nothing happens while time passes. Not owned; outlives the server.
  Clock* clock = nullptr;
  EventLog::Sink log_sink;                       // empty: stderr
  TelemetryOptions telemetry;                    // hang and straggler diagnosis
  // HOST:PORT of the metrics port (/metrics, the dashboard); empty: none.
  std::string metrics_listen;
  // Set: the pages go to this server (already listening, not owned,
  // outlives this one) instead of one of our own on metrics_listen; they
  // are taken back at Shutdown. The replicated server keeps its port
  // across terms so (replicated_server.h).
  MetricsHttpServer* shared_http = nullptr;
  HistoryOptions history;  // bounds of the per-step history
};

class ShardServer {
 public:
  static absl::StatusOr<std::unique_ptr<ShardServer>> Start(ShardServerOptions options);
  // The same components, wired the same way, without the network: no gRPC
  // server, no metrics port and no timer thread. The caller calls the
  // handlers of coordinator() and checkpoints() directly and Tick() when
  // time has passed (tests/fuzz/service_fuzzer.cc: thousands of call
  // sequences a second, where the gRPC path allows tens).
  static absl::StatusOr<std::unique_ptr<ShardServer>> StartWithoutNetwork(
      ShardServerOptions options);
  ~ShardServer();  // Shutdown()

  int port() const { return port_; }
  int metrics_port() const {  // 0: none
    return options_.shared_http != nullptr ? options_.shared_http->port()
           : http_ != nullptr              ? http_->port()
                                           : 0;
  }
  std::string address() const { return address_; }  // HOST:PORT actually bound
  // A channel to this server inside the process (no socket), through the
  // same services and interceptors as the network (tests/fuzz).
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // Blocks until Shutdown() is called from another thread (or a signal handler
  // thread).
  void Wait();
  void Shutdown();

  // One pass of the server's timer: dead members, expired joins and held
  // KV calls, and (every 500 ms of the clock) diagnosis and history. The
  // timer thread calls it every `tick`; StartWithoutNetwork's caller does.
  void Tick();

  Membership* membership() { return membership_.get(); }
  KvStore* kv() { return kv_.get(); }
  CoordinatorService* coordinator() { return service_.get(); }
  CheckpointService* checkpoints() { return checkpoints_.get(); }
  JobCredentials* credentials() { return credentials_.get(); }
  // Null without a checkpoint root or with verify_checkpoints off.
  CheckpointVerifier* checkpoint_verifier() { return checkpoint_verifier_.get(); }

 private:
  ShardServer() = default;
  void TickLoop();
  // Start's steps, in order (StartWithoutNetwork: the first four).
  static absl::StatusOr<std::unique_ptr<ShardServer>> MakeComponents(ShardServerOptions options);
  absl::Status OpenState();
  absl::Status MakeMembershipAndStores();
  absl::Status OpenCheckpoints();
  void MakeServices();
  absl::Status StartGrpc();
  absl::Status StartHttp();

  ShardServerOptions options_;
  std::unique_ptr<EventLog> log_;
  std::unique_ptr<StateStore> state_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<RequestBudget> request_budget_;
  std::unique_ptr<PlanService> plans_;
  std::unique_ptr<CheckpointRegistry> checkpoint_registry_;  // null without a checkpoint root
  std::unique_ptr<CheckpointVerifier> checkpoint_verifier_;  // null: not verifying
  std::unique_ptr<CheckpointService> checkpoints_;
  std::unique_ptr<TelemetryAnalyzer> diagnosis_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<HistoryStore> history_;
  std::unique_ptr<JobCredentials> credentials_;
  std::optional<WorkerIdBinding> worker_ids_;  // unset: any certificate, any worker id
  std::unique_ptr<CoordinatorService> service_;
  // Node agents (docs/scale.md); served on call_queues_.
  std::unique_ptr<v1::HostAgent::AsyncService> agent_service_;
  // Declared before server_: its completion queues outlive the server.
  std::unique_ptr<CallQueues> call_queues_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> http_;  // null without metrics_listen
  RealClock real_clock_;
  Clock* clock_ = &real_clock_;  // options_.clock when given
  int port_ = 0;
  // <state_dir>/lock, held (flock) while the server lives: one server per
  // state directory. -1: no state directory.
  int state_dir_lock_ = -1;
  std::string address_;
  absl::Notification stop_;
  std::thread ticker_;
  absl::Mutex tick_mu_;  // one Tick at a time
  absl::Time next_analysis_ ABSL_GUARDED_BY(tick_mu_) = absl::InfinitePast();
  bool history_ok_ ABSL_GUARDED_BY(tick_mu_) = true;  // the last history record succeeded
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_SHARD_SERVER_H_
