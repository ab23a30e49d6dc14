#include "shard_server/observability/server_metrics.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "shard_server/observability/goodput_metrics.h"
#include "shard_server/observability/rank_views.h"

namespace zeroshard {
namespace {

// "/zeroshard.v1.Coordinator/Join" -> "Join".
std::string ShortMethod(const char* method) {
  std::string m = method == nullptr ? "" : method;
  size_t slash = m.rfind('/');
  return slash == std::string::npos ? m : m.substr(slash + 1);
}

class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(grpc::experimental::ServerRpcInfo* info, ServerMetrics* metrics)
      : metrics_(metrics), method_(ShortMethod(info->method())), start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      ++received_;
      if (method_ == "CommitShard" && methods->GetRecvMessage() != nullptr) {
        commit_bytes_ =
            static_cast<const v1::CommitShardRequest*>(methods->GetRecvMessage())->size_bytes();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::StatusCode code = methods->GetSendStatus().error_code();
      metrics_->RecordRpc(method_, code, absl::Now() - start_);
      metrics_->AddMessagesReceived(method_, received_);
      if (method_ == "CommitShard" && code == grpc::StatusCode::OK) {
        metrics_->AddCheckpointCommit(commit_bytes_);
      }
      received_ = 0;
    }
    methods->Proceed();
  }

 private:
  ServerMetrics* const metrics_;
  const std::string method_;
  const absl::Time start_;
  int64_t received_ = 0;  // since last counted
  int64_t commit_bytes_ = 0;
};

class RpcMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsFactory(ServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // An interceptor costs every message of its call a pass through the
    // interception machinery: on heartbeat streams that was 40 % more
    // server CPU per beat (control_plane_bench). The service counts beats.
    if (ShortMethod(info->method()) == "Heartbeat") return nullptr;
    return new RpcMetricsInterceptor(info, metrics_);
  }

 private:
  ServerMetrics* const metrics_;
};

const char* CodeName(int code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  return code >= 0 && code < 17 ? kNames[code] : "UNKNOWN";
}

// A metric family: its HELP and TYPE lines.
void Family(std::string* out, const char* name, const char* type, const char* help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

std::string Num(double v) { return absl::StrCat(v); }

}  // namespace

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void ServerMetrics::RecordRpc(const std::string& method, grpc::StatusCode code,
                              absl::Duration latency) {
  const double seconds = absl::ToDoubleSeconds(latency);
  absl::MutexLock lock(&mu_);
  Rpc& rpc = rpcs_[{method, static_cast<int>(code)}];
  rpc.count++;
  rpc.seconds += seconds;
  for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
    if (seconds <= kLatencyBuckets[i]) {
      rpc.buckets[i]++;
      break;
    }
  }
}

void ServerMetrics::AddMessagesReceived(const std::string& method, int64_t count) {
  if (count == 0) return;
  absl::MutexLock lock(&mu_);
  messages_[method] += count;
}

void ServerMetrics::AddCheckpointCommit(int64_t bytes) {
  commits_.fetch_add(1);
  commit_bytes_.fetch_add(bytes);
}

void ServerMetrics::AddConsolidation(int64_t bytes, double seconds) {
  consolidations_.fetch_add(1);
  consolidation_bytes_.fetch_add(bytes);
  double old = consolidation_seconds_.load();
  while (!consolidation_seconds_.compare_exchange_weak(old, old + seconds)) {
  }
}

void ServerMetrics::AddHeartbeatHandling(absl::Duration handling) {
  const double seconds = absl::ToDoubleSeconds(handling);
  const int64_t ns = absl::ToInt64Nanoseconds(handling);
  for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
    if (seconds <= kLatencyBuckets[i]) {
      beat_buckets_[i].fetch_add(1, std::memory_order_relaxed);
      break;
    }
  }
  beat_handled_.fetch_add(1, std::memory_order_relaxed);
  beat_handling_ns_.fetch_add(ns, std::memory_order_relaxed);
  int64_t max = beat_handling_max_ns_.load(std::memory_order_relaxed);
  while (ns > max && !beat_handling_max_ns_.compare_exchange_weak(max, ns)) {
  }
}

