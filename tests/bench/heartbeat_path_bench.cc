// The server's own work per heartbeat, without gRPC and without a client on
// the same cores: a job of W members beating once a second on a fake clock,
// driven through the components the server's timer drives (Membership's
// Heartbeat and Tick every 50 ms; twice a second the status pass that feeds
// the telemetry analyzer and the history store, as ShardServer::TickLoop
// does). Reports this thread's CPU time per heartbeat, split by part, for
// each W: what must not grow with the job (issue #31).
//
//   bazel run //tests/bench:heartbeat_path_bench -- [--members=4096,32768,131072]
//       [--seconds=5] [--json_out=FILE]
//
// control_plane_bench measures the same through real streams (gRPC
// included); on a shared 2-core machine its client starves the server, so
// this one isolates what the server's code costs.
#include <time.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/table.h"
#include "google/protobuf/arena.h"
#include "nlohmann/json.hpp"
#include "shard_server/base/clock.h"
#include "shard_server/base/event_log.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/history_store.h"
#include "shard_server/observability/telemetry_analyzer.h"
#include "tests/testing/bench_json.h"

ABSL_FLAG(std::string, members, "4096,32768,131072", "Job sizes, comma-separated");
ABSL_FLAG(int, seconds, 5, "Simulated seconds of 1-s heartbeats per size");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(bool, time_ledgers, true,
          "Ranks 0-7 carry their time ledger (RankTelemetry.time) in every beat, as workers send "
          "it (#45); false: no rank does");

