// The simulating half of scale_bench (scale_bench.h): a process of
// simulated node agents, each one HostHeartbeat stream and one HostJoin call
// for its ranks, beating one interval after each answer, and writing what it
// saw to its status file for the parent.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/server_list.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/bench/scale_bench.h"
#include "tests/testing/process.h"
#include "tests/testing/simulated_members.h"

namespace zeroshard {
namespace scale_bench {

absl::Duration Interval() { return absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms)); }

std::string WorkerId(int host, int slot) { return absl::StrFormat("h%05d/%d", host, slot); }

int64_t NowUs() { return absl::ToUnixMicros(absl::Now()); }

namespace {

// ---------------------------------------------------------------- child --

// One HostJoin call: its answers, then `done`.
class JoinCall : public grpc::ClientReadReactor<v1::HostJoinResponse> {
 public:
  using Done = std::function<void(std::vector<v1::HostJoinAnswer>, grpc::Status)>;
  JoinCall(v1::HostAgent::Stub* stub, v1::HostJoinRequest request, Done done)
      : request_(std::move(request)), done_(std::move(done)) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(300)));
    stub->async()->HostJoin(&context_, &request_, this);
    StartRead(&answer_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    for (const v1::HostJoinAnswer& a : answer_.answers()) answers_.push_back(a);
    StartRead(&answer_);
  }
  void OnDone(const grpc::Status& status) override {
    done_(std::move(answers_), status);
    delete this;
  }

 private:
  grpc::ClientContext context_;
  v1::HostJoinRequest request_;
  v1::HostJoinResponse answer_;
  std::vector<v1::HostJoinAnswer> answers_;
  Done done_;
};

class Child;
class SimHost;

// One HostHeartbeat stream of a simulated agent. A hold keeps it (no OnDone)
// until its host has seen it break, so the host never touches a finished
// stream; a broken stream is replaced by a new one (a leader killed: the
// channel connects to the next one), as shard_agent re-opens its stream.
class BeatStream
    : public grpc::ClientBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse> {
 public:
  BeatStream(v1::HostAgent::Stub* stub, SimHost* host) : host_(host) {
    stub->async()->HostHeartbeat(&context_, this);
    AddHold();  // after the call is bound: before it, gRPC has no stream to hold
  }
  // One round: `request` written and its answer read, then the host's
  // RoundDone. REQUIRES: no round in flight; `request` unchanged until then.
  void Send(const v1::HostHeartbeatRequest* request) {
    pending_ = 2;
    StartWrite(request);
    StartRead(&response_);
    if (!started_) StartCall();
    started_ = true;
  }
  // The host is done with it (it broke): it may finish and delete itself.
  void Release() { RemoveHold(); }
  const v1::HostHeartbeatResponse& response() const { return response_; }
  void OnWriteDone(bool ok) override { Part(ok); }
  void OnReadDone(bool ok) override { Part(ok); }
  void OnDone(const grpc::Status&) override { delete this; }

 private:
  void Part(bool ok);

  SimHost* const host_;
  grpc::ClientContext context_;
  v1::HostHeartbeatResponse response_;
  std::atomic<int> pending_{0};
  std::atomic<bool> ok_{true};
  bool started_ = false;
};

// One simulated node agent.
class SimHost {
 public:
  SimHost(Child* child, int host, int ranks, std::shared_ptr<grpc::Channel> channel,
          const std::string& telemetry);
  // Starts connecting to the server (every host at once, not one after the
  // other: a handshake with a busy server takes a round of its event loop).
  void StartConnecting() { channel_->GetState(/*try_to_connect=*/true); }
  // Its connection to the server is up (a real agent's is long before its
  // ranks join); false at `deadline`.
  bool Connect(absl::Time deadline);
  void Join();
  // Sends the host's beats unless a round is out, the host is joining or silent.
  // Beats if its next beat is due at `now` (one clock read per sweep of a
  // process's hosts: a read and a lock per host every 10 ms were ~8 % of
  // the simulating core).
  void Tick(absl::Time now);
  int host() const { return host_; }
  void SilenceRank(int slot) {
    absl::MutexLock lock(&mu_);
    silent_slot_ = slot;
    request_built_ = false;
  }
  void SilenceHost() {
    absl::MutexLock lock(&mu_);
    silent_ = true;
  }
  // A round of `stream` ended: its answers, or it broke.
  void RoundDone(BeatStream* stream, bool ok);
  // Its first beat sent after `mark_us` and answered: when (0: none yet).
  int64_t AnsweredAfterMark(int64_t mark_us) {
    absl::MutexLock lock(&mu_);
    return mark_us == mark_us_ ? answered_after_mark_us_ : 0;
  }
  void SetMark(int64_t mark_us) {
    absl::MutexLock lock(&mu_);
    mark_us_ = mark_us;
    answered_after_mark_us_ = 0;
  }

