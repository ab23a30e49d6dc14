#include "shard_server/observability/rank_views.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace zeroshard {
namespace {

// Larger is worse; compared lexicographically.
auto Badness(const v1::MemberStatus& m) {
  return std::make_tuple(!(m.alive() && !m.left()), m.hung(), m.straggler(),
                         m.last_heartbeat_age_ms(),
                         static_cast<double>(m.telemetry().arrival_lag_median_ms()),
                         m.last_step().step_ms(), -m.rank());
}

auto HostBadness(const HostSummary& h) {
  return std::make_tuple(h.ranks - h.alive, h.stragglers, h.heartbeat_age_max, h.step_seconds_max,
                         h.step_min < 0 ? 0 : -h.step_min);
}

v1::HostStatus HostStatusOf(const HostSummary& h) {
  v1::HostStatus out;
  out.set_host(h.host);
  out.set_ranks(h.ranks);
  out.set_alive(h.alive);
  out.set_stragglers(h.stragglers);
  out.set_heartbeat_age_max_seconds(h.heartbeat_age_max);
  out.set_step_max_seconds(h.step_seconds_max);
  out.set_step_min(h.step_min);
  return out;
}

v1::JobSummary SummaryOf(const v1::JobStatus& job, int worst_hosts) {
  v1::JobSummary summary;
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() < 0) continue;
    summary.set_ranks(summary.ranks() + 1);
    summary.set_alive(summary.alive() + (m.alive() && !m.left()));
    summary.set_stragglers(summary.stragglers() + m.straggler());
    summary.set_hung(summary.hung() + m.hung());
  }
  std::vector<HostSummary> hosts = SummarizeHosts(job);
  summary.set_hosts(static_cast<int>(hosts.size()));
  KeepWorstHosts(&hosts, worst_hosts);
  for (const HostSummary& h : hosts) *summary.add_worst_hosts() = HostStatusOf(h);
  for (const RankHistogramSpec& spec : RankHistogramSpecs()) {
    const RankHistogram h = HistogramOverRanks(job, spec);
    v1::RankHistogram* out = summary.add_histograms();
    out->set_name(spec.name);
    out->mutable_bounds()->Add(h.bounds.begin(), h.bounds.end());
    out->mutable_counts()->Add(h.counts.begin(), h.counts.end());
    out->set_sum(h.sum);
    out->set_count(h.count);
  }
  return summary;
}

// The job's members that `request` lists, in the order it lists them.
std::vector<const v1::MemberStatus*> ListedMembers(const v1::JobStatus& job,
                                                   const v1::GetStatusRequest& request,
                                                   int* worst_listed) {
  std::vector<const v1::MemberStatus*> listed = WorstRanks(
      job, request.worst_ranks() > 0 ? request.worst_ranks() : kDefaultWorstRanks);
  *worst_listed = static_cast<int>(listed.size());
  const std::set<const v1::MemberStatus*> worst(listed.begin(), listed.end());
  const std::set<int> ranks(request.ranks().begin(), request.ranks().end());
  const std::set<std::string> hosts(request.hosts().begin(), request.hosts().end());
  for (const v1::MemberStatus& m : job.members()) {  // by rank
    if (m.rank() < 0 || worst.count(&m) > 0) continue;
    if (ranks.count(m.rank()) > 0 || hosts.count(m.host()) > 0) listed.push_back(&m);
  }
  return listed;
}

void SummarizeJob(const v1::GetStatusRequest& request, v1::JobStatus* job) {
  *job->mutable_summary() = SummaryOf(
      *job, request.worst_hosts() > 0 ? request.worst_hosts() : kDefaultWorstHosts);
  int worst_listed = 0;
  std::vector<const v1::MemberStatus*> listed = ListedMembers(*job, request, &worst_listed);
  job->mutable_summary()->set_worst_listed(worst_listed);
  google::protobuf::RepeatedPtrField<v1::MemberStatus> kept;
  kept.Reserve(static_cast<int>(listed.size()));
  for (const v1::MemberStatus* m : listed) *kept.Add() = std::move(*const_cast<v1::MemberStatus*>(m));
  job->mutable_members()->Swap(&kept);
}

}  // namespace

