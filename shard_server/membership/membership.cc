// Membership's core: construction and listeners, finding a member's job,
// and a job's generations: formed when its join barrier completes, started
// by a change (a death, a re-join, a restart, a grow back), announced to the
// listener; and a job's end (forgotten once idle). What else the class does
// is in the files membership.h lists.
#include "shard_server/membership/membership.h"

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/local_address.h"
#include "common/utf8_prefix.h"
#include "shard_server/membership/member_table.h"

namespace zeroshard {
namespace {

bool TokensEqual(const std::string& a, const std::string& b) {
  // Constant time in the token's length: no early exit on the first mismatch.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

std::string Membership::Ms(absl::Duration d) { return absl::StrCat(absl::ToInt64Milliseconds(d)); }

Membership::Membership(Clock* clock, EventLog* log, StateStore* state, MembershipOptions options)
    : clock_(clock),
      log_(log),
      state_(state),
      options_(options),
      detector_options_{options.heartbeat_interval, options.heartbeat_timeout,
                        options.isolation_grace},
      server_lag_(detector_options_) {}

// Here, where Job is complete (member_table.h).
Membership::~Membership() = default;

void Membership::SetGenerationListener(GenerationListener listener) {
  absl::MutexLock lock(&mu_);
  listener_ = std::move(listener);
}

void Membership::SetForgetListener(ForgetListener listener) {
  absl::MutexLock lock(&mu_);
  forget_listener_ = std::move(listener);
}

void Membership::SetGenerationFloor(GenerationFloor floor) {
  absl::MutexLock lock(&mu_);
  generation_floor_ = std::move(floor);
}

void Membership::Remember(Job& job, const std::string& reason) {
  constexpr size_t kMaxHistory = 32;
  // A death of thousands of ranks names each of them: the server's log
  // (generation_bumped) keeps the whole reason; the history, which the
  // state store keeps, its start.
  constexpr size_t kMaxReason = 1024;
  std::string kept = reason;
  if (kept.size() > kMaxReason) {
    const absl::string_view cut = Utf8Prefix(reason, kMaxReason);  // a proto3 string is UTF-8
    kept = absl::StrCat(cut, "... (", reason.size() - cut.size(),
                        " bytes more in the server's log: generation_bumped)");
  }
  const int64_t seq = job.history.empty() ? 1 : job.history.back().seq + 1;
  job.history.push_back({seq, job.generation, std::move(kept), clock_->Now()});
  while (job.history.size() > kMaxHistory) job.history.pop_front();
}

std::string Membership::NewToken() {
  // 128 random bits from a cryptographically seeded generator.
  thread_local absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen), absl::Uniform<uint64_t>(gen));
}

absl::StatusOr<Membership::Job*> Membership::FindMemberJob(const v1::MemberCredentials& member,
                                                           bool allow_stale) {
  auto it = jobs_.find(member.job_id());
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("no job '", member.job_id(), "' on this server"));
  }
  Job& job = *it->second;
  if (member.generation() != job.members_generation || job.members.empty() ||
      (!allow_stale && member.generation() != job.generation)) {
    return absl::FailedPreconditionError(absl::StrCat("stale generation ", member.generation(),
                                                      ": job '", job.id, "' is at generation ",
                                                      job.generation, "; abort and join again"));
  }
  if (member.rank() < 0 || member.rank() >= static_cast<int>(job.members.size()) ||
      !TokensEqual(member.token(), job.members[member.rank()].token)) {
    return absl::FailedPreconditionError(
        absl::StrCat("wrong token for rank ", member.rank(), " of job '", job.id, "' generation ",
                     member.generation(), "; join to get a token"));
  }
  return &job;
}

absl::Status Membership::CheckHostsReachable(const Job& job) {
  std::set<std::string> nodes;
  std::vector<std::string> loopback;
  for (const auto& [worker_id, p] : job.pending) {
    if (!p.node.empty()) nodes.insert(p.node);
    if (IsLoopback(p.host)) loopback.push_back(absl::StrCat(worker_id, " (", p.host, ")"));
  }
  if (nodes.size() < 2 || loopback.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "job '", job.id, "' cannot form: its workers run on ", nodes.size(), " machines but ",
      absl::StrJoin(loopback, ", "),
      " advertise a loopback address, which peers on the other machines cannot reach; start "
      "them with --host=<an address the other machines reach>, or without --host (the "
      "address of the route to the server)"));
}

