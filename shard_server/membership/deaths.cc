// Where a member is declared dead: which live members the timer judges,
// the failure detector's verdicts on them (failure_detector.h has the rules)
// and the doubts it logs.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "shard_server/membership/failure_detector.h"
#include "shard_server/membership/member_table.h"
#include "shard_server/membership/membership.h"

namespace zeroshard {

void Membership::MarkDead(Job& job, MemberState& m, absl::Time now, absl::string_view why,
                          std::string* dead) {
  const absl::Duration silent = now - m.last_heartbeat;
  m.alive = false;
  job.StopWatching(m.rank);
  absl::StrAppend(dead, dead->empty() ? "" : ", ", "worker '", m.worker_id, "' (rank ", m.rank,
                  ")");
  // A survivor of an abandoned generation that has joined the next one
  // beats no more in the old: not a death (status shows it rejoined).
  if (!job.formed() && job.pending.count(m.worker_id) > 0) return;
  log_->Log("member_dead", {{"job", job.id},
                            {"worker", m.worker_id},
                            {"rank", absl::StrCat(m.rank)},
                            {"generation", absl::StrCat(job.members_generation)},
                            {"silent_ms", Ms(silent)},
                            {"why", std::string(why)}});
}

bool Membership::DeclareDeaths(Job& job, absl::Time now, Deferred& deferred) {
  bool died = false;
  bool changed = false;
  std::string dead;  // who, for the generation's history
  // Who is dead: shard_server/membership/failure_detector.h has the rules.
  // Only those that may be dead: every other live member is alive
  // (failure_detector.h, JudgeMembers).
  const std::vector<MemberState*> live = MembersToJudge(job, now);
  const std::vector<MemberVerdict> verdicts = Verdicts(job, live, now);
  LogDoubts(job, std::vector<const MemberState*>(live.begin(), live.end()), verdicts);
  for (size_t i = 0; i < live.size(); ++i) {
    if (verdicts[i].verdict != Verdict::kDead) continue;
    if (job.formed()) {
      job.death_evidence = std::min(job.death_evidence, LastSignOfLife(job, *live[i], now));
    }
    MarkDead(job, *live[i], now, verdicts[i].why, &dead);
    changed = true;
    died = died || job.formed();
  }
  // A death stands whatever the disk says: applied now, saved when it can be.
  if (died) {
    const int64_t old = job.generation;
    job.world_size = job.WithGrowers(job.world_size);
    job.generation++;
    job.state = v1::DEGRADED;
    job.degraded_at = now;
    const std::string reason = absl::StrCat(dead, " stopped heartbeating");
    Remember(job, reason);
    AnnounceGeneration(job, old, reason, deferred);
    SaveOrMarkUnsaved(job, absl::StrCat("generation ", job.generation, " after a death"));
  } else if (changed) {
    // Survivors of an abandoned generation went silent.
    SaveOrMarkUnsaved(job, "members of an abandoned generation went silent");
  }
  return died;
}

std::vector<Membership::MemberState*> Membership::MembersToJudge(Job& job, absl::Time now) const {
  // Beyond this silence a member may be dead (rules 1 and 5); within it, a
  // member is alive unless its stream closed.
  absl::Duration may_be_dead = options_.heartbeat_timeout;
  // Rule 4b holds a member that may be dead while its silence is within
  // the timeout plus the server's lag since its last beat: of those only the
  // longest silent is judged, which is enough for the episode's log line. At
  // 100K ranks a server 2 s behind had tens of thousands of them, and
  // judging every one every tick (50 ms) kept it behind. Members after it
  // are less silent; the walk goes on only while one of them may have a
  // smaller allowance that makes it dead (its silence began after a worse
  // lag was over), and judges only those past their own allowance. That walk
  // passes every held member of the steps before such a one: O(held
  // members) per tick, a list hop and a binary search each (~1-3 ms for
  // 50K held), only while a lag's holds overlap a smaller later step.
  bool extended = true;
  if (job.formed() && job.suspect_generation == job.generation) {
    may_be_dead = std::min(may_be_dead, options_.heartbeat_interval * 1.5);
    extended = false;  // rule 1's shorter silence is not extended
  }
  std::vector<int> ranks;
  bool held_one = false;
  // The end of the allowance step whose later members were found possibly
  // dead: the same holds for every member of that step.
  absl::Time checked_until = absl::InfinitePast();
  for (int r = job.silence.Oldest(); r != -1; r = job.silence.Next(r)) {
    const absl::Time last_beat = job.members[r].last_heartbeat;
    const absl::Duration silent = now - last_beat;
    if (silent <= may_be_dead) break;
    if (!extended ||
        silent > may_be_dead +
                     ServerLagAllowance(server_lag_.AllowanceSince(last_beat), detector_options_)) {
      ranks.push_back(r);
      continue;
    }
    if (!held_one) ranks.push_back(r);
    held_one = true;
    if (last_beat > checked_until) {
      if (!server_lag_.LaterMayBeDead(last_beat, now, may_be_dead)) break;
      checked_until = server_lag_.StepEnd(last_beat);
    }
  }
  for (auto it = job.closed_streams.begin(); it != job.closed_streams.end();) {
    const MemberState& m = job.members[*it];
    if (!m.alive || m.left || m.stream_closed <= m.last_heartbeat) {
      job.closed_streams.erase(it++);  // beat again, or no longer judged
      continue;
    }
    ranks.push_back(*it);
    ++it;
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<MemberState*> members;
  members.reserve(ranks.size());
  for (int r : ranks) members.push_back(&job.members[r]);
  return members;
}

std::vector<MemberVerdict> Membership::Verdicts(const Job& job,
                                                const std::vector<MemberState*>& live,
                                                absl::Time now) const {
  const bool suspect = job.formed() && job.suspect_generation == job.generation;
  std::vector<MemberSignals> signals;
  signals.reserve(live.size());
  for (const MemberState* m : live) {
    signals.push_back(
        {m->last_heartbeat, m->stream_closed, server_lag_.AllowanceSince(m->last_heartbeat)});
  }
  const JobSignals job_signals{
      suspect, job.formed() ? job.data_plane_advanced : absl::InfinitePast(), job.formed(),
      job.silence.size() > 0 ? job.members[job.silence.Newest()].last_heartbeat
                             : absl::InfinitePast(),
      !job.formed() && !job.pending.empty()};
  return JudgeMembers(signals, job_signals, now, detector_options_);
}

void Membership::LogDoubts(Job& job, const std::vector<const MemberState*>& live,
                           const std::vector<MemberVerdict>& verdicts) {
  auto first = [&](Verdict v) {
    for (size_t i = 0; i < verdicts.size(); ++i) {
      if (verdicts[i].verdict == v) return static_cast<int>(i);
    }
    return -1;
  };
  const int isolated = first(Verdict::kIsolationSuspected);
  if ((isolated >= 0) != job.isolation_suspected) {
    job.isolation_suspected = isolated >= 0;
    if (isolated >= 0) {
      log_->Log("isolation_suspected", {{"job", job.id},
                                        {"generation", absl::StrCat(job.generation)},
                                        {"members", absl::StrCat(live.size())},
                                        {"why", verdicts[isolated].why}});
    } else {
      log_->Log("isolation_over", {{"job", job.id}, {"generation", absl::StrCat(job.generation)}});
    }
  }
  const int behind = first(Verdict::kServerBehind);
  if ((behind >= 0) != job.server_behind) {
    job.server_behind = behind >= 0;
    if (behind >= 0) {
      log_->Log("server_behind", {{"job", job.id},
                                  {"generation", absl::StrCat(job.generation)},
                                  {"worker", live[behind]->worker_id},
                                  {"why", verdicts[behind].why}});
    } else {
      log_->Log("server_behind_over", {{"job", job.id}});
    }
  }
  const int seen = first(Verdict::kSeenByPeers);
  if ((seen >= 0) != job.seen_by_peers) {
    job.seen_by_peers = seen >= 0;
    if (seen >= 0) {
      log_->Log("member_seen_by_peers", {{"job", job.id},
                                         {"worker", live[seen]->worker_id},
                                         {"rank", absl::StrCat(live[seen]->rank)},
                                         {"why", verdicts[seen].why}});
    } else {
      log_->Log("members_seen_by_peers_over", {{"job", job.id}});
    }
  }
}

void Membership::StartOverdueClocks(Job& job, absl::Time now) {
  if (job.undelivered.empty() || now < job.delivery_deadline) return;
  log_->Log("answers_undelivered", {{"job", job.id},
                                    {"generation", absl::StrCat(job.members_generation)},
                                    {"members", absl::StrCat(job.undelivered.size())},
                                    {"after_ms", Ms(options_.answer_delivery_timeout)}});
  std::vector<int> ranks(job.undelivered.begin(), job.undelivered.end());
  std::sort(ranks.begin(), ranks.end());
  for (int rank : ranks) job.StartClock(rank, now);
}

}  // namespace zeroshard
