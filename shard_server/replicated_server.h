// ReplicatedServer: a shard server that is one of several on the same etcd
// (shard_server --etcd_endpoints). It campaigns for leadership
// (state/etcd_state.h); once elected it starts a ShardServer whose durable
// state is etcd's image (restored jobs get one heartbeat timeout from this
// start, as after a restart: no generation change); when its lease is lost
// it stops serving and campaigns again. Followers do not listen, so clients
// that list every server (common/server_list.h) reach the leader.
#ifndef ZEROSHARD_SHARD_SERVER_REPLICATED_SERVER_H_
#define ZEROSHARD_SHARD_SERVER_REPLICATED_SERVER_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "shard_server/observability/metrics_http.h"
#include "shard_server/shard_server.h"
#include "shard_server/state/etcd_state.h"

namespace zeroshard {

class ReplicatedServer {
 public:
  // `on_serving` is called each time this process starts leading, with the
  // server now serving (to write port files, print the address).
  ReplicatedServer(ShardServerOptions options, EtcdOptions etcd, std::string advertise,
                   std::function<void(ShardServer&)> on_serving)
      : options_(std::move(options)),
        etcd_(std::move(etcd)),
        advertise_(std::move(advertise)),
        on_serving_(std::move(on_serving)) {}

  // Campaigns and serves, again and again, until Stop(). Returns an error
  // only for a configuration that can never work (bad endpoints).
  absl::Status Run() ABSL_LOCKS_EXCLUDED(mu_);
  // From another thread (the signal thread): resigns and returns from Run().
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Term {
    int64_t number = 0;  // this process's leaderships so far, this one included
    absl::Time elected;
    absl::Duration restore;  // election to serving
    std::string previous_leader;
  };
  // One term: from the won campaign to the lost lease (or Stop).
  void Lead(EtcdSession& session, const std::string& previous_leader) ABSL_LOCKS_EXCLUDED(mu_);
  void Describe(EtcdSession& session, const EtcdStateReplica& replica, const Term& term,
                v1::ControlPlaneStatus* out) ABSL_LOCKS_EXCLUDED(mu_);
  bool Stopping() ABSL_LOCKS_EXCLUDED(mu_);
  void Say(const std::string& what);
  // While not leading, --metrics_listen serves a /metrics of its own: this
  // server follows (leader 0), whom it saw lead, and why it cannot lead when
  // etcd is out of reach. The leader's ShardServer puts its pages on the same
  // HTTP server (ShardServerOptions::shared_http): one listening socket for
  // the process's life, nothing stopped or rebound at a failover.
  void ServeFollowerMetrics() ABSL_LOCKS_EXCLUDED(mu_);
  std::string FollowerMetrics() ABSL_LOCKS_EXCLUDED(mu_);
  void NoteFollowing(const std::string& leader, const std::string& etcd_error)
      ABSL_LOCKS_EXCLUDED(mu_);

  ShardServerOptions options_;
  const EtcdOptions etcd_;
  const std::string advertise_;
  const std::function<void(ShardServer&)> on_serving_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  EtcdSession* session_ ABSL_GUARDED_BY(mu_) = nullptr;  // campaigning or leading
  ShardServer* server_ ABSL_GUARDED_BY(mu_) = nullptr;   // while leading
  int64_t terms_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> servers_ ABSL_GUARDED_BY(mu_);  // registered in etcd
  absl::Time servers_read_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::StatusOr<EtcdHealth> health_ ABSL_GUARDED_BY(mu_) = absl::UnavailableError("not read");
  absl::Time health_read_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // What a follower's /metrics says: the leader it last read ("" none) and
  // etcd's last error ("" while it holds an etcd session).
  std::string seen_leader_ ABSL_GUARDED_BY(mu_);
  std::string etcd_error_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<MetricsHttpServer> http_;  // Run()'s thread only
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_REPLICATED_SERVER_H_
