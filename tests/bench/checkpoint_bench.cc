// Checkpoint benchmark, two phases (--pause, --consolidation; both by
// default).
//
// Pause: a real shard_worker (W = 1, an MLP of 3 x 4096: a 576 MiB shard of
// parameters and Adam moments) checkpoints every 12 steps; its run report
// gives the training thread's pause per checkpoint, the time from Save to
// the committed step, and the step times with and without a checkpoint's
// copy running beside them, with --checkpoint_staging on and off in
// alternate runs (--pause_rounds pairs, the order swapped every round).
//
// Consolidation: a sharded checkpoint of about 2.4 GB
// (W = 4; parameters plus both Adam moments) committed to a real shard_server
// process, consolidated through the Consolidate RPC into one local file, next
// to `cat` of the same shard files into one file on the same disk.
//
//   bazel run -c opt //tests/bench:checkpoint_bench -- [--json_out=FILE] [--dir=DIR]
//
// Reports, as medians of --repeats rounds (cat and the RPC consolidation run
// back to back, order swapped every round; per-round ratios are printed too),
// the consolidation rate (output bytes over the client's wall time, fsync
// included) of a step the server already verified in the background (it
// does so right after a step completes; that time is reported too, and a
// consolidation asked for before it ends adds its own verification pass),
// cat's rate (with and without an fsync of its output) and
// the server's peak RSS while consolidating (VmRSS sampled every 5 ms, and
// VmHWM). Shard
// files are written directly in the worker's format. Everything is deleted
// afterwards. Both runs read shard files that are in the page cache (they
// were just written); no cache is dropped, so the comparison is warm vs warm.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/checksum.h"
#include "common/plan/plan_codec.h"
#include "common/safetensors.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

ABSL_FLAG(std::string, server_binary, "", "shard_server binary (default: from runfiles)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(std::string, dir, "", "Work directory (default: a new one under /tmp); deleted after");
ABSL_FLAG(int, layers, 12, "Linear layers of the model: [width, width] weight + [width] bias");
ABSL_FLAG(int, width, 4096, "Layer width; 12 x 4096 gives 0.8 GB of parameters, 2.4 GB with Adam");
ABSL_FLAG(int, world, 4, "Ranks (shard files)");
ABSL_FLAG(int, repeats, 3,
          "Rounds of cat and consolidation, run alternately (order swapped every round); "
          "medians are reported");
ABSL_FLAG(bool, keep, false, "Keep the work directory");
ABSL_FLAG(bool, consolidation, true, "Run the consolidation phase (cat vs the Consolidate RPC)");
ABSL_FLAG(bool, pause, true,
          "Run the pause phase: a real shard_worker (W = 1) whose shard (parameters and Adam "
          "moments) is --pause_layers x --pause_width, checkpointing every --pause_every steps");
ABSL_FLAG(int, pause_layers, 3, "Pause phase: MLP layers (3 x 4096: a 576 MiB shard with Adam)");
ABSL_FLAG(int, pause_width, 4096, "Pause phase: MLP width");
ABSL_FLAG(int, pause_batch, 64, "Pause phase: rows per step");
ABSL_FLAG(int, pause_steps, 72, "Pause phase: steps");
ABSL_FLAG(int, pause_rounds, 1,
          "Pause phase: rounds of two runs, --checkpoint_staging=true and false (staged first in "
          "even rounds, direct first in odd ones)");
ABSL_FLAG(int, pause_every, 12,
          "Pause phase: --checkpoint_every (12 steps of ~0.3 s here: longer than a shard's write, "
          "as a real interval is; at 4 the disk cannot keep up and every update waits for it)");

namespace zeroshard {
namespace {

using testing::ChildProcess;

constexpr char kJob[] = "bench";
constexpr int64_t kStep = 100;
constexpr int64_t kChunkFloats = 1 << 20;  // generation chunk: 4 MiB

// What Die() cleans up: the server process and the work directory.
ChildProcess* g_server = nullptr;
std::string g_dir;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "checkpoint_bench: %s\n", message.c_str());
  if (g_server != nullptr) g_server->Signal(SIGKILL);
  if (!g_dir.empty() && !absl::GetFlag(FLAGS_keep)) testing::RunCommand("rm -rf " + g_dir);
  std::exit(1);
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.ToString()));
}

