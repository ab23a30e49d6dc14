// shard_server: the zeroshard control plane.
//
//   shard_server --listen=0.0.0.0:7070 --state_dir=/var/lib/zeroshard
//   shard_server --listen=10.0.0.1:7070 --etcd_endpoints=e1:2379,e2:2379,e3:2379
//
// With --etcd_endpoints several servers share one durable state in etcd; one
// leads and serves, the others wait to take over (replicated_server.h).
//
// Prints "listening on HOST:PORT" once serving; SIGINT/SIGTERM stop it.
#include <malloc.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <algorithm>
#include <limits>
#include <string>
#include <thread>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/command_line.h"
#include "common/local_address.h"
#include "common/secret_file.h"
#include "shard_server/replicated_server.h"
#include "shard_server/shard_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "HOST:PORT to serve on; port 0 picks a free port");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written here once serving");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for the SQLite database and server files, made if missing (its parents "
          "too; the directory itself private, 0700) (empty: state is not kept across restarts)");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "HOST:PORT,... of an etcd v3 cluster's client URLs: the durable state lives there and "
          "several servers with the same endpoints and --etcd_prefix elect one leader that serves "
          "(the others take over within seconds when it fails); empty: SQLite under --state_dir");
ABSL_FLAG(int, etcd_max_txn_ops, 128,
          "Operations per etcd transaction when writing the state: at most etcd's --max-txn-ops "
          "(128 by default). A change larger than one transaction is written in several, made "
          "atomic by a head key written last");
ABSL_FLAG(int64_t, etcd_max_txn_bytes, 1 << 20,
          "Bytes of keys and values per etcd transaction: under etcd's --max-request-bytes "
          "(1.5 MiB by default)");
ABSL_FLAG(int, etcd_compact_every_writes, 1000,
          "The leader compacts etcd's history (at the revision of its last complete write) every "
          "this many state writes, or --etcd_compact_interval, whichever comes first; 0: only by "
          "the interval");
ABSL_FLAG(absl::Duration, etcd_compact_interval, absl::Minutes(5),
          "The longest time between two compactions of etcd's history by the leader");
ABSL_FLAG(int64_t, etcd_quota_bytes, int64_t{2} << 30,
          "etcd's --quota-backend-bytes (etcd does not tell it over its API): shardctl status and "
          "/metrics show the database size against it and warn above 80 %");
ABSL_FLAG(std::string, etcd_prefix, "/zeroshard",
          "Every etcd key of this control plane starts with it (one prefix per control plane)");
ABSL_FLAG(
    absl::Duration, etcd_lease_ttl, absl::Seconds(2),
    "The leader's etcd lease: a leader that cannot renew it for this long stops serving, "
    "and a failed leader is replaced this long after its last renewal (whole seconds, >= 1s)");
ABSL_FLAG(std::string, advertise, "",
          "HOST:PORT this server is reached at, recorded in etcd while it leads (empty: --listen)");
ABSL_FLAG(std::string, checkpoint_root, "",
          "Directory below which workers' shard files are committed (or uploaded) and "
          "consolidated; the server reads and writes nothing outside it (empty: no checkpoint "
          "RPCs)");
ABSL_FLAG(int, keep_last, 0,
          "Complete checkpoints kept per job; older complete steps are deleted when a newer one "
          "completes (0: keep all)");
ABSL_FLAG(int, heartbeat_interval_ms, 1000, "Heartbeat interval advertised to workers");
ABSL_FLAG(absl::Duration, restore_grace, absl::Seconds(10),
          "After a restart or a failover, how long restored members have to beat again, from "
          "when the server serves (at least the heartbeat timeout): every agent and worker "
          "re-attaches at once, and at 100,000 ranks that takes seconds");
ABSL_FLAG(int, heartbeat_timeout_ms, 3000,
          "A member silent this long is declared dead and its job's generation bumped");
ABSL_FLAG(absl::Duration, isolation_grace, absl::Seconds(90),
          "When every member of a job falls silent at once, the likelier cause is the server's "
          "own network: wait this long before declaring them dead (0: no wait; "
          "docs/multihost.md)");
ABSL_FLAG(int, join_timeout_ms, 600000,
          "A join still waiting for the rest of its job after this long gets DEADLINE_EXCEEDED");
