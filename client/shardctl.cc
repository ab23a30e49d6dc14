// shardctl: the zeroshard command line.
//
//   shardctl --server=HOST:PORT status [--job=ID] [--json]
//
// Tables for people; --json for programs.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/connection_flags.h"
#include "client/rank_rows.h"
#include "client/shardctl_commands.h"
#include "common/table.h"
#include "google/protobuf/util/json_util.h"

// The connection flags (--server, --token_file, --tls_*) are
// client/connection_flags.cc's; --tls_server_name is shardctl's alone.
ABSL_FLAG(std::string, tls_server_name, "", "Name expected in the server certificate");
ABSL_FLAG(std::string, job, "", "Job id (status, top: empty shows every job; goodput: required)");
ABSL_FLAG(bool, json, false,
          "Print JSON for programs instead of tables (status: what the table shows, with a large "
          "job's summary; --all: every rank of every job)");
ABSL_FLAG(bool, all, false,
          "status, top: list every rank (a job of more than 64 ranks shows its worst 32, its worst "
          "hosts and histograms)");

namespace zeroshard {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "shardctl: %s\n", status.ToString().c_str());
  // gRPC's own words when nothing answered (a server that answers
  // UNAVAILABLE itself, e.g. its state store away, says why instead).
  const absl::string_view message = status.message();
  if (status.code() == absl::StatusCode::kUnavailable &&
      (absl::StrContains(message, "failed to connect") ||
       absl::StrContains(message, "DNS resolution failed") ||
       absl::StrContains(message, "Connection refused"))) {
    std::fprintf(stderr,
                 "shardctl: no answer from a shard_server at --server=%s: start one there, or "
                 "pass --server=HOST:PORT of a running one\n",
                 absl::GetFlag(FLAGS_server).c_str());
  }
  return 1;
}

int FailUsage(const absl::Status& status) {
  std::fprintf(stderr, "shardctl: %s\n", std::string(status.message()).c_str());
  return 2;
}

std::string ProtoJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags() {
  absl::StatusOr<ClientOptions> options = ClientOptionsFromFlags();
  if (!options.ok()) return options.status();
  options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  return Client::Connect(*options);
}

std::string InCollective(const v1::RankTelemetry& t) {
  if (!t.has_in_progress()) return "-";
  const v1::CollectiveInProgress& c = t.in_progress();
  std::string op = absl::AsciiStrToLower(v1::CollectiveOp_Name(c.op()));
  // Its age when the rank reported it (at most a heartbeat interval ago),
  // not now minus its start: that would add the report's age.
  return absl::StrFormat("%s #%d %s %.1fs", op, c.seq(), c.unit(), c.age_ms() / 1000.0);
}

std::string MemberFlags(const v1::MemberStatus& m) {
  if (m.hung()) return m.straggler() ? "HUNG,STRAGGLER" : "HUNG";
  return m.straggler() ? "STRAGGLER" : "-";
}

// The replicated control plane's leadership, one line each (nothing for a
// single server).
void PrintControlPlane(const v1::ControlPlaneStatus& cp) {
  if (cp.etcd_endpoints().empty()) return;
  const double renewed = cp.etcd_lease_renewed_seconds_ago();
  std::printf("control plane: leader %s, followers %s\n", cp.leader().c_str(),
              cp.followers().empty() ? "none" : absl::StrJoin(cp.followers(), ", ").c_str());
  std::printf("etcd %s: %s (lease renewed %.1f s ago, TTL %.0f s)\n", cp.etcd_endpoints().c_str(),
              renewed < cp.etcd_lease_ttl_seconds() / 2 ? "healthy" : "SLOW OR UNREACHABLE",
              renewed, cp.etcd_lease_ttl_seconds());
  std::printf("elected %s%s, serving %.0f ms later (term %lld of this server)\n",
              absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(cp.elected_unix_ms()),
                               absl::UTCTimeZone())
                  .c_str(),
              cp.previous_leader().empty() ? "" : (" after " + cp.previous_leader()).c_str(),
              cp.restore_seconds() * 1000, static_cast<long long>(cp.terms()));
  if (!cp.has_etcd_storage()) {
    std::printf("\n");
    return;
  }
  const v1::EtcdStorage& e = cp.etcd_storage();
  if (!e.error().empty()) {
    std::printf("etcd storage: cannot read it: %s\n\n", e.error().c_str());
    return;
  }
  const double used = e.quota_bytes() > 0 ? 100.0 * e.db_size_bytes() / e.quota_bytes() : 0;
  std::printf(
      "etcd storage: db %s (%s in use) of a %s quota (%.0f %%); last compaction %s\n",
      HumanBytes(static_cast<double>(e.db_size_bytes())).c_str(),
      HumanBytes(static_cast<double>(e.db_size_in_use_bytes())).c_str(),
      HumanBytes(static_cast<double>(e.quota_bytes())).c_str(), used,
      e.compacted_unix_ms() == 0 ? "none yet"
                                 : absl::StrCat("at revision ", e.compacted_revision()).c_str());
  for (const std::string& alarm : e.alarms()) {
    std::printf(
        "WARNING: etcd alarm %s: etcd refuses writes (joins, generations, checkpoints "
        "fail) until an operator clears it; docs/deploy.md\n",
        alarm.c_str());
  }
  if (used >= 80) {
    std::printf(
        "WARNING: etcd's database is over 80 %% of its quota: defragment it "
        "(etcdctl defrag) or raise --quota-backend-bytes (and --etcd_quota_bytes); "
        "docs/deploy.md\n");
  }
  std::printf("\n");
}

