// Control-plane benchmark: simulated workers (async gRPC clients in this
// process) against a real shard_server process on loopback.
//
//   bazel run //tests/bench:control_plane_bench -- [--json_out=FILE]
//
// Measures: the time until N concurrent joins are all answered (N = 1024,
// 4096); the heartbeat rate the server sustains with 4096 members each on its
// own stream, beating as fast as they can; the time from a member's last
// heartbeat to the server marking it dead; the time to serve /metrics for a
// job of 4096 ranks.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/rank_rows.h"
#include "common/table.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/control_plane_sim.h"
#include "tests/testing/process.h"
#include "tests/testing/simulated_members.h"

ABSL_FLAG(std::string, server_binary, "", "shard_server binary (default: from runfiles)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(int, members, 4096, "Members for the heartbeat-rate run");
ABSL_FLAG(double, heartbeat_seconds, 5.0, "Length of the heartbeat-rate measurement");
ABSL_FLAG(int, ranks_per_host, 8,
          "Simulated members per host name (the host summaries of GetStatus and /metrics)");
ABSL_FLAG(int, channels, 16, "Client connections the simulated members share");
ABSL_FLAG(int, client_queues, 16,
          "Completion queues (one thread each) the simulated members' streams are spread over");
ABSL_FLAG(std::string, server_flags, "",
          "Extra shard_server flags for the heartbeat-rate run, comma-separated "
          "(e.g. --heartbeat_queues=4)");
ABSL_FLAG(bool, metrics, true, "Time GET /metrics (off: for a server without --metrics_listen)");
ABSL_FLAG(bool, joins, true, "Measure the join barriers (off: heartbeats, /metrics, detection)");
ABSL_FLAG(std::string, telemetry, "full",
          "What beats carry besides the member's credentials: full (a training rank's telemetry, "
          "as shard_worker sends it), step (the step fields that predate RankTelemetry: for a "
          "before/after comparison against an older server) or none");

namespace zeroshard {
namespace {

using testing::ChildProcess;
using testing::CpuSeconds;
using testing::Credentials;
using testing::JoinAll;
using testing::Joined;
using testing::MakeStubs;
using testing::RssBytes;
using Server = testing::ServerProcess;

Server StartServer(const std::string& binary, const std::vector<std::string>& extra) {
  return testing::StartServerProcess(binary, extra);
}



// A training rank's beat (tests/testing/simulated_members.h), as --telemetry says.
void FillTelemetry(v1::HeartbeatRequest* request) {
  testing::FillTelemetry(absl::GetFlag(FLAGS_telemetry), request);
}

// One member's heartbeat stream, beating back to back: the next beat is
// written once the previous beat's write and reply have both completed. On
// gRPC's async API over the bench's client queues (ClientQueues): with the
// callback API every stream's pending read would sit in one process-wide
// queue, whose cost per event grows with the streams in Debian's libgrpc
// (shard_server/heartbeat_streams.h), and the client, not the server, would
// set the rate.
class Beater {
 public:
  // What a queue event names: the beater and which of its operations completed.
  enum class Step { kStarted, kWritten, kRead, kWritesDone, kFinished };
  struct Tag {
    Beater* beater;
    Step step;
  };

  Beater(v1::Coordinator::Stub* stub, grpc::CompletionQueue* queue,
         const v1::MemberCredentials& member, std::atomic<bool>* stop,
         std::atomic<int64_t>* replies, absl::BlockingCounter* finished)
      : stop_(stop), replies_(replies), finished_(finished) {
    *request_.mutable_member() = member;
    FillTelemetry(&request_);
    stream_ = stub->PrepareAsyncHeartbeat(&context_, queue);
    stream_->StartCall(&started_);
  }
  // Runs on the beater's queue thread, one event at a time.
  void Proceed(Step step, bool ok) {
    switch (step) {
      case Step::kStarted:
        if (!ok) return Fail();
        return Round();
      case Step::kWritten:
        return HalfDone(ok);
      case Step::kRead:
        if (ok) {
          if (response_.command() != v1::CONTINUE) bad_commands_++;
          replies_->fetch_add(1, std::memory_order_relaxed);
        }
        return HalfDone(ok);
      case Step::kWritesDone:
        return stream_->Finish(&status_, &finished_tag_);
      case Step::kFinished:
        finished_->DecrementCount();
        return;
    }
  }
  int bad_commands() const { return bad_commands_; }
  const grpc::Status& status() const { return status_; }

 private:
  void Round() {
    pending_ = 2;
    request_.set_step(request_.step() + 1);
    stream_->Write(request_, &written_);
    stream_->Read(&response_, &read_);
  }
  void HalfDone(bool ok) {
    failed_ |= !ok;
    if (--pending_ != 0) return;  // the other half of the round is still out
    if (failed_) return Fail();
    if (stop_->load()) return stream_->WritesDone(&writes_done_);
    Round();
  }
  void Fail() { stream_->Finish(&status_, &finished_tag_); }

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>>
      stream_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  int pending_ = 0;
  bool failed_ = false;
  int bad_commands_ = 0;
  std::atomic<bool>* stop_;
  std::atomic<int64_t>* replies_;
  absl::BlockingCounter* finished_;
  grpc::Status status_;
  Tag started_{this, Step::kStarted};
  Tag written_{this, Step::kWritten};
  Tag read_{this, Step::kRead};
  Tag writes_done_{this, Step::kWritesDone};
  Tag finished_tag_{this, Step::kFinished};
};

// The client's completion queues, one polling thread each.
class ClientQueues {
 public:
  explicit ClientQueues(int count) {
    for (int i = 0; i < count; ++i) queues_.push_back(std::make_unique<grpc::CompletionQueue>());
    for (auto& queue : queues_) {
      threads_.emplace_back([q = queue.get()] {
        void* tag = nullptr;
        bool ok = false;
        while (q->Next(&tag, &ok)) {
          auto* event = static_cast<Beater::Tag*>(tag);
          event->beater->Proceed(event->step, ok);
        }
      });
    }
  }
  // REQUIRES: every beater on the queues finished.
  ~ClientQueues() {
    for (auto& queue : queues_) queue->Shutdown();
    for (std::thread& thread : threads_) thread.join();
  }
  grpc::CompletionQueue* queue(int i) { return queues_[i % queues_.size()].get(); }

 private:
  std::vector<std::unique_ptr<grpc::CompletionQueue>> queues_;
  std::vector<std::thread> threads_;
};


double HeartbeatRate(std::vector<std::unique_ptr<v1::Coordinator::Stub>>& stubs,
                     const std::string& job, const Joined& joined, double seconds,
                     pid_t server = -1, double* server_cpu_us_per_beat = nullptr) {
  int members = static_cast<int>(joined.responses.size());
  std::atomic<bool> stop{false};
  std::atomic<int64_t> replies{0};
  absl::BlockingCounter finished(members);
  ClientQueues queues(absl::GetFlag(FLAGS_client_queues));
  std::vector<std::unique_ptr<Beater>> beaters;
  for (int i = 0; i < members; ++i) {
    beaters.push_back(std::make_unique<Beater>(stubs[i % stubs.size()].get(), queues.queue(i),
                                               Credentials(job, joined.responses[i]), &stop,
                                               &replies, &finished));
  }
  absl::SleepFor(absl::Seconds(1));  // warm-up: every stream open and beating
  int64_t start_count = replies.load();
  absl::Time start = absl::Now();
  const double cpu_start = server > 0 ? CpuSeconds(server) : -1;
  absl::SleepFor(absl::Seconds(seconds));
  int64_t end_count = replies.load();
  const double cpu_end = server > 0 ? CpuSeconds(server) : -1;
  if (server_cpu_us_per_beat != nullptr) {
    *server_cpu_us_per_beat = cpu_start < 0 || cpu_end < 0 || end_count == start_count
                                  ? -1
                                  : (cpu_end - cpu_start) * 1e6 / (end_count - start_count);
  }
  double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  stop = true;
  finished.Wait();
  int bad = 0, broken = 0;
  std::string first_broken;
  for (auto& b : beaters) {
    bad += b->bad_commands();
    broken += !b->status().ok();
    if (!b->status().ok() && first_broken.empty()) {
      first_broken = absl::StrCat(b->status().error_code(), " ", b->status().error_message());
    }
  }
  if (bad > 0 || broken > 0) {
    std::fprintf(stderr, "heartbeat run: %d non-CONTINUE replies, %d broken streams (%s)\n", bad,
                 broken, first_broken.c_str());
  }
  return (end_count - start_count) / elapsed;
}

// GetStatus of one job of W ranks: the response's size, its JSON (--json)
// size and the RPC's time, medians of 5. `view`: every member (max_members
// 0, `shardctl status --all`) or shardctl's summary (its worst ranks, hosts
// and histograms; rank_rows.h).
struct StatusCost {
  int64_t bytes = 0;
  int64_t json_bytes = 0;
  double rpc_seconds = -1;
};
StatusCost MeasureStatus(v1::Coordinator::Stub* stub, const v1::GetStatusRequest& view) {
  StatusCost cost;
  std::vector<double> rpc;
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::GetStatusResponse response;
    absl::Time start = absl::Now();
    grpc::Status s = stub->GetStatus(&context, view, &response);
    rpc.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    if (!s.ok() || response.jobs().empty()) {
      std::fprintf(stderr, "GetStatus failed: %s\n", s.error_message().c_str());
      return cost;
    }
    cost.bytes = response.ByteSizeLong();
    if (i == 0) {
      std::string json;
      (void)google::protobuf::util::MessageToJsonString(response, &json);
      cost.json_bytes = json.size();
    }
  }
  std::sort(rpc.begin(), rpc.end());
  cost.rpc_seconds = rpc[rpc.size() / 2];
  return cost;
}

// A 2-member job; member 1 stops beating; time from its last acknowledged
// beat until GetStatus shows it dead.
double DetectionSeconds(const std::string& address, int interval_ms) {
  auto stubs = MakeStubs(address, 1);
  Joined joined = JoinAll(stubs, "detect", 2);
  if (joined.failures > 0) return -1;
  auto beat = [&](int rank) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    auto stream = stubs[0]->Heartbeat(&context);
    v1::HeartbeatRequest request;
    *request.mutable_member() = Credentials("detect", joined.responses[rank]);
    v1::HeartbeatResponse response;
    stream->Write(request);
    stream->Read(&response);
    stream->WritesDone();
    stream->Finish();
  };
  int victim = joined.responses[0].rank() == 1 ? 0 : 1;
  int survivor = 1 - victim;
  for (int i = 0; i < 5; ++i) {
    beat(victim);
    beat(survivor);
    absl::SleepFor(absl::Milliseconds(interval_ms));
  }
  beat(victim);
  absl::Time last = absl::Now();  // after the reply: the server saw it before now
  absl::Time survivor_beat = last;
  while (absl::Now() - last < absl::Seconds(30)) {
    // The survivor keeps beating: were both silent, the server would suspect
    // its own network (--isolation_grace) rather than declare a death.
    if (absl::Now() - survivor_beat >= absl::Milliseconds(interval_ms)) {
      beat(survivor);
      survivor_beat = absl::Now();
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::GetStatusRequest request;
    request.set_job_id("detect");
    v1::GetStatusResponse response;
    if (stubs[0]->GetStatus(&context, request, &response).ok() &&
        !response.jobs(0).members(joined.responses[victim].rank()).alive()) {
      return absl::ToDoubleSeconds(absl::Now() - last);
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  return -1;
}

int Main() {
  std::string binary = absl::GetFlag(FLAGS_server_binary);
  // `bazel run`, or the binary started by hand: its runfiles have the server.
  if (binary.empty()) binary = testing::RunfilePath("shard_server/shard_server");
  nlohmann::ordered_json result;
  Table table({"MEASURE", "VALUE", "TARGET"});
  {
    std::vector<std::string> server_flags = {"--heartbeat_timeout_ms=600000",
                                             "--max_world_size=131072"};
    for (absl::string_view flag :
         absl::StrSplit(absl::GetFlag(FLAGS_server_flags), ',', absl::SkipEmpty())) {
      server_flags.emplace_back(flag);
    }
    Server server = StartServer(binary, server_flags);
    auto stubs = MakeStubs(server.address, absl::GetFlag(FLAGS_channels));
    for (int n : {1024, 4096}) {
      if (!absl::GetFlag(FLAGS_joins)) break;
      Joined joined = JoinAll(stubs, absl::StrCat("join-", n), n);
      result["join_seconds"][absl::StrCat(n)] = joined.seconds;
      table.AddRow({absl::StrCat(n, " joins answered"), absl::StrFormat("%.3f s", joined.seconds),
                    n == 4096 ? "< 2 s" : ""});
      if (joined.failures > 0)
        table.AddRow({"  join failures", absl::StrCat(joined.failures), "0"});
    }
    // With the member table in every response: W² entries on the wire.
    for (int n : {1024, 4096}) {
      if (!absl::GetFlag(FLAGS_joins)) break;
      Joined joined = JoinAll(stubs, absl::StrCat("join-table-", n), n, /*member_table=*/true);
      result["join_with_member_table_seconds"][absl::StrCat(n)] = joined.seconds;
      table.AddRow({absl::StrCat(n, " joins, full member tables"),
                    absl::StrFormat("%.3f s", joined.seconds), ""});
    }
    int members = absl::GetFlag(FLAGS_members);
    const int64_t rss_before = RssBytes(server.process->pid());
    Joined hb = JoinAll(stubs, "heartbeats", members, /*member_table=*/false,
                        absl::GetFlag(FLAGS_ranks_per_host));
    double cpu_us = -1;
    double rate = HeartbeatRate(stubs, "heartbeats", hb, absl::GetFlag(FLAGS_heartbeat_seconds),
                                server.process->pid(), &cpu_us);
    result["server_cpu_us_per_heartbeat"] = cpu_us;
    // What the members cost the server while they beat (streams, member
    // state, telemetry): the growth of its RSS over the run, per member.
    const int64_t rss_after = RssBytes(server.process->pid());
    result["server_rss_bytes"] = rss_after;
    result["server_rss_bytes_per_member"] =
        rss_before < 0 || rss_after < 0 ? -1.0 : double(rss_after - rss_before) / members;
    result["heartbeats_per_second"] = rate;
    v1::HeartbeatRequest sample;
    *sample.mutable_member() = Credentials("heartbeats", hb.responses[0]);
    FillTelemetry(&sample);
    result["heartbeat_bytes"] = sample.ByteSizeLong();
    table.AddRow({"heartbeat message", absl::StrCat(sample.ByteSizeLong(), " bytes"), ""});
    table.AddRow({absl::StrCat("heartbeats/s, ", members, " streams"),
                  absl::StrFormat("%.0f", rate), ">= 25000"});
    table.AddRow({"server CPU per heartbeat", absl::StrFormat("%.1f us", cpu_us), ""});
    table.AddRow({absl::StrCat("server RSS, ", members, " members beating"),
                  absl::StrFormat("%.1f MiB (%.1f KiB per member)", rss_after / 1048576.0,
                                  double(rss_after - rss_before) / members / 1024),
                  ""});
    for (const bool all : {true, false}) {
      const StatusCost status = MeasureStatus(
          stubs[0].get(), StatusRequest("heartbeats", /*rank=*/-1, /*host=*/"", all));
      const char* key = all ? "get_status" : "get_status_summary";
      result[absl::StrCat(key, "_bytes")] = status.bytes;
      result[absl::StrCat(key, "_json_bytes")] = status.json_bytes;
      result[absl::StrCat(key, "_seconds")] = status.rpc_seconds;
      table.AddRow({absl::StrCat(all ? "GetStatus, every one of " : "GetStatus summary of ",
                                 members, " ranks"),
                    absl::StrFormat("%.1f ms, %.3f MB (JSON %.3f MB)", status.rpc_seconds * 1e3,
                                    status.bytes / 1e6, status.json_bytes / 1e6),
                    ""});
    }
    server.process->Signal(SIGTERM);
    server.process->Wait(absl::Seconds(10));
  }
  if (absl::GetFlag(FLAGS_metrics)) {
    // /metrics of one job of `members` ranks, every rank with full
    // telemetry: the time curl measures for the whole response (median of 9).
    std::string dir = testing::MakeTempDir("cpbench-metrics");
    testing::RemovedAtExit dir_owner(dir);
    Server server =
        StartServer(binary, {"--heartbeat_timeout_ms=600000", "--max_world_size=131072",
                             "--metrics_listen=127.0.0.1:0",
                             "--metrics_port_file=" + dir + "/mport"});
    std::string mport;
    testing::WaitFor(
        [&] {
          mport = testing::ReadFileOrEmpty(dir + "/mport");
          return !mport.empty() && mport.back() == '\n';
        },
        absl::Seconds(10));
    auto stubs = MakeStubs(server.address, absl::GetFlag(FLAGS_channels));
    int members = absl::GetFlag(FLAGS_members);
    Joined joined = JoinAll(stubs, "metrics", members, /*member_table=*/false,
                            absl::GetFlag(FLAGS_ranks_per_host));
    HeartbeatRate(stubs, "metrics", joined, 1.0);  // every member has beaten
    std::vector<double> times;
    int64_t bytes = 0;
    for (int i = 0; i < 9; ++i) {
      auto [code, out] = testing::RunCommand(
          absl::StrCat("curl -s -o ", dir, "/metrics.txt -w '%{time_total} %{size_download}' ",
                       "http://127.0.0.1:", absl::StripAsciiWhitespace(mport), "/metrics"));
      double seconds = 0;
      std::vector<std::string> parts = absl::StrSplit(out, ' ');
      if (code != 0 || parts.size() != 2 || !absl::SimpleAtod(parts[0], &seconds)) {
        std::fprintf(stderr, "GET /metrics failed: %s\n", out.c_str());
        break;
      }
      absl::SimpleAtoi(parts[1], &bytes);
      times.push_back(seconds);
    }
    std::sort(times.begin(), times.end());
    double median = times.empty() ? -1 : times[times.size() / 2];
    result["metrics_seconds"] = median;
    result["metrics_bytes"] = bytes;
    table.AddRow({absl::StrCat("GET /metrics, ", members, " ranks (", bytes / 1000000.0, " MB)"),
                  absl::StrFormat("%.1f ms", median * 1e3), "< 200 ms"});
    server.process->Signal(SIGTERM);
    server.process->Wait(absl::Seconds(10));
  }
  {
    constexpr int kTimeoutMs = 1000;
    Server server = StartServer(binary, {absl::StrCat("--heartbeat_timeout_ms=", kTimeoutMs),
                                         "--heartbeat_interval_ms=100"});
    double detection = DetectionSeconds(server.address, 100);
    result["detection_seconds"] = detection;
    result["heartbeat_timeout_seconds"] = kTimeoutMs / 1000.0;
    table.AddRow(
        {"failure detection (timeout 1 s)", absl::StrFormat("%.3f s", detection), "<= 1.5 s"});
    server.process->Signal(SIGTERM);
    server.process->Wait(absl::Seconds(10));
  }
  std::printf("%s", table.ToString().c_str());
  return WriteBenchJson(result, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