ABSL_FLAG(int, heartbeat_queues, 16,
          "Completion queues (one thread each) serving heartbeat streams; a beat's cost grows "
          "with the streams per queue (docs/scale.md)");
ABSL_FLAG(int, max_world_size, 131072, "Largest world size a job may ask for");
ABSL_FLAG(int64_t, kv_max_job_bytes, 256 << 20, "KV store: keys and values of one job, in bytes");
ABSL_FLAG(int64_t, kv_max_wait_keys, 131072, "KV store: keys one StoreWait may name");
ABSL_FLAG(int64_t, kv_max_waiters_per_job, 1 << 17, "KV store: gets and waits held for one job");
ABSL_FLAG(int64_t, kv_max_total_bytes, int64_t{1} << 30,
          "KV store: keys, values and waited-for keys of every job, in bytes");
ABSL_FLAG(int64_t, max_request_bytes_in_flight, int64_t{256} << 20,
          "StoreSet, StoreWait, StoreCheck and StoreCompareSet requests being received, parsed or "
          "held at once, in bytes as received and as parsed; more are refused RESOURCE_EXHAUSTED "
          "unparsed");
ABSL_FLAG(int, max_jobs, 10000, "Jobs the server holds at once; more are refused");
ABSL_FLAG(int, max_pending_joins, 1 << 18, "Joins held at once over every job");
ABSL_FLAG(absl::Duration, job_ttl, absl::Hours(24),
          "A job with no live member and no pending join is forgotten after this long (its "
          "checkpoints stay); a job that never formed, once its last join expires");
ABSL_FLAG(absl::Duration, answer_delivery_timeout, absl::Seconds(30),
          "A rank that joined through a node agent is judged by the heartbeat timeout from its "
          "first beat, not from its generation's formation; at most this long after formation "
          "its clock starts anyway");
ABSL_FLAG(int, max_consolidations, 4,
          "Consolidations running at once; more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, consolidate_stall_timeout_s, 60,
          "A streamed consolidation whose caller reads nothing for this long is cancelled, "
          "freeing its slot");
ABSL_FLAG(int64_t, checkpoint_upload_max_job_bytes, int64_t{64} << 30,
          "Checkpoint uploads (--checkpoint_transport=grpc) of one job in flight, in bytes of "
          "the sizes they announce; more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, checkpoint_upload_max_total_bytes, int64_t{256} << 30,
          "Checkpoint uploads of every job in flight, in bytes; keep it under the free space "
          "of --checkpoint_root");
ABSL_FLAG(int, testing_hold_commit_of_rank, -1,
          "Tests only: this rank's checkpoint commits wait --testing_commit_hold before they "
          "are recorded (a window to kill the server in); -1: none");
ABSL_FLAG(absl::Duration, testing_commit_hold, absl::Seconds(2),
          "Tests only: see --testing_hold_commit_of_rank");
ABSL_FLAG(int, hang_report_ms, 10000,
          "Ranks waiting this long in a collective that another rank has not entered (and that "
          "rank not advancing) are reported as a hang naming that rank, in shardctl status, the "
          "metrics and the log; keep it well under the workers' --collective_timeout");
ABSL_FLAG(int64_t, history_max_points_per_job, 1 << 18,
          "The per-step history (shardctl history, the dashboard's plots) keeps about this many "
          "points per job, split evenly over its ranks; a rank over its share keeps its newest "
          "half and every other older point");
ABSL_FLAG(int64_t, history_min_points_per_rank, 64,
          "Each rank's share of --history_max_points_per_job is at least this many points");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT of the metrics port: Prometheus text at /metrics and the dashboard at / "
          "(empty: off); with --auth_token_file, /metrics and the dashboard's data need the token");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the bound metrics port is written here once serving");
ABSL_FLAG(bool, insecure, false,
          "Accept an --auth_token_file (or job token file) that every user may read or write, a "
          "token shorter than 16 characters, a token over plaintext on a non-loopback "
          "--listen address, or a non-loopback --listen address with no authentication at all "
          "(no token, job tokens or --tls_client_ca) (all refused otherwise)");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token; then every RPC except health needs "
          "'authorization: Bearer <token>'");
