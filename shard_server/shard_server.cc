#include "shard_server/shard_server.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/keepalive.h"
#include "google/protobuf/arena.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "shard_server/auth/bearer_auth.h"
#include "shard_server/membership/failure_detector.h"
#include "shard_server/observability/observability_pages.h"

namespace zeroshard {

namespace {

// Takes <dir>/lock (flock, released when the process ends however it ends)
// and writes this process's id into it; FAILED_PRECONDITION naming the
// holder when another server has it. Two servers on one state directory
// would each believe their own view of the jobs.
absl::StatusOr<int> LockStateDir(const std::string& dir) {
  const std::string path = dir + "/lock";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char holder[32] = {0};
    const ssize_t n = pread(fd, holder, sizeof(holder) - 1, 0);
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir ", dir, " is in use by another shard_server (process ",
                     n > 0 ? std::string(holder, strcspn(holder, "\n")) : "?",
                     "): two servers cannot share a state directory; stop that one or pick another "
                     "--state_dir"));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    // The lock holds without the note of who holds it.
  }
  return fd;
}

// --state_dir, made if missing: its parents as the umask says (as
// `mkdir -p`), the directory itself private (0700; one that exists is used
// as it is).
absl::Status MakeStateDir(const std::string& flag_value) {
  std::filesystem::path dir = std::filesystem::path(flag_value).lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();  // a trailing slash
  std::error_code error;
  if (dir.has_parent_path()) std::filesystem::create_directories(dir.parent_path(), error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create --state_dir ", flag_value, ": its parent ",
                     dir.parent_path().string(), ": ", error.message(),
                     "; pass a --state_dir this user can create"));
  }
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create --state_dir ", flag_value,
                                                      ": ", std::strerror(errno),
                                                      "; pass a --state_dir this user can create"));
  }
  if (!std::filesystem::is_directory(dir, error)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir ", flag_value,
                     " is not a directory; pass a directory (made if missing) for the server's "
                     "state"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::MakeComponents(
    ShardServerOptions options) {
  std::unique_ptr<ShardServer> server(new ShardServer());
  server->options_ = options;
  if (options.clock != nullptr) server->clock_ = options.clock;
  if (!options.job_tokens_dir.empty() && options.auth_token.empty()) {
    return absl::InvalidArgumentError(
        "--job_tokens_dir needs --auth_token_file: job tokens narrow an authenticated server");
  }
  server->log_ = std::make_unique<EventLog>(options.log_sink);
  if (absl::Status s = server->OpenState(); !s.ok()) return s;
  if (absl::Status s = server->MakeMembershipAndStores(); !s.ok()) return s;
  if (absl::Status s = server->OpenCheckpoints(); !s.ok()) return s;
  server->MakeServices();
  return server;
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::StartWithoutNetwork(
    ShardServerOptions options) {
  absl::StatusOr<std::unique_ptr<ShardServer>> server = MakeComponents(std::move(options));
  if (server.ok()) (*server)->membership_->StartGrace();
  return server;
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(ShardServerOptions options) {
  absl::StatusOr<std::unique_ptr<ShardServer>> made = MakeComponents(options);
  if (!made.ok()) return made.status();
  std::unique_ptr<ShardServer> server = *std::move(made);
  if (absl::Status s = server->StartGrpc(); !s.ok()) return s;
  if (absl::Status s = server->StartHttp(); !s.ok()) return s;
  server->server_->GetHealthCheckService()->SetServingStatus(true);
  // Restored members' grace counts from here, not from Restore().
  server->membership_->StartGrace();
  server->ticker_ = std::thread([s = server.get()] { s->TickLoop(); });
  server->log_->Log("serving", {{"address", server->address_},
                                {"state_dir", options.state_dir},
                                {"checkpoint_root", options.checkpoint_root},
                                {"keep_last", absl::StrCat(options.keep_last)},
                                {"auth", options.auth_token.empty() ? "off" : "bearer"},
                                {"tls", options.tls_cert.empty() ? "off" : "on"},
                                {"metrics_port", absl::StrCat(server->metrics_port())}});
  return server;
}

// The durable state: replicated (etcd), SQLite under --state_dir (locked
// against a second server), or an in-memory one when only checkpoints need it.
absl::Status ShardServer::OpenState() {
  if (options_.state_replica != nullptr) {
    absl::StatusOr<std::unique_ptr<StateStore>> state =
        StateStore::OpenReplicated(options_.state_replica);
    if (!state.ok()) return state.status();
    state_ = std::move(*state);
  }
  if (!options_.state_dir.empty()) {
    if (absl::Status s = MakeStateDir(options_.state_dir); !s.ok()) return s;
    absl::StatusOr<int> lock = LockStateDir(options_.state_dir);
    if (!lock.ok()) return lock.status();
    state_dir_lock_ = *lock;
    if (state_ != nullptr) return absl::OkStatus();  // replicated: the directory keeps history
    absl::StatusOr<std::unique_ptr<StateStore>> state =
        StateStore::Open(options_.state_dir + "/zeroshard.db");
    if (!state.ok()) return state.status();
    state_ = std::move(*state);
  } else if (state_ == nullptr && !options_.checkpoint_root.empty()) {
    // The checkpoint registry and the plans it reads need SQLite; without
    // a state directory they live in memory for the life of the process.
    absl::StatusOr<std::unique_ptr<StateStore>> state = StateStore::Open(":memory:");
    if (!state.ok()) return state.status();
    state_ = std::move(*state);
  }
  return absl::OkStatus();
}

// Membership, the KV store, plans and history, and what each tells the
// others (a new generation drops the old one's keys; a forgotten job its
// keys, plans and history).
absl::Status ShardServer::MakeMembershipAndStores() {
  membership_ = std::make_unique<Membership>(clock_, log_.get(), state_.get(), options_.membership);
  if (absl::Status s = membership_->Restore(); !s.ok()) return s;
  kv_ = std::make_unique<KvStore>(clock_, options_.kv);
  plans_ = std::make_unique<PlanService>(state_.get(), log_.get());
  KvStore* kv = kv_.get();
  PlanService* plans = plans_.get();
  membership_->SetGenerationListener(
      [kv](const std::string& job, int64_t generation) { kv->DropJob(job, generation); });
  absl::StatusOr<std::unique_ptr<HistoryStore>> history = HistoryStore::Open(
      options_.state_dir.empty() ? ":memory:" : options_.state_dir + "/history.db",
      options_.history);
  if (!history.ok()) return history.status();
  history_ = *std::move(history);
  HistoryStore* history_store = history_.get();
  membership_->SetForgetListener([kv, plans, history_store](const std::string& job) {
    kv->DropJob(job, std::numeric_limits<int64_t>::max());
    plans->ForgetJob(job);
    (void)history_store->ForgetJob(job);  // a leftover is thinned and forgotten with the id
  });
  return absl::OkStatus();
}

// The checkpoint registry (its plans from the state store) and verifier.
absl::Status ShardServer::OpenCheckpoints() {
  if (!options_.checkpoint_root.empty()) {
    StateStore* state = state_.get();
    auto plan_lookup = [state](const std::string& job,
                               int64_t generation) -> absl::StatusOr<v1::ShardPlan> {
      absl::StatusOr<std::optional<StoredPlan>> stored = state->LoadPlan(job, generation);
      if (!stored.ok()) return stored.status();
      if (!stored->has_value()) {
        return absl::NotFoundError(
            absl::StrCat("job '", job, "' generation ", generation, " has no shard plan"));
      }
      v1::ShardPlan plan;
      if (!plan.ParseFromString((*stored)->plan_bytes)) {
        return absl::DataLossError(
            absl::StrCat("stored plan of job '", job, "' generation ", generation, " is corrupt"));
      }
      return plan;
    };
    absl::StatusOr<std::unique_ptr<CheckpointRegistry>> registry = CheckpointRegistry::Open(
        {options_.checkpoint_root, options_.keep_last}, state, log_.get(), plan_lookup);
    if (!registry.ok()) return registry.status();
    checkpoint_registry_ = std::move(*registry);
    CheckpointRegistry* checkpoints = checkpoint_registry_.get();
    membership_->SetGenerationFloor(
        [checkpoints](const std::string& job) { return checkpoints->HighestGeneration(job); });
    if (options_.verify_checkpoints) {
      checkpoint_verifier_ =
          std::make_unique<CheckpointVerifier>(checkpoint_registry_.get(), log_.get());
      CheckpointVerifier* verifier = checkpoint_verifier_.get();
      checkpoint_registry_->SetCompletionListener(
          [verifier](const std::string& job, int64_t step) { verifier->Enqueue(job, step); });
    }
  }
  return absl::OkStatus();
}

// Metrics, the checkpoint and coordinator services, the telemetry analyzer.
void ShardServer::MakeServices() {
  metrics_ = std::make_unique<ServerMetrics>();
  ServerMetrics* metrics = metrics_.get();
  CheckpointServiceOptions checkpoint_service = options_.checkpoint_service;
  checkpoint_service.on_consolidated = [metrics](int64_t bytes, double seconds) {
    metrics->AddConsolidation(bytes, seconds);
  };
  checkpoints_ = std::make_unique<CheckpointService>(checkpoint_registry_.get(), membership_.get(),
                                                     log_.get(), checkpoint_service);
  diagnosis_ = std::make_unique<TelemetryAnalyzer>(clock_, log_.get(), options_.telemetry);
  credentials_ = std::make_unique<JobCredentials>(options_.auth_token, options_.job_tokens_dir,
                                                  options_.insecure_job_tokens);
  service_ = std::make_unique<CoordinatorService>(
      clock_, membership_.get(), kv_.get(), plans_.get(), credentials_.get(), checkpoints_.get(),
      diagnosis_.get(), history_.get());
  if (options_.control_plane) service_->SetControlPlaneSource(options_.control_plane);
  if (options_.leadership_check) service_->SetLeadershipCheck(options_.leadership_check);
  request_budget_ = std::make_unique<RequestBudget>(
      options_.max_request_bytes_in_flight, "the server's --max_request_bytes_in_flight");
  service_->SetRequestBudget(request_budget_.get());
  agent_service_ = std::make_unique<v1::HostAgent::AsyncService>();
}

// The gRPC server: TLS, interceptors, keepalive, one server per address.
absl::Status ShardServer::StartGrpc() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!options_.tls_cert.empty() || !options_.tls_key.empty()) {
    if (options_.tls_cert.empty() || options_.tls_key.empty()) {
      return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
    }
    grpc::SslServerCredentialsOptions ssl(
        options_.tls_client_ca.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = options_.tls_client_ca;
    ssl.pem_key_cert_pairs.push_back({options_.tls_key, options_.tls_cert});
    credentials = grpc::SslServerCredentials(ssl);
  } else if (!options_.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  }
  if (options_.tls_bind_worker_ids || !options_.tls_worker_id_map.empty()) {
    if (options_.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_bind_worker_ids and --tls_worker_id_map need client certificates: give "
          "--tls_client_ca (with --tls_cert and --tls_key)");
    }
    absl::StatusOr<WorkerIdBinding> binding = WorkerIdBinding::Parse(options_.tls_worker_id_map);
    if (!binding.ok()) return binding.status();
    worker_ids_ = *std::move(binding);
    service_->SetWorkerIdBinding(&*worker_ids_);  // the agents' joins: HostAgentServices below
  }
  int port = 0;
  builder.AddListeningPort(options_.listen, credentials, &port);
  builder.RegisterService(service_.get());
  builder.RegisterService(agent_service_.get());
  if (options_.heartbeat_queues < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_queues ", options_.heartbeat_queues, " must be at least 1"));
  }
  call_queues_ = std::make_unique<CallQueues>(&builder, options_.heartbeat_queues);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(RpcMetricsInterceptorFactory(metrics_.get()));
  if (!options_.auth_token.empty()) {
    // Reflection describes every method and message: behind the token too.
    interceptors.push_back(ReflectionAuthInterceptorFactory(options_.auth_token));
  }
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  // Heartbeat streams are long-lived and many; raise the concurrent-stream
  // limit per connection above gRPC's default so that simulated clusters can
  // multiplex thousands of members on a few connections.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 1 << 16);
  builder.SetMaxReceiveMessageSize(64 << 20);
  // The clients' keepalive pings are welcome (common/keepalive.h), and the
  // server pings too, to close the streams of clients that vanished.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kServerMinPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);  // 0: never GOAWAY for pings
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kServerKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kServerKeepaliveTimeoutMs);
  // One server per address: without SO_REUSEPORT a second server on an
  // address in use fails to start instead of splitting the clients with the
  // first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen,
                                               " (address in use, or a bad --listen value?)"));
  }
  HostAgentServices agents{agent_service_.get(), clock_,           membership_.get(),
                           credentials_.get(),   metrics_.get(), log_.get(),
                           worker_ids_.has_value() ? &*worker_ids_ : nullptr};
  call_queues_->Start({AcceptHeartbeatStreams(call_queues_.get(), {service_.get(), membership_.get(),
                                                                   metrics_.get(), credentials_.get()}),
                       AcceptHostHeartbeats(call_queues_.get(), agents),
                       AcceptHostJoins(call_queues_.get(), agents)});
  port_ = port;
  std::string host = options_.listen.substr(0, options_.listen.rfind(':'));
  address_ = absl::StrCat(host, ":", port);
  return absl::OkStatus();
}

