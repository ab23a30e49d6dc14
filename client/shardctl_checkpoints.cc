// shardctl checkpoints / consolidate.
//
//   shardctl checkpoints --job=ID [--json]
//   shardctl consolidate --job=ID --step=N|latest --out=PATH [--weights_only]
//       [--dtype=f32|bf16|f16] [--max_shard_bytes=B] [--format=safetensors|hf]
//       [--on_server] [--json]
//
// consolidate streams the merged bytes to this machine by default (--out is
// a file, or a directory for Hugging Face shards); --on_server leaves them
// under the server's checkpoint root instead.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/shardctl_commands.h"
#include "common/file_util.h"
#include "common/hf_gpt2_config.h"
#include "common/table.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, step, "latest",
          "consolidate: the step to merge, N or 'latest' (the job's latest complete step)");
ABSL_FLAG(std::string, out, "",
          "consolidate: where the merged bytes go on this machine: the output file, or a "
          "directory with --max_shard_bytes");
ABSL_FLAG(bool, weights_only, false, "consolidate: leave out the optimizer state");
ABSL_FLAG(bool, force, false,
          "consolidate: replace an existing --out file (or write into a non-empty --out "
          "directory); without it, an existing output is refused");
ABSL_FLAG(std::string, dtype, "f32",
          "consolidate: parameter dtype in the output: f32, bf16 or f16 (the optimizer state "
          "stays f32)");
ABSL_FLAG(int64_t, max_shard_bytes, 0,
          "consolidate: > 0 writes Hugging Face shards of at most this many tensor bytes each "
          "(a larger tensor gets its own file) plus model.safetensors.index.json");
ABSL_FLAG(std::string, format, "safetensors",
          "consolidate: safetensors (--out is a file, or a directory with --max_shard_bytes) or "
          "hf: --out is a Hugging Face model directory that GPT2LMHeadModel.from_pretrained "
          "loads (config.json, generation_config.json, model.safetensors or shards + index)");
ABSL_FLAG(bool, on_server, false,
          "consolidate: write under the server's <checkpoint_root>/<job>/consolidated/step-<N>/ "
          "instead of streaming the bytes here");

namespace zeroshard {
namespace {

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms),
                          absl::LocalTimeZone());
}

std::string FormatDuration(double seconds) {
  if (seconds < 0 || seconds > 1e7) return "?";
  int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

// A one-line progress bar on stderr, redrawn at most 10 times a second, only
// when stderr is a terminal (logs of scripts stay clean).
class ProgressBar {
 public:
  explicit ProgressBar(bool streamed) : streamed_(streamed), enabled_(isatty(2) == 1) {}

  void Update(const ConsolidateProgress& p) {
    if (!enabled_) return;
    absl::Time now = absl::Now();
    if (now - last_draw_ < absl::Milliseconds(100) && p.work_done < p.work_total) return;
    last_draw_ = now;
    const double elapsed = absl::ToDoubleSeconds(now - start_);
    const double fraction =
        p.work_total > 0 ? static_cast<double>(p.work_done) / p.work_total : 0.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    // The rate is of output bytes received; the ETA follows the server's
    // progress, which counts its verification pass too.
    const double bytes = streamed_ ? static_cast<double>(p.bytes_received)
                                   : static_cast<double>(p.work_done);
    const double rate = elapsed > 0 ? bytes / elapsed : 0;
    const double eta = fraction > 0 ? elapsed * (1 - fraction) / fraction : -1;
    std::fprintf(stderr, "\r[%s] %3.0f%%  %s  %s/s  ETA %s   ", bar.c_str(), 100 * fraction,
                 HumanBytes(bytes).c_str(), HumanBytes(rate).c_str(),
                 FormatDuration(eta).c_str());
    std::fflush(stderr);
    drawn_ = true;
  }
  void Done() {
    if (drawn_) std::fprintf(stderr, "\n");
  }

 private:
  const bool streamed_;
  const bool enabled_;
  const absl::Time start_ = absl::Now();
  absl::Time last_draw_ = absl::InfinitePast();
  bool drawn_ = false;
};

// config.json and generation_config.json for `hf_config` (the GPT2Config
// the workers recorded) in `dir`, each written atomically; their paths.
absl::StatusOr<std::vector<std::string>> WriteHfConfigFiles(const std::string& dir,
                                                            const std::string& hf_config) {
  const std::string path = absl::StrCat(dir, "/config.json");
  absl::StatusOr<HfGpt2Config> config = ParseHfGpt2Config(hf_config, "the recorded model config");
  if (!config.ok()) return config.status();
  std::vector<std::string> paths = {path, absl::StrCat(dir, "/generation_config.json")};
  if (absl::Status s = WriteFileAtomically(paths[0], HfGpt2ConfigJson(*config)); !s.ok()) return s;
  if (absl::Status s = WriteFileAtomically(paths[1], HfGpt2GenerationConfigJson(*config));
      !s.ok()) {
    return s;
  }
  return paths;
}

}  // namespace

