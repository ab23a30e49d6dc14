// deploy/slurm/zeroshard.sbatch under a real Slurm 22.05 cluster: slurmctld,
// slurmdbd and three slurmd nodes on emulated hosts (tests/slurm/
// slurm_cluster.h). The template is submitted as users submit it, with sbatch,
// and starts the shard server and one worker per node with srun:
//   - it trains, checkpoints and consolidates, and sacct's states and exit
//     codes agree with the ranks' reports;
//   - a node dies mid-job (its slurmd, step daemons and worker killed at
//     once): Slurm marks it DOWN, requeues the job (sbatch --requeue) onto the
//     nodes left, and the template resumes from the last complete checkpoint;
//   - scancel ends every process of the job on every node, and the last
//     complete checkpoint stays whole (a fresh server consolidates it).
// The cases share one cluster and run in this order (the second leaves host1
// down). Wall time on the 2-core dev machine: see docs/deploy.md.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/slurm/slurm_cluster.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

constexpr int kHosts = 3;
constexpr char kServer[] = "198.18.0.1:7070";  // host0 (the job's first node): ZS_PORT's default

// WaitFor at a Slurm client's pace: every check below runs sacct, scontrol or
// shardctl in a namespace (tens of ms of CPU), too much for a 10 ms loop.
bool Poll(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(500));
  }
}

// A timestamped line on stderr (the test log): where a case spends its time.
void Note(const std::string& what) {
  std::cerr << absl::FormatTime("%H:%M:%E3S ", absl::Now(), absl::UTCTimeZone()) << what
            << std::endl;
}

// The cluster of every case; null when it could not start (the reason is in
// g_missing or g_start_error).
std::unique_ptr<SlurmCluster> g_cluster;
std::string g_missing;
std::string g_start_error;
std::string g_dir;

// Training of every case: a small MLP, one BLAS thread (2 cores for 3 nodes).
std::string WorkerFlags(const std::string& run, int steps, int step_delay_ms) {
  return absl::StrCat("--model=mlp --layers=4 --width=256 --batch=32 --stage=3 --threads=1 ",
                      "--steps=", steps, " --checkpoint_every=10 --checkpoint_at_end ",
                      "--test_step_delay_ms=", step_delay_ms, " --report=", run,
                      "/report-{rank}.json");
}

class SlurmTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_missing = SlurmCluster::MissingRequirement();
    if (!g_missing.empty()) return;
    g_dir = MakeTempDir("slurm");
    Note("starting the cluster");
    absl::StatusOr<std::unique_ptr<SlurmCluster>> cluster = SlurmCluster::Start(kHosts);
    if (!cluster.ok()) {
      g_start_error = cluster.status().ToString();
      return;
    }
    g_cluster = *std::move(cluster);
    Note("cluster up: every node idle");
    // ZS_BIN_DIR: the binaries under the names the template runs.
    RunCommand(absl::StrCat("mkdir -p ", g_dir, "/bin"));
    for (const char* binary :
         {"shard_server/shard_server", "worker/shard_worker", "client/shardctl"}) {
      RunCommand(absl::StrCat("ln -sf \"$(realpath ", RunfilePath(binary), ")\" ", g_dir, "/bin/"));
    }
  }
  static void TearDownTestSuite() { g_cluster.reset(); }

  void SetUp() override {
    if (!g_missing.empty()) {
      // CI runs as root with tools/install_deps.sh's packages: never a skip there.
      const char* ci = getenv("CI");
      if (ci != nullptr && std::string(ci) == "true") FAIL() << g_missing;
      GTEST_SKIP() << g_missing;
    }
    ASSERT_NE(g_cluster, nullptr) << g_start_error;
  }

  SlurmCluster& cluster() { return *g_cluster; }

  // sbatch of the template with the case's settings, from directory `run`
  // (its ZS_SHARED_DIR): sbatch's exit code and output (the job id).
  std::pair<int, std::string> Submit(const std::string& run, const std::string& worker_flags,
                                     const std::string& sbatch_flags) {
    RunCommand("mkdir -p " + run);
    return cluster().Client(absl::StrCat(
        "cd ", run, " && export ZS_BIN_DIR=", g_dir, "/bin ZS_SHARED_DIR=", run,
        " ZS_BACKEND=gloo ZS_HEALTH_TIMEOUT_S=60 ZS_WORKER_FLAGS='", worker_flags, "' && ",
        "sbatch --parsable --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 ", "--time=10 --output=",
        run, "/slurm-%j.out ", sbatch_flags, " ", RunfilePath("deploy/slurm/zeroshard.sbatch")));
  }

  // The job's rows in sacct once its record there says `state` (slurmctld
  // hands records to slurmdbd asynchronously), or what sacct said last.
  std::vector<SacctRow> SacctOnce(const std::string& id, const std::string& state, int runs = 1) {
    std::vector<SacctRow> rows;
    Poll(
        [&] {
          rows = cluster().Sacct(id);
          int seen = 0;
          for (const SacctRow& r : rows) seen += (r.id == id);
          return seen == runs && !rows.empty() && Last(rows, id).state == state;
        },
        absl::Seconds(30));
    return rows;
  }

  // The last row of `id` (a job, "N.batch" or a step "N.K") in `rows`.
  static SacctRow Last(const std::vector<SacctRow>& rows, const std::string& id) {
    SacctRow last;
    for (const SacctRow& r : rows) {
      if (r.id == id) last = r;
    }
    return last;
  }

  // Steps of the job's complete checkpoints (`shardctl checkpoints`, column
  // COMPLETE "yes") on the server at `server`, from host0.
  std::vector<int> CompleteCheckpoints(const std::string& job,
                                       const std::string& server = kServer) {
    auto [code, output] = cluster().hosts().Run(
        0, absl::StrCat(g_dir, "/bin/shardctl --server=", server, " checkpoints --job=", job));
    std::vector<int> steps;
    if (code != 0) return steps;
    for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      int step = 0;
      if (f.size() >= 2 && f[1] == "yes" && absl::SimpleAtoi(f[0], &step)) steps.push_back(step);
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  }

  static nlohmann::json Report(const std::string& path) {
    std::ifstream in(path);
    if (!in) return nlohmann::json();
    return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }

  std::string JobOutput(const std::string& run, const std::string& id) {
    return ReadFileOrEmpty(absl::StrCat(run, "/slurm-", id, ".out"));
  }
};