// A cheap deterministic value for element `e` of model tensor `t`, kind `k`.
inline float Value(int k, int t, int64_t e) {
  uint32_t x = static_cast<uint32_t>(e) * 2654435761u + static_cast<uint32_t>(t * 131 + k * 97);
  return static_cast<float>(x >> 16) * (1.0f / 65536.0f) - 0.5f;
}

void Fill(int k, int t, int64_t first, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = Value(k, t, first + i);
}

struct Source {
  int kind;
  int tensor;
  int64_t first;  // element of the model tensor
  int64_t count;
};

struct Shard {
  std::string relative;
  int64_t size = 0;
  std::map<std::string, std::string> checksums;
};

// Writes rank `rank`'s shard file as the worker does: parameters, then both
// Adam moments; checksums in the header, so values are generated twice
// (hashed, then written), 4 MiB at a time.
Shard WriteShard(const std::string& root, const v1::ShardPlan& plan, int rank, int64_t generation) {
  const char* prefixes[] = {"", "optim.exp_avg.", "optim.exp_avg_sq."};
  std::map<std::string, int> index;
  for (const v1::Unit& unit : plan.units()) {
    for (const v1::TensorSpec& t : unit.tensors()) index.emplace(t.name(), index.size());
  }
  std::vector<TensorEntry> entries;
  std::vector<Source> sources;
  for (int kind = 0; kind < 3; ++kind) {
    for (const v1::Unit& unit : plan.units()) {
      for (const v1::Piece& p : unit.pieces()) {
        if (p.rank() != rank) continue;
        const v1::TensorSpec& spec = unit.tensors(p.tensor());
        std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
        int64_t row = 1;
        for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
        if (!shape.empty()) shape[0] = p.row_end() - p.row_begin();
        entries.push_back(
            {absl::StrCat(prefixes[kind], spec.name(), ":", p.row_begin(), "-", p.row_end()),
             DType::kF32, shape});
        sources.push_back(
            {kind, index[spec.name()], p.row_begin() * row, (p.row_end() - p.row_begin()) * row});
      }
    }
  }
  std::vector<float> buffer(kChunkFloats);
  Shard shard;
  shard.relative = absl::StrCat(kJob, "/step-", kStep, "/rank-", rank, "-of-", plan.world_size(),
                                ".safetensors");
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  for (size_t i = 0; i < sources.size(); ++i) {
    Hasher hasher;
    for (int64_t done = 0; done < sources[i].count; done += kChunkFloats) {
      int64_t n = std::min(kChunkFloats, sources[i].count - done);
      Fill(sources[i].kind, sources[i].tensor, sources[i].first + done, n, buffer.data());
      hasher.Update(buffer.data(), n * 4);
    }
    std::string hex = ChecksumToHex(hasher.Digest());
    checksums[entries[i].name] = hex;
    shard.checksums[entries[i].name] = hex;
  }
  SafetensorsMetadata metadata = {{"format", "zeroshard-shard-v1"},
                                  {"job", kJob},
                                  {"step", absl::StrCat(kStep)},
                                  {"rank", absl::StrCat(rank)},
                                  {"world_size", absl::StrCat(plan.world_size())},
                                  {"generation", absl::StrCat(generation)},
                                  {"plan_hash", plan.hash()},
                                  {"optimizer", "adam"},
                                  {"optimizer_step", absl::StrCat(kStep)},
                                  {"checksums", checksums.dump()}};
  auto writer =
      SafetensorsWriter::Create(absl::StrCat(root, "/", shard.relative), entries, metadata);
  Check(writer.status(), "create shard file");
  for (const Source& s : sources) {
    for (int64_t done = 0; done < s.count; done += kChunkFloats) {
      int64_t n = std::min(kChunkFloats, s.count - done);
      Fill(s.kind, s.tensor, s.first + done, n, buffer.data());
      Check((*writer)->Append(buffer.data(), n * 4), "write shard");
    }
  }
  Check((*writer)->Finish(), "finish shard");
  shard.size = (*writer)->file_size();
  return shard;
}