void ServerMetrics::Write(std::string* out) const {
  absl::MutexLock lock(&mu_);
  WriteRpcFamiliesLocked(out);
  WriteHeartbeatFamilies(out);
  Family(out, "zeroshard_joins_total", "counter", "Joins answered with a rank.");
  absl::StrAppend(out, "zeroshard_joins_total ", AnsweredLocked("Join", true), "\n");
  Family(out, "zeroshard_kv_operations_total", "counter",
         "Key-value store operations answered, by operation.");
  for (const auto& [op, method] : std::vector<std::pair<const char*, const char*>>{
           {"set", "StoreSet"}, {"get", "StoreGet"}, {"add", "StoreAdd"}, {"wait", "StoreWait"}}) {
    absl::StrAppend(out, "zeroshard_kv_operations_total{op=\"", op, "\"} ",
                    AnsweredLocked(method, false), "\n");
  }
  Family(out, "zeroshard_checkpoint_commits_total", "counter", "Shard commits accepted.");
  absl::StrAppend(out, "zeroshard_checkpoint_commits_total ", commits_.load(), "\n");
  Family(out, "zeroshard_checkpoint_committed_bytes_total", "counter",
         "Bytes of the shard files of accepted commits.");
  absl::StrAppend(out, "zeroshard_checkpoint_committed_bytes_total ", commit_bytes_.load(), "\n");
  Family(out, "zeroshard_consolidations_total", "counter", "Consolidations completed.");
  absl::StrAppend(out, "zeroshard_consolidations_total ", consolidations_.load(), "\n");
  Family(out, "zeroshard_consolidated_bytes_total", "counter",
         "Bytes written by completed consolidations.");
  absl::StrAppend(out, "zeroshard_consolidated_bytes_total ", consolidation_bytes_.load(), "\n");
  Family(out, "zeroshard_consolidation_seconds_total", "counter",
         "Seconds spent in completed consolidations.");
  absl::StrAppend(out, "zeroshard_consolidation_seconds_total ", Num(consolidation_seconds_.load()),
                  "\n");
}

void ServerMetrics::WriteRpcFamiliesLocked(std::string* out) const {
  Family(out, "zeroshard_rpcs_total", "counter", "RPCs answered, by method and status code.");
  for (const auto& [key, rpc] : rpcs_) {
    absl::StrAppend(out, "zeroshard_rpcs_total{method=\"", key.first, "\",code=\"",
                    CodeName(key.second), "\"} ", rpc.count, "\n");
  }
  Family(out, "zeroshard_rpc_duration_seconds", "histogram",
         "RPC latency from arrival to status (a stream: its life), by method and status code.");
  for (const auto& [key, rpc] : rpcs_) {
    const std::string labels =
        absl::StrCat("method=\"", key.first, "\",code=\"", CodeName(key.second), "\"");
    int64_t cumulative = 0;
    for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
      cumulative += rpc.buckets[i];
      absl::StrAppend(out, "zeroshard_rpc_duration_seconds_bucket{", labels, ",le=\"",
                      Num(kLatencyBuckets[i]), "\"} ", cumulative, "\n");
    }
    absl::StrAppend(out, "zeroshard_rpc_duration_seconds_bucket{", labels, ",le=\"+Inf\"} ",
                    rpc.count, "\n");
    absl::StrAppend(out, "zeroshard_rpc_duration_seconds_sum{", labels, "} ", Num(rpc.seconds),
                    "\n");
    absl::StrAppend(out, "zeroshard_rpc_duration_seconds_count{", labels, "} ", rpc.count, "\n");
  }
  Family(
      out, "zeroshard_rpc_messages_received_total", "counter",
      "Messages received on RPCs that ended, by method (heartbeats: zeroshard_heartbeats_total).");
  for (const auto& [method, count] : messages_) {
    absl::StrAppend(out, "zeroshard_rpc_messages_received_total{method=\"", method, "\"} ", count,
                    "\n");
  }
}

int64_t ServerMetrics::AnsweredLocked(absl::string_view method, bool ok_only) const {
  int64_t n = 0;
  for (const auto& [key, rpc] : rpcs_) {
    if (key.first == method && (!ok_only || key.second == 0)) n += rpc.count;
  }
  return n;
}

