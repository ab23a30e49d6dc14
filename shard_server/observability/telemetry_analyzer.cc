#include "shard_server/observability/telemetry_analyzer.h"

#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace zeroshard {
namespace {

enum Stream { kGathers = 0, kReductions = 1 };

Stream StreamOf(v1::CollectiveOp op) { return op == v1::ALL_GATHER ? kGathers : kReductions; }

const char* OpName(v1::CollectiveOp op) {
  switch (op) {
    case v1::ALL_GATHER:
      return "all_gather";
    case v1::REDUCE_SCATTER:
      return "reduce_scatter";
    case v1::ALL_REDUCE:
      return "all_reduce";
    default:
      return "collective";
  }
}

int64_t Entered(const v1::RankTelemetry& t, Stream stream) {
  return stream == kGathers ? t.gathers_entered() : t.reductions_entered();
}

std::string Describe(const v1::CollectiveInProgress& c) {
  return absl::StrCat(OpName(c.op()), " #", c.seq(), " (unit ", c.unit(), ")");
}

// "rank 2 (host/2)" or "ranks 2,5 (w2, w5)": worker ids of the first four.
std::string NameRanks(const std::vector<const v1::MemberStatus*>& members) {
  std::vector<int> ranks;
  std::vector<std::string> ids;
  for (const v1::MemberStatus* m : members) {
    ranks.push_back(m->rank());
    if (ids.size() < 4) ids.push_back(m->worker_id());
  }
  if (members.size() > ids.size()) ids.push_back("...");
  return absl::StrCat(members.size() == 1 ? "rank " : "ranks ", FormatRanks(ranks), " (",
                      absl::StrJoin(ids, ", "), ")");
}

std::string RanksOnly(const std::vector<const v1::MemberStatus*>& members) {
  std::vector<int> ranks;
  for (const v1::MemberStatus* m : members) ranks.push_back(m->rank());
  return absl::StrCat(members.size() == 1 ? "rank " : "ranks ", FormatRanks(ranks));
}

v1::Diagnosis Make(v1::Diagnosis::Kind kind, std::string message,
                   const std::vector<const v1::MemberStatus*>& named) {
  v1::Diagnosis d;
  d.set_kind(kind);
  d.set_message(std::move(message));
  for (const v1::MemberStatus* m : named) d.add_ranks(m->rank());
  return d;
}

std::string Key(const v1::Diagnosis& d) {
  return absl::StrCat(d.kind(), ":", absl::StrJoin(d.ranks(), ","));
}


// Members with a rank that are alive, have not left and have heartbeated.
std::vector<const v1::MemberStatus*> LiveMembers(const v1::JobStatus& job) {
  std::vector<const v1::MemberStatus*> live;
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() >= 0 && m.alive() && !m.left() && m.last_heartbeat_age_ms() >= 0) {
      live.push_back(&m);
    }
  }
  return live;
}

using Waiting = std::map<std::pair<int, int64_t>, std::vector<const v1::MemberStatus*>>;

// Ranks in flight, by the collective (stream, number) they wait in.
Waiting WaitingByCollective(const std::vector<const v1::MemberStatus*>& live) {
  Waiting waiting;
  for (const v1::MemberStatus* m : live) {
    const v1::RankTelemetry& t = m->telemetry();
    if (!t.has_in_progress() || t.in_progress().op() == v1::COLLECTIVE_OP_UNSPECIFIED) continue;
    waiting[{StreamOf(t.in_progress().op()), t.in_progress().seq()}].push_back(m);
  }
  return waiting;
}

struct HangCandidate {
  absl::Time started;  // when the first waiter entered the collective
  v1::Diagnosis diagnosis;
};

