// shard_worker: one training process of a zeroshard job.
//
//   shard_worker --server=HOST:PORT --job=ID --world_size=W --model=mlp
//       --layers=20 --width=2000 --stage=3 --steps=100
//
// Joins the job, gets its rank and the shard plan from the server, bootstraps
// Gloo (or NCCL) through the server's KV store, and trains with ZeRO stage
// 0-3. Progress goes to stderr (rank 0); --report writes a JSON summary.
//
// Exit codes: 0 done (or the job finished while this worker waited to
// grow it back: a replacement, or a survivor left out of a shrink to whole
// shard groups; docs/recovery.md, "Grow back"); 1 a failure (a non-finite
// step under --on_nonfinite=stop included, even when a peer's exit ended
// the generation first); 2 a bad flag (or a device this build or
// machine cannot use), found before joining; 3 the server aborted the job
// generation or fenced this member. Every failure is one line on stderr,
// "shard_worker rank R: <message>" ("shard_worker: ..." before joining).
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/command_line.h"
#include "worker/abort_latch.h"
#include "worker/input_checks.h"
#include "worker/model/blas_kernel.h"
#include "worker/nonfinite_policy.h"
#include "worker/worker.h"
#include "worker/worker_config.h"

ABSL_FLAG(std::string, blas_kernel, "auto",
          "OpenBLAS kernel set: auto (OpenBLAS's choice unless it is below what this CPU runs, "
          "e.g. Prescott on a CPU newer than that OpenBLAS; then SkylakeX, Haswell or Sandybridge "
          "by the CPU's widest extension), openblas (its choice, always), or a name such as "
          "SkylakeX or Haswell. OPENBLAS_CORETYPE in the environment wins over this flag");