namespace zeroshard {
namespace {

constexpr absl::Duration kTick = absl::Milliseconds(50);  // ShardServerOptions::tick
constexpr int kTicksPerAnalysis = 10;                     // TickLoop: every 500 ms

// This thread's CPU time in seconds.
double ThreadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// A ZeRO-3 rank's beat in the middle of training (as control_plane_bench's
// --telemetry=full).
v1::HeartbeatRequest Beat(const v1::JoinResponse& joined, const std::string& job) {
  v1::HeartbeatRequest r;
  v1::MemberCredentials* c = r.mutable_member();
  c->set_job_id(job);
  c->set_generation(joined.generation());
  c->set_rank(joined.rank());
  c->set_token(joined.token());
  r.set_loss(2.718281828);
  r.set_memory_bytes(int64_t{3} << 30);
  r.set_collective_seq(1234567);
  r.mutable_last_step()->set_step_ms(123.456);
  r.mutable_last_step()->set_items_per_second(81234.5);
  v1::RankTelemetry* t = r.mutable_telemetry();
  t->mutable_memory()->set_params(int64_t{1} << 30);
  t->mutable_memory()->set_optimizer_state(int64_t{2} << 30);
  t->set_bytes_moved(int64_t{123} << 30);
  t->set_gathers_entered(512345);
  t->set_reductions_entered(256789);
  t->set_arrival_lag_ms(3.5f);
  t->set_arrival_lag_median_ms(2.25f);
  t->mutable_in_progress()->set_op(v1::ALL_GATHER);
  t->mutable_in_progress()->set_unit("transformer.h.17");
  t->mutable_in_progress()->set_seq(512345);
  return r;
}

struct Costs {
  double beat_us = 0;      // in Membership::Heartbeat, per beat
  double tick_us = 0;      // Membership::Tick, per beat
  double analysis_us = 0;  // status pass + analyzer + history, per beat
  double total_us() const { return beat_us + tick_us + analysis_us; }
};

Costs Measure(int members, int seconds) {
  FakeClock clock;
  EventLog log([](const std::string&) {});
  MembershipOptions options;
  options.max_world_size = std::max(options.max_world_size, members);
  options.heartbeat_timeout = absl::Seconds(3);
  Membership membership(&clock, &log, nullptr, options);
  TelemetryAnalyzer analyzer(&clock, &log, {});
  std::unique_ptr<HistoryStore> history = *HistoryStore::Open(":memory:");

  const std::string job = "bench";
  std::vector<v1::JoinResponse> joined(members);
  for (int i = 0; i < members; ++i) {
    v1::JoinRequest r;
    r.set_job_id(job);
    r.set_world_size(members);
    r.set_worker_id(absl::StrFormat("node%06d/%d", i / 8, i % 8));
    r.set_host(absl::StrFormat("node%06d", i / 8));
    r.set_skip_member_table(true);
    membership.Join(r, clock.Now() + absl::Hours(1),
                    [&joined, i](absl::StatusOr<v1::JoinResponse> j) { joined[i] = *j; });
  }
  std::vector<v1::HeartbeatRequest> beats;
  beats.reserve(members);
  for (const v1::JoinResponse& j : joined) beats.push_back(Beat(j, job));

  Costs c;
  const int ticks_per_second = static_cast<int>(absl::Seconds(1) / kTick);
  int64_t beats_sent = 0;
  for (int s = 0; s < seconds; ++s) {
    for (int tick = 0; tick < ticks_per_second; ++tick) {
      // The members whose beat falls in this tick's 50 ms.
      const int from = members * tick / ticks_per_second;
      const int to = members * (tick + 1) / ticks_per_second;
      double t0 = ThreadCpuSeconds();
      for (int i = from; i < to; ++i) {
        beats[i].set_step(s + 1);
        // In a collective since just now, as ranks of a healthy job are.
        beats[i].mutable_telemetry()->mutable_in_progress()->set_started_unix_ms(
            absl::ToUnixMillis(clock.Now()));
        if (i < 8 && absl::GetFlag(FLAGS_time_ledgers)) {
          // Cumulative, growing: each one is kept as the generation's highest.
          v1::TimeLedger* time = beats[i].mutable_telemetry()->mutable_time();
          time->set_startup(1.5);
          time->set_productive(s + 0.05 * tick);
          time->set_data_wait(0.01 * s);
          time->set_model_flops(1e15 * s);
          time->set_peak_flop_budget(3e15 * s);
          time->set_peak_flops(1e12);
          time->set_flops_per_item(6e8);
        }
        if (!membership.Heartbeat(beats[i]).ok()) std::abort();
      }
      beats_sent += to - from;
      clock.Advance(kTick);
      double t1 = ThreadCpuSeconds();
      membership.Tick();
      double t2 = ThreadCpuSeconds();
      c.beat_us += (t1 - t0) * 1e6;
      c.tick_us += (t2 - t1) * 1e6;
      if ((tick + 1) % kTicksPerAnalysis == 0) {
        google::protobuf::Arena arena;
        auto* status = google::protobuf::Arena::CreateMessage<v1::GetStatusResponse>(&arena);
        membership.FillStatus("", status);
        analyzer.Analyze(*status);
        if (!history->Record(*status, clock.Now()).ok()) std::abort();
        c.analysis_us += (ThreadCpuSeconds() - t2) * 1e6;
      }
    }
  }
  if (membership.Status(job).jobs(0).state() != v1::RUNNING) std::abort();  // nobody died
  c.beat_us /= beats_sent;
  c.tick_us /= beats_sent;
  c.analysis_us /= beats_sent;
  return c;
}

int Main() {
  nlohmann::ordered_json result;
  Table table({"MEMBERS", "HEARTBEAT", "TICK", "STATUS+ANALYSIS+HISTORY", "TOTAL PER BEAT"});
  for (absl::string_view size : absl::StrSplit(absl::GetFlag(FLAGS_members), ',')) {
    int members = 0;
    if (!absl::SimpleAtoi(size, &members) || members <= 0) {
      std::fprintf(stderr, "--members: '%s' is not a positive count\n", std::string(size).c_str());
      return 2;
    }
    const Costs c = Measure(members, absl::GetFlag(FLAGS_seconds));
    result["members"][absl::StrCat(members)] = {{"heartbeat_us", c.beat_us},
                                                {"tick_us", c.tick_us},
                                                {"analysis_us", c.analysis_us},
                                                {"total_us", c.total_us()}};
    table.AddRow({absl::StrCat(members), absl::StrFormat("%.2f us", c.beat_us),
                  absl::StrFormat("%.2f us", c.tick_us), absl::StrFormat("%.2f us", c.analysis_us),
                  absl::StrFormat("%.2f us", c.total_us())});
  }
  std::printf("server CPU per heartbeat at 1-s heartbeats (this thread, no gRPC):\n%s",
              table.ToString().c_str());
  return WriteBenchJson(result, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
