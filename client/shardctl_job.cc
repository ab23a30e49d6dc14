// shardctl job create --job=ID --job_tokens_dir=DIR: issues a job token, a
// file the server's --job_tokens_dir reads (shard_server/auth/job_credentials.h).
// Run where that directory is (the server's machine, or a volume it mounts);
// hand the file to the job's workers (--token_file).
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/shardctl_commands.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "common/job_token_file.h"

ABSL_FLAG(std::string, job_tokens_dir, "",
          "job create: the server's --job_tokens_dir, where the job's token file is written");

namespace zeroshard {

int JobCommand(const std::string& verb) {
  if (verb != "create") {
    std::fprintf(stderr, "shardctl job: unknown verb '%s' (expected: create)\n", verb.c_str());
    return 2;
  }
  const std::string job = absl::GetFlag(FLAGS_job);
  const std::string dir = absl::GetFlag(FLAGS_job_tokens_dir);
  if (job.empty() || dir.empty()) {
    std::fprintf(stderr, "shardctl job create needs --job=ID and --job_tokens_dir=DIR\n");
    return 2;
  }
  absl::StatusOr<std::string> token = CreateJobTokenFile(dir, job);
  if (!token.ok()) return Fail(token.status());
  const std::string path = JobTokenPath(dir, job);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", nlohmann::json{{"job", job}, {"token_file", path}}.dump(1).c_str());
    return 0;
  }
  Table table({"JOB", "TOKEN FILE"});
  table.AddRow({job, path});
  std::printf("%s", table.ToString().c_str());
  std::printf("give the job's workers this file (--token_file); it acts on job '%s' only\n",
              job.c_str());
  return 0;
}

}  // namespace zeroshard
