#include "shard_server/replicated_server.h"

#include <cstdio>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace zeroshard {
namespace {
// Between attempts while etcd cannot be reached (or the server cannot start).
constexpr absl::Duration kRetryPause = absl::Milliseconds(500);
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

absl::Status ReplicatedServer::Run() {
  while (!Stopping()) {
    absl::StatusOr<std::unique_ptr<EtcdSession>> session = EtcdSession::Connect(etcd_);
    if (!session.ok()) return session.status();
    if (absl::Status s = (*session)->StartLease(); !s.ok()) {
      Say(absl::StrCat("cannot start an etcd session, retrying: ", s.message()));
      absl::SleepFor(kRetryPause);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      session_ = session->get();
    }
    Say(absl::StrCat("campaigning for leadership of ", etcd_.prefix, " as ", advertise_));
    absl::Status won = (*session)->Campaign(advertise_);
    if (won.ok()) {
      Lead(**session);
    } else if (!absl::IsCancelled(won)) {
      Say(absl::StrCat("campaign ended: ", won.message()));
    }
    absl::MutexLock lock(&mu_);
    session_ = nullptr;
  }
  return absl::OkStatus();
}

void ReplicatedServer::Lead(EtcdSession& session) {
  const absl::Time elected = absl::Now();
  EtcdStateReplica replica(&session);
  ShardServerOptions options = options_;
  options.state_replica = &replica;
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
  Say(absl::StrCat("leading ", etcd_.prefix, " (state restored from etcd and serving in ",
                   absl::FormatDuration(absl::Now() - elected), ")"));
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
