// Soak: a shard_server under a flood of what an attacker (or a broken
// launcher) sends — one-member jobs that never beat, joins that never
// complete, StoreWaits for thousands of keys, consolidations whose reader
// stops — while a real training job runs, job after job, on the same server.
// Reports the server's memory over time against a stated bound, what the
// server refused, and whether every training run succeeded.
//
//   bazel run -c opt //tests/bench:soak_bench -- [--seconds=60] [--json_out=FILE]
//
// --mode=isolation (#29 item 3): four training jobs (2 workers each) train
// first alone, then while one flooding tenant fills every bounded resource —
// KV waits of many keys, KV values, checkpoint uploads, joins — for
// --seconds. Reports, per job, the median step time alone and under the
// flood, the largest heartbeat age the server saw (a missed heartbeat: an age
// above 1.5 intervals, see kBeatSlack), and whether the job's generation
// changed; the server's own time to answer beats (its /metrics); and the
// server's peak RSS against its bound. The KV and upload bounds are 64 MiB per
// job and 256 MiB in all (--kv_max_*, --checkpoint_upload_max_*).
//
//   bazel run -c opt //tests/bench:soak_bench -- --mode=isolation --seconds=120
//
// The server runs with small bounds so that a minute reaches them:
// --max_jobs=2000, --job_ttl=10s, --kv_max_total_bytes=64 MiB,
// --consolidate_stall_timeout_s=5 (defaults: 10,000, 24 h, 1 GiB, 60 s).
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
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/table.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

ABSL_FLAG(int, seconds, 60, "Length of the flood");
ABSL_FLAG(int, rss_bound_mib, 512,
          "The server's peak resident memory must stay under this: the KV store's 64 MiB, the "
          "requests in flight (16 waits of ~6 MB, parsed and copied) and what the allocator keeps");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(int, wait_threads, 16, "StoreWaits in flight at once");
ABSL_FLAG(int, wait_keys, 50000, "Keys per StoreWait");
ABSL_FLAG(std::string, mode, "flood",
          "flood: jobs after jobs under a flood; isolation: four jobs alone, then under a flood");
ABSL_FLAG(int, upload_threads, 6,
          "isolation: checkpoint uploads of 16 MiB in flight at once (the job's bound: 64 MiB)");
ABSL_FLAG(int, step_delay_ms, 20,
          "isolation: each training step sleeps this long first, so that eight workers leave "
          "the CPUs room for the server and the flood");