TEST_F(SlurmTest, TrainsCheckpointsAndConsolidatesAndSacctAgrees) {
  const std::string run = g_dir + "/train";
  constexpr int kSteps = 40;
  auto [code, output] = Submit(run, WorkerFlags(run, kSteps, 0), "");
  ASSERT_EQ(code, 0) << output;
  const std::string id(absl::StripAsciiWhitespace(output));
  // Not sbatch --wait: it polls at 2, 4, 8... s.
  ASSERT_TRUE(
      Poll([&] { return cluster().JobField(id, "JobState") == "COMPLETED"; }, absl::Seconds(180)))
      << cluster().JobField(id, "JobState") << "\n"
      << JobOutput(run, id) << cluster().Logs();
  Note("job completed");
  const std::string out = JobOutput(run, id);
  EXPECT_TRUE(absl::StrContains(out, "2 workers on 2 nodes")) << out;

  // Slurm's view: the job, its batch script, the server step (stopped with
  // SIGTERM: a clean exit) and the worker step on both nodes, all 0.
  std::vector<SacctRow> rows = SacctOnce(id, "COMPLETED");
  const std::string server_step = id + ".0", worker_step = id + ".1";
  EXPECT_EQ(Last(rows, id).exit_code, "0:0");
  EXPECT_EQ(Last(rows, id + ".batch").state, "COMPLETED");
  EXPECT_EQ(Last(rows, server_step).name, "zeroshard-server");
  EXPECT_EQ(Last(rows, server_step).state, "COMPLETED");
  EXPECT_EQ(Last(rows, server_step).exit_code, "0:0");
  EXPECT_EQ(Last(rows, worker_step).state, "COMPLETED");
  EXPECT_EQ(Last(rows, worker_step).exit_code, "0:0");
  EXPECT_EQ(Last(rows, worker_step).nodes, "host[0-1]");

  // The run's view agrees: each rank trained every step, to the same
  // parameters (ZeRO: one model, sharded), and the last checkpoint merged.
  for (int rank = 0; rank < 2; ++rank) {
    nlohmann::json r = Report(absl::StrCat(run, "/report-", rank, ".json"));
    ASSERT_TRUE(r.is_object()) << "rank " << rank << " wrote no report\n" << out;
    EXPECT_EQ(r["losses"].size(), kSteps) << "rank " << rank;
  }
  EXPECT_EQ(Report(run + "/report-0.json")["params_sum"],
            Report(run + "/report-1.json")["params_sum"]);
  EXPECT_TRUE(
      absl::StrContains(out, absl::StrCat("consolidated step ", kSteps, " of job slurm-", id)))
      << out;
  // Named after the step merged: a continued or requeued run writes its own.
  const std::string model =
      absl::StrCat(run, "/models/slurm-", id, "-step", kSteps, ".safetensors");
  EXPECT_GT(ReadFileOrEmpty(model).size(), 256 * 1024 * 4) << model;  // >= the MLP's f32 weights
}