// Waiters under one collective number that are in different collectives:
// the ranks' schedules differ. Empty when they all wait in the same one.
std::optional<v1::Diagnosis> MixedCollectives(Stream stream, int64_t seq, double seconds,
                                              const std::vector<const v1::MemberStatus*>& waiters) {
  std::map<std::pair<int, std::string>, std::vector<const v1::MemberStatus*>> kinds;
  for (const v1::MemberStatus* w : waiters) {
    kinds[{w->telemetry().in_progress().op(), w->telemetry().in_progress().unit()}].push_back(w);
  }
  if (kinds.size() <= 1) return std::nullopt;
  std::vector<std::string> parts;
  for (const auto& [kind, ranks] : kinds) {
    parts.push_back(absl::StrCat(RanksOnly(ranks), " in ",
                                 OpName(static_cast<v1::CollectiveOp>(kind.first)), " (unit ",
                                 kind.second, ")"));
  }
  return Make(v1::Diagnosis::SCHEDULE_MISMATCH,
              absl::StrFormat("ranks disagree on the collective schedule: at %s #%d for %.1f s: %s",
                              stream == kGathers ? "all_gather" : "reduction", seq, seconds,
                              absl::StrJoin(parts, "; ")),
              waiters);
}

// Laggards that themselves wait in a collective the waiters have not
// entered: each side waits for the other.
std::vector<const v1::MemberStatus*> CrossedLaggards(
    const std::vector<const v1::MemberStatus*>& laggards,
    const std::vector<const v1::MemberStatus*>& waiters) {
  std::vector<const v1::MemberStatus*> crossed;
  for (const v1::MemberStatus* l : laggards) {
    const v1::RankTelemetry& t = l->telemetry();
    if (!t.has_in_progress()) continue;
    for (const v1::MemberStatus* w : waiters) {
      if (Entered(w->telemetry(), StreamOf(t.in_progress().op())) < t.in_progress().seq()) {
        crossed.push_back(l);
        break;
      }
    }
  }
  return crossed;
}

// What keeps the collective (stream, seq) from finishing, once it has been
// waited in for hang_report: ranks that disagree on the schedule, or the
// stalled ranks that have not entered it. Empty while nothing explains it.
std::optional<HangCandidate> DiagnoseCollective(
    Stream stream, int64_t seq, const std::vector<const v1::MemberStatus*>& waiters,
    const std::vector<const v1::MemberStatus*>& live,
    const std::vector<absl::Time>& progressed_at, absl::Time now,
    const TelemetryOptions& options) {
  absl::Time started = absl::InfiniteFuture();
  for (const v1::MemberStatus* w : waiters) {
    started = std::min(started, absl::FromUnixMillis(w->telemetry().in_progress().started_unix_ms()));
  }
  if (now - started < options.hang_report) return std::nullopt;
  const double seconds = absl::ToDoubleSeconds(now - started);
  if (std::optional<v1::Diagnosis> mixed = MixedCollectives(stream, seq, seconds, waiters)) {
    return HangCandidate{started, *std::move(mixed)};
  }
  auto stalled = [&](const v1::MemberStatus* m) {
    return m->rank() < static_cast<int>(progressed_at.size()) &&
           now - progressed_at[m->rank()] >= options.hang_report;
  };
  std::vector<const v1::MemberStatus*> laggards;
  for (const v1::MemberStatus* m : live) {
    if (Entered(m->telemetry(), stream) < seq && stalled(m)) laggards.push_back(m);
  }
  if (laggards.empty()) return std::nullopt;
  const v1::CollectiveInProgress& c = waiters.front()->telemetry().in_progress();
  const std::vector<const v1::MemberStatus*> crossed = CrossedLaggards(laggards, waiters);
  if (!crossed.empty()) {
    std::vector<const v1::MemberStatus*> named = crossed;
    named.insert(named.end(), waiters.begin(), waiters.end());
    return HangCandidate{
        started, Make(v1::Diagnosis::SCHEDULE_MISMATCH,
                      absl::StrFormat("ranks disagree on the collective schedule: %s %s in %s for "
                                      "%.1f s, which %s has not entered, while %s waits in %s",
                                      RanksOnly(waiters), waiters.size() == 1 ? "waits" : "wait",
                                      Describe(c), seconds, RanksOnly(crossed), RanksOnly(crossed),
                                      Describe(crossed.front()->telemetry().in_progress())),
                      named)};
  }
  return HangCandidate{
      started, Make(v1::Diagnosis::HANG,
                    absl::StrFormat("%s %s not entered %s for %.1f s; %s %s waiting in it",
                                    NameRanks(laggards), laggards.size() == 1 ? "has" : "have",
                                    Describe(c), seconds, RanksOnly(waiters),
                                    waiters.size() == 1 ? "is" : "are"),
                    laggards)};
}