 private:
  void Joined(std::vector<v1::HostJoinAnswer> answers, const grpc::Status& status);

  Child* const child_;
  const int host_;
  const int ranks_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::HostAgent::Stub> stub_;
  v1::HeartbeatRequest template_;  // the telemetry every beat carries
  absl::Mutex mu_;
  // Written under mu_ while no round is in flight; read by the stream's
  // write while one is.
  v1::HostHeartbeatRequest request_;
  BeatStream* stream_ ABSL_GUARDED_BY(mu_) = nullptr;  // null: none open (or it broke)
  int64_t mark_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t answered_after_mark_us_ ABSL_GUARDED_BY(mu_) = 0;
  bool beating_ ABSL_GUARDED_BY(mu_) = false;  // joined, not yet aborted
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool silent_ ABSL_GUARDED_BY(mu_) = false;
  int silent_slot_ ABSL_GUARDED_BY(mu_) = -1;
  // request_ holds this round's beats: built once per join (or silence),
  // sent every second (what changes in a real agent's beats costs the
  // server, not the simulator; the simulators' own CPU is what limits the
  // beat rate this machine can offer the server).
  bool request_built_ ABSL_GUARDED_BY(mu_) = false;
  bool request_carries_members_ ABSL_GUARDED_BY(mu_) = false;  // not yet same_member
  int round_ ABSL_GUARDED_BY(mu_) = 0;                         // joins completed
  absl::Time next_beat_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time sent_at_ ABSL_GUARDED_BY(mu_);  // this round's write started
 public:
  // In the first generation (before any abort): the latest beat this host
  // sent after it was due, and its slowest answer, in us. Whose silence a
  // death right after the barrier was (Child::WriteHosts).
  std::pair<int64_t, int64_t> FirstGenerationLateness() {
    absl::MutexLock lock(&mu_);
    return {first_late_us_, first_rtt_us_};
  }

 private:
  int64_t first_late_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t first_rtt_us_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time retry_join_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::vector<v1::MemberCredentials> members_ ABSL_GUARDED_BY(mu_);  // by slot
};

class Child {
 public:
  Child(int index, std::string dir, std::string server, int first_host, int hosts, int ranks)
      : index_(index), dir_(std::move(dir)), first_host_(first_host) {
    const int connections = absl::GetFlag(FLAGS_connections_per_process);
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    for (int c = 0; c < (connections > 0 ? std::min(connections, hosts) : hosts); ++c) {
      // A channel argument of its own: gRPC shares one connection among
      // channels with equal arguments.
      grpc::ChannelArguments args;
      args.SetInt("zeroshard.bench.connection", first_host + c);
      args.SetMaxReceiveMessageSize(64 << 20);
      // Several servers (on etcd): the leader found by pick_first, and the
      // next one within a second of a failover, as shard_agent does.
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      absl::StatusOr<std::string> target = GrpcTargetForServers(server);
      channels.push_back(grpc::CreateCustomChannel(target.ok() ? *target : server,
                                                   grpc::InsecureChannelCredentials(), args));
    }
    for (int h = 0; h < hosts; ++h) {
      hosts_.push_back(std::make_unique<SimHost>(this, first_host + h, ranks,
                                                 channels[h % channels.size()],
                                                 absl::GetFlag(FLAGS_telemetry)));
    }
  }