namespace zeroshard {
namespace {

std::unique_ptr<v1::Coordinator::Stub> Stub(const std::string& address, int channel) {
  grpc::ChannelArguments args;
  args.SetInt("zeroshard.soak.channel", channel);  // its own connection
  args.SetMaxReceiveMessageSize(64 << 20);
  return v1::Coordinator::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

void Deadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

struct Counts {
  explicit Counts(const char* what) : what(what) {}
  const char* what;
  std::atomic<int64_t> ok{0};
  std::atomic<int64_t> refused{0};  // RESOURCE_EXHAUSTED: a bound held
  std::atomic<int64_t> other{0};    // any other error
  void Count(const grpc::Status& s) {
    if (s.ok()) {
      ++ok;
    } else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      if (refused++ == 0)
        std::fprintf(stderr, "soak: %s: first refusal: %s\n", what, s.error_message().c_str());
    } else if (other++ == 0) {
      std::fprintf(stderr, "soak: %s: first error: %s\n", what, s.error_message().c_str());
    }
  }
};

int Main() {
  const absl::Duration flood = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  testing::LocalCluster cluster(
      testing::MakeTempDir("soak"),
      {"--max_jobs=2000", "--job_ttl=10s", absl::StrCat("--kv_max_total_bytes=", 64 << 20),
       "--consolidate_stall_timeout_s=5"});
  if (!cluster.ok()) return 1;
  const pid_t server_pid = cluster.server()->pid();
  const std::string address = cluster.address();
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;

  // One-member jobs that never beat (declared dead, then forgotten), and
  // joins of four-member jobs that never complete (forgotten when they expire).
  Counts jobs("one-member jobs"), squats("never-completing joins");
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      auto stub = Stub(address, 100 + t);
      for (int64_t i = 0; !stop; ++i) {
        grpc::ClientContext context;
        v1::JoinRequest request;
        const bool squat = i % 4 == 3;
        Deadline(&context, squat ? absl::Seconds(1) : absl::Seconds(5));
        request.set_job_id(absl::StrCat(squat ? "squat-" : "flood-", t, "-", i));
        request.set_world_size(squat ? 4 : 1);
        request.set_worker_id("w0");
        request.set_host("127.0.0.1");
        request.set_skip_member_table(true);
        v1::JoinResponse response;
        grpc::Status s = stub->Join(&context, request, &response);
        if (squat && s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          ++squats.ok;  // held until it expired, as expected
        } else if (squat) {
          squats.Count(s);
        } else {
          jobs.Count(s);
        }
      }
    });
  }

  // StoreWaits of 50,000 keys of 95 bytes (~6 MB each, 16 at a time: more
  // than --kv_max_total_bytes) for keys nobody sets.
  Counts waits("store waits");
  ClientOptions kv_options;
  kv_options.server = address;
  auto kv_member = Client::Connect(kv_options);
  if (!kv_member.ok() ||
      !(*kv_member)->Join("flood-kv", 1, "w0", "127.0.0.1", absl::Seconds(20)).ok()) {
    std::fprintf(stderr, "soak: the KV member could not join\n");
    return 1;
  }
  (*kv_member)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});
  const v1::MemberCredentials kv_credentials = (*kv_member)->credentials();
  for (int t = 0; t < absl::GetFlag(FLAGS_wait_threads); ++t) {
    threads.emplace_back([&, t] {
      auto stub = Stub(address, 200 + t);
      v1::StoreWaitRequest request;
      *request.mutable_member() = kv_credentials;
      request.set_timeout_ms(3000);
      for (int k = 0; k < absl::GetFlag(FLAGS_wait_keys); ++k) {
        request.add_keys(absl::StrFormat("%s-%06d-%06d", std::string(80, 'k'), t, k));
      }
      while (!stop) {
        grpc::ClientContext context;
        Deadline(&context, absl::Seconds(10));
        v1::StoreWaitResponse response;
        grpc::Status s = stub->StoreWait(&context, request, &response);
        // Held to its deadline is what a wait for keys nobody sets does.
        if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          ++waits.ok;
        } else {
          waits.Count(s);
        }
      }
    });
  }

  // Consolidations whose reader takes the first message and stops: each
  // holds a slot until the server's stall timeout cancels it.
  Counts abandoned("abandoned consolidations");
  std::atomic<bool> checkpointed{false};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto stub = Stub(address, 300 + t);
      while (!stop) {
        if (!checkpointed) {
          absl::SleepFor(absl::Milliseconds(200));
          continue;
        }
        grpc::ClientContext context;
        Deadline(&context, absl::Seconds(30));
        v1::ConsolidateRequest request;
        request.set_job_id("train-0");
        request.set_step(-1);
        auto reader = stub->Consolidate(&context, request);
        v1::ConsolidateResponse first;
        if (reader->Read(&first)) {
          ++abandoned.ok;
          // Read nothing more until the server gives up on this reader.
          const absl::Time until = absl::Now() + absl::Seconds(8);
          while (!stop && absl::Now() < until) absl::SleepFor(absl::Milliseconds(100));
          context.TryCancel();
          while (reader->Read(&first)) {
          }
          reader->Finish().IgnoreError();
        } else {
          abandoned.Count(reader->Finish());
        }
      }
    });
  }

  // Memory, sampled four times a second.
  const int64_t rss_start = testing::ProcStatusBytes(server_pid, "VmRSS");
  int64_t rss_max = rss_start;  // the sampler's until it is joined
  std::thread sampler([&] {
    while (!stop) {
      rss_max = std::max(rss_max, testing::ProcStatusBytes(server_pid, "VmRSS"));
      absl::SleepFor(absl::Milliseconds(250));
    }
  });

  // The real job: two workers train an MLP with ZeRO-3 and checkpoint, run
  // after run, for as long as the flood lasts.
  const absl::Time start = absl::Now();
  int runs_ok = 0, runs_failed = 0;
  for (int run = 0; absl::Now() - start < flood; ++run) {
    const std::string job = absl::StrCat("train-", run);
    const bool ok =
        cluster.Run(job, 2,
                    {"--model=mlp", "--layers=4", "--width=256", "--stage=3", "--steps=40",
                     "--batch=16", "--checkpoint_every=20", "--checkpoint_transport=grpc"},
                    absl::Seconds(120));
    (ok ? runs_ok : runs_failed)++;
    if (ok) checkpointed = true;
    std::fprintf(stderr, "soak: %.0f s, training run %d %s, server RSS %.1f MiB\n",
                 absl::ToDoubleSeconds(absl::Now() - start), run, ok ? "ok" : "FAILED",
                 testing::ProcStatusBytes(server_pid, "VmRSS") / 1048576.0);
  }
  stop = true;
  for (auto& t : threads) t.join();
  sampler.join();
  (*kv_member)->StopHeartbeats();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t rss_end = testing::ProcStatusBytes(server_pid, "VmRSS");
  const int64_t hwm = testing::ProcStatusBytes(server_pid, "VmHWM");
  const int64_t bound = int64_t{absl::GetFlag(FLAGS_rss_bound_mib)} << 20;
  const bool held = hwm >= 0 && hwm < bound && runs_failed == 0 && runs_ok > 0;

  auto mib = [](int64_t b) { return absl::StrFormat("%.1f MiB", b / 1048576.0); };
  Table table({"MEASURE", "VALUE"});
  table.AddRow({"flood length", absl::StrFormat("%.0f s", seconds)});
  table.AddRow({"one-member jobs joined / refused (--max_jobs)",
                absl::StrCat(jobs.ok.load(), " / ", jobs.refused.load())});
  table.AddRow({"never-completing joins held / refused",
                absl::StrCat(squats.ok.load(), " / ", squats.refused.load())});
  table.AddRow({"50,000-key StoreWaits held / refused (--kv_max_total_bytes)",
                absl::StrCat(waits.ok.load(), " / ", waits.refused.load())});
  table.AddRow({"abandoned consolidations / refused (slots)",
                absl::StrCat(abandoned.ok.load(), " / ", abandoned.refused.load())});
  table.AddRow(
      {"other errors", absl::StrCat(jobs.other + squats.other + waits.other + abandoned.other)});
  table.AddRow({"training runs ok / failed", absl::StrCat(runs_ok, " / ", runs_failed)});
  table.AddRow({"server RSS start / max / end",
                absl::StrCat(mib(rss_start), " / ", mib(rss_max), " / ", mib(rss_end))});
  table.AddRow({"server peak RSS (VmHWM) vs bound",
                absl::StrCat(mib(hwm), " vs ", mib(bound), held ? "  held" : "  NOT HELD")});
  std::printf("%s", table.ToString().c_str());

  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    nlohmann::ordered_json out;
    out["seconds"] = seconds;
    out["jobs"] = {{"ok", jobs.ok.load()}, {"refused", jobs.refused.load()}};
    out["squat_joins"] = {{"held", squats.ok.load()}, {"refused", squats.refused.load()}};
    out["store_waits"] = {{"held", waits.ok.load()}, {"refused", waits.refused.load()}};
    out["abandoned_consolidations"] = {{"started", abandoned.ok.load()},
                                       {"refused", abandoned.refused.load()}};
    out["other_errors"] = jobs.other + squats.other + waits.other + abandoned.other;
    out["training_runs"] = {{"ok", runs_ok}, {"failed", runs_failed}};
    out["rss_bytes"] = {{"start", rss_start}, {"max", rss_max}, {"end", rss_end}, {"hwm", hwm}};
    out["rss_bound_bytes"] = bound;
    out["held"] = held;
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << out.dump(2) << "\n";
  }
  return held ? 0 : 1;
}

