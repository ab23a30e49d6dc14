// shardctl history and shardctl top: a job's per-step history, and a live
// view of every job and rank.
#include <poll.h>
#include <signal.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rank_rows.h"
#include "client/shardctl_commands.h"
#include "common/table.h"

ABSL_FLAG(bool, csv, false, "history: print CSV");
ABSL_FLAG(int, rank, -1,
          "history, status, top: only this rank (-1: every rank, or a large job's worst)");
ABSL_FLAG(std::string, host, "",
          "status, top: only this host's ranks (a job of more than 64 ranks: look them up); "
          "unfence: the machine whose fence is lifted (its hostname)");
ABSL_FLAG(int, top_iterations, 0, "top: refresh this many times, then exit (0: until q or Ctrl-C)");
ABSL_FLAG(absl::Duration, top_interval, absl::Seconds(1), "top: time between refreshes");

namespace zeroshard {
namespace {

std::atomic<bool> interrupted{false};
void OnInterrupt(int) { interrupted = true; }

// The terminal in non-canonical, no-echo mode for the life of the object
// (so a single 'q' is read at once), restored on destruction.
class RawTerminal {
 public:
  RawTerminal() {
    if (!isatty(STDIN_FILENO) || tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= ~(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    active_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
  }
  ~RawTerminal() {
    if (active_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }

 private:
  termios saved_{};
  bool active_ = false;
};

// Waits up to `timeout` for a key; true when it was 'q' (or stdin closed on a terminal).
bool QuitPressed(absl::Duration timeout) {
  pollfd fd{STDIN_FILENO, POLLIN, 0};
  if (!isatty(STDIN_FILENO)) {
    absl::SleepFor(timeout);
    return false;
  }
  if (poll(&fd, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) return false;
  char c = 0;
  return read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q');
}

std::string Ms(double ms) { return ms > 0 ? absl::StrFormat("%.1f ms", ms) : "-"; }

// One refresh: a header per job and a row per rank.
std::string Render(Client& client, const v1::GetStatusResponse& status, bool color) {
  const char* red = color ? "\033[1;31m" : "";
  const char* yellow = color ? "\033[1;33m" : "";
  const char* bold = color ? "\033[1m" : "";
  const char* reset = color ? "\033[0m" : "";
  std::string out = absl::StrCat(bold, "zeroshard top", reset, "  ",
                                 absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone()),
                                 "  (q or Ctrl-C quits)\n");
  if (status.jobs().empty()) absl::StrAppend(&out, "\nno jobs\n");
  for (const v1::JobStatus& job : status.jobs()) {
    std::string latest = "none";
    absl::StatusOr<v1::ListCheckpointsResponse> checkpoints = client.ListCheckpoints(job.job_id());
    if (checkpoints.ok()) {
      for (const v1::CheckpointInfo& c : checkpoints->checkpoints()) {
        if (c.complete()) latest = absl::StrCat("step ", c.step(), " (", c.verification(), ")");
      }
    }
    const int alive = AliveRanks(job);
    absl::StrAppend(&out, "\n", bold, "job ", job.job_id(), reset, "  ",
                    v1::JobState_Name(job.state()), "  generation ", job.generation(),
                    "  recoveries ", job.recoveries_size(), "  ranks ", alive, "/",
                    job.world_size(), "  latest checkpoint ", latest, "\n");
    for (const v1::Diagnosis& d : job.diagnoses()) {
      const bool straggler = d.kind() == v1::Diagnosis::STRAGGLER;
      absl::StrAppend(&out, straggler ? yellow : red,
                      straggler ? "STRAGGLER: " : "HANG: ", d.message(), reset, "\n");
    }
    const int rank = absl::GetFlag(FLAGS_rank);
    const std::string host = absl::GetFlag(FLAGS_host);
    absl::StrAppend(&out, HostsAndHistograms(job, rank, host));
    const RankRows rows = SelectRankRows(job, rank, host);
    if (!rows.caption.empty()) absl::StrAppend(&out, rows.caption, "\n");
    Table table({"RANK", "WORKER", "STEP", "STEP TIME", "LOSS", "ITEMS/S", "MEMORY",
                 "WAIT GATHER/REDUCE", "LAG", "IN COLLECTIVE", "HEARTBEAT", "FLAGS"});
    std::vector<int> flagged_rows;
    for (const v1::MemberStatus* row : rows.members) {
      const v1::MemberStatus& m = *row;
      if (m.rank() < 0) continue;
      const v1::StepTelemetry& s = m.last_step();
      table.AddRow({absl::StrCat(m.rank()), m.worker_id(), absl::StrCat(m.step()), Ms(s.step_ms()),
                    FormatLoss(m.loss()),
                    s.items_per_second() > 0 ? absl::StrFormat("%.0f", s.items_per_second()) : "-",
                    HumanBytes(static_cast<double>(m.memory_bytes())),
                    s.step_ms() > 0
                        ? absl::StrFormat("%.1f / %.1f ms", s.gather_wait_ms(), s.reduce_wait_ms())
                        : "-",
                    Ms(m.telemetry().arrival_lag_ms()), InCollective(m.telemetry()),
                    m.last_heartbeat_age_ms() < 0
                        ? "-"
                        : absl::StrFormat("%.1fs", m.last_heartbeat_age_ms() / 1000.0),
                    m.left()       ? "LEFT"
                    : m.rejoined() ? "REJOINED"
                    : !m.alive()   ? "DEAD"
                                   : MemberFlags(m)});
      flagged_rows.push_back(m.hung() ? 2 : m.straggler() ? 1 : 0);
    }
    // The table's lines: header, then one per row; flagged rows in color.
    std::vector<std::string> lines = absl::StrSplit(table.ToString(), '\n');
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].empty()) continue;
      const int flag = i >= 1 && i - 1 < flagged_rows.size() ? flagged_rows[i - 1] : 0;
      absl::StrAppend(&out,
                      flag == 2   ? red
                      : flag == 1 ? yellow
                                  : "",
                      lines[i], flag != 0 ? reset : "", "\n");
    }
  }
  return out;
}

}  // namespace

absl::Status CheckRankFlag() {
  const int rank = absl::GetFlag(FLAGS_rank);
  if (rank >= -1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--rank=", rank, ": expected a rank (0 or more); leave it out for every rank"));
}

int HistoryCommand() {
  const std::string job = absl::GetFlag(FLAGS_job);
  if (job.empty()) {
    std::fprintf(stderr, "shardctl history: --job=ID is required\n");
    return 2;
  }
  if (absl::Status s = CheckRankFlag(); !s.ok()) return FailUsage(s);
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  absl::StatusOr<v1::GetHistoryResponse> history =
      (*client)->GetHistory(job, absl::GetFlag(FLAGS_rank));
  if (!history.ok()) return Fail(history.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ProtoJson(*history).c_str());
    return 0;
  }
  if (absl::GetFlag(FLAGS_csv)) {
    std::printf("rank,step,unix_ms,loss,step_ms,items_per_second,memory_bytes\n");
    for (const v1::HistoryPoint& p : history->points()) {
      std::printf("%d,%lld,%lld,%.9g,%.6g,%.6g,%lld\n", p.rank(), static_cast<long long>(p.step()),
                  static_cast<long long>(p.unix_ms()), p.loss(), p.step_ms(), p.items_per_second(),
                  static_cast<long long>(p.memory_bytes()));
    }
    return 0;
  }
  Table table({"RANK", "STEP", "TIME", "LOSS", "STEP TIME", "ITEMS/S", "MEMORY"});
  for (const v1::HistoryPoint& p : history->points()) {
    table.AddRow({absl::StrCat(p.rank()), absl::StrCat(p.step()),
                  absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(p.unix_ms()),
                                   absl::LocalTimeZone()),
                  FormatLoss(p.loss()), Ms(p.step_ms()),
                  absl::StrFormat("%.0f", p.items_per_second()),
                  HumanBytes(static_cast<double>(p.memory_bytes()))});
  }
  std::printf("%s", table.ToString().c_str());
  return 0;
}

