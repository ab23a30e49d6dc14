#include "client/client.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/fault_messages.h"
#include "common/file_util.h"
#include "common/keepalive.h"
#include "common/plan/plan_codec.h"
#include "common/secret_file.h"
#include "common/server_list.h"
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
      return info_;
    }
    if (!Retryable(status) || absl::Now() + backoff >= deadline) {
      return absl::Status(
          status.code(),
          absl::StrCat("join of job '", job_id, "' as '", worker_id, "' at ", options_.server, ": ",
                       status.message(), " (tried for ",
                       absl::FormatDuration(absl::Trunc(absl::Now() - started, absl::Seconds(1))),
                       ")"));
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

void Client::ReportProgress(const Progress& progress) {
  absl::MutexLock lock(&mu_);
  progress_ = progress;
}

void Client::ReportPeerFailure() {
  absl::MutexLock lock(&mu_);
  peer_failure_ = true;
  beat_now_ = true;
}

void Client::SetTelemetrySource(TelemetrySource source) {
  absl::MutexLock lock(&mu_);
  telemetry_source_ = std::move(source);
}

void Client::StartHeartbeats(CommandHandler handler) {
  absl::MutexLock threads(&heartbeat_threads_mu_);
  StopHeartbeatThreads();
  {
    absl::MutexLock lock(&mu_);
    stop_heartbeats_ = false;
    peer_failure_ = false;
    beat_now_ = false;
    heartbeats_ended_ = false;
    last_answer_ = absl::Now();
    step_at_answer_ = progress_.step;
  }
  heartbeat_thread_ = std::thread([this, handler = std::move(handler)] {
    HeartbeatLoop(handler);
    absl::MutexLock lock(&mu_);
    heartbeats_ended_ = true;  // a command or an error ended them: silence is expected
  });
  silence_thread_ = std::thread([this] { ReportSilences(); });
}

void Client::ReportSilences() {
  // Often enough to be seen in a log that is being watched, rarely enough
  // not to flood one.
  constexpr absl::Duration kSilenceReport = absl::Seconds(5);
  absl::Time last_said = absl::InfinitePast();
  absl::Duration said_silence = absl::ZeroDuration();  // > 0: a silence was reported
  absl::MutexLock lock(&mu_);
  auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_heartbeats_ || heartbeats_ended_;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Seconds(1))) {
    const absl::Time now = absl::Now();
    const absl::Duration silent = now - last_answer_;
    if (silent > info_.heartbeat_timeout && now - last_said >= kSilenceReport) {
      last_said = now;
      said_silence = silent;
      // Whether this rank still steps decides what the line says: a rank
      // stuck in a collective with cut-off peers is not training.
      std::fprintf(stderr, "%s\n",
                   ServerSilenceLine({info_.job_id, info_.rank, options_.server, silent,
                                      progress_.step - step_at_answer_})
                       .c_str());
    } else if (said_silence > absl::ZeroDuration() && silent <= info_.heartbeat_timeout) {
      std::fprintf(stderr, "job '%s' rank %d: the server at %s answers heartbeats again\n",
                   info_.job_id.c_str(), info_.rank, options_.server.c_str());
      said_silence = absl::ZeroDuration();
    }
  }
}

absl::Duration Client::SinceHeartbeatAnswer() {
  absl::MutexLock lock(&mu_);
  return absl::Now() - last_answer_;
}

void Client::StopHeartbeats() {
  absl::MutexLock threads(&heartbeat_threads_mu_);
  StopHeartbeatThreads();
}