void ServerMetrics::WriteHeartbeatFamilies(std::string* out) const {
  Family(out, "zeroshard_heartbeats_total", "counter", "Heartbeats received.");
  absl::StrAppend(out, "zeroshard_heartbeats_total ", heartbeats_.load(), "\n");
  Family(out, "zeroshard_heartbeat_handling_seconds", "histogram",
         "Time the server took to answer a beat once read (a wait for Membership's lock "
         "included).");
  int64_t cumulative = 0;
  for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
    cumulative += beat_buckets_[i].load();
    absl::StrAppend(out, "zeroshard_heartbeat_handling_seconds_bucket{le=\"",
                    Num(kLatencyBuckets[i]), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, "zeroshard_heartbeat_handling_seconds_bucket{le=\"+Inf\"} ",
                  beat_handled_.load(), "\n");
  absl::StrAppend(out, "zeroshard_heartbeat_handling_seconds_sum ",
                  Num(beat_handling_ns_.load() / 1e9), "\n");
  absl::StrAppend(out, "zeroshard_heartbeat_handling_seconds_count ", beat_handled_.load(), "\n");
  Family(out, "zeroshard_heartbeat_handling_max_seconds", "gauge",
         "The longest a beat's answer took since the server started.");
  absl::StrAppend(out, "zeroshard_heartbeat_handling_max_seconds ",
                  Num(beat_handling_max_ns_.load() / 1e9), "\n");
  Family(out, "zeroshard_call_queue_lag_seconds", "gauge",
         "How far behind the threads of the heartbeat and agent call queues are (an alarm "
         "every 100 ms, timed when served); past half a heartbeat interval, the heartbeat "
         "timeout is extended by it.");
  absl::StrAppend(out, "zeroshard_call_queue_lag_seconds ", Num(call_queue_lag_ns_.load() / 1e9),
                  "\n");
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RpcMetricsInterceptorFactory(
    ServerMetrics* metrics) {
  return std::make_unique<RpcMetricsFactory>(metrics);
}

namespace {

// zeroshard_jobs and zeroshard_members: how many are in each state.
void WriteStateCounts(const v1::GetStatusResponse& status, std::string* out) {
  std::map<std::string, int> job_states = {
      {"joining", 0}, {"running", 0}, {"degraded", 0}, {"finished", 0}};
  std::map<std::string, int> member_states = {
      {"alive", 0}, {"dead", 0}, {"left", 0}, {"joining", 0}};
  for (const v1::JobStatus& job : status.jobs()) {
    job_states[absl::AsciiStrToLower(v1::JobState_Name(job.state()))]++;
    for (const v1::MemberStatus& m : job.members()) {
      member_states[m.rank() < 0 ? "joining" : m.left() ? "left" : m.alive() ? "alive" : "dead"]++;
    }
  }
  Family(out, "zeroshard_jobs", "gauge", "Jobs the server holds, by state.");
  for (const auto& [state, n] : job_states) {
    absl::StrAppend(out, "zeroshard_jobs{state=\"", state, "\"} ", n, "\n");
  }
  Family(out, "zeroshard_members", "gauge", "Members of every job, by state.");
  for (const auto& [state, n] : member_states) {
    absl::StrAppend(out, "zeroshard_members{state=\"", state, "\"} ", n, "\n");
  }
}

// The state in etcd: its size against the quota, compaction, what the
// leader wrote.
void WriteEtcdStorage(const v1::EtcdStorage& e, std::string* out) {
  auto gauge = [out](const char* name, const char* type, const char* help, auto value) {
    Family(out, name, type, help);
    absl::StrAppend(out, name, " ", value, "\n");
  };
  gauge("zeroshard_etcd_db_size_bytes", "gauge",
        "etcd's database file (one member's Maintenance.Status).", e.db_size_bytes());
  gauge("zeroshard_etcd_db_size_in_use_bytes", "gauge",
        "Of etcd's database, what live keys and kept history use.", e.db_size_in_use_bytes());
  gauge("zeroshard_etcd_quota_bytes", "gauge",
        "etcd's --quota-backend-bytes as shard_server's --etcd_quota_bytes says; at it, etcd "
        "raises NOSPACE and refuses every write.",
        e.quota_bytes());
  Family(out, "zeroshard_etcd_alarm", "gauge", "1 per alarm etcd has raised (NOSPACE, CORRUPT).");
  for (const std::string& alarm : e.alarms()) {
    absl::StrAppend(out, "zeroshard_etcd_alarm{alarm=\"", EscapeLabelValue(alarm), "\"} 1\n");
  }
  gauge("zeroshard_etcd_compacted_revision", "gauge",
        "The revision the leader last compacted etcd's history at (0: not yet).",
        e.compacted_revision());
  gauge("zeroshard_etcd_last_compaction_timestamp_seconds", "gauge",
        "When the leader last compacted etcd's history (Unix seconds; 0: not yet).",
        absl::StrFormat("%.3f", e.compacted_unix_ms() / 1000.0));
  gauge("zeroshard_etcd_state_writes_total", "counter", "State changes the leader wrote to etcd.",
        e.state_batches());
  gauge("zeroshard_etcd_state_written_bytes_total", "counter",
        "Keys and values the leader wrote to etcd.", e.state_bytes_written());
  gauge("zeroshard_etcd_state_load_seconds", "gauge",
        "How long the leader took to read the state from etcd when elected.", e.load_seconds());
}

// The replicated control plane's leadership (only the leader serves
// /metrics, so leader is 1 wherever it is scraped); nothing for a single
// server.
void WriteControlPlane(const v1::ControlPlaneStatus& cp, std::string* out) {
  if (cp.etcd_endpoints().empty()) return;
  Family(out, "zeroshard_control_plane_leader", "gauge",
         "1 on the server that leads the replicated control plane (label: its address).");
  absl::StrAppend(out, "zeroshard_control_plane_leader{address=\"", EscapeLabelValue(cp.leader()),
                  "\"} 1\n");
  Family(out, "zeroshard_control_plane_followers", "gauge",
         "Other servers registered in etcd, waiting to take over.");
  absl::StrAppend(out, "zeroshard_control_plane_followers ", cp.followers_size(), "\n");
  Family(out, "zeroshard_control_plane_etcd_lease_renewed_seconds_ago", "gauge",
         "Since the leader last renewed its etcd lease; at the lease TTL it steps down.");
  absl::StrAppend(out, "zeroshard_control_plane_etcd_lease_renewed_seconds_ago ",
                  cp.etcd_lease_renewed_seconds_ago(), "\n");
  Family(out, "zeroshard_control_plane_elected_timestamp_seconds", "gauge",
         "When the leader won its election (Unix seconds): a change is a failover.");
  absl::StrAppend(out, "zeroshard_control_plane_elected_timestamp_seconds ",
                  absl::StrFormat("%.3f", cp.elected_unix_ms() / 1000.0), "\n");
  Family(out, "zeroshard_control_plane_restore_seconds", "gauge",
         "From the leader's election to serving: loading the state from etcd.");
  absl::StrAppend(out, "zeroshard_control_plane_restore_seconds ", cp.restore_seconds(), "\n");
  Family(out, "zeroshard_control_plane_terms_total", "counter",
         "Leaderships the leading server process has held.");
  absl::StrAppend(out, "zeroshard_control_plane_terms_total ", cp.terms(), "\n");
  WriteEtcdStorage(cp.etcd_storage(), out);
}

// The families with one series per job (label job="...").
// The most any member reported: every rank counts the same, but a member
// that has not beaten since its last step may lag behind.
int64_t MostReported(const v1::JobStatus& job, int64_t (v1::StepTelemetry::*count)() const) {
  int64_t most = 0;
  for (const v1::MemberStatus& m : job.members()) most = std::max(most, (m.last_step().*count)());
  return most;
}
int64_t SkippedSteps(const v1::JobStatus& job) {
  return MostReported(job, &v1::StepTelemetry::skipped_steps);
}

// The jobs' checkpoint steps by state, and their latest complete step.
void WriteCheckpointFamilies(const v1::GetStatusResponse& status,
                             const std::map<std::string, CheckpointCounts>& checkpoints,
                             const std::vector<std::string>& job_labels, std::string* out) {
  Family(out, "zeroshard_checkpoints", "gauge",
         "Checkpoint steps of the job, by state (verified, pending, failed: verification found "
         "damage; incomplete: not every rank committed).");
  for (int j = 0; j < status.jobs_size(); ++j) {
    auto it = checkpoints.find(status.jobs(j).job_id());
    CheckpointCounts c = it == checkpoints.end() ? CheckpointCounts() : it->second;
    for (const auto& [state, n] :
         std::vector<std::pair<const char*, int>>{{"verified", c.verified},
                                                  {"pending", c.pending},
                                                  {"failed", c.failed},
                                                  {"incomplete", c.incomplete}}) {
      absl::StrAppend(out, "zeroshard_checkpoints{", job_labels[j], ",state=\"", state, "\"} ", n,
                      "\n");
    }
  }
  Family(out, "zeroshard_checkpoint_latest_step", "gauge",
         "Step of the job's latest complete checkpoint (-1: none).");
  for (int j = 0; j < status.jobs_size(); ++j) {
    auto it = checkpoints.find(status.jobs(j).job_id());
    absl::StrAppend(out, "zeroshard_checkpoint_latest_step{", job_labels[j], "} ",
                    it == checkpoints.end() ? -1 : it->second.latest_step, "\n");
  }
}

void WriteJobFamilies(const v1::GetStatusResponse& status,
                      const std::map<std::string, CheckpointCounts>& checkpoints,
                      const std::vector<std::string>& job_labels, std::string* out) {
  auto per_job = [&](const char* name, const char* type, const char* help,
                     const std::function<std::string(const v1::JobStatus&)>& value) {
    Family(out, name, type, help);
    for (int j = 0; j < status.jobs_size(); ++j) {
      absl::StrAppend(out, name, "{", job_labels[j], "} ", value(status.jobs(j)), "\n");
    }
  };
  per_job("zeroshard_job_generation", "gauge", "The job's current generation.",
          [](const v1::JobStatus& j) { return absl::StrCat(j.generation()); });
  per_job("zeroshard_job_world_size", "gauge", "The job's world size.",
          [](const v1::JobStatus& j) { return absl::StrCat(j.world_size()); });
  per_job("zeroshard_job_generation_changes", "gauge",
          "Generation changes the server remembers for the job (the last 32).",
          [](const v1::JobStatus& j) { return absl::StrCat(j.history_size()); });
  per_job("zeroshard_job_hung", "gauge",
          "1 while the server reports a hang or schedule disagreement in the job.",
          [](const v1::JobStatus& j) {
            for (const v1::Diagnosis& d : j.diagnoses()) {
              if (d.kind() != v1::Diagnosis::STRAGGLER) return std::string("1");
            }
            return std::string("0");
          });
  per_job("zeroshard_job_skipped_steps_total", "counter",
          "Steps the job dropped for a non-finite loss or gradient norm (--on_nonfinite=skip), "
          "as its listed ranks report them (every rank counts the same).",
          [](const v1::JobStatus& j) { return absl::StrCat(SkippedSteps(j)); });
  // docs/numerics.md: rewinds to an in-memory snapshot and what caused them.
  per_job("zeroshard_job_rewinds_total", "counter",
          "Rewinds of the job to an in-memory snapshot for a bad step (a loss spike, a "
          "non-finite step under --loss_spike_zscore, a replica mismatch).",
          [](const v1::JobStatus& j) {
            return absl::StrCat(MostReported(j, &v1::StepTelemetry::rewinds));
          });
  per_job("zeroshard_job_loss_spikes_total", "counter",
          "Steps of the job whose loss spiked above its recent window (--loss_spike_zscore).",
          [](const v1::JobStatus& j) {
            return absl::StrCat(MostReported(j, &v1::StepTelemetry::loss_spikes));
          });
  per_job("zeroshard_job_replica_mismatches_total", "counter",
          "Checks of the job whose HSDP replicas held different master shards "
          "(--replica_check_every): silent data corruption.",
          [](const v1::JobStatus& j) {
            return absl::StrCat(MostReported(j, &v1::StepTelemetry::replica_mismatches));
          });
  per_job("zeroshard_job_corrupted_shards_total", "counter",
          "Ranks of the job named, after a rewind's re-run, as having held a corrupted shard "
          "(the ranks' logs and shardctl status name them).",
          [](const v1::JobStatus& j) {
            return absl::StrCat(MostReported(j, &v1::StepTelemetry::corruptions));
          });
  per_job("zeroshard_job_fenced_hosts", "gauge",
          "Machines fenced from the job after a rank's shard was corrupted twice (their joins "
          "are refused until shardctl unfence; shardctl status names them).",
          [](const v1::JobStatus& j) { return absl::StrCat(j.fenced_hosts_size()); });
  per_job("zeroshard_job_stragglers", "gauge", "Ranks of the job flagged as stragglers.",
          [](const v1::JobStatus& j) {
            int n = 0;
            for (const v1::MemberStatus& m : j.members()) n += m.straggler();
            return absl::StrCat(n);
          });
  WriteCheckpointFamilies(status, checkpoints, job_labels, out);
}

// The members of `job` whose series `view` lists.
std::vector<const v1::MemberStatus*> ListedRanks(const v1::JobStatus& job,
                                                 const MetricsView& view) {
  std::vector<const v1::MemberStatus*> listed;
  if (view.rank >= 0) {
    if (job.job_id() != view.job) return listed;
    for (const v1::MemberStatus& m : job.members()) {
      if (m.rank() == view.rank) listed.push_back(&m);
    }
    return listed;
  }
  if (!view.all_ranks && job.members_size() > view.max_rank_series) {
    listed = WorstRanks(job, view.worst_ranks);
    std::sort(
        listed.begin(), listed.end(),
        [](const v1::MemberStatus* a, const v1::MemberStatus* b) { return a->rank() < b->rank(); });
    return listed;
  }
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() >= 0) listed.push_back(&m);
  }
  return listed;
}