  int Run() {
    // Every host's connection up, then the parent's go (every process ready).
    const absl::Time deadline = absl::Now() + absl::Minutes(5);
    for (auto& h : hosts_) h->StartConnecting();
    for (auto& h : hosts_) {
      if (!h->Connect(deadline)) {
        std::fprintf(stderr, "a simulated host could not connect to the server\n");
        return 1;
      }
    }
    std::ofstream(absl::StrCat(dir_, "/ready-", index_)) << "ready\n";
    testing::WaitFor([&] { return !testing::ReadFileOrEmpty(dir_ + "/go").empty(); },
                     absl::Minutes(10));
    for (auto& h : hosts_) h->Join();
    SetProbe(0, absl::Now() + kProbeEvery);
    std::thread ticker([this] { Tick(); });
    size_t commands_done = 0;
    while (testing::ReadFileOrEmpty(dir_ + "/stop").empty()) {
      std::vector<std::string> commands = absl::StrSplit(
          testing::ReadFileOrEmpty(absl::StrCat(dir_, "/cmd-", index_)), '\n', absl::SkipEmpty());
      for (; commands_done < commands.size(); ++commands_done) Apply(commands[commands_done]);
      WriteStatus();
      absl::SleepFor(absl::Milliseconds(50));
    }
    stop_ = true;
    ticker.join();
    WriteStatus();
    WriteHosts();
    std::_Exit(0);  // the streams stay open: the server sees the process go
  }