int TopCommand() {
  if (absl::Status s = CheckRankFlag(); !s.ok()) return FailUsage(s);
  if (absl::GetFlag(FLAGS_top_interval) <= absl::ZeroDuration() ||
      absl::GetFlag(FLAGS_top_iterations) < 0) {
    return FailUsage(absl::InvalidArgumentError(absl::StrCat(
        "--top_interval=", absl::FormatDuration(absl::GetFlag(FLAGS_top_interval)),
        " --top_iterations=", absl::GetFlag(FLAGS_top_iterations),
        ": expected a positive interval and 0 or more iterations (0: until q)")));
  }
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  const bool tty = isatty(STDOUT_FILENO);
  struct sigaction action {};
  action.sa_handler = OnInterrupt;  // no SA_RESTART: poll returns at once
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  RawTerminal raw;
  const int iterations = absl::GetFlag(FLAGS_top_iterations);
  if (tty) std::printf("\033[?1049h");  // the alternate screen: the shell's comes back on exit
  // A live view shows a failed read and tries again; the exit says whether
  // the last read failed (1, its error on stderr too), as `status` does.
  absl::Status last = absl::OkStatus();
  for (int i = 0; (iterations == 0 || i < iterations) && !interrupted; ++i) {
    absl::StatusOr<v1::GetStatusResponse> status =
        (*client)->GetStatus(StatusRequest(absl::GetFlag(FLAGS_job), absl::GetFlag(FLAGS_rank),
                                           absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_all)));
    last = status.status();
    std::string screen = status.ok()
                             ? Render(**client, *status, tty)
                             : absl::StrCat("shardctl top: ", status.status().ToString(), "\n");
    if (tty) {
      std::printf("\033[H\033[2J%s", screen.c_str());
    } else {
      std::printf("%s%s", i > 0 ? "\n" : "", screen.c_str());
    }
    std::fflush(stdout);
    if (iterations != 0 && i + 1 == iterations) break;
    if (QuitPressed(absl::GetFlag(FLAGS_top_interval))) break;
  }
  if (tty) std::printf("\033[?1049l");
  std::fflush(stdout);
  if (!last.ok()) return Fail(last);
  return 0;
}

}  // namespace zeroshard