// ---- --mode=isolation ----

constexpr int kTrainingJobs = 4;

// "No missed heartbeat", precisely: the server never sees a training member's
// last beat older than one interval + kBeatSlack. A worker sends its next beat
// one interval after the answer to its previous one (client.cc,
// HeartbeatLoop), so the age the server sees peaks at one interval plus the
// next beat's trip: the worker building and sending it, the server reading and
// answering it. kBeatSlack, half an interval, is what that trip may take: a
// beat later than that is late by half its own period (the old criterion, two
// intervals, allowed a whole beat to go missing), and it leaves a member still
// 1.5 intervals from being declared dead (--heartbeat_timeout_ms = 3 intervals).
// The run alone is judged by the same rule, so that what the machine's load
// does to the workers' own scheduling shows apart from what the flood does.
constexpr absl::Duration kHeartbeatInterval = absl::Seconds(1);  // the server's default
constexpr absl::Duration kBeatSlack = absl::Milliseconds(500);    // half an interval
const int64_t kMissedAgeMs = absl::ToInt64Milliseconds(kHeartbeatInterval + kBeatSlack);

struct JobResult {
  double median_step_ms = 0;
  int64_t max_heartbeat_age_ms = 0;
  int64_t generation = 0;
  bool ok = false;
};

double MedianStepMs(const nlohmann::json& report) {
  std::vector<double> ms;
  if (report.contains("step_ms")) ms = report["step_ms"].get<std::vector<double>>();
  if (ms.empty()) return 0;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// How often the isolation runs read their members' heartbeat age on the
// server. The largest age sampled is under the true largest by at most this
// (a beat may land just before a sample would have seen it older).
constexpr absl::Duration kAgeSampling = absl::Milliseconds(100);

// Runs the four jobs at once for `steps` steps, sampling their members'
// heartbeat age on the server every kAgeSampling.
std::vector<JobResult> TrainFourJobs(testing::LocalCluster& cluster, Client& observer,
                                     const std::string& prefix, int steps) {
  std::vector<JobResult> results(kTrainingJobs);
  std::vector<std::string> flags = {"--model=mlp",
                                    "--layers=4",
                                    "--width=128",
                                    "--stage=3",
                                    "--batch=16",
                                    absl::StrCat("--steps=", steps),
                                    absl::StrCat("--test_step_delay_ms=",
                                                 absl::GetFlag(FLAGS_step_delay_ms)),
                                    "--checkpoint_every=50",
                                    "--checkpoint_transport=grpc"};
  // LocalCluster starts one set of workers at a time: one cluster object
  // per job, all on the same server.
  std::vector<std::unique_ptr<testing::LocalCluster>> jobs;
  for (int j = 0; j < kTrainingJobs; ++j) {
    jobs.push_back(std::make_unique<testing::LocalCluster>(
        testing::ExternalServers(cluster.address()), cluster.dir() + "/" + prefix + std::to_string(j)));
    jobs.back()->StartWorkers(absl::StrCat(prefix, j), 2, flags);
  }
  std::atomic<bool> done{false};
  std::thread sampler([&] {
    while (!done) {
      for (int j = 0; j < kTrainingJobs; ++j) {
        absl::StatusOr<v1::GetStatusResponse> status = observer.GetStatus(absl::StrCat(prefix, j));
        if (!status.ok()) continue;
        for (const v1::JobStatus& job : status->jobs()) {
          for (const v1::MemberStatus& m : job.members()) {
            if (m.left() || m.rank() < 0) continue;
            results[j].max_heartbeat_age_ms =
                std::max(results[j].max_heartbeat_age_ms, m.last_heartbeat_age_ms());
          }
          results[j].generation = std::max(results[j].generation, job.generation());
        }
      }
      absl::SleepFor(kAgeSampling);
    }
  });
  for (int j = 0; j < kTrainingJobs; ++j) {
    std::vector<int> codes = jobs[j]->WaitWorkers(absl::Minutes(10));
    results[j].ok = codes == std::vector<int>({0, 0});
    if (!results[j].ok) {
      std::fprintf(stderr, "soak: job %s%d failed:\n%s\n%s\n", prefix.c_str(), j,
                   jobs[j]->WorkerLog(0).c_str(), jobs[j]->WorkerLog(1).c_str());
    }
    results[j].median_step_ms = MedianStepMs(jobs[j]->Report(absl::StrCat(prefix, j), 0));
  }
  done = true;
  sampler.join();
  return results;
}

// What the server's /metrics says of its answers to beats (server_metrics.h).
struct BeatHandling {
  int64_t count = -1;  // -1: /metrics could not be read
  int64_t over_100ms = -1;
  double max_seconds = -1;
};

BeatHandling ReadBeatHandling(const std::string& port_file) {
  BeatHandling h;
  const std::string port(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(port_file)));
  auto [code, text] =
      testing::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", port, "/metrics"));
  if (code != 0) return h;
  int64_t within_100ms = -1;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    if (parts.size() != 2) continue;
    if (parts[0] == "zeroshard_heartbeat_handling_seconds_count") {
      absl::SimpleAtoi(parts[1], &h.count);
    } else if (parts[0] == "zeroshard_heartbeat_handling_seconds_bucket{le=\"0.1\"}") {
      absl::SimpleAtoi(parts[1], &within_100ms);
    } else if (parts[0] == "zeroshard_heartbeat_handling_max_seconds") {
      absl::SimpleAtod(parts[1], &h.max_seconds);
    }
  }
  if (h.count >= 0 && within_100ms >= 0) h.over_100ms = h.count - within_100ms;
  return h;
}