ABSL_FLAG(std::string, job_tokens_dir, "",
          "Directory of job tokens, one file <job>.token each (shardctl job create writes one): a "
          "job token acts on its own job only; --auth_token_file's token stays the admin's. Read "
          "again whenever the directory changes (remove a file to revoke its token)");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain file: serve TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key file for --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA file: require client certificates signed by it (mutual TLS)");
ABSL_FLAG(bool, tls_bind_worker_ids, false,
          "With --tls_client_ca: a join's worker id must be bound to its client certificate: the "
          "id's host part (before the first '/') is one of the certificate's subject "
          "alternative names or its common name, or --tls_worker_id_map pairs them; other joins "
          "are refused with PERMISSION_DENIED");
ABSL_FLAG(std::string, tls_worker_id_map, "",
          "File of 'IDENTITY HOST_PART' lines ('*': any host part; '#' comments): certificate "
          "identities that may join as worker ids of other host parts. Implies "
          "--tls_bind_worker_ids");

namespace {

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream buffer;
  buffer << in.rdbuf();
  *out = buffer.str();
  return true;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "shard_server: %s\n", message.c_str());
  return 2;
}

// Each returns INVALID_ARGUMENT with the message shard_server prints when a
// flag's value is refused.
absl::Status ReadMembershipFlags(zeroshard::ShardServerOptions& options) {
  if (absl::GetFlag(FLAGS_heartbeat_interval_ms) <= 0 ||
      absl::GetFlag(FLAGS_heartbeat_timeout_ms) <= absl::GetFlag(FLAGS_heartbeat_interval_ms)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_timeout_ms (", absl::GetFlag(FLAGS_heartbeat_timeout_ms),
                     ") must exceed --heartbeat_interval_ms (",
                     absl::GetFlag(FLAGS_heartbeat_interval_ms), ") and both be > 0"));
  }
  if (absl::GetFlag(FLAGS_join_timeout_ms) <= 0)
    return absl::InvalidArgumentError("--join_timeout_ms must be > 0");
  if (absl::GetFlag(FLAGS_max_world_size) < 1)
    return absl::InvalidArgumentError("--max_world_size must be >= 1");
  if (absl::GetFlag(FLAGS_heartbeat_queues) < 1 || absl::GetFlag(FLAGS_heartbeat_queues) > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--heartbeat_queues ",
                                                   absl::GetFlag(FLAGS_heartbeat_queues),
                                                   " must be between 1 and 1024"));
  }
  options.heartbeat_queues = absl::GetFlag(FLAGS_heartbeat_queues);
  options.membership.heartbeat_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  options.membership.restore_grace = absl::GetFlag(FLAGS_restore_grace);
  options.membership.heartbeat_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  options.membership.isolation_grace = absl::GetFlag(FLAGS_isolation_grace);
  if (options.membership.isolation_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--isolation_grace must be >= 0");
  }
  options.membership.join_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
  options.membership.max_world_size = absl::GetFlag(FLAGS_max_world_size);
  options.membership.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  options.membership.max_pending_joins = absl::GetFlag(FLAGS_max_pending_joins);
  options.membership.job_ttl = absl::GetFlag(FLAGS_job_ttl);
  if (options.membership.max_jobs < 1 || options.membership.max_pending_joins < 1) {
    return absl::InvalidArgumentError("--max_jobs and --max_pending_joins must be >= 1");
  }
  if (options.membership.job_ttl < absl::ZeroDuration())
    return absl::InvalidArgumentError("--job_ttl must be >= 0");
  options.membership.answer_delivery_timeout = absl::GetFlag(FLAGS_answer_delivery_timeout);
  if (options.membership.answer_delivery_timeout < absl::ZeroDuration())
    return absl::InvalidArgumentError("--answer_delivery_timeout must be >= 0");
  return absl::OkStatus();
}

