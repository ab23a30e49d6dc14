#include "client/client.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/keepalive.h"
#include "common/plan/plan_codec.h"
#include "common/secret_file.h"
#include "common/server_list.h"
#include "common/utf8_prefix.h"
#include "proto/health.grpc.pb.h"

namespace zeroshard {
namespace {

absl::Status ReadFileTo(const std::string& path, const char* what, std::string* out) {
  if (path.empty()) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " file ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  *out = buffer.str();
  return absl::OkStatus();
}

const char* ChannelStateName(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE:
      return "idle";
    case GRPC_CHANNEL_CONNECTING:
      return "connecting";
    case GRPC_CHANNEL_READY:
      return "ready";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "failing to connect";
    case GRPC_CHANNEL_SHUTDOWN:
      return "shut down";
  }
  return "in an unknown state";
}

// A join is asked again on these. CANCELLED: the server shut down under the
// call, a leader that lost its etcd lease stepping down (its calls in flight
// are cancelled when its 2-s drain ends); the next leader, or this one
// re-elected, answers the same join.
bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsAlreadyExists(s) || absl::IsAborted(s) ||
         absl::IsCancelled(s);
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status LoadClientFiles(const std::string& token_file, const std::string& ca_file,
                             const std::string& cert_file, const std::string& key_file,
                             ClientOptions* options) {
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token =
        ReadTokenFile(token_file, "--token_file", options->insecure);
    if (!token.ok()) return token.status();
    options->token = *std::move(token);
  }
  if (absl::Status s = ReadFileTo(ca_file, "TLS CA", &options->tls_ca); !s.ok()) return s;
  if (absl::Status s = ReadFileTo(cert_file, "TLS certificate", &options->tls_cert); !s.ok()) {
    return s;
  }
  return ReadFileTo(key_file, "TLS key", &options->tls_key);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  // Several servers (a replicated control plane): one channel over all of
  // them, which connects to the one that listens, the leader.
  absl::StatusOr<std::string> target = GrpcTargetForServers(options.server);
  if (!target.ok()) return target.status();
  if (absl::Status s = CheckTokenTransport(!options.token.empty(), !options.tls_ca.empty(),
                                           options.server, options.insecure, "--tls_ca");
      !s.ok()) {
    return s;
  }
  std::unique_ptr<Client> client(new Client());
  client->options_ = options;
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // Find a restarted server quickly: a member must beat again within the
  // heartbeat timeout (3 s by default), and gRPC's default first reconnect
  // backoff is already 1 s. Connection attempts start 100 ms apart and
  // grow to at most 1 s apart (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is the
  // timeout of one attempt, not a backoff).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A silently dead connection is closed within a few seconds
  // (common/keepalive.h), so the capped backoff above also bounds how long
  // after a network outage heartbeats resume.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kClientKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kClientKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // keep pinging an idle channel
  if (!options.tls_ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca;
    ssl.pem_cert_chain = options.tls_cert;
    ssl.pem_private_key = options.tls_key;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  } else if (!options.tls_cert.empty() || !options.tls_key.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate needs the server's CA (--tls_ca)");
  }
  client->channel_ = grpc::CreateCustomChannel(*target, credentials, args);
  client->stub_ = v1::Coordinator::NewStub(client->channel_);
  if (!options.agent.empty()) {
    // The agent is on this host (a unix socket or loopback): no TLS, and a
    // restarted agent is found within 100 ms to 1 s.
    grpc::ChannelArguments local;
    local.SetMaxReceiveMessageSize(64 << 20);
    local.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    local.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
    local.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    client->agent_channel_ =
        grpc::CreateCustomChannel(options.agent, grpc::InsecureChannelCredentials(), local);
    client->agent_stub_ = v1::Coordinator::NewStub(client->agent_channel_);
  }
  return client;
}