// The job's latest abandoned checkpoint, when no complete one came after it
// (a server without a checkpoint root has neither).
void PrintCheckpointFailure(Client& client, const std::string& job) {
  absl::StatusOr<v1::ListCheckpointsResponse> list = client.ListCheckpoints(job);
  if (!list.ok()) return;
  const v1::CheckpointInfo* failed = nullptr;
  for (const v1::CheckpointInfo& c : list->checkpoints()) {  // by step
    if (!c.failure().empty()) failed = &c;
    if (c.complete() && failed != nullptr && c.step() > failed->step()) failed = nullptr;
  }
  if (failed != nullptr) std::printf("CHECKPOINT: %s\n", failed->failure().c_str());
}

// grpc.health.v1 Check: exit 0 when the server is SERVING, 1 otherwise (it
// does not answer within the client's RPC deadline, or answers NOT_SERVING). Needs no
// token: the container image's HEALTHCHECK (deploy/container).
int HealthCommand() {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  if (absl::Status s = (*client)->HealthCheck(); !s.ok()) return Fail(s);
  std::printf("SERVING\n");
  return 0;
}

// The members of `job` (or the rank or host asked for) as a table.
void PrintMembers(const v1::JobStatus& job, int rank, const std::string& host) {
  const RankRows rows = SelectRankRows(job, rank, host);
  if (!rows.caption.empty()) std::printf("%s\n", rows.caption.c_str());
  Table members({"RANK", "WORKER", "HOST", "STATE", "HEARTBEAT", "STEP", "LOSS", "STEP TIME",
                 "WAIT GATHER/REDUCE", "MEMORY", "COLLECTIVES", "IN COLLECTIVE", "REJOINS",
                 "FLAGS"});
  for (const v1::MemberStatus* row : rows.members) {
    const v1::MemberStatus& m = *row;
    std::string state = m.left() ? "left" : m.rejoined() ? "rejoined" : m.alive() ? "alive" : "dead";
    if (m.rank() < 0) state = "joining";
    members.AddRow(
        {m.rank() < 0 ? "-" : absl::StrCat(m.rank()), m.worker_id(), m.host(), state,
         m.last_heartbeat_age_ms() < 0
             ? "-"
             : absl::StrFormat("%.1fs ago", m.last_heartbeat_age_ms() / 1000.0),
         absl::StrCat(m.step()), FormatLoss(m.loss()),
         m.last_step().step_ms() > 0 ? absl::StrFormat("%.1f ms", m.last_step().step_ms()) : "-",
         m.last_step().step_ms() > 0
             ? absl::StrFormat("%.1f / %.1f ms", m.last_step().gather_wait_ms(),
                               m.last_step().reduce_wait_ms())
             : "-",
         HumanBytes(static_cast<double>(m.memory_bytes())), absl::StrCat(m.collective_seq()),
         InCollective(m.telemetry()), absl::StrCat(m.rejoins()), MemberFlags(m)});
  }
  std::printf("%s", members.ToString().c_str());
}

// The job's generation changes and why.
void PrintGenerations(const v1::JobStatus& job) {
  if (job.history_size() > 0) {
    Table history({"GENERATION", "SINCE", "WHY"});
    for (const v1::GenerationChange& change : job.history()) {
      history.AddRow({absl::StrCat(change.generation()),
                      absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC",
                                       absl::FromUnixMillis(change.unix_ms()), absl::UTCTimeZone()),
                      change.reason()});
    }
    std::printf("\n%s generations\n%s", job.job_id().c_str(), history.ToString().c_str());
  }
}

// The machines fenced from `job` (docs/numerics.md): why, since when, and
// the command that lifts each fence.
void PrintFences(const v1::JobStatus& job) {
  for (const v1::FencedHost& f : job.fenced_hosts()) {
    std::printf(
        "%s FENCED machine '%s' since %s: %s; its joins are refused (lift with: shardctl "
        "unfence --job=%s --host=%s)\n",
        job.job_id().c_str(), f.node().c_str(),
        absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(f.unix_ms()),
                         absl::UTCTimeZone())
            .c_str(),
        f.reason().c_str(), job.job_id().c_str(), f.node().substr(0, f.node().find(' ')).c_str());
  }
}