// Ranks whose median lag to each step's first collective is over the
// straggler threshold (a fraction of their step time, with a floor).
std::vector<v1::Diagnosis> Stragglers(const std::vector<const v1::MemberStatus*>& live,
                                      const TelemetryOptions& options) {
  std::vector<v1::Diagnosis> out;
  for (const v1::MemberStatus* m : live) {
    const double median = m->telemetry().arrival_lag_median_ms();
    const double step_ms = m->last_step().step_ms();
    const double threshold = std::max(options.straggler_fraction * step_ms,
                                      absl::ToDoubleMilliseconds(options.straggler_floor));
    if (median < 0 || median <= threshold) continue;
    out.push_back(Make(v1::Diagnosis::STRAGGLER,
                       absl::StrFormat("rank %d (%s) is a straggler: it reaches each step's first "
                                       "collective %.0f ms after the first rank (median of the "
                                       "last 20 steps; its step takes %.0f ms)",
                                       m->rank(), m->worker_id(), median, step_ms),
                       {m}));
  }
  return out;
}

}  // namespace

std::string FormatRanks(std::vector<int> ranks, int max_runs) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<std::string> runs;
  size_t i = 0;
  int covered = 0;
  while (i < ranks.size() && static_cast<int>(runs.size()) < max_runs) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j == i + 1) {  // two in a row read better as a pair: "0,1"
      runs.push_back(absl::StrCat(ranks[i], ",", ranks[j]));
    } else {
      runs.push_back(j == i ? absl::StrCat(ranks[i]) : absl::StrCat(ranks[i], "-", ranks[j]));
    }
    covered += static_cast<int>(j - i + 1);
    i = j + 1;
  }
  std::string out = absl::StrJoin(runs, ",");
  if (i < ranks.size()) {
    absl::StrAppend(&out, " and ", static_cast<int>(ranks.size()) - covered, " more");
  }
  return out;
}

std::vector<v1::Diagnosis> TelemetryAnalyzer::Diagnose(
    const v1::JobStatus& job, const std::vector<absl::Time>& progressed_at, absl::Time now,
    const TelemetryOptions& options) {
  std::vector<v1::Diagnosis> out;
  if (job.state() != v1::RUNNING) return out;
  const std::vector<const v1::MemberStatus*> live = LiveMembers(job);
  // The collective waited in longest that has been waited in for
  // hang_report and explains itself: one hang diagnosis per job (the others
  // are usually its consequences).
  std::optional<HangCandidate> oldest;
  for (const auto& [key, waiters] : WaitingByCollective(live)) {
    std::optional<HangCandidate> c = DiagnoseCollective(static_cast<Stream>(key.first), key.second,
                                                        waiters, live, progressed_at, now, options);
    if (c.has_value() && (!oldest.has_value() || c->started < oldest->started)) oldest = c;
  }
  if (oldest.has_value()) out.push_back(oldest->diagnosis);
  for (v1::Diagnosis& d : Stragglers(live, options)) out.push_back(std::move(d));
  return out;
}

TelemetryAnalyzer::TelemetryAnalyzer(Clock* clock, EventLog* log, TelemetryOptions options)
    : clock_(clock), log_(log), options_(options) {}