v1::Coordinator::Stub* Client::AgentOrServer() {
  if (agent_stub_ == nullptr) return stub_.get();
  // An agent that is not there fails the connection at once (no socket
  // file, connection refused: TRANSIENT_FAILURE); one that is there may take
  // a while to accept on a loaded host, and is waited for.
  constexpr absl::Duration kAgentConnectWait = absl::Seconds(5);
  const absl::Time deadline = absl::Now() + kAgentConnectWait;
  grpc_connectivity_state state = agent_channel_->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
         state != GRPC_CHANNEL_SHUTDOWN &&
         agent_channel_->WaitForStateChange(state, absl::ToChronoTime(deadline))) {
    state = agent_channel_->GetState(/*try_to_connect=*/true);
  }
  if (state == GRPC_CHANNEL_READY) {
    if (said_no_agent_.exchange(false)) {
      std::fprintf(stderr,
                   "the node agent at %s answers again: heartbeats and joins go through it\n",
                   options_.agent.c_str());
    }
    return agent_stub_.get();
  }
  if (!said_no_agent_.exchange(true)) {
    std::fprintf(stderr,
                 "no node agent answers at %s: heartbeats and joins go straight to the server "
                 "at %s\n",
                 options_.agent.c_str(), options_.server.c_str());
  }
  return stub_.get();
}

Client::~Client() { StopHeartbeats(); }

void Client::Prepare(grpc::ClientContext* context, absl::Duration timeout) const {
  constexpr absl::Duration kOneReconnect = absl::Milliseconds(1500);  // backoff <= 1 s + connect
  if (channel_->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + std::min(timeout, kOneReconnect)));
  }
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

v1::MemberCredentials Client::credentials() const {
  v1::MemberCredentials c;
  c.set_job_id(info_.job_id);
  c.set_generation(info_.generation);
  c.set_rank(info_.rank);
  c.set_token(info_.token);
  return c;
}