  void RecordJoined(int round, int64_t at, int errors, const std::string& error) {
    absl::MutexLock lock(&mu_);
    Round& r = RoundLocked(round);
    r.joined++;
    r.joined_last_us = std::max(r.joined_last_us, at);
    r.join_errors += errors;
    if (r.first_join_error.empty()) r.first_join_error = error;
  }
  void RecordAborted(int round, int64_t at) {
    absl::MutexLock lock(&mu_);
    Round& r = RoundLocked(round);
    r.aborted++;
    r.aborted_last_us = std::max(r.aborted_last_us, at);
  }
  void RecordJoinRetry() { join_retries_++; }
  // A beat sent `late` after it was due (this process could not keep up):
  // the server sees that as silence it did not cause.
  void RecordLate(absl::Duration late) {
    const int64_t us = absl::ToInt64Microseconds(late);
    int64_t seen = max_late_us_.load(std::memory_order_relaxed);
    while (us > seen && !max_late_us_.compare_exchange_weak(seen, us)) {
    }
    if (late > absl::Seconds(1)) late_over_1s_++;
    // A beat more than timeout - interval late (2 s by default) is a silence
    // the server must take for a death: when, to compare with its log.
    if (late > absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms)) - Interval()) {
      int64_t expected = 0;
      first_too_late_us_.compare_exchange_strong(expected, NowUs());
    }
  }
  // An alarm every 100 ms on gRPC's callback path, timed when it runs: how
  // late this process handles what gRPC has for it. An answer handled late
  // sets its host's next beat late, which RecordLate cannot see (the beat is
  // then sent on time from the late answer). Two alarms in turn: one is set
  // from the other's callback.
  static constexpr absl::Duration kProbeEvery = absl::Milliseconds(100);
  void SetProbe(int which, absl::Time due) {
    probes_[which].Set(absl::ToChronoTime(due), [this, which, due](bool fired) {
      if (!fired || stop_) return;
      const absl::Time now = absl::Now();
      const int64_t us = absl::ToInt64Microseconds(now - due);
      int64_t seen = max_probe_late_us_.load(std::memory_order_relaxed);
      while (us > seen && !max_probe_late_us_.compare_exchange_weak(seen, us)) {
      }
      if (now - due > absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms)) - Interval()) {
        int64_t expected = 0;
        first_probe_too_late_us_.compare_exchange_strong(expected, NowUs());
      }
      SetProbe(1 - which, now + kProbeEvery);
    });
  }
  // A host's beats sent to their answer handled: the server's queues, the
  // connection and this process's callbacks. WriteStatus publishes the worst
  // of each second: the parent waits for a job whose answers come back
  // within half an interval before it sends a fault (the server caught up).
  void RecordRoundTrip(absl::Duration rtt) {
    const int64_t us = absl::ToInt64Microseconds(rtt);
    int64_t seen = window_rtt_us_.load(std::memory_order_relaxed);
    while (us > seen && !window_rtt_us_.compare_exchange_weak(seen, us)) {
    }
  }
  void RecordAnswers(int answers, int errors, const std::string& error) {
    answers_ += answers;
    errors_ += errors;
    if (errors > 0) {
      absl::MutexLock lock(&mu_);
      if (first_error_.empty()) first_error_ = error;
    }
  }

 private:
  Round& RoundLocked(int round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (static_cast<int>(rounds_.size()) <= round) rounds_.resize(round + 1);
    return rounds_[round];
  }

  // Every 10 ms, each host whose next beat is due beats: one interval after
  // the answer to its last, as a worker through a real agent does (a host's
  // first beat after a join is spread over an interval by its number).
  void Tick() {
    absl::Time next = absl::Now();
    while (!stop_) {
      const absl::Time now = absl::Now();
      for (const auto& h : hosts_) h->Tick(now);
      next += absl::Milliseconds(10);
      absl::SleepFor(next - absl::Now());
    }
  }

  void Apply(const std::string& command) {
    std::vector<std::string> words = absl::StrSplit(command, ' ');
    if (words.size() == 2 && words[0] == "mark" && absl::SimpleAtoi(words[1], &mark_us_)) {
      for (auto& h : hosts_) h->SetMark(mark_us_);
      return;
    }
    int host = 0, slot = 0;
    if (words.size() < 2 || !absl::SimpleAtoi(words[1], &host)) return;
    SimHost* h = hosts_.at(host - first_host_).get();
    if (words[0] == "silence-rank" && words.size() == 3 && absl::SimpleAtoi(words[2], &slot)) {
      h->SilenceRank(slot);
    } else if (words[0] == "silence-host") {
      h->SilenceHost();
    } else if (words[0] == "replace-host") {
      h->Join();  // a new agent on the host's replacement, its ranks restarted
    }
  }

  // Each host's first-generation lateness, one line each: host, latest beat
  // sent after due, slowest answer (us).
  void WriteHosts() {
    std::ofstream out(absl::StrCat(dir_, "/hosts-", index_));
    for (const auto& h : hosts_) {
      const auto [late, rtt] = h->FirstGenerationLateness();
      out << h->host() << " " << late << " " << rtt << "\n";
    }
  }

  void WriteStatus() {
    nlohmann::json status;
    status["answers"] = answers_.load();
    status["errors"] = errors_.load();
    status["join_retries"] = join_retries_.load();
    status["max_late_us"] = max_late_us_.load();
    status["late_over_1s"] = late_over_1s_.load();
    status["first_too_late_us"] = first_too_late_us_.load();
    status["max_probe_late_us"] = max_probe_late_us_.load();
    if (const absl::Time now = absl::Now(); now >= window_end_) {
      last_second_rtt_us_ = window_rtt_us_.exchange(0);
      window_end_ = now + absl::Seconds(1);
    }
    status["round_trip_last_second_us"] = last_second_rtt_us_;
    status["first_probe_too_late_us"] = first_probe_too_late_us_.load();
    // Since the mark (a leader killed): hosts whose first beat after it was
    // answered, and the latest such answer.
    int answered = 0;
    int64_t latest = 0;
    for (const auto& h : hosts_) {
      if (const int64_t at = h->AnsweredAfterMark(mark_us_); at > 0) {
        ++answered;
        latest = std::max(latest, at);
      }
    }
    status["mark_us"] = mark_us_;
    status["answered_after_mark"] = answered;
    status["answered_after_mark_latest_us"] = latest;
    {
      absl::MutexLock lock(&mu_);
      status["first_error"] = first_error_;
      for (const Round& r : rounds_) {
        status["rounds"].push_back({{"joined", r.joined},
                                    {"joined_last_us", r.joined_last_us},
                                    {"aborted", r.aborted},
                                    {"aborted_last_us", r.aborted_last_us},
                                    {"join_errors", r.join_errors},
                                    {"first_join_error", r.first_join_error}});
      }
    }
    const std::string path = absl::StrCat(dir_, "/status-", index_);
    std::ofstream(path + ".tmp") << status.dump();
    std::rename((path + ".tmp").c_str(), path.c_str());
  }

  const int index_;
  const std::string dir_;
  const int first_host_;
  std::vector<std::unique_ptr<SimHost>> hosts_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> answers_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<int64_t> join_retries_{0};
  std::atomic<int64_t> max_late_us_{0};
  std::atomic<int64_t> late_over_1s_{0};
  std::atomic<int64_t> first_too_late_us_{0};
  grpc::Alarm probes_[2];
  std::atomic<int64_t> window_rtt_us_{0};  // RecordRoundTrip, this second
  int64_t last_second_rtt_us_ = -1;        // the last whole second's worst (WriteStatus)
  absl::Time window_end_ = absl::InfinitePast();
  std::atomic<int64_t> max_probe_late_us_{0};
  std::atomic<int64_t> first_probe_too_late_us_{0};
  int64_t mark_us_ = 0;  // the command thread's (Apply, WriteStatus)
  absl::Mutex mu_;
  std::vector<Round> rounds_ ABSL_GUARDED_BY(mu_);
  std::string first_error_ ABSL_GUARDED_BY(mu_);
};