// What the ranks report of numerical integrity (docs/numerics.md) and of
// checkpoint commits waiting for the server.
void PrintIntegrity(const v1::JobStatus& job) {
  int64_t skipped = 0, rewinds = 0, spikes = 0, mismatches = 0, corruptions = 0;
  int corrupted_rank = -1;
  int pending = 0, pending_ranks = 0;
  for (const v1::MemberStatus& m : job.members()) {
    skipped = std::max(skipped, m.last_step().skipped_steps());
    pending = std::max(pending, m.telemetry().commits_pending());
    pending_ranks += m.telemetry().commits_pending() > 0;
    rewinds = std::max(rewinds, m.last_step().rewinds());
    spikes = std::max(spikes, m.last_step().loss_spikes());
    mismatches = std::max(mismatches, m.last_step().replica_mismatches());
    if (m.last_step().corruptions() > corruptions) {
      corruptions = m.last_step().corruptions();
      corrupted_rank = m.last_step().corrupted_rank();
    }
  }
  if (pending > 0) {
    std::printf(
        "\n%s checkpoint commits pending: up to %d on %d rank(s) (written, waiting for "
        "the server; committed in order when it answers)\n",
        job.job_id().c_str(), pending, pending_ranks);
  }
  if (rewinds > 0 || spikes > 0 || mismatches > 0) {
    std::printf(
        "\n%s rewinds: %lld (loss spikes: %lld, replica mismatches: %lld; "
        "docs/numerics.md)\n",
        job.job_id().c_str(), static_cast<long long>(rewinds), static_cast<long long>(spikes),
        static_cast<long long>(mismatches));
  }
  if (corruptions > 0) {
    std::string host = "?";
    for (const v1::MemberStatus& m : job.members()) {
      if (m.rank() == corrupted_rank) host = m.host();
    }
    std::printf(
        "%s corrupted shard: rank %d (host %s) is the last of %lld named (the ranks' "
        "logs say how far off each was)\n",
        job.job_id().c_str(), corrupted_rank, host.c_str(), static_cast<long long>(corruptions));
  }
  PrintFences(job);
  if (skipped > 0) {
    std::printf(
        "\n%s skipped steps: %lld (non-finite loss or gradient norm, "
        "--on_nonfinite=skip; the ranks' logs name each)\n",
        job.job_id().c_str(), static_cast<long long>(skipped));
  }
}

// The job's recoveries: where each generation's state came from and how long it took.
void PrintRecoveries(const v1::JobStatus& job) {
  if (job.recoveries_size() > 0) {
    Table recoveries({"GENERATION", "SOURCE", "FAILED AT", "RESUMED AT", "W", "REJOIN", "RESTORE",
                      "TRAINING AGAIN"});
    for (const v1::RecoveryRecord& r : job.recoveries()) {
      recoveries.AddRow(
          {absl::StrCat(r.generation()), r.source(),
           r.failed_step() >= 0 ? absl::StrCat("step ", r.failed_step()) : "-",
           absl::StrCat("step ", r.restored_step()), absl::StrCat(r.world_size()),
           absl::StrFormat("%.0f ms", r.rejoin_ms()), absl::StrFormat("%.0f ms", r.restore_ms()),
           r.first_step_ms() > 0 ? absl::StrFormat("%.0f ms", r.first_step_ms()) : "-"});
    }
    std::printf("\n%s recoveries\n%s", job.job_id().c_str(), recoveries.ToString().c_str());
  }
}

// --sync=diloco: the job's last outer steps and who took part in each.
void PrintOuterSteps(const v1::JobStatus& job) {
  if (job.outer_steps_size() == 0) return;
  Table table({"OUTER STEP", "AFTER STEP", "GENERATION", "GROUPS", "GROUP SIZE", "WORKERS"});
  for (const v1::OuterStepRecord& o : job.outer_steps()) {
    table.AddRow({absl::StrCat(o.outer_step()), absl::StrCat(o.after_step()),
                  absl::StrCat(o.generation()), absl::StrCat(o.groups()),
                  absl::StrCat(o.group_size()),
                  o.workers().empty() ? "-" : absl::StrJoin(o.workers(), ",")});
  }
  std::printf("\n%s outer steps (DiLoCo; the last %d)\n%s", job.job_id().c_str(),
              job.outer_steps_size(), table.ToString().c_str());
}