// Per host of each job (labels job, host): what stands for the ranks a large
// job does not list.
void WriteHostFamilies(const v1::GetStatusResponse& status,
                       const std::vector<std::string>& job_labels, std::string* out) {
  std::vector<std::pair<std::string, HostSummary>> hosts;  // labels, summary
  for (int j = 0; j < status.jobs_size(); ++j) {
    for (HostSummary& h : SummarizeHosts(status.jobs(j))) {
      std::string labels = absl::StrCat(job_labels[j], ",host=\"", EscapeLabelValue(h.host), "\"");
      hosts.emplace_back(std::move(labels), std::move(h));
    }
  }
  auto per_host = [&](const char* name, const char* help, auto value) {
    Family(out, name, "gauge", help);
    for (const auto& [labels, h] : hosts)
      absl::StrAppend(out, name, "{", labels, "} ", value(h), "\n");
  };
  per_host("zeroshard_host_ranks", "Ranks of the job on the host.",
           [](const HostSummary& h) { return h.ranks; });
  per_host("zeroshard_host_alive_ranks", "Ranks of the job on the host that are alive.",
           [](const HostSummary& h) { return h.alive; });
  per_host("zeroshard_host_stragglers", "Ranks of the job on the host flagged as stragglers.",
           [](const HostSummary& h) { return h.stragglers; });
  per_host("zeroshard_host_heartbeat_age_max_seconds",
           "The oldest last heartbeat among the host's ranks (-1: none yet).",
           [](const HostSummary& h) { return h.heartbeat_age_max; });
  per_host("zeroshard_host_step_max_seconds",
           "The slowest last step among the host's ranks (-1: none yet).",
           [](const HostSummary& h) { return h.step_seconds_max; });
  per_host("zeroshard_host_step_min", "Steps the host's slowest rank completed.",
           [](const HostSummary& h) { return h.step_min; });
}

