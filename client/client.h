// zeroshard::Client: what a worker (and shardctl) links to talk to the shard
// server. Join with retries, a background heartbeat that hands the server's
// commands to the caller, the KV store of the member's job generation, Leave.
//
// Thread-safe, except Join/Leave which the owner calls from one thread.
#ifndef ZEROSHARD_CLIENT_CLIENT_H_
#define ZEROSHARD_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/plan/planner.h"
#include "common/plan/shard_plan.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"

namespace zeroshard {

struct ClientOptions {
  std::string server;  // HOST:PORT, or HOST:PORT,HOST:PORT,... (common/server_list.h)
  std::string token;   // bearer token; empty: none
  // LoadClientFiles accepts a token file any user may read or write, or a
  // short token (shard_worker and shardctl --insecure).
  bool insecure = false;
  // TLS (PEM contents). tls_ca set: TLS on, server verified against it;
  // tls_cert/tls_key: the client certificate for mutual TLS.
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_server_name;  // expected name in the server certificate, if not the host
  absl::Duration rpc_timeout = absl::Seconds(30);  // for calls that do not wait
  // The node agent of this host (shard_agent --listen, docs/scale.md), e.g.
  // "unix:/run/zeroshard/agent.sock": heartbeats, joins and StoreWaits go through it while
  // it answers, straight to the server when it does not. Empty: no agent.
  std::string agent;
};

// Reads the token and TLS files (each optional: "" reads nothing) into
// `options`: the token stripped of surrounding whitespace (a token file any
// user may read or write, or a token under 16 characters, is refused unless
// options->insecure: common/secret_file.h), the PEM files as they are.
// client/connection_flags.h applies it to the connection flags.
absl::Status LoadClientFiles(const std::string& token_file, const std::string& ca_file,
                             const std::string& cert_file, const std::string& key_file,
                             ClientOptions* options);

struct JoinInfo {
  int rank = -1;
  int world_size = 0;
  int64_t generation = 0;
  std::string job_id;
  std::string token;
  std::vector<v1::Member> members;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // The most steps any member of the job completed so far (the server's
  // count): a step below it trained again is lost work (docs/goodput.md).
  int64_t steps_done = 0;
};

// What a consolidation reports as it goes.
struct ConsolidateProgress {
  int64_t work_done = 0;       // the server's progress: bytes verified, then bytes written
  int64_t work_total = 0;      // 0 until the server's first progress message
  int64_t bytes_received = 0;  // output bytes received so far (streamed mode)
  int64_t bytes_expected = 0;  // output bytes announced so far (streamed mode)
  std::string file;            // the file being received
};

struct Progress {
  int64_t step = 0;
  double loss = 0;
  int64_t memory_bytes = 0;
  int64_t collective_seq = 0;
  v1::StepTelemetry last_step;  // where the last step's time went
  int64_t snapshot_step = -1;   // the latest committed in-memory snapshot
  v1::RecoveryRecord recovery;  // the latest recovery (generation 0: none)
  v1::RankTelemetry telemetry;  // the last step's arrival; live fields come from the source
};

// Fault-tolerance fields of a Join (shard_worker --min_world_size,
// --rejoin_grace; the incarnation is random per process).
struct JoinExtras {
  int min_world_size = 0;
  absl::Duration rejoin_grace = absl::ZeroDuration();
  std::string incarnation;
  std::string node;        // "<hostname> <boot id>" (common/local_address.h)
  int world_multiple = 0;  // JoinRequest.world_multiple: --shard_group_size
};

absl::Status FromGrpcStatus(const grpc::Status& status);

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();  // stops heartbeats; does not Leave

  // Joins `job_id`, waiting for the rest of the job. While no server accepts
  // a connection it waits for one (within a reconnect backoff, <= 1 s, of a
  // new leader serving); it retries with backoff (100 ms doubling to 2 s)
  // when the call fails (the leader died in the barrier), or the worker id
  // is still a live member of the job (ALREADY_EXISTS: an earlier incarnation
  // not yet declared dead), or its generation was abandoned (ABORTED), until
  // `timeout`. Other refusals are returned at once.
  absl::StatusOr<JoinInfo> Join(const std::string& job_id, int world_size,
                                const std::string& worker_id, const std::string& host,
                                absl::Duration timeout);
  // Sent with every later Join.
  void set_join_extras(const JoinExtras& extras) { join_extras_ = extras; }
  // The most steps this process completed in the job (JoinRequest.
  // steps_completed), sent with every later Join.
  void set_steps_completed(int64_t steps) { steps_completed_ = steps; }
  // REQUIRES: a successful Join.
  const JoinInfo& info() const { return info_; }
  v1::MemberCredentials credentials() const;

