// The client's heartbeat stream: a thread beats on one bidirectional stream
// (to the node agent when one answers, else to the server), carries the
// rank's progress and telemetry, and hands the server's commands to the
// worker's handler. The rest of the client is client.cc.
#include <optional>

#include "client/client.h"
#include "common/fault_messages.h"

namespace zeroshard {

void Client::ReportProgress(const Progress& progress) {
  absl::MutexLock lock(&mu_);
  progress_ = progress;
}

void Client::ReportOuterStep(const v1::OuterStepRecord& record) {
  absl::MutexLock lock(&mu_);
  outer_steps_.push_back(record);
  while (outer_steps_.size() > static_cast<size_t>(kOuterStepsSent)) outer_steps_.pop_front();
  beat_now_ = true;  // the server's record keeps up with outer steps closer than a beat
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

v1::HeartbeatRequest Client::NextBeat() {
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
    for (const v1::OuterStepRecord& o : outer_steps_) *request.add_outer_steps() = o;
    *request.mutable_telemetry() = progress_.telemetry;
    source = telemetry_source_;
  }
  if (source) source(request.mutable_telemetry());
  return request;
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
      const v1::HeartbeatRequest request = NextBeat();
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

}  // namespace zeroshard