void Membership::FailPendingJoins(Job& job, const absl::Status& status, Deferred& deferred) {
  for (auto& [worker_id, p] : job.pending) {
    pending_by_id_.erase(p.id);
    deferred.push_back([done = std::move(p.done), status]() { done(status); });
  }
  job.pending.clear();
}

void Membership::FormGeneration(Job& job, Deferred& deferred) {
  absl::Time now = clock_->Now();
  if (absl::Status unreachable = CheckHostsReachable(job); !unreachable.ok()) {
    log_->Log("join_refused", {{"job", job.id}, {"reason", unreachable.ToString()}});
    FailPendingJoins(job, unreachable, deferred);
    return;
  }
  std::vector<MemberState> previous_members = std::move(job.members);
  const int64_t previous_members_generation = job.members_generation;
  const v1::JobState previous_state = job.state;
  job.members.clear();
  job.members.reserve(job.world_size);
  int rank = 0;
  for (auto& [worker_id, p] : job.pending) {  // std::map: sorted by worker id
    MemberState m;
    m.rank = rank++;
    m.worker_id = worker_id;
    m.host = p.host;
    m.incarnation = p.incarnation;
    m.node = p.node;
    m.token = NewToken();
    m.last_heartbeat = now;
    job.members.push_back(std::move(m));
  }
  job.IndexMembers();
  job.members_generation = job.generation;
  job.state = v1::RUNNING;
  job.data_plane_advanced = absl::InfinitePast();
  absl::Status saved = SaveChange(
      job, absl::StrCat("job '", job.id, "' generation ", job.generation, " could not be formed"));
  if (!saved.ok()) {
    job.members = std::move(previous_members);
    job.IndexMembers();
    job.members_generation = previous_members_generation;
    job.state = previous_state;
    FailPendingJoins(job, saved, deferred);
    return;
  }
  job.undelivered.clear();
  job.restarted_from = v1::JOB_STATE_UNSPECIFIED;  // the restart formed
  job.failure.clear();
  job.RebuildSilenceOrder();
  {
    int r = 0;
    for (const auto& [worker_id, p] : job.pending) {
      const int rank = r++;
      if (p.clock != ClockStart::kAtFirstBeat) continue;
      job.silence.Remove(rank);
      job.undelivered.insert(rank);
    }
    job.delivery_deadline = now + options_.answer_delivery_timeout;
  }

  if (previous_state == v1::DEGRADED) {
    log_->Log("recovery_rejoined",
              {{"job", job.id},
               {"generation", absl::StrCat(job.generation)},
               {"world_size", absl::StrCat(job.world_size, "/", job.target_world_size)},
               {"since_failure_ms", job.degraded_at == absl::InfinitePast()
                                        ? std::string("-1")
                                        : Ms(now - job.degraded_at)}});
  }
  job.degraded_at = absl::InfinitePast();
  job.goodput.Formed(job.generation, now);
  job.death_evidence = absl::InfiniteFuture();
  SaveGoodput(job, now, /*phase_changed=*/true);
  AnswerPendingJoins(job, deferred);
  for (MemberState& m : job.members) m.rejoins = std::max(0, ++job.joins[m.worker_id] - 1);
  log_->Log("ranks_assigned", {{"job", job.id},
                               {"generation", absl::StrCat(job.generation)},
                               {"world_size", absl::StrCat(job.world_size)}});
}