  // Called on the heartbeat thread with every command other than CONTINUE,
  // or with the error that ended heartbeating (a fenced member, say).
  using CommandHandler = std::function<void(absl::StatusOr<v1::HeartbeatResponse>)>;
  // Starts beating every heartbeat_interval on a background thread; a broken
  // stream is re-opened (the server may have restarted). Heartbeats stop after
  // the first non-CONTINUE command or error is handed to `handler`.
  void StartHeartbeats(CommandHandler handler);
  void StopHeartbeats() ABSL_LOCKS_EXCLUDED(heartbeat_threads_mu_);
  // How long since the server last answered a heartbeat (since
  // StartHeartbeats when it has not yet): a long one means the server is
  // unreachable from here.
  absl::Duration SinceHeartbeatAnswer();
  void ReportProgress(const Progress& progress);
  // --sync=diloco, rank 0: an outer step and who took part. The last
  // kOuterStepsSent go with every later heartbeat (the next one sent now)
  // and with Leave.
  static constexpr int kOuterStepsSent = 8;
  void ReportOuterStep(const v1::OuterStepRecord& record);
  // A collective failed here: the next heartbeat, sent now, says so
  // (HeartbeatRequest.peer_failure), and so does every later one, 50 ms
  // apart, until heartbeats are restarted: the server's abort comes within
  // 50 ms of its decision, not a heartbeat interval later.
  void ReportPeerFailure();
  // Called on the heartbeat thread before every beat, without the client's
  // lock, to fill what changes between steps (memory, the collective in
  // flight) into the reported telemetry. Empty: none.
  using TelemetrySource = std::function<void(v1::RankTelemetry*)>;
  void SetTelemetrySource(TelemetrySource source);

  // A clean exit from the job, with the member's time ledger as it leaves
  // (LeaveRequest.final_time; empty: none). A server that is away
  // (restarting) is waited for, up to the client's rpc_timeout.
  // `failure` (cut to 1 KiB): this member exits on a failure of the job's
  // inputs, which ends the job (LeaveRequest.failure).
  absl::Status Leave(const v1::TimeLedger& final_time = v1::TimeLedger(),
                     const std::string& failure = "");