absl::StatusOr<JoinInfo> Client::Join(const std::string& job_id, int world_size,
                                      const std::string& worker_id, const std::string& host,
                                      absl::Duration timeout) {
  const absl::Time started = absl::Now();
  const absl::Time deadline = started + timeout;
  // How often a join that keeps failing says so.
  constexpr absl::Duration kJoinRetryReport = absl::Seconds(5);
  absl::Time last_said = started;
  absl::Duration backoff = absl::Milliseconds(100);
  v1::JoinRequest request;
  request.set_job_id(job_id);
  request.set_world_size(world_size);
  request.set_worker_id(worker_id);
  request.set_host(host);
  request.set_min_world_size(join_extras_.min_world_size);
  request.set_rejoin_grace_ms(absl::ToInt64Milliseconds(join_extras_.rejoin_grace));
  request.set_incarnation(join_extras_.incarnation);
  request.set_node(join_extras_.node);
  request.set_world_multiple(join_extras_.world_multiple);
  request.set_steps_completed(steps_completed_);
  while (true) {
    v1::JoinResponse response;
    // Through the node agent when one answers (it forwards the join), else
    // straight to the server, waiting for a connection to one of its
    // addresses first.
    v1::Coordinator::Stub* via = AgentOrServer();
    absl::Status status = via == stub_.get()
                              ? AwaitConnection(std::min(deadline, absl::Now() + kJoinRetryReport))
                              : absl::OkStatus();
    if (status.ok()) {
      grpc::ClientContext context;
      Prepare(&context, deadline - absl::Now());
      // Connected a moment ago; if the connection breaks before the call
      // leaves, the call waits (polling) for the next one, as above.
      context.set_wait_for_ready(true);
      status = FromGrpcStatus(via->Join(&context, request, &response));
    }
    if (status.ok()) {
      info_ = JoinInfo();
      info_.rank = response.rank();
      info_.world_size = response.world_size();
      info_.generation = response.generation();
      info_.job_id = job_id;
      info_.token = response.token();
      info_.members.assign(response.members().begin(), response.members().end());
      info_.heartbeat_interval = absl::Milliseconds(response.heartbeat_interval_ms());
      info_.heartbeat_timeout = absl::Milliseconds(response.heartbeat_timeout_ms());
      info_.steps_done = response.steps_done();
      return info_;
    }
    if (!Retryable(status) || absl::Now() + backoff >= deadline) {
      // How long it tried says something only of a refusal it retried.
      const absl::Duration tried = absl::Trunc(absl::Now() - started, absl::Seconds(1));
      return absl::Status(
          status.code(),
          absl::StrCat("join of job '", job_id, "' as '", worker_id, "' at ", options_.server, ": ",
                       status.message(),
                       Retryable(status)
                           ? absl::StrCat(" (tried for ", absl::FormatDuration(tried), ")")
                           : ""));
    }
    // Say so every few seconds: an unreachable server (a wrong address, a
    // firewall, a server listening on 127.0.0.1) is otherwise a silent wait.
    if (absl::Now() - last_said >= kJoinRetryReport) {
      last_said = absl::Now();
      std::fprintf(
          stderr,
          "join of job '%s' as '%s': the server at %s has not accepted it for %s "
          "(last error: %s); still trying for %s\n",
          job_id.c_str(), worker_id.c_str(), options_.server.c_str(),
          absl::FormatDuration(absl::Trunc(absl::Now() - started, absl::Seconds(1))).c_str(),
          status.ToString().c_str(),
          absl::FormatDuration(absl::Trunc(deadline - absl::Now(), absl::Seconds(1))).c_str());
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

absl::Status Client::AwaitConnection(absl::Time until) {
  // WaitForConnected polls the channel while it waits: a connection attempt
  // completes (and a new leader is found) within gRPC's reconnect backoff
  // (<= 1 s here) of a server accepting. A call that fails fast followed by a
  // sleep would leave the attempt's completion unpolled until gRPC's 5-s
  // backup poller ran: workers waiting in a join barrier when the leader
  // died took 7-25 s to reach a new leader that had served for 2 s.
  if (channel_->WaitForConnected(absl::ToChronoTime(until))) return absl::OkStatus();
  // Several servers: a replicated control plane, where only the leader
  // listens and a server that cannot reach an etcd quorum stops listening.
  const bool replicated = absl::StrContains(options_.server, ',');
  return absl::UnavailableError(absl::StrCat(
      "no server of ", options_.server, " accepts a connection (channel ",
      ChannelStateName(channel_->GetState(/*try_to_connect=*/true)), ")",
      replicated ? "; none leads: is a quorum of their etcd members up? (each server's "
                   "/metrics says why it does not lead: zeroshard_control_plane_etcd_session)"
                 : ""));
}

absl::Status Client::Leave(const v1::TimeLedger& final_time, const std::string& failure) {
  StopHeartbeats();
  v1::LeaveRequest request;
  *request.mutable_member() = credentials();
  *request.mutable_final_time() = final_time;
  // The server's bound (LeaveRequest.failure).
  constexpr size_t kMaxFailure = 1024;
  if (failure.size() <= kMaxFailure) {
    request.set_failure(failure);
  } else {
    const absl::string_view kept = Utf8Prefix(failure, kMaxFailure - 40);
    request.set_failure(
        absl::StrCat(kept, "... (", failure.size() - kept.size(), " bytes more)"));
  }
  {
    absl::MutexLock lock(&mu_);
    request.set_has_final(true);
    request.set_final_step(progress_.step);
    request.set_final_loss(progress_.loss);
    *request.mutable_final_last_step() = progress_.last_step;
    for (const v1::OuterStepRecord& o : outer_steps_) *request.add_outer_steps() = o;
  }
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  while (true) {
    grpc::ClientContext context;
    Prepare(&context, deadline - absl::Now());
    // The job's last call: worth waiting for a restarting server rather than
    // failing a finished job.
    context.set_wait_for_ready(true);
    v1::LeaveResponse response;
    absl::Status s = FromGrpcStatus(stub_->Leave(&context, request, &response));
    // A connection that broke under the call (a keepalive that timed out on
    // a starved machine, a reset) fails it with UNAVAILABLE although the
    // server is there: leaving again is harmless (the server's Leave is
    // idempotent), on a new connection.
    constexpr absl::Duration kRetryPause = absl::Milliseconds(100);
    if (!absl::IsUnavailable(s) || absl::Now() + kRetryPause >= deadline) return s;
    absl::SleepFor(kRetryPause);
  }
}

absl::Status Client::StoreSet(const std::string& key, const std::string& value) {
  grpc::ClientContext context;
  Prepare(&context, options_.rpc_timeout);
  v1::StoreSetRequest request;
  *request.mutable_member() = credentials();
  request.set_key(key);
  request.set_value(value);
  v1::StoreSetResponse response;
  return FromGrpcStatus(stub_->StoreSet(&context, request, &response));
}

absl::StatusOr<std::string> Client::StoreGet(const std::string& key, absl::Duration timeout) {
  grpc::ClientContext context;
  // The server answers at the store deadline; the call deadline is a margin later.
  Prepare(&context, timeout + absl::Seconds(5));
  v1::StoreGetRequest request;
  *request.mutable_member() = credentials();
  request.set_key(key);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  v1::StoreGetResponse response;
  absl::Status s = FromGrpcStatus(stub_->StoreGet(&context, request, &response));
  if (!s.ok()) return s;
  return std::move(*response.mutable_value());
}

absl::StatusOr<int64_t> Client::StoreAdd(const std::string& key, int64_t delta) {
  v1::StoreAddRequest request;
  *request.mutable_member() = credentials();
  request.set_key(key);
  request.set_delta(delta);
  absl::StatusOr<v1::StoreAddResponse> response =
      Call(&v1::Coordinator::Stub::StoreAdd, request, options_.rpc_timeout);
  if (!response.ok()) return response.status();
  return response->value();
}

absl::Status Client::StoreWait(const std::vector<std::string>& keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto wait = [&](v1::Coordinator::Stub* via) {
    const absl::Duration left = std::max(deadline - absl::Now(), absl::Milliseconds(1));
    grpc::ClientContext context;
    Prepare(&context, left + absl::Seconds(5));
    v1::StoreWaitRequest request;
    *request.mutable_member() = credentials();
    for (const std::string& k : keys) request.add_keys(k);
    request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(left)));
    v1::StoreWaitResponse response;
    return FromGrpcStatus(via->StoreWait(&context, request, &response));
  };
  // Through the node agent when one answers: the host's ranks' waits for the
  // same keys reach the server as one (agent/store_wait_fan_out.h).
  v1::Coordinator::Stub* via = AgentOrServer();
  absl::Status s = wait(via);
  // The agent went away under the wait (stopped, killed) or lost the server:
  // wait on at the server itself, as heartbeats then go straight to it. A
  // wait only reads, so asking again is harmless.
  if (via != stub_.get() && absl::IsUnavailable(s) && absl::Now() < deadline) s = wait(stub_.get());
  return s;
}

absl::StatusOr<std::string> Client::StoreCompareSet(const std::string& key,
                                                    const std::string& expected,
                                                    const std::string& desired) {
  v1::StoreCompareSetRequest request;
  *request.mutable_member() = credentials();
  request.set_key(key);
  request.set_expected(expected);
  request.set_desired(desired);
  absl::StatusOr<v1::StoreCompareSetResponse> response =
      Call(&v1::Coordinator::Stub::StoreCompareSet, request, options_.rpc_timeout);
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_value());
}