double Seconds(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// CPU seconds (user + system) of process `pid`, all threads.
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
  // Fields 14 and 15 of the line (utime, stime) are 11 and 12 after the name.
  if (fields.size() < 13) return 0;
  int64_t utime = 0, stime = 0;
  absl::SimpleAtoi(fields[11], &utime);
  absl::SimpleAtoi(fields[12], &stime);
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

double RusageCpuSeconds(int who) {
  struct rusage u;
  getrusage(who, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec * 1e-6;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

absl::Status FsyncFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::ErrnoToStatus(errno, path);
  int rc = fsync(fd);
  close(fd);
  return rc == 0 ? absl::OkStatus() : absl::ErrnoToStatus(errno, path);
}

// The pause a checkpoint costs training, measured in a real shard_worker
// (its run report's checkpoint_pause_ms: from Save's start to its return,
// plus the next update's wait for the copy), and the time from Save to the
// committed step (checkpoint_commit_ms). Steps with a checkpoint's copy
// running beside them are compared with the others: on a machine with few
// cores the copy's CPU is taken from the step even when it pauses nothing.
// One worker run's measurements (its run report).
struct PauseRun {
  std::vector<double> pauses, commits, beside, alone;
  nlohmann::json compute;
};

PauseRun RunPauseWorker(bool staging) {
  const int layers = absl::GetFlag(FLAGS_pause_layers);
  const int width = absl::GetFlag(FLAGS_pause_width);
  const int every = absl::GetFlag(FLAGS_pause_every);
  const int steps = absl::GetFlag(FLAGS_pause_steps);
  const std::string dir = testing::MakeTempDir("checkpoint_pause");
  // Its checkpoints are the shard's size times the checkpoints: gone after.
  absl::Cleanup remove = [&dir] {
    if (!absl::GetFlag(FLAGS_keep)) testing::RunCommand("rm -rf " + dir);
  };
  testing::LocalCluster cluster(dir);
  if (!cluster.ok()) Die("pause phase: no server");
  const bool ran = cluster.Run(
      "pause", 1,
      {"--model=mlp", absl::StrCat("--layers=", layers), absl::StrCat("--width=", width),
       absl::StrCat("--batch=", absl::GetFlag(FLAGS_pause_batch)), absl::StrCat("--steps=", steps),
       absl::StrCat("--checkpoint_every=", every), "--seed=1", "--collective_timeout=120s",
       absl::StrCat("--checkpoint_staging=", staging ? "true" : "false")});
  if (!ran) Die(absl::StrCat("pause phase: the worker failed:\n", cluster.WorkerLog(0)));
  const nlohmann::json report = cluster.Report("pause", 0);
  PauseRun run;
  run.compute = report["compute"];
  run.pauses = report["checkpoint_pause_ms"].get<std::vector<double>>();
  run.commits = report["checkpoint_commit_ms"].get<std::vector<double>>();
  const std::vector<double> step_ms = report["step_ms"];
  // Step i (0-based) runs after the checkpoint of step i when i % every == 0.
  for (size_t i = 1; i < step_ms.size(); ++i) {  // the first step warms up
    (i % every == 0 ? run.beside : run.alone).push_back(step_ms[i]);
  }
  if (run.pauses.empty() || run.commits.empty() || run.beside.empty() || run.alone.empty()) {
    Die(absl::StrCat("pause phase: too few checkpoints or steps: ", report.dump()));
  }
  return run;
}

// The pause a checkpoint costs training, measured in a real shard_worker
// (its run report's checkpoint_pause_ms: from Save's start to its return,
// plus the next update's wait for the copy), and the time from Save to the
// committed step (checkpoint_commit_ms), with --checkpoint_staging on and
// off in alternate runs. Steps with a checkpoint's copy running beside them
// are compared with the others: on a machine with few cores the copy's CPU
// is taken from the step even when it pauses nothing.
int MeasurePause(nlohmann::ordered_json* j) {
  const int64_t params = int64_t{absl::GetFlag(FLAGS_pause_layers)} *
                         (int64_t{absl::GetFlag(FLAGS_pause_width)} * absl::GetFlag(FLAGS_pause_width) +
                          absl::GetFlag(FLAGS_pause_width));
  PauseRun by_mode[2];  // [0]: staged, [1]: straight from the engine's memory
  for (int round = 0; round < std::max(1, absl::GetFlag(FLAGS_pause_rounds)); ++round) {
    for (int i = 0; i < 2; ++i) {
      // Staged first in even rounds, direct first in odd ones: a run's
      // written pages are still being flushed when the next one starts.
      const int mode = round % 2 == 0 ? i : 1 - i;
      PauseRun run = RunPauseWorker(/*staging=*/mode == 0);
      PauseRun& all = by_mode[mode];
      all.compute = run.compute;
      for (auto [to, from] : {std::pair{&all.pauses, &run.pauses}, {&all.commits, &run.commits},
                              {&all.beside, &run.beside}, {&all.alone, &run.alone}}) {
        to->insert(to->end(), from->begin(), from->end());
      }
    }
  }
  const BenchMachine machine = DescribeBenchMachine(by_mode[0].compute["blas_kernel"]);
  std::printf("%s\n", machine.Line().c_str());
  const double shard_bytes = params * 12.0;
  Table table({"MEASUREMENT (W = 1, " + HumanBytes(shard_bytes) + " shard)", "STAGED MEDIAN MS",
               "MAX", "DIRECT MEDIAN MS", "MAX", "N"});
  auto row = [&](const std::string& what, std::vector<double> PauseRun::*field) {
    const std::vector<double>& a = by_mode[0].*field;
    const std::vector<double>& b = by_mode[1].*field;
    table.AddRow({what, absl::StrFormat("%.1f", Median(a)),
                  absl::StrFormat("%.1f", *std::max_element(a.begin(), a.end())),
                  absl::StrFormat("%.1f", Median(b)),
                  absl::StrFormat("%.1f", *std::max_element(b.begin(), b.end())),
                  absl::StrCat(a.size(), " / ", b.size())});
  };
  row("pause per checkpoint (training thread)", &PauseRun::pauses);
  row("Save -> step committed", &PauseRun::commits);
  row("step with a checkpoint's copy beside it", &PauseRun::beside);
  row("step without", &PauseRun::alone);
  std::printf("%s\n", table.ToString().c_str());
  (*j)["machine"] = machine.Json();
  (*j)["pause_shard_bytes"] = shard_bytes;
  for (int mode = 0; mode < 2; ++mode) {
    const PauseRun& r = by_mode[mode];
    const std::string k = mode == 0 ? "staged_" : "direct_";
    (*j)[k + "pause_ms"] = r.pauses;
    (*j)[k + "pause_ms_median"] = Median(r.pauses);
    (*j)[k + "pause_ms_max"] = *std::max_element(r.pauses.begin(), r.pauses.end());
    (*j)[k + "commit_ms_median"] = Median(r.commits);
    (*j)[k + "step_ms_beside_copy_median"] = Median(r.beside);
    (*j)[k + "step_ms_alone_median"] = Median(r.alone);
  }
  return 0;
}

int Main() {
  nlohmann::ordered_json j;
  if (absl::GetFlag(FLAGS_pause)) {
    if (int rc = MeasurePause(&j); rc != 0) return rc;
  }
  if (!absl::GetFlag(FLAGS_consolidation)) return WriteBenchJson(j, absl::GetFlag(FLAGS_json_out));
  const int layers = absl::GetFlag(FLAGS_layers);
  const int width = absl::GetFlag(FLAGS_width);
  const int world = absl::GetFlag(FLAGS_world);
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) dir = testing::MakeTempDir("checkpoint_bench");
  const std::string root = dir + "/checkpoints";
  mkdir(dir.c_str(), 0755);
  g_dir = dir;
  testing::RunCommand(absl::StrCat("mkdir -p ", root, "/", kJob, "/step-", kStep));
  const int64_t params = int64_t{layers} * (int64_t{width} * width + width);
  const int64_t checkpoint_bytes = params * 4 * 3;
  struct statvfs fs;
  if (statvfs(dir.c_str(), &fs) == 0) {
    const double free_bytes = static_cast<double>(fs.f_bavail) * fs.f_frsize;
    if (free_bytes < 2.2 * checkpoint_bytes) {
      Die(absl::StrFormat("%s has %.1f GB free; the bench needs %.1f GB", dir, free_bytes / 1e9,
                          2.2 * checkpoint_bytes / 1e9));
    }
  }

  // ---- Server ----
  std::string binary = absl::GetFlag(FLAGS_server_binary);
  if (binary.empty()) binary = testing::RunfilePath("shard_server/shard_server");
  auto server = std::make_unique<ChildProcess>(
      binary,
      std::vector<std::string>{"--listen=127.0.0.1:0", "--port_file=" + dir + "/port",
                               "--state_dir=" + dir + "/state", "--checkpoint_root=" + root,
                               // Writing 2.4 GB on a loaded machine must not look like death.
                               "--heartbeat_timeout_ms=120000"},
      dir + "/server.log");
  g_server = server.get();
  std::string port;
  if (!testing::WaitFor(
          [&] {
            port = testing::ReadFileOrEmpty(dir + "/port");
            return !port.empty() && port.back() == '\n';
          },
          absl::Seconds(20))) {
    Die("server did not start:\n" + server->Log());
  }
  port.pop_back();
  const std::string address = "127.0.0.1:" + port;
  auto connect = [&] {
    ClientOptions o;
    o.server = address;
    o.rpc_timeout = absl::Seconds(60);
    auto c = Client::Connect(o);
    Check(c.status(), "connect");
    return std::move(*c);
  };

  // ---- Join, plan, write and commit ----
  v1::ModelSpec spec;
  for (int i = 0; i < layers; ++i) {
    v1::TensorSpec* w = spec.add_tensors();
    w->set_name(absl::StrCat("layers.", i, ".weight"));
    w->add_shape(width);
    w->add_shape(width);
    w->set_dtype("F32");
    v1::TensorSpec* b = spec.add_tensors();
    b->set_name(absl::StrCat("layers.", i, ".bias"));
    b->add_shape(width);
    b->set_dtype("F32");
  }
  std::vector<std::unique_ptr<Client>> members(world);
  {
    std::vector<std::unique_ptr<Client>> clients(world);
    std::vector<std::thread> threads;
    for (int i = 0; i < world; ++i) {
      clients[i] = connect();
      threads.emplace_back([&, i] {
        Check(clients[i]
                  ->Join(kJob, world, absl::StrCat("w", i), "127.0.0.1", absl::Seconds(30))
                  .status(),
              "join");
      });
    }
    for (auto& t : threads) t.join();
    for (auto& c : clients) members[c->info().rank] = std::move(c);
  }
  for (auto& m : members) {
    m->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse> reply) {
      Die(absl::StrCat("heartbeat: ", reply.ok() ? reply->reason() : reply.status().ToString()));
    });
  }
  v1::ShardPlan plan;
  for (auto& m : members) {
    auto p = m->PlanShards(ModelSpecFromProto(spec), PlanOptions(), world);
    Check(p.status(), "plan");
    plan = ShardPlanToProto(*p);
  }
  std::fprintf(stderr, "writing %d shard files of %.2f GB in all under %s ...\n", world,
               checkpoint_bytes / 1e9, root.c_str());
  std::vector<std::string> shard_paths;
  int64_t shard_bytes = 0;
  const absl::Time write_start = absl::Now();
  for (int r = 0; r < world; ++r) {
    Shard shard = WriteShard(root, plan, r, members[r]->info().generation);
    auto commit = members[r]->CommitShard(kStep, shard.relative, shard.size, shard.checksums);
    Check(commit.status(), "commit");
    shard_paths.push_back(root + "/" + shard.relative);
    shard_bytes += shard.size;
  }
  std::fprintf(stderr, "written and committed in %.1f s\n", Seconds(write_start));
  // The server reads a complete step back once in the background; timed
  // runs start after that (a consolidation asked for earlier adds its own
  // verification pass: verify_seconds in the server log).
  double background_verify_seconds = -1;
  if (!testing::WaitFor(
          [&] {
            for (absl::string_view line : absl::StrSplit(server->Log(), '\n')) {
              if (!absl::StrContains(line, "event=checkpoint_verified")) continue;
              size_t at = line.find("seconds=");
              if (at != absl::string_view::npos) {
                absl::SimpleAtod(line.substr(at + 8, line.find(' ', at) - at - 8),
                                 &background_verify_seconds);
              }
              return true;
            }
            return false;
          },
          absl::Seconds(120))) {
    Die("the step was not verified:\n" + server->Log());
  }
  auto ctl = connect();
  auto list = ctl->ListCheckpoints(kJob);
  Check(list.status(), "list");
  if (list->checkpoints_size() != 1 || !list->checkpoints(0).complete()) {
    Die("the step did not complete:\n" + server->Log());
  }

  // ---- cat vs consolidation, alternating ----
  // Round r runs cat and the RPC consolidation back to back, cat first in
  // even rounds and second in odd ones, then the on_server consolidation.
  // Every output is removed right after it is timed, so each timed run
  // writes into memory the previous one just freed (in a VM, memory freed
  // long ago may have gone back to the host and costs a fault per page on
  // its next use: the main source of spread here). Medians are reported.
  const std::string cat_out = dir + "/cat.out";
  const std::string out = dir + "/model.safetensors";
  const int rounds = std::max(1, absl::GetFlag(FLAGS_repeats));
  std::vector<double> cat_s, cat_sync_s, consolidate_s, server_s, on_server_s, ratios;
  // CPU seconds per run: cat's (and its shell's), and the server's plus this
  // process's (the client) during a consolidation. Less sensitive than wall
  // time to other load on the machine.
  std::vector<double> cat_cpu, consolidate_server_cpu, consolidate_client_cpu;
  int64_t output_bytes = 0, peak_rss = 0;
  std::string shard_list;
  for (const auto& p : shard_paths) absl::StrAppend(&shard_list, " ", p);
  auto run_cat = [&] {
    const double cpu_before = RusageCpuSeconds(RUSAGE_CHILDREN);
    absl::Time start = absl::Now();
    auto [code, output] = testing::RunCommand(absl::StrCat("cat", shard_list, " > ", cat_out));
    if (code != 0) Die("cat failed: " + output);
    cat_s.push_back(Seconds(start));
    cat_cpu.push_back(RusageCpuSeconds(RUSAGE_CHILDREN) - cpu_before);
    Check(FsyncFile(cat_out), "fsync cat output");
    cat_sync_s.push_back(Seconds(start));
    std::remove(cat_out.c_str());
  };
  v1::ConsolidateRequest request;
  request.set_job_id(kJob);
  request.set_step(-1);
  auto run_consolidate = [&] {
    std::atomic<bool> sampling{true};
    std::atomic<int64_t> peak{0};
    std::thread sampler([&] {
      while (sampling.load()) {
        int64_t rss = testing::ProcStatusBytes(server->pid(), "VmRSS");
        if (rss > peak.load()) peak.store(rss);
        absl::SleepFor(absl::Milliseconds(5));
      }
    });
    const double server_cpu_before = ProcessCpuSeconds(server->pid());
    const double client_cpu_before = RusageCpuSeconds(RUSAGE_SELF);
    absl::Time start = absl::Now();
    auto summary = ctl->Consolidate(request, out);
    const double seconds = Seconds(start);
    consolidate_server_cpu.push_back(ProcessCpuSeconds(server->pid()) - server_cpu_before);
    consolidate_client_cpu.push_back(RusageCpuSeconds(RUSAGE_SELF) - client_cpu_before);
    sampling.store(false);
    sampler.join();
    Check(summary.status(), "consolidate");
    output_bytes = summary->total_bytes();
    consolidate_s.push_back(seconds);
    server_s.push_back(summary->seconds());
    peak_rss = std::max(peak_rss, peak.load());
    std::remove(out.c_str());
  };
  for (int round = 0; round < rounds; ++round) {
    if (round % 2 == 0) {
      run_cat();
      run_consolidate();
    } else {
      run_consolidate();
      run_cat();
    }
    ratios.push_back(cat_sync_s.back() / consolidate_s.back());
    // The same merge written by the server under its root: no RPC stream.
    v1::ConsolidateRequest local_request = request;
    local_request.set_on_server(true);
    absl::Time start = absl::Now();
    auto local = ctl->Consolidate(local_request, "");
    Check(local.status(), "consolidate on_server");
    on_server_s.push_back(Seconds(start));
    testing::RunCommand(absl::StrCat("rm -rf ", root, "/", kJob, "/consolidated"));
    std::fprintf(stderr,
                 "round %d (%s first): cat %.2f s (+fsync %.2f s), consolidate %.2f s "
                 "(ratio %.2f), on_server %.2f s; CPU s: cat %.2f, consolidate %.2f server + "
                 "%.2f client\n",
                 round + 1, round % 2 == 0 ? "cat" : "consolidate", cat_s.back(), cat_sync_s.back(),
                 consolidate_s.back(), ratios.back(), on_server_s.back(), cat_cpu.back(),
                 consolidate_server_cpu.back(), consolidate_client_cpu.back());
  }
  const int64_t vmhwm = testing::ProcStatusBytes(server->pid(), "VmHWM");

  for (auto& m : members) m->StopHeartbeats();
  for (const auto& line : absl::StrSplit(server->Log(), '\n')) {
    if (absl::StrContains(line, "event=consolidate_done")) {
      std::fprintf(stderr, "%s\n", std::string(line).c_str());
    }
  }
  server->Signal(SIGTERM);
  server->Wait(absl::Seconds(10));
  g_server = nullptr;
  if (!absl::GetFlag(FLAGS_keep)) testing::RunCommand("rm -rf " + dir);

  // ---- Report ----
  const double cat_gbps = shard_bytes / 1e9 / Median(cat_sync_s);
  const double cat_nosync_gbps = shard_bytes / 1e9 / Median(cat_s);
  const double consolidation_gbps = output_bytes / 1e9 / Median(consolidate_s);
  const double server_seconds = Median(server_s);
  const double on_server_gbps = output_bytes / 1e9 / Median(on_server_s);
  auto spread = [](int64_t bytes, const std::vector<double>& seconds) {
    return absl::StrFormat("%.2f-%.2f",
                           bytes / 1e9 / *std::max_element(seconds.begin(), seconds.end()),
                           bytes / 1e9 / *std::min_element(seconds.begin(), seconds.end()));
  };
  std::printf("%d alternating rounds; medians, and the range over the rounds\n", rounds);
  Table table({"MEASUREMENT", "BYTES", "SECONDS", "GB/S", "RANGE GB/S"});
  table.AddRow({absl::StrCat("cat ", world, " shard files > one file, + fsync"),
                HumanBytes(shard_bytes), absl::StrFormat("%.2f", Median(cat_sync_s)),
                absl::StrFormat("%.2f", cat_gbps), spread(shard_bytes, cat_sync_s)});
  table.AddRow({"cat, no fsync", HumanBytes(shard_bytes), absl::StrFormat("%.2f", Median(cat_s)),
                absl::StrFormat("%.2f", cat_nosync_gbps), spread(shard_bytes, cat_s)});
  table.AddRow({"Consolidate RPC -> local file, + fsync", HumanBytes(output_bytes),
                absl::StrFormat("%.2f", Median(consolidate_s)),
                absl::StrFormat("%.2f", consolidation_gbps), spread(output_bytes, consolidate_s)});
  table.AddRow({"  of which the server's own time", HumanBytes(output_bytes),
                absl::StrFormat("%.2f", server_seconds),
                absl::StrFormat("%.2f", output_bytes / 1e9 / server_seconds),
                spread(output_bytes, server_s)});
  table.AddRow({"  background verification after the commit (not in the above)",
                HumanBytes(shard_bytes), absl::StrFormat("%.2f", background_verify_seconds),
                absl::StrFormat("%.2f", shard_bytes / 1e9 / background_verify_seconds), ""});
  table.AddRow({"Consolidate on_server (written under the root, no stream)",
                HumanBytes(output_bytes), absl::StrFormat("%.2f", Median(on_server_s)),
                absl::StrFormat("%.2f", on_server_gbps), spread(output_bytes, on_server_s)});
  std::printf("%s\n", table.ToString().c_str());
  std::string ratio_list;
  for (double r : ratios)
    absl::StrAppend(&ratio_list, ratio_list.empty() ? "" : " ", absl::StrFormat("%.2f", r));
  std::printf(
      "consolidation / cat(+fsync): %.2f of the medians (target >= 0.70); per round: %s; "
      "vs cat without fsync: %.2f\n",
      consolidation_gbps / cat_gbps, ratio_list.c_str(), consolidation_gbps / cat_nosync_gbps);
  std::printf(
      "CPU seconds (medians): cat %.2f; consolidation %.2f in the server + %.2f in the "
      "client\n",
      Median(cat_cpu), Median(consolidate_server_cpu), Median(consolidate_client_cpu));
  std::printf(
      "server peak RSS during consolidation: %s sampled VmRSS, %s VmHWM (target <= 128 "
      "MiB)\n",
      HumanBytes(peak_rss).c_str(), HumanBytes(vmhwm).c_str());

  j["consolidation_gbps"] = consolidation_gbps;
  j["cat_gbps"] = cat_gbps;
  j["server_peak_rss_bytes"] = std::max(peak_rss, vmhwm);
  j["cat_gbps_note"] = "cat of the shard files into one file followed by fsync of it";
  j["cat_nosync_gbps"] = cat_nosync_gbps;
  j["rounds"] = rounds;
  j["cat_cpu_seconds"] = Median(cat_cpu);
  j["consolidation_server_cpu_seconds"] = Median(consolidate_server_cpu);
  j["consolidation_client_cpu_seconds"] = Median(consolidate_client_cpu);
  j["ratio_of_medians"] = consolidation_gbps / cat_gbps;
  j["ratio_per_round"] = ratios;
  auto rates = [](int64_t bytes, const std::vector<double>& seconds) {
    std::vector<double> r;
    for (double s : seconds) r.push_back(bytes / 1e9 / s);
    return r;
  };
  j["consolidation_gbps_per_round"] = rates(output_bytes, consolidate_s);
  j["cat_gbps_per_round"] = rates(shard_bytes, cat_sync_s);
  j["server_seconds"] = server_seconds;
  j["background_verify_seconds"] = background_verify_seconds;
  j["on_server_gbps"] = on_server_gbps;
  j["checkpoint_bytes"] = shard_bytes;
  j["output_bytes"] = output_bytes;
  j["world_size"] = world;
  return WriteBenchJson(j, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
