#include "shard_server/observability/rank_views.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

namespace zeroshard {
namespace {

// Larger is worse; compared lexicographically.
auto Badness(const v1::MemberStatus& m) {
  return std::make_tuple(!(m.alive() && !m.left()), m.hung(), m.straggler(),
                         m.last_heartbeat_age_ms(),
                         static_cast<double>(m.telemetry().arrival_lag_median_ms()),
                         m.last_step().step_ms(), -m.rank());
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
  std::map<std::string, HostSummary> hosts;
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

}  // namespace zeroshard