  // The KV store of this member's job generation.
  absl::Status StoreSet(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> StoreGet(const std::string& key, absl::Duration timeout);
  absl::StatusOr<int64_t> StoreAdd(const std::string& key, int64_t delta);
  absl::Status StoreWait(const std::vector<std::string>& keys, absl::Duration timeout);
  // TCPStore's compare_set: the value the key holds afterwards.
  absl::StatusOr<std::string> StoreCompareSet(const std::string& key, const std::string& expected,
                                              const std::string& desired);
  absl::StatusOr<bool> StoreDelete(const std::string& key);               // false: there was none
  absl::StatusOr<bool> StoreCheck(const std::vector<std::string>& keys);  // never waits
  absl::StatusOr<int64_t> StoreNumKeys();

  // As a member: asks the server to evict the machine of `rank` (its shard
  // was corrupted twice after `step`; docs/numerics.md). Idempotent.
  absl::StatusOr<v1::EvictHostResponse> EvictHost(int rank, int64_t step,
                                                  const std::string& reason);
  // Admin: lifts job `job_id`'s fences on machine `host` (shardctl unfence).
  absl::StatusOr<v1::UnfenceHostResponse> UnfenceHost(const std::string& job_id,
                                                      const std::string& host);

  absl::StatusOr<v1::GetStatusResponse> GetStatus(const std::string& job_id);
  // With a view of large jobs (GetStatusRequest.max_members: their summary
  // and worst ranks instead of every member, and rank or host look-ups).
  absl::StatusOr<v1::GetStatusResponse> GetStatus(const v1::GetStatusRequest& request);
  // The job's per-step history as the server keeps it (`rank` -1: all).
  absl::StatusOr<v1::GetHistoryResponse> GetHistory(const std::string& job_id, int rank = -1);
  // As a member (after Join): the job generation's plan. Before any Join: a
  // one-off plan for `world_size`. The plan crossed the wire (maybe from a
  // server of another version), so it is checked before it is returned:
  // ValidatePlan against `spec` and the world size asked for; INTERNAL naming
  // the server and the failed check otherwise.
  absl::StatusOr<ShardPlan> PlanShards(const ModelSpec& spec, const PlanOptions& options,
                                       int world_size);
  // grpc.health.v1 Check of the whole server: OK when SERVING.
  absl::Status HealthCheck();
  // The channel to the server (TLS, keepalive and reconnection as configured):
  // what shard_agent speaks its own RPCs on.
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

  // ---- Checkpoints ----
  // As a member: commits this rank's shard file of `step`, `file` relative
  // to the server's checkpoint root ("<job>/step-<N>/rank-<R>-of-<W>.safetensors"),
  // with its size in bytes and tensor -> XXH64 hex checksums. The call may
  // take `timeout`, never less than rpc_timeout: the server reads the file's
  // header and, for the last rank, writes and fsyncs the manifest. A server
  // that is away (restarting, or its leader failing over) is waited for within
  // the timeout, and a call it dropped is made again, here and in
  // UploadShard. Errors name `file` ("commit of <file>: ...").
  absl::StatusOr<v1::CommitShardResponse> CommitShard(
      int64_t step, const std::string& file, int64_t size_bytes,
      const std::map<std::string, std::string>& checksums,
      absl::Duration timeout = absl::Minutes(2));
  // As a member: streams the local file `local_path` to the server, which
  // stores it as `file` below its root (1 MiB messages), within `timeout`
  // for the whole stream. Returns the bytes stored. CommitShard follows as
  // usual. Errors of the stream name `file` ("upload of <file>: ...").
  absl::StatusOr<int64_t> UploadShard(int64_t step, const std::string& file,
                                      const std::string& local_path,
                                      absl::Duration timeout = absl::Hours(24));
  // As a member: this rank could not save its piece of `step` (`failure`
  // says why, e.g. "No space left on device"); the server abandons the step
  // for every rank (CommitShardRequest.failure). `retry_step`: the step the
  // job checkpoints next (0: none).
  absl::Status AbandonCheckpointStep(int64_t step, const std::string& failure, int64_t retry_step,
                                     absl::Duration timeout = absl::Minutes(2));
  // Checkpoints of `job_id` (empty: every job).
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const std::string& job_id);

  using ConsolidateProgressFn = std::function<void(const ConsolidateProgress&)>;
  // Merges a complete step into safetensors. Unless request.on_server(), the
  // bytes stream back and are written at `out_path`: the file itself for one
  // file (inside it if `out_path` is a directory), a directory (created if
  // missing) for Hugging Face shards (max_shard_bytes > 0). Every file goes
  // through a temporary name and all are renamed into place only when the
  // whole stream arrived; on any error nothing is left. The summary's files
  // are the local paths (or the server's paths under its root with
  // on_server). `progress` (optional) is called from this thread.
  absl::StatusOr<v1::ConsolidateSummary> Consolidate(const v1::ConsolidateRequest& request,
                                                     const std::string& out_path,
                                                     ConsolidateProgressFn progress = nullptr);