// Histograms over each job's ranks (label job).
void WriteRankHistograms(const v1::GetStatusResponse& status,
                         const std::vector<std::string>& job_labels, std::string* out) {
  for (const RankHistogramSpec& spec : RankHistogramSpecs()) {
    const std::string name = absl::StrCat("zeroshard_job_rank_", spec.name);
    Family(out, name.c_str(), "histogram", spec.help);
    for (int j = 0; j < status.jobs_size(); ++j) {
      const RankHistogram h = HistogramOverRanks(status.jobs(j), spec);
      int64_t cumulative = 0;
      for (size_t b = 0; b <= h.bounds.size(); ++b) {
        cumulative += h.counts[b];
        absl::StrAppend(out, name, "_bucket{", job_labels[j], ",le=\"",
                        b < h.bounds.size() ? Num(h.bounds[b]) : "+Inf", "\"} ", cumulative, "\n");
      }
      absl::StrAppend(out, name, "_sum{", job_labels[j], "} ", h.sum, "\n");
      absl::StrAppend(out, name, "_count{", job_labels[j], "} ", h.count, "\n");
    }
  }
}

// A rank this page lists, with its series' labels (job, rank, worker).
struct ListedRank {
  std::string labels;
  const v1::MemberStatus* m;
};

// The ranks this page lists, each job's count written as
// zeroshard_job_ranks_listed.
std::vector<ListedRank> ListRanksOfPage(const v1::GetStatusResponse& status,
                                        const std::vector<std::string>& job_labels,
                                        const MetricsView& view, std::string* out) {
  std::vector<ListedRank> ranks;
  Family(out, "zeroshard_job_ranks_listed", "gauge",
         "Ranks of the job whose zeroshard_rank_* series this page lists (a large job lists "
         "its worst; /metrics?all=1 lists every rank, ?job=J&rank=R one).");
  for (int j = 0; j < status.jobs_size(); ++j) {
    const std::vector<const v1::MemberStatus*> listed = ListedRanks(status.jobs(j), view);
    absl::StrAppend(out, "zeroshard_job_ranks_listed{", job_labels[j], "} ", listed.size(), "\n");
    for (const v1::MemberStatus* m : listed) {
      ranks.push_back({absl::StrCat(job_labels[j], ",rank=\"", m->rank(), "\",worker=\"",
                                    EscapeLabelValue(m->worker_id()), "\""),
                       m});
    }
  }
  return ranks;
}

