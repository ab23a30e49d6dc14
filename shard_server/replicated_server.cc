#include "shard_server/replicated_server.h"

#include <cstdio>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/fault_messages.h"
#include "shard_server/observability/server_metrics.h"

namespace zeroshard {
namespace {
// Between attempts while etcd cannot be reached (or the server cannot start).
constexpr absl::Duration kRetryPause = absl::Milliseconds(500);
// How often a follower reads who leads.
constexpr absl::Duration kLeaderReadPeriod = absl::Milliseconds(500);
}  // namespace

void ReplicatedServer::Say(const std::string& what) {
  std::fprintf(stderr, "shard_server: %s\n", what.c_str());
  std::fflush(stderr);
}

bool ReplicatedServer::Stopping() {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void ReplicatedServer::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  if (session_ != nullptr) session_->Cancel();
  if (server_ != nullptr) server_->Shutdown();
}

void ReplicatedServer::NoteFollowing(const std::string& leader, const std::string& etcd_error) {
  absl::MutexLock lock(&mu_);
  if (!leader.empty()) seen_leader_ = leader;
  etcd_error_ = etcd_error;
}

std::string ReplicatedServer::FollowerMetrics() {
  absl::MutexLock lock(&mu_);
  std::string out;
  absl::StrAppend(&out,
                  "# HELP zeroshard_control_plane_leader 1 on the server that leads the replicated "
                  "control plane (label: its address).\n"
                  "# TYPE zeroshard_control_plane_leader gauge\n"
                  "zeroshard_control_plane_leader{address=\"",
                  EscapeLabelValue(advertise_), "\"} 0\n");
  absl::StrAppend(&out,
                  "# HELP zeroshard_control_plane_seen_leader_info The leader this follower last "
                  "read from etcd.\n# TYPE zeroshard_control_plane_seen_leader_info gauge\n"
                  "zeroshard_control_plane_seen_leader_info{leader=\"",
                  EscapeLabelValue(seen_leader_), "\"} 1\n");
  absl::StrAppend(&out,
                  "# HELP zeroshard_control_plane_etcd_session 1 while this server holds an etcd "
                  "lease (it can be elected); 0: etcd is out of reach (label: why).\n"
                  "# TYPE zeroshard_control_plane_etcd_session gauge\n"
                  "zeroshard_control_plane_etcd_session{error=\"",
                  EscapeLabelValue(etcd_error_), "\"} ", etcd_error_.empty() ? 1 : 0, "\n");
  return out;
}

void ReplicatedServer::ServeFollowerMetrics() {
  if (options_.metrics_listen.empty()) return;
  std::map<std::string, HttpPage> pages;
  pages["/metrics"].render = [this](const std::map<std::string, std::string>&) {
    HttpResponse response;
    response.content_type = "text/plain; version=0.0.4; charset=utf-8";
    response.body = FollowerMetrics();
    return response;
  };
  if (http_ != nullptr) {
    http_->SetPages(std::move(pages));
    return;
  }
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
      MetricsHttpServer::Start(options_.metrics_listen, options_.auth_token, std::move(pages));
  if (!http.ok()) {
    Say(absl::StrCat("cannot serve a follower's /metrics: ", http.status().message()));
    return;
  }
  http_ = *std::move(http);
}

absl::Status ReplicatedServer::Run() {
  while (!Stopping()) {
    ServeFollowerMetrics();
    absl::StatusOr<std::unique_ptr<EtcdSession>> session = EtcdSession::Connect(etcd_);
    if (!session.ok()) return session.status();
    if (absl::Status s = (*session)->StartLease(); !s.ok()) {
      NoteFollowing("", std::string(s.message()));
      Say(absl::StrCat("cannot start an etcd session, retrying: ", s.message()));
      absl::SleepFor(kRetryPause);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      session_ = session->get();
    }
    if (absl::Status s = (*session)->Register(advertise_); !s.ok()) {
      Say(absl::StrCat("cannot register in etcd (shardctl status will not list this server): ",
                       s.message()));
    }
    absl::StatusOr<std::string> leader = (*session)->Leader();
    NoteFollowing(leader.ok() ? *leader : "", "");
    Say(absl::StrCat("campaigning for leadership of ", etcd_.prefix, " as ", advertise_,
                     leader.ok() && !leader->empty() ? " (leader: " + *leader + ")" : ""));
    // Who leads is read again while waiting (a read, never a write), so
    // that a new leader names the one it took over from.
    std::string previous = leader.ok() ? *leader : "";
    absl::Notification campaign_over;
    std::thread watch([&, said = previous]() mutable {
      while (!campaign_over.WaitForNotificationWithTimeout(kLeaderReadPeriod)) {
        absl::StatusOr<std::string> now = (*session)->Leader();
        if (!now.ok()) continue;
        // A follower's log names the leader of now, not the one it saw when
        // it began to campaign.
        if (*now != said && *now != advertise_) {
          Say(LeaderSeenLine(etcd_.prefix, *now, said));
          said = *now;
        }
        absl::MutexLock lock(&mu_);
        if (!now->empty() && *now != advertise_) previous = *now;
        if (!now->empty()) seen_leader_ = *now;
      }
    });
    absl::Status won = (*session)->Campaign(advertise_);
    campaign_over.Notify();
    watch.join();
    if (won.ok()) {
      Lead(**session, previous);  // its ShardServer's pages replace the follower's
    } else if (!absl::IsCancelled(won)) {
      NoteFollowing("", std::string(won.message()));
      Say(absl::StrCat("campaign ended: ", won.message()));
    }
    absl::MutexLock lock(&mu_);
    session_ = nullptr;
  }
  http_.reset();
  return absl::OkStatus();
}

// The control plane's part of GetStatus and /metrics while leading.
void ReplicatedServer::Describe(EtcdSession& session, const EtcdStateReplica& replica,
                                const Term& term, v1::ControlPlaneStatus* out) {
  out->set_leader(advertise_);
  out->set_etcd_endpoints(etcd_.endpoints);
  out->set_etcd_lease_ttl_seconds(absl::ToDoubleSeconds(etcd_.lease_ttl));
  out->set_etcd_lease_renewed_seconds_ago(
      absl::ToDoubleSeconds(absl::Now() - session.last_renewal()));
  out->set_elected_unix_ms(absl::ToUnixMillis(term.elected));
  out->set_previous_leader(term.previous_leader);
  out->set_terms(term.number);
  absl::MutexLock lock(&mu_);
  out->set_restore_seconds(absl::ToDoubleSeconds(term.restore));  // written under mu_
  // An etcd read, at most once a second however often status is asked.
  if (absl::Now() - servers_read_at_ >= absl::Seconds(1)) {
    absl::StatusOr<std::vector<std::string>> servers = session.Servers();
    if (servers.ok()) servers_ = *std::move(servers);
    servers_read_at_ = absl::Now();
  }
  for (const std::string& s : servers_) {
    if (s != advertise_) out->add_followers(s);
  }
  // etcd's own state, read at most every 5 s (two calls).
  if (absl::Now() - health_read_at_ >= absl::Seconds(5)) {
    health_ = session.Health();
    health_read_at_ = absl::Now();
  }
  v1::EtcdStorage* storage = out->mutable_etcd_storage();
  storage->set_quota_bytes(etcd_.quota_bytes);
  if (health_.ok()) {
    storage->set_db_size_bytes(health_->db_size_bytes);
    storage->set_db_size_in_use_bytes(health_->db_size_in_use_bytes);
    for (const std::string& alarm : health_->alarms) storage->add_alarms(alarm);
  } else {
    storage->set_error(std::string(health_.status().message()));
  }
  const EtcdStateReplica::Stats stats = replica.stats();
  storage->set_state_batches(stats.batches);
  storage->set_state_bytes_written(stats.bytes_written);
  storage->set_last_batch_bytes(stats.last_batch_bytes);
  storage->set_last_batch_transactions(stats.last_batch_transactions);
  storage->set_largest_value_bytes(stats.largest_value_bytes);
  storage->set_head_revision(stats.head_revision);
  storage->set_compacted_revision(stats.compacted_revision);
  if (stats.compacted_at != absl::InfinitePast()) {
    storage->set_compacted_unix_ms(absl::ToUnixMillis(stats.compacted_at));
  }
  storage->set_compaction_error(stats.compaction_error);
  storage->set_loaded_keys(stats.loaded_keys);
  storage->set_loaded_bytes(stats.loaded_bytes);
  storage->set_load_seconds(absl::ToDoubleSeconds(stats.load_time));
}

void ReplicatedServer::Lead(EtcdSession& session, const std::string& previous_leader) {
  NoteFollowing(advertise_, "");  // what its follower /metrics says after this term
  Term term;
  term.elected = absl::Now();
  term.previous_leader = previous_leader;
  {
    absl::MutexLock lock(&mu_);
    term.number = ++terms_;
    servers_read_at_ = absl::InfinitePast();
  }
  EtcdStateReplica replica(&session);
  ShardServerOptions options = options_;
  options.state_replica = &replica;
  options.shared_http = http_.get();  // null without --metrics_listen, or when it could not listen
  // Filled once the server serves (below); read by status calls after that.
  auto shared_term = std::make_shared<Term>(term);
  options.control_plane = [this, &session, &replica, shared_term](v1::ControlPlaneStatus* out) {
    Describe(session, replica, *shared_term, out);
  };
  options.leadership_check = [&session] { return session.CheckLeading(); };
  absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start(options);
  if (!server.ok()) {
    Say(absl::StrCat("elected but cannot serve, resigning: ", server.status().ToString()));
    session.Resign();
    absl::SleepFor(kRetryPause);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    server_ = server->get();
    if (stopping_) server_->Shutdown();
  }
  {
    absl::MutexLock lock(&mu_);
    shared_term->restore = absl::Now() - term.elected;
  }
  Say(absl::StrCat("leading ", etcd_.prefix, " (term ", term.number,
                   previous_leader.empty() ? "" : ", after " + previous_leader,
                   "; state restored from etcd and serving in ",
                   absl::FormatDuration(absl::Now() - term.elected), ")"));
  on_serving_(**server);
  std::thread watcher([&] {
    const std::string why = session.WaitLost();
    if (!Stopping() && why != EtcdSession::kCancelled) {
      Say(absl::StrCat("lost leadership: ", why, "; stopping serving and campaigning again"));
    }
    (*server)->Shutdown();
  });
  (*server)->Wait();
  (*server)->Shutdown();
  session.Cancel();  // wakes the watcher when the server stopped for another reason
  watcher.join();
  {
    absl::MutexLock lock(&mu_);
    server_ = nullptr;
  }
  if (Stopping()) {
    session.Resign();  // the next leader need not wait out the lease
    Say("resigned leadership: stopping");
  }
  server->reset();  // before the replica it writes to
}

}  // namespace zeroshard