SimHost::SimHost(Child* child, int host, int ranks, std::shared_ptr<grpc::Channel> channel,
                 const std::string& telemetry)
    : child_(child), host_(host), ranks_(ranks), channel_(std::move(channel)) {
  stub_ = v1::HostAgent::NewStub(channel_);
  testing::FillTelemetry(telemetry, &template_);
  // No collective progress: a rank's peers never vouch for a silent rank
  // (failure_detector.h, rule 3), so a death is judged by the timeout alone,
  // as when a job's data plane stopped with the dead rank.
  template_.set_collective_seq(0);
}

bool SimHost::Connect(absl::Time deadline) {
  return channel_->WaitForConnected(absl::ToChronoTime(deadline));
}

void SimHost::Join() {
  v1::HostJoinRequest request;
  request.set_node(absl::StrCat("host", host_, " boot-sim"));
  for (int slot = 0; slot < ranks_; ++slot) {
    v1::JoinRequest* join = request.add_joins();
    join->set_job_id(kJob);
    join->set_world_size(absl::GetFlag(FLAGS_hosts) * ranks_);
    join->set_worker_id(WorkerId(host_, slot));
    join->set_host(absl::StrCat("10.", host_ / 250, ".", host_ % 250, ".1"));
    join->set_node(request.node());
    join->set_skip_member_table(true);
  }
  new JoinCall(stub_.get(), std::move(request),
               [this](std::vector<v1::HostJoinAnswer> answers, grpc::Status status) {
                 Joined(std::move(answers), status);
               });
}

void SimHost::Joined(std::vector<v1::HostJoinAnswer> answers, const grpc::Status& status) {
  const int64_t at = NowUs();
  int errors = 0;
  std::string error = status.ok() ? "" : status.error_message();
  std::vector<v1::MemberCredentials> members(ranks_);
  for (const v1::HostJoinAnswer& a : answers) {
    if (a.error_code() != 0) {
      ++errors;
      if (error.empty()) error = a.error_message();
      continue;
    }
    v1::MemberCredentials& m = members.at(a.index());
    m.set_job_id(kJob);
    m.set_generation(a.response().generation());
    m.set_rank(a.response().rank());
    m.set_token(a.response().token());
  }
  if (static_cast<int>(answers.size()) < ranks_ && errors == 0) {
    // The call broke (a connection the starved machine let time out): its
    // joins were withdrawn by the server; join again, as an agent's ranks do.
    child_->RecordJoinRetry();
    absl::MutexLock lock(&mu_);
    retry_join_at_ = absl::Now() + absl::Milliseconds(200);
    return;
  }
  int round = 0;
  {
    absl::MutexLock lock(&mu_);
    round = round_++;
    members_ = std::move(members);
    beating_ = errors == 0;
    silent_ = false;
    silent_slot_ = -1;
    request_built_ = false;
    next_beat_ = absl::Now() + Interval() * (host_ % 100) / 100;
  }
  child_->RecordJoined(round, at, errors, error);
}

void SimHost::Tick(absl::Time now) {
  BeatStream* stream = nullptr;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (retry_join_at_ < now) {
      retry_join_at_ = absl::InfiniteFuture();
      lock.Release();
      Join();
      return;
    }
    if (!beating_ || in_flight_ || silent_ || now < next_beat_) return;
    child_->RecordLate(now - next_beat_);
    in_flight_ = true;
    sent_at_ = now;
    if (round_ == 1) {
      first_late_us_ = std::max(first_late_us_, absl::ToInt64Microseconds(now - next_beat_));
    }
    if (stream_ == nullptr) {
      stream_ = new BeatStream(stub_.get(), this);
      request_built_ = false;  // a new stream: the members again
    }
    if (!request_built_) {
      request_.Clear();
      for (int slot = 0; slot < ranks_; ++slot) {
        if (slot == silent_slot_) continue;
        v1::RankBeat* beat = request_.add_beats();
        beat->set_local_stream(slot + 1);
        *beat->mutable_beat() = template_;
        *beat->mutable_beat()->mutable_member() = members_[slot];
      }
      request_built_ = true;
      request_carries_members_ = true;
    } else if (request_carries_members_ && absl::GetFlag(FLAGS_same_member)) {
      // Sent once on this stream: the server keeps the credentials, as for
      // shard_agent's beats (RankBeat.same_member).
      for (v1::RankBeat& beat : *request_.mutable_beats()) {
        beat.mutable_beat()->clear_member();
        beat.set_same_member(true);
      }
      request_carries_members_ = false;
    }
    stream = stream_;
  }
  // request_ is not touched until this round is done (in_flight_).
  stream->Send(&request_);
}