absl::Status ReadKvFlags(zeroshard::ShardServerOptions& options) {
  const std::pair<const char*, int64_t> kv_bounds[] = {
      {"kv_max_job_bytes", absl::GetFlag(FLAGS_kv_max_job_bytes)},
      {"kv_max_wait_keys", absl::GetFlag(FLAGS_kv_max_wait_keys)},
      {"kv_max_waiters_per_job", absl::GetFlag(FLAGS_kv_max_waiters_per_job)},
      {"kv_max_total_bytes", absl::GetFlag(FLAGS_kv_max_total_bytes)},
      {"max_request_bytes_in_flight", absl::GetFlag(FLAGS_max_request_bytes_in_flight)}};
  for (const auto& [flag, value] : kv_bounds) {
    if (value < 1)
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1, not ", value));
  }
  options.kv.max_job_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_kv_max_job_bytes));
  options.kv.max_wait_keys = static_cast<size_t>(absl::GetFlag(FLAGS_kv_max_wait_keys));
  options.kv.max_waiters_per_job = static_cast<size_t>(absl::GetFlag(FLAGS_kv_max_waiters_per_job));
  options.kv.max_total_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_kv_max_total_bytes));
  options.max_request_bytes_in_flight =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_request_bytes_in_flight));
  return absl::OkStatus();
}

absl::Status ReadCheckpointAndTelemetryFlags(zeroshard::ShardServerOptions& options) {
  options.checkpoint_service.max_consolidations = absl::GetFlag(FLAGS_max_consolidations);
  if (options.checkpoint_service.max_consolidations < 1) {
    return absl::InvalidArgumentError("--max_consolidations must be >= 1");
  }
  if (absl::GetFlag(FLAGS_consolidate_stall_timeout_s) < 1) {
    return absl::InvalidArgumentError("--consolidate_stall_timeout_s must be >= 1");
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, int64_t>{"checkpoint_upload_max_job_bytes",
                                        absl::GetFlag(FLAGS_checkpoint_upload_max_job_bytes)},
        {"checkpoint_upload_max_total_bytes",
         absl::GetFlag(FLAGS_checkpoint_upload_max_total_bytes)}}) {
    if (value < 1)
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1, not ", value));
  }
  options.checkpoint_service.max_upload_job_bytes =
      absl::GetFlag(FLAGS_checkpoint_upload_max_job_bytes);
  options.checkpoint_service.max_upload_total_bytes =
      absl::GetFlag(FLAGS_checkpoint_upload_max_total_bytes);
  if (absl::GetFlag(FLAGS_hang_report_ms) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hang_report_ms must be >= 1, not ", absl::GetFlag(FLAGS_hang_report_ms)));
  }
  options.history.max_points_per_job = absl::GetFlag(FLAGS_history_max_points_per_job);
  options.history.min_points_per_rank = absl::GetFlag(FLAGS_history_min_points_per_rank);
  if (options.history.min_points_per_rank < 2 ||
      options.history.max_points_per_job < options.history.min_points_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--history_min_points_per_rank (", options.history.min_points_per_rank,
        ") must be >= 2 and --history_max_points_per_job (", options.history.max_points_per_job,
        ") at least as large"));
  }
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.telemetry.hang_report = absl::Milliseconds(absl::GetFlag(FLAGS_hang_report_ms));
  options.checkpoint_service.stall_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_consolidate_stall_timeout_s));
  options.checkpoint_service.testing_hold_commit_of_rank =
      absl::GetFlag(FLAGS_testing_hold_commit_of_rank);
  options.checkpoint_service.testing_commit_hold = absl::GetFlag(FLAGS_testing_commit_hold);
  return absl::OkStatus();
}