// The families with two labels per rank: memory by category, collective
// waits by op.
void WriteRankBreakdowns(const std::vector<ListedRank>& ranks, std::string* out) {
  Family(out, "zeroshard_rank_memory_bytes", "gauge",
         "Bytes the rank's ZeRO engine holds, by category.");
  for (const ListedRank& r : ranks) {
    const v1::MemoryUsage& mem = r.m->telemetry().memory();
    const std::pair<const char*, int64_t> categories[] = {
        {"params", mem.params()},
        {"grads", mem.grads()},
        {"optimizer_state", mem.optimizer_state()},
        {"activations", mem.activations()},
        {"comm_buffers", mem.comm_buffers()},
        {"cached", mem.cached()}};
    for (const auto& [category, bytes] : categories) {
      absl::StrAppend(out, "zeroshard_rank_memory_bytes{", r.labels, ",category=\"", category,
                      "\"} ", bytes, "\n");
    }
  }
  Family(out, "zeroshard_rank_collective_wait_seconds", "gauge",
         "Time the rank's last step waited for collectives, by op (all_gather: parameter "
         "gathers; reduce: gradient reductions).");
  for (const ListedRank& r : ranks) {
    absl::StrAppend(out, "zeroshard_rank_collective_wait_seconds{", r.labels,
                    ",op=\"all_gather\"} ", r.m->last_step().gather_wait_ms() / 1e3, "\n");
    absl::StrAppend(out, "zeroshard_rank_collective_wait_seconds{", r.labels, ",op=\"reduce\"} ",
                    r.m->last_step().reduce_wait_ms() / 1e3, "\n");
  }
}

