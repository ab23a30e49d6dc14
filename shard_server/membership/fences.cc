// Machines fenced from a job. A rank whose shard was named corrupted twice
// (docs/numerics.md) has its machine evicted: the members there are declared
// dead at once, as a dead host's would be after a heartbeat timeout, and the
// machine's joins to the job are refused until an operator lifts the fence
// (shardctl unfence), so the job shrinks or takes a replacement elsewhere
// instead of landing on the same memory again. A fence is kept with the job
// in the state store: it survives a restart and a failover.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {
namespace {

// The machine a member or a join runs on: its node, or its host when it
// sent none (an older worker; the host is then as good a name as there is).
std::string MachineOf(const std::string& node, const std::string& host) {
  return node.empty() ? host : node;
}

// "<hostname> <boot id>" -> "<hostname>" (what an operator types).
std::string Hostname(const std::string& node) { return node.substr(0, node.find(' ')); }

}  // namespace

absl::Status Membership::CheckNotFenced(const v1::JoinRequest& request, const Job& job) const {
  if (job.fences.empty()) return absl::OkStatus();
  auto fence = job.fences.find(MachineOf(request.node(), request.host()));
  if (fence == job.fences.end()) fence = job.fences.find(request.host());
  if (fence == job.fences.end()) return absl::OkStatus();
  const v1::FencedHost& f = fence->second;
  const std::string hostname = Hostname(f.node());
  absl::Status refused = absl::FailedPreconditionError(
      absl::StrCat("worker '", request.worker_id(), "' runs on machine '", f.node(),
                   "', which is fenced from job '", job.id, "' since ",
                   absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(f.unix_ms()),
                                    absl::UTCTimeZone()),
                   " (", f.reason(),
                   "); start the worker on another machine, or check this one (its memory, "
                   "its accelerators) and lift the fence with: shardctl unfence --job=",
                   job.id, " --host=", hostname));
  log_->Log(
      "join_refused",
      {{"job", job.id}, {"worker", request.worker_id()}, {"node", f.node()}, {"reason", "fenced"}});
  return refused;
}

absl::StatusOr<v1::EvictHostResponse> Membership::EvictHost(const v1::EvictHostRequest& request) {
  Deferred deferred;
  absl::StatusOr<v1::EvictHostResponse> result = [&]() -> absl::StatusOr<v1::EvictHostResponse> {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Job*> found = FindMemberJob(request.member(), /*allow_stale=*/true);
    if (!found.ok()) return found.status();
    Job& job = **found;
    if (absl::Status s = SaveUnsaved(job); !s.ok()) return s;
    if (request.rank() < 0 || request.rank() >= static_cast<int>(job.members.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "EvictHost: rank ", request.rank(), " is not a rank of job '", job.id, "' generation ",
          job.members_generation, " (0..", job.members.size() - 1, ")"));
    }
    const MemberState& named = job.members[request.rank()];
    const std::string node = MachineOf(named.node, named.host);
    v1::EvictHostResponse response;
    response.set_node(node);
    if (job.fences.count(node) > 0) {
      response.set_already(true);
      return response;
    }
    const absl::Time now = clock_->Now();
    v1::FencedHost fence;
    fence.set_node(node);
    fence.set_rank(request.rank());
    fence.set_step(request.step());
    fence.set_unix_ms(absl::ToUnixMillis(now));
    fence.set_reason(request.reason().empty()
                         ? absl::StrCat("silent corruption on rank ", request.rank(), " at step ",
                                        request.step())
                         : request.reason());
    job.fences[node] = fence;
    // The fence is saved before anyone hears of it; the deaths below stand
    // whatever the disk says, as a dead host's would.
    if (absl::Status saved = SaveChange(
            job, absl::StrCat("job '", job.id, "' could not fence machine '", node, "'"));
        !saved.ok()) {
      job.fences.erase(node);
      return saved;
    }
    log_->Log("host_evicted", {{"job", job.id},
                               {"node", node},
                               {"rank", absl::StrCat(request.rank())},
                               {"step", absl::StrCat(request.step())},
                               {"by_rank", absl::StrCat(request.member().rank())},
                               {"reason", fence.reason()}});
    DeclareMachineDead(job, node, fence.reason(), now, deferred);
    return response;
  }();
  SyncState(LastCommit()).IgnoreError();
  for (auto& f : deferred) f();
  return result;
}

void Membership::DeclareMachineDead(Job& job, const std::string& node, const std::string& why,
                                    absl::Time now, Deferred& deferred) {
  std::string dead;
  for (MemberState& m : job.members) {
    if (!m.alive || m.left || MachineOf(m.node, m.host) != node) continue;
    MarkDead(job, m, now, absl::StrCat("its machine was evicted: ", why), &dead);
  }
  // Joins held from the machine (a forming generation) can never be taken.
  const absl::Status refused = absl::FailedPreconditionError(
      absl::StrCat("machine '", node, "' was fenced from job '", job.id, "' (", why,
                   "); lift it with: shardctl unfence --job=", job.id, " --host=", Hostname(node)));
  for (auto it = job.pending.begin(); it != job.pending.end();) {
    if (MachineOf(it->second.node, it->second.host) != node) {
      ++it;
      continue;
    }
    pending_by_id_.erase(it->second.id);
    deferred.push_back([done = std::move(it->second.done), refused]() { done(refused); });
    it = job.pending.erase(it);
  }
  if (dead.empty()) return;
  if (job.formed()) {
    const int64_t old = job.generation;
    job.world_size = job.WithGrowers(job.world_size);
    job.generation++;
    job.state = v1::DEGRADED;
    job.degraded_at = now;
    const std::string reason = absl::StrCat(dead, " evicted with their machine (", why, ")");
    Remember(job, reason);
    AnnounceGeneration(job, old, reason, deferred);
  }
  SaveOrMarkUnsaved(job, absl::StrCat("generation ", job.generation, " after an eviction"));
}

absl::StatusOr<v1::UnfenceHostResponse> Membership::UnfenceHost(const std::string& job_id,
                                                                const std::string& host) {
  absl::StatusOr<v1::UnfenceHostResponse> result =
      [&]() -> absl::StatusOr<v1::UnfenceHostResponse> {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("no job '", job_id, "' on this server"));
    }
    Job& job = *it->second;
    if (absl::Status s = SaveUnsaved(job); !s.ok()) return s;
    std::map<std::string, v1::FencedHost> lifted;
    for (auto f = job.fences.begin(); f != job.fences.end();) {
      if (f->first != host && Hostname(f->first) != host) {
        ++f;
        continue;
      }
      lifted.insert(*f);
      f = job.fences.erase(f);
    }
    v1::UnfenceHostResponse response;
    if (lifted.empty()) return response;
    if (absl::Status saved = SaveChange(
            job, absl::StrCat("job '", job_id, "' could not lift the fence on '", host, "'"));
        !saved.ok()) {
      job.fences.insert(lifted.begin(), lifted.end());
      return saved;
    }
    for (const auto& [node, fence] : lifted) {
      response.add_nodes(node);
      log_->Log("host_unfenced", {{"job", job_id}, {"node", node}, {"reason", fence.reason()}});
    }
    return response;
  }();
  SyncState(LastCommit()).IgnoreError();
  return result;
}

}  // namespace zeroshard
