// Recovery benchmark (#13): how long a job stops when a worker dies, and
// how much work it loses, with real shard_server and shard_worker processes
// on loopback (the bench is the launcher: it kills with SIGKILL and starts
// replacements with the dead worker's id).
//
//   bazel run //tests/bench:recovery_bench -- [--quick] [--json_out=FILE]
//
// Jobs: the quickstart GPT at W = 4 (deploy/quickstart.sh's model, with
// the all-token loss and learning rate it had before --loss_on=answers) and seed 001's model (20 x Linear(2000, 2000), batch 20, Adam)
// at W = 2, both at stage 3. Ways a job comes back, each from one kill in
// the middle of a snapshot interval:
//   replace      rank 1 killed; the launcher starts it again at once
//   shrink       rank W-1 killed, no replacement; --min_world_size=W-1
//                (W = 2: 1) and --rejoin_grace=--grace
//   disk         W = 4: rank 1 and its buddy (rank 2) killed and started
//                again, so only the disk checkpoint has their state;
//                W = 2 (every rank is the other's buddy): snapshots off,
//                rank 1 killed and started again
//   restart_all  today's way without #13: --max_recoveries=0, the
//                survivors exit, then all W start again with
//                --resume=latest
// The disk checkpoint interval (disk and restart_all runs; replace and
// shrink runs write none) equals the snapshot interval, so the lost work
// compares like with like.
//
// Figures (seconds from the kill, as wall-clock times the workers record):
//   detection_s         the server's abort confirmed the death on rank 0
//                       (restart_all: the last survivor exited)
//   rejoin_s            confirmation -> the new generation formed
//   restore_s           formed -> state restored (restart_all: restart ->
//                       state restored, process start and join included)
//   first_step_after_s  kill -> first completed step of the new generation
//   lost_steps          steps trained before the kill and trained again
//   process_start_s     a started worker's exec -> its first Join (the
//                       "replacement's process start" of the target)
//   snapshot_pause_ms   the training thread's pause per snapshot (max and
//                       median over rank 0's snapshots before the kill)
//   step_ms             rank 0's median step time; step_ms_after_snapshot
//                       and step_ms_other split the first generation's
//                       steps: the background copy and swap share the CPUs
//                       with the step after a boundary
// Targets checked (printed, not asserted): replace <= 2 s + process_start;
// shrink <= grace + 2 s; lost_steps <= the snapshot interval; seed 001's
// model at W = 2: snapshot pause <= 2 % of the step time.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(bool, quick, false,
          "Small: the GPT only, fewer steps (a smoke test of the bench, not its figures)");
ABSL_FLAG(std::string, jobs, "gpt,mlp",
          "Which jobs: gpt (quickstart, W=4), mlp (seed 001, W=2), hsdp (seed 001's model at W=4 "
          "in shard groups of 2)");
ABSL_FLAG(std::string, modes, "replace,shrink,disk,restart_all",
          "Which recoveries (also replace_buddy: replace with --snapshot_buddy=always, the buddy "
          "copies HSDP's replicas make unneeded)");
ABSL_FLAG(absl::Duration, grace, absl::Seconds(2), "--rejoin_grace of the shrink runs");