// The families with one series per listed rank (labels job, rank, worker).
using RankValue = std::function<void(const v1::MemberStatus&, std::string*)>;

// One per-rank family: `value` writes each listed rank's sample.
void PerRank(const std::vector<ListedRank>& ranks, const char* name, const char* type,
             const char* help, const RankValue& value, std::string* out) {
  Family(out, name, type, help);
  for (const ListedRank& r : ranks) {
    absl::StrAppend(out, name, "{", r.labels, "} ");
    value(*r.m, out);
    *out += '\n';
  }
}

// The ranks' data-plane bytes (all, on their host, across hosts) and their
// checkpoint commits waiting for the server.
void WriteRankTrafficFamilies(const std::vector<ListedRank>& ranks, std::string* out) {
  auto per_rank = [&](const char* name, const char* type, const char* help,
                      const RankValue& value) { PerRank(ranks, name, type, help, value, out); };
  per_rank("zeroshard_rank_data_plane_sent_bytes_total", "counter",
           "Bytes the rank sent through its data plane since its generation began.",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.telemetry().bytes_moved());
           });
  per_rank("zeroshard_rank_comm_bytes_intra_host_total", "counter",
           "Of the data-plane bytes, those sent to ranks on the rank's own host (shared memory, "
           "loopback).",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.telemetry().comm_bytes_intra_host());
           });
  per_rank("zeroshard_rank_comm_bytes_inter_host_total", "counter",
           "Of the data-plane bytes, those sent across the network to ranks on other hosts.",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.telemetry().comm_bytes_inter_host());
           });
  per_rank("zeroshard_rank_commits_pending", "gauge",
           "Checkpoints the rank wrote whose commits wait for the server (committed in order "
           "once it answers).",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.telemetry().commits_pending());
           });
}

