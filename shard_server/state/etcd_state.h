// The shard server's durable state and leadership on etcd (v3 gRPC API).
//
// Several shard servers run with the same --etcd_endpoints. Each holds an
// EtcdSession: a lease (TTL 2 s by default) renewed every TTL/4, and a
// campaign on etcd's Election service under "<prefix>/leader" with its own
// address as the value. The one that wins leads: it loads the state store's
// last image from etcd (EtcdStateReplica) and serves; the others wait in
// Campaign and do not listen at all, so a client's channel over every
// server's address (common/server_list.h) connects to the leader.
//
// Fencing: every write of the leader is one Txn that puts the image only if
// its leadership key still exists with the create revision it won with. A
// leader paused past its lease (its key deleted by etcd, another server
// elected) has its late write refused, never applied.
//
// Losing the lease (not renewed within its TTL: etcd unreachable or without
// quorum, or etcd says it expired) ends the leadership: WaitLost() returns
// why, and the server stops serving and campaigns again.
#ifndef ZEROSHARD_SHARD_SERVER_STATE_ETCD_STATE_H_
#define ZEROSHARD_SHARD_SERVER_STATE_ETCD_STATE_H_

#include <cstdint>
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
  std::string endpoints;             // "HOST:PORT,HOST:PORT,...": etcd's client URLs
  std::string prefix = "/zeroshard";  // every key of this control plane starts with it
  absl::Duration lease_ttl = absl::Seconds(2);
  absl::Duration rpc_timeout = absl::Seconds(1);  // of one etcd call (not Campaign)
};

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
  absl::Status FencedPut(const std::string& key, const std::string& value)
      ABSL_LOCKS_EXCLUDED(mu_);

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

// The state store's image under "<prefix>/state", zlib-compressed, written
// with FencedPut. Load and Save fail with UNAVAILABLE while etcd is out of
// reach; Save also when this server no longer leads.
class EtcdStateReplica : public DatabaseReplica {
 public:
  explicit EtcdStateReplica(EtcdSession* session)
      : session_(session), key_(session->options().prefix + "/state") {}
  absl::StatusOr<std::string> Load() override;
  absl::Status Save(absl::string_view image) override;

 private:
  EtcdSession* const session_;
  const std::string key_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_ETCD_STATE_H_