int CheckpointsCommand() {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  const std::string job = absl::GetFlag(FLAGS_job);
  absl::StatusOr<v1::ListCheckpointsResponse> list = (*client)->ListCheckpoints(job);
  if (!list.ok()) return Fail(list.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ProtoJson(*list).c_str());
    return 0;
  }
  if (list->checkpoints().empty()) {
    std::printf("no checkpoints%s\n", job.empty() ? "" : absl::StrCat(" of job ", job).c_str());
    return 0;
  }
  std::vector<std::string> header = {"STEP",    "COMPLETE", "VERIFIED", "RANKS",
                                     "SIZE",    "CREATED",  "MANIFEST"};
  if (job.empty()) header.insert(header.begin(), "JOB");
  Table table(header);
  for (const v1::CheckpointInfo& c : list->checkpoints()) {
    std::vector<std::string> row = {absl::StrCat(c.step()),
                                    c.complete() ? "yes" : (c.failure().empty() ? "no" : "failed"),
                                    c.verification().empty() ? "-" : c.verification(),
                                    absl::StrCat(c.committed(), "/", c.world_size()),
                                    HumanBytes(static_cast<double>(c.total_bytes())),
                                    FormatTime(c.created_unix_ms()),
                                    c.manifest().empty() ? "-" : c.manifest()};
    if (job.empty()) row.insert(row.begin(), c.job_id());
    table.AddRow(std::move(row));
  }
  std::printf("%s", table.ToString().c_str());
  for (const v1::CheckpointInfo& c : list->checkpoints()) {
    if (c.verification() == "failed") {
      std::printf("step %lld of job %s failed verification (not used as \"latest\"): %s\n",
                  static_cast<long long>(c.step()), c.job_id().c_str(),
                  c.verification_error().c_str());
    }
    if (!c.failure().empty()) std::printf("job %s: %s\n", c.job_id().c_str(), c.failure().c_str());
  }
  return 0;
}

// --out before anything is asked of the server: a regular file or a
// directory may be replaced or written into only with --force; anything
// else (a device, a FIFO) never.
static absl::Status CheckOutput(const std::string& out, bool force) {
  struct stat st;
  if (stat(out.c_str(), &st) != 0) {  // new: the usual case, in a directory it can write
    // The directory it goes in (a trailing slash names the new directory
    // itself, which the writer makes: "dir/" is in ".").
    const size_t end = out.find_last_not_of('/');
    const size_t slash = end == std::string::npos ? 0 : out.find_last_of('/', end);
    const std::string parent =
        slash == std::string::npos ? "." : (slash == 0 ? "/" : out.substr(0, slash));
    if (access(parent.c_str(), W_OK | X_OK) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--out=", out, ": its directory ", parent,
          errno == ENOENT ? " does not exist" : absl::StrCat(" is not writable (", std::strerror(errno), ")"),
          "; create it, or give a path in a directory you can write"));
    }
    return absl::OkStatus();
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* dir = opendir(out.c_str());
    bool empty = true;
    if (dir != nullptr) {
      while (dirent* entry = readdir(dir)) {
        const std::string name = entry->d_name;
        if (name != "." && name != "..") empty = false;
      }
      closedir(dir);
    }
    if (empty || force) return absl::OkStatus();
    return absl::AlreadyExistsError(
        absl::StrCat("--out=", out,
                     " is a directory that is not empty; pass --force to write into it "
                     "(files of the same names are replaced), or give a new path"));
  }
  if (absl::Status s = CheckReplaceable(out); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("--out=", s.message()));
  }
  if (force) return absl::OkStatus();
  return absl::AlreadyExistsError(absl::StrCat("--out=", out,
                                               " exists; pass --force to replace it, or give "
                                               "a new path"));
}