int StatusCommand() {
  if (absl::Status s = CheckRankFlag(); !s.ok()) return FailUsage(s);
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  const int rank = absl::GetFlag(FLAGS_rank);
  const std::string host = absl::GetFlag(FLAGS_host);
  absl::StatusOr<v1::GetStatusResponse> status = (*client)->GetStatus(
      StatusRequest(absl::GetFlag(FLAGS_job), rank, host, absl::GetFlag(FLAGS_all)));
  if (!status.ok()) return Fail(status.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ProtoJson(*status).c_str());
    return 0;
  }
  PrintControlPlane(status->control_plane());
  if (status->jobs().empty()) {
    std::printf("no jobs\n");
    return 0;
  }
  Table jobs({"JOB", "STATE", "GENERATION", "WORLD", "JOINED", "ALIVE", "PLAN"});
  for (const v1::JobStatus& job : status->jobs()) {
    jobs.AddRow({job.job_id(), v1::JobState_Name(job.state()), absl::StrCat(job.generation()),
                 absl::StrCat(job.world_size()), absl::StrCat(job.joined()),
                 absl::StrCat(AliveRanks(job)), job.plan_hash().empty() ? "-" : job.plan_hash()});
  }
  std::printf("%s", jobs.ToString().c_str());
  for (const v1::JobStatus& job : status->jobs()) {
    if (job.members().empty()) continue;
    std::printf("\n%s (generation %lld)\n", job.job_id().c_str(),
                static_cast<long long>(job.generation()));
    std::printf("%s", HostsAndHistograms(job, rank, host).c_str());
    PrintMembers(job, rank, host);
    for (const v1::Diagnosis& d : job.diagnoses()) {
      std::printf("%s: %s\n", d.kind() == v1::Diagnosis::STRAGGLER ? "STRAGGLER" : "HANG",
                  d.message().c_str());
    }
    if (!job.waiting().empty()) std::printf("WAITING: %s\n", job.waiting().c_str());
    if (!job.growing_note().empty()) std::printf("GROWING BACK: %s\n", job.growing_note().c_str());
    PrintCheckpointFailure(**client, job.job_id());
    PrintGenerations(job);
    PrintIntegrity(job);
    std::printf(
        "\n%s latest committed snapshot: %s\n", job.job_id().c_str(),
        job.snapshot_step() >= 0 ? absl::StrCat("step ", job.snapshot_step()).c_str() : "none");
    PrintRecoveries(job);
    PrintOuterSteps(job);
  }
  return 0;
}

}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "zeroshard command line.\n\n"
      "  shardctl [--server=HOST:PORT] [--token_file=F] [TLS flags] COMMAND [flags]\n\n"
      "Commands:\n"
      "  status [--job=ID] [--rank=R|--host=H|--all] [--json]  jobs, generations and members\n"
      "  health                                  grpc.health.v1 check: exit 0 when SERVING\n"
      "  spec --model=mlp|gpt2 ... [--preset=124M] print a model spec (JSON)\n"
      "  plan --spec=FILE --world=N [--local]    shard plan and memory estimate\n"
      "  checkpoints [--job=ID] [--json]         checkpoints of a job, or of every job\n"
      "  consolidate --job=ID --step=N|latest --out=PATH   merge into safetensors\n"
      "  history --job=ID [--rank=R] [--csv|--json]        a job's per-step history\n"
      "  goodput --job=ID [--json]               where the job's wall-clock time went\n"
      "  top [--job=ID] [--rank=R|--host=H|--all]  live view of jobs and ranks (q quits)\n"
      "  job create --job=ID --job_tokens_dir=DIR  issue a token for one job (a file)\n"
      "  unfence --job=ID --host=HOSTNAME        lift a machine's fence (admin token)\n");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const char* commands =
      "status, health, spec, plan, checkpoints, consolidate, history, goodput, top, job, "
      "unfence";
  if (args.size() < 2) {
    std::fprintf(stderr, "shardctl: missing command (%s); see --help\n", commands);
    return 2;
  }
  std::string command = args[1];
  if (command == "status") return zeroshard::StatusCommand();
  if (command == "health") return zeroshard::HealthCommand();
  if (command == "spec") return zeroshard::SpecCommand();
  if (command == "plan") return zeroshard::PlanCommand();
  if (command == "checkpoints") return zeroshard::CheckpointsCommand();
  if (command == "consolidate") return zeroshard::ConsolidateCommand();
  if (command == "history") return zeroshard::HistoryCommand();
  if (command == "goodput") return zeroshard::GoodputCommand();
  if (command == "top") return zeroshard::TopCommand();
  if (command == "job") return zeroshard::JobCommand(args.size() > 2 ? args[2] : "");
  if (command == "unfence") return zeroshard::UnfenceCommand();
  std::fprintf(stderr, "shardctl: unknown command '%s' (expected: %s)\n", command.c_str(),
               commands);
  return 2;
}