void Client::StopHeartbeatThreads() {
  {
    absl::MutexLock lock(&mu_);
    stop_heartbeats_ = true;
    if (heartbeat_context_ != nullptr) heartbeat_context_->TryCancel();
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (silence_thread_.joinable()) silence_thread_.join();
}

void Client::HeartbeatLoop(CommandHandler handler) {
  absl::Duration backoff = absl::Milliseconds(100);
  auto stopping = [this](absl::Duration wait) {
    absl::MutexLock lock(&mu_);
    auto stop = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_heartbeats_ || beat_now_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), wait);
    beat_now_ = false;
    return stop_heartbeats_;
  };
  while (true) {
    grpc::ClientContext context;
    if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
    // While the server is away (restarting), the stream waits for the
    // channel instead of failing at once. Waiting in the call is also what
    // keeps the channel's connection attempts polled, so the stream is back
    // within one reconnect backoff (<= 1 s) of the server's return; failing
    // fast and sleeping would leave them to gRPC's 5-second backup poller,
    // past a restarted server's heartbeat grace.
    context.set_wait_for_ready(true);
    {
      absl::MutexLock lock(&mu_);
      if (stop_heartbeats_) return;
      heartbeat_context_ = &context;
    }
    auto stream = AgentOrServer()->Heartbeat(&context);
    bool delivered = false;
    while (true) {
      v1::HeartbeatRequest request;
      TelemetrySource source;
      *request.mutable_member() = credentials();
      {
        absl::MutexLock lock(&mu_);
        request.set_step(progress_.step);
        request.set_loss(progress_.loss);
        request.set_memory_bytes(progress_.memory_bytes);
        request.set_collective_seq(progress_.collective_seq);
        *request.mutable_last_step() = progress_.last_step;
        request.set_snapshot_step(progress_.snapshot_step);
        if (progress_.recovery.generation() > 0) *request.mutable_recovery() = progress_.recovery;
        request.set_peer_failure(peer_failure_);
        *request.mutable_telemetry() = progress_.telemetry;
        source = telemetry_source_;
      }
      if (source) source(request.mutable_telemetry());
      v1::HeartbeatResponse response;
      if (!stream->Write(request) || !stream->Read(&response)) break;
      backoff = absl::Milliseconds(100);
      {
        absl::MutexLock lock(&mu_);
        last_answer_ = absl::Now();
        step_at_answer_ = progress_.step;
      }
      if (response.command() != v1::CONTINUE) {
        handler(response);
        delivered = true;
        break;
      }
      // After a failed collective the abort is what this member waits for:
      // beat often until it comes.
      constexpr absl::Duration kAwaitingAbortInterval = absl::Milliseconds(50);
      bool awaiting_abort = false;
      {
        absl::MutexLock lock(&mu_);
        awaiting_abort = peer_failure_;
      }
      if (stopping(awaiting_abort ? std::min(info_.heartbeat_interval, kAwaitingAbortInterval)
                                  : info_.heartbeat_interval)) {
        break;
      }
    }
    stream->WritesDone();
    grpc::Status status = stream->Finish();
    {
      absl::MutexLock lock(&mu_);
      heartbeat_context_ = nullptr;
      if (stop_heartbeats_ || delivered) return;
    }
    absl::Status s = FromGrpcStatus(status);
    if (absl::IsFailedPrecondition(s) || absl::IsNotFound(s) || absl::IsUnauthenticated(s)) {
      handler(s);  // fenced: beating again cannot help
      return;
    }
    if (stopping(backoff)) return;  // the server is away: re-open the stream
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

absl::Status Client::Leave() {
  StopHeartbeats();
  v1::LeaveRequest request;
  *request.mutable_member() = credentials();
  {
    absl::MutexLock lock(&mu_);
    request.set_has_final(true);
    request.set_final_step(progress_.step);
    request.set_final_loss(progress_.loss);
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

// ---- Checkpoints ----

namespace {

// Runs `attempt` (given the time left) again while it fails with UNAVAILABLE
// or CANCELLED and time is left: a call in flight when the server died (or,
// replicated, when its leader died) fails so even with wait_for_ready, one in
// flight on a leader that lost its lease (etcd without quorum: it stops
// serving and shuts its calls down) is CANCELLED by that server (these calls'
// contexts are never cancelled here), and the server takes a repeated commit
// or upload as the same one (its answer was lost).
template <typename T>
absl::StatusOr<T> RetryWhileUnavailable(
    absl::Duration timeout, const std::function<absl::StatusOr<T>(absl::Duration)>& attempt) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  for (;;) {
    absl::StatusOr<T> result = attempt(deadline - absl::Now());
    const bool again = absl::IsUnavailable(result.status()) || absl::IsCancelled(result.status());
    if (result.ok() || !again || absl::Now() + backoff >= deadline) return result;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

}  // namespace

absl::StatusOr<v1::CommitShardResponse> Client::CommitShard(
    int64_t step, const std::string& file, int64_t size_bytes,
    const std::map<std::string, std::string>& checksums, absl::Duration timeout) {
  return RetryWhileUnavailable<v1::CommitShardResponse>(
      std::max(options_.rpc_timeout, timeout), [&](absl::Duration left) {
        return CommitShardOnce(step, file, size_bytes, checksums, left);
      });
}

absl::StatusOr<v1::CommitShardResponse> Client::CommitShardOnce(
    int64_t step, const std::string& file, int64_t size_bytes,
    const std::map<std::string, std::string>& checksums, absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  // Training goes on without the server; a checkpoint made while it
  // restarts is committed when it is back, within the deadline.
  context.set_wait_for_ready(true);
  v1::CommitShardRequest request;
  *request.mutable_member() = credentials();
  request.set_step(step);
  request.set_file(file);
  request.set_size_bytes(size_bytes);
  for (const auto& [tensor, hex] : checksums) {
    v1::TensorChecksum* c = request.add_checksums();
    c->set_tensor(tensor);
    c->set_xxh64(hex);
  }
  v1::CommitShardResponse response;
  absl::Status s = FromGrpcStatus(stub_->CommitShard(&context, request, &response));
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("commit of ", file, ": ", s.message()));
  return response;
}

absl::Status Client::AbandonCheckpointStep(int64_t step, const std::string& failure,
                                           int64_t retry_step, absl::Duration timeout) {
  return RetryWhileUnavailable<v1::CommitShardResponse>(
             std::max(options_.rpc_timeout, timeout),
             [&](absl::Duration left) -> absl::StatusOr<v1::CommitShardResponse> {
               grpc::ClientContext context;
               Prepare(&context, left);
               context.set_wait_for_ready(true);
               v1::CommitShardRequest request;
               *request.mutable_member() = credentials();
               request.set_step(step);
               request.set_failure(failure);
               request.set_retry_step(retry_step);
               v1::CommitShardResponse response;
               absl::Status s = FromGrpcStatus(stub_->CommitShard(&context, request, &response));
               if (!s.ok()) {
                 return absl::Status(s.code(), absl::StrCat("abandoning checkpoint step ", step,
                                                            ": ", s.message()));
               }
               return response;
             })
      .status();
}

absl::StatusOr<int64_t> Client::UploadShard(int64_t step, const std::string& file,
                                            const std::string& local_path, absl::Duration timeout) {
  return RetryWhileUnavailable<int64_t>(
      timeout, [&](absl::Duration left) { return UploadShardOnce(step, file, local_path, left); });
}

absl::StatusOr<int64_t> Client::UploadShardOnce(int64_t step, const std::string& file,
                                                const std::string& local_path,
                                                absl::Duration timeout) {
  int fd = open(local_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", local_path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot stat", local_path);
    close(fd);
    return s;
  }
  grpc::ClientContext context;
  Prepare(&context, timeout);
  context.set_wait_for_ready(true);  // as CommitShard: the server may be restarting
  v1::UploadShardResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadShardRequest>> stream =
      stub_->UploadShard(&context, &response);
  v1::UploadShardRequest message;
  *message.mutable_member() = credentials();
  message.set_step(step);
  message.set_file(file);
  message.set_size_bytes(st.st_size);
  absl::Status local;
  bool open_stream = stream->Write(message);
  message.Clear();
  constexpr size_t kChunk = size_t{1} << 20;  // bytes per message
  int64_t sent = 0;
  while (open_stream && sent < st.st_size) {
    std::string* data = message.mutable_data();
    data->resize(static_cast<size_t>(std::min<int64_t>(kChunk, st.st_size - sent)));
    ssize_t n = pread(fd, data->data(), data->size(), sent);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      local = n < 0 ? ErrnoStatus(errno, "cannot read", local_path)
                    : absl::DataLossError(absl::StrCat(local_path, " shrank while uploading"));
      break;
    }
    data->resize(static_cast<size_t>(n));
    sent += n;
    open_stream = stream->Write(message);
  }
  close(fd);
  if (!local.ok()) context.TryCancel();  // the server keeps nothing of a short upload
  stream->WritesDone();
  absl::Status s = FromGrpcStatus(stream->Finish());
  if (!local.ok()) return local;
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("upload of ", file, ": ", s.message()));
  return response.size_bytes();
}

