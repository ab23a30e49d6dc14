// shardctl job create --job=ID --job_tokens_dir=DIR: issues a job token, a
// file the server's --job_tokens_dir reads (shard_server/auth/job_credentials.h).
// Run where that directory is (the server's machine, or a volume it mounts);
// hand the file to the job's workers (--token_file).
//
// shardctl unfence --job=ID --host=HOSTNAME: lifts the fence the server put
// on a machine whose rank's shard was corrupted twice (docs/numerics.md),
// once the machine was checked; the admin token's call.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/shardctl_commands.h"
#include "common/job_token_file.h"
#include "common/table.h"
#include "nlohmann/json.hpp"

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

namespace zeroshard {

int UnfenceCommand() {
  const std::string job = absl::GetFlag(FLAGS_job);
  const std::string host = absl::GetFlag(FLAGS_host);
  if (job.empty() || host.empty()) {
    std::fprintf(stderr,
                 "shardctl unfence needs --job=ID and --host=HOSTNAME (the machine `shardctl "
                 "status --job=ID` lists as FENCED)\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  absl::StatusOr<v1::UnfenceHostResponse> lifted = (*client)->UnfenceHost(job, host);
  if (!lifted.ok()) return Fail(lifted.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ProtoJson(*lifted).c_str());
    return 0;
  }
  if (lifted->nodes().empty()) {
    std::fprintf(stderr, "shardctl unfence: job '%s' has no fence on '%s'\n", job.c_str(),
                 host.c_str());
    return 1;
  }
  for (const std::string& node : lifted->nodes()) {
    std::printf("lifted the fence on '%s' for job '%s': its workers may join again\n", node.c_str(),
                job.c_str());
  }
  return 0;
}

}  // namespace zeroshard