void BeatStream::Part(bool ok) {
  if (!ok) ok_ = false;
  if (pending_.fetch_sub(1) != 1) return;
  host_->RoundDone(this, ok_);
}

void SimHost::RoundDone(BeatStream* stream, bool ok) {
  if (!ok) {
    // The stream broke (the server died or cut it): the next beat opens a
    // new one.
    {
      absl::MutexLock lock(&mu_);
      in_flight_ = false;
      if (stream_ == stream) stream_ = nullptr;
      next_beat_ = absl::Now() + absl::Milliseconds(100);
    }
    stream->Release();
    return;
  }
  const v1::HostHeartbeatResponse& response = stream->response();
  int errors = 0, aborts = 0;
  std::string error;
  for (const v1::RankAnswer& a : response.answers()) {
    if (a.error_code() != 0) {
      ++errors;
      if (error.empty()) error = a.error_message();
    } else if (a.response().command() == v1::ABORT_GENERATION_CHANGED) {
      ++aborts;
    }
  }
  child_->RecordAnswers(response.answers_size(), errors, error);
  int round = 0;
  {
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
    const absl::Time now = absl::Now();
    child_->RecordRoundTrip(now - sent_at_);
    if (round_ == 1) {
      first_rtt_us_ = std::max(first_rtt_us_, absl::ToInt64Microseconds(now - sent_at_));
    }
    if (mark_us_ > 0 && answered_after_mark_us_ == 0 && errors == 0 &&
        absl::ToUnixMicros(sent_at_) > mark_us_) {
      answered_after_mark_us_ = absl::ToUnixMicros(now);
    }
    next_beat_ = now + Interval();
    if (aborts == 0) return;
    beating_ = false;  // as a worker does: stop beating, re-join
    round = round_ - 1;
  }
  child_->RecordAborted(round, NowUs());
  Join();
}

}  // namespace

// --------------------------------------------------------------- CPUs --

absl::StatusOr<cpu_set_t> ParseCpuList(const std::string& list) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    std::pair<std::string, std::string> range = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int first = 0;
    int last = 0;
    if (!absl::SimpleAtoi(range.first, &first) ||
        !absl::SimpleAtoi(range.second.empty() ? range.first : range.second, &last) || first < 0 ||
        last < first || last >= CPU_SETSIZE) {
      return absl::InvalidArgumentError(
          absl::StrCat("CPU list '", list, "': '", part, "' is not a CPU or a range like 0-3"));
    }
    for (int cpu = first; cpu <= last; ++cpu) CPU_SET(cpu, &set);
  }
  return set;
}

absl::Status PinProcess(pid_t pid, const std::string& list) {
  if (list.empty()) return absl::OkStatus();
  absl::StatusOr<cpu_set_t> set = ParseCpuList(list);
  if (!set.ok()) return set.status();
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(tasks, error)) {
    pid_t tid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &tid)) continue;
    if (sched_setaffinity(tid, sizeof(*set), &*set) != 0 && errno != ESRCH) {
      return absl::InternalError(
          absl::StrCat("sched_setaffinity(", tid, ", ", list, "): ", std::strerror(errno)));
    }
  }
  if (error) return absl::InternalError(absl::StrCat(tasks, ": ", error.message()));
  return absl::OkStatus();
}

int RunChild() {
  if (absl::Status pinned = PinProcess(getpid(), absl::GetFlag(FLAGS_simulator_cpus));
      !pinned.ok()) {
    std::fprintf(stderr, "scale_bench child: %s\n", pinned.ToString().c_str());
    return 2;
  }
  if (const int nice = absl::GetFlag(FLAGS_simulator_nice);
      nice != 0 && setpriority(PRIO_PROCESS, 0, nice) != 0) {
    std::fprintf(stderr, "scale_bench child: setpriority(%d): %s\n", nice, std::strerror(errno));
    return 2;
  }
  Child child(absl::GetFlag(FLAGS_child), absl::GetFlag(FLAGS_dir), absl::GetFlag(FLAGS_server),
              absl::GetFlag(FLAGS_first_host), absl::GetFlag(FLAGS_host_count),
              absl::GetFlag(FLAGS_ranks_per_host));
  return child.Run();
}

}  // namespace scale_bench
}  // namespace zeroshard