std::string LoadAverage() {
  return std::string(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty("/proc/loadavg")))
      .substr(0, 4);
}

int IsolationMain() {
  const absl::Duration flood_length = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  const int64_t job_bound = int64_t{64} << 20, total_bound = int64_t{256} << 20;
  const std::string dir = testing::MakeTempDir("isolation");
  testing::LocalCluster cluster(
      dir, {"--max_jobs=200", "--job_ttl=10s", absl::StrCat("--kv_max_job_bytes=", job_bound),
            absl::StrCat("--kv_max_total_bytes=", total_bound),
            absl::StrCat("--checkpoint_upload_max_job_bytes=", job_bound),
            absl::StrCat("--checkpoint_upload_max_total_bytes=", total_bound),
            "--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/metrics-port"});
  if (!cluster.ok()) return 1;
  const pid_t server_pid = cluster.server()->pid();
  const std::string address = cluster.address();
  ClientOptions options;
  options.server = address;
  auto observer = Client::Connect(options);
  if (!observer.ok()) return 1;

  // The steps that make the flooded run last --seconds, from a run alone.
  const int probe_steps = 100;
  std::vector<JobResult> probe = TrainFourJobs(cluster, **observer, "probe-", probe_steps);
  const double probe_ms = std::max(1.0, probe[0].median_step_ms);
  const int steps = std::max(probe_steps, static_cast<int>(absl::ToDoubleMilliseconds(flood_length) /
                                                           (probe_ms * 1.15)));
  std::fprintf(stderr, "soak: %.1f ms a step alone: %d steps for the flooded run\n", probe_ms,
               steps);
  std::vector<JobResult> alone = TrainFourJobs(cluster, **observer, "alone-", steps / 2);

  // The flooding tenant: one member of job "flood" for the KV store and
  // uploads, and joins of new jobs.
  auto flooder = Client::Connect(options);
  if (!flooder.ok() || !(*flooder)->Join("flood", 1, "w0", "127.0.0.1", absl::Seconds(20)).ok()) {
    std::fprintf(stderr, "soak: the flooding member could not join\n");
    return 1;
  }
  (*flooder)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});
  const v1::MemberCredentials member = (*flooder)->credentials();
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  Counts waits("store waits"), values("store values"), uploads("checkpoint uploads"),
      joins("joins");
  for (int t = 0; t < absl::GetFlag(FLAGS_wait_threads); ++t) {
    threads.emplace_back([&, t] {
      auto stub = Stub(address, 200 + t);
      v1::StoreWaitRequest request;
      *request.mutable_member() = member;
      request.set_timeout_ms(3000);
      for (int k = 0; k < absl::GetFlag(FLAGS_wait_keys); ++k) {
        request.add_keys(absl::StrFormat("%s-%06d-%06d", std::string(80, 'k'), t, k));
      }
      while (!stop) {
        grpc::ClientContext context;
        Deadline(&context, absl::Seconds(10));
        v1::StoreWaitResponse response;
        grpc::Status s = stub->StoreWait(&context, request, &response);
        if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          ++waits.ok;
        } else {
          waits.Count(s);
          if (!s.ok()) absl::SleepFor(absl::Milliseconds(10));
        }
      }
    });
  }
  threads.emplace_back([&] {
    auto stub = Stub(address, 400);
    const std::string value(1 << 20, 'v');
    for (int64_t i = 0; !stop; ++i) {
      grpc::ClientContext context;
      Deadline(&context, absl::Seconds(10));
      v1::StoreSetRequest request;
      *request.mutable_member() = member;
      request.set_key(absl::StrCat("value-", i % 4096));
      request.set_value(value);
      v1::StoreSetResponse response;
      grpc::Status s = stub->StoreSet(&context, request, &response);
      values.Count(s);
      if (!s.ok()) absl::SleepFor(absl::Milliseconds(10));
    }
  });
  const std::string upload_file = cluster.dir() + "/flood-upload";
  testing::WriteFile(upload_file, std::string(16 << 20, 'u'));
  // More 16-MiB uploads at once than --checkpoint_upload_max_job_bytes admits.
  for (int t = 0; t < absl::GetFlag(FLAGS_upload_threads); ++t) {
    threads.emplace_back([&] {
      for (int64_t i = 0; !stop; ++i) {
        absl::StatusOr<int64_t> sent = (*flooder)->UploadShard(
            1, "flood/step-1/rank-0-of-1.safetensors", upload_file, absl::Seconds(30));
        if (sent.ok()) {
          ++uploads.ok;
        } else if (absl::IsResourceExhausted(sent.status())) {
          if (uploads.refused++ == 0) {
            std::fprintf(stderr, "soak: uploads: first refusal: %s\n",
                         sent.status().ToString().c_str());
          }
          absl::SleepFor(absl::Milliseconds(10));
        } else if (uploads.other++ == 0) {
          std::fprintf(stderr, "soak: uploads: first error: %s\n",
                       sent.status().ToString().c_str());
        }
      }
    });
  }
  threads.emplace_back([&] {
    auto stub = Stub(address, 500);
    for (int64_t i = 0; !stop; ++i) {
      grpc::ClientContext context;
      Deadline(&context, absl::Seconds(2));
      v1::JoinRequest request;
      request.set_job_id(absl::StrCat("flood-join-", i));
      request.set_world_size(i % 2 == 0 ? 1 : 4);  // every other one never completes
      request.set_worker_id("w0");
      request.set_host("127.0.0.1");
      request.set_skip_member_table(true);
      v1::JoinResponse response;
      grpc::Status s = stub->Join(&context, request, &response);
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        ++joins.ok;
      } else {
        joins.Count(s);
      }
    }
  });
  const int64_t rss_before_flood = testing::ProcStatusBytes(server_pid, "VmRSS");
  const absl::Time flood_start = absl::Now();
  std::vector<JobResult> flooded = TrainFourJobs(cluster, **observer, "flooded-", steps);
  const double flooded_seconds = absl::ToDoubleSeconds(absl::Now() - flood_start);
  stop = true;
  for (auto& t : threads) t.join();
  (*flooder)->StopHeartbeats();
  const int64_t hwm = testing::ProcStatusBytes(server_pid, "VmHWM");
  const int64_t bound = int64_t{absl::GetFlag(FLAGS_rss_bound_mib)} << 20;
  const BeatHandling handling = ReadBeatHandling(dir + "/metrics-port");

  Table table({"JOB", "ALONE ms/step", "FLOODED ms/step", "CHANGE", "MAX BEAT AGE ALONE",
               "MAX BEAT AGE FLOODED", "GENERATION", "RESULT"});
  bool held = hwm >= 0 && hwm < bound;
  for (int j = 0; j < kTrainingJobs; ++j) {
    const JobResult& a = alone[j];
    const JobResult& f = flooded[j];
    const double change = a.median_step_ms > 0 ? f.median_step_ms / a.median_step_ms - 1 : 0;
    const bool job_held = a.ok && f.ok && f.generation == 1 &&
                          f.max_heartbeat_age_ms <= kMissedAgeMs && change <= 0.10;
    held = held && job_held;
    table.AddRow({absl::StrCat("job ", j), absl::StrFormat("%.1f", a.median_step_ms),
                  absl::StrFormat("%.1f", f.median_step_ms),
                  absl::StrFormat("%+.1f %%", 100 * change),
                  absl::StrFormat("%.2f s", a.max_heartbeat_age_ms / 1000.0),
                  absl::StrFormat("%.2f s", f.max_heartbeat_age_ms / 1000.0),
                  absl::StrCat(f.generation), job_held ? "held" : "NOT HELD"});
  }
  std::printf("%s", table.ToString().c_str());
  std::printf("a missed heartbeat: a beat age above %.2f s (interval + half an interval), "
              "sampled every %s\n",
              kMissedAgeMs / 1000.0, absl::FormatDuration(kAgeSampling).c_str());
  auto mib = [](int64_t b) { return absl::StrFormat("%.1f MiB", b / 1048576.0); };
  Table flood({"FLOOD", "HELD OR DONE / REFUSED / OTHER ERRORS"});
  for (const Counts* c : {&waits, &values, &uploads, &joins}) {
    flood.AddRow({c->what, absl::StrCat(c->ok.load(), " / ", c->refused.load(), " / ",
                                        c->other.load())});
  }
  flood.AddRow({"flood length", absl::StrFormat("%.0f s", flooded_seconds)});
  flood.AddRow({"beats answered by the server: all runs / over 0.1 s / longest",
                absl::StrFormat("%d / %d / %.3f s", handling.count, handling.over_100ms,
                                handling.max_seconds)});
  flood.AddRow({"server RSS before the flood / peak (VmHWM) vs bound",
                absl::StrCat(mib(rss_before_flood), " / ", mib(hwm), " vs ", mib(bound))});
  flood.AddRow({"bounds (KV and uploads alike)",
                absl::StrCat("--kv_max_job_bytes=", mib(job_bound), " --kv_max_total_bytes=",
                             mib(total_bound))});
  flood.AddRow({"machine load (1-minute average) at the end", LoadAverage()});
  std::printf("%s%s\n", flood.ToString().c_str(), held ? "ISOLATION HELD" : "ISOLATION NOT HELD");
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    nlohmann::ordered_json out;
    out["mode"] = "isolation";
    out["flood_seconds"] = flooded_seconds;
    out["jobs"] = nlohmann::json::array();
    for (int j = 0; j < kTrainingJobs; ++j) {
      out["jobs"].push_back({{"alone_step_ms", alone[j].median_step_ms},
                             {"flooded_step_ms", flooded[j].median_step_ms},
                             {"max_heartbeat_age_ms", flooded[j].max_heartbeat_age_ms},
                             {"alone_max_heartbeat_age_ms", alone[j].max_heartbeat_age_ms},
                             {"generation", flooded[j].generation},
                             {"ok", alone[j].ok && flooded[j].ok}});
    }
    out["missed_heartbeat_age_ms"] = kMissedAgeMs;
    out["beats_answered"] = {{"count", handling.count},
                             {"over_100ms", handling.over_100ms},
                             {"max_seconds", handling.max_seconds}};
    out["load_average"] = LoadAverage();
    out["rss_hwm_bytes"] = hwm;
    out["rss_bound_bytes"] = bound;
    out["held"] = held;
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << out.dump(2) << "\n";
  }
  return held ? 0 : 1;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_mode) == "isolation") return zeroshard::IsolationMain();
  return zeroshard::Main();
}