void Membership::AnswerPendingJoins(Job& job, Deferred& deferred) {
  v1::JoinResponse common;
  common.set_world_size(job.world_size);
  common.set_target_world_size(job.target_world_size);
  common.set_generation(job.generation);
  common.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  common.set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(options_.heartbeat_timeout));
  // Steps below it that the generation trains again are lost work (the
  // workers' time ledgers count them so).
  common.set_steps_done(job.goodput.steps_done());
  for (const MemberState& m : job.members) {
    v1::Member* out = common.add_members();
    out->set_rank(m.rank);
    out->set_worker_id(m.worker_id);
    out->set_host(m.host);
  }
  v1::JoinResponse without_table = common;
  without_table.clear_members();
  auto shared = std::make_shared<const v1::JoinResponse>(std::move(common));
  auto shared_without_table = std::make_shared<const v1::JoinResponse>(std::move(without_table));
  int r = 0;
  for (auto& [worker_id, p] : job.pending) {
    pending_by_id_.erase(p.id);
    std::string token = job.members[r].token;
    int member_rank = r++;
    auto base = p.skip_member_table ? shared_without_table : shared;
    deferred.push_back([base, token, member_rank, done = std::move(p.done)]() {
      v1::JoinResponse response = *base;
      response.set_rank(member_rank);
      response.set_token(token);
      done(std::move(response));
    });
  }
  job.pending.clear();
}

absl::Status Membership::StartGeneration(Job& job, int world_size, v1::JobState state,
                                         const std::string& reason, Deferred& deferred) {
  const int previous_world_size = job.world_size;
  const int64_t previous_generation = job.generation;
  const v1::JobState previous_state = job.state;
  // A formed job's pending joins are growers: the next generation has room.
  job.world_size = job.formed() && !job.pending.empty() ? job.WithGrowers(world_size) : world_size;
  job.generation++;
  job.state = state;
  Remember(job, reason);  // saved with the change
  absl::Status saved =
      SaveChange(job, absl::StrCat("job '", job.id, "' could not move to generation ",
                                   job.generation, " (", reason, ")"));
  if (!saved.ok()) {
    job.world_size = previous_world_size;
    job.generation = previous_generation;
    job.state = previous_state;
    job.history.pop_back();
    return saved;
  }
  AnnounceGeneration(job, previous_generation, reason, deferred);
  return absl::OkStatus();
}

void Membership::AnnounceGeneration(Job& job, int64_t old, const std::string& reason,
                                    Deferred& deferred) {
  // Joins pending for the old generation can never complete it. When the old
  // generation was formed, its pending joins are growers that join the next
  // one (world_size has room for them).
  const bool old_was_formed = job.members_generation == old && !job.members.empty();
  if (old_was_formed) EndGoodputGeneration(job, clock_->Now());
  for (auto& [worker_id, p] : job.pending) {
    if (old_was_formed) break;
    pending_by_id_.erase(p.id);
    deferred.push_back([done = std::move(p.done), id = job.id, old, reason]() {
      done(absl::AbortedError(absl::StrCat("job '", id, "' generation ", old, " was abandoned (",
                                           reason, "); join again")));
    });
  }
  if (!old_was_formed) job.pending.clear();
  log_->Log("generation_bumped", {{"job", job.id},
                                  {"from", absl::StrCat(old)},
                                  {"to", absl::StrCat(job.generation)},
                                  {"reason", reason}});
  if (listener_) {
    deferred.push_back(
        [listener = listener_, id = job.id, gen = job.generation]() { listener(id, gen); });
  }
}

bool Membership::ForgetIfIdle(Job& job, absl::Time now, Deferred& deferred) {
  const bool live = !job.pending.empty() || job.silence.size() > 0 || !job.undelivered.empty();
  if (live) {
    job.idle_since = absl::InfiniteFuture();
    return false;
  }
  if (job.idle_since == absl::InfiniteFuture()) job.idle_since = now;
  const bool never_formed = job.members.empty();
  if (!never_formed && now - job.idle_since < options_.job_ttl) return false;
  if (state_ != nullptr) {
    if (absl::Status s = state_->DeleteJob(job.id); !s.ok()) {
      // Kept, and tried again at the next tick.
      log_->Log("state_store_error", {{"job", job.id}, {"error", s.ToString()}});
      return false;
    }
  }
  log_->Log("job_forgotten",
            {{"job", job.id},
             {"generation", absl::StrCat(job.generation)},
             {"reason", never_formed ? "no pending join left" : "idle for --job_ttl"}});
  if (forget_listener_) {
    deferred.push_back([listener = forget_listener_, id = job.id] { listener(id); });
  }
  return true;
}

}  // namespace zeroshard