absl::Status ReadSecurityFiles(zeroshard::ShardServerOptions& options) {
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    absl::StatusOr<std::string> token = zeroshard::ReadTokenFile(
        absl::GetFlag(FLAGS_auth_token_file), "--auth_token_file", absl::GetFlag(FLAGS_insecure));
    if (!token.ok()) return absl::InvalidArgumentError(std::string(token.status().message()));
    options.auth_token = *std::move(token);
  }
  options.job_tokens_dir = absl::GetFlag(FLAGS_job_tokens_dir);
  options.insecure_job_tokens = absl::GetFlag(FLAGS_insecure);
  const std::pair<std::string, std::string*> tls_files[] = {
      {absl::GetFlag(FLAGS_tls_cert), &options.tls_cert},
      {absl::GetFlag(FLAGS_tls_key), &options.tls_key},
      {absl::GetFlag(FLAGS_tls_client_ca), &options.tls_client_ca}};
  for (const auto& [path, field] : tls_files) {
    if (!path.empty() && !ReadFile(path, field))
      return absl::InvalidArgumentError("cannot read " + path);
  }
  options.tls_bind_worker_ids = absl::GetFlag(FLAGS_tls_bind_worker_ids);
  if (const std::string map = absl::GetFlag(FLAGS_tls_worker_id_map); !map.empty()) {
    if (!ReadFile(map, &options.tls_worker_id_map)) {
      return absl::InvalidArgumentError("cannot read --tls_worker_id_map " + map);
    }
    options.tls_bind_worker_ids = true;
  }
  if (absl::Status s = zeroshard::CheckListenAuthenticated(absl::GetFlag(FLAGS_listen),
                                                           !options.auth_token.empty() ||
                                                               !options.job_tokens_dir.empty() ||
                                                               !options.tls_client_ca.empty(),
                                                           absl::GetFlag(FLAGS_insecure));
      !s.ok()) {
    return s;
  }
  return zeroshard::CheckTokenTransport(!options.auth_token.empty(), !options.tls_cert.empty(),
                                        absl::GetFlag(FLAGS_listen), absl::GetFlag(FLAGS_insecure),
                                        "--tls_cert and --tls_key");
}

// The server's options from the flags.
absl::StatusOr<zeroshard::ShardServerOptions> OptionsFromFlags() {
  zeroshard::ShardServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  if (absl::Status s = zeroshard::CheckListenAddress("listen", options.listen, false); !s.ok()) {
    return s;
  }
  if (const std::string metrics = absl::GetFlag(FLAGS_metrics_listen); !metrics.empty()) {
    if (absl::Status s = zeroshard::CheckListenAddress("metrics_listen", metrics, false); !s.ok()) {
      return s;
    }
  }
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  options.keep_last = absl::GetFlag(FLAGS_keep_last);
  if (options.keep_last < 0)
    return absl::InvalidArgumentError("--keep_last must be >= 0 (0 keeps every checkpoint)");
  if (options.keep_last > 0 && options.checkpoint_root.empty()) {
    return absl::InvalidArgumentError("--keep_last needs --checkpoint_root");
  }
  for (auto read :
       {ReadMembershipFlags, ReadKvFlags, ReadCheckpointAndTelemetryFlags, ReadSecurityFiles}) {
    if (absl::Status s = read(options); !s.ok()) return s;
  }
  return options;
}