namespace zeroshard {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitBadConfig = 2;
constexpr int kExitAborted = 3;

// After the server's abort, the phases unwind and the process tears down in
// order, normally within milliseconds (the abort breaks the data plane). A
// thread blocked where no abort reaches (a slow file write, a long RPC) must
// not keep a dead generation's process alive: the watchdog exits after this.
// The same bound holds for the teardown after any other failure.
constexpr absl::Duration kAbortGrace = absl::Seconds(10);

void PrintFailure(int rank, absl::string_view message) {
  std::fprintf(stderr, "shard_worker%s: %s\n",
               rank >= 0 ? absl::StrCat(" rank ", rank).c_str() : "", std::string(message).c_str());
  std::fflush(stderr);
}

// The life cycle of a worker, in order; the first error ends it. `rank`
// follows the worker's, for the watchdog.
absl::Status LifeCycle(Worker& worker, std::atomic<int>* rank) {
  absl::Status s;
  // A generation that ends under the worker (a peer died) is recovered from
  // in this process: join the next one and resume (worker.h, "Recovery").
  while (true) {
    s = worker.Join();
    if (absl::IsOutOfRange(s)) {
      // The server's answer to a join that waited to grow the job back when
      // the job finished (every member left): the job succeeded without
      // this worker; nothing is wrong, and there is nothing to report.
      std::fprintf(stderr, "shard_worker: %s; exiting 0 (without a report)\n",
                   std::string(s.message()).c_str());
      return absl::OkStatus();
    }
    rank->store(worker.rank());
    if (s.ok()) s = worker.Plan();
    if (s.ok()) s = worker.BootstrapDataPlane();
    if (s.ok()) s = worker.Restore();
    if (s.ok()) s = worker.Train();
    if (s.ok()) break;
    if (absl::Status why = worker.PrepareRecovery(s); !why.ok()) return why;
  }
  if (s.ok()) s = worker.Report();
  if (s.ok()) s = worker.Leave();
  if (s.ok() && !worker.last_checkpoint_failure().ok()) {
    return absl::Status(
        worker.last_checkpoint_failure().code(),
        absl::StrCat("training finished, but its last checkpoint failed (",
                     worker.last_checkpoint_failure().message(),
                     "); the job's latest complete checkpoint is an earlier one (shardctl "
                     "checkpoints lists them)"));
  }
  return s;
}

int RunWorker() {
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
  if (!config.ok()) {
    PrintFailure(-1, config.status().message());
    return kExitBadConfig;
  }
  // Before joining: a bad input fails this worker alone, not its job.
  if (absl::Status s = CheckInputsBeforeJoining(*config); !s.ok()) {
    PrintFailure(-1, s.message());
    return kExitBadConfig;
  }
  std::atomic<int> rank{-1};
  AbortLatch abort(kAbortGrace, [&rank](const std::string& message) {
    PrintFailure(rank.load(),
                 absl::StrCat(message, " (still running ", absl::FormatDuration(kAbortGrace),
                              " after the abort: exiting now)"));
    std::_Exit(kExitAborted);
  });
  auto worker = std::make_unique<Worker>(*std::move(config), &abort);
  // Before joining, so that a misconfigured job fails fast and alone.
  if (absl::Status s = worker->OpenDevice(); !s.ok()) {
    PrintFailure(-1, s.message());
    return kExitBadConfig;
  }
  // The model and its data, before joining too: a file that does not open
  // or a size the model refuses is this worker's input, which a restart
  // does not mend (exit 2, as a bad flag: launchers do not retry it).
  if (absl::Status s = worker->LoadTask(); !s.ok()) {
    PrintFailure(-1, s.message());
    return absl::IsUnavailable(s) || absl::IsResourceExhausted(s) || absl::IsInternal(s)
               ? kExitFailure
               : kExitBadConfig;
  }
  const absl::Status status = LifeCycle(*worker, &rank);
  int code = 0;
  if (abort.tripped() && !IsNonFiniteStop(status)) {
    // Whatever failed, the abort is why (the broken data plane's errors
    // included); a recovery that was refused says why too.
    code = kExitAborted;
    PrintFailure(rank.load(), absl::StrContains(status.message(), "not recovering")
                                  ? status.message()
                                  : abort.message());
  } else if (!status.ok()) {
    code = kExitFailure;
    PrintFailure(rank.load(), status.message());
    if (worker->failed_on_inputs()) {
      // The job's inputs: its peers are told (the job fails now rather than
      // wait --rejoin_timeout for this rank), and launchers see exit 2, as
      // for a bad flag: a restart would fail the same way.
      worker->ReportFailure(status);
      code = kExitBadConfig;
    }
    // Tearing down waits for the checkpoint in flight, whose commit to a
    // server that is gone could take minutes; the exit must not.
    std::thread([] {
      absl::SleepFor(kAbortGrace);
      std::_Exit(kExitFailure);
    }).detach();
  }
  worker.reset();  // tears the generation down; the watchdogs cover a hang
  abort.Disarm();
  return code;
}

// OpenBLAS reads OPENBLAS_CORETYPE only when it loads: to change its pick,
// set it and execute this binary again (same arguments; the environment then
// holds the choice, so this happens at most once). Exits 2 on a bad value.
void UseBlasKernelOrExit(char** argv) {
  const std::string flag = absl::GetFlag(FLAGS_blas_kernel);
  const char* loaded = BlasKernel();
  const char* environment = std::getenv("OPENBLAS_CORETYPE");
  absl::StatusOr<std::string> kernel = KernelToSet(flag, loaded, KernelForThisCpu(), environment);
  if (!kernel.ok()) {
    std::fprintf(stderr, "shard_worker: %s\n", std::string(kernel.status().message()).c_str());
    std::exit(2);
  }
  if (kernel->empty()) {
    if (environment != nullptr && KernelLevel(environment) >= 0 &&
        !absl::EqualsIgnoreCase(environment, loaded)) {
      std::fprintf(stderr,
                   "note: OPENBLAS_CORETYPE=%s, but this OpenBLAS loaded its %s kernels "
                   "(it was built without %s)\n",
                   environment, loaded, environment);
    }
    return;
  }
  std::fprintf(stderr, "note: OpenBLAS chose its %s kernels%s; running again with "
                       "OPENBLAS_CORETYPE=%s (--blas_kernel=openblas keeps its choice)\n",
               loaded,
               flag == "auto" ? ", below what this CPU runs (that OpenBLAS does not know this CPU)"
                              : "",
               kernel->c_str());
  setenv("OPENBLAS_CORETYPE", kernel->c_str(), /*overwrite=*/1);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "shard_worker: cannot execute /proc/self/exe again (%s); going on with %s\n",
               std::strerror(errno), loaded);
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("zeroshard worker: joins a job and trains with ZeRO stage 0-3");
  zeroshard::ParseCommandLineOrExit(argc, argv, /*bad_flag_exit_code=*/2);
  zeroshard::UseBlasKernelOrExit(argv);
  return zeroshard::RunWorker();
}