namespace zeroshard {
namespace {

struct JobSpec {
  std::string name;
  int world = 0;
  std::vector<std::string> flags;
  int interval = 0;    // --snapshot_every and --checkpoint_every
  int kill_after = 0;  // rank 0's completed steps when the kill comes
  int steps = 0;
};

JobSpec Gpt(bool quick) {
  JobSpec j;
  j.name = "gpt";
  j.world = 4;
  j.flags = {"--model=gpt",         "--layers=3",        "--heads=4",
             "--d_model=96",        "--context=32",      "--task=reversed-addition",
             "--digits=2",          "--batch=16",        "--stage=3",
             "--prefetch=1",        "--optimizer=adamw", "--lr=1e-2",
             "--max_grad_norm=1.0", "--seed=1",          "--threads=1"};
  j.interval = 20;
  j.kill_after = quick ? 30 : 50;
  j.steps = quick ? 45 : 80;
  return j;
}

JobSpec Mlp() {
  JobSpec j;
  j.name = "mlp";
  j.world = 2;
  j.flags = {"--model=mlp",      "--layers=20",
             "--width=2000",     "--activation=none",
             "--batch=20",       "--stage=3",
             "--optimizer=adam", "--lr=1e-4",
             "--threads=1",      "--collective_timeout=300s"};
  j.interval = 10;
  j.kill_after = 15;
  j.steps = 22;
  return j;
}

// Seed 001's model at W = 4 in HSDP (2 groups of 2): a replacement comes
// back from its replica (replace) or from the buddies' copies
// (replace_buddy).
JobSpec Hsdp() {
  JobSpec j = Mlp();
  j.name = "hsdp";
  j.world = 4;
  j.flags.push_back("--shard_group_size=2");
  return j;
}

std::string LoadAverage() {
  std::string text = testing::ReadFileOrEmpty("/proc/loadavg");
  std::vector<std::string> parts = absl::StrSplit(text, ' ');
  return parts.size() >= 3 ? absl::StrCat(parts[0], " ", parts[1], " ", parts[2]) : "?";
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double UnixMs() { return static_cast<double>(absl::ToUnixMillis(absl::Now())); }

// Rank 0's completed steps so far, from its "step N/M" lines (rank 0 alone
// prints them).
int CompletedSteps(const std::string& log) {
  int last = 0;
  for (size_t p = log.find("\nstep "); p != std::string::npos; p = log.find("\nstep ", p + 1)) {
    int n = 0;
    if (std::sscanf(log.c_str() + p + 6, "%d/", &n) == 1 &&
        log.find('/', p + 6) < log.find(' ', p + 6)) {
      last = std::max(last, n);
    }
  }
  return last;
}

// "1 replica", "3 buddy + 2 replica", or "-": the blobs a restore moved.
std::string Moved(const nlohmann::json& r) {
  if (!r.contains("transfers") || r["transfers"].empty()) return "-";
  std::vector<std::string> parts;
  for (const auto& [kind, count] : r["transfers"].items()) {
    parts.push_back(absl::StrCat(count.get<int>(), " ", kind));
  }
  return absl::StrJoin(parts, " + ");
}

std::string SnapshotMb(const nlohmann::json& r) {
  const int64_t bytes = r.value("snapshot_host_bytes_peak", int64_t{0});
  return bytes > 0 ? absl::StrFormat("%.0f", bytes / 1e6) : "-";
}

class Bench {
 public:
  explicit Bench(testing::LocalCluster* cluster) : cluster_(cluster) {}

  nlohmann::json Run(const JobSpec& job, const std::string& mode) {
    const std::string id = absl::StrCat(job.name, "-", mode);
    nlohmann::json out = {{"job", job.name},
                          {"world_size", job.world},
                          {"mode", mode},
                          {"interval", job.interval},
                          {"load_before", LoadAverage()}};
    std::vector<std::string> flags = job.flags;
    flags.push_back(absl::StrCat("--steps=", job.steps));
    // Disk checkpoints where the recovery needs them (replace and shrink
    // runs have none, so their steps show the snapshots' cost alone).
    if (mode == "disk" || mode == "restart_all") {
      flags.push_back(absl::StrCat("--checkpoint_every=", job.interval));
    }
    flags.push_back("--rejoin_timeout=120s");
    flags.push_back("--join_timeout_s=120");
    const bool w2_disk = mode == "disk" && job.world == 2;
    flags.push_back(
        absl::StrCat("--snapshot_every=", mode == "restart_all" || w2_disk ? 0 : job.interval));
    if (mode == "restart_all") flags.push_back("--max_recoveries=0");
    if (mode == "replace_buddy") flags.push_back("--snapshot_buddy=always");
    if (mode == "shrink") {
      flags.push_back(absl::StrCat("--min_world_size=", job.world - 1));
      flags.push_back("--rejoin_grace=" + absl::FormatDuration(absl::GetFlag(FLAGS_grace)));
    }
    std::vector<int> victims = {mode == "shrink" ? job.world - 1 : 1};
    if (mode == "disk" && job.world > 2) victims.push_back(2);  // rank 1's buddy (one host)

    cluster_->StartWorkers(id, job.world, flags);
    const std::string mark = absl::StrCat("\nstep ", job.kill_after, "/");
    if (!testing::WaitFor(
            [&] { return ("\n" + cluster_->WorkerLog(0)).find(mark) != std::string::npos; },
            absl::Minutes(10))) {
      return Failed(out, "rank 0 did not reach the kill step", job.world);
    }
    const int completed_at_kill = CompletedSteps("\n" + cluster_->WorkerLog(0));
    const double kill_ms = UnixMs();
    for (int v : victims) cluster_->worker(v)->Signal(SIGKILL);
    out["completed_at_kill"] = completed_at_kill;

    if (mode == "restart_all") return RestartAll(job, out, kill_ms, completed_at_kill, id);

    double spawn_ms = 0;
    if (mode != "shrink") {
      for (int v : victims) cluster_->RestartWorker(v);
      spawn_ms = UnixMs();
    }
    std::vector<int> codes = cluster_->WaitWorkers(absl::Minutes(15));
    for (size_t r = 0; r < codes.size(); ++r) {
      const bool gone = mode == "shrink" && static_cast<int>(r) == victims[0];
      if (!gone && codes[r] != 0)
        return Failed(out, absl::StrCat("worker ", r, " exited ", codes[r]), job.world);
    }
    nlohmann::json report = cluster_->Report(id, 0);
    if (report.is_discarded() || report["recoveries"].empty()) {
      return Failed(out, "rank 0 reported no recovery", job.world);
    }
    const nlohmann::json& rec = report["recoveries"][0];
    out["source"] = rec["source"];
    out["new_world_size"] = rec["world_size"];
    out["detection_s"] = (rec["confirmed_unix_ms"].get<double>() - kill_ms) / 1000;
    out["rejoin_s"] =
        (rec["joined_unix_ms"].get<double>() - rec["confirmed_unix_ms"].get<double>()) / 1000;
    out["restore_s"] = rec["restore_ms"].get<double>() / 1000;
    out["first_step_after_s"] = (rec["first_step_unix_ms"].get<double>() - kill_ms) / 1000;
    out["lost_steps"] = rec["failed_step"].get<int64_t>() - rec["restored_step"].get<int64_t>();
    // The blobs the restore moved, by kind (replica, buddy, peer).
    nlohmann::json kinds = nlohmann::json::object();
    for (const nlohmann::json& t : rec.value("transfers", nlohmann::json::array())) {
      kinds[t["kind"].get<std::string>()] = kinds.value(t["kind"].get<std::string>(), 0) + 1;
    }
    out["transfers"] = kinds;
    out["snapshot_host_bytes_peak"] = report["memory"].value("snapshot_host_bytes_peak", 0);
    if (mode != "shrink") {
      nlohmann::json replaced = cluster_->Report(id, victims[0]);
      if (!replaced.is_discarded() && replaced.contains("first_join_unix_ms")) {
        out["process_start_s"] = (replaced["first_join_unix_ms"].get<double>() - spawn_ms) / 1000;
      }
    }
    AddSteps(report, job.interval, &out);
    out["load_after"] = LoadAverage();
    return out;
  }

 private:
  nlohmann::json Failed(nlohmann::json out, const std::string& why, int world) {
    std::fprintf(stderr, "%s/%s: %s\n", out["job"].get<std::string>().c_str(),
                 out["mode"].get<std::string>().c_str(), why.c_str());
    for (int r = 0; r < world; ++r) {
      std::fprintf(stderr, "--- worker %d ---\n%s\n", r, cluster_->WorkerLog(r).c_str());
    }
    cluster_->WaitWorkers(absl::Seconds(1));
    out["error"] = why;
    return out;
  }

  // Snapshot pauses (before the kill's recovery: every one this process
  // took) and the median step.
  static void AddSteps(const nlohmann::json& report, int interval, nlohmann::json* out) {
    std::vector<double> pauses = report.value("snapshot_pause_ms", std::vector<double>{});
    std::vector<double> steps = report.value("step_ms", std::vector<double>{});
    (*out)["step_ms"] = Median(steps);
    // The snapshot's cost beyond its pause: the background copy and swap
    // share the CPUs with the step after the boundary (first generation
    // only: steps 1..kill, numbered from 1).
    std::vector<double> after, others;
    const int first_generation = (*out)["completed_at_kill"].get<int>();
    for (int i = 1; i < static_cast<int>(steps.size()) && i < first_generation; ++i) {
      (i % interval == 0 ? after : others).push_back(steps[i]);
    }
    if (!pauses.empty() && !after.empty()) {
      (*out)["step_ms_after_snapshot"] = Median(after);
      (*out)["step_ms_other"] = Median(others);
    }
    if (!pauses.empty()) {
      (*out)["snapshot_pause_ms"] = *std::max_element(pauses.begin(), pauses.end());
      (*out)["snapshot_pause_ms_median"] = Median(pauses);
      (*out)["snapshots_skipped"] = report.value("snapshots_skipped", 0);
      (*out)["snapshots_waited"] = report.value("snapshots_waited", 0);
      std::vector<double> transfers = report.value("snapshot_transfer_ms", std::vector<double>{});
      if (!transfers.empty()) (*out)["snapshot_transfer_ms_median"] = Median(transfers);
    }
  }

  nlohmann::json RestartAll(const JobSpec& job, nlohmann::json out, double kill_ms,
                            int completed_at_kill, const std::string& id) {
    // Detection: every survivor has exited.
    if (!testing::WaitFor(
            [&] {
              for (int r = 0; r < job.world; ++r) {
                if (r != 1 && cluster_->worker(r)->running()) return false;
              }
              return true;
            },
            absl::Minutes(2))) {
      return Failed(out, "the survivors did not exit", job.world);
    }
    const double detected_ms = UnixMs();
    // The step rank 0 completed last before it exited (it may have gone on
    // a little after the kill).
    const int completed = CompletedSteps("\n" + cluster_->WorkerLog(0));
    for (int r = 0; r < job.world; ++r) cluster_->RestartWorker(r, {"--resume=latest"});
    const double restart_ms = UnixMs();
    double restored_ms = 0, first_ms = 0;
    int restored_step = -1;
    testing::WaitFor(
        [&] {
          const std::string log = "\n" + cluster_->WorkerLog(0);
          if (restored_ms == 0) {
            const size_t p = log.find("\nrestored ");
            if (p != std::string::npos && log.find('\n', p + 1) != std::string::npos) {
              restored_ms = UnixMs();
              const size_t s = log.find("(step ", p);
              if (s != std::string::npos) restored_step = std::atoi(log.c_str() + s + 6);
            }
          }
          if (log.find("\nstep ") != std::string::npos) first_ms = UnixMs();
          return first_ms > 0;
        },
        absl::Minutes(5));
    std::vector<int> codes = cluster_->WaitWorkers(absl::Minutes(15));
    for (size_t r = 0; r < codes.size(); ++r) {
      if (codes[r] != 0)
        return Failed(out, absl::StrCat("worker ", r, " exited ", codes[r]), job.world);
    }
    if (first_ms == 0 || restored_step < 0) return Failed(out, "no restored step seen", job.world);
    out["source"] = "disk (restart all)";
    out["new_world_size"] = job.world;
    out["detection_s"] = (detected_ms - kill_ms) / 1000;
    out["rejoin_s"] = nullptr;
    out["restore_s"] = (restored_ms - restart_ms) / 1000;
    out["first_step_after_s"] = (first_ms - kill_ms) / 1000;
    out["lost_steps"] = std::max(completed, completed_at_kill) - restored_step;
    nlohmann::json report = cluster_->Report(id, 1);
    if (!report.is_discarded() && report.contains("first_join_unix_ms")) {
      out["process_start_s"] = (report["first_join_unix_ms"].get<double>() - restart_ms) / 1000;
    }
    AddSteps(cluster_->Report(id, 0), job.interval, &out);
    out["load_after"] = LoadAverage();
    return out;
  }

  testing::LocalCluster* cluster_;
};

std::string Seconds(const nlohmann::json& r, const char* key) {
  if (!r.contains(key) || r[key].is_null()) return "-";
  return absl::StrFormat("%.2f", r[key].get<double>());
}

int Main() {
  const bool quick = absl::GetFlag(FLAGS_quick);
  const double grace_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_grace));
  std::vector<JobSpec> jobs;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_jobs), ',')) {
    if (name == "gpt") jobs.push_back(Gpt(quick));
    if (name == "mlp" && !quick) jobs.push_back(Mlp());
    if (name == "hsdp" && !quick) jobs.push_back(Hsdp());
  }
  std::vector<std::string> modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  if (quick) modes = {"replace", "restart_all"};
  testing::LocalCluster cluster(testing::MakeTempDir("recovery-bench"));
  if (!cluster.ok()) return 1;
  Bench bench(&cluster);
  nlohmann::json results = nlohmann::json::array();
  for (const JobSpec& job : jobs) {
    for (const std::string& mode : modes) {
      std::fprintf(stderr, "recovery_bench: %s W=%d %s (load %s)\n", job.name.c_str(), job.world,
                   mode.c_str(), LoadAverage().c_str());
      results.push_back(bench.Run(job, mode));
    }
  }
  Table table({"JOB", "W", "MODE", "SOURCE", "W'", "DETECT s", "REJOIN s", "RESTORE s",
               "FIRST STEP s", "START s", "LOST", "PAUSE ms", "STEP ms", "MOVED", "SNAPSHOT MB",
               "TARGET", "LOAD"});
  for (nlohmann::json& r : results) {
    std::string target = "-";
    if (r.contains("error")) {
      target = "error: " + r["error"].get<std::string>();
    } else {
      std::vector<std::string> misses;
      const double first = r["first_step_after_s"];
      const double start = r.value("process_start_s", 0.0);
      if ((r["mode"] == "replace" || r["mode"] == "replace_buddy") && first > 2 + start) {
        misses.push_back(absl::StrFormat("first step %.2f > 2 + %.2f", first, start));
      }
      if (r["mode"] == "shrink" && first > grace_s + 2) {
        misses.push_back(absl::StrFormat("first step %.2f > grace %.0f + 2", first, grace_s));
      }
      if (r["mode"] != "restart_all" && r["lost_steps"].get<int>() > r["interval"].get<int>()) {
        misses.push_back("lost > interval");
      }
      if (r["job"] == "mlp" && r.contains("snapshot_pause_ms") &&
          r["snapshot_pause_ms"].get<double>() > 0.02 * r["step_ms"].get<double>()) {
        misses.push_back("pause > 2 % of step");
      }
      if (r["mode"] != "restart_all") target = misses.empty() ? "met" : absl::StrJoin(misses, "; ");
      r["targets_met"] = misses.empty();
    }
    table.AddRow({r["job"], absl::StrCat(r["world_size"].get<int>()), r["mode"],
                  r.value("source", "-"),
                  r.contains("new_world_size") ? absl::StrCat(r["new_world_size"].get<int>()) : "-",
                  Seconds(r, "detection_s"), Seconds(r, "rejoin_s"), Seconds(r, "restore_s"),
                  Seconds(r, "first_step_after_s"), Seconds(r, "process_start_s"),
                  r.contains("lost_steps") ? absl::StrCat(r["lost_steps"].get<int>()) : "-",
                  r.contains("snapshot_pause_ms")
                      ? absl::StrFormat("%.1f", r["snapshot_pause_ms"].get<double>())
                      : "-",
                  r.contains("step_ms") ? absl::StrFormat("%.0f", r["step_ms"].get<double>()) : "-",
                  Moved(r), SnapshotMb(r), target, r["load_before"]});
  }
  std::printf("%s", table.ToString().c_str());
  return WriteBenchJson(results, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