// The metrics port (/metrics, the dashboard), when asked for.
absl::Status ShardServer::StartHttp() {
  if (!options_.metrics_listen.empty() || options_.shared_http != nullptr) {
    ObservabilitySources sources;
    sources.membership = membership_.get();
    sources.diagnosis = diagnosis_.get();
    sources.checkpoints = checkpoint_registry_.get();
    sources.metrics = metrics_.get();
    sources.history = history_.get();
    sources.control_plane = options_.control_plane;
    if (options_.shared_http != nullptr) {
      options_.shared_http->SetPages(ObservabilityPages(sources));
      return absl::OkStatus();
    }
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Start(
        options_.metrics_listen, options_.auth_token, ObservabilityPages(sources));
    if (!http.ok()) return http.status();
    http_ = *std::move(http);
  }
  return absl::OkStatus();
}

void ShardServer::TickLoop() {
  while (!stop_.WaitForNotificationWithTimeout(options_.tick)) Tick();
}

void ShardServer::Tick() {
  // Diagnosis looks at every member: twice a second is fine-grained enough
  // for reports due after seconds (--hang_report_ms: 10 s). The pass copies
  // every member's status (~2.4 us each: 8 % of the server's CPU at 32K
  // ranks, perf), so above 16,384 members it runs once per 32,768 members a
  // second (every 3 s at 100K ranks): its cost stays under ~0.08 cores
  // however large the jobs.
  constexpr absl::Duration kAnalyzeEvery = absl::Milliseconds(500);
  constexpr double kMembersPerSecond = 32768;
  absl::MutexLock lock(&tick_mu_);
  // Null without the network (StartWithoutNetwork): no queues, no lag.
  if (call_queues_ != nullptr) {
    const absl::Duration lag = call_queues_->Lag();
    metrics_->SetCallQueueLag(lag);
    membership_->ReadServerLag(clock_->Now(), lag);
  }
  membership_->Tick();
  kv_->Tick();
  if (clock_->Now() < next_analysis_) return;
  // On an arena: every member's telemetry is copied, and freed at once.
  google::protobuf::Arena arena;
  auto* status = google::protobuf::Arena::CreateMessage<v1::GetStatusResponse>(&arena);
  membership_->FillStatus("", status);
  diagnosis_->Analyze(*status);
  const absl::Status recorded = history_->Record(*status, clock_->Now());
  if (!recorded.ok() && history_ok_) {
    log_->Log("history_failed", {{"error", recorded.ToString()}});  // once until it recovers
  } else if (recorded.ok() && !history_ok_) {
    log_->Log("history_recovered", {});
  }
  history_ok_ = recorded.ok();
  int64_t members = 0;
  for (const v1::JobStatus& job : status->jobs()) members += job.members_size();
  next_analysis_ =
      clock_->Now() + std::max(kAnalyzeEvery, absl::Seconds(members / kMembersPerSecond));
}

void ShardServer::Wait() { stop_.WaitForNotification(); }

std::shared_ptr<grpc::Channel> ShardServer::InProcessChannel() {
  return server_->InProcessChannel(grpc::ChannelArguments());
}

void ShardServer::Shutdown() {
  // Held throughout, so that a second caller returns only once the first
  // caller's shutdown is complete.
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (ticker_.joinable()) ticker_.join();
  // Its pages read the components below.
  if (options_.shared_http != nullptr) options_.shared_http->SetPages({});
  http_.reset();
  // Null: Start failed before serving, or StartWithoutNetwork.
  if (server_ != nullptr) {
    // Held calls are answered by the shutdown's cancellation.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
    call_queues_->Stop();  // every stream is cancelled: their last events drain
  }
  // Consolidation threads see their calls cancelled and stop.
  if (checkpoints_ != nullptr) checkpoints_->WaitIdle();
  if (checkpoint_verifier_ != nullptr) checkpoint_verifier_->Stop();
}

ShardServer::~ShardServer() {
  Shutdown();
  if (state_dir_lock_ >= 0) close(state_dir_lock_);
}

}  // namespace zeroshard