// Written through a temporary name, so that a reader never sees half.
bool WritePortFile(const std::string& path, int port) {
  if (path.empty()) return true;
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// The port files and the "listening on" line; "" or what went wrong.
std::string AnnounceServing(zeroshard::ShardServer& server) {
  // The metrics port first, so that --port_file means everything is up.
  if (!WritePortFile(absl::GetFlag(FLAGS_metrics_port_file), server.metrics_port())) {
    return "cannot write --metrics_port_file " + absl::GetFlag(FLAGS_metrics_port_file);
  }
  if (!WritePortFile(absl::GetFlag(FLAGS_port_file), server.port())) {
    return "cannot write --port_file " + absl::GetFlag(FLAGS_port_file);
  }
  if (server.metrics_port() != 0) {
    std::printf("metrics on port %d\n", server.metrics_port());
  }
  std::printf("listening on %s\n", server.address().c_str());
  std::fflush(stdout);
  return "";
}

// One of several servers on etcd: serves while it leads, until a signal.
int RunReplicated(const zeroshard::ShardServerOptions& options, sigset_t signals) {
  zeroshard::EtcdOptions etcd;
  etcd.endpoints = absl::GetFlag(FLAGS_etcd_endpoints);
  etcd.prefix = absl::GetFlag(FLAGS_etcd_prefix);
  etcd.lease_ttl = absl::GetFlag(FLAGS_etcd_lease_ttl);
  etcd.max_txn_ops = absl::GetFlag(FLAGS_etcd_max_txn_ops);
  etcd.max_txn_bytes = static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_etcd_max_txn_bytes)));
  etcd.compact_every_writes = absl::GetFlag(FLAGS_etcd_compact_every_writes);
  if (etcd.compact_every_writes <= 0) etcd.compact_every_writes = std::numeric_limits<int>::max();
  etcd.compact_interval = absl::GetFlag(FLAGS_etcd_compact_interval);
  etcd.quota_bytes = absl::GetFlag(FLAGS_etcd_quota_bytes);
  if (etcd.max_txn_ops < 3) {
    return Fail("--etcd_max_txn_ops must be at least 3 (it is " +
                std::to_string(etcd.max_txn_ops) + ")");
  }
  if (etcd.max_txn_bytes < (64 << 10)) {
    return Fail("--etcd_max_txn_bytes must be at least 65536 (it is " +
                std::to_string(etcd.max_txn_bytes) + "): etcd's default allows 1.5 MiB");
  }
  // A value and its key fit in one transaction.
  etcd.max_value_bytes = std::min<size_t>(etcd.max_value_bytes, etcd.max_txn_bytes / 2);
  if (etcd.prefix.empty() || etcd.prefix[0] != '/') {
    return Fail("--etcd_prefix must start with '/' (it is '" + etcd.prefix + "')");
  }
  if (etcd.lease_ttl < absl::Seconds(1) ||
      etcd.lease_ttl != absl::Trunc(etcd.lease_ttl, absl::Seconds(1))) {
    return Fail("--etcd_lease_ttl must be whole seconds, at least 1s (it is " +
                absl::FormatDuration(etcd.lease_ttl) + ")");
  }
  std::string advertise = absl::GetFlag(FLAGS_advertise);
  if (advertise.empty()) advertise = options.listen;
  zeroshard::ReplicatedServer server(options, etcd, advertise, [](zeroshard::ShardServer& s) {
    if (std::string error = AnnounceServing(s); !error.empty()) {
      std::fprintf(stderr, "shard_server: %s\n", error.c_str());
    }
  });
  std::thread signal_thread([&server, signals]() {
    int sig = 0;
    sigwait(&signals, &sig);
    std::fprintf(stderr, "shard_server: signal %d, shutting down\n", sig);
    server.Stop();
  });
  signal_thread.detach();
  if (absl::Status s = server.Run(); !s.ok()) return Fail(std::string(s.message()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "zeroshard control plane: rendezvous, KV store, health, plans, checkpoints");
  zeroshard::ParseCommandLineOrExit(argc, argv, /*bad_flag_exit_code=*/2);
  // Debian's Abseil is built with the mutex deadlock detector on: a lock
  // graph updated on every acquisition, 4-8 % of the server's CPU while
  // 10,000 ranks beat (perf, docs/scale.md). The tests (their own binaries)
  // keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Requests of a few megabytes (StoreWaits of many keys, plans of large
  // specs) come and go; glibc's default raises its mmap threshold after the
  // first such free and then serves them from arenas that do not shrink,
  // one per thread that touched them, so the server's memory would keep the
  // high-water mark of every burst. A fixed threshold returns large buffers
  // to the system when freed, and few arenas bound the fragmentation.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  mallopt(M_ARENA_MAX, 2);

  absl::StatusOr<zeroshard::ShardServerOptions> read = OptionsFromFlags();
  if (!read.ok()) return Fail(std::string(read.status().message()));
  const zeroshard::ShardServerOptions& options = *read;

  // Signals are taken by one thread with sigwait, so every other thread
  // (gRPC's included) must start with them blocked.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (!absl::GetFlag(FLAGS_etcd_endpoints).empty()) return RunReplicated(options, signals);
  absl::StatusOr<std::unique_ptr<zeroshard::ShardServer>> server =
      zeroshard::ShardServer::Start(options);
  if (!server.ok()) return Fail(server.status().ToString());
  if (std::string error = AnnounceServing(**server); !error.empty()) return Fail(error);

  std::thread signal_thread([s = server->get(), signals]() {
    int sig = 0;
    sigwait(&signals, &sig);
    std::fprintf(stderr, "shard_server: signal %d, shutting down\n", sig);
    s->Shutdown();
  });
  signal_thread.detach();
  (*server)->Wait();
  (*server)->Shutdown();
  return 0;
}