absl::StatusOr<bool> Client::StoreDelete(const std::string& key) {
  v1::StoreDeleteRequest request;
  *request.mutable_member() = credentials();
  request.set_key(key);
  absl::StatusOr<v1::StoreDeleteResponse> response =
      Call(&v1::Coordinator::Stub::StoreDelete, request, options_.rpc_timeout);
  if (!response.ok()) return response.status();
  return response->deleted();
}

absl::StatusOr<bool> Client::StoreCheck(const std::vector<std::string>& keys) {
  v1::StoreCheckRequest request;
  *request.mutable_member() = credentials();
  for (const std::string& k : keys) request.add_keys(k);
  absl::StatusOr<v1::StoreCheckResponse> response =
      Call(&v1::Coordinator::Stub::StoreCheck, request, options_.rpc_timeout);
  if (!response.ok()) return response.status();
  return response->all_exist();
}

absl::StatusOr<int64_t> Client::StoreNumKeys() {
  v1::StoreNumKeysRequest request;
  *request.mutable_member() = credentials();
  absl::StatusOr<v1::StoreNumKeysResponse> response =
      Call(&v1::Coordinator::Stub::StoreNumKeys, request, options_.rpc_timeout);
  if (!response.ok()) return response.status();
  return response->num_keys();
}