 private:
  // OK once the channel is connected to a server, polling it meanwhile;
  // UNAVAILABLE naming the servers when none accepted by `until`.
  absl::Status AwaitConnection(absl::Time until);
  // One attempt of CommitShard / UploadShard within `timeout`.
  absl::StatusOr<v1::CommitShardResponse> CommitShardOnce(
      int64_t step, const std::string& file, int64_t size_bytes,
      const std::map<std::string, std::string>& checksums, absl::Duration timeout);
  absl::StatusOr<int64_t> UploadShardOnce(int64_t step, const std::string& file,
                                          const std::string& local_path, absl::Duration timeout);
  Client() = default;
  // Sets the bearer token and a deadline `timeout` from now. A channel not
  // connected is first given up to one reconnect (1.5 s, within `timeout`)
  // with this thread polling it: after a failover, a long-lived client's
  // channel would otherwise fail fast until gRPC's 5-s backup poller happened
  // to complete a connection attempt (see AwaitConnection).
  void Prepare(grpc::ClientContext* context, absl::Duration timeout) const;
  // One unary call of `method` with a deadline `timeout` from now.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*,
                                                                              const Request&,
                                                                              Response*),
                                const Request& request, absl::Duration timeout) const {
    grpc::ClientContext context;
    Prepare(&context, timeout);
    Response response;
    absl::Status s = FromGrpcStatus((stub_.get()->*method)(&context, request, &response));
    if (!s.ok()) return s;
    return response;
  }
  // Call for a read (GetStatus, GetHistory): asked once more on
  // UNAVAILABLE, within `timeout`. A connection that broke under the call
  // (its server killed, a failover: "Broken pipe") fails it although
  // another server, or the same one restarted, would answer on a new
  // connection; a read asked twice is harmless. Once, not until the
  // deadline: `shardctl status` against a server that is down says so
  // at once.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Read(grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*,
                                                                              const Request&,
                                                                              Response*),
                                const Request& request, absl::Duration timeout) const {
    constexpr absl::Duration kRetryPause = absl::Milliseconds(100);
    const absl::Time deadline = absl::Now() + timeout;
    absl::StatusOr<Response> response = Call(method, request, timeout);
    if (!absl::IsUnavailable(response.status()) || absl::Now() + kRetryPause >= deadline) {
      return response;
    }
    absl::SleepFor(kRetryPause);
    return Call(method, request, deadline - absl::Now());
  }
  // The next beat: credentials, progress and telemetry as they are now.
  v1::HeartbeatRequest NextBeat() ABSL_LOCKS_EXCLUDED(mu_);
  void HeartbeatLoop(CommandHandler handler);
  // Where heartbeats and joins go now: the node agent when one is configured
  // and answers, the server otherwise (said once on stderr).
  v1::Coordinator::Stub* AgentOrServer();
  // While heartbeats run: says on stderr every kSilenceReport that the server
  // has not answered a heartbeat for longer than the heartbeat timeout, and
  // once when it answers again. The heartbeat thread itself may be blocked
  // in a call while the server is unreachable; this one is not.
  void ReportSilences();

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::shared_ptr<grpc::Channel> agent_channel_;  // null: no --agent
  std::unique_ptr<v1::Coordinator::Stub> agent_stub_;
  std::atomic<bool> said_no_agent_{false};
  JoinInfo info_;
  JoinExtras join_extras_;
  int64_t steps_completed_ = 0;

  absl::Mutex mu_;
  Progress progress_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::OuterStepRecord> outer_steps_ ABSL_GUARDED_BY(mu_);  // ReportOuterStep
  TelemetrySource telemetry_source_ ABSL_GUARDED_BY(mu_);
  bool stop_heartbeats_ ABSL_GUARDED_BY(mu_) = false;
  bool peer_failure_ ABSL_GUARDED_BY(mu_) = false;      // ReportPeerFailure
  bool beat_now_ ABSL_GUARDED_BY(mu_) = false;          // wakes the heartbeat loop
  bool heartbeats_ended_ ABSL_GUARDED_BY(mu_) = false;  // HeartbeatLoop returned
  absl::Time last_answer_ ABSL_GUARDED_BY(mu_);         // SinceHeartbeatAnswer
  int64_t step_at_answer_ ABSL_GUARDED_BY(mu_) = 0;     // progress_.step at last_answer_
  grpc::ClientContext* heartbeat_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  void StopHeartbeatThreads() ABSL_EXCLUSIVE_LOCKS_REQUIRED(heartbeat_threads_mu_);
  // Serializes StartHeartbeats and StopHeartbeats: callers on several threads
  // (the Python bridge releases the GIL) must not assign a running thread.
  absl::Mutex heartbeat_threads_mu_;
  std::thread heartbeat_thread_ ABSL_GUARDED_BY(heartbeat_threads_mu_);
  std::thread silence_thread_ ABSL_GUARDED_BY(heartbeat_threads_mu_);  // ReportSilences
};

}  // namespace zeroshard

#endif  // ZEROSHARD_CLIENT_CLIENT_H_