std::vector<const v1::MemberStatus*> WorstRanks(const v1::JobStatus& job, int n) {
  std::vector<const v1::MemberStatus*> ranked;
  ranked.reserve(job.members_size());
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() >= 0) ranked.push_back(&m);
  }
  const size_t keep = std::min(ranked.size(), static_cast<size_t>(std::max(0, n)));
  std::partial_sort(ranked.begin(), ranked.begin() + keep, ranked.end(),
                    [](const v1::MemberStatus* a, const v1::MemberStatus* b) {
                      return Badness(*a) > Badness(*b);
                    });
  ranked.resize(keep);
  return ranked;
}

std::vector<HostSummary> SummarizeHosts(const v1::JobStatus& job) {
  // A hash map, then one sort by name (a 100,000-rank job has 12,500 hosts).
  absl::flat_hash_map<std::string, HostSummary> hosts;
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() < 0) continue;
    HostSummary& h = hosts[m.host()];
    h.ranks++;
    h.alive += m.alive() && !m.left();
    h.stragglers += m.straggler();
    if (m.last_heartbeat_age_ms() >= 0) {
      h.heartbeat_age_max = std::max(h.heartbeat_age_max, m.last_heartbeat_age_ms() / 1e3);
    }
    if (m.last_step().step_ms() > 0) {
      h.step_seconds_max = std::max(h.step_seconds_max, m.last_step().step_ms() / 1e3);
    }
    h.step_min = h.step_min < 0 ? m.step() : std::min(h.step_min, m.step());
  }
  std::vector<HostSummary> out;
  out.reserve(hosts.size());
  for (auto& [name, h] : hosts) {
    h.host = name;
    out.push_back(std::move(h));
  }
  std::sort(out.begin(), out.end(),
            [](const HostSummary& a, const HostSummary& b) { return a.host < b.host; });
  return out;
}

void RankHistogram::Add(double value) {
  if (value < 0) return;
  const size_t bucket =
      std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin();  // value <= bound
  counts[bucket]++;
  sum += value;
  count++;
}

RankHistogram MakeRankHistogram(std::vector<double> bounds) {
  RankHistogram h;
  h.counts.assign(bounds.size() + 1, 0);
  h.bounds = std::move(bounds);
  return h;
}

const std::vector<RankHistogramSpec>& RankHistogramSpecs() {
  static const std::vector<RankHistogramSpec> specs = {
      {"step_seconds", "The ranks' last step times.",
       {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
       [](const v1::MemberStatus& m) {
         return m.last_step().step_ms() > 0 ? m.last_step().step_ms() / 1e3 : -1.0;
       }},
      {"heartbeat_age_seconds", "Time since each rank's last heartbeat.",
       {0.25, 0.5, 1, 2, 3, 5, 10, 30, 60},
       [](const v1::MemberStatus& m) {
         return m.last_heartbeat_age_ms() < 0 ? -1.0 : m.last_heartbeat_age_ms() / 1e3;
       }},
      {"arrival_lag_median_seconds",
       "The ranks' median arrival lag at each step's first collective (last 20 steps).",
       {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5},
       [](const v1::MemberStatus& m) {
         const double median = m.telemetry().arrival_lag_median_ms();
         return median < 0 ? -1.0 : median / 1e3;
       }},
  };
  return specs;
}

RankHistogram HistogramOverRanks(const v1::JobStatus& job, const RankHistogramSpec& spec) {
  RankHistogram h = MakeRankHistogram(spec.bounds);
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() >= 0 && m.alive() && !m.left()) h.Add(spec.value(m));
  }
  return h;
}

void KeepWorstHosts(std::vector<HostSummary>* hosts, int n) {
  const size_t keep = std::min(hosts->size(), static_cast<size_t>(std::max(0, n)));
  std::partial_sort(hosts->begin(), hosts->begin() + keep, hosts->end(),
                    [](const HostSummary& a, const HostSummary& b) {
                      const auto badness_a = HostBadness(a), badness_b = HostBadness(b);
                      return badness_a != badness_b ? badness_a > badness_b : a.host < b.host;
                    });
  hosts->resize(keep);
}

void SummarizeLargeJobs(const v1::GetStatusRequest& request, v1::GetStatusResponse* status) {
  if (request.max_members() <= 0) return;
  for (v1::JobStatus& job : *status->mutable_jobs()) {
    if (job.members_size() > request.max_members()) SummarizeJob(request, &job);
  }
}

}  // namespace zeroshard