TEST_F(SlurmTest, ANodeLostMidJobIsRequeuedAndResumesFromTheLastCheckpoint) {
  const std::string run = g_dir + "/requeue";
  // 100 ms a step: the node dies between the first checkpoint (step 10) and
  // the end (step 60) whatever the machine's speed.
  constexpr int kSteps = 60;
  auto [code, output] = Submit(run, WorkerFlags(run, kSteps, 100), "--requeue");
  ASSERT_EQ(code, 0) << output;
  const std::string id(absl::StripAsciiWhitespace(output));
  const std::string job = "slurm-" + id;

  std::vector<int> complete;
  ASSERT_TRUE(
      Poll([&] { return !(complete = CompleteCheckpoints(job)).empty(); }, absl::Seconds(120)))
      << "no complete checkpoint within 120 s\n"
      << JobOutput(run, id) << cluster().Logs();
  // The job's second node (the first runs the server): host1 on a fresh cluster.
  auto [hcode, hosts] =
      cluster().Client(absl::StrCat("scontrol show hostnames \"$(squeue -h -j ", id, " -o %N)\""));
  std::vector<std::string> nodes = absl::StrSplit(hosts, '\n', absl::SkipEmpty());
  ASSERT_EQ(nodes.size(), 2u) << hosts;
  int victim = nodes[1].back() - '0';
  Note(absl::StrCat("complete checkpoint of step ", complete.back(), "; killing host", victim));
  cluster().KillHost(victim);

  // Slurm notices (SlurmdTimeout and its ping period: ~30 s here) and
  // requeues. A requeued job waits ~2 minutes before it is eligible (Slurm's
  // fixed delay); the test makes it eligible at once.
  ASSERT_TRUE(Poll([&] { return cluster().JobField(id, "Restarts") == "1"; }, absl::Seconds(120)))
      << "the job was not requeued within 120 s of host" << victim
      << "'s death: " << cluster().JobField(id, "JobState") << "\n"
      << cluster().Logs();
  Note("requeued");
  EXPECT_TRUE(Poll([&] { return absl::StartsWith(cluster().NodeState(victim), "down"); },
                   absl::Seconds(30)))
      << "NodeState(" << victim << ") = '" << cluster().NodeState(victim) << "'\n"
      << cluster().Client("sinfo -N -o '%N %T %E'").second;
  ASSERT_TRUE(
      Poll([&] { return cluster().JobField(id, "JobState") == "PENDING"; }, absl::Seconds(60)))
      << cluster().JobField(id, "JobState");
  auto [ucode, uout] =
      cluster().Client(absl::StrCat("scontrol update jobid=", id, " StartTime=now"));
  ASSERT_EQ(ucode, 0) << uout;
  Note("requeued job eligible");
  ASSERT_TRUE(
      Poll([&] { return cluster().JobField(id, "JobState") == "COMPLETED"; }, absl::Seconds(180)))
      << cluster().JobField(id, "JobState") << "\n"
      << JobOutput(run, id) << cluster().Logs();

  Note("requeued job completed");
  // Slurm's view: the first run failed with its node, the second completed
  // on the nodes left.
  std::vector<SacctRow> rows = SacctOnce(id, "COMPLETED", /*runs=*/2);
  std::vector<SacctRow> job_rows;
  for (const SacctRow& r : rows) {
    if (r.id == id) job_rows.push_back(r);
  }
  ASSERT_EQ(job_rows.size(), 2u);
  EXPECT_EQ(job_rows[0].state, "NODE_FAIL");
  EXPECT_EQ(job_rows[1].state, "COMPLETED");
  EXPECT_EQ(job_rows[1].exit_code, "0:0");
  EXPECT_FALSE(absl::StrContains(job_rows[1].nodes, std::to_string(victim))) << job_rows[1].nodes;

  // The run's view: the second run resumed (from the checkpoint of a step
  // at least the one seen before the kill) and trained to the end.
  const std::string out = JobOutput(run, id);
  EXPECT_TRUE(absl::StrContains(out, absl::StrCat("restart 1 of job ", id, ", resume: latest")))
      << out;
  for (int rank = 0; rank < 2; ++rank) {
    nlohmann::json r = Report(absl::StrCat(run, "/report-", rank, ".json"));
    ASSERT_TRUE(r.is_object()) << "rank " << rank << "\n" << out;
    EXPECT_LE(r["losses"].size(), static_cast<size_t>(kSteps - complete.back()))
        << "rank " << rank << " did not resume from step " << complete.back() << " or later";
  }
  EXPECT_TRUE(absl::StrContains(out, absl::StrCat("consolidated step ", kSteps, " of job ", job)))
      << out;
}

