// shardctl's commands, one file each, sharing the flags defined in
// shardctl.cc (--job, --json) and the connection flags
// (client/connection_flags.h).
#ifndef ZEROSHARD_CLIENT_SHARDCTL_COMMANDS_H_
#define ZEROSHARD_CLIENT_SHARDCTL_COMMANDS_H_

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "google/protobuf/message.h"

ABSL_DECLARE_FLAG(std::string, job);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(int, rank);  // shardctl_observe.cc
ABSL_DECLARE_FLAG(bool, all);
ABSL_DECLARE_FLAG(std::string, host);  // shardctl_observe.cc

namespace zeroshard {

// A client for --server with the token and TLS flags (and
// --tls_server_name) applied.
absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags();
// Prints "shardctl: <status>" to stderr; returns the exit code 1.
int Fail(const absl::Status& status);
// A flag's mistake: prints it and returns 2 (nothing was asked of the server).
int FailUsage(const absl::Status& status);
// --rank as given: -1 (the default: every rank) or a rank (shardctl_observe.cc).
absl::Status CheckRankFlag();
// Pretty JSON with proto field names and every primitive field.
std::string ProtoJson(const google::protobuf::Message& message);
// Status columns (shardctl.cc): "all_gather #12 h.3 4.1s" or "-"; "HUNG", "STRAGGLER" or "-".
std::string InCollective(const v1::RankTelemetry& telemetry);
std::string MemberFlags(const v1::MemberStatus& member);

int StatusCommand();                      // shardctl.cc
int HealthCommand();                      // shardctl.cc
int SpecCommand();                        // shardctl_plan.cc
int PlanCommand();                        // shardctl_plan.cc
int CheckpointsCommand();                 // shardctl_checkpoints.cc
int ConsolidateCommand();                 // shardctl_checkpoints.cc
int HistoryCommand();                     // shardctl_observe.cc
int TopCommand();                         // shardctl_observe.cc
int JobCommand(const std::string& verb);  // shardctl_job.cc: "create"
int UnfenceCommand();                     // shardctl_job.cc
int GoodputCommand();                     // shardctl_goodput.cc

}  // namespace zeroshard

#endif  // ZEROSHARD_CLIENT_SHARDCTL_COMMANDS_H_
