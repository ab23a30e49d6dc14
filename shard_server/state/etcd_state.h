// The shard server's durable state and leadership on etcd (v3 gRPC API).
//
// Several shard servers run with the same --etcd_endpoints. Each holds an
// EtcdSession: a lease (TTL 2 s by default) renewed every TTL/4, and a
// campaign on etcd's Election service under "<prefix>/leader" with its own
// address as the value. The one that wins leads: it loads the state store's
// state from etcd (EtcdStateReplica) and serves; the others wait in
// Campaign and do not listen at all, so a client's channel over every
// server's address (common/server_list.h) connects to the leader.
//
// Fencing: every write of the leader is a Txn that applies only if its
// leadership key still exists with the create revision it won with. A
// leader paused past its lease (its key deleted by etcd, another server
// elected) has its late write refused, never applied.
//
// Losing the lease (not renewed within its TTL: etcd unreachable or without
// quorum, or etcd says it expired) ends the leadership: WaitLost() returns
// why, and the server stops serving and campaigns again.
#ifndef ZEROSHARD_SHARD_SERVER_STATE_ETCD_STATE_H_
#define ZEROSHARD_SHARD_SERVER_STATE_ETCD_STATE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcdserver/api/v3election/v3electionpb/v3election.grpc.pb.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "shard_server/state/sql_database.h"

namespace zeroshard {

struct EtcdOptions {
  std::string endpoints;              // "HOST:PORT,HOST:PORT,...": etcd's client URLs
  std::string prefix = "/zeroshard";  // every key of this control plane starts with it
  absl::Duration lease_ttl = absl::Seconds(2);
  absl::Duration rpc_timeout = absl::Seconds(1);  // of one etcd call (not Campaign)

  // The state's writes (EtcdStateReplica). etcd's defaults allow 128
  // operations per transaction (--max-txn-ops) and 1.5 MiB per request
  // (--max-request-bytes); values are split above max_value_bytes.
  size_t max_value_bytes = 256 << 10;
  int max_txn_ops = 128;
  size_t max_txn_bytes = 1 << 20;
  // The leader compacts etcd's history at the revision of its last complete
  // write every this many writes or this long, whichever comes first.
  int compact_every_writes = 1000;
  absl::Duration compact_interval = absl::Minutes(5);
  // etcd's --quota-backend-bytes (its default: 2 GiB), for status and the
  // warning at 80 %: etcd does not say it over its API.
  int64_t quota_bytes = int64_t{2} << 30;
};

// One operation of a fenced transaction: a put, or a delete of one key (or
// of every key in [key, range_end) when range_end is set).
struct EtcdOp {
  std::string key;
  std::string value;
  bool is_delete = false;
  std::string range_end;
};

// A key read by EtcdSession::Range.
struct EtcdKeyValue {
  std::string key;
  std::string value;  // empty with keys_only
  int64_t mod_revision = 0;
};

// What etcd says of itself (Maintenance.Status and its alarms).
struct EtcdHealth {
  int64_t db_size_bytes = 0;         // the database file
  int64_t db_size_in_use_bytes = 0;  // of it, what live keys and kept history use
  std::vector<std::string> alarms;   // "NOSPACE", "CORRUPT"
};

// An etcd error as a status that names its cause and what to do: a request
// too large, the NOSPACE alarm (the quota is full), too many operations in
// one transaction, no quorum or no etcd leader, etcd out of reach.
absl::Status EtcdError(absl::string_view endpoints, absl::string_view what,
                       const grpc::Status& status);

// Thread-safe.
class EtcdSession {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdSession>> Connect(const EtcdOptions& options);
  ~EtcdSession();  // Cancel()s, stops renewing (the lease then expires)