void TelemetryAnalyzer::Analyze(const v1::GetStatusResponse& status) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  std::set<std::string> seen;
  for (const v1::JobStatus& job : status.jobs()) {
    seen.insert(job.job_id());
    JobState& state = jobs_[job.job_id()];
    if (state.generation != job.generation()) {
      // A new generation starts its diagnoses afresh; those of the old one
      // end with it, and say so.
      LogCleared(job.job_id(), state.diagnoses,
                 absl::StrCat("generation ", job.generation(), " began"));
      state = JobState();
      state.generation = job.generation();
    }
    std::vector<absl::Time> progressed_at(job.members_size(), now);
    for (const v1::MemberStatus& m : job.members()) {
      if (m.rank() < 0) continue;
      if (static_cast<int>(state.ranks.size()) <= m.rank()) state.ranks.resize(m.rank() + 1);
      if (static_cast<int>(progressed_at.size()) <= m.rank()) progressed_at.resize(m.rank() + 1, now);
      RankProgress& p = state.ranks[m.rank()];
      const v1::RankTelemetry& t = m.telemetry();
      if (p.gathers != t.gathers_entered() || p.reductions != t.reductions_entered()) {
        p = {t.gathers_entered(), t.reductions_entered(), now};
      }
      progressed_at[m.rank()] = p.since;
    }
    std::vector<v1::Diagnosis> found = Diagnose(job, progressed_at, now, options_);
    std::map<std::string, const v1::Diagnosis*> before;
    for (const v1::Diagnosis& d : state.diagnoses) before[Key(d)] = &d;
    for (v1::Diagnosis& d : found) {
      auto it = before.find(Key(d));
      if (it != before.end()) {
        d.set_since_unix_ms(it->second->since_unix_ms());
        before.erase(it);
        continue;
      }
      d.set_since_unix_ms(absl::ToUnixMillis(now));
      if (log_ != nullptr) {
        log_->Log(d.kind() == v1::Diagnosis::STRAGGLER           ? "straggler"
                  : d.kind() == v1::Diagnosis::SCHEDULE_MISMATCH ? "schedule_mismatch"
                                                                 : "hang",
                  {{"job", job.job_id()},
                   {"generation", absl::StrCat(job.generation())},
                   {"message", d.message()}});
      }
    }
    if (log_ != nullptr) {
      for (const auto& [key, d] : before) {
        log_->Log("diagnosis_cleared", {{"job", job.job_id()}, {"was", d->message()}});
      }
    }
    state.diagnoses = std::move(found);
  }
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (seen.count(it->first)) {
      ++it;
      continue;
    }
    LogCleared(it->first, it->second.diagnoses, "the job is gone");
    it = jobs_.erase(it);
  }
}

void TelemetryAnalyzer::LogCleared(const std::string& job,
                                   const std::vector<v1::Diagnosis>& diagnoses,
                                   const std::string& why) {
  if (log_ == nullptr) return;
  for (const v1::Diagnosis& d : diagnoses) {
    log_->Log("diagnosis_cleared", {{"job", job}, {"was", d.message()}, {"why", why}});
  }
}

void TelemetryAnalyzer::Annotate(v1::GetStatusResponse* status) const {
  absl::MutexLock lock(&mu_);
  for (v1::JobStatus& job : *status->mutable_jobs()) {
    auto it = jobs_.find(job.job_id());
    if (it == jobs_.end() || it->second.generation != job.generation()) continue;
    std::set<int> stragglers, hung;
    for (const v1::Diagnosis& d : it->second.diagnoses) {
      *job.add_diagnoses() = d;
      std::set<int>& flagged = d.kind() == v1::Diagnosis::STRAGGLER ? stragglers : hung;
      flagged.insert(d.ranks().begin(), d.ranks().end());
    }
    for (v1::MemberStatus& m : *job.mutable_members()) {
      m.set_straggler(stragglers.count(m.rank()) > 0);
      m.set_hung(hung.count(m.rank()) > 0);
    }
  }
}

}  // namespace zeroshard