// Processes whose command line mentions `needle`.
std::vector<std::string> ProcessesMentioning(const std::string& needle) {
  std::vector<std::string> found;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return found;
  while (dirent* entry = readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry->d_name, &pid) || pid == getpid()) continue;
    std::string cmdline = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/cmdline"));
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (absl::StrContains(cmdline, needle)) found.push_back(absl::StrCat(pid, ": ", cmdline));
  }
  closedir(proc);
  return found;
}

TEST_F(SlurmTest, ScancelEndsEveryProcessAndKeepsTheLastCompleteCheckpoint) {
  const std::string run = g_dir + "/cancel";
  constexpr int kSteps = 600;  // 60 s at 100 ms a step: cancelled long before its end
  auto [code, output] = Submit(run, WorkerFlags(run, kSteps, 100), "");
  ASSERT_EQ(code, 0) << output;
  const std::string id(absl::StripAsciiWhitespace(output));
  const std::string job = "slurm-" + id;
  std::vector<int> complete;
  ASSERT_TRUE(
      Poll([&] { return (complete = CompleteCheckpoints(job)).size() >= 2; }, absl::Seconds(120)))
      << JobOutput(run, id) << cluster().Logs();
  complete = CompleteCheckpoints(job);  // the last one complete just before scancel
  Note(absl::StrCat("scancel at complete checkpoint ", complete.back()));
  ASSERT_EQ(cluster().Client("scancel " + id).first, 0);

  // Every process of the job gone, on every node: the server, the workers,
  // their restart loops and slurmstepd (its command line names the job).
  std::vector<std::string> left;
  EXPECT_TRUE(Poll(
      [&] {
        left = ProcessesMentioning(run);
        for (const std::string& p : ProcessesMentioning(absl::StrCat("slurmstepd: [", id, ".")))
          left.push_back(p);
        return left.empty();
      },
      absl::Seconds(60)))
      << "still running 60 s after scancel:\n"
      << absl::StrJoin(left, "\n");
  std::vector<SacctRow> rows = SacctOnce(id, "CANCELLED");
  EXPECT_EQ(Last(rows, id).state, "CANCELLED");
  // The run's view agrees: no rank reports a finished run.
  for (int rank = 0; rank < 2; ++rank) {
    nlohmann::json r = Report(absl::StrCat(run, "/report-", rank, ".json"));
    EXPECT_TRUE(!r.is_object() || r["losses"].size() < kSteps) << "rank " << rank;
  }

  // A fresh server on the job's state and checkpoints: the last complete
  // checkpoint is there, at or after the one seen before scancel, and merges.
  auto server = cluster().hosts().Start(
      0, RunfilePath("shard_server/shard_server"),
      {"--listen=0.0.0.0:7071", "--insecure", "--state_dir=" + run + "/state",
       "--checkpoint_root=" + run + "/checkpoints"},
      run + "/server-after.log");
  std::vector<int> after;
  ASSERT_TRUE(Poll([&] { return !(after = CompleteCheckpoints(job, "198.18.0.1:7071")).empty(); },
                   absl::Seconds(60)))
      << server->Log();
  EXPECT_GE(after.back(), complete.back());
  auto [ccode, cout] = cluster().hosts().Run(
      0, absl::StrCat(g_dir, "/bin/shardctl --server=198.18.0.1:7071 consolidate --job=", job,
                      " --step=latest --out=", run, "/after.safetensors"));
  EXPECT_EQ(ccode, 0) << cout;
  EXPECT_TRUE(absl::StrContains(cout, absl::StrCat("consolidated step ", after.back()))) << cout;
}

}  // namespace
}  // namespace zeroshard::testing