void WriteRankFamilies(const v1::GetStatusResponse& status,
                       const std::vector<std::string>& job_labels, const MetricsView& view,
                       std::string* out) {
  const std::vector<ListedRank> ranks = ListRanksOfPage(status, job_labels, view, out);
  out->reserve(out->size() + ranks.size() * 2600);
  auto per_rank = [&](const char* name, const char* type, const char* help,
                      const RankValue& value) { PerRank(ranks, name, type, help, value, out); };
  per_rank("zeroshard_rank_alive", "gauge", "1 while the member is alive (not dead, not left).",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.alive() && !m.left() ? 1 : 0);
           });
  per_rank("zeroshard_rank_left", "gauge",
           "1 once the member left cleanly (its job finished); 0 while alive or when dead.",
           [](const v1::MemberStatus& m, std::string* o) { absl::StrAppend(o, m.left() ? 1 : 0); });
  per_rank("zeroshard_rank_step", "gauge", "Steps the rank completed.",
           [](const v1::MemberStatus& m, std::string* o) { absl::StrAppend(o, m.step()); });
  per_rank("zeroshard_rank_loss", "gauge", "Loss of the rank's last step (mean over ranks).",
           [](const v1::MemberStatus& m, std::string* o) { absl::StrAppend(o, m.loss()); });
  per_rank("zeroshard_rank_step_seconds", "gauge", "Wall time of the rank's last step.",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.last_step().step_ms() / 1e3);
           });
  per_rank("zeroshard_rank_items_per_second", "gauge",
           "Job-wide throughput (tokens or rows per second) of the rank's last step.",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.last_step().items_per_second());
           });
  WriteRankBreakdowns(ranks, out);
  per_rank("zeroshard_rank_arrival_lag_seconds", "gauge",
           "How far behind the first rank this rank entered its last step's first collective.",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(o, m.telemetry().arrival_lag_ms() / 1e3);
           });
  per_rank("zeroshard_rank_arrival_lag_median_seconds", "gauge",
           "Median arrival lag over the last 20 steps (-1: fewer steps yet).",
           [](const v1::MemberStatus& m, std::string* o) {
             const double median = m.telemetry().arrival_lag_median_ms();
             absl::StrAppend(o, median < 0 ? -1.0 : median / 1e3);
           });
  per_rank("zeroshard_rank_heartbeat_age_seconds", "gauge",
           "Time since the rank's last heartbeat (-1: none yet).",
           [](const v1::MemberStatus& m, std::string* o) {
             absl::StrAppend(
                 o, m.last_heartbeat_age_ms() < 0 ? -1.0 : m.last_heartbeat_age_ms() / 1e3);
           });
  per_rank("zeroshard_rank_in_collective_seconds", "gauge",
           "How long the rank had been in its oldest collective in flight when it last "
           "reported (-1: none in flight, or the rank is dead or left).",
           [](const v1::MemberStatus& m, std::string* o) {
             const v1::RankTelemetry& t = m.telemetry();
             absl::StrAppend(o, t.has_in_progress() ? t.in_progress().age_ms() / 1e3 : -1.0);
           });
  per_rank("zeroshard_rank_straggler", "gauge", "1 while the rank is flagged a straggler.",
           [](const v1::MemberStatus& m, std::string* o) { absl::StrAppend(o, m.straggler()); });
  per_rank("zeroshard_rank_hung", "gauge",
           "1 while the rank is named in a hang or schedule disagreement.",
           [](const v1::MemberStatus& m, std::string* o) { absl::StrAppend(o, m.hung()); });
  per_rank(
      "zeroshard_rank_collectives", "gauge", "Collectives the rank completed in its generation.",
      [](const v1::MemberStatus& m, std::string* o) { absl::StrAppend(o, m.collective_seq()); });
  WriteRankTrafficFamilies(ranks, out);
}

}  // namespace

std::string MetricsExposition(const ServerMetrics& server, const v1::GetStatusResponse& status,
                              const std::map<std::string, CheckpointCounts>& checkpoints,
                              const MetricsView& view) {
  std::string out;
  out.reserve(4096 + static_cast<size_t>(status.jobs_size()) * 512);
  server.Write(&out);
  WriteControlPlane(status.control_plane(), &out);
  WriteStateCounts(status, &out);
  std::vector<std::string> job_labels;
  for (const v1::JobStatus& job : status.jobs()) {
    job_labels.push_back(absl::StrCat("job=\"", EscapeLabelValue(job.job_id()), "\""));
  }
  WriteJobFamilies(status, checkpoints, job_labels, &out);
  WriteGoodputFamilies(status, job_labels, &out);
  WriteHostFamilies(status, job_labels, &out);
  WriteRankHistograms(status, job_labels, &out);
  WriteRankFamilies(status, job_labels, view, &out);
  return out;
}

}  // namespace zeroshard