// The request the flags describe, every flag checked before the server is
// asked anything (--out included).
static absl::StatusOr<v1::ConsolidateRequest> ConsolidateRequestFromFlags() {
  v1::ConsolidateRequest request;
  request.set_job_id(absl::GetFlag(FLAGS_job));
  if (request.job_id().empty()) return absl::InvalidArgumentError("consolidate needs --job=ID");
  const std::string step = absl::GetFlag(FLAGS_step);
  int64_t step_number = -1;
  if (step != "latest" && (!absl::SimpleAtoi(step, &step_number) || step_number < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--step=", step, " is not a step; expected N >= 0 or 'latest'"));
  }
  request.set_step(step_number);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "f32" && dtype != "bf16" && dtype != "f16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", dtype, " is not an output dtype; expected f32, bf16 or f16"));
  }
  request.set_dtype(dtype);
  request.set_weights_only(absl::GetFlag(FLAGS_weights_only));
  if (absl::GetFlag(FLAGS_max_shard_bytes) < 0) {
    return absl::InvalidArgumentError("--max_shard_bytes must be >= 0 (0: one file)");
  }
  request.set_max_shard_bytes(absl::GetFlag(FLAGS_max_shard_bytes));
  request.set_on_server(absl::GetFlag(FLAGS_on_server));
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty() && !request.on_server()) {
    return absl::InvalidArgumentError(
        "consolidate needs --out=PATH (a file, or a directory with --max_shard_bytes), or "
        "--on_server to write under the server's checkpoint root");
  }
  if (!request.on_server()) {
    if (absl::Status s = CheckOutput(out, absl::GetFlag(FLAGS_force)); !s.ok()) return s;
  }
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "safetensors" && format != "hf") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format=", format, " is not an output format; expected safetensors or hf"));
  }
  const bool hf = format == "hf";
  if (hf && request.on_server()) {
    return absl::InvalidArgumentError(
        "--format=hf writes a model directory on this machine; leave out --on_server");
  }
  // from_pretrained wants exactly the model's tensors.
  if (hf) request.set_weights_only(true);
  request.set_require_hf_config(hf);
  return request;
}

static void PrintConsolidateSummary(const v1::ConsolidateRequest& request,
                                    const v1::ConsolidateSummary& summary, double seconds) {
  const double gbps = summary.total_bytes() / 1e9 / std::max(seconds, 1e-9);
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::ordered_json j;
    j["job"] = request.job_id();
    j["step"] = summary.step();
    j["files"] = std::vector<std::string>(summary.files().begin(), summary.files().end());
    j["total_bytes"] = summary.total_bytes();
    j["seconds"] = seconds;
    j["gbps"] = gbps;
    j["on_server"] = request.on_server();
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("consolidated step %lld of job %s%s: %d file%s, %s in %.2f s (%.2f GB/s)\n",
              static_cast<long long>(summary.step()), request.job_id().c_str(),
              request.on_server() ? " on the server" : "", summary.files_size(),
              summary.files_size() == 1 ? "" : "s",
              HumanBytes(static_cast<double>(summary.total_bytes())).c_str(), seconds, gbps);
  for (const std::string& f : summary.files()) std::printf("  %s\n", f.c_str());
}

int ConsolidateCommand() {
  absl::StatusOr<v1::ConsolidateRequest> request = ConsolidateRequestFromFlags();
  if (!request.ok()) return Fail(request.status());
  const std::string out = absl::GetFlag(FLAGS_out);
  const bool hf = request->require_hf_config();
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  // A Hugging Face directory is made here, and removed again (while still
  // empty) if the consolidation fails: nothing is left half-written.
  bool made_dir = false;
  if (hf) {
    if (mkdir(out.c_str(), 0755) == 0) {
      made_dir = true;
    } else if (errno != EEXIST) {
      return Fail(ErrnoStatus(errno, "cannot create the output directory", out));
    }
  }
  ProgressBar bar(!request->on_server());
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ConsolidateSummary> summary = (*client)->Consolidate(
      *request, out, [&bar](const ConsolidateProgress& p) { bar.Update(p); });
  bar.Done();
  if (summary.ok() && hf) {
    absl::StatusOr<std::vector<std::string>> written = WriteHfConfigFiles(out, summary->hf_config());
    if (!written.ok()) summary = written.status();
    for (const std::string& path : written.ok() ? *written : std::vector<std::string>{}) {
      summary->add_files(path);
    }
  }
  if (!summary.ok()) {
    if (made_dir) rmdir(out.c_str());
    return Fail(summary.status());
  }
  PrintConsolidateSummary(*request, *summary, absl::ToDoubleSeconds(absl::Now() - start));
  return 0;
}

}  // namespace zeroshard