absl::StatusOr<v1::ListCheckpointsResponse> Client::ListCheckpoints(const std::string& job_id) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  return Call(&v1::Coordinator::Stub::ListCheckpoints, request, options_.rpc_timeout);
}

namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Where streamed files go: a directory (made for sharded output), or ""
// when `out_path` is the single file itself.
absl::StatusOr<std::string> StreamedOutputDir(const std::string& out_path, bool sharded) {
  if (out_path.empty()) return absl::InvalidArgumentError("no output path for consolidation");
  if (!sharded) return IsDirectory(out_path) ? out_path : std::string();
  if (mkdir(out_path.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, "cannot create output directory", out_path);
  }
  if (!IsDirectory(out_path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--out ", out_path, " is a file; sharded output (max_shard_bytes > 0) needs a directory"));
  }
  return out_path;
}

// The files of a Consolidate stream, written as they arrive. Every file stays
// at its temporary name until Commit (after the summary arrived), so a stream
// that breaks leaves nothing that looks complete.
class ConsolidationReceiver {
 public:
  ConsolidationReceiver(std::string out_path, std::string out_dir)
      : out_path_(std::move(out_path)), out_dir_(std::move(out_dir)) {}

  absl::Status StartFile(const v1::ConsolidateFile& file) {
    const std::string& name = file.name();
    if (file_received_ != file_size_) {
      return absl::DataLossError(absl::StrCat("unexpected file '", name, "' in the stream"));
    }
    // The server names files; they must not climb out of --out.
    if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos ||
        (out_dir_.empty() && !files_.empty())) {
      return absl::DataLossError(absl::StrCat("the server sent file name '", name, "'"));
    }
    std::string path = out_dir_.empty() ? out_path_ : absl::StrCat(out_dir_, "/", name);
    // O_DIRECT: the multi-GB output goes to disk without a page-cache copy
    // (on this project's VM that copy cost 2-5x the CPU of the DMA).
    AtomicFileOptions direct;
    direct.direct = true;
    absl::StatusOr<std::unique_ptr<AtomicFile>> opened = AtomicFile::Create(path, direct);
    if (!opened.ok()) return opened.status();
    files_.push_back(*std::move(opened));
    paths_.push_back(path);
    file_size_ = file.size_bytes();
    file_received_ = 0;
    progress_.file = path;
    progress_.bytes_expected += file_size_;
    return absl::OkStatus();
  }

  absl::Status Append(const std::string& data) {
    const auto n = static_cast<int64_t>(data.size());
    if (files_.empty() || file_received_ + n > file_size_) {
      return absl::DataLossError("the server sent more bytes than it announced");
    }
    if (absl::Status s = files_.back()->Write(data.data(), data.size()); !s.ok()) return s;
    file_received_ += n;
    progress_.bytes_received += n;
    return absl::OkStatus();
  }

  // Every announced byte arrived: the files take their names.
  absl::Status Commit(v1::ConsolidateSummary* summary) {
    if (file_received_ != file_size_) {
      return absl::DataLossError(absl::StrCat(progress_.file, ": ", file_received_, " of ",
                                              file_size_, " bytes received"));
    }
    if (files_.empty()) return absl::DataLossError("the server sent no file");
    for (auto& f : files_) {
      if (absl::Status c = f->Commit(); !c.ok()) return c;
    }
    summary->clear_files();
    for (const std::string& p : paths_) summary->add_files(p);
    return absl::OkStatus();
  }

  ConsolidateProgress& progress() { return progress_; }

 private:
  const std::string out_path_;
  const std::string out_dir_;
  std::vector<std::unique_ptr<AtomicFile>> files_;
  std::vector<std::string> paths_;
  int64_t file_size_ = 0, file_received_ = 0;
  ConsolidateProgress progress_;
};

}  // namespace