absl::StatusOr<v1::GetStatusResponse> Client::GetStatus(const std::string& job_id) {
  v1::GetStatusRequest request;
  request.set_job_id(job_id);
  return GetStatus(request);
}

absl::StatusOr<v1::GetStatusResponse> Client::GetStatus(const v1::GetStatusRequest& request) {
  return Read(&v1::Coordinator::Stub::GetStatus, request, options_.rpc_timeout);
}

absl::StatusOr<v1::EvictHostResponse> Client::EvictHost(int rank, int64_t step,
                                                        const std::string& reason) {
  v1::EvictHostRequest request;
  *request.mutable_member() = credentials();
  request.set_rank(rank);
  request.set_step(step);
  request.set_reason(reason);
  // Asked twice is harmless (the server's EvictHost is idempotent).
  return Read(&v1::Coordinator::Stub::EvictHost, request, options_.rpc_timeout);
}

absl::StatusOr<v1::UnfenceHostResponse> Client::UnfenceHost(const std::string& job_id,
                                                            const std::string& host) {
  v1::UnfenceHostRequest request;
  request.set_job_id(job_id);
  request.set_host(host);
  return Read(&v1::Coordinator::Stub::UnfenceHost, request, options_.rpc_timeout);
}

absl::StatusOr<v1::GetHistoryResponse> Client::GetHistory(const std::string& job_id, int rank) {
  v1::GetHistoryRequest request;
  request.set_job_id(job_id);
  request.set_rank(rank);
  return Read(&v1::Coordinator::Stub::GetHistory, request, options_.rpc_timeout);
}

absl::StatusOr<ShardPlan> Client::PlanShards(const ModelSpec& spec, const PlanOptions& options,
                                             int world_size) {
  grpc::ClientContext context;
  Prepare(&context, options_.rpc_timeout);
  v1::PlanShardsRequest request;
  if (!info_.token.empty()) *request.mutable_member() = credentials();
  *request.mutable_spec() = ModelSpecToProto(spec);
  *request.mutable_options() = PlanOptionsToProto(options);
  request.set_world_size(world_size);
  v1::PlanShardsResponse response;
  absl::Status s = FromGrpcStatus(stub_->PlanShards(&context, request, &response));
  if (!s.ok()) return s;
  ShardPlan plan = ShardPlanFromProto(response.plan());
  absl::Status valid = ValidatePlan(spec, plan);
  if (valid.ok() && plan.world_size != world_size) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("the plan is for world size ", plan.world_size, ", not ", world_size));
  }
  if (!valid.ok()) {
    return absl::InternalError(
        absl::StrCat("the server at ", options_.server,
                     " returned a shard plan that fails validation: ", valid.message()));
  }
  return plan;
}

absl::Status Client::HealthCheck() {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  Prepare(&context, options_.rpc_timeout);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  absl::Status s = FromGrpcStatus(health->Check(&context, request, &response));
  if (!s.ok()) return s;
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(
        absl::StrCat("server is ",
                     grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())));
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