  // Grants a new lease and renews it on a thread until it is lost.
  absl::Status StartLease() ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until this session leads, `value` (the server's address) being
  // the leader's value, or until Cancel() (CANCELLED) or the lease is lost.
  absl::Status Campaign(const std::string& value) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until the lease is lost or Cancel(); returns why (kCancelled
  // after Cancel()).
  std::string WaitLost() ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr char kCancelled[] = "the etcd session was cancelled";
  // Ends Campaign and WaitLost; the session is then spent.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // Gives the leadership up at once (a clean shutdown: no TTL to wait).
  void Resign() ABSL_LOCKS_EXCLUDED(mu_);

  // Records this server (`value`: its address) under "<prefix>/servers/"
  // for as long as its lease lives: one write per session.
  absl::Status Register(const std::string& value) ABSL_LOCKS_EXCLUDED(mu_);
  // Every registered server's address.
  absl::StatusOr<std::vector<std::string>> Servers();
  // The current leader's value ("" : none).
  absl::StatusOr<std::string> Leader();
  // When the lease was last renewed (its grant, before the first renewal).
  absl::Time last_renewal() const ABSL_LOCKS_EXCLUDED(mu_);

  // `key`'s value; "" when there is none.
  absl::StatusOr<std::string> Get(const std::string& key);
  // Puts key = value only while this session's leadership key exists as it
  // was won (fencing). UNAVAILABLE when it is gone or etcd cannot be reached.
  absl::Status FencedPut(const std::string& key, const std::string& value) ABSL_LOCKS_EXCLUDED(mu_);
  // Applies `ops` in one transaction only while this session's leadership
  // key exists as it was won; returns etcd's revision after it.
  absl::StatusOr<int64_t> FencedTxn(const std::vector<EtcdOp>& ops) ABSL_LOCKS_EXCLUDED(mu_);
  // Up to `limit` keys in [key, range_end) in key order, as of `revision`
  // (0: now). `more`: keys are left after the last one returned.
  absl::StatusOr<std::vector<EtcdKeyValue>> Range(const std::string& key,
                                                  const std::string& range_end, int64_t revision,
                                                  int64_t limit, bool keys_only, bool* more);
  // Every key with `prefix`, as of `revision` (0: now), read in pages.
  absl::StatusOr<std::vector<EtcdKeyValue>> RangeAll(const std::string& prefix, int64_t revision,
                                                     bool keys_only);
  // Drops etcd's history before `revision` (its older values of keys).
  absl::Status Compact(int64_t revision);
  absl::StatusOr<EtcdHealth> Health();
  // OK while this session leads and its lease was renewed within the TTL
  // (counted from the renewal's sending): a write acknowledged after that
  // check was made while no other server could lead. UNAVAILABLE otherwise
  // (a server that was paused past its lease: its queued calls are refused).
  absl::Status CheckLeading() const ABSL_LOCKS_EXCLUDED(mu_);

  const EtcdOptions& options() const { return options_; }
  // The lease this session renews (0: none yet).
  int64_t lease_id() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit EtcdSession(EtcdOptions options) : options_(std::move(options)) {}
  void RenewLoop(int64_t lease) ABSL_LOCKS_EXCLUDED(mu_);
  // One LeaseKeepAlive exchange: the TTL etcd grants (0: the lease is gone).
  absl::StatusOr<int64_t> RenewOnce(int64_t lease);
  void MarkLost(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  std::unique_ptr<grpc::ClientContext> CallContext() const;
  absl::Status Unavailable(absl::string_view what, const grpc::Status& status) const;

  const EtcdOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease_stub_;
  std::unique_ptr<v3electionpb::Election::Stub> election_;
  std::unique_ptr<etcdserverpb::Maintenance::Stub> maintenance_;

  mutable absl::Mutex mu_;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time renewed_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool have_leader_key_ ABSL_GUARDED_BY(mu_) = false;
  v3electionpb::LeaderKey leader_key_ ABSL_GUARDED_BY(mu_);
  std::string lost_ ABSL_GUARDED_BY(mu_);  // why the lease was lost; "": not lost
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* campaign_ ABSL_GUARDED_BY(mu_) = nullptr;  // in flight
  std::thread renewer_;
};

// The state store's rows (sql_replication.h) under "<prefix>/state/", one
// etcd key per entry. Values are zlib-compressed above 1 KiB and split into
// parts ("<key>/~<i>") above max_value_bytes, so that no etcd value is
// larger whatever the job size.
//
// A batch is written in as few fenced transactions as etcd's limits allow
// (max_txn_ops, max_txn_bytes). Its last transaction puts
// "<prefix>/state.head"; the state is every key as of head's revision. A
// batch that takes several transactions puts "<prefix>/state.pending" in
// its first and deletes it in its last; a leader that finds it (its
// predecessor died or was deposed half-way) reads the state as of head's
// revision and writes back whatever changed after it.
//
// The leader compacts etcd's history at head's revision every
// compact_every_writes writes or compact_interval, so that etcd's database
// holds the live state and a bounded history, not every value ever written.
//
// Load and Save fail with UNAVAILABLE while etcd is out of reach; Save also
// when this server no longer leads. Thread-safe.
class EtcdStateReplica : public DatabaseReplica {
 public:
  explicit EtcdStateReplica(EtcdSession* session);
  absl::StatusOr<std::vector<ReplicaEntry>> Load() override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Save(const ReplicaBatch& batch) override ABSL_LOCKS_EXCLUDED(mu_);

  struct Stats {
    int64_t batches = 0;        // saved
    int64_t transactions = 0;   // etcd transactions they took
    int64_t bytes_written = 0;  // keys and values put
    int64_t last_batch_bytes = 0;
    int64_t last_batch_transactions = 0;
    int64_t largest_value_bytes = 0;  // of one etcd value written
    int64_t head_revision = 0;        // of the last complete batch
    int64_t compacted_revision = 0;   // 0: none yet by this leader
    absl::Time compacted_at = absl::InfinitePast();
    std::string compaction_error;  // of the last compaction ("" : it worked)
    int64_t loaded_keys = 0;       // etcd keys read by Load
    int64_t loaded_bytes = 0;
    absl::Duration load_time;
    bool repaired = false;  // Load found a half-written batch and repaired it
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Writes `ops` (and head, and pending around several transactions).
  absl::Status Commit(std::vector<EtcdOp> ops, bool pending_exists)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Repair(int64_t head_revision, const std::vector<EtcdKeyValue>& at_head)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rows as of head: read now when no change was cut half-way
  // (`pending` empty), else at head's revision.
  absl::StatusOr<std::vector<EtcdKeyValue>> RowsAtHead(int64_t head_revision,
                                                       const std::string& pending)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeCompact() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The etcd keys and values of one entry (its parts) and the deletes of
  // parts it no longer has; returns its part count.
  int AddPut(const ReplicaEntry& entry, std::vector<EtcdOp>& ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddDelete(const std::string& key, std::vector<EtcdOp>& ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  EtcdSession* const session_;
  const std::string rows_prefix_;  // "<prefix>/state/"
  const std::string head_key_;     // "<prefix>/state.head"
  const std::string pending_key_;  // "<prefix>/state.pending"
  const std::string legacy_key_;   // "<prefix>/state": an older version's whole image

  mutable absl::Mutex mu_;
  // Parts of the entries stored in more than one (relative key -> count).
  std::map<std::string, int> parts_ ABSL_GUARDED_BY(mu_);
  bool legacy_ ABSL_GUARDED_BY(mu_) = false;        // the legacy image is still in etcd
  bool pending_left_ ABSL_GUARDED_BY(mu_) = false;  // a failed batch left pending
  int64_t head_value_ ABSL_GUARDED_BY(mu_) = 0;     // batches so far, head's value
  int writes_since_compaction_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_compaction_try_ ABSL_GUARDED_BY(mu_) = absl::Now();
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_ETCD_STATE_H_