absl::StatusOr<v1::ConsolidateSummary> Client::Consolidate(const v1::ConsolidateRequest& request,
                                                           const std::string& out_path,
                                                           ConsolidateProgressFn progress) {
  const bool streamed = !request.on_server();
  std::string out_dir;
  if (streamed) {
    absl::StatusOr<std::string> dir = StreamedOutputDir(out_path, request.max_shard_bytes() > 0);
    if (!dir.ok()) return dir.status();
    out_dir = *std::move(dir);
  }
  grpc::ClientContext context;
  Prepare(&context, absl::Hours(24));
  std::unique_ptr<grpc::ClientReader<v1::ConsolidateResponse>> stream =
      stub_->Consolidate(&context, request);
  ConsolidationReceiver receiver(out_path, out_dir);
  v1::ConsolidateResponse message;
  std::optional<v1::ConsolidateSummary> summary;
  absl::Status local;
  while (local.ok() && stream->Read(&message)) {
    switch (message.kind_case()) {
      case v1::ConsolidateResponse::kFile:
        local = !streamed || summary.has_value()
                    ? absl::DataLossError(absl::StrCat("unexpected file '", message.file().name(),
                                                       "' in the stream"))
                    : receiver.StartFile(message.file());
        break;
      case v1::ConsolidateResponse::kData:
        local = receiver.Append(message.data());
        break;
      case v1::ConsolidateResponse::kProgress:
        receiver.progress().work_done = message.progress().bytes_done();
        receiver.progress().work_total = message.progress().bytes_total();
        if (progress) progress(receiver.progress());
        break;
      case v1::ConsolidateResponse::kDone:
        summary = message.done();
        break;
      default:
        break;
    }
  }
  if (!local.ok()) context.TryCancel();
  absl::Status s = FromGrpcStatus(stream->Finish());
  if (!local.ok()) return local;  // the files go with their temporary names
  if (!s.ok()) return s;
  if (!summary.has_value()) return absl::DataLossError("the stream ended without a summary");
  if (streamed) {
    if (absl::Status c = receiver.Commit(&*summary); !c.ok()) return c;
  }
  return *std::move(summary);
}

}  // namespace zeroshard
